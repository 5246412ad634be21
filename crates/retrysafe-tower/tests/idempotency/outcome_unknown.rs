//! Server errors and panics become `outcome-unknown`; a dropped caller's handler still
//! runs to completion.

use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use retrysafe_tower::idempotency::{IdempotencyLayer, ProblemKind, UnknownReason};
use tower::ServiceExt;

use super::{Recorder, assert_problem, make_app, post_req, req, send};

// Row: 5xx or 408 without NoEffect → answered as the handler did, do-not-retry;
// later copies get 500 outcome-unknown; the reconcile hook is called once.
#[tokio::test]
async fn server_errors_become_outcome_unknown() {
    let rec = Recorder::default();
    let (app, effects) = make_app(rec.attach(IdempotencyLayer::in_memory()));
    for (i, status) in [500u16, 502, 503, 408].into_iter().enumerate() {
        let key = format!("k{i}");
        let r = post_req(Some(&key), "")
            .header("x-status", status.to_string())
            .body(Body::from("a"))
            .unwrap();
        let first = send(&app, r).await;
        assert_eq!(first.0.as_u16(), status);
        assert_eq!(first.1["do-not-retry"], "1");
        assert!(first.2.starts_with(b"effect"), "the handler's own body");
        for _ in 0..2 {
            let later = send(&app, req(&key, "a")).await;
            assert_problem(&later, ProblemKind::OutcomeUnknown);
        }
    }
    assert_eq!(effects.get(), 4, "never re-run");
    let unknown = rec.unknown.lock().unwrap().clone();
    assert_eq!(unknown.len(), 4, "reconcile hook called once per record");
    assert_eq!(
        unknown[0].reason,
        UnknownReason::Status(StatusCode::INTERNAL_SERVER_ERROR)
    );
    assert_eq!(
        unknown[3].reason,
        UnknownReason::Status(StatusCode::REQUEST_TIMEOUT)
    );
}

// Row: a panicking handler → 500 problem, do-not-retry, outcome unknown.
#[tokio::test]
async fn panics_become_outcome_unknown() {
    let rec = Recorder::default();
    let (app, effects) = make_app(rec.attach(IdempotencyLayer::in_memory()));
    let r = post_req(Some("k"), "")
        .header("x-panic", "1")
        .body(Body::from("a"))
        .unwrap();
    assert_problem(&send(&app, r).await, ProblemKind::HandlerPanicked);
    assert_problem(
        &send(&app, req("k", "a")).await,
        ProblemKind::OutcomeUnknown,
    );
    assert_eq!(effects.get(), 0);
    assert_eq!(
        rec.unknown.lock().unwrap()[0].reason,
        UnknownReason::Panicked
    );
    // The service keeps working.
    assert_eq!(send(&app, req("k2", "a")).await.0, StatusCode::CREATED);
}

// Row: client disconnected mid-request → the handler runs to completion, is stored.
#[tokio::test(start_paused = true)]
async fn dropped_outer_future_still_stores_the_result() {
    let layer = IdempotencyLayer::in_memory();
    let shutdown = layer.shutdown_handle();
    let (app, effects) = make_app(layer);
    let r = post_req(Some("k"), "")
        .header("x-sleep-ms", "1000")
        .body(Body::from("a"))
        .unwrap();
    let outer = tokio::time::timeout(Duration::from_millis(100), app.clone().oneshot(r)).await;
    assert!(outer.is_err(), "the client gave up");
    assert_eq!(effects.get(), 0);
    assert_eq!(shutdown.in_flight(), 1, "the handler still runs");
    shutdown.clone().drain().await;
    assert_eq!(effects.get(), 1);
    let retry = send(
        &app,
        post_req(Some("k"), "")
            .header("x-sleep-ms", "1000")
            .body(Body::from("a"))
            .unwrap(),
    )
    .await;
    assert_eq!(retry.0, StatusCode::CREATED);
    assert_eq!(retry.1["idempotent-replayed"], "true");
    assert_eq!(effects.get(), 1);
}
