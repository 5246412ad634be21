//! `CircuitBreakerLayer` at the poll level, over `tower-test` mocks on a paused clock.
//!
//! The breaker's behaviour runs on both forms of the client stack (`both_forms!`,
//! `retrysafe_test_support::forms`): the separate layers stacked by hand and
//! `ClientLayers`, built from one description whose retry makes one attempt per call,
//! so the breaker sees each call once. Single-form, with no stack behaviour to share:
//! - `invalid_configuration_is_refused`: the validation of `BreakerConfig` and
//!   `KeyedBreakers`;
//! - `futures_and_bodies_are_send`: the types of the standalone `CircuitBreakerService`.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::uri::Authority;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use retrysafe_core::breaker::{BreakerConfig, CircuitBreaker, State};
use retrysafe_core::error::{CircuitOpen, find};
use retrysafe_core::strategy::StandardRetryStrategy;
use retrysafe_tower::BoxError;
use retrysafe_tower::answer::GrpcStatusLayer;
use retrysafe_tower::breaker::{CircuitBreakerLayer, KeyedBreakers, ResponseBody};
use retrysafe_tower::retry::ReplayBody;
use tower::{Layer, Service, ServiceExt};
use tower_test::mock::{self, Handle};

use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::{Client, Form, FormLayer};

/// A response body: one data frame, then optional trailers.
#[derive(Debug, Default)]
struct TestBody {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl TestBody {
    fn grpc(status: &'static str) -> Self {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static(status));
        TestBody {
            data: Some(Bytes::from_static(b"\0\0\0\0\0")),
            trailers: Some(trailers),
        }
    }
}

impl Body for TestBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(data) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }
}

type Req = Request<String>;
/// A request as the transport below a client stack gets it.
type Sent = Request<ReplayBody<String>>;
type Res = Response<TestBody>;
type Out = Result<Response<ResponseBody<TestBody>>, BoxError>;

/// The client stack in `form` with `breaker`, its retry making one attempt per call.
fn stack(form: Form, breaker: CircuitBreakerLayer) -> FormLayer {
    Client::new()
        .strategy(StandardRetryStrategy::new().max_attempts(1))
        .breaker(breaker)
        .layer(form)
}

fn config(minimum_calls: u32, probes: u32) -> BreakerConfig {
    let mut config = BreakerConfig::default();
    config = config.with_minimum_calls(minimum_calls);
    config = config.with_half_open_probes(probes);
    config
}

fn get(uri: &str) -> Req {
    Request::get(uri).body(String::new()).unwrap()
}

fn grpc() -> Req {
    Request::post("http://svc.example/pkg.Service/Method")
        .header("content-type", "application/grpc")
        .body(String::new())
        .unwrap()
}

fn status(code: u16) -> Res {
    let mut response = Response::new(TestBody::default());
    *response.status_mut() = StatusCode::from_u16(code).unwrap();
    response
}

fn grpc_response(body: TestBody) -> Res {
    let mut response = Response::new(body);
    response
        .headers_mut()
        .insert("content-type", HeaderValue::from_static("application/grpc"));
    response
}

/// Calls `svc` with `request` and answers it with `response` through `handle` (unless
/// the call is answered without reaching the inner service).
async fn exchange<S, T>(
    svc: &mut S,
    handle: &mut Handle<T, Res>,
    request: Req,
    response: Res,
) -> Out
where
    S: Service<Req, Response = Response<ResponseBody<TestBody>>, Error = BoxError>,
{
    let mut future = std::pin::pin!(svc.ready().await.unwrap().call(request));
    tokio::select! {
        biased;
        out = &mut future => return out,
        next = handle.next_request() => {
            let (_, send) = next.expect("the mock is alive");
            send.send_response(response);
        }
    }
    future.await
}

/// The `CircuitOpen` a refused call failed with.
fn refusal(out: Option<Out>) -> CircuitOpen {
    let error = match out {
        Some(Err(error)) => error,
        Some(Ok(response)) => panic!("admitted: {response:?}"),
        None => panic!("not answered at once"),
    };
    find::<CircuitOpen>(&*error)
        .unwrap_or_else(|| panic!("not CircuitOpen: {error}"))
        .clone()
}

