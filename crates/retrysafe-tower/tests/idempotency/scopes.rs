//! Fingerprints and scopes: the same key for another request, in another scope, the
//! scope rules, and a request without a principal.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Extension, Router};
use retrysafe_core::idempotency::Scope;
use retrysafe_tower::idempotency::{EventKind, IdempotencyLayer, ProblemKind};

use super::{Effects, Recorder, assert_problem, handler, make_app, post_req, req, send};

// Row: same key, different fingerprint, completed or in flight → 422 do-not-retry.
#[tokio::test]
async fn other_request_with_same_key_is_a_mismatch() {
    let rec = Recorder::default();
    let (app, effects) = make_app(rec.attach(IdempotencyLayer::in_memory()));
    send(&app, req("k", "amount=1")).await;
    let r = send(&app, req("k", "amount=2")).await;
    assert_problem(&r, ProblemKind::KeyMismatch);
    // Another path, query, method or content-type is another request too.
    let r = Request::post("/pay?x=1")
        .header("idempotency-key", "k")
        .header("content-type", "text/plain")
        .body(Body::from("amount=1"))
        .unwrap();
    assert_eq!(send(&app, r).await.0, StatusCode::UNPROCESSABLE_ENTITY);
    let r = Request::patch("/pay")
        .header("idempotency-key", "k")
        .header("content-type", "text/plain")
        .body(Body::from("amount=1"))
        .unwrap();
    assert_eq!(send(&app, r).await.0, StatusCode::UNPROCESSABLE_ENTITY);
    let r = Request::post("/pay")
        .header("idempotency-key", "k")
        .header("content-type", "application/json")
        .body(Body::from("amount=1"))
        .unwrap();
    assert_eq!(send(&app, r).await.0, StatusCode::UNPROCESSABLE_ENTITY);
    // In flight.
    let slow = post_req(Some("k2"), "")
        .header("x-sleep-ms", "200")
        .body(Body::from("a"))
        .unwrap();
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, slow).await }
    });
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_problem(&send(&app, req("k2", "b")).await, ProblemKind::KeyMismatch);
    first.await.unwrap();
    assert_eq!(effects.get(), 2);
    assert_eq!(rec.count(EventKind::Mismatch), 5);
}

// Row: same key, different scope → an independent record.
#[tokio::test]
async fn same_key_in_another_scope_is_independent() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory());
    let as_user = |who: &str| {
        post_req(Some("k"), "")
            .header("authorization", format!("Bearer {who}"))
            .body(Body::from("a"))
            .unwrap()
    };
    let a = send(&app, as_user("alice")).await;
    let b = send(&app, as_user("bob")).await;
    assert!(a.1.get("idempotent-replayed").is_none());
    assert!(
        b.1.get("idempotent-replayed").is_none(),
        "never a replay across scopes"
    );
    assert_ne!(a.2, b.2);
    assert_eq!(send(&app, as_user("alice")).await.2, a.2);
    assert_eq!(effects.get(), 2);
}

// Scope rules: global and by Authorization hash.
#[tokio::test]
async fn explicit_scope_rules() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory().global_scope());
    let as_user = |who: &str| {
        post_req(Some("k"), "")
            .header("authorization", format!("Bearer {who}"))
            .body(Body::from("a"))
            .unwrap()
    };
    send(&app, as_user("alice")).await;
    assert_eq!(
        send(&app, as_user("bob")).await.1["idempotent-replayed"],
        "true"
    );
    assert_eq!(effects.get(), 1);

    let (app, effects) =
        app_without_auth(IdempotencyLayer::in_memory().scope_by_authorization_hash());
    send(&app, as_user("alice")).await;
    assert!(
        send(&app, as_user("bob"))
            .await
            .1
            .get("idempotent-replayed")
            .is_none()
    );
    assert_eq!(effects.get(), 2);
    assert_problem(&send(&app, req("k", "a")).await, ProblemKind::ScopeMissing);

    let layer = IdempotencyLayer::in_memory().scope_by(|parts| {
        parts
            .headers
            .get("x-tenant")
            .map(|v| Scope::new(v.as_bytes()))
    });
    let (app, effects) = app_without_auth(layer);
    let tenant = |t: &str| {
        post_req(Some("k"), "")
            .header("x-tenant", t)
            .body(Body::from("a"))
            .unwrap()
    };
    send(&app, tenant("t1")).await;
    send(&app, tenant("t2")).await;
    assert_eq!(
        send(&app, tenant("t1")).await.1["idempotent-replayed"],
        "true"
    );
    assert_eq!(effects.get(), 2);
}

fn app_without_auth(layer: IdempotencyLayer) -> (Router, Arc<Effects>) {
    let effects = Arc::new(Effects::default());
    let router = Router::new()
        .route("/pay", post(handler))
        .layer(layer)
        .layer(Extension(Arc::clone(&effects)));
    (router, effects)
}

// No principal: the layer refuses to guard (500 scope-missing), and the handler never runs.
#[tokio::test]
async fn no_principal_is_a_configuration_error() {
    let (app, effects) = app_without_auth(IdempotencyLayer::in_memory());
    assert_problem(&send(&app, req("k", "a")).await, ProblemKind::ScopeMissing);
    assert_eq!(effects.get(), 0);
    // Without a key the request is not guarded and passes.
    assert_eq!(
        send(&app, post_req(None, "").body(Body::empty()).unwrap())
            .await
            .0,
        StatusCode::CREATED
    );
}
