//! Poll-level tests of the client retry layers with `tower-test`, on tokio's paused
//! clock with a seeded jitter, so every delay is exact: the `RetryLayer` (delays, delay
//! hints, deadlines, readiness, attempt headers, safe requests, keys, the retry point,
//! giving up, local failures, default timeouts, hooks, body replay), the
//! `RetryBudgetLayer` and the `EdgeLayer` in front of it.
//!
//! The behaviour the whole client stack shares runs on both of its forms
//! (`both_forms!`, `retrysafe_test_support::forms`): the separate layers stacked by
//! hand and `ClientLayers`, built from one description. Single-form, the API of one
//! standalone layer with no `ClientLayers` counterpart:
//! - `readiness_is_awaited_after_the_backoff_and_counts_against_the_deadline` and
//!   `readiness_that_outlasts_the_deadline_is_a_deadline_exceeded`: a `RetryLayer` right
//!   over a service awaits its readiness itself; in a stack the breaker below it is
//!   always ready and awaits the transport's inside its own future (the deadline's
//!   `waiting_for_readiness_counts` and the breaker's readiness tests cover that);
//! - `every_attempt_of_a_budgeted_request_is_tagged`: the `RetryCharged` mark is for a
//!   separate `RetryBudgetLayer` below; the fused stack has none to read it;
//! - `a_buffer_between_the_retry_and_budget_layers_keeps_one_deposit_per_request`: a
//!   `Buffer` between two separate layers;
//! - `without_a_budget_above_the_budget_layer_counts_every_attempt` and
//!   `a_budget_layer_with_its_own_budget_counts_a_retry_layers_attempts`: a retry layer
//!   and a budget layer with different budgets; `ClientLayers` is given one;
//! - `the_budget_layer_charges_foreign_retries`,
//!   `the_server_budget_layer_answers_503_problems_with_do_not_retry` and
//!   `the_edge_layer_strips_a_forged_retry_attempt_before_the_budget`: the
//!   `RetryBudgetLayer` alone, and its server form.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    missing_docs,
    unreachable_pub
)]

use std::convert::Infallible;
use std::io;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use retrysafe_core::__private::RetryCharged;
use retrysafe_core::backoff::{Backoff, RngSource};
use retrysafe_core::budget::{BudgetSnapshot, RatioConfig, RetryBudget};
use retrysafe_core::classify::FaultSide;
use retrysafe_core::error::{BudgetExhausted, DeadlineExceeded, find};
use retrysafe_core::idempotency::{IdempotencyContext, Principal, Scope, Token};
use retrysafe_core::strategy::{GiveUp, Idempotent, NoRetry, StandardRetryStrategy};
use retrysafe_core::wire::{Convention, IdempotencyKey, encode_grpc_timeout};
use retrysafe_core::{CallContext, Deadline};
use retrysafe_tower::budget::RetryBudgetLayer;
use retrysafe_tower::edge::EdgeLayer;
use retrysafe_tower::local::{BoxError, GrpcStatusLayer};
use retrysafe_tower::retry::{GiveUpEvent, ReplayBody, RetryEvent, RetryLayer};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower::layer::util::{Identity, Stack};
use tower::{Layer, Service, ServiceBuilder, ServiceExt};
use tower_test::mock;

use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::{Client, Form, FormLayer};

type Req = Request<ReplayBody<String>>;
type Res = Response<String>;
type Handle = mock::Handle<Req, Res>;
type Responder = mock::SendResponse<Res>;

const SEED: u64 = 7;
const NS: Duration = Duration::from_nanos(1);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn strategy() -> StandardRetryStrategy {
    StandardRetryStrategy::new().seed(SEED)
}

fn layer() -> RetryLayer {
    RetryLayer::new().strategy(strategy())
}

/// The standard client stack with the seeded strategy.
fn client() -> Client {
    Client::new().strategy(strategy())
}

/// The standard client stack in `form`, with `retry`'s settings but the seeded strategy
/// (the strategy `retry` has is replaced).
fn stacked(form: Form, retry: RetryLayer) -> FormLayer {
    client().retry(retry).layer(form)
}

/// The standard client stack in `form`.
fn stack(form: Form) -> FormLayer {
    stacked(form, RetryLayer::new())
}

