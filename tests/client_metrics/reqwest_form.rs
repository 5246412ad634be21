//! The reqwest form, over loopback: a server answering from a script (200 once it runs
//! out; `0` means: answer 200 after 1 s).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use http::StatusCode;
use reqwest_middleware::ClientWithMiddleware;
use retrysafe::RetryBudget;
use retrysafe::breaker::{BreakerConfig, SlidingWindow};
use retrysafe::budget::RatioConfig;
use retrysafe::error::DeadlineExceeded;
use retrysafe::observe::names;
use retrysafe::reqwest::{CircuitBreakerMiddleware, ClientMiddlewares, RetryMiddleware};
use retrysafe::retry::GiveUp;
use retrysafe_test_support::observe::Recorder;

use super::stack_counts::hear_expiries;
use super::{MINUTE, strategy};

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

fn client(recorder: &Recorder, stack: impl FnOnce() -> ClientMiddlewares) -> ClientWithMiddleware {
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
