//! What is guarded, and the key: no key, a required key, invalid keys, the two wire
//! forms of one key, and the methods and gRPC calls that pass untouched.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode};
use retrysafe_tower::idempotency::{IdempotencyLayer, ProblemKind};

use super::{assert_problem, make_app, post_req, req, send};

// Row: no key, route does not require one → passes through, not guarded.
#[tokio::test]
async fn no_key_passes_through_unguarded() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory());
    for _ in 0..2 {
        let r = send(&app, post_req(None, "").body(Body::from("a")).unwrap()).await;
        assert_eq!(r.0, StatusCode::CREATED);
        assert!(r.1.get("idempotent-replayed").is_none());
        assert_eq!(
            r.1["set-cookie"], "session=abc",
            "an unguarded response is untouched"
        );
    }
    assert_eq!(effects.get(), 2);
}

// Row: no key with require_key → 400, no record.
#[tokio::test]
async fn require_key_refuses_a_request_without_key() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory().require_key());
    let r = send(&app, post_req(None, "").body(Body::from("a")).unwrap()).await;
    assert_problem(&r, ProblemKind::KeyMissing);
    assert_eq!(effects.get(), 0);
}

// Row: key empty, over 255 characters, or not printable ASCII → 400.
#[tokio::test]
async fn invalid_keys_are_refused() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory());
    let long = "k".repeat(256);
    let max = "k".repeat(255);
    let bad: Vec<HeaderValue> = vec![
        HeaderValue::from_static(""),
        HeaderValue::from_static("   "),
        HeaderValue::from_static("\"\""),
        HeaderValue::from_str(&long).unwrap(),
        HeaderValue::from_bytes("clé".as_bytes()).unwrap(),
        HeaderValue::from_bytes(b"a\tb").unwrap(),
        HeaderValue::from_bytes(b"\xff\xfe").unwrap(),
        HeaderValue::from_static("two words"),
    ];
    for value in bad {
        let r = Request::post("/pay")
            .header("idempotency-key", value.clone())
            .body(Body::from("a"))
            .unwrap();
        let r = send(&app, r).await;
        assert_problem(&r, ProblemKind::KeyInvalid);
    }
    // The key sent twice is ambiguous.
    let r = Request::post("/pay")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(Body::from("a"))
        .unwrap();
    assert_problem(&send(&app, r).await, ProblemKind::KeyInvalid);
    assert_eq!(effects.get(), 0);
    // 255 characters, and the sf-string form with a space, are fine.
    assert_eq!(send(&app, req(&max, "a")).await.0, StatusCode::CREATED);
    assert_eq!(
        send(&app, req("\"two words\"", "a")).await.0,
        StatusCode::CREATED
    );
    assert_eq!(effects.get(), 2);
}

// Both wire forms of one key are the same key.
#[tokio::test]
async fn quoted_and_bare_forms_are_one_key() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory());
    assert_eq!(send(&app, req("abc-1", "a")).await.0, StatusCode::CREATED);
    let r = send(&app, req("\"abc-1\"", "a")).await;
    assert_eq!(r.1["idempotent-replayed"], "true");
    assert_eq!(effects.get(), 1);
}

// Other methods and gRPC requests pass untouched by default.
#[tokio::test]
async fn unguarded_methods_and_grpc_pass_untouched() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory());
    for _ in 0..2 {
        let r = Request::put("/pay")
            .header("idempotency-key", "k")
            .body(Body::from("a"))
            .unwrap();
        assert!(send(&app, r).await.1.get("idempotent-replayed").is_none());
        let r = Request::get("/pay")
            .header("idempotency-key", "k")
            .body(Body::empty())
            .unwrap();
        assert!(send(&app, r).await.1.get("idempotent-replayed").is_none());
        let r = Request::post("/pay")
            .header("idempotency-key", "k")
            .header("content-type", "application/grpc+proto")
            .body(Body::from("a"))
            .unwrap();
        assert!(send(&app, r).await.1.get("idempotent-replayed").is_none());
    }
    assert_eq!(effects.get(), 6);
    // Configured methods and gRPC opt-in.
    let (app, effects) = make_app(
        IdempotencyLayer::in_memory()
            .methods([axum::http::Method::PUT])
            .guard_grpc(),
    );
    for _ in 0..2 {
        let r = Request::put("/pay")
            .header("idempotency-key", "k")
            .body(Body::from("a"))
            .unwrap();
        send(&app, r).await;
    }
    assert_eq!(effects.get(), 1);
}