fn response(code: u16, headers: &[(&'static str, &str)]) -> Res {
    let mut b = Response::builder().status(code);
    for (name, value) in headers {
        b = b.header(*name, *value);
    }
    b.body(format!("status {code}")).unwrap()
}

fn status(code: u16) -> Res {
    response(code, &[])
}

fn grpc_status(code: &str, more: &[(&'static str, &str)]) -> Res {
    let mut headers = vec![("content-type", "application/grpc"), ("grpc-status", code)];
    headers.extend_from_slice(more);
    response(200, &headers)
}

fn get(uri: &str) -> Request<String> {
    Request::get(uri).body(String::new()).unwrap()
}

fn post(uri: &str, body: &str) -> Request<String> {
    Request::post(uri).body(body.to_owned()).unwrap()
}

fn grpc_call() -> Request<String> {
    Request::post("http://svc.local/pkg.Greeter/Get")
        .header("content-type", "application/grpc")
        .body(String::new())
        .unwrap()
}

fn with<T: Clone + Send + Sync + 'static>(mut req: Request<String>, ext: T) -> Request<String> {
    req.extensions_mut().insert(ext);
    req
}

/// The full-jitter delays of the first request that retries under
/// `StandardRetryStrategy::new().seed(SEED)`: replays its generator.
fn jitter_delays<const N: usize>() -> [Duration; N] {
    let mut rng = RngSource::seeded(SEED).next_rng();
    let backoff = Backoff::default();
    let mut previous = Duration::ZERO;
    std::array::from_fn(|n| {
        previous = backoff.delay(n as u32, previous, false, &mut rng);
        previous
    })
}

/// Lets every runnable task run, without letting the paused clock move.
async fn settle() {
    for _ in 0..64 {
        tokio::task::yield_now().await;
    }
}

fn try_next(handle: &mut Handle) -> Option<(Req, Responder)> {
    match handle.poll_request() {
        Poll::Ready(Some(r)) => Some(r),
        Poll::Ready(None) => panic!("the mock was closed"),
        Poll::Pending => None,
    }
}

async fn next(handle: &mut Handle) -> (Req, Responder) {
    settle().await;
    try_next(handle).expect("an attempt")
}

async fn no_more_attempts(handle: &mut Handle) {
    settle().await;
    assert!(try_next(handle).is_none(), "an unexpected attempt");
}

async fn advance_to(at: Instant) {
    let now = Instant::now();
    if at > now {
        tokio::time::advance(at - now).await;
    }
}

/// Tokio's timers fire on whole milliseconds (rounded up).
fn ceil_ms(d: Duration) -> Duration {
    ms(u64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap())
}

/// The next attempt comes `delay` after `t0`: not 1 ns before, and by the timer tick
/// right after (`t0` must be on a whole millisecond of the paused clock).
async fn expect_attempt_after(
    handle: &mut Handle,
    t0: Instant,
    delay: Duration,
) -> (Req, Responder) {
    settle().await;
    if !delay.is_zero() {
        advance_to(t0 + delay - NS).await;
        settle().await;
        assert!(try_next(handle).is_none(), "an attempt before {delay:?}");
    }
    advance_to(t0 + ceil_ms(delay)).await;
    next(handle).await
}

/// Readies `svc` and spawns the call.
async fn call<S>(svc: &mut S, req: Request<String>) -> JoinHandle<Result<S::Response, BoxError>>
where
    S: Service<Request<String>, Error = BoxError>,
    S::Response: Send + 'static,
    S::Future: Send + 'static,
{
    let fut = svc.ready().await.unwrap().call(req);
    tokio::spawn(fut)
}

/// What one attempt looked like when it reached the inner service.
struct Seen {
    parts: http::request::Parts,
    body: Bytes,
    at: Instant,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.parts.headers.get(name).map(|v| v.to_str().unwrap())
    }
}

/// Waits for the next attempt (the paused clock jumps over backoffs) and reads it.
async fn take(handle: &mut Handle) -> (Seen, Responder) {
    let (req, reply) = handle.next_request().await.expect("an attempt");
    let at = Instant::now();
    let (parts, body) = req.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (Seen { parts, body, at }, reply)
}

/// Answers the next attempts with `replies`, in order.
async fn answer(handle: &mut Handle, replies: Vec<Result<Res, BoxError>>) -> Vec<Seen> {
    let mut seen = Vec::new();
    for r in replies {
        let (s, reply) = take(handle).await;
        seen.push(s);
        match r {
            Ok(res) => reply.send_response(res),
            Err(e) => reply.send_error(e),
        }
    }
    seen
}

/// Runs `req` through `layer` over a mock answering `replies`; returns the result and
/// the attempts, after checking that no other attempt came.
async fn run<L, R>(
    layer: L,
    req: Request<String>,
    replies: Vec<Result<Res, BoxError>>,
) -> (Result<R, BoxError>, Vec<Seen>)
where
    L: Layer<mock::Mock<Req, Res>>,
    L::Service: Service<Request<String>, Response = R, Error = BoxError>,
    <L::Service as Service<Request<String>>>::Future: Send + 'static,
    R: Send + 'static,
{
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = layer.layer(mock);
    let join = call(&mut svc, req).await;
    let seen = answer(&mut handle, replies).await;
    let result = join.await.unwrap();
    no_more_attempts(&mut handle).await;
    (result, seen)
}

/// `layer` under the one `GrpcStatusLayer` of a gRPC client stack.
fn grpc_statuses<L>(layer: L) -> ServiceBuilder<Stack<L, Stack<GrpcStatusLayer, Identity>>> {
    ServiceBuilder::new()
        .layer(GrpcStatusLayer::new())
        .layer(layer)
}

fn io_error(kind: io::ErrorKind) -> Result<Res, BoxError> {
    Err(Box::new(io::Error::from(kind)))
}

fn marked<B>(res: &Response<B>) -> bool {
    res.headers().get("do-not-retry").is_some_and(|v| v == "1")
}

type Events<E> = Arc<Mutex<Vec<E>>>;

/// A layer recording its hook events.
fn hooked(layer: RetryLayer) -> (RetryLayer, Events<RetryEvent>, Events<GiveUpEvent>) {
    let retries: Events<RetryEvent> = Arc::default();
    let give_ups: Events<GiveUpEvent> = Arc::default();
    let (r, g) = (retries.clone(), give_ups.clone());
    let layer = layer
        .on_retry(move |e| r.lock().unwrap().push(e.clone()))
        .on_give_up(move |e| g.lock().unwrap().push(e.clone()));
    (layer, retries, give_ups)
}

/// A copy of the events recorded so far.
fn events<E: Clone>(events: &Events<E>) -> Vec<E> {
    events.lock().unwrap().clone()
}

fn ratio(min_per_sec: u32, retry_ratio: f64) -> RetryBudget {
    let mut config = RatioConfig::default();
    config = config.with_min_per_sec(min_per_sec);
    config = config.with_retry_ratio(retry_ratio);
    RetryBudget::ratio_with(config)
}

fn ratio_counts(budget: &RetryBudget) -> (u64, u64) {
    match budget.snapshot() {
        BudgetSnapshot::Ratio {
            deposits,
            withdrawals,
            ..
        } => (deposits, withdrawals),
        other => panic!("{other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Delays
// ---------------------------------------------------------------------------------------

async fn full_jitter_delays_are_exact(form: Form) {
    let [d1, d2] = jitter_delays::<2>();
    assert!(d1 <= ms(50) && d2 <= ms(100), "{d1:?} {d2:?}");
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);

    let join = call(&mut svc, get("http://api.local/items")).await;
    let (req, reply) = next(&mut handle).await;
    assert!(req.headers().get("retry-attempt").is_none());
    let t0 = Instant::now();
    reply.send_response(status(503));

    let (req, reply) = expect_attempt_after(&mut handle, t0, d1).await;
    assert_eq!(req.headers()["retry-attempt"], "2");
    let t1 = Instant::now();
    reply.send_response(status(502));

    let (req, reply) = expect_attempt_after(&mut handle, t1, d2).await;
    assert_eq!(req.headers()["retry-attempt"], "3");
    reply.send_response(status(200));

    let res = join.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(!marked(&res));
    no_more_attempts(&mut handle).await;
}

both_forms!(full_jitter_delays_are_exact, start_paused = true);

async fn retry_after_is_a_minimum_delay(form: Form) {
    // Replay the generator: a 503 with retry-after is a throttle (base 1 s).
    let mut rng = RngSource::seeded(SEED).next_rng();
    let backoff = Backoff::default();
    let b0 = backoff.delay(0, Duration::ZERO, true, &mut rng);
    assert!(b0 <= Duration::from_secs(1));
    let d1 = Duration::from_secs(2); // retry-after 2 s is longer than the backoff
    let d2 = backoff.delay(1, d1, true, &mut rng); // retry-after 0: the backoff
    assert!(d2 > Duration::ZERO);

    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let join = call(&mut svc, get("http://api.local/items")).await;
    let (_, reply) = next(&mut handle).await;
    let t0 = Instant::now();
    reply.send_response(response(503, &[("retry-after", "2")]));
    let (_, reply) = expect_attempt_after(&mut handle, t0, d1).await;
    let t1 = Instant::now();
    reply.send_response(response(503, &[("retry-after", "0")]));
    let (_, reply) = expect_attempt_after(&mut handle, t1, d2).await;
    reply.send_response(status(204));
    assert_eq!(
        join.await.unwrap().unwrap().status(),
        StatusCode::NO_CONTENT
    );
}

both_forms!(retry_after_is_a_minimum_delay, start_paused = true);

async fn grpc_pushback_is_the_exact_delay_and_negative_means_no_retry(form: Form) {
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let join = call(&mut svc, with(grpc_call(), Idempotent)).await;
    let (req, reply) = next(&mut handle).await;
    assert!(req.headers().get("grpc-previous-rpc-attempts").is_none());
    let t0 = Instant::now();
    reply.send_response(grpc_status("14", &[("grpc-retry-pushback-ms", "1234")]));

    let (req, reply) = expect_attempt_after(&mut handle, t0, ms(1234)).await;
    assert_eq!(req.headers()["retry-attempt"], "2");
    assert_eq!(req.headers()["grpc-previous-rpc-attempts"], "1");
    let t1 = Instant::now();
    reply.send_response(grpc_status("14", &[("grpc-retry-pushback-ms", "-1")]));
    settle().await;
    // Answered at once, as the server said: not retried, and not marked by us.
    assert!(join.is_finished());
    assert_eq!(Instant::now(), t1);
    let res = join.await.unwrap().unwrap();
    assert_eq!(res.headers()["grpc-status"], "14");
    assert!(!marked(&res));
    no_more_attempts(&mut handle).await;

    // A pushback of 0: at once.
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let join = call(&mut svc, with(grpc_call(), Idempotent)).await;
    let (_, reply) = next(&mut handle).await;
    let t0 = Instant::now();
    reply.send_response(grpc_status("14", &[("grpc-retry-pushback-ms", "0")]));
    let (req, reply) = next(&mut handle).await;
    assert_eq!(Instant::now(), t0);
    assert_eq!(req.headers()["grpc-previous-rpc-attempts"], "1");
    reply.send_response(grpc_status("0", &[]));
    assert_eq!(join.await.unwrap().unwrap().headers()["grpc-status"], "0");
}

both_forms!(
    grpc_pushback_is_the_exact_delay_and_negative_means_no_retry,
    start_paused = true
);

async fn a_delay_longer_than_the_time_left_gives_up_at_once(form: Form) {
    let (layer, retries, give_ups) = hooked(layer());
    let ctx = CallContext::new();
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stacked(form, layer).layer(mock);
    let req = with(
        get("http://api.local/items"),
        Deadline::after(Duration::from_secs(1)),
    );
    // The context is the task's current one while `call` runs.
    svc.ready().await.unwrap();
    let join = ctx.clone().sync_scope(|| tokio::spawn(svc.call(req)));
    let (_, reply) = next(&mut handle).await;
    let t0 = Instant::now();
    reply.send_response(response(503, &[("retry-after", "5")]));
    settle().await;
    assert!(join.is_finished());
    assert_eq!(Instant::now(), t0);
    let res = join.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(marked(&res));
    assert!(ctx.downstream_gave_up());
    assert!(retries.lock().unwrap().is_empty());
    let give_ups = events(&give_ups);
    assert_eq!(give_ups.len(), 1);
    assert_eq!(give_ups[0].reason, GiveUp::NotEnoughTime);
    assert_eq!(give_ups[0].attempts, 1);
    assert_eq!(give_ups[0].status, Some(StatusCode::SERVICE_UNAVAILABLE));
    no_more_attempts(&mut handle).await;
}

both_forms!(
    a_delay_longer_than_the_time_left_gives_up_at_once,
    start_paused = true
);

/// An attempt that never answers (a black hole) under a deadline: an explicit
/// `attempt_timeout` cuts it and leaves time for a retry; the attempt's time-left header
/// is the attempt's bound. Without one, the attempt may use the whole deadline.
async fn an_explicit_attempt_timeout_cuts_a_black_hole_under_a_deadline(form: Form) {
    let bounded = Client::new()
        .strategy(strategy().attempt_timeout(ms(200)))
        .layer(form);
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = bounded.layer(mock);
    let req = with(get("http://api.local/items"), Deadline::after(ms(1000)));
    let t0 = Instant::now();
    let join = call(&mut svc, req).await;
    let (first, _black_hole) = take(&mut handle).await;
    assert_eq!(first.header("request-timeout-ms"), Some("200"));
    let (second, reply) = take(&mut handle).await;
    // Cut at 200 ms, then the seeded backoff.
    let [delay] = jitter_delays::<1>();
    assert_eq!(second.at, t0 + ms(200) + ceil_ms(delay));
    assert_eq!(second.header("retry-attempt"), Some("2"));
    reply.send_response(status(200));
    assert_eq!(join.await.unwrap().unwrap().status(), StatusCode::OK);
    no_more_attempts(&mut handle).await;

    // The default attempt timeout does not apply under a deadline.
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let req = with(get("http://api.local/items"), Deadline::after(ms(1000)));
    let join = call(&mut svc, req).await;
    let (first, _black_hole) = take(&mut handle).await;
    assert_eq!(first.header("request-timeout-ms"), Some("1000"));
    let err = join.await.unwrap().unwrap_err();
    assert!(err.is::<DeadlineExceeded>(), "{err}");
    no_more_attempts(&mut handle).await;
}

both_forms!(
    an_explicit_attempt_timeout_cuts_a_black_hole_under_a_deadline,
    start_paused = true
);

// ---------------------------------------------------------------------------------------
// Readiness
// ---------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------
// Deadline headers
// ---------------------------------------------------------------------------------------

async fn the_deadline_header_is_rewritten_on_every_attempt_rounded_down(form: Form) {
    let [d1, d2] = jitter_delays::<2>();
    let budget = Duration::from_micros(1_000_500); // 1000.5 ms
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let join = call(
        &mut svc,
        with(get("http://api.local/items"), Deadline::after(budget)),
    )
    .await;
    let start = Instant::now();
    let (req, reply) = next(&mut handle).await;
    assert_eq!(req.headers()["request-timeout-ms"], "1000");
    assert!(req.headers().get("grpc-timeout").is_none());
    reply.send_response(status(503));
    let (req, reply) = expect_attempt_after(&mut handle, start, d1).await;
    let left = budget - (Instant::now() - start);
    assert_eq!(
        req.headers()["request-timeout-ms"],
        left.as_millis().to_string()
    );
    let t1 = Instant::now();
    reply.send_response(status(503));
    let (req, reply) = expect_attempt_after(&mut handle, t1, d2).await;
    let left = budget - (Instant::now() - start);
    assert_eq!(
        req.headers()["request-timeout-ms"],
        left.as_millis().to_string()
    );
    reply.send_response(status(200));
    join.await.unwrap().unwrap();
}

both_forms!(
    the_deadline_header_is_rewritten_on_every_attempt_rounded_down,
    start_paused = true
);

async fn grpc_timeout_is_rewritten_on_every_attempt_rounded_down(form: Form) {
    let [d1] = jitter_delays::<1>();
    let budget = Duration::from_micros(1_000_500);
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let req = with(with(grpc_call(), Idempotent), Deadline::after(budget));
    let join = call(&mut svc, req).await;
    let start = Instant::now();
    let (req, reply) = next(&mut handle).await;
    assert_eq!(req.headers()["grpc-timeout"], "1000500u");
    assert!(req.headers().get("request-timeout-ms").is_none());
    reply.send_response(grpc_status("14", &[]));
    let (req, reply) = expect_attempt_after(&mut handle, start, d1).await;
    let left = budget - (Instant::now() - start);
    assert_eq!(req.headers()["grpc-timeout"], encode_grpc_timeout(left));
    let sent = retrysafe_core::wire::parse_grpc_timeout(req.headers()["grpc-timeout"].as_bytes());
    assert!(sent.unwrap() <= left);
    reply.send_response(grpc_status("0", &[]));
    join.await.unwrap().unwrap();
}

both_forms!(
    grpc_timeout_is_rewritten_on_every_attempt_rounded_down,
    start_paused = true
);

async fn a_timeout_header_set_by_the_caller_or_an_inherited_deadline_is_honoured(form: Form) {
    let [d1] = jitter_delays::<1>();
    // A header the caller set, with no Deadline extension.
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let req = Request::get("http://api.local/items")
        .header("request-timeout-ms", "300")
        .body(String::new())
        .unwrap();
    let join = call(&mut svc, req).await;
    let start = Instant::now();
    let (req, reply) = next(&mut handle).await;
    assert_eq!(req.headers()["request-timeout-ms"], "300");
    reply.send_response(status(503));
    let (req, reply) = expect_attempt_after(&mut handle, start, d1).await;
    let left = ms(300) - ceil_ms(d1);
    assert_eq!(
        req.headers()["request-timeout-ms"],
        left.as_millis().to_string()
    );
    reply.send_response(status(200));
    join.await.unwrap().unwrap();

    // The inherited context's deadline, tightened by a sooner request deadline.
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let ctx = CallContext::new().with_deadline(Deadline::after(ms(800)));
    let join = ctx
        .clone()
        .scope(call(&mut svc, get("http://api.local/a")))
        .await;
    let (req, reply) = next(&mut handle).await;
    assert_eq!(req.headers()["request-timeout-ms"], "800");
    reply.send_response(status(200));
    join.await.unwrap().unwrap();
    let req = with(
        with(get("http://api.local/b"), ctx),
        Deadline::after(ms(250)),
    );
    let join = call(&mut svc, req).await;
    let (req, reply) = next(&mut handle).await;
    assert_eq!(req.headers()["request-timeout-ms"], "250");
    reply.send_response(status(200));
    join.await.unwrap().unwrap();
}

both_forms!(
    a_timeout_header_set_by_the_caller_or_an_inherited_deadline_is_honoured,
    start_paused = true
);

async fn a_504_long_before_the_deadline_is_the_callees_own_timeout(form: Form) {
    // The deadline sent was 5 s and the 504 came at once: not the caller's deadline at
    // work (that is a 504 as the deadline runs out), the callee's fault. Retried either
    // way.
    let (layer, retries, _) = hooked(layer());
    let req = with(
        get("http://api.local/items"),
        Deadline::after(Duration::from_secs(5)),
    );
    let (res, seen) = run(
        stacked(form, layer),
        req,
        vec![Ok(status(504)), Ok(status(200))],
    )
    .await;
    assert_eq!(res.unwrap().status(), StatusCode::OK);
    assert_eq!(seen.len(), 2);
    let retries = events(&retries);
    assert_eq!(retries[0].classification.fault, Some(FaultSide::Server));
    assert!(retries[0].classification.timeout);

    // Without a deadline, the callee's own fault.
    let (layer, retries, _) = hooked(self::layer());
    let (res, _) = run(
        stacked(form, layer),
        get("http://api.local/items"),
        vec![Ok(status(504)), Ok(status(200))],
    )
    .await;
    res.unwrap();
    assert_eq!(
        retries.lock().unwrap()[0].classification.fault,
        Some(FaultSide::Server)
    );
}

both_forms!(
    a_504_long_before_the_deadline_is_the_callees_own_timeout,
    start_paused = true
);

// ---------------------------------------------------------------------------------------
// Attempt headers and safe requests
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn every_attempt_of_a_budgeted_request_is_tagged() {
    let (_, seen) = run(
        layer(),
        with(grpc_call(), Idempotent),
        vec![
            Ok(grpc_status("14", &[])),
            Ok(grpc_status("14", &[])),
            Ok(grpc_status("0", &[])),
        ],
    )
    .await;
    let charged = |s: &Seen| s.parts.extensions.get::<RetryCharged>().map(|c| c.attempt);
    // The first included: a budget layer below skips them all.
    assert_eq!(
        seen.iter().map(charged).collect::<Vec<_>>(),
        [Some(1), Some(2), Some(3)]
    );
}

async fn attempts_two_and_later_are_numbered(form: Form) {
    let (res, seen) = run(
        stack(form),
        with(grpc_call(), Idempotent),
        vec![
            Ok(grpc_status("14", &[])),
            Ok(grpc_status("14", &[])),
            Ok(grpc_status("0", &[])),
        ],
    )
    .await;
    assert_eq!(res.unwrap().headers()["grpc-status"], "0");
    let attempt = |s: &Seen| s.header("retry-attempt").map(str::to_owned);
    let previous = |s: &Seen| s.header("grpc-previous-rpc-attempts").map(str::to_owned);
    assert_eq!(
        seen.iter().map(attempt).collect::<Vec<_>>(),
        [None, Some("2".to_owned()), Some("3".to_owned())]
    );
    assert_eq!(
        seen.iter().map(previous).collect::<Vec<_>>(),
        [None, Some("1".to_owned()), Some("2".to_owned())]
    );

    // Plain HTTP: no grpc-previous-rpc-attempts.
    let (_, seen) = run(
        stack(form),
        get("http://api.local/x"),
        vec![Ok(status(503)), Ok(status(200))],
    )
    .await;
    assert_eq!(seen[1].header("retry-attempt"), Some("2"));
    assert_eq!(seen[1].header("grpc-previous-rpc-attempts"), None);
}

both_forms!(attempts_two_and_later_are_numbered, start_paused = true);

async fn a_post_without_a_key_is_sent_once_unless_nothing_was_sent(form: Form) {
    let ctx = CallContext::new();
    let req = with(post("http://api.local/orders", "{}"), ctx.clone());
    let (res, seen) = run(stack(form), req, vec![Ok(status(503))]).await;
    let res = res.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.len(), 1);
    // Not a give-up: nothing retryable was refused, so nothing is marked.
    assert!(!marked(&res));
    assert!(!ctx.downstream_gave_up());

    // A failed connect: nothing was sent, so even a POST is retried.
    let (res, seen) = run(
        stack(form),
        post("http://api.local/orders", "{\"n\":1}"),
        vec![io_error(io::ErrorKind::ConnectionRefused), Ok(status(201))],
    )
    .await;
    assert_eq!(res.unwrap().status(), StatusCode::CREATED);
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].body, "{\"n\":1}");

    // A reset after sending: maybe processed, so not retried; the error comes back.
    let (res, seen) = run(
        stack(form),
        post("http://api.local/orders", "{}"),
        vec![io_error(io::ErrorKind::ConnectionReset)],
    )
    .await;
    let err = res.unwrap_err();
    assert_eq!(
        find::<io::Error>(&*err).unwrap().kind(),
        io::ErrorKind::ConnectionReset
    );
    assert_eq!(seen.len(), 1);

    // The same reset on a GET is retried.
    let (res, seen) = run(
        stack(form),
        get("http://api.local/orders"),
        vec![io_error(io::ErrorKind::ConnectionReset), Ok(status(200))],
    )
    .await;
    res.unwrap();
    assert_eq!(seen.len(), 2);
}

both_forms!(
    a_post_without_a_key_is_sent_once_unless_nothing_was_sent,
    start_paused = true
);

async fn no_retry_and_idempotent_extensions_and_idempotent_if(form: Form) {
    let ctx = CallContext::new();
    let req = with(with(get("http://api.local/x"), NoRetry), ctx.clone());
    let (res, seen) = run(stack(form), req, vec![Ok(status(503))]).await;
    let res = res.unwrap();
    assert_eq!(seen.len(), 1);
    assert!(!marked(&res));
    assert!(!ctx.downstream_gave_up());

    // NoRetry also keeps a POST from getting a generated key.
    let req = with(post("http://api.local/x", "b"), NoRetry);
    let (_, seen) = run(
        stacked(form, layer().generate_idempotency_keys()),
        req,
        vec![Ok(status(503))],
    )
    .await;
    assert_eq!(seen[0].header("idempotency-key"), None);

    let req = with(post("http://api.local/x", "b"), Idempotent);
    let (res, seen) = run(stack(form), req, vec![Ok(status(503)), Ok(status(200))]).await;
    res.unwrap();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].body, "b");

    let read_only = stacked(
        form,
        layer().idempotent_if(|parts| parts.uri.path().starts_with("/query")),
    );
    let (_, seen) = run(
        read_only.clone(),
        post("http://api.local/query/items", "q"),
        vec![Ok(status(503)), Ok(status(200))],
    )
    .await;
    assert_eq!(seen.len(), 2);
    let (_, seen) = run(
        read_only,
        post("http://api.local/orders", "q"),
        vec![Ok(status(503))],
    )
    .await;
    assert_eq!(seen.len(), 1);
}

