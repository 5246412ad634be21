//! The `DeadlineLayer`, client and server forms: poll-level tests on a paused clock with
//! tower-test, and one two-hop test between real axum servers on loopback (real clock, no
//! timing assertions: only orderings).
//!
//! A client deadline's behaviour runs on both forms of the client stack (`both_forms!`,
//! `retrysafe_test_support::forms`): the separate layers stacked by hand and
//! `ClientLayers`, built from one description; the transport sees the time left as the
//! timeout header each attempt carries. Single-form, the API of the standalone layer
//! with no `ClientLayers` counterpart:
//! - `client_sets_the_deadline_extension` and
//!   `the_extension_after_waiting_for_readiness_is_the_time_left`: the `Deadline`
//!   extension the `DeadlineLayer` hands the layers below (the fused stack gives the
//!   deadline to its retry planner directly);
//! - `the_body_can_be_bounded_too`, `a_bounded_body_forwards_hints_and_completes_in_time`
//!   and `grpc_statuses_and_a_bounded_body_combine`: `bound_body()`, which
//!   `ClientLayers` does not offer;
//! - `client_configuration_is_validated` and `every_bad_server_setting_is_named`: the
//!   builders' validation (`ClientLayers::build`'s is in its docs);
//! - the server form (`DeadlineLayer::server()`), and the futures of the server, propagate
//!   and budget layers polled after completion.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    missing_docs,
    unreachable_pub
)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use retrysafe_core::error::{DeadlineExceeded, find};
use retrysafe_core::wire::{MAX_TIMEOUT, TimeoutError};
use retrysafe_core::{CallContext, Deadline};
use retrysafe_tower::BoxError;
use retrysafe_tower::answer::GrpcStatusLayer;
use retrysafe_tower::deadline::DeadlineLayer;
use retrysafe_tower::retry::ReplayBody;
use tokio::net::TcpListener;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};
use tower_test::mock;

use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::{Form, FormLayer};

type Res = Response<Full<Bytes>>;
/// A request as the transport below a client stack gets it.
type Sent = Request<ReplayBody<String>>;

/// The client stack in `form` with a deadline of `timeout` on every call.
fn stack(form: Form, timeout: Duration) -> FormLayer {
    retrysafe_test_support::forms::Client::new()
        .deadline(timeout)
        .layer(form)
}

/// A GET through a client stack.
fn get_call() -> Request<String> {
    Request::get("/").body(String::new()).unwrap()
}

/// A gRPC call through a client stack.
fn grpc_call() -> Request<String> {
    Request::post("/pkg.Svc/Method")
        .header("content-type", "application/grpc")
        .body(String::new())
        .unwrap()
}

