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

mod attempts;
mod bodies;
mod budget_and_edge;
mod deadline_headers;
mod default_timeouts;
mod delays;
mod giving_up;
mod keys;
mod local_failures;
mod readiness;
mod retry_point;

use std::io;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use retrysafe_core::backoff::{Backoff, RngSource};
use retrysafe_core::budget::{BudgetSnapshot, RatioConfig, RetryBudget};
use retrysafe_core::strategy::StandardRetryStrategy;
use retrysafe_test_support::forms::{Client, Form, FormLayer};
use retrysafe_tower::BoxError;
use retrysafe_tower::answer::GrpcStatusLayer;
use retrysafe_tower::retry::{GiveUpEvent, ReplayBody, RetryEvent, RetryLayer};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower::layer::util::{Identity, Stack};
use tower::{Layer, Service, ServiceBuilder, ServiceExt};
use tower_test::mock;

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