both_forms!(
    no_retry_and_idempotent_extensions_and_idempotent_if,
    start_paused = true
);

async fn a_custom_convention_renames_every_header(form: Form) {
    let convention = Convention::default()
        .with_request_timeout_ms(HeaderName::from_static("x-envoy-expected-rq-timeout-ms"))
        .with_retry_attempt(HeaderName::from_static("x-attempt"))
        .with_do_not_retry(HeaderName::from_static("x-final"))
        .with_idempotency_key(HeaderName::from_static("x-key"))
        .with_retry_point(HeaderName::from_static("x-retry-point"));
    let ctx = CallContext::new();
    let req = with(
        with(
            post("http://api.local/orders", "x"),
            Deadline::after(ms(900)),
        ),
        ctx.clone(),
    );
    let (res, seen) = run(
        stacked(
            form,
            layer()
                .convention(convention)
                .generate_idempotency_keys()
                .retry_point(),
        ),
        req,
        vec![Ok(status(503)), Ok(status(503)), Ok(status(503))],
    )
    .await;
    let res = res.unwrap();
    assert_eq!(seen.len(), 3);
    for (n, s) in seen.iter().enumerate() {
        assert!(s.header("x-envoy-expected-rq-timeout-ms").is_some());
        assert!(s.header("request-timeout-ms").is_none());
        assert!(s.header("x-key").is_some());
        assert!(s.header("idempotency-key").is_none());
        assert_eq!(s.header("x-retry-point"), Some("caller"));
        let attempt = (n > 0).then(|| (n + 1).to_string());
        assert_eq!(s.header("x-attempt").map(str::to_owned), attempt);
        assert!(s.header("retry-attempt").is_none());
    }
    assert_eq!(res.headers()["x-final"], "1");
    assert!(res.headers().get("do-not-retry").is_none());
    assert!(ctx.downstream_gave_up());

    // A renamed mark from below stops the retries; the default name is just a header.
    let convention = Convention::default().with_do_not_retry(HeaderName::from_static("x-final"));
    let (_, seen) = run(
        stacked(form, layer().convention(convention.clone())),
        get("http://api.local/x"),
        vec![Ok(response(503, &[("x-final", "1")]))],
    )
    .await;
    assert_eq!(seen.len(), 1);
    let (_, seen) = run(
        stacked(form, layer().convention(convention)),
        get("http://api.local/x"),
        vec![Ok(response(503, &[("do-not-retry", "1")])), Ok(status(200))],
    )
    .await;
    assert_eq!(seen.len(), 2);
}