/// The time left that an attempt tells its callee, in whole milliseconds.
fn timeout_sent(req: &Sent) -> &str {
    req.headers()["request-timeout-ms"].to_str().unwrap()
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn get_req() -> Request<()> {
    Request::get("/").body(()).unwrap()
}

fn grpc_req() -> Request<()> {
    Request::post("/pkg.Svc/Method")
        .header("content-type", "application/grpc")
        .body(())
        .unwrap()
}

fn is_deadline_exceeded(e: &BoxError) -> bool {
    find::<DeadlineExceeded>(&**e).is_some()
}

async fn text<B: Body>(body: B) -> String
where
    B::Error: std::fmt::Debug,
{
    String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

// ---------------------------------------------------------------- client, poll level

#[tokio::test(start_paused = true)]
async fn client_sets_the_deadline_extension() {
    let (svc, mut handle) = mock::spawn_layer::<Request<()>, Res, _>(DeadlineLayer::new(ms(100)));
    let mut svc = svc.into_inner();
    let call = tokio::spawn(svc.ready().await.unwrap().call(get_req()));

    let (req, send) = handle.next_request().await.unwrap();
    let deadline = *req.extensions().get::<Deadline>().unwrap();
    assert_eq!(deadline.remaining(), ms(100));
    send.send_response(Response::new(Full::from("ok")));

    let res = call.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(text(res.into_body()).await, "ok");

    // Tightened by a sooner inherited or own deadline, not by a later one.
    let inherited = CallContext::new().with_deadline(Deadline::after(ms(30)));
    let cases = [
        (Some(inherited), None, 30),
        (None, Some(Deadline::after(ms(20))), 20),
        (None, Some(Deadline::after(ms(500))), 100),
    ];
    for (ctx, own, seen) in cases {
        let mut req = get_req();
        if let Some(ctx) = ctx {
            req.extensions_mut().insert(ctx);
        }
        if let Some(own) = own {
            req.extensions_mut().insert(own);
        }
        let call = tokio::spawn(svc.ready().await.unwrap().call(req));
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(
            req.extensions().get::<Deadline>().unwrap().remaining(),
            ms(seen)
        );
        send.send_response(Response::new(Full::default()));
        call.await.unwrap().unwrap();
    }
}

async fn an_inherited_sooner_deadline_wins(form: Form) {
    let (svc, mut handle) = mock::spawn_layer::<Sent, Res, _>(stack(form, ms(100)));
    let mut svc = svc.into_inner();

    // Inside a handler whose caller has 40 ms left.
    let ctx = CallContext::new().with_deadline(Deadline::after(ms(40)));
    let future = ctx.sync_scope(|| {
        futures_util::FutureExt::now_or_never(svc.ready())
            .unwrap()
            .unwrap()
            .call(get_call())
    });
    let call = tokio::spawn(future);
    let (req, send) = handle.next_request().await.unwrap();
    assert_eq!(timeout_sent(&req), "40");
    send.send_response(Response::new(Full::default()));
    call.await.unwrap().unwrap();

    // An inherited context carried by hand in the extensions counts the same.
    let mut req = get_call();
    req.extensions_mut()
        .insert(CallContext::new().with_deadline(Deadline::after(ms(30))));
    let call = tokio::spawn(svc.ready().await.unwrap().call(req));
    let (req, send) = handle.next_request().await.unwrap();
    assert_eq!(timeout_sent(&req), "30");
    send.send_response(Response::new(Full::default()));
    call.await.unwrap().unwrap();

    // The request's own sooner deadline wins too; a later one does not.
    for (own, seen) in [(20, 20), (500, 100)] {
        let mut req = get_call();
        req.extensions_mut().insert(Deadline::after(ms(own)));
        let call = tokio::spawn(svc.ready().await.unwrap().call(req));
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(timeout_sent(&req), seen.to_string());
        send.send_response(Response::new(Full::default()));
        call.await.unwrap().unwrap();
    }
}

both_forms!(an_inherited_sooner_deadline_wins, start_paused = true);

async fn an_expired_call_is_deadline_exceeded(form: Form) {
    let (svc, mut handle) = mock::spawn_layer::<Sent, Res, _>(stack(form, ms(100)));
    let mut svc = svc.into_inner();
    let call = tokio::spawn(svc.ready().await.unwrap().call(get_call()));
    // The callee got the request and never answers.
    let (_req, _send) = handle.next_request().await.unwrap();
    let err = call.await.unwrap().unwrap_err();
    assert!(is_deadline_exceeded(&err), "{err}");
    assert_eq!(err.to_string(), "deadline exceeded");
}

both_forms!(an_expired_call_is_deadline_exceeded, start_paused = true);

async fn an_error_at_the_deadline_is_deadline_exceeded(form: Form) {
    // A transport that times the call itself from the timeout header (a tonic
    // `Channel`) fails at the same instant as the deadline: that is the deadline.
    let svc = ServiceBuilder::new()
        .layer(stack(form, ms(50)))
        .service(tower::service_fn(|_req: Sent| async {
            tokio::time::sleep(ms(50)).await;
            Err::<Response<Full<Bytes>>, BoxError>("Timeout expired".into())
        }));
    let err = svc.oneshot(get_call()).await.unwrap_err();
    assert!(is_deadline_exceeded(&err), "{err}");

    // gRPC: the synthesised DEADLINE_EXCEEDED.
    let svc = ServiceBuilder::new()
        .layer(GrpcStatusLayer::new())
        .layer(stack(form, ms(50)))
        .service(tower::service_fn(|_req: Sent| async {
            tokio::time::sleep(ms(50)).await;
            Err::<Response<Full<Bytes>>, BoxError>("Timeout expired".into())
        }));
    let res = svc.oneshot(grpc_call()).await.unwrap();
    assert_eq!(res.headers()["grpc-status"], "4");

    // An error before the deadline is passed through as it is.
    let svc = ServiceBuilder::new()
        .layer(stack(form, ms(50)))
        .service(tower::service_fn(|_req: Sent| async {
            tokio::time::sleep(ms(49)).await;
            Err::<Response<Full<Bytes>>, BoxError>("connection reset".into())
        }));
    let err = svc.oneshot(get_call()).await.unwrap_err();
    assert!(!is_deadline_exceeded(&err));
    assert_eq!(err.to_string(), "connection reset");
}

both_forms!(
    an_error_at_the_deadline_is_deadline_exceeded,
    start_paused = true
);

async fn a_response_ready_at_the_deadline_is_not_dropped(form: Form) {
    let svc = ServiceBuilder::new()
        .layer(stack(form, ms(50)))
        .service(tower::service_fn(|_req: Sent| async {
            // Answers exactly at the deadline: polled before the timer, it wins.
            tokio::time::sleep(ms(50)).await;
            Ok::<_, Infallible>(Response::new(Full::<Bytes>::from("late but ready")))
        }));
    let res = svc.oneshot(get_call()).await.unwrap();
    assert_eq!(text(res.into_body()).await, "late but ready");
}

both_forms!(
    a_response_ready_at_the_deadline_is_not_dropped,
    start_paused = true
);

async fn an_expired_grpc_call_is_a_synthesised_deadline_exceeded(form: Form) {
    let (svc, mut handle) = mock::spawn_layer::<Sent, Res, _>(
        ServiceBuilder::new()
            .layer(GrpcStatusLayer::new())
            .layer(stack(form, ms(100))),
    );
    let mut svc = svc.into_inner();
    let call = tokio::spawn(svc.ready().await.unwrap().call(grpc_call()));
    let (_req, _send) = handle.next_request().await.unwrap();
    let res = call.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["content-type"], "application/grpc");
    assert_eq!(res.headers()["grpc-status"], "4");
    assert_eq!(res.headers()["do-not-retry"], "1");

    // A plain HTTP request through the same layer still gets the error.
    let call = tokio::spawn(svc.ready().await.unwrap().call(get_call()));
    let (_req, _send) = handle.next_request().await.unwrap();
    assert!(is_deadline_exceeded(&call.await.unwrap().unwrap_err()));
}

both_forms!(
    an_expired_grpc_call_is_a_synthesised_deadline_exceeded,
    start_paused = true
);

#[tokio::test(start_paused = true)]
async fn the_extension_after_waiting_for_readiness_is_the_time_left() {
    let (svc, mut handle) = mock::spawn_layer::<Request<()>, Res, _>(DeadlineLayer::new(ms(100)));
    let mut svc = svc.into_inner();
    handle.allow(0);
    // Ready after 60 ms: the callee sees the 40 ms that are left.
    let call = tokio::spawn(svc.ready().await.unwrap().call(get_req()));
    tokio::time::sleep(ms(60)).await;
    handle.allow(1);
    let (req, send) = handle.next_request().await.unwrap();
    assert_eq!(
        req.extensions().get::<Deadline>().unwrap().remaining(),
        ms(40)
    );
    send.send_response(Response::new(Full::default()));
    assert_eq!(call.await.unwrap().unwrap().status(), StatusCode::OK);
}

async fn waiting_for_readiness_counts(form: Form) {
    let (svc, mut handle) = mock::spawn_layer::<Sent, Res, _>(stack(form, ms(100)));
    let mut svc = svc.into_inner();

    // Never ready: the deadline passes while waiting, and the request is never sent.
    handle.allow(0);
    // The layer itself is always ready.
    let call = tokio::spawn(svc.ready().await.unwrap().call(get_call()));
    let err = call.await.unwrap().unwrap_err();
    assert!(is_deadline_exceeded(&err), "{err}");
    assert!(
        futures_util::FutureExt::now_or_never(handle.next_request()).is_none(),
        "no request may be sent once the deadline passed"
    );

    // Ready after 60 ms: sent then, and answered in time.
    let call = tokio::spawn(svc.ready().await.unwrap().call(get_call()));
    tokio::time::sleep(ms(60)).await;
    handle.allow(1);
    let (_req, send) = handle.next_request().await.unwrap();
    send.send_response(Response::new(Full::default()));
    assert_eq!(call.await.unwrap().unwrap().status(), StatusCode::OK);
}

both_forms!(waiting_for_readiness_counts, start_paused = true);

async fn a_readiness_error_is_returned(form: Form) {
    let (svc, mut handle) = mock::spawn_layer::<Sent, Res, _>(stack(form, ms(100)));
    let mut svc = svc.into_inner();
    handle.send_error("connection pool closed");
    let err = svc
        .ready()
        .await
        .unwrap()
        .call(get_call())
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "connection pool closed");
}

