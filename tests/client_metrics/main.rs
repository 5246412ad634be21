//! The client layers' metrics and hooks, read from a recorder of the test's own after
//! scripted scenarios: a retry, a give-up, a budget refusal, a breaker opening and
//! refusing, a deadline expiry — on the separate layers and on `ClientLayers` alike —,
//! hedges and throttle rejections; and the attempt number every attempt carries.
//! Timing runs on tokio's paused clock with seeded randomness; every assertion is an
//! exact count.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub,
    dead_code
)]

mod hedge_and_throttle;
mod metric_names;
mod reqwest_form;
mod stack_counts;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use retrysafe::breaker::ResponseBody;
use retrysafe::breaker::{BreakerConfig, CircuitBreaker};
use retrysafe::observe::AttemptNumber;
use retrysafe::retry::{Backoff, Jitter};
use retrysafe::{
    CircuitBreakerLayer, ClientLayers, DeadlineLayer, RetryBudget, RetryBudgetLayer, RetryLayer,
    StandardRetryStrategy,
};
use retrysafe_test_support::forms::Form;
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Layer, ServiceBuilder};

type Stack =
    BoxCloneSyncService<Request<Full<Bytes>>, Response<ResponseBody<Full<Bytes>>>, BoxError>;

/// What the scripted transport answers next.
#[derive(Debug, Clone, Copy)]
enum Answer {
    Status(u16),
    /// A 503 asking to wait this long (`retry-after`, in seconds).
    Pushback(u64),
    /// Answers `status` after `delay`.
    Slow(Duration, u16),
    /// No answer: the connection was reset.
    Reset,
}

/// A transport answering from a script (200 once it runs out), noting the attempt number
/// of every request it gets.
#[derive(Clone, Default)]
struct Script {
    answers: Arc<Mutex<VecDeque<Answer>>>,
    attempts: Arc<Mutex<Vec<Option<u32>>>>,
}

impl Script {
    fn new(answers: &[Answer]) -> Self {
        Script {
            answers: Arc::new(Mutex::new(answers.iter().copied().collect())),
            attempts: Arc::default(),
        }
    }

    fn attempts(&self) -> Vec<Option<u32>> {
        self.attempts.lock().unwrap().clone()
    }

    fn service<B: Send + 'static>(
        &self,
    ) -> impl tower::Service<
        Request<B>,
        Response = Response<Full<Bytes>>,
        Error = BoxError,
        Future = impl Send,
    > + Clone
    + Send
    + Sync
    + 'static {
        let script = self.clone();
        tower::service_fn(move |request: Request<B>| {
            let script = script.clone();
            async move {
                let attempt = AttemptNumber::of(request.extensions()).map(AttemptNumber::get);
                script.attempts.lock().unwrap().push(attempt);
                let answer = script.answers.lock().unwrap().pop_front();
                let mut response = Response::new(Full::new(Bytes::new()));
                *response.status_mut() = match answer.unwrap_or(Answer::Status(200)) {
                    Answer::Status(status) => StatusCode::from_u16(status).unwrap(),
                    Answer::Pushback(seconds) => {
                        response.headers_mut().insert("retry-after", seconds.into());
                        StatusCode::SERVICE_UNAVAILABLE
                    }
                    Answer::Slow(delay, status) => {
                        tokio::time::sleep(delay).await;
                        StatusCode::from_u16(status).unwrap()
                    }
                    Answer::Reset => {
                        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
                        return Err(BoxError::from(reset));
                    }
                };
                Ok::<_, BoxError>(response)
            }
        })
    }
}

/// A strategy of `attempts` attempts with a short seeded backoff, charging `budget`.
fn strategy(attempts: u32, budget: &RetryBudget) -> StandardRetryStrategy {
    StandardRetryStrategy::new()
        .max_attempts(attempts)
        .backoff(Backoff::new(
            Duration::from_millis(1),
            Duration::from_millis(5),
            Jitter::Full,
        ))
        .budget(budget.clone())
        .seed(7)
}

/// The standard stack named `api` over `script`, in `form`: deadline `timeout`, the
/// retry layer `retry` (given its strategy here), `budget`, `breaker`.
fn stack(
    form: Form,
    script: &Script,
    retry: RetryLayer,
    strategy: StandardRetryStrategy,
    budget: RetryBudget,
    breaker: CircuitBreaker,
    timeout: Duration,
) -> Stack {
    match form {
        Form::Separate => BoxCloneSyncService::new(
            ServiceBuilder::new()
                .layer(DeadlineLayer::new(timeout).name("api"))
                .layer(retry.name("api").strategy(strategy))
                .layer(RetryBudgetLayer::new(budget))
                .layer(CircuitBreakerLayer::new(breaker))
                .service(script.service()),
        ),
        // Named first: the retry layer given after takes the stack's name.
        Form::Fused => BoxCloneSyncService::new(
            ClientLayers::new()
                .name("api")
                .deadline(timeout)
                .retry(retry.strategy(strategy))
                .budget(budget)
                .breaker(CircuitBreakerLayer::new(breaker))
                .layer(script.service()),
        ),
    }
}

fn get() -> Request<Full<Bytes>> {
    Request::get("http://api.test/items")
        .body(Full::new(Bytes::new()))
        .unwrap()
}

fn budget() -> RetryBudget {
    RetryBudget::ratio().with_name("api-budget")
}

fn breaker() -> CircuitBreaker {
    CircuitBreaker::new(BreakerConfig::default().with_name("api-breaker"))
}

const MINUTE: Duration = Duration::from_secs(60);