both_forms!(
    a_custom_convention_renames_every_header,
    start_paused = true
);

// ---------------------------------------------------------------------------------------
// Idempotency keys
// ---------------------------------------------------------------------------------------

fn key_of(seen: &Seen) -> Option<IdempotencyKey> {
    seen.parts
        .headers
        .get("idempotency-key")
        .map(|v| IdempotencyKey::from_header(v).unwrap())
}

async fn generated_keys_are_added_to_post_and_patch_and_kept_across_attempts(form: Form) {
    let keys = stacked(form, layer().generate_idempotency_keys());
    let (res, seen) = run(
        keys.clone(),
        post("http://api.local/orders", "x"),
        vec![Ok(status(503)), Ok(status(503)), Ok(status(201))],
    )
    .await;
    assert_eq!(res.unwrap().status(), StatusCode::CREATED);
    assert_eq!(seen.len(), 3);
    let key = key_of(&seen[0]).unwrap();
    assert_eq!(key.as_str().len(), 32);
    assert!(key.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(key_of(&seen[1]).unwrap(), key);
    assert_eq!(key_of(&seen[2]).unwrap(), key);

    // Another request, another random key.
    let (_, again) = run(
        keys.clone(),
        post("http://api.local/orders", "x"),
        vec![Ok(status(201))],
    )
    .await;
    assert_ne!(key_of(&again[0]).unwrap(), key);

    let patch = Request::patch("http://api.local/orders/1")
        .body("p".to_owned())
        .unwrap();
    let (_, seen) = run(keys.clone(), patch, vec![Ok(status(200))]).await;
    assert!(key_of(&seen[0]).is_some());

    // None on a GET, and a key the caller set is kept.
    let (_, seen) = run(
        keys.clone(),
        get("http://api.local/orders"),
        vec![Ok(status(200))],
    )
    .await;
    assert!(key_of(&seen[0]).is_none());
    let own = Request::post("http://api.local/orders")
        .header("idempotency-key", "mine-1")
        .body("x".to_owned())
        .unwrap();
    let (_, seen) = run(keys, own, vec![Ok(status(503)), Ok(status(201))]).await;
    assert_eq!(seen[0].header("idempotency-key"), Some("mine-1"));
    assert_eq!(seen[1].header("idempotency-key"), Some("mine-1"));

    // Without the option, no key is added.
    let (_, seen) = run(
        stack(form),
        post("http://api.local/orders", "x"),
        vec![Ok(status(201))],
    )
    .await;
    assert!(key_of(&seen[0]).is_none());
}

both_forms!(
    generated_keys_are_added_to_post_and_patch_and_kept_across_attempts,
    start_paused = true
);

async fn keys_inside_a_guarded_handler_are_deterministic_child_keys(form: Form) {
    let scope = Scope::from(&Principal::new("alice"));
    let inbound = IdempotencyKey::new("order-7").unwrap();
    let expected = IdempotencyContext::detached(scope, inbound.clone(), Token::random());
    let first = expected.next_child_key("POST ledger.local/entries");
    let second = expected.next_child_key("POST mail.local/send");
    assert_ne!(first, second);

    // The parent handler runs twice (a takeover, or a retry after NoEffect): each run
    // has its own claim token, and repeats the same keys in the same order.
    for _run in 0..2 {
        let record = IdempotencyContext::detached(scope, inbound.clone(), Token::random());
        let ctx = CallContext::new().with_idempotency(record);
        let keys = stacked(form, layer().generate_idempotency_keys());
        let (_, seen) = ctx
            .clone()
            .scope(run(
                keys.clone(),
                post("http://ledger.local/entries", "e"),
                vec![Ok(status(503)), Ok(status(201))],
            ))
            .await;
        assert_eq!(key_of(&seen[0]).unwrap(), first);
        assert_eq!(key_of(&seen[1]).unwrap(), first);
        let (_, seen) = ctx
            .scope(run(
                keys,
                post("http://mail.local/send", "m"),
                vec![Ok(status(202))],
            ))
            .await;
        assert_eq!(key_of(&seen[0]).unwrap(), second);
    }

    // Another inbound key, other child keys.
    let other = IdempotencyContext::detached(
        scope,
        IdempotencyKey::new("order-8").unwrap(),
        Token::random(),
    );
    let ctx = CallContext::new().with_idempotency(other);
    let req = with(post("http://ledger.local/entries", "e"), ctx);
    let (_, seen) = run(
        stacked(form, layer().generate_idempotency_keys()),
        req,
        vec![Ok(status(201))],
    )
    .await;
    assert_ne!(key_of(&seen[0]).unwrap(), first);
}

both_forms!(
    keys_inside_a_guarded_handler_are_deterministic_child_keys,
    start_paused = true
);

// ---------------------------------------------------------------------------------------
// The retry point
// ---------------------------------------------------------------------------------------

async fn retry_point_sends_the_header_on_every_attempt(form: Form) {
    let (_, seen) = run(
        stacked(form, layer().retry_point()),
        get("http://api.local/x"),
        vec![Ok(status(503)), Ok(status(503)), Ok(status(200))],
    )
    .await;
    assert_eq!(seen.len(), 3);
    assert!(
        seen.iter()
            .all(|s| s.header("retry-point") == Some("caller"))
    );
    let (_, seen) = run(
        stack(form),
        get("http://api.local/x"),
        vec![Ok(status(200))],
    )
    .await;
    assert_eq!(seen[0].header("retry-point"), None);
}

both_forms!(
    retry_point_sends_the_header_on_every_attempt,
    start_paused = true
);

async fn an_inherited_retry_point_makes_one_attempt_and_does_not_mark(form: Form) {
    let (layer, retries, give_ups) = hooked(layer());
    let ctx = CallContext::new().with_caller_is_retry_point(true);
    let req = with(get("http://api.local/x"), ctx.clone());
    let (res, seen) = run(stacked(form, layer), req, vec![Ok(status(503))]).await;
    let res = res.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.len(), 1);
    assert!(!marked(&res));
    assert!(!ctx.downstream_gave_up());
    assert!(retries.lock().unwrap().is_empty());
    assert!(give_ups.lock().unwrap().is_empty());
    // The hop below is told too: nothing under the caller may retry.
    assert_eq!(seen[0].header("retry-point"), Some("caller"));
}