both_forms!(a_readiness_error_is_returned, start_paused = true);

type Stalling =
    StreamBody<futures_util::stream::BoxStream<'static, Result<Frame<Bytes>, Infallible>>>;

fn stalling_body() -> Stalling {
    let first = futures_util::stream::iter([Ok(Frame::data(Bytes::from_static(b"head")))]);
    StreamBody::new(first.chain(futures_util::stream::pending()).boxed())
}

#[tokio::test(start_paused = true)]
async fn the_body_can_be_bounded_too() {
    let svc = ServiceBuilder::new()
        .layer(DeadlineLayer::new(ms(100)).bound_body())
        .service(tower::service_fn(|_req: Request<()>| async {
            tokio::time::sleep(ms(30)).await;
            Ok::<_, Infallible>(Response::new(stalling_body()))
        }));
    let res = svc.oneshot(get_req()).await.unwrap();
    let mut body = std::pin::pin!(res.into_body());
    assert!(!body.is_end_stream());
    let first = body.as_mut().frame().await.unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), "head");
    // Then the stream stalls until the deadline.
    let err = body.as_mut().frame().await.unwrap().unwrap_err();
    assert!(is_deadline_exceeded(&err), "{err}");
    assert!(body.is_end_stream());
    assert!(body.as_mut().frame().await.is_none());
}

