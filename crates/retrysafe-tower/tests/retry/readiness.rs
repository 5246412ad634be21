//! A `RetryLayer` right over a service awaits its readiness after the backoff, within
//! the deadline.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::StatusCode;
use retrysafe_core::{CallContext, Deadline};
use tokio::time::Instant;
use tower::{Layer, Service};
use tower_test::mock;

use super::{
    NS, Req, Res, advance_to, call, ceil_ms, get, jitter_delays, layer, ms, next, settle, status,
    try_next, with,
};

/// Logs when its readiness is polled.
#[derive(Clone)]
struct ReadyLog<S> {
    inner: S,
    log: Arc<Mutex<Vec<Instant>>>,
}

impl<S: Service<R>, R> Service<R> for ReadyLog<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.log.lock().unwrap().push(Instant::now());
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> S::Future {
        self.inner.call(req)
    }
}

#[tokio::test(start_paused = true)]
async fn readiness_is_awaited_after_the_backoff_and_counts_against_the_deadline() {
    let [d1] = jitter_delays::<1>();
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut svc = layer().layer(ReadyLog {
        inner: mock,
        log: log.clone(),
    });
    handle.allow(1);
    let req = with(
        get("http://api.local/items"),
        Deadline::after(Duration::from_secs(5)),
    );
    let join = call(&mut svc, req).await;
    let (req, reply) = next(&mut handle).await;
    assert_eq!(req.headers()["request-timeout-ms"], "5000");
    let t0 = Instant::now();
    reply.send_response(status(503));
    settle().await;
    let before = log.lock().unwrap().len();

    // Not polled for readiness during the backoff.
    advance_to(t0 + d1 - NS).await;
    settle().await;
    assert_eq!(log.lock().unwrap().len(), before);
    // Polled after it; the inner service is not ready, so no attempt yet.
    advance_to(t0 + ceil_ms(d1)).await;
    settle().await;
    assert!(log.lock().unwrap().len() > before);
    assert!(try_next(&mut handle).is_none());
    tokio::time::advance(ms(200)).await;
    settle().await;
    assert!(try_next(&mut handle).is_none());
    assert!(!join.is_finished());
    assert!(log.lock().unwrap()[1..].iter().all(|at| *at >= t0 + d1));

    handle.allow(1);
    let (req, reply) = next(&mut handle).await;
    assert_eq!(req.headers()["retry-attempt"], "2");
    // The wait for readiness was spent from the deadline.
    let left = Duration::from_secs(5) - ceil_ms(d1) - ms(200);
    assert_eq!(
        req.headers()["request-timeout-ms"],
        left.as_millis().to_string()
    );
    reply.send_response(status(200));
    assert_eq!(join.await.unwrap().unwrap().status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn readiness_that_outlasts_the_deadline_is_a_deadline_exceeded() {
    let [d1] = jitter_delays::<1>();
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = layer().layer(mock);
    handle.allow(1);
    let ctx = CallContext::new().with_deadline(Deadline::after(ms(500)));
    let join = call(&mut svc, with(get("http://api.local/items"), ctx.clone())).await;
    let (req, reply) = next(&mut handle).await;
    assert_eq!(req.headers()["request-timeout-ms"], "500");
    let t0 = Instant::now();
    reply.send_response(status(503));
    advance_to(t0 + ceil_ms(d1)).await;
    settle().await;
    advance_to(t0 + ms(500) - NS).await;
    settle().await;
    assert!(!join.is_finished());
    advance_to(t0 + ms(500)).await;
    settle().await;
    assert!(join.is_finished());
    // The retry could not be made in time: the last real response, marked.
    let res = join.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["do-not-retry"], "1");
    assert!(ctx.downstream_gave_up());
}