/// Opens `breaker` by answering `n` calls with 503.
async fn open<S, T>(svc: &mut S, handle: &mut Handle<T, Res>, breaker: &CircuitBreaker, n: u32)
where
    S: Service<Req, Response = Response<ResponseBody<TestBody>>, Error = BoxError>,
{
    for _ in 0..n {
        let response = exchange(svc, handle, get("http://a.example/"), status(503)).await;
        assert_eq!(response.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
    }
    assert_eq!(breaker.state(), State::Open);
}

async fn closed_drives_readiness_in_the_future_and_open_fails_fast(form: Form) {
    let (mock, mut handle) = mock::pair::<Sent, Res>();
    let breaker = CircuitBreaker::new(config(2, 3));
    let mut svc = stack(form, CircuitBreakerLayer::new(breaker.clone())).layer(mock);

    // The inner service is not ready: the breaker still is, and a closed breaker's
    // call waits for the inner readiness inside its future.
    handle.allow(0);
    assert!(svc.ready().now_or_never().unwrap().is_ok());
    let mut waiting = Box::pin(svc.call(get("http://a.example/")));
    assert!(waiting.as_mut().now_or_never().is_none());
    assert!(handle.poll_request().is_pending());
    handle.allow(1);
    let respond = async {
        let (_, send) = handle.next_request().await.unwrap();
        send.send_response(status(200));
    };
    let (out, ()) = tokio::join!(waiting, respond);
    assert_eq!(out.unwrap().status(), StatusCode::OK);
    assert_eq!(breaker.window().successes, 1);

    handle.allow(u64::MAX);
    // 1 success, 1 failure: 50 % of 2 calls, at least 2.
    open(&mut svc, &mut handle, &breaker, 1).await;

    // Open, inner not ready: refused at once, the inner service never sees it.
    handle.allow(0);
    assert!(svc.ready().now_or_never().unwrap().is_ok());
    let open = refusal(svc.call(get("http://a.example/")).now_or_never());
    assert_eq!(open.retry_in(), Duration::from_secs(5));
    assert!(handle.poll_request().is_pending());

    tokio::time::advance(Duration::from_secs(2)).await;
    let open = refusal(svc.call(get("http://a.example/")).now_or_never());
    assert_eq!(open.retry_in(), Duration::from_secs(3));
}

both_forms!(
    closed_drives_readiness_in_the_future_and_open_fails_fast,
    start_paused = true
);

/// A transport whose first instance to be polled fails its readiness, and stays failed:
/// tower's contract is that such an instance is discarded, not called again.
#[derive(Clone)]
struct FailsOnce {
    /// Whether the next instance polled fails (shared by every clone).
    fail_next: Arc<Mutex<bool>>,
    /// This instance failed its readiness.
    failed: bool,
    calls: Arc<Mutex<u32>>,
}

impl Service<Sent> for FailsOnce {
    type Response = Res;
    type Error = BoxError;
    type Future = std::future::Ready<Result<Res, BoxError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        if !self.failed && std::mem::take(&mut *self.fail_next.lock().unwrap()) {
            self.failed = true;
        }
        if self.failed {
            return Poll::Ready(Err("this instance is broken".into()));
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Sent) -> Self::Future {
        assert!(!self.failed, "called an instance that failed its readiness");
        *self.calls.lock().unwrap() += 1;
        std::future::ready(Ok(status(200)))
    }
}

async fn an_instance_that_failed_its_readiness_is_not_called_again(form: Form) {
    let calls = Arc::new(Mutex::new(0));
    let transport = FailsOnce {
        fail_next: Arc::new(Mutex::new(true)),
        failed: false,
        calls: calls.clone(),
    };
    let breaker = CircuitBreaker::new(config(10, 1));
    let mut svc = stack(form, CircuitBreakerLayer::new(breaker.clone())).layer(transport);

    // The first call's transport fails its readiness: that call fails, recorded. The
    // next calls go to a sound instance.
    for n in 0..4 {
        let answer = svc
            .ready()
            .await
            .unwrap()
            .call(get("http://a.example/"))
            .await;
        if n == 0 {
            assert!(answer.unwrap_err().to_string().contains("broken"));
            assert_eq!(breaker.window().failures, 1);
        } else {
            assert_eq!(answer.unwrap().status(), StatusCode::OK);
        }
    }
    assert_eq!(*calls.lock().unwrap(), 3);
    assert_eq!(breaker.window().successes, 3);
}

both_forms!(
    an_instance_that_failed_its_readiness_is_not_called_again,
    start_paused = true
);

async fn half_open_admits_exactly_the_probes(form: Form) {
    let (mock, mut handle) = mock::pair::<Sent, Res>();
    let breaker = CircuitBreaker::new(config(2, 3));
    let mut svc = stack(form, CircuitBreakerLayer::new(breaker.clone())).layer(mock);
    open(&mut svc, &mut handle, &breaker, 2).await;

    tokio::time::advance(Duration::from_secs(5)).await;
    handle.allow(0);
    let mut admitted = Vec::new();
    let mut refused = 0;
    for _ in 0..20 {
        let mut future = Box::pin(svc.call(get("http://a.example/")));
        match future.as_mut().now_or_never() {
            None => admitted.push(future),
            Some(out) => {
                refusal(Some(out));
                refused += 1;
            }
        }
    }
    assert_eq!((admitted.len(), refused), (3, 17));
    assert_eq!(breaker.state(), State::HalfOpen);

    // The three probes succeed: the breaker closes.
    handle.allow(3);
    let respond = async {
        for _ in 0..3 {
            let (_, send) = handle.next_request().await.unwrap();
            send.send_response(status(200));
        }
    };
    let (outs, ()) = tokio::join!(futures_util::future::join_all(admitted), respond);
    assert!(
        outs.into_iter()
            .all(|out| out.unwrap().status() == StatusCode::OK)
    );
    assert_eq!(breaker.state(), State::Closed);
}

both_forms!(half_open_admits_exactly_the_probes, start_paused = true);

async fn a_dropped_probe_reopens_the_breaker(form: Form) {
    let (mock, mut handle) = mock::pair::<Sent, Res>();
    let breaker = CircuitBreaker::new(config(2, 1));
    let mut svc = stack(form, CircuitBreakerLayer::new(breaker.clone())).layer(mock);
    open(&mut svc, &mut handle, &breaker, 2).await;

    // A probe dropped while waiting for readiness.
    tokio::time::advance(Duration::from_secs(5)).await;
    handle.allow(0);
    let mut probe = Box::pin(svc.call(get("http://a.example/")));
    assert!(probe.as_mut().now_or_never().is_none());
    assert_eq!(breaker.state(), State::HalfOpen);
    drop(probe);
    assert_eq!(breaker.state(), State::Open);
    // Reopened: the open duration doubled.
    assert_eq!(
        refusal(svc.call(get("http://a.example/")).now_or_never()).retry_in(),
        Duration::from_secs(10)
    );

    // A probe dropped while its request is in flight.
    tokio::time::advance(Duration::from_secs(10)).await;
    handle.allow(1);
    let mut probe = Box::pin(svc.call(get("http://a.example/")));
    assert!(probe.as_mut().now_or_never().is_none());
    let (_, _send) = handle.next_request().await.unwrap();
    assert_eq!(breaker.state(), State::HalfOpen);
    drop(probe);
    assert_eq!(breaker.state(), State::Open);
}

both_forms!(a_dropped_probe_reopens_the_breaker, start_paused = true);

async fn half_open_times_out_when_probes_never_report(form: Form) {
    let (mock, mut handle) = mock::pair::<Sent, Res>();
    let mut config = config(2, 1);
    config = config.with_half_open_timeout(Duration::from_secs(2));
    let breaker = CircuitBreaker::new(config);
    let mut svc = stack(form, CircuitBreakerLayer::new(breaker.clone())).layer(mock);
    open(&mut svc, &mut handle, &breaker, 2).await;

    tokio::time::advance(Duration::from_secs(5)).await;
    handle.allow(0);
    let mut probe = Box::pin(svc.call(get("http://a.example/")));
    assert!(probe.as_mut().now_or_never().is_none());
    let open = refusal(svc.call(get("http://a.example/")).now_or_never());
    assert_eq!(open.retry_in(), Duration::from_secs(2));

    tokio::time::advance(Duration::from_secs(2)).await;
    refusal(svc.call(get("http://a.example/")).now_or_never());
    assert_eq!(breaker.state(), State::Open);
    // The stale probe's late drop changes nothing.
    drop(probe);
    assert_eq!(breaker.state(), State::Open);
}

both_forms!(
    half_open_times_out_when_probes_never_report,
    start_paused = true
);

async fn dependency_and_caller_deadline_failures_are_neutral(form: Form) {
    let (mock, mut handle) = mock::pair::<Sent, Res>();
    let breaker = CircuitBreaker::new(config(2, 3));
    let mut svc = stack(form, CircuitBreakerLayer::new(breaker.clone())).layer(mock);

    for _ in 0..10 {
        // A downstream gave up on its own dependency.
        let mut marked = status(503);
        marked
            .headers_mut()
            .insert("do-not-retry", HeaderValue::from_static("1"));
        let out = exchange(&mut svc, &mut handle, get("http://a.example/"), marked).await;
        assert_eq!(out.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);

        // A 504 caused by the deadline this caller sent: it comes when the 100 ms are
        // (nearly) spent.
        let request = Request::get("http://a.example/")
            .header("request-timeout-ms", "100")
            .body(String::new())
            .unwrap();
        let out = answer_after(&mut svc, &mut handle, request, status(504), 95).await;
        assert_eq!(out.unwrap().status(), StatusCode::GATEWAY_TIMEOUT);

        // A layer below refused locally (another breaker).
        let future = svc.ready().await.unwrap().call(get("http://a.example/"));
        let respond = async {
            let (_, send) = handle.next_request().await.unwrap();
            send.send_error(CircuitOpen::new(Duration::from_secs(1)));
        };
        let (out, ()) = tokio::join!(future, respond);
        assert!(find::<CircuitOpen>(&*out.unwrap_err()).is_some());
    }
    assert_eq!(breaker.state(), State::Closed);
    assert_eq!(breaker.window().calls(), 0);

    // Client errors are the callee's successes; a transport failure is its failure.
    let out = exchange(&mut svc, &mut handle, get("http://a.example/"), status(404)).await;
    assert_eq!(out.unwrap().status(), StatusCode::NOT_FOUND);
    assert_eq!(breaker.window().successes, 1);
    let future = svc.ready().await.unwrap().call(get("http://a.example/"));
    let respond = async {
        let (_, send) = handle.next_request().await.unwrap();
        send.send_error(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
    };
    let (out, ()) = tokio::join!(future, respond);
    assert!(out.is_err());
    assert_eq!(breaker.window().failures, 1);
    assert_eq!(breaker.state(), State::Open);
}

both_forms!(
    dependency_and_caller_deadline_failures_are_neutral,
    start_paused = true
);

/// Calls `svc` with `request` and answers it with `response` after `ms` milliseconds.
async fn answer_after<S, T>(
    svc: &mut S,
    handle: &mut Handle<T, Res>,
    request: Req,
    response: Res,
    ms: u64,
) -> Result<Response<ResponseBody<TestBody>>, BoxError>
where
    S: Service<Req, Response = Response<ResponseBody<TestBody>>, Error = BoxError>,
{
    let future = svc.ready().await.unwrap().call(request);
    let respond = async {
        let (_, send) = handle.next_request().await.unwrap();
        tokio::time::sleep(Duration::from_millis(ms)).await;
        send.send_response(response);
    };
    let (out, ()) = tokio::join!(future, respond);
    out
}

async fn a_timeout_long_before_the_deadline_sent_is_the_callees_fault(form: Form) {
    let (mock, mut handle) = mock::pair::<Sent, Res>();
    let breaker = CircuitBreaker::new(config(2, 3));
    let mut svc = stack(form, CircuitBreakerLayer::new(breaker.clone())).layer(mock);

    // 1 s given, answered 504 after 100 ms: the callee's own timeout, a failure.
    let request = Request::get("http://a.example/")
        .header("request-timeout-ms", "1000")
        .body(String::new())
        .unwrap();
    let out = answer_after(&mut svc, &mut handle, request, status(504), 100).await;
    assert_eq!(out.unwrap().status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(breaker.window().failures, 1);

    // gRPC: DEADLINE_EXCEEDED after 300 ms of 10 s given: a failure too.
    let mut request = grpc();
    request
        .headers_mut()
        .insert("grpc-timeout", HeaderValue::from_static("10S"));
    let mut response = status(200);
    response
        .headers_mut()
        .insert("content-type", HeaderValue::from_static("application/grpc"));
    response
        .headers_mut()
        .insert("grpc-status", HeaderValue::from_static("4"));
    let out = answer_after(&mut svc, &mut handle, request, response, 300).await;
    assert!(out.is_ok());
    assert_eq!(breaker.window().failures, 2);
    assert_eq!(breaker.state(), State::Open);

    // The same answers when the deadline is spent are neutral.
    let breaker = CircuitBreaker::new(config(2, 3));
    let (mock, mut handle) = mock::pair::<Sent, Res>();
    let mut svc = stack(form, CircuitBreakerLayer::new(breaker.clone())).layer(mock);
    for _ in 0..5 {
        let request = Request::get("http://a.example/")
            .header("request-timeout-ms", "1000")
            .body(String::new())
            .unwrap();
        let out = answer_after(&mut svc, &mut handle, request, status(504), 990).await;
        assert_eq!(out.unwrap().status(), StatusCode::GATEWAY_TIMEOUT);
    }
    assert_eq!(breaker.window().calls(), 0);
    assert_eq!(breaker.state(), State::Closed);
}

both_forms!(
    a_timeout_long_before_the_deadline_sent_is_the_callees_fault,
    start_paused = true
);

async fn grpc_status_in_trailers_counts_at_end_of_stream(form: Form) {
    let (mock, mut handle) = mock::pair::<Sent, Res>();
    let breaker = CircuitBreaker::new(config(4, 3));
    let mut svc = stack(form, CircuitBreakerLayer::new(breaker.clone())).layer(mock);

    // INTERNAL in the trailers: nothing recorded at the head, a failure at the end.
    let response = grpc_response(TestBody::grpc("13"));
    let out = exchange(&mut svc, &mut handle, grpc(), response)
        .await
        .unwrap();
    assert!(out.body().is_pending());
    assert_eq!(breaker.window().calls(), 0);
    let collected = out.into_body().collect().await.unwrap();
    assert_eq!(collected.trailers().unwrap()["grpc-status"], "13");
    assert_eq!(breaker.window().failures, 1);

    // OK in the trailers: a success.
    let response = grpc_response(TestBody::grpc("0"));
    let out = exchange(&mut svc, &mut handle, grpc(), response)
        .await
        .unwrap();
    out.into_body().collect().await.unwrap();
    assert_eq!(breaker.window().successes, 1);

    // A body dropped before its end: neutral.
    let response = grpc_response(TestBody::grpc("13"));
    let out = exchange(&mut svc, &mut handle, grpc(), response)
        .await
        .unwrap();
    drop(out);
    assert_eq!(breaker.window().calls(), 2);

    // A Trailers-Only UNAVAILABLE is recorded at the head.
    let mut trailers_only = grpc_response(TestBody::default());
    trailers_only
        .headers_mut()
        .insert("grpc-status", HeaderValue::from_static("14"));
    let out = exchange(&mut svc, &mut handle, grpc(), trailers_only)
        .await
        .unwrap();
    assert!(!out.body().is_pending());
    assert_eq!(breaker.window().failures, 2);
    assert_eq!(breaker.state(), State::Closed);

    // A fourth call, failing in its trailers, opens the breaker (3 of 4) at its end.
    let response = grpc_response(TestBody::grpc("13"));
    let out = exchange(&mut svc, &mut handle, grpc(), response)
        .await
        .unwrap();
    assert_eq!(breaker.state(), State::Closed);
    out.into_body().collect().await.unwrap();
    assert_eq!(breaker.state(), State::Open);
}

both_forms!(
    grpc_status_in_trailers_counts_at_end_of_stream,
    start_paused = true
);

async fn grpc_statuses_synthesise_unavailable(form: Form) {
    let (mock, mut handle) = mock::pair::<Sent, Res>();
    let breaker = CircuitBreaker::default();
    let mut svc = GrpcStatusLayer::new()
        .layer(stack(form, CircuitBreakerLayer::new(breaker.clone())).layer(mock));
    breaker.force_open();

    let response = svc.call(grpc()).now_or_never().unwrap().unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["grpc-status"], "14");
    assert_eq!(response.headers()["do-not-retry"], "1");
    assert_eq!(response.headers()["content-type"], "application/grpc");

    // Not gRPC: the error.
    refusal(svc.call(get("http://a.example/")).now_or_never());
    assert!(handle.poll_request().is_pending());
}

both_forms!(grpc_statuses_synthesise_unavailable, start_paused = true);

async fn keyed_breakers_are_independent_per_authority(form: Form) {
    let (mock, mut handle) = mock::pair::<Sent, Res>();
    let changes = Arc::new(Mutex::new(Vec::new()));
    let seen = changes.clone();
    let breakers = KeyedBreakers::per_authority(config(2, 3)).on_state_change(
        move |key: &Option<Authority>, change| {
            seen.lock()
                .unwrap()
                .push((key.clone(), change.from, change.to));
        },
    );
    let mut svc = stack(form, CircuitBreakerLayer::keyed(breakers.clone())).layer(mock);

    for _ in 0..2 {
        let out = exchange(
            &mut svc,
            &mut handle,
            get("http://a.example/x"),
            status(502),
        )
        .await;
        assert_eq!(out.unwrap().status(), StatusCode::BAD_GATEWAY);
    }
    let a = breakers
        .get(&Some(Authority::from_static("a.example")))
        .unwrap();
    assert_eq!(a.state(), State::Open);
    refusal(svc.call(get("http://a.example/y")).now_or_never());

    // b.example has its own breaker, closed; so does a request with only a Host header.
    let out = exchange(
        &mut svc,
        &mut handle,
        get("http://b.example/x"),
        status(200),
    )
    .await;
    assert_eq!(out.unwrap().status(), StatusCode::OK);
    let host_only = Request::get("/x")
        .header("host", "c.example")
        .body(String::new())
        .unwrap();
    let out = exchange(&mut svc, &mut handle, host_only, status(200)).await;
    assert_eq!(out.unwrap().status(), StatusCode::OK);
    let b = breakers
        .get(&Some(Authority::from_static("b.example")))
        .unwrap();
    assert_eq!((b.state(), b.window().successes), (State::Closed, 1));
    let c = breakers
        .get(&Some(Authority::from_static("c.example")))
        .unwrap();
    assert_eq!(c.window().successes, 1);

    let changes = changes.lock().unwrap();
    assert_eq!(
        *changes,
        vec![(
            Some(Authority::from_static("a.example")),
            State::Closed,
            State::Open
        )]
    );
}

both_forms!(
    keyed_breakers_are_independent_per_authority,
    start_paused = true
);

async fn on_state_change_reports_every_transition(form: Form) {
    let (mock, mut handle) = mock::pair::<Sent, Res>();
    let changes = Arc::new(Mutex::new(Vec::new()));
    let seen = changes.clone();
    let mut config = config(2, 1);
    config = config.with_on_state_change(move |change| {
        seen.lock().unwrap().push((change.from, change.to));
    });
    let mut svc = stack(form, CircuitBreakerLayer::with_config(config)).layer(mock);

    for _ in 0..2 {
        let out = exchange(&mut svc, &mut handle, get("http://a.example/"), status(503)).await;
        assert_eq!(out.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
    }
    refusal(svc.call(get("http://a.example/")).now_or_never());
    tokio::time::advance(Duration::from_secs(5)).await;
    let out = exchange(&mut svc, &mut handle, get("http://a.example/"), status(200)).await;
    assert_eq!(out.unwrap().status(), StatusCode::OK);

    assert_eq!(
        *changes.lock().unwrap(),
        vec![
            (State::Closed, State::Open),
            (State::Open, State::HalfOpen),
            (State::HalfOpen, State::Closed),
        ]
    );
}

both_forms!(
    on_state_change_reports_every_transition,
    start_paused = true
);

#[test]
fn invalid_configuration_is_refused() {
    let mut bad = BreakerConfig::default();
    bad = bad.with_half_open_probes(0);
    let error = bad.clone().build().unwrap_err();
    assert_eq!(error.field(), "half_open_probes");
    let error = KeyedBreakers::per_authority(bad).build().unwrap_err();
    assert_eq!(error.field(), "half_open_probes");

    let keyed = KeyedBreakers::new(BreakerConfig::default(), |p| p.uri.path().to_owned());
    assert_eq!(
        keyed.clone().max_keys(0).build().unwrap_err().field(),
        "max_keys"
    );
    assert_eq!(
        keyed.clone().max_keys(1 << 21).build().unwrap_err().field(),
        "max_keys"
    );
    assert!(keyed.max_keys(16).build().is_ok());
}

/// The layer wraps a plain `service_fn`, whose future is not `Unpin`.
async fn wraps_a_plain_service_fn(form: Form) {
    let svc =
        stack(form, CircuitBreakerLayer::default()).layer(tower::service_fn(|_req: Sent| async {
            tokio::task::yield_now().await;
            Ok::<_, Infallible>(Response::new(TestBody::default()))
        }));
    let response = svc.oneshot(get("http://a.example/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.body().is_end_stream());
}

both_forms!(wraps_a_plain_service_fn, start_paused = true);

#[test]
fn futures_and_bodies_are_send() {
    fn send<T: Send + 'static>() {}
    type Svc = retrysafe_tower::breaker::CircuitBreakerService<mock::Mock<Req, Res>>;
    send::<Svc>();
    send::<<Svc as Service<Req>>::Future>();
    send::<ResponseBody<TestBody>>();
}

async fn behind_a_full_buffer_an_open_breaker_still_fails_fast(form: Form) {
    // A tower `Buffer` (what a tonic `Channel` is) whose one slot is taken and whose
    // worker cannot make progress: the inner service is not ready.
    let (mock, mut handle) = mock::pair::<Sent, Res>();
    handle.allow(0);
    let buffered = tower::buffer::Buffer::new(mock, 1);
    let breaker = CircuitBreaker::new(config(2, 3));
    let mut svc = stack(form, CircuitBreakerLayer::new(breaker.clone())).layer(buffered);

    // Two closed calls queue: one in the buffer's channel, one waiting for a slot.
    let mut first = Box::pin(svc.ready().await.unwrap().call(get("http://a.example/")));
    let mut second = Box::pin(svc.ready().await.unwrap().call(get("http://a.example/")));
    assert!(first.as_mut().now_or_never().is_none());
    assert!(second.as_mut().now_or_never().is_none());
    assert!(handle.poll_request().is_pending());

    // Opened (by hand here; by failures elsewhere in practice): new calls are refused at
    // once, although the buffer behind is full and its service not ready.
    breaker.force_open();
    for _ in 0..100 {
        assert!(svc.ready().now_or_never().unwrap().is_ok());
        let error = match svc.call(get("http://a.example/")).now_or_never() {
            Some(Err(error)) => error,
            other => panic!("not refused at once: {:?}", other.map(|r| r.map(|_| ()))),
        };
        assert!(find::<CircuitOpen>(&*error).is_some());
    }
    assert!(handle.poll_request().is_pending());

    // The queued calls were admitted before: they go through once the service is ready.
    handle.allow(2);
    let respond = async {
        for _ in 0..2 {
            let (_, send) = handle.next_request().await.unwrap();
            send.send_response(status(200));
        }
    };
    let (a, b, ()) = tokio::join!(first, second, respond);
    assert_eq!(a.unwrap().status(), StatusCode::OK);
    assert_eq!(b.unwrap().status(), StatusCode::OK);
}

both_forms!(
    behind_a_full_buffer_an_open_breaker_still_fails_fast,
    start_paused = true
);

async fn a_breaker_in_the_request_extensions_overrides_the_layers(form: Form) {
    let (mock, mut handle) = mock::pair::<Sent, Res>();
    let keyed = CircuitBreakerLayer::keyed(KeyedBreakers::per_authority(config(2, 3)));
    let mut svc = stack(form, keyed).layer(mock);
    let chosen = CircuitBreaker::new(config(2, 3));

    // Counted on the chosen breaker, not the layer's map.
    for _ in 0..2 {
        let mut request = get("http://a.example/");
        request.extensions_mut().insert(chosen.clone());
        let out = exchange(&mut svc, &mut handle, request, status(503)).await;
        assert_eq!(out.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
    }
    assert_eq!(chosen.state(), State::Open);

    // The layer's breaker for a.example is still closed: a request without the
    // extension goes through...
    let out = exchange(&mut svc, &mut handle, get("http://a.example/"), status(200)).await;
    assert_eq!(out.unwrap().status(), StatusCode::OK);
    // ...and one with it is refused at once.
    let mut request = get("http://a.example/");
    request.extensions_mut().insert(chosen.clone());
    let open = refusal(svc.call(request).now_or_never());
    assert_eq!(open.retry_in(), Duration::from_secs(5));
}

both_forms!(
    a_breaker_in_the_request_extensions_overrides_the_layers,
    start_paused = true
);