#[tokio::test(start_paused = true)]
async fn a_bounded_body_forwards_hints_and_completes_in_time() {
    let svc = ServiceBuilder::new()
        .layer(DeadlineLayer::new(ms(100)).bound_body())
        .service(tower::service_fn(|_req: Request<()>| async {
            Ok::<_, Infallible>(Response::new(Full::<Bytes>::from("twelve bytes")))
        }));
    let res = svc.clone().oneshot(get_req()).await.unwrap();
    let body = res.into_body();
    assert_eq!(body.size_hint().exact(), Some(12));
    assert!(!body.is_end_stream());
    assert_eq!(text(body).await, "twelve bytes");

    // An empty body is at its end from the start.
    let svc = ServiceBuilder::new()
        .layer(DeadlineLayer::new(ms(100)).bound_body())
        .service(tower::service_fn(|_req: Request<()>| async {
            Ok::<_, Infallible>(Response::new(Full::<Bytes>::default()))
        }));
    let body = svc.oneshot(get_req()).await.unwrap().into_body();
    assert!(body.is_end_stream());
    assert_eq!(body.size_hint().exact(), Some(0));
}

#[tokio::test(start_paused = true)]
async fn grpc_statuses_and_a_bounded_body_combine() {
    let svc = ServiceBuilder::new()
        .layer(GrpcStatusLayer::new())
        .layer(DeadlineLayer::new(ms(100)).bound_body())
        .service(tower::service_fn(|_req: Request<()>| async {
            tokio::time::sleep(ms(500)).await;
            Ok::<_, Infallible>(Response::new(Full::<Bytes>::from("too late")))
        }));
    let res = svc.oneshot(grpc_req()).await.unwrap();
    assert_eq!(res.headers()["grpc-status"], "4");
    assert!(res.into_body().is_end_stream());
}

