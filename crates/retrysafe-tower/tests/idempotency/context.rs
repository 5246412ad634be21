//! The handler's `IdempotencyContext`: child keys, and commit points sharing one write.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Extension, Router};
use retrysafe_core::idempotency::{Scope, Token};
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_memory::MemoryStore;
use retrysafe_test_support::bearer::auth;
use retrysafe_tower::idempotency::{IdempotencyContext, IdempotencyLayer, Principal};
use tower::ServiceExt;

// The handler sees its IdempotencyContext; child keys are deterministic.
#[tokio::test]
async fn handler_sees_its_context() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = Arc::clone(&seen);
    let app = Router::new()
        .route(
            "/pay",
            post(move |Extension(ctx): Extension<IdempotencyContext>| {
                let s = Arc::clone(&s);
                async move {
                    s.lock()
                        .unwrap()
                        .push((ctx.key().as_str().to_owned(), ctx.child_key("ledger")));
                    StatusCode::CREATED
                }
            }),
        )
        .layer(
            IdempotencyLayer::in_memory()
                .methods([axum::http::Method::POST, axum::http::Method::PATCH]),
        )
        .layer(axum::middleware::map_request(auth));
    let r = Request::post("/pay")
        .header("idempotency-key", "order-1")
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        app.clone().oneshot(r).await.unwrap().status(),
        StatusCode::CREATED
    );
    let r = Request::patch("/pay")
        .header("idempotency-key", "order-1")
        .body(Body::empty())
        .unwrap();
    let _ = app.oneshot(r).await.unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen.len(),
        1,
        "PATCH is a different request: 422, the handler did not run"
    );
    assert_eq!(seen[0].0, "order-1");
}

// Concurrent commit_point calls share one store write: none of them passes on the
// strength of a write that fails.
#[tokio::test]
async fn concurrent_commit_points_share_one_write() {
    let store = MemoryStore::new();
    let scope = Scope::from(&Principal::new("alice"));
    let key = IdempotencyKey::new("k").unwrap();
    // No claim is held with this token: the store refuses it.
    let ctx = IdempotencyContext::new(
        scope,
        key,
        Token::random(),
        retrysafe_core::store::BoxStore::new(store),
        Duration::from_secs(1),
    );
    let (a, b, c) = tokio::join!(ctx.commit_point(), ctx.commit_point(), ctx.commit_point());
    assert!(a.is_err() && b.is_err() && c.is_err());
    assert!(!ctx.is_committed());
}