both_forms!(
    an_inherited_retry_point_makes_one_attempt_and_does_not_mark,
    start_paused = true
);

// ---------------------------------------------------------------------------------------
// Giving up
// ---------------------------------------------------------------------------------------

async fn giving_up_after_the_last_attempt_marks_the_last_response(form: Form) {
    let [d1, d2] = jitter_delays::<2>();
    let (layer, retries, give_ups) = hooked(layer());
    let ctx = CallContext::new();
    let replies = vec![
        Ok(response(503, &[("x-n", "1")])),
        Ok(response(502, &[("x-n", "2")])),
        Ok(response(503, &[("x-n", "3")])),
    ];
    let (res, seen) = ctx
        .clone()
        .scope(run(
            stacked(form, layer),
            get("http://api.local/x"),
            replies,
        ))
        .await;
    let res = res.unwrap();
    assert_eq!(seen.len(), 3);
    assert_eq!(res.headers()["x-n"], "3");
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.body().get_ref(), "status 503");
    assert!(marked(&res));
    assert!(ctx.downstream_gave_up());

    let retries = events(&retries);
    assert_eq!(retries.len(), 2);
    assert_eq!((retries[0].attempt, retries[0].delay), (2, d1));
    assert_eq!(retries[0].status, Some(StatusCode::SERVICE_UNAVAILABLE));
    assert_eq!((retries[1].attempt, retries[1].delay), (3, d2));
    assert_eq!(retries[1].status, Some(StatusCode::BAD_GATEWAY));
    assert_eq!(retries[1].classification.fault, Some(FaultSide::Server));
    let give_ups = events(&give_ups);
    assert_eq!(give_ups.len(), 1);
    assert_eq!(give_ups[0].attempts, 3);
    assert_eq!(give_ups[0].reason, GiveUp::AttemptsExhausted);
    assert_eq!(give_ups[0].status, Some(StatusCode::SERVICE_UNAVAILABLE));
    // The attempts came when the hooks said.
    assert_eq!(seen[1].at - seen[0].at, ceil_ms(d1));
}

both_forms!(
    giving_up_after_the_last_attempt_marks_the_last_response,
    start_paused = true
);

