//! Configuration: a replaced problem responder, and builders that validate instead of
//! panicking.

use std::time::Duration;

use axum::Router;
use axum::body::to_bytes;
use axum::http::StatusCode;
use axum::routing::get;
use bytes::Bytes;
use retrysafe_tower::idempotency::{IdempotencyLayer, ProblemKind};
use tower::ServiceExt;

use super::{make_app, req, send};

// A replaced problem responder keeps the protocol headers and the Problem extension.
#[tokio::test]
async fn problem_responder_can_be_replaced() {
    let layer = IdempotencyLayer::in_memory().problem_responder(|p| {
        let mut res = axum::http::Response::new(Bytes::from(format!("custom {}", p.kind())));
        *res.status_mut() = p.kind().status();
        res
    });
    let (app, _) = make_app(layer);
    send(&app, req("k", "a")).await;
    let res = app.clone().oneshot(req("k", "b")).await.unwrap();
    assert_eq!(res.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(res.headers()["do-not-retry"], "1");
    assert_eq!(
        res.extensions()
            .get::<retrysafe_tower::idempotency::Problem>()
            .unwrap()
            .kind(),
        ProblemKind::KeyMismatch
    );
    assert_eq!(
        to_bytes(res.into_body(), usize::MAX).await.unwrap(),
        "custom key-mismatch"
    );
}

// Builders validate instead of panicking.
#[test]
fn invalid_configuration_is_an_error() {
    assert!(
        IdempotencyLayer::in_memory()
            .lease(Duration::ZERO)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .retention(Duration::ZERO)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .max_execution(Duration::ZERO)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .store_timeout(Duration::ZERO)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .max_in_flight(0)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .max_request_body(0)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .wait_for_in_flight(Duration::ZERO)
            .build()
            .is_err()
    );
    let e = IdempotencyLayer::in_memory()
        .lease(Duration::ZERO)
        .build()
        .err()
        .unwrap();
    assert_eq!(e.field(), "lease");
}

#[allow(dead_code)]
fn _get_route_compiles() -> Router {
    Router::new()
        .route("/x", get(|| async { "x" }))
        .layer(IdempotencyLayer::in_memory())
}

// One build names every refused setting; a refused setting keeps its default, so a
// layer used without build still works.
#[tokio::test]
async fn build_names_every_refused_setting_and_refused_values_keep_their_defaults() {
    let unbuilt = IdempotencyLayer::in_memory()
        .lease(Duration::ZERO)
        .max_request_body(0)
        .retention(Duration::MAX)
        .max_in_flight(0);
    let error = unbuilt.clone().build().unwrap_err();
    assert_eq!(
        error.fields().collect::<Vec<_>>(),
        ["lease", "max_request_body", "retention", "max_in_flight"]
    );
    let (app, effects) = make_app(unbuilt);
    let (first, _, _) = send(&app, req("k", "{}")).await;
    let (again, headers, _) = send(&app, req("k", "{}")).await;
    assert_eq!(first, StatusCode::CREATED);
    assert_eq!(again, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(effects.get(), 1);
}

// Absurd values are refused rather than overflowing deadline arithmetic later.
#[test]
fn huge_configuration_values_are_refused() {
    assert!(
        IdempotencyLayer::in_memory()
            .lease(Duration::MAX)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .max_execution(Duration::MAX)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .wait_for_in_flight(Duration::MAX)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .store_timeout(Duration::MAX)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .retention(Duration::MAX)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .max_stored_response(usize::MAX)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .max_request_body(usize::MAX)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .retention(Duration::from_secs(365 * 86_400))
            .build()
            .is_ok()
    );
}
