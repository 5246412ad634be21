//! Duplicates in flight: 409 with `retry-after`, the wait mode, waiters racing after a
//! release, and 64 concurrent copies.

use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use retrysafe_tower::idempotency::{EventKind, IdempotencyLayer, ProblemKind};

use super::{Recorder, assert_problem, make_app, post_req, req, send};

// Row: same key, same fingerprint, in flight → 409 with retry-after.
#[tokio::test]
async fn in_flight_duplicate_gets_409_with_retry_after() {
    let rec = Recorder::default();
    let (app, effects) = make_app(rec.attach(IdempotencyLayer::in_memory()));
    let slow = post_req(Some("k"), "")
        .header("x-sleep-ms", "300")
        .body(Body::from("a"))
        .unwrap();
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, slow).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let dup = send(
        &app,
        post_req(Some("k"), "")
            .header("x-sleep-ms", "300")
            .body(Body::from("a"))
            .unwrap(),
    )
    .await;
    assert_problem(&dup, ProblemKind::InFlight);
    assert_eq!(dup.1["retry-after"], "1");
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(effects.get(), 1);
    assert_eq!(rec.count(EventKind::Conflict), 1);
}

// Row: in flight with wait_for_in_flight → wait and replay.
#[tokio::test]
async fn in_flight_duplicate_waits_and_replays() {
    let layer = IdempotencyLayer::in_memory()
        .wait_for_in_flight(Duration::from_secs(5))
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let mk = || {
        post_req(Some("k"), "")
            .header("x-sleep-ms", "200")
            .body(Body::from("a"))
            .unwrap()
    };
    let first = tokio::spawn({
        let app = app.clone();
        let r = mk();
        async move { send(&app, r).await }
    });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let dup = send(&app, mk()).await;
    let first = first.await.unwrap();
    assert_eq!(dup.0, StatusCode::CREATED);
    assert_eq!(dup.2, first.2);
    assert_eq!(dup.1["idempotent-replayed"], "true");
    assert_eq!(effects.get(), 1);
}

// Row: wait mode past its maximum → 409.
#[tokio::test(start_paused = true)]
async fn wait_past_its_maximum_gets_409() {
    let layer = IdempotencyLayer::in_memory()
        .wait_for_in_flight(Duration::from_secs(2))
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let mk = || {
        post_req(Some("k"), "")
            .header("x-sleep-ms", "8000")
            .body(Body::from("a"))
            .unwrap()
    };
    let first = tokio::spawn({
        let app = app.clone();
        let r = mk();
        async move { send(&app, r).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let start = tokio::time::Instant::now();
    let dup = send(&app, mk()).await;
    assert_problem(&dup, ProblemKind::InFlight);
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(effects.get(), 1);
}

// Row: waiters whose holder released race to claim: exactly one runs next.
#[tokio::test]
async fn waiters_race_to_claim_after_a_release() {
    let layer = IdempotencyLayer::in_memory()
        .wait_for_in_flight(Duration::from_secs(5))
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let first = tokio::spawn({
        let app = app.clone();
        let r = post_req(Some("k"), "")
            .header("x-sleep-ms", "200")
            .header("x-status", "503")
            .header("x-no-effect", "1")
            .body(Body::from("a"))
            .unwrap();
        async move { send(&app, r).await }
    });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let mut waiters = Vec::new();
    for _ in 0..8 {
        let app = app.clone();
        waiters.push(tokio::spawn(async move { send(&app, req("k", "a")).await }));
    }
    assert_eq!(first.await.unwrap().0, StatusCode::SERVICE_UNAVAILABLE);
    let mut bodies = Vec::new();
    for w in waiters {
        let r = w.await.unwrap();
        assert_eq!(r.0, StatusCode::CREATED);
        bodies.push(r.2);
    }
    assert!(
        bodies.windows(2).all(|w| w[0] == w[1]),
        "all waiters see one execution"
    );
    assert_eq!(effects.get(), 2, "the released first call and one re-run");
}

// 64 concurrent duplicates → exactly one execution: the 201s identical, the rest 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_run_once() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory());
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let app = app.clone();
        let r = post_req(Some("k"), "")
            .header("x-sleep-ms", "300")
            .body(Body::from("a"))
            .unwrap();
        tasks.push(tokio::spawn(async move { send(&app, r).await }));
    }
    let mut created = Vec::new();
    let mut conflicts = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r.0 {
            StatusCode::CREATED => created.push(r.2),
            StatusCode::CONFLICT => {
                assert_problem(&r, ProblemKind::InFlight);
                conflicts += 1;
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(effects.get(), 1);
    assert_eq!(created.len() + conflicts, 64);
    assert!(!created.is_empty());
    assert!(created.windows(2).all(|w| w[0] == w[1]));
}

// In wait mode all 64 get the identical 201.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_in_wait_mode_all_get_the_answer() {
    let layer = IdempotencyLayer::in_memory()
        .wait_for_in_flight(Duration::from_secs(5))
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let app = app.clone();
        let r = post_req(Some("k"), "")
            .header("x-sleep-ms", "300")
            .body(Body::from("a"))
            .unwrap();
        tasks.push(tokio::spawn(async move { send(&app, r).await }));
    }
    let mut bodies = Vec::new();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.0, StatusCode::CREATED);
        bodies.push(r.2);
    }
    assert_eq!(effects.get(), 1);
    assert!(bodies.windows(2).all(|w| w[0] == w[1]));
}