async fn a_budget_refusal_on_the_first_retry_marks_the_response(form: Form) {
    let budget = ratio(0, 0.0);
    let (layer, retries, give_ups) = hooked(RetryLayer::new());
    let layer = client().retry(layer).budget(budget.clone()).layer(form);
    let ctx = CallContext::new();
    let req = with(get("http://api.local/x"), ctx.clone());
    let (res, seen) = run(layer, req, vec![Ok(status(503))]).await;
    let res = res.unwrap();
    assert_eq!(seen.len(), 1);
    assert!(marked(&res));
    assert!(ctx.downstream_gave_up());
    assert!(retries.lock().unwrap().is_empty());
    assert_eq!(give_ups.lock().unwrap()[0].reason, GiveUp::BudgetExhausted);
    assert_eq!(give_ups.lock().unwrap()[0].attempts, 1);
    // One deposit for the request, no withdrawal.
    assert_eq!(ratio_counts(&budget), (1, 0));

    // A per-request budget (extension) replaces the stack's in the retry's charges;
    // the stack's budget still counts the request as another budget's.
    let generous = RetryBudget::token_bucket();
    let shared = ratio(0, 1.0);
    let req = with(get("http://api.local/x"), generous.clone());
    let (res, seen) = run(
        client().budget(shared.clone()).layer(form),
        req,
        vec![Ok(status(503)), Ok(status(200))],
    )
    .await;
    res.unwrap();
    assert_eq!(seen.len(), 2);
    // The retry's cost, then refunded by its success.
    assert_eq!(generous.available_retries(), 100);
    assert_eq!(ratio_counts(&shared), (1, 1));

    // So a stack's budget that affords no retry refuses it all the same: below the
    // retry, after a real response.
    let (layer, retries, give_ups) = hooked(RetryLayer::new());
    let ctx = CallContext::new();
    let req = with(
        with(get("http://api.local/x"), generous.clone()),
        ctx.clone(),
    );
    let (res, seen) = run(
        client().retry(layer).budget(budget.clone()).layer(form),
        req,
        vec![Ok(status(503))],
    )
    .await;
    let res = res.unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(marked(&res));
    assert!(ctx.downstream_gave_up());
    assert_eq!(retries.lock().unwrap().len(), 1);
    assert_eq!(give_ups.lock().unwrap()[0].reason, GiveUp::RefusedBelow);
    assert_eq!(ratio_counts(&budget), (2, 0));
}

both_forms!(
    a_budget_refusal_on_the_first_retry_marks_the_response,
    start_paused = true
);

async fn a_do_not_retry_reply_is_not_retried_and_recorded(form: Form) {
    let (layer, retries, give_ups) = hooked(layer());
    let ctx = CallContext::new();
    let req = with(get("http://api.local/x"), ctx.clone());
    let (res, seen) = run(
        stacked(form, layer),
        req,
        vec![Ok(response(503, &[("do-not-retry", "1")]))],
    )
    .await;
    let res = res.unwrap();
    assert_eq!(seen.len(), 1);
    assert!(marked(&res));
    assert!(ctx.downstream_gave_up());
    assert!(retries.lock().unwrap().is_empty());
    // Not this layer's give-up: the reply was final already.
    assert!(give_ups.lock().unwrap().is_empty());

    // `do-not-retry: 0` is no mark.
    let ctx = CallContext::new();
    let req = with(get("http://api.local/x"), ctx.clone());
    let (_, seen) = run(
        stack(form),
        req,
        vec![Ok(response(503, &[("do-not-retry", "0")])), Ok(status(200))],
    )
    .await;
    assert_eq!(seen.len(), 2);
    assert!(!ctx.downstream_gave_up());
}

both_forms!(
    a_do_not_retry_reply_is_not_retried_and_recorded,
    start_paused = true
);

async fn a_replayed_response_is_not_retried(form: Form) {
    for code in [503, 409, 429] {
        let req = Request::post("http://api.local/orders")
            .header("idempotency-key", "k-1")
            .body("x".to_owned())
            .unwrap();
        let replayed = response(
            code,
            &[("idempotent-replayed", "true"), ("retry-after", "1")],
        );
        let (res, seen) = run(stack(form), req, vec![Ok(replayed)]).await;
        assert_eq!(res.unwrap().status().as_u16(), code);
        assert_eq!(seen.len(), 1, "{code}");
    }
    // Without the mark, the keyed 409 "in flight" is retried after retry-after.
    let req = Request::post("http://api.local/orders")
        .header("idempotency-key", "k-1")
        .body("x".to_owned())
        .unwrap();
    let (res, seen) = run(
        stack(form),
        req,
        vec![Ok(response(409, &[("retry-after", "1")])), Ok(status(201))],
    )
    .await;
    res.unwrap();
    assert_eq!(seen.len(), 2);
    assert!(seen[1].at - seen[0].at >= Duration::from_secs(1));
}

both_forms!(a_replayed_response_is_not_retried, start_paused = true);

// ---------------------------------------------------------------------------------------
// Local failures
// ---------------------------------------------------------------------------------------

async fn grpc_statuses_answer_local_failures_with_trailers_only_responses(form: Form) {
    // An expired deadline: nothing is sent.
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = grpc_statuses(stack(form)).service(mock);
    let deadline = Deadline::after(ms(10));
    tokio::time::advance(ms(10)).await;
    let join = call(&mut svc, with(grpc_call(), deadline)).await;
    let res = join.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["content-type"], "application/grpc");
    assert_eq!(res.headers()["grpc-status"], "4");
    assert!(marked(&res));
    assert!(res.body().get_ref().is_empty());
    no_more_attempts(&mut handle).await;

    // A budget refusal from below: UNAVAILABLE, not retried.
    let (res, seen) = run(
        grpc_statuses(stack(form)),
        with(grpc_call(), Idempotent),
        vec![Err(Box::new(BudgetExhausted::new()))],
    )
    .await;
    let res = res.unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(res.headers()["grpc-status"], "14");
    assert!(marked(&res));

    // The deadline running out during an attempt: DEADLINE_EXCEEDED.
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = grpc_statuses(stack(form)).service(mock);
    let join = call(
        &mut svc,
        with(with(grpc_call(), Idempotent), Deadline::after(ms(300))),
    )
    .await;
    let (_req, _reply) = next(&mut handle).await;
    tokio::time::advance(ms(300)).await;
    settle().await;
    assert!(join.is_finished());
    let res = join.await.unwrap().unwrap();
    assert_eq!(res.headers()["grpc-status"], "4");
    assert!(marked(&res));

    // Other (non-gRPC) requests still get errors in this mode.
    let (mock, _handle) = mock::pair::<Req, Res>();
    let mut svc = grpc_statuses(stack(form)).service(mock);
    let deadline = Deadline::after(ms(1));
    tokio::time::advance(ms(1)).await;
    let err = call(&mut svc, with(get("http://api.local/x"), deadline))
        .await
        .await
        .unwrap()
        .unwrap_err();
    assert!(err.is::<DeadlineExceeded>());
}

both_forms!(
    grpc_statuses_answer_local_failures_with_trailers_only_responses,
    start_paused = true
);

async fn local_failures_are_typed_errors_by_default(form: Form) {
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let deadline = Deadline::after(ms(10));
    tokio::time::advance(ms(10)).await;
    let err = call(&mut svc, with(grpc_call(), deadline))
        .await
        .await
        .unwrap()
        .unwrap_err();
    assert!(err.is::<DeadlineExceeded>(), "{err}");
    no_more_attempts(&mut handle).await;

    let (res, seen) = run(
        stack(form),
        with(grpc_call(), Idempotent),
        vec![Err(Box::new(BudgetExhausted::new()))],
    )
    .await;
    assert_eq!(seen.len(), 1);
    assert!(find::<BudgetExhausted>(&*res.unwrap_err()).is_some());

    // The deadline running out during an attempt of a GET: an error, after giving up.
    let ctx = CallContext::new().with_deadline(Deadline::after(ms(300)));
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let join = call(&mut svc, with(get("http://api.local/x"), ctx.clone())).await;
    let (_req, _reply) = next(&mut handle).await;
    let err = join.await.unwrap().unwrap_err();
    assert!(err.is::<DeadlineExceeded>());
    assert!(ctx.downstream_gave_up());
    no_more_attempts(&mut handle).await;
}

both_forms!(
    local_failures_are_typed_errors_by_default,
    start_paused = true
);