#[test]
fn client_configuration_is_validated() {
    let err = DeadlineLayer::new(Duration::ZERO).build().unwrap_err();
    assert!(err.to_string().contains("timeout"), "{err}");
    assert!(DeadlineLayer::new(MAX_TIMEOUT + ms(1)).build().is_err());
    assert!(DeadlineLayer::new(MAX_TIMEOUT).build().is_ok());
    assert!(
        DeadlineLayer::server()
            .max_timeout(Duration::ZERO)
            .build()
            .is_err()
    );
    assert!(
        DeadlineLayer::server()
            .margin(Duration::from_secs(61))
            .build()
            .is_err()
    );
}

#[test]
fn every_bad_server_setting_is_named() {
    let err = DeadlineLayer::server()
        .max_timeout(Duration::ZERO)
        .margin(Duration::from_secs(61))
        .build()
        .unwrap_err();
    assert_eq!(err.fields().collect::<Vec<_>>(), ["max timeout", "margin"]);
    let err = retrysafe_tower::propagate::PropagateLayer::new()
        .margin(Duration::from_secs(61))
        .max_timeout(MAX_TIMEOUT + ms(1))
        .build()
        .unwrap_err();
    assert_eq!(err.fields().collect::<Vec<_>>(), ["max timeout", "margin"]);
}

// ---------------------------------------------------------------- server, poll level

/// A handler that reports the inherited context and the request's `Deadline` extension
/// (in whole milliseconds), after `delay`.
fn reporting(
    delay: Duration,
) -> impl tower::Service<
    Request<()>,
    Response = Res,
    Error = Infallible,
    Future = impl Future<Output = Result<Res, Infallible>> + Send,
> + Clone {
    tower::service_fn(move |req: Request<()>| async move {
        let ext = req.extensions().get::<Deadline>().map(|d| d.remaining());
        tokio::time::sleep(delay).await;
        let ctx = CallContext::current().map(|c| c.deadline().map(|d| d.remaining()));
        let show = |d: Option<Duration>| d.map_or("none".to_owned(), |d| d.as_millis().to_string());
        let body = format!("{} {}", show(ctx.flatten()), show(ext));
        Ok::<_, Infallible>(Response::new(Full::from(body)))
    })
}

async fn problem_type<B: Body>(res: Response<B>) -> String
where
    B::Error: std::fmt::Debug,
{
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    let body = text(res.into_body()).await;
    let start = body.find("urn:retrysafe:problem:").unwrap();
    let rest = &body[start..];
    rest[..rest.find('"').unwrap()].to_owned()
}

