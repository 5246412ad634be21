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

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use retrysafe::breaker::ResponseBody;
use retrysafe::core::backoff::{Backoff, Jitter};
use retrysafe::core::breaker::{BreakerConfig, CircuitBreaker, SlidingWindow, State};
use retrysafe::core::budget::RatioConfig;
use retrysafe::core::error::{CircuitOpen, DeadlineExceeded, Throttled, find};
use retrysafe::core::strategy::GiveUp;
use retrysafe::core::{Deadline, DeadlineExpiry};
use retrysafe::hedge::HedgeOutcome;
use retrysafe::observe::{AttemptNumber, names};
use retrysafe::{
    AdaptiveThrottleLayer, CircuitBreakerLayer, ClientLayers, DeadlineLayer, HedgeLayer,
    RetryBudget, RetryBudgetLayer, RetryLayer, StandardRetryStrategy,
};
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Layer, ServiceBuilder, ServiceExt};

use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::Form;
use retrysafe_test_support::observe::Recorder;

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

async fn a_retry_counts_each_attempt_and_the_retry_by_reason(form: Form) {
    let recorder = Recorder::new();
    let script = Script::new(&[
        Answer::Pushback(1),
        Answer::Status(503),
        Answer::Status(200),
    ]);
    let retries = Arc::new(Mutex::new(Vec::new()));
    let seen = retries.clone();
    let client = recorder.build(|| {
        let budget = budget();
        let retry = RetryLayer::new().on_retry(move |e| seen.lock().unwrap().push(e.clone()));
        stack(
            form,
            &script,
            retry,
            strategy(3, &budget),
            budget,
            breaker(),
            MINUTE,
        )
    });

    let response = client.oneshot(get()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(script.attempts(), [None, Some(2), Some(3)]);

    let m = recorder.read();
    let attempts = names::CLIENT_ATTEMPTS_TOTAL;
    let retried = names::CLIENT_RETRIES_TOTAL;
    assert_eq!(
        m.counter(attempts, &[("name", "api"), ("outcome", "failure")]),
        2
    );
    assert_eq!(
        m.counter(attempts, &[("name", "api"), ("outcome", "success")]),
        1
    );
    assert_eq!(m.total(attempts), 3);
    assert_eq!(
        m.counter(retried, &[("name", "api"), ("reason", "pushback")]),
        1
    );
    assert_eq!(
        m.counter(retried, &[("name", "api"), ("reason", "status")]),
        1
    );
    assert_eq!(m.total(retried), 2);
    assert_eq!(m.total(names::BUDGET_REFUSALS_TOTAL), 0);
    // Renamed parts leave no series behind under the name `default`.
    assert!(m.names_with_label("name", "default").is_empty());
    // Every part's series are there from the start.
    assert!(m.has(names::BUDGET_REFUSALS_TOTAL, &[("name", "api-budget")]));
    assert!(m.has(names::DEADLINE_EXCEEDED_TOTAL, &[("name", "api")]));
    assert_eq!(
        m.gauge(names::BREAKER_STATE, &[("name", "api-breaker")]),
        Some(0.0)
    );
    let retries = retries.lock().unwrap();
    assert_eq!(retries.len(), 2);
    assert!(retries.iter().all(|e| e.name.as_str() == "api"));
    assert_eq!(
        retries.iter().map(|e| e.attempt).collect::<Vec<_>>(),
        [2, 3]
    );
}

async fn a_give_up_counts_every_failed_attempt_and_calls_the_hook_with_the_name(form: Form) {
    let recorder = Recorder::new();
    let script = Script::new(&[Answer::Status(503), Answer::Status(503)]);
    let give_ups = Arc::new(Mutex::new(Vec::new()));
    let seen = give_ups.clone();
    let client = recorder.build(|| {
        let budget = budget();
        let retry = RetryLayer::new().on_give_up(move |e| seen.lock().unwrap().push(e.clone()));
        stack(
            form,
            &script,
            retry,
            strategy(2, &budget),
            budget,
            breaker(),
            MINUTE,
        )
    });

    let response = client.oneshot(get()).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()["do-not-retry"], "1");
    assert_eq!(script.attempts(), [None, Some(2)]);

    let m = recorder.read();
    let attempts = names::CLIENT_ATTEMPTS_TOTAL;
    assert_eq!(
        m.counter(attempts, &[("name", "api"), ("outcome", "failure")]),
        2
    );
    assert_eq!(m.total(attempts), 2);
    assert_eq!(
        m.counter(
            names::CLIENT_RETRIES_TOTAL,
            &[("name", "api"), ("reason", "status")]
        ),
        1
    );
    assert_eq!(m.total(names::CLIENT_RETRIES_TOTAL), 1);
    let give_ups = give_ups.lock().unwrap();
    assert_eq!(give_ups.len(), 1);
    assert_eq!(give_ups[0].name.as_str(), "api");
    assert_eq!(give_ups[0].attempts, 2);
    assert_eq!(give_ups[0].reason, GiveUp::AttemptsExhausted);
}