// ---------------------------------------------------------------------------------------
// Default timeouts
// ---------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------
// Request bodies
// ---------------------------------------------------------------------------------------

async fn a_body_under_the_cap_is_replayed_byte_for_byte(form: Form) {
    let body = "{\"amount\": 125, \"note\": \"ünïcödé\"}";
    let req = Request::post("http://api.local/payments")
        .header("idempotency-key", "pay-1")
        .body(body.to_owned())
        .unwrap();
    let (res, seen) = run(
        stack(form),
        req,
        vec![Ok(status(503)), Ok(status(502)), Ok(status(201))],
    )
    .await;
    res.unwrap();
    assert_eq!(seen.len(), 3);
    for s in &seen {
        assert_eq!(s.body, body.as_bytes());
    }

    // Exactly at the cap is still replayable.
    let req = Request::post("http://api.local/payments")
        .header("idempotency-key", "pay-2")
        .body("12345678".to_owned())
        .unwrap();
    let (_, seen) = run(
        stacked(form, layer().max_replay_body(8)),
        req,
        vec![Ok(status(503)), Ok(status(201))],
    )
    .await;
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].body, "12345678");
}

both_forms!(
    a_body_under_the_cap_is_replayed_byte_for_byte,
    start_paused = true
);

async fn a_body_over_the_cap_is_sent_once(form: Form) {
    let ctx = CallContext::new();
    let req = Request::post("http://api.local/payments")
        .header("idempotency-key", "pay-3")
        .body("123456789".to_owned())
        .unwrap();
    let (res, seen) = run(
        stacked(form, layer().max_replay_body(8)),
        with(req, ctx.clone()),
        vec![Ok(status(503))],
    )
    .await;
    assert_eq!(res.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body, "123456789");
    assert!(!ctx.downstream_gave_up());
    assert!(layer().max_replay_body((1 << 30) + 1).build().is_err());
}

both_forms!(a_body_over_the_cap_is_sent_once, start_paused = true);

// ---------------------------------------------------------------------------------------
// RetryBudgetLayer and EdgeLayer
// ---------------------------------------------------------------------------------------