#[tokio::test(start_paused = true)]
async fn malformed_inbound_timeouts_answer_400() {
    let svc = DeadlineLayer::server().layer(reporting(Duration::ZERO));
    let values = [
        HeaderValue::from_static("abc"),
        HeaderValue::from_static("-5"),
        HeaderValue::from_static("1.5"),
        HeaderValue::from_static("  "),
        HeaderValue::from_static("12 34"),
        HeaderValue::from_bytes(&[0xff, 0xfe, b'1']).unwrap(),
        HeaderValue::from_bytes("５００".as_bytes()).unwrap(),
    ];
    for value in values {
        let req = Request::get("/")
            .header("request-timeout-ms", value.clone())
            .body(())
            .unwrap();
        let res = svc.clone().oneshot(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{value:?}");
        assert!(res.extensions().get::<TimeoutError>().is_some());
        assert_eq!(
            problem_type(res).await,
            "urn:retrysafe:problem:timeout-invalid",
            "{value:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn an_overflowing_inbound_timeout_is_clamped_not_refused() {
    let svc = DeadlineLayer::server()
        .max_timeout(Duration::from_secs(2))
        .layer(reporting(Duration::ZERO));
    for value in ["9".repeat(40), u64::MAX.to_string()] {
        let req = Request::get("/")
            .header("request-timeout-ms", value.as_str())
            .body(())
            .unwrap();
        let res = svc.clone().oneshot(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(text(res.into_body()).await, "1990 1990");
    }
}

#[tokio::test(start_paused = true)]
async fn malformed_grpc_timeouts_answer_invalid_argument() {
    let svc = DeadlineLayer::server().layer(reporting(Duration::ZERO));
    for value in ["abc", "-5S", "5", "5x", "123456789S", "1.5S"] {
        let mut req = grpc_req();
        req.headers_mut()
            .insert("grpc-timeout", HeaderValue::from_str(value).unwrap());
        let res = svc.clone().oneshot(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "{value}");
        assert_eq!(res.headers()["grpc-status"], "3", "{value}");
        assert_eq!(res.headers()["content-type"], "application/grpc");
        let message = res.headers()["grpc-message"].to_str().unwrap();
        assert!(message.starts_with("grpc-timeout"), "{message}");
    }
    // A gRPC request's `request-timeout-ms` is not its timeout header: ignored.
    let mut req = grpc_req();
    req.headers_mut()
        .insert("request-timeout-ms", HeaderValue::from_static("abc"));
    let res = svc.oneshot(req).await.unwrap();
    assert!(res.headers().get("grpc-status").is_none());
}

#[tokio::test(start_paused = true)]
async fn inbound_timeouts_are_clamped_to_the_maximum() {
    let svc = DeadlineLayer::server()
        .max_timeout(Duration::from_secs(1))
        .layer(reporting(Duration::ZERO));
    let req = Request::get("/")
        .header("request-timeout-ms", "60000")
        .body(())
        .unwrap();
    let res = svc.clone().oneshot(req).await.unwrap();
    assert_eq!(text(res.into_body()).await, "990 990");

    let mut req = grpc_req();
    req.headers_mut()
        .insert("grpc-timeout", HeaderValue::from_static("5M"));
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(text(res.into_body()).await, "990 990");
}

#[tokio::test(start_paused = true)]
async fn the_handler_inherits_the_deadline_less_the_margin() {
    let svc = DeadlineLayer::server()
        .margin(ms(20))
        .layer(reporting(ms(50)));
    let req = Request::get("/")
        .header("request-timeout-ms", "200")
        .body(())
        .unwrap();
    let res = svc.clone().oneshot(req).await.unwrap();
    // The extension at the start (180), the context after 50 ms of work (130).
    assert_eq!(text(res.into_body()).await, "130 180");

    // No inbound timeout: no deadline, nothing enforced.
    let res = svc.oneshot(get_req()).await.unwrap();
    assert_eq!(text(res.into_body()).await, "none none");
}

#[tokio::test(start_paused = true)]
async fn a_handler_outliving_the_deadline_answers_504() {
    let svc = DeadlineLayer::server().layer(reporting(Duration::from_secs(5)));
    let req = Request::get("/")
        .header("request-timeout-ms", "100")
        .body(())
        .unwrap();
    let started = tokio::time::Instant::now();
    let res = svc.clone().oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(res.headers()["do-not-retry"], "1");
    assert!(res.extensions().get::<DeadlineExceeded>().is_some());
    // Answered before the caller gives up: at the deadline less the 10 ms margin.
    assert_eq!(started.elapsed(), ms(90));
    assert_eq!(
        problem_type(res).await,
        "urn:retrysafe:problem:deadline-exceeded"
    );

    let mut req = grpc_req();
    req.headers_mut()
        .insert("grpc-timeout", HeaderValue::from_static("100m"));
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["grpc-status"], "4");
    assert_eq!(res.headers()["do-not-retry"], "1");
}

#[tokio::test(start_paused = true)]
async fn no_time_left_answers_504_before_the_handler_starts() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let svc = DeadlineLayer::server().layer(tower::service_fn(move |_req: Request<()>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(Response::new(Full::from("ran"))) }
    }));
    // `0`, and timeouts no longer than the 10 ms margin: nothing is left to work with.
    for value in ["0", "5", "10"] {
        let req = Request::get("/")
            .header("request-timeout-ms", value)
            .body(())
            .unwrap();
        let started = tokio::time::Instant::now();
        let res = svc.clone().oneshot(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::GATEWAY_TIMEOUT, "{value}");
        assert_eq!(res.headers()["do-not-retry"], "1", "{value}");
        assert_eq!(started.elapsed(), Duration::ZERO, "{value}: at once");
        assert_eq!(
            problem_type(res).await,
            "urn:retrysafe:problem:deadline-exceeded"
        );
    }
    let mut req = grpc_req();
    req.headers_mut()
        .insert("grpc-timeout", HeaderValue::from_static("0m"));
    let res = svc.clone().oneshot(req).await.unwrap();
    assert_eq!(res.headers()["grpc-status"], "4");
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the handler never started");

    let req = Request::get("/")
        .header("request-timeout-ms", "11")
        .body(())
        .unwrap();
    assert_eq!(svc.oneshot(req).await.unwrap().status(), StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_failure_is_marked_when_downstream_gave_up() {
    let svc = DeadlineLayer::server().layer(tower::service_fn(|_req: Request<()>| async {
        CallContext::current().unwrap().mark_downstream_gave_up();
        let mut res = Response::new(Full::<Bytes>::default());
        *res.status_mut() = StatusCode::BAD_GATEWAY;
        Ok::<_, Infallible>(res)
    }));
    let req = Request::get("/")
        .header("request-timeout-ms", "1000")
        .header("retry-point", "caller")
        .body(())
        .unwrap();
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(res.headers()["do-not-retry"], "1");
}

#[tokio::test(start_paused = true)]
async fn server_readiness_is_the_inner_services() {
    let (mut svc, mut handle) = mock::spawn_layer::<Request<()>, Res, _>(DeadlineLayer::server());
    handle.allow(0);
    assert!(svc.poll_ready().is_pending());
    handle.allow(1);
    assert!(svc.poll_ready().is_ready());
    let call = tokio::spawn(
        svc.call(
            Request::get("/")
                .header("request-timeout-ms", "500")
                .body(())
                .unwrap(),
        ),
    );
    let (req, send) = handle.next_request().await.unwrap();
    assert_eq!(
        req.extensions().get::<Deadline>().unwrap().remaining(),
        ms(490)
    );
    assert!(req.extensions().get::<CallContext>().is_some());
    send.send_response(Response::new(Full::default()));
    assert_eq!(call.await.unwrap().unwrap().status(), StatusCode::OK);
}

// ---------------------------------------------------------------- two real hops

type Transport =
    Client<hyper_util::client::legacy::connect::HttpConnector, ReplayBody<Full<Bytes>>>;
type Outbound = <FormLayer as Layer<Transport>>::Service;

fn outbound(form: Form, timeout: Duration) -> Outbound {
    stack(form, timeout).layer(Client::builder(TokioExecutor::new()).build_http())
}

async fn serve(app: Router) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

async fn incoming_text(res: Response<Incoming>) -> String {
    text(res.into_body()).await
}

fn left_ms() -> u128 {
    CallContext::current()
        .expect("a context")
        .deadline()
        .expect("a deadline")
        .remaining()
        .as_millis()
}

async fn two_real_hops_see_the_deadline_shrink(form: Form) {
    // B reports the time it was left.
    let b_app = Router::new()
        .route("/", get(|| async { left_ms().to_string() }))
        .layer(DeadlineLayer::server());
    let b = serve(b_app).await;

    // A reports what it was left, and what B was left, through a client stack with a
    // generous timeout of its own: the inherited deadline is sooner, so it wins.
    let a_app = Router::new()
        .route(
            "/",
            get(move || async move {
                let a_left = left_ms();
                let req = Request::get(format!("http://{b}/"))
                    .body(Full::default())
                    .unwrap();
                let res = outbound(form, Duration::from_secs(60))
                    .oneshot(req)
                    .await
                    .unwrap();
                assert_eq!(res.status(), StatusCode::OK);
                format!("{a_left} {}", text(res.into_body()).await)
            }),
        )
        .layer(DeadlineLayer::server());
    let a = serve(a_app).await;

    let req = Request::get(format!("http://{a}/"))
        .body(Full::default())
        .unwrap();
    let res = outbound(form, Duration::from_secs(5))
        .oneshot(req)
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let reply = text(res.into_body()).await;
    let (a_left, b_left) = reply.split_once(' ').unwrap();
    let a_left: u128 = a_left.parse().unwrap();
    let b_left: u128 = b_left.parse().unwrap();
    assert!(a_left < 5000, "{reply}");
    assert!(b_left < a_left, "{reply}");

    // A malformed header sent by hand to a real server: 400, and the server lives on.
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = Request::get(format!("http://{b}/"))
        .header("request-timeout-ms", "-5")
        .body(Full::default())
        .unwrap();
    let res = client.request(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert!(incoming_text(res).await.contains("timeout-invalid"));
}

both_forms!(
    two_real_hops_see_the_deadline_shrink,
    flavor = "multi_thread",
    worker_threads = 2
);

#[tokio::test(start_paused = true)]
async fn a_server_future_polled_after_completion_stays_pending() {
    use std::task::Poll;
    let mut svc = DeadlineLayer::server().layer(reporting(Duration::ZERO));
    let req = Request::get("/")
        .header("request-timeout-ms", "1000")
        .body(())
        .unwrap();
    let mut future = std::pin::pin!(svc.ready().await.unwrap().call(req));
    let res = (&mut future).await.unwrap();
    // The handler saw 990 ms (1 s less the 10 ms margin).
    assert_eq!(text(res.into_body()).await, "990 990");
    // Polled again (not allowed by the `Future` contract, but harmless): no panic from
    // the handler's task-local scope, and nothing more.
    let again = futures_util::poll!(&mut future);
    assert!(matches!(again, Poll::Pending));
    // So is a refused (malformed) one.
    let req = Request::get("/")
        .header("request-timeout-ms", "x")
        .body(())
        .unwrap();
    let mut future = std::pin::pin!(svc.ready().await.unwrap().call(req));
    assert_eq!(
        (&mut future).await.unwrap().status(),
        StatusCode::BAD_REQUEST
    );
    assert!(matches!(futures_util::poll!(&mut future), Poll::Pending));
}

#[tokio::test(start_paused = true)]
async fn propagate_and_budget_futures_polled_after_completion_stay_pending() {
    use retrysafe_core::budget::RetryBudget;
    use retrysafe_tower::budget::RetryBudgetLayer;
    use retrysafe_tower::propagate::PropagateLayer;
    use std::task::Poll;

    let mut svc = PropagateLayer::new().layer(reporting(Duration::ZERO));
    let mut future = std::pin::pin!(svc.ready().await.unwrap().call(get_req()));
    assert_eq!((&mut future).await.unwrap().status(), StatusCode::OK);
    assert!(matches!(futures_util::poll!(&mut future), Poll::Pending));

    let mut svc = RetryBudgetLayer::new(RetryBudget::default())
        .server()
        .layer(reporting(Duration::ZERO));
    let mut future = std::pin::pin!(svc.ready().await.unwrap().call(get_req()));
    assert_eq!((&mut future).await.unwrap().status(), StatusCode::OK);
    assert!(matches!(futures_util::poll!(&mut future), Poll::Pending));

    let mut svc = RetryBudgetLayer::new(RetryBudget::default()).layer(reporting(Duration::ZERO));
    let mut future = std::pin::pin!(svc.ready().await.unwrap().call(get_req()));
    assert_eq!((&mut future).await.unwrap().status(), StatusCode::OK);
    assert!(matches!(futures_util::poll!(&mut future), Poll::Pending));
}