async fn a_budget_refusal_counts_under_the_budget_name(form: Form) {
    let recorder = Recorder::new();
    let script = Script::new(&[Answer::Status(503)]);
    let refusals = Arc::new(Mutex::new(Vec::new()));
    let seen = refusals.clone();
    let client = recorder.build(|| {
        // No reserve, and one deposit: not even one retry is affordable.
        let budget = RetryBudget::ratio_with(RatioConfig::default().with_min_per_sec(0))
            .with_name("api-budget")
            .with_on_refusal(move |r| seen.lock().unwrap().push(r.name.to_string()));
        stack(
            form,
            &script,
            RetryLayer::new(),
            strategy(3, &budget),
            budget,
            breaker(),
            MINUTE,
        )
    });

    let response = client.oneshot(get()).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(script.attempts(), [None]);

    let m = recorder.read();
    assert_eq!(
        m.counter(names::BUDGET_REFUSALS_TOTAL, &[("name", "api-budget")]),
        1
    );
    assert_eq!(m.total(names::BUDGET_REFUSALS_TOTAL), 1);
    assert_eq!(
        m.counter(
            names::CLIENT_ATTEMPTS_TOTAL,
            &[("name", "api"), ("outcome", "failure")]
        ),
        1
    );
    assert_eq!(m.total(names::CLIENT_RETRIES_TOTAL), 0);
    assert_eq!(*refusals.lock().unwrap(), ["api-budget"]);
}

