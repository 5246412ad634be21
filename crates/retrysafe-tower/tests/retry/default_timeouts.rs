//! The default attempt timeout and the default overall timeout.

use std::time::Duration;

use http::StatusCode;
use retrysafe_core::error::DeadlineExceeded;
use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::{Client, Form};
use tokio::time::Instant;
use tower::Layer;
use tower_test::mock;

use super::{
    NS, Req, Res, advance_to, call, events, expect_attempt_after, get, hooked, jitter_delays,
    layer, next, no_more_attempts, settle, stack, stacked, status, strategy, try_next,
};

async fn the_default_attempt_timeout_fires_and_retries_a_get(form: Form) {
    let [d1] = jitter_delays::<1>();
    let (layer, retries, _) = hooked(layer());
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stacked(form, layer).layer(mock);
    let join = call(&mut svc, get("http://api.local/slow")).await;
    let start = Instant::now();
    let (_first, _unanswered) = next(&mut handle).await;
    advance_to(start + Duration::from_secs(10) - NS).await;
    settle().await;
    assert!(try_next(&mut handle).is_none());
    assert!(!join.is_finished());
    advance_to(start + Duration::from_secs(10)).await;
    // At 10 s the attempt is abandoned; the retry follows after the backoff.
    let (req, reply) = expect_attempt_after(&mut handle, start + Duration::from_secs(10), d1).await;
    assert_eq!(req.headers()["retry-attempt"], "2");
    // No deadline was given: no deadline header.
    assert!(req.headers().get("request-timeout-ms").is_none());
    reply.send_response(status(200));
    assert_eq!(join.await.unwrap().unwrap().status(), StatusCode::OK);
    let retries = events(&retries);
    assert!(retries[0].classification.timeout);
    assert_eq!(retries[0].status, None);
}

both_forms!(
    the_default_attempt_timeout_fires_and_retries_a_get,
    start_paused = true
);

async fn the_default_overall_timeout_ends_the_call_at_30_s(form: Form) {
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let join = call(&mut svc, get("http://api.local/slow")).await;
    let start = Instant::now();
    let mut held = Vec::new();
    for _ in 0..3 {
        // Never answered: each attempt times out (the paused clock jumps ahead).
        held.push(handle.next_request().await.unwrap());
    }
    let err = join.await.unwrap().unwrap_err();
    assert!(err.is::<DeadlineExceeded>(), "{err}");
    assert_eq!(Instant::now() - start, Duration::from_secs(30));
    no_more_attempts(&mut handle).await;

    // `no_timeout()`: an attempt may take as long as it takes.
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = Client::new()
        .strategy(strategy().no_timeout())
        .layer(form)
        .layer(mock);
    let join = call(&mut svc, get("http://api.local/slow")).await;
    let (_req, reply) = next(&mut handle).await;
    tokio::time::advance(Duration::from_secs(3600)).await;
    settle().await;
    assert!(!join.is_finished());
    reply.send_response(status(200));
    join.await.unwrap().unwrap();
}

both_forms!(
    the_default_overall_timeout_ends_the_call_at_30_s,
    start_paused = true
);
