//! Poll-level tests of the Idempotency service with `tower-test`: readiness comes from
//! the inner service, untouched requests are passed through in place, inner errors are
//! returned and leave an `outcome_unknown` record.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use retrysafe_tower::idempotency::{
    IdempotencyLayer, Principal, ProblemKind, RequestBody, UnknownOutcome, UnknownReason,
};
use tower_test::mock;

type Req = Request<RequestBody<Full<Bytes>>>;

fn post(key: &str) -> Request<Full<Bytes>> {
    let mut r = Request::post("/pay")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"a")))
        .unwrap();
    r.extensions_mut().insert(Principal::new("alice"));
    r
}

#[tokio::test]
async fn readiness_is_the_inner_services() {
    let (mut svc, mut handle) = mock::spawn_with::<Req, Response<Full<Bytes>>, _, _>(|s| {
        IdempotencyLayer::in_memory().layer_service(s)
    });
    handle.allow(0);
    assert!(svc.poll_ready().is_pending());
    handle.allow(1);
    assert!(matches!(svc.poll_ready(), std::task::Poll::Ready(Ok(()))));

    // An unguarded GET is passed to the inner service as it is.
    let get = Request::get("/x")
        .body(Full::new(Bytes::from_static(b"q")))
        .unwrap();
    let fut = svc.call(get);
    let (req, send) = handle.next_request().await.unwrap();
    assert_eq!(req.method(), http::Method::GET);
    assert_eq!(req.into_body().collect().await.unwrap().to_bytes(), "q");
    send.send_response(Response::new(Full::new(Bytes::from_static(b"ok"))));
    let res = fut.await.unwrap();
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "ok");
}

#[tokio::test]
async fn guarded_request_reaches_the_inner_service_once() {
    let (mut svc, mut handle) = mock::spawn_with::<Req, Response<Full<Bytes>>, _, _>(|s| {
        IdempotencyLayer::in_memory().layer_service(s)
    });
    handle.allow(2);
    assert!(matches!(svc.poll_ready(), std::task::Poll::Ready(Ok(()))));
    let first = tokio::spawn(svc.call(post("k")));
    let (req, send) = handle.next_request().await.unwrap();
    assert!(
        req.extensions()
            .get::<retrysafe_tower::idempotency::IdempotencyContext>()
            .is_some()
    );
    assert_eq!(
        req.into_body().collect().await.unwrap().to_bytes(),
        "a",
        "the buffered body"
    );
    let mut res = Response::new(Full::new(Bytes::from_static(b"paid")));
    *res.status_mut() = StatusCode::CREATED;
    send.send_response(res);
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::CREATED);

    assert!(matches!(svc.poll_ready(), std::task::Poll::Ready(Ok(()))));
    let replay = svc.call(post("k")).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(
        replay.into_body().collect().await.unwrap().to_bytes(),
        "paid"
    );
    // The inner service saw no second request.
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(20), handle.next_request())
            .await
            .is_err()
    );
}

#[tokio::test]
async fn inner_error_is_returned_and_the_outcome_is_unknown() {
    let seen: Arc<Mutex<Vec<UnknownOutcome>>> = Arc::default();
    let s = Arc::clone(&seen);
    let layer = IdempotencyLayer::in_memory()
        .on_outcome_unknown(move |u| s.lock().unwrap().push(u.clone()));
    let (mut svc, mut handle) =
        mock::spawn_with::<Req, Response<Full<Bytes>>, _, _>(move |s| layer.layer_service(s));
    handle.allow(2);
    assert!(matches!(svc.poll_ready(), std::task::Poll::Ready(Ok(()))));
    let first = tokio::spawn(svc.call(post("k")));
    let (_req, send) = handle.next_request().await.unwrap();
    send.send_error("connection to the ledger lost");
    let err = first.await.unwrap().unwrap_err();
    assert_eq!(err.to_string(), "connection to the ledger lost");
    assert_eq!(seen.lock().unwrap()[0].reason, UnknownReason::ServiceError);

    assert!(matches!(svc.poll_ready(), std::task::Poll::Ready(Ok(()))));
    let later = svc.call(post("k")).await.unwrap();
    let problem = later
        .extensions()
        .get::<retrysafe_tower::idempotency::Problem>()
        .unwrap();
    assert_eq!(problem.kind(), ProblemKind::OutcomeUnknown);
}

trait LayerService {
    fn layer_service<S>(&self, s: S) -> retrysafe_tower::idempotency::IdempotencyService<S>;
}

impl LayerService for IdempotencyLayer {
    fn layer_service<S>(&self, s: S) -> retrysafe_tower::idempotency::IdempotencyService<S> {
        tower_layer::Layer::layer(self, s)
    }
}
