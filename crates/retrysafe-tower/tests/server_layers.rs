//! `ServerLayers`: the recommended server order as one layer. `build` refuses a stack
//! that can never find a scope; the inbound deadline sits between authentication and
//! the idempotency layer, so a malformed or spent deadline is answered before anything
//! is claimed or run.
#![allow(clippy::unwrap_used, clippy::panic, missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use retrysafe_core::idempotency::{Principal, Scope};
use retrysafe_tower::deadline::DeadlineLayer;
use retrysafe_tower::idempotency::IdempotencyLayer;
use retrysafe_tower::server::ServerLayers;
use tower::ServiceExt;

/// The authentication of these tests: every caller is alice (axum's `Extension`
/// layer inserts the `Principal`).
fn alice() -> axum::Extension<Principal> {
    axum::Extension(Principal::new("alice"))
}

#[test]
fn a_stack_that_can_never_find_a_scope_is_refused() {
    let err = ServerLayers::new(IdempotencyLayer::in_memory())
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "authentication");
    assert!(err.to_string().contains("scope-missing"), "{err}");

    // An authentication layer inserts the Principal; a scope rule needs none.
    let authenticated = ServerLayers::new(IdempotencyLayer::in_memory())
        .authentication(alice())
        .build();
    assert!(authenticated.is_ok());
    for scoped in [
        IdempotencyLayer::in_memory().global_scope(),
        IdempotencyLayer::in_memory().scope_by(|_parts| Some(Scope::global())),
        IdempotencyLayer::in_memory().scope_by_authorization_hash(),
    ] {
        assert!(ServerLayers::new(scoped).build().is_ok());
    }
}

#[test]
fn every_refused_setting_is_named() {
    let err = ServerLayers::new(IdempotencyLayer::in_memory())
        .concurrency_limit(0)
        .build()
        .unwrap_err();
    let shown = err.to_string();
    assert!(shown.contains("authentication"), "{shown}");
    assert!(shown.contains("concurrency_limit"), "{shown}");
}

async fn answer(app: &Router, timeout: Option<&str>) -> (StatusCode, String, bool) {
    let mut req = Request::post("/orders").header("idempotency-key", "o-1");
    if let Some(t) = timeout {
        req = req.header("request-timeout-ms", t);
    }
    let res = app
        .clone()
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = res.status();
    let marked = res.headers().contains_key("do-not-retry");
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned(), marked)
}

#[tokio::test]
async fn the_inbound_deadline_is_checked_before_the_key_is_claimed() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let layers = ServerLayers::new(IdempotencyLayer::in_memory().require_key())
        .authentication(alice())
        .deadline(DeadlineLayer::server())
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/orders",
            post(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                async { (StatusCode::CREATED, "made") }
            }),
        )
        .layer(layers);

    for bad in ["abc", "-5", ""] {
        let (status, body, _) = answer(&app, Some(bad)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad:?}");
        assert!(
            body.contains("urn:retrysafe:problem:timeout-invalid"),
            "{body}"
        );
    }
    let (status, body, marked) = answer(&app, Some("0")).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert!(
        body.contains("urn:retrysafe:problem:deadline-exceeded"),
        "{body}"
    );
    assert!(marked, "do-not-retry");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "nothing ran, nothing was claimed"
    );

    // The key was never claimed: the first request with time left runs.
    let (status, body, _) = answer(&app, Some("5000")).await;
    assert_eq!((status, body.as_str()), (StatusCode::CREATED, "made"));
    let (status, _, _) = answer(&app, None).await;
    assert_eq!(status, StatusCode::CREATED, "replayed");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