async fn an_open_breaker_refuses_counts_and_reports_its_state(form: Form) {
    let recorder = Recorder::new();
    let script = Script::new(&[Answer::Status(500), Answer::Status(500)]);
    let changes = Arc::new(Mutex::new(Vec::new()));
    let rejections = Arc::new(Mutex::new(Vec::new()));
    let (c, r) = (changes.clone(), rejections.clone());
    let client = recorder.build(|| {
        let budget = budget();
        let breaker = CircuitBreaker::new(
            BreakerConfig::default()
                .with_name("api-breaker")
                .with_window(SlidingWindow::count(2, 1))
                .with_minimum_calls(2)
                .with_open_duration(MINUTE)
                .with_on_state_change(move |change| {
                    c.lock()
                        .unwrap()
                        .push((change.name.to_string(), change.from, change.to));
                })
                .with_on_rejection(move |rejection| {
                    r.lock()
                        .unwrap()
                        .push((rejection.name.to_string(), rejection.state));
                }),
        );
        stack(
            form,
            &script,
            RetryLayer::new(),
            strategy(1, &budget),
            budget,
            breaker,
            MINUTE,
        )
    });

    for _ in 0..2 {
        let response = client.clone().oneshot(get()).await.unwrap();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
    let refused = client.clone().oneshot(get()).await.unwrap_err();
    assert!(find::<CircuitOpen>(&*refused).is_some(), "{refused}");
    assert_eq!(script.attempts().len(), 2);

    let m = recorder.read();
    assert_eq!(
        m.counter(names::BREAKER_REJECTIONS_TOTAL, &[("name", "api-breaker")]),
        1
    );
    assert_eq!(m.total(names::BREAKER_REJECTIONS_TOTAL), 1);
    assert_eq!(
        m.gauge(names::BREAKER_STATE, &[("name", "api-breaker")]),
        Some(2.0)
    );
    assert_eq!(
        *changes.lock().unwrap(),
        [("api-breaker".to_owned(), State::Closed, State::Open)]
    );
    assert_eq!(
        *rejections.lock().unwrap(),
        [("api-breaker".to_owned(), State::Open)]
    );
}

async fn a_deadline_expiry_counts_once_under_the_stack_name(form: Form) {
    let recorder = Recorder::new();
    let script = Script::new(&[Answer::Slow(Duration::from_secs(1), 200)]);
    let client = recorder.build(|| {
        let budget = budget();
        stack(
            form,
            &script,
            RetryLayer::new(),
            strategy(3, &budget),
            budget,
            breaker(),
            Duration::from_millis(100),
        )
    });

    let error = client.oneshot(get()).await.unwrap_err();
    assert!(find::<DeadlineExceeded>(&*error).is_some(), "{error}");

    let m = recorder.read();
    assert_eq!(
        m.counter(names::DEADLINE_EXCEEDED_TOTAL, &[("name", "api")]),
        1
    );
    assert_eq!(m.total(names::DEADLINE_EXCEEDED_TOTAL), 1);
}

/// An attempt without an answer is an `error` and its retry's reason too; a 4xx is not
/// retried: `rejected`.
async fn an_error_and_a_rejection_count_by_outcome_and_reason(form: Form) {
    let recorder = Recorder::new();
    let script = Script::new(&[Answer::Reset, Answer::Status(400)]);
    let client = recorder.build(|| {
        let budget = budget();
        let retry = RetryLayer::new();
        let strategy = strategy(3, &budget);
        stack(form, &script, retry, strategy, budget, breaker(), MINUTE)
    });

    let response = client.oneshot(get()).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(script.attempts(), [None, Some(2)]);

    let m = recorder.read();
    let attempts = names::CLIENT_ATTEMPTS_TOTAL;
    let retried = names::CLIENT_RETRIES_TOTAL;
    assert_eq!(
        m.counter(attempts, &[("name", "api"), ("outcome", "error")]),
        1
    );
    assert_eq!(
        m.counter(attempts, &[("name", "api"), ("outcome", "rejected")]),
        1
    );
    assert_eq!(m.total(attempts), 2);
    assert_eq!(
        m.counter(retried, &[("name", "api"), ("reason", "error")]),
        1
    );
    assert_eq!(m.total(retried), 1);
}

/// After its open duration, the call that probes a breaker makes it half-open: the
/// gauge reads 1 while the probe is out.
async fn a_probing_breaker_reports_half_open(form: Form) {
    let recorder = Recorder::new();
    let script = Script::new(&[
        Answer::Status(500),
        Answer::Status(500),
        Answer::Slow(Duration::from_secs(1), 200),
    ]);
    let client = recorder.build(|| {
        let budget = budget();
        let breaker = CircuitBreaker::new(
            BreakerConfig::default()
                .with_name("api-breaker")
                .with_window(SlidingWindow::count(2, 1))
                .with_minimum_calls(2)
                .with_open_duration(MINUTE),
        );
        let strategy = strategy(1, &budget);
        stack(
            form,
            &script,
            RetryLayer::new(),
            strategy,
            budget,
            breaker,
            MINUTE * 2,
        )
    });
    let state = || {
        let m = recorder.read();
        m.gauge(names::BREAKER_STATE, &[("name", "api-breaker")])
    };
    for _ in 0..2 {
        client.clone().oneshot(get()).await.unwrap();
    }
    assert_eq!(state(), Some(2.0), "open");

    tokio::time::advance(MINUTE).await;
    let probe = tokio::spawn(client.oneshot(get()));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(state(), Some(1.0), "half-open while the probe is out");
    assert_eq!(probe.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(script.attempts().len(), 3);
}

/// The names the `on_expiry` hook heard.
type Expiries = Arc<Mutex<Vec<String>>>;

fn hear_expiries() -> (Expiries, impl Fn(&DeadlineExpiry) + Send + Sync + 'static) {
    let heard = Expiries::default();
    let seen = heard.clone();
    (heard, move |e: &DeadlineExpiry| {
        seen.lock().unwrap().push(e.name.to_string());
    })
}

/// The hook hears each expiry once, with the stack's name: the deadline cutting a call
/// short in a slow attempt, and a call that finds its deadline spent.
async fn the_expiry_hook_hears_each_expiry_once_with_the_name(form: Form) {
    let recorder = Recorder::new();
    let script = Script::new(&[Answer::Slow(Duration::from_secs(1), 200)]);
    let (heard, hook) = hear_expiries();
    let timeout = Duration::from_millis(100);
    let client: Stack = recorder.build(|| {
        let budget = budget();
        let retry = RetryLayer::new().strategy(strategy(3, &budget));
        match form {
            Form::Separate => BoxCloneSyncService::new(
                ServiceBuilder::new()
                    .layer(DeadlineLayer::new(timeout).name("api").on_expiry(hook))
                    .layer(retry.name("api"))
                    .layer(RetryBudgetLayer::new(budget))
                    .layer(CircuitBreakerLayer::new(breaker()))
                    .service(script.service()),
            ),
            Form::Fused => BoxCloneSyncService::new(
                ClientLayers::new()
                    .name("api")
                    .deadline(timeout)
                    .on_expiry(hook)
                    .retry(retry)
                    .budget(budget)
                    .breaker(CircuitBreakerLayer::new(breaker()))
                    .layer(script.service()),
            ),
        }
    });

    let error = client.clone().oneshot(get()).await.unwrap_err();
    assert!(find::<DeadlineExceeded>(&*error).is_some(), "{error}");
    assert_eq!(*heard.lock().unwrap(), ["api"]);
    let mut spent = get();
    spent
        .extensions_mut()
        .insert(Deadline::at(tokio::time::Instant::now()));
    let error = client.oneshot(spent).await.unwrap_err();
    assert!(find::<DeadlineExceeded>(&*error).is_some(), "{error}");
    assert_eq!(script.attempts().len(), 1, "no attempt past the deadline");

    assert_eq!(*heard.lock().unwrap(), ["api", "api"]);
    let m = recorder.read();
    assert_eq!(
        m.counter(names::DEADLINE_EXCEEDED_TOTAL, &[("name", "api")]),
        2
    );
    assert_eq!(m.total(names::DEADLINE_EXCEEDED_TOTAL), 2);
}

both_forms!(
    a_retry_counts_each_attempt_and_the_retry_by_reason,
    start_paused = true
);
both_forms!(
    a_give_up_counts_every_failed_attempt_and_calls_the_hook_with_the_name,
    start_paused = true
);
both_forms!(
    a_budget_refusal_counts_under_the_budget_name,
    start_paused = true
);
both_forms!(
    an_open_breaker_refuses_counts_and_reports_its_state,
    start_paused = true
);
both_forms!(
    a_deadline_expiry_counts_once_under_the_stack_name,
    start_paused = true
);
both_forms!(
    the_expiry_hook_hears_each_expiry_once_with_the_name,
    start_paused = true
);
both_forms!(
    an_error_and_a_rejection_count_by_outcome_and_reason,
    start_paused = true
);
both_forms!(a_probing_breaker_reports_half_open, start_paused = true);

/// Breakers per authority count their rejections under their configuration's name,
/// with no label per key, and report no state gauge.
#[tokio::test(start_paused = true)]
async fn keyed_breakers_count_rejections_under_the_configurations_name() {
    use retrysafe::breaker::KeyedBreakers;

    let recorder = Recorder::new();
    let script = Script::new(&[Answer::Status(500), Answer::Status(500)]);
    let rejected = Arc::new(Mutex::new(Vec::new()));
    let seen = rejected.clone();
    let client = recorder.build(|| {
        let config = BreakerConfig::default()
            .with_name("per-host")
            .with_window(SlidingWindow::count(2, 1))
            .with_minimum_calls(2)
            .with_open_duration(MINUTE)
            .with_on_rejection(move |r| seen.lock().unwrap().push(r.name.to_string()));
        let budget = budget();
        ServiceBuilder::new()
            .layer(RetryLayer::new().strategy(strategy(1, &budget)))
            .layer(CircuitBreakerLayer::keyed(KeyedBreakers::per_authority(
                config,
            )))
            .service(script.service::<retrysafe::ReplayBody<Full<Bytes>>>())
    });
    let to = |host: &str| {
        Request::get(format!("http://{host}/items"))
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    for _ in 0..2 {
        let response = client.clone().oneshot(to("a.test")).await.unwrap();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
    let refused = client.clone().oneshot(to("a.test")).await.unwrap_err();
    assert!(find::<CircuitOpen>(&*refused).is_some(), "{refused}");
    let other = client.clone().oneshot(to("b.test")).await.unwrap();
    assert_eq!(
        other.status(),
        StatusCode::OK,
        "another host's breaker is closed"
    );

    let m = recorder.read();
    let rejections = names::BREAKER_REJECTIONS_TOTAL;
    assert_eq!(m.counter(rejections, &[("name", "per-host")]), 1);
    assert_eq!(m.total(rejections), 1, "no series per key");
    assert_eq!(m.label_keys(rejections), ["name"]);
    assert_eq!(m.gauge(names::BREAKER_STATE, &[("name", "per-host")]), None);
    assert!(m.label_keys(names::BREAKER_STATE).is_empty());
    assert_eq!(*rejected.lock().unwrap(), ["per-host"]);
}

/// `ClientLayers::name` names the parts it made itself: the retry layer, the budget and
/// the breaker.
#[tokio::test(start_paused = true)]
async fn client_layers_name_their_own_parts() {
    let recorder = Recorder::new();
    let script = Script::new(&[
        Answer::Status(503),
        Answer::Status(503),
        Answer::Status(503),
    ]);
    let client = recorder.build(|| ClientLayers::new().name("svc").layer(script.service()));

    let response = client.oneshot(get()).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(script.attempts(), [None, Some(2), Some(3)]);

    let m = recorder.read();
    assert_eq!(
        m.counter(
            names::CLIENT_ATTEMPTS_TOTAL,
            &[("name", "svc"), ("outcome", "failure")]
        ),
        3
    );
    assert_eq!(
        m.counter(
            names::CLIENT_RETRIES_TOTAL,
            &[("name", "svc"), ("reason", "status")]
        ),
        2
    );
    assert_eq!(m.gauge(names::BREAKER_STATE, &[("name", "svc")]), Some(0.0));
    // Nothing is left behind under the name the stack had before it was named.
    assert_eq!(m.gauge(names::BREAKER_STATE, &[("name", "default")]), None);
    assert_eq!(
        m.counter(names::BUDGET_REFUSALS_TOTAL, &[("name", "svc")]),
        0
    );
    let defaults: Vec<_> = m.names_with_label("name", "default");
    assert!(defaults.is_empty(), "{defaults:?}");
}

/// The stack behind a hedge layer named `h`: a retry layer of one attempt.
fn hedged(
    recorder: &Recorder,
    script: &Script,
    layer: impl FnOnce() -> HedgeLayer,
) -> BoxCloneSyncService<Request<Full<Bytes>>, Response<Full<Bytes>>, BoxError> {
    recorder.build(|| {
        BoxCloneSyncService::new(
            ServiceBuilder::new()
                .layer(layer())
                .layer(RetryLayer::new().strategy(StandardRetryStrategy::new().max_attempts(1)))
                .service(script.service()),
        )
    })
}

#[tokio::test(start_paused = true)]
async fn hedges_count_as_won_lost_and_refused_and_carry_their_attempt_number() {
    let recorder = Recorder::new();
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let seen = outcomes.clone();
    // The first copy is slow: the hedge sent after 10 ms wins.
    let script = Script::new(&[
        Answer::Slow(Duration::from_millis(100), 200),
        Answer::Status(200),
        // Then the first copy wins over a slower hedge.
        Answer::Slow(Duration::from_millis(20), 200),
        Answer::Slow(Duration::from_millis(100), 200),
    ]);
    let client = hedged(&recorder, &script, || {
        HedgeLayer::new()
            .name("h")
            .delay(Duration::from_millis(10))
            .on_hedge(move |e| seen.lock().unwrap().push((e.name.to_string(), e.outcome)))
    });
    for _ in 0..2 {
        let response = client.clone().oneshot(get()).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    assert_eq!(script.attempts(), [Some(1), Some(2), Some(1), Some(2)]);

    // A budget with nothing to spend refuses the hedge.
    let refusing = Script::new(&[Answer::Slow(Duration::from_millis(100), 200)]);
    let seen = outcomes.clone();
    let client = hedged(&recorder, &refusing, || {
        HedgeLayer::new()
            .name("h")
            .delay(Duration::from_millis(10))
            .budget(RetryBudget::ratio_with(
                RatioConfig::default().with_min_per_sec(0),
            ))
            .on_hedge(move |e| seen.lock().unwrap().push((e.name.to_string(), e.outcome)))
    });
    let response = client.oneshot(get()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(refusing.attempts(), [Some(1)]);

    let m = recorder.read();
    let hedges = names::HEDGES_TOTAL;
    assert_eq!(m.counter(hedges, &[("name", "h"), ("outcome", "won")]), 1);
    assert_eq!(m.counter(hedges, &[("name", "h"), ("outcome", "lost")]), 1);
    assert_eq!(
        m.counter(hedges, &[("name", "h"), ("outcome", "refused")]),
        1
    );
    assert_eq!(m.total(hedges), 3);
    let h = || "h".to_owned();
    assert_eq!(
        *outcomes.lock().unwrap(),
        [
            (h(), HedgeOutcome::Won),
            (h(), HedgeOutcome::Lost),
            (h(), HedgeOutcome::Refused)
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn throttle_rejections_count_each_local_refusal() {
    let recorder = Recorder::new();
    let hooked = Arc::new(Mutex::new(0u64));
    let seen = hooked.clone();
    // Overloaded: every call that gets through is answered 503.
    let answers = vec![Answer::Status(503); 200];
    let script = Script::new(&answers);
    let client = recorder.build(|| {
        ServiceBuilder::new()
            .layer(
                AdaptiveThrottleLayer::new()
                    .name("t")
                    .seed(1)
                    .on_rejection(move |r| {
                        assert_eq!(r.name.as_str(), "t");
                        *seen.lock().unwrap() += 1;
                    }),
            )
            .service(script.service::<Full<Bytes>>())
    });
    let mut throttled = 0;
    for _ in 0..100 {
        if let Err(error) = client.clone().oneshot(get()).await {
            assert!(find::<Throttled>(&*error).is_some(), "{error}");
            throttled += 1;
        }
    }
    assert!(throttled > 0, "an overloaded callee is throttled locally");
    assert_eq!(script.attempts().len(), 100 - throttled);

    let m = recorder.read();
    let counted = m.counter(names::THROTTLE_REJECTIONS_TOTAL, &[("name", "t")]);
    assert_eq!(counted, u64::try_from(throttled).unwrap());
    assert_eq!(*hooked.lock().unwrap(), counted);
}

#[tokio::test(start_paused = true)]
async fn without_a_name_every_metric_is_named_default() {
    let recorder = Recorder::new();
    let script = Script::new(&[Answer::Status(503), Answer::Status(200)]);
    let client = recorder.build(|| {
        ServiceBuilder::new()
            .layer(RetryLayer::new().strategy(StandardRetryStrategy::new().seed(1)))
            .service(script.service())
    });
    client.oneshot(get()).await.unwrap();
    let m = recorder.read();
    let attempts = names::CLIENT_ATTEMPTS_TOTAL;
    assert_eq!(
        m.counter(attempts, &[("name", "default"), ("outcome", "failure")]),
        1
    );
    assert_eq!(
        m.counter(attempts, &[("name", "default"), ("outcome", "success")]),
        1
    );
}

/// The reqwest form, over loopback: a server answering from a script (200 once it runs
/// out; `0` means: answer 200 after 1 s).
mod reqwest_form {
    use super::*;
    use axum::Router;
    use reqwest_middleware::ClientWithMiddleware;
    use retrysafe::core::strategy::GiveUp;
    use retrysafe::reqwest::{CircuitBreakerMiddleware, ClientMiddlewares, RetryMiddleware};

    async fn scripted(answers: &[u16]) -> String {
        let script = Arc::new(Mutex::new(answers.iter().copied().collect::<VecDeque<_>>()));
        let app = Router::new().route(
            "/items",
            axum::routing::get(move || {
                let next = script.lock().unwrap().pop_front();
                async move {
                    match next {
                        Some(0) => {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            StatusCode::OK
                        }
                        Some(status) => StatusCode::from_u16(status).unwrap(),
                        None => StatusCode::OK,
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}/items")
    }

    fn client(
        recorder: &Recorder,
        stack: impl FnOnce() -> ClientMiddlewares,
    ) -> ClientWithMiddleware {
        recorder.build(|| stack().client(reqwest::Client::new()))
    }

    /// A retry middleware of `attempts` attempts with a short seeded backoff.
    fn retry(attempts: u32) -> RetryMiddleware {
        let budget = RetryBudget::ratio();
        RetryMiddleware::new().strategy(strategy(attempts, &budget))
    }

    #[tokio::test]
    async fn a_retry_then_a_give_up() {
        let recorder = Recorder::new();
        let give_ups = Arc::new(Mutex::new(Vec::new()));
        let seen = give_ups.clone();
        let client = client(&recorder, || {
            ClientMiddlewares::new()
                .name("rq")
                .retry(retry(2).on_give_up(move |e| seen.lock().unwrap().push(e.clone())))
        });
        let url = scripted(&[503, 200, 503, 503]).await;
        assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
        assert_eq!(client.get(&url).send().await.unwrap().status(), 503);

        let m = recorder.read();
        let attempts = names::CLIENT_ATTEMPTS_TOTAL;
        assert_eq!(
            m.counter(attempts, &[("name", "rq"), ("outcome", "failure")]),
            3
        );
        assert_eq!(
            m.counter(attempts, &[("name", "rq"), ("outcome", "success")]),
            1
        );
        assert_eq!(m.total(attempts), 4);
        assert_eq!(
            m.counter(
                names::CLIENT_RETRIES_TOTAL,
                &[("name", "rq"), ("reason", "status")]
            ),
            2
        );
        assert_eq!(m.total(names::CLIENT_RETRIES_TOTAL), 2);
        let give_ups = give_ups.lock().unwrap();
        assert_eq!(give_ups.len(), 1);
        assert_eq!(give_ups[0].name.as_str(), "rq");
        assert_eq!(give_ups[0].reason, GiveUp::AttemptsExhausted);
    }

    #[tokio::test]
    async fn a_budget_refusal() {
        let recorder = Recorder::new();
        let client = client(&recorder, || {
            ClientMiddlewares::new().name("rq").retry(retry(3)).budget(
                RetryBudget::ratio_with(RatioConfig::default().with_min_per_sec(0))
                    .with_name("rq-budget"),
            )
        });
        let url = scripted(&[503]).await;
        assert_eq!(client.get(&url).send().await.unwrap().status(), 503);

        let m = recorder.read();
        assert_eq!(
            m.counter(names::BUDGET_REFUSALS_TOTAL, &[("name", "rq-budget")]),
            1
        );
        assert_eq!(m.total(names::BUDGET_REFUSALS_TOTAL), 1);
        assert_eq!(m.total(names::CLIENT_RETRIES_TOTAL), 0);
    }

    /// A budget and a breaker given before `.name(…)` stay the ones given: the name
    /// renames only the parts the stack made itself.
    #[tokio::test]
    async fn a_given_budget_and_breaker_survive_a_later_name() {
        let recorder = Recorder::new();
        let given = RetryBudget::ratio_with(RatioConfig::default().with_min_per_sec(0))
            .with_name("shared-budget");
        let client = client(&recorder, move || {
            let config = BreakerConfig::default()
                .with_name("given-breaker")
                .with_window(SlidingWindow::count(2, 1))
                .with_minimum_calls(2)
                .with_open_duration(MINUTE);
            ClientMiddlewares::new()
                .budget(given)
                .breaker(CircuitBreakerMiddleware::with_config(config))
                .retry(retry(3))
                .name("late")
        });
        let url = scripted(&[503, 503, 503]).await;
        assert_eq!(client.get(&url).send().await.unwrap().status(), 503);
        assert_eq!(client.get(&url).send().await.unwrap().status(), 503);
        let refused = client.get(&url).send().await.unwrap_err();
        assert!(refused.to_string().contains("circuit"), "{refused}");

        let m = recorder.read();
        // The shared budget (no deposits to spend: min_per_sec 0) refused the retries
        // under its own name, and the given breaker opened under its own.
        assert_eq!(
            m.counter(names::BUDGET_REFUSALS_TOTAL, &[("name", "shared-budget")]),
            2
        );
        assert_eq!(m.total(names::BUDGET_REFUSALS_TOTAL), 2);
        assert_eq!(
            m.counter(
                names::BREAKER_REJECTIONS_TOTAL,
                &[("name", "given-breaker")]
            ),
            1
        );
        assert_eq!(m.total(names::BREAKER_REJECTIONS_TOTAL), 1);
    }

    #[tokio::test]
    async fn an_open_breaker_refuses() {
        let recorder = Recorder::new();
        let client = client(&recorder, || {
            let config = BreakerConfig::default()
                .with_name("rq-breaker")
                .with_window(SlidingWindow::count(2, 1))
                .with_minimum_calls(2)
                .with_open_duration(MINUTE);
            ClientMiddlewares::new()
                .name("rq")
                .retry(retry(1))
                .breaker(CircuitBreakerMiddleware::with_config(config))
        });
        let url = scripted(&[500, 500]).await;
        for _ in 0..2 {
            assert_eq!(client.get(&url).send().await.unwrap().status(), 500);
        }
        let refused = client.get(&url).send().await.unwrap_err();
        assert!(refused.to_string().contains("circuit"), "{refused}");

        let m = recorder.read();
        assert_eq!(
            m.counter(names::BREAKER_REJECTIONS_TOTAL, &[("name", "rq-breaker")]),
            1
        );
        assert_eq!(
            m.gauge(names::BREAKER_STATE, &[("name", "rq-breaker")]),
            Some(2.0)
        );
    }

    #[tokio::test]
    async fn the_expiry_hook_hears_each_expiry_once_with_the_name() {
        let recorder = Recorder::new();
        let (heard, hook) = hear_expiries();
        let client = client(&recorder, || {
            ClientMiddlewares::new()
                .name("rq")
                .on_expiry(hook)
                .deadline(Duration::from_millis(100))
                .retry(retry(3))
        });
        let url = scripted(&[0]).await;
        let error = client.get(&url).send().await.unwrap_err();
        assert!(
            matches!(&error, reqwest_middleware::Error::Middleware(e) if e.is::<DeadlineExceeded>()),
            "{error:?}"
        );
        assert_eq!(*heard.lock().unwrap(), ["rq"]);
        let m = recorder.read();
        assert_eq!(
            m.counter(names::DEADLINE_EXCEEDED_TOTAL, &[("name", "rq")]),
            1
        );
    }

    #[tokio::test]
    async fn a_deadline_expiry() {
        let recorder = Recorder::new();
        let client = client(&recorder, || {
            ClientMiddlewares::new()
                .name("rq")
                .deadline(Duration::from_millis(100))
                .retry(retry(3))
        });
        let url = scripted(&[0]).await;
        let error = client.get(&url).send().await.unwrap_err();
        assert!(
            matches!(&error, reqwest_middleware::Error::Middleware(e) if e.is::<DeadlineExceeded>()),
            "{error:?}"
        );

        let m = recorder.read();
        assert_eq!(
            m.counter(names::DEADLINE_EXCEEDED_TOTAL, &[("name", "rq")]),
            1
        );
        assert_eq!(m.total(names::DEADLINE_EXCEEDED_TOTAL), 1);
    }
}
