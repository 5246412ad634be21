//! What "the same request" means to the `IdempotencyLayer`: the convention's
//! per-attempt headers (`retry-attempt`, `grpc-previous-rpc-attempts`,
//! `request-timeout-ms`, `grpc-timeout`, `retry-point`) change between the attempts of
//! one request, so they never count, and a layer that is told to fingerprint them is
//! refused; and which methods are guarded: a key on another method is not looked at.
#![allow(clippy::unwrap_used, clippy::panic, missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::routing::any;
use http::{HeaderName, Method, Request, StatusCode};
use retrysafe_tower::idempotency::IdempotencyLayer;
use tower::ServiceExt;

fn counted() -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let layer = IdempotencyLayer::in_memory()
        .global_scope()
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/orders",
            any(move || {
                counter.fetch_add(1, Ordering::SeqCst);
                async { (StatusCode::CREATED, "made") }
            }),
        )
        .layer(layer);
    (app, runs)
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, bool) {
    let res = app.clone().oneshot(req).await.unwrap();
    let replayed = res.headers().contains_key("idempotent-replayed");
    (res.status(), replayed)
}

#[tokio::test]
async fn per_attempt_headers_never_make_another_request() {
    let (app, runs) = counted();
    let first = Request::post("/orders")
        .header("idempotency-key", "k-1")
        .header("content-type", "application/json")
        .body(Body::from("{}"))
        .unwrap();
    assert_eq!(send(&app, first).await, (StatusCode::CREATED, false));
    let retry = Request::post("/orders")
        .header("idempotency-key", "k-1")
        .header("content-type", "application/json")
        .header("retry-attempt", "2")
        .header("request-timeout-ms", "1500")
        .header("retry-point", "caller")
        .body(Body::from("{}"))
        .unwrap();
    assert_eq!(
        send(&app, retry).await,
        (StatusCode::CREATED, true),
        "the second attempt is the same request: replayed"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[test]
fn fingerprinting_a_per_attempt_header_is_refused() {
    for name in [
        "retry-attempt",
        "grpc-previous-rpc-attempts",
        "request-timeout-ms",
        "grpc-timeout",
        "retry-point",
        "idempotency-key",
    ] {
        let err = IdempotencyLayer::in_memory()
            .fingerprint_headers([http::header::CONTENT_TYPE, HeaderName::from_static(name)])
            .build()
            .unwrap_err();
        assert_eq!(err.field(), "fingerprint_headers", "{name}");
    }
    let fine = IdempotencyLayer::in_memory()
        .fingerprint_headers([
            http::header::CONTENT_TYPE,
            HeaderName::from_static("x-tenant"),
        ])
        .build();
    assert!(fine.is_ok());
}

#[tokio::test]
async fn a_key_on_an_unguarded_method_is_not_looked_at() {
    let (app, runs) = counted();
    for method in [Method::GET, Method::PUT, Method::DELETE] {
        // Not even validated: an invalid key passes with the request.
        for key in ["k-2", "bad key with spaces"] {
            let req = Request::builder()
                .method(method.clone())
                .uri("/orders")
                .header("idempotency-key", key)
                .body(Body::empty())
                .unwrap();
            assert_eq!(
                send(&app, req).await,
                (StatusCode::CREATED, false),
                "{method}"
            );
        }
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        6,
        "each ran: nothing was recorded"
    );
}
