//! What the client stack counts, on both forms: retries, give-ups, budget refusals, an
//! open and a probing breaker, deadline expiries, errors and rejections, and the
//! expiry hook.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::StatusCode;
use retrysafe::breaker::{BreakerConfig, CircuitBreaker, SlidingWindow, State};
use retrysafe::budget::RatioConfig;
use retrysafe::deadline::{Deadline, DeadlineExpiry};
use retrysafe::error::{CircuitOpen, DeadlineExceeded, find};
use retrysafe::observe::names;
use retrysafe::retry::GiveUp;
use retrysafe::{
    CircuitBreakerLayer, ClientLayers, DeadlineLayer, RetryBudget, RetryBudgetLayer, RetryLayer,
};
use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::Form;
use retrysafe_test_support::observe::Recorder;
use tower::util::BoxCloneSyncService;
use tower::{Layer, ServiceBuilder, ServiceExt};

use super::{Answer, MINUTE, Script, Stack, breaker, budget, get, stack, strategy};

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
pub(super) type Expiries = Arc<Mutex<Vec<String>>>;

pub(super) fn hear_expiries() -> (Expiries, impl Fn(&DeadlineExpiry) + Send + Sync + 'static) {
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