async fn the_budget_layer_skips_attempts_the_retry_layer_charged(form: Form) {
    // One budget shared by the RetryLayer and the RetryBudgetLayer below it (given
    // once to ClientLayers): still
    // exactly one deposit for the logical request and one withdrawal for the retry.
    let budget = ratio(0, 1.0);
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = client().budget(budget.clone()).layer(form).layer(mock);
    let join = call(&mut svc, get("http://api.local/x")).await;
    let seen = answer(&mut handle, vec![Ok(status(503)), Ok(status(200))]).await;
    assert_eq!(join.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(seen[1].header("retry-attempt"), Some("2"));
    assert_eq!(ratio_counts(&budget), (1, 1));
}

both_forms!(
    the_budget_layer_skips_attempts_the_retry_layer_charged,
    start_paused = true
);

#[tokio::test(start_paused = true)]
async fn a_buffer_between_the_retry_and_budget_layers_keeps_one_deposit_per_request() {
    // The "already counted" mark travels in the request's extensions, so a `Buffer`
    // (which calls the layers below on another task) keeps it: one deposit per logical
    // request and one withdrawal per retry, however many attempts pass the budget layer.
    let budget = ratio(0, 1.0);
    let calls = Arc::new(Mutex::new(0u32));
    let count = calls.clone();
    // Fails every first attempt with 503, then succeeds.
    let flaky = tower::service_fn(move |req: Req| {
        let retry = req.headers().contains_key("retry-attempt");
        *count.lock().unwrap() += 1;
        async move { Ok::<_, Infallible>(if retry { status(200) } else { status(503) }) }
    });
    let below = tower::ServiceBuilder::new()
        .layer(RetryBudgetLayer::new(budget.clone()))
        .service(flaky);
    let buffered = tower::buffer::Buffer::new(below, 8);
    let mut svc = RetryLayer::new()
        .strategy(strategy().budget(budget.clone()))
        .layer(buffered);
    for n in 1..=3u64 {
        let response = svc
            .ready()
            .await
            .unwrap()
            .call(get("http://api.local/x"))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(ratio_counts(&budget), (n, n));
    }
    assert_eq!(*calls.lock().unwrap(), 6);
}

#[tokio::test(start_paused = true)]
async fn without_a_budget_above_the_budget_layer_counts_every_attempt() {
    // The RetryLayer has no budget, so it marks nothing: the RetryBudgetLayer deposits
    // for the first attempt and withdraws for the retry (`retry-attempt: 2`).
    let budget = ratio(0, 1.0);
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = tower::ServiceBuilder::new()
        .layer(RetryLayer::new().strategy(strategy().no_budget()))
        .layer(RetryBudgetLayer::new(budget.clone()))
        .service(mock);
    let join = call(&mut svc, get("http://api.local/x")).await;
    let seen = answer(&mut handle, vec![Ok(status(503)), Ok(status(200))]).await;
    assert_eq!(join.await.unwrap().unwrap().status(), StatusCode::OK);
    assert!(seen[1].parts.extensions.get::<RetryCharged>().is_none());
    assert_eq!(ratio_counts(&budget), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn the_budget_layer_charges_foreign_retries() {
    let budget = ratio(0, 0.5);
    let (mock, mut handle) = mock::pair::<Request<String>, Response<String>>();
    let mut svc = RetryBudgetLayer::new(budget.clone()).layer(mock);
    let retry = || {
        Request::get("http://api.local/x")
            .header("retry-attempt", "2")
            .body(String::new())
            .unwrap()
    };

    // Nothing deposited yet: a marked retry is refused without reaching the service.
    let err = svc.ready().await.unwrap().call(retry()).await.unwrap_err();
    assert!(err.is::<BudgetExhausted>());
    assert_eq!(ratio_counts(&budget), (0, 0));

    // Two first attempts deposit; half of them may be retried.
    for _ in 0..2 {
        let fut = svc.ready().await.unwrap().call(get("http://api.local/x"));
        let (_, reply) = handle.next_request().await.unwrap();
        reply.send_response(status(200));
        fut.await.unwrap();
    }
    assert_eq!(ratio_counts(&budget), (2, 0));
    let fut = svc.ready().await.unwrap().call(retry());
    let (_, reply) = handle.next_request().await.unwrap();
    reply.send_response(status(200));
    fut.await.unwrap();
    assert_eq!(ratio_counts(&budget), (2, 1));
    let err = svc.ready().await.unwrap().call(retry()).await.unwrap_err();
    assert!(err.is::<BudgetExhausted>());
    assert_eq!(ratio_counts(&budget), (2, 1));

    // `retry-attempt: 1` is a first attempt; a RetryCharged extension is skipped.
    let first = Request::get("http://api.local/x")
        .header("retry-attempt", "1")
        .body(String::new())
        .unwrap();
    let fut = svc.ready().await.unwrap().call(first);
    let (_, reply) = handle.next_request().await.unwrap();
    reply.send_response(status(200));
    fut.await.unwrap();
    assert_eq!(ratio_counts(&budget), (3, 1));
    let charged = with(retry(), RetryCharged::new(2, budget.id()));
    let fut = svc.ready().await.unwrap().call(charged);
    let (_, reply) = handle.next_request().await.unwrap();
    reply.send_response(status(200));
    fut.await.unwrap();
    assert_eq!(ratio_counts(&budget), (3, 1));
    // Charged to another budget: this one still counts it.
    let other = ratio(0, 0.0);
    let charged_elsewhere = with(retry(), RetryCharged::new(2, other.id()));
    // (3 deposits at 50 % afford one retry, already taken: refused, not skipped.)
    let err = svc
        .ready()
        .await
        .unwrap()
        .call(charged_elsewhere)
        .await
        .unwrap_err();
    assert!(err.is::<BudgetExhausted>());
    assert_eq!(ratio_counts(&budget), (3, 1));

    // Under a GrpcStatusLayer, a refused gRPC retry is UNAVAILABLE.
    let (mock, _handle) = mock::pair::<Request<String>, Response<String>>();
    let mut svc = GrpcStatusLayer::new().layer(RetryBudgetLayer::new(ratio(0, 0.0)).layer(mock));
    let mut req = grpc_call();
    req.headers_mut()
        .insert("retry-attempt", "3".parse().unwrap());
    let res = svc.ready().await.unwrap().call(req).await.unwrap();
    assert_eq!(res.headers()["grpc-status"], "14");
    assert!(marked(&res));
}

async fn problem_body<B>(res: Response<B>) -> serde_json::Value
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap()
}

/// Answers every request with the `retry-attempt` header it saw (or `none`).
#[derive(Clone, Copy)]
struct Echo;

impl Service<Request<Full<Bytes>>> for Echo {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Full<Bytes>>) -> Self::Future {
        let seen = req
            .headers()
            .get("retry-attempt")
            .map_or("none".to_owned(), |v| v.to_str().unwrap().to_owned());
        std::future::ready(Ok(Response::new(Full::new(Bytes::from(seen)))))
    }
}

fn raw(uri: &str, headers: &[(&'static str, &str)]) -> Request<Full<Bytes>> {
    let mut b = Request::get(uri);
    for (name, value) in headers {
        b = b.header(*name, *value);
    }
    b.body(Full::new(Bytes::new())).unwrap()
}

#[tokio::test(start_paused = true)]
async fn the_server_budget_layer_answers_503_problems_with_do_not_retry() {
    let budget = ratio(0, 0.0);
    let svc = RetryBudgetLayer::new(budget.clone()).server().layer(Echo);
    let res = svc
        .clone()
        .oneshot(raw("http://api.local/x", &[("retry-attempt", "2")]))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    assert!(res.headers().get("do-not-retry").is_some_and(|v| v == "1"));
    let problem = problem_body(res).await;
    assert_eq!(
        problem["type"],
        "urn:retrysafe:problem:retry-budget-exhausted"
    );
    assert_eq!(problem["status"], 503);

    // A first attempt passes (and deposits).
    let res = svc
        .clone()
        .oneshot(raw("http://api.local/x", &[]))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(ratio_counts(&budget), (1, 0));

    // gRPC on the server path: UNAVAILABLE.
    let res = svc
        .oneshot(raw(
            "http://api.local/pkg.S/M",
            &[("content-type", "application/grpc"), ("retry-attempt", "2")],
        ))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["grpc-status"], "14");
    assert!(res.headers().get("do-not-retry").is_some_and(|v| v == "1"));
}

#[tokio::test(start_paused = true)]
async fn the_edge_layer_strips_a_forged_retry_attempt_before_the_budget() {
    let budget = ratio(0, 0.0);
    let behind_edge = tower::ServiceBuilder::new()
        .layer(EdgeLayer::new())
        .layer(RetryBudgetLayer::new(budget.clone()).server())
        .service(Echo);
    let forged = || {
        raw(
            "http://api.local/x",
            &[("retry-attempt", "5"), ("retry-point", "caller")],
        )
    };
    let res = behind_edge.oneshot(forged()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // The handler never saw it, and the budget counted a first attempt.
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "none");
    assert_eq!(ratio_counts(&budget), (1, 0));

    // Without the edge, the same forged header is charged (and refused).
    let exposed = RetryBudgetLayer::new(budget.clone()).server().layer(Echo);
    let res = exposed.oneshot(forged()).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(ratio_counts(&budget), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_budget_layer_with_its_own_budget_counts_a_retry_layers_attempts() {
    // `RetryLayer::new()` keeps a private ratio budget; a shared budget below it is
    // another budget, so it still sees one deposit and one withdrawal per retry.
    let shared = ratio(0, 1.0);
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = tower::ServiceBuilder::new()
        .layer(layer())
        .layer(RetryBudgetLayer::new(shared.clone()))
        .service(mock);
    let join = call(&mut svc, get("http://api.local/x")).await;
    let seen = answer(&mut handle, vec![Ok(status(503)), Ok(status(200))]).await;
    assert_eq!(join.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(seen.len(), 2);
    assert_eq!(ratio_counts(&shared), (1, 1));

    // A shared budget that affords no retry stops the RetryLayer's retries.
    let strict = ratio(0, 0.0);
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = tower::ServiceBuilder::new()
        .layer(layer())
        .layer(RetryBudgetLayer::new(strict.clone()))
        .service(mock);
    let ctx = CallContext::new();
    let join = call(&mut svc, with(get("http://api.local/x"), ctx.clone())).await;
    let seen = answer(&mut handle, vec![Ok(status(503))]).await;
    // The refused retry never reaches the service; the caller gets the last real
    // response, marked, and the context records that downstream gave up.
    let res = join.await.unwrap().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(marked(&res));
    assert!(ctx.downstream_gave_up());
    no_more_attempts(&mut handle).await;
}

/// A layer below that refuses after a real response: the retry layer gives up with that
/// real response, marked — also under the `GrpcStatusLayer` of a gRPC stack, which
/// synthesises statuses only for refusals that reach it.
async fn a_synthesised_refusal_below_after_a_real_response_gives_up_with_the_real_one(form: Form) {
    use retrysafe_core::breaker::{BreakerConfig, CircuitBreaker};
    use retrysafe_tower::breaker::CircuitBreakerLayer;

    fn unavailable() -> Response<String> {
        Response::builder()
            .header("content-type", "application/grpc")
            .header("grpc-status", "14")
            .header("grpc-message", "real")
            .body(String::new())
            .unwrap()
    }
    for synthesised in [false, true] {
        let mut config = BreakerConfig::default();
        config = config.with_minimum_calls(1); // the first failure opens it
        let breaker = CircuitBreaker::new(config);
        let calls = Arc::new(Mutex::new(0u32));
        let count = Arc::clone(&calls);
        let inner = tower::service_fn(move |_r: Request<ReplayBody<String>>| {
            *count.lock().unwrap() += 1;
            async move { Ok::<_, Infallible>(unavailable()) }
        });
        let gave_up = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&gave_up);
        let retry = RetryLayer::new()
            .on_give_up(move |e: &GiveUpEvent| seen.lock().unwrap().push(e.reason));
        let stack = Client::new()
            .strategy(StandardRetryStrategy::new().seed(1))
            .retry(retry)
            .breaker(CircuitBreakerLayer::new(breaker))
            .layer(form);
        let mut req = Request::post("http://svc/pkg.Svc/Get")
            .header("content-type", "application/grpc")
            .body(String::new())
            .unwrap();
        req.extensions_mut().insert(Idempotent);
        let res = if synthesised {
            grpc_statuses(stack)
                .service(inner)
                .oneshot(req)
                .await
                .unwrap()
        } else {
            stack.layer(inner).oneshot(req).await.unwrap()
        };
        assert_eq!(*calls.lock().unwrap(), 1, "synthesised: {synthesised}");
        assert_eq!(
            res.headers()["grpc-message"],
            "real",
            "synthesised: {synthesised}"
        );
        assert_eq!(res.headers()["do-not-retry"], "1");
        assert_eq!(*gave_up.lock().unwrap(), vec![GiveUp::RefusedBelow]);
    }
}

both_forms!(
    a_synthesised_refusal_below_after_a_real_response_gives_up_with_the_real_one,
    start_paused = true
);

/// Retried, then a failure that is not retryable: the layer gave up all the same, so
/// the inherited context records it (the server above marks its own failure).
async fn a_final_failure_after_retries_marks_the_context(form: Form) {
    for (second, marked) in [(500, true), (404, false)] {
        let answers = Arc::new(Mutex::new(vec![503u16, second]));
        let inner = tower::service_fn(move |_r: Request<ReplayBody<String>>| {
            let code = answers.lock().unwrap().remove(0);
            async move {
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(code)
                        .body(String::new())
                        .unwrap(),
                )
            }
        });
        let svc = Client::new()
            .strategy(StandardRetryStrategy::new().seed(1))
            .layer(form)
            .layer(inner);
        let ctx = CallContext::new();
        let res = ctx
            .clone()
            .scope(svc.oneshot(Request::get("http://api/x").body(String::new()).unwrap()))
            .await
            .unwrap();
        assert_eq!(res.status().as_u16(), second);
        assert!(res.headers().get("do-not-retry").is_none());
        assert_eq!(ctx.downstream_gave_up(), marked, "{second}");
    }
}

both_forms!(
    a_final_failure_after_retries_marks_the_context,
    start_paused = true
);
