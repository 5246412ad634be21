//! Store failures: completion retried, fail closed or open, a claim whose reply was
//! lost, a slow store, and `fail_open` never running past an existing record.

use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use retrysafe_core::store::FaultyStore;
use retrysafe_memory::MemoryStore;
use retrysafe_tower::idempotency::{EventKind, IdempotencyLayer, ProblemKind};

use super::{Recorder, assert_problem, make_app, post_req, req, send};

// Row: completion write fails after the handler ran → retried; the real response
// returned either way; completion_lost when it never lands.
#[tokio::test(start_paused = true)]
async fn completion_failures_are_retried_then_reported() {
    let store = FaultyStore::new(MemoryStore::new());
    let rec = Recorder::default();
    let (app, effects) = make_app(rec.attach(IdempotencyLayer::new(store.clone())));
    store.fail_next_completions(3);
    let first = send(&app, req("k", "a")).await;
    assert_eq!(first.0, StatusCode::CREATED);
    assert_eq!(
        send(&app, req("k", "a")).await.1["idempotent-replayed"],
        "true",
        "completed after retries"
    );
    assert_eq!(rec.count(EventKind::CompletionLost), 0);

    store.fail_next_completions(u32::MAX);
    let r = send(&app, req("k2", "a")).await;
    assert_eq!(r.0, StatusCode::CREATED, "the handler's real response");
    assert_eq!(rec.count(EventKind::CompletionLost), 1);
    assert_eq!(effects.get(), 2);
}

// Row: store unavailable → 503 with retry-after (fail closed); fail_open runs unguarded.
#[tokio::test]
async fn store_failure_fails_closed_or_open() {
    let store = FaultyStore::new(MemoryStore::new());
    store.fail_all(true);
    let (app, effects) = make_app(IdempotencyLayer::new(store.clone()));
    let r = send(&app, req("k", "a")).await;
    assert_problem(&r, ProblemKind::StoreUnavailable);
    assert_eq!(r.1["retry-after"], "1");
    assert_eq!(effects.get(), 0);
    // Recovers without a restart.
    store.fail_all(false);
    assert_eq!(send(&app, req("k", "a")).await.0, StatusCode::CREATED);

    let store = FaultyStore::new(MemoryStore::new());
    store.fail_all(true);
    let (app, effects) = make_app(IdempotencyLayer::new(store).fail_open());
    assert_eq!(send(&app, req("k", "a")).await.0, StatusCode::CREATED);
    assert_eq!(send(&app, req("k", "a")).await.0, StatusCode::CREATED);
    assert_eq!(effects.get(), 2, "unguarded");
}

// A claim the store applied but whose reply was lost (a connection reset after the
// script ran) answers 503 and is released with its token in the background, so the
// retry runs the handler — not a key stuck in progress, nor an unknown outcome.
#[tokio::test(start_paused = true)]
async fn a_claim_applied_with_its_reply_lost_is_released_and_the_retry_runs() {
    let store = FaultyStore::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(store.clone());
    let shutdown = layer.shutdown_handle();
    let (app, effects) = make_app(layer);
    store.lose_next_replies(1);
    let lost = send(&app, req("k", "a")).await;
    assert_problem(&lost, ProblemKind::StoreUnavailable);
    assert_eq!(effects.get(), 0);
    shutdown.drain().await; // the background release
    let (retry, headers, _) = send(&app, req("k", "a")).await;
    assert_eq!(retry, StatusCode::CREATED);
    assert!(!headers.contains_key("idempotent-replayed"));
    assert_eq!(effects.get(), 1);
}

// Row: a slow store times out (1 s default, or the request deadline) → 503.
#[tokio::test(start_paused = true)]
async fn slow_store_times_out() {
    let store = FaultyStore::new(MemoryStore::new());
    store.delay(Duration::from_secs(5));
    let (app, effects) = make_app(IdempotencyLayer::new(store.clone()));
    let start = tokio::time::Instant::now();
    assert_problem(
        &send(&app, req("k", "a")).await,
        ProblemKind::StoreUnavailable,
    );
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    // A request deadline shortens it.
    let mut r = req("k", "a");
    r.extensions_mut()
        .insert(retrysafe_core::Deadline::after(Duration::from_millis(200)));
    let start = tokio::time::Instant::now();
    assert_problem(&send(&app, r).await, ProblemKind::StoreUnavailable);
    assert_eq!(start.elapsed(), Duration::from_millis(200));
    assert_eq!(effects.get(), 0);
}

// fail_open never runs a handler past a record that exists: a waiter whose store
// fails while the holder runs gets 503, not an unguarded second run.
#[tokio::test(start_paused = true)]
async fn fail_open_never_runs_past_an_existing_record() {
    let store = FaultyStore::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(store.clone())
        .fail_open()
        .wait_for_in_flight(Duration::from_secs(5))
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let first = tokio::spawn({
        let app = app.clone();
        let r = post_req(Some("k"), "")
            .header("x-sleep-ms", "3000")
            .body(Body::from("a"))
            .unwrap();
        async move { send(&app, r).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let dup = tokio::spawn({
        let app = app.clone();
        async move { send(&app, req("k", "a")).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The store goes down while the duplicate waits.
    store.fail_all(true);
    let dup = dup.await.unwrap();
    assert_problem(&dup, ProblemKind::StoreUnavailable);
    store.fail_all(false);
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(effects.get(), 1);
}
