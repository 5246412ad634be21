//! The bounds: oversize bodies and responses, the in-flight bound, a full record
//! cache, a slow response body, one huge frame, and a record heavier than the store.

use std::time::Duration;

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::http::StatusCode;
use axum::routing::post;
use bytes::Bytes;
use retrysafe_memory::MemoryStore;
use retrysafe_test_support::bearer::auth;
use retrysafe_tower::idempotency::{IdempotencyLayer, ProblemKind};
use tower::ServiceExt;

use super::{assert_problem, make_app, post_req, req, send};

// Row: request body over the limit → 413 before any claim.
#[tokio::test]
async fn oversize_body_is_refused_before_any_claim() {
    let layer = IdempotencyLayer::in_memory()
        .max_request_body(1024)
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let big = vec![b'x'; 1025];
    let r = send(
        &app,
        post_req(Some("k"), "")
            .body(Body::from(big.clone()))
            .unwrap(),
    )
    .await;
    assert_problem(&r, ProblemKind::BodyTooLarge);
    // Streamed without a content-length.
    let chunks = futures_util::stream::iter(
        big.chunks(100)
            .map(|c| Ok::<_, std::io::Error>(Bytes::copy_from_slice(c)))
            .collect::<Vec<_>>(),
    );
    let r = send(
        &app,
        post_req(Some("k"), "")
            .body(Body::from_stream(chunks))
            .unwrap(),
    )
    .await;
    assert_problem(&r, ProblemKind::BodyTooLarge);
    assert_eq!(effects.get(), 0);
    // No record was made: the same key with a small body runs.
    assert_eq!(send(&app, req("k", "small")).await.0, StatusCode::CREATED);
    assert_eq!(effects.get(), 1);
}

// Row: response over the storable limit → not-replayable marker; later copies 409.
#[tokio::test]
async fn oversize_response_is_streamed_once_and_never_rerun() {
    let layer = IdempotencyLayer::in_memory()
        .max_stored_response(1000)
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let mk = || {
        post_req(Some("k"), "")
            .header("x-big", "5000")
            .body(Body::from("a"))
            .unwrap()
    };
    let first = send(&app, mk()).await;
    assert_eq!(first.0, StatusCode::CREATED);
    assert_eq!(first.2.len(), 5000, "the first client gets the whole body");
    let later = send(&app, mk()).await;
    assert_problem(&later, ProblemKind::ResponseNotStored);
    assert_eq!(effects.get(), 1);
    // At the limit it is stored.
    let mk = || {
        post_req(Some("k2"), "")
            .header("x-big", "1000")
            .body(Body::from("a"))
            .unwrap()
    };
    send(&app, mk()).await;
    let again = send(&app, mk()).await;
    assert_eq!(again.2.len(), 1000);
    assert_eq!(again.1["idempotent-replayed"], "true");
}

// Row: too many guarded requests in flight → 503 with retry-after.
#[tokio::test]
async fn in_flight_bound_answers_503() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory().max_in_flight(1));
    let slow = tokio::spawn({
        let app = app.clone();
        let r = post_req(Some("a"), "")
            .header("x-sleep-ms", "200")
            .body(Body::from("a"))
            .unwrap();
        async move { send(&app, r).await }
    });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let r = send(&app, req("b", "a")).await;
    assert_problem(&r, ProblemKind::Overloaded);
    assert!(r.1.contains_key("retry-after"));
    assert_eq!(slow.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(send(&app, req("b", "a")).await.0, StatusCode::CREATED);
    assert_eq!(effects.get(), 2);
}

// A full completed-record cache, then a fresh claim and its duplicate: still one run.
#[tokio::test]
async fn full_cache_does_not_let_a_duplicate_run() {
    let store = MemoryStore::new().max_bytes(64 * 1024).build().unwrap();
    let (app, effects) = make_app(IdempotencyLayer::new(store.clone()));
    for i in 0..300 {
        let r = post_req(Some(&format!("fill-{i}")), "")
            .header("x-big", "1000")
            .body(Body::from("a"))
            .unwrap();
        assert_eq!(send(&app, r).await.0, StatusCode::CREATED);
    }
    assert!(store.cached_bytes() <= 64 * 1024);
    let before = effects.get();
    let slow = tokio::spawn({
        let app = app.clone();
        let r = post_req(Some("fresh"), "")
            .header("x-sleep-ms", "100")
            .body(Body::from("a"))
            .unwrap();
        async move { send(&app, r).await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_problem(&send(&app, req("fresh", "a")).await, ProblemKind::InFlight);
    assert_eq!(slow.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(
        send(&app, req("fresh", "a")).await.1["idempotent-replayed"],
        "true"
    );
    assert_eq!(effects.get(), before + 1);
}

// A streaming response that outlives max_execution is not held back forever: it is
// recorded as not stored and streams on.
#[tokio::test(start_paused = true)]
async fn slow_response_body_is_bounded_by_max_execution() {
    let layer = IdempotencyLayer::in_memory()
        .max_execution(Duration::from_secs(5))
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/pay",
            post(|| async {
                let chunks = futures_util::stream::unfold(0u32, |n| async move {
                    if n == 10 {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    Some((Ok::<_, std::io::Error>(Bytes::from("chunk ")), n + 1))
                });
                (StatusCode::CREATED, Body::from_stream(chunks))
            }),
        )
        .layer(layer)
        .layer(axum::middleware::map_request(auth));
    let start = tokio::time::Instant::now();
    let res = app.clone().oneshot(req("k", "a")).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert!(
        start.elapsed() <= Duration::from_secs(6),
        "headers after max_execution at most"
    );
    let body = to_bytes(res.into_body(), usize::MAX).await.unwrap();
    assert_eq!(
        body,
        "chunk ".repeat(10),
        "the first client still gets every byte"
    );
    let later = send(&app, req("k", "a")).await;
    assert_problem(&later, ProblemKind::ResponseNotStored);
}

// A response that arrives as one frame larger than the storable limit is streamed on
// as it is, and the key is never re-run.
#[tokio::test]
async fn one_huge_frame_is_passed_on() {
    let layer = IdempotencyLayer::in_memory()
        .max_stored_response(10)
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let mk = || {
        post_req(Some("k"), "")
            .header("x-big", "100000")
            .body(Body::from("a"))
            .unwrap()
    };
    assert_eq!(send(&app, mk()).await.2.len(), 100_000);
    assert_problem(&send(&app, mk()).await, ProblemKind::ResponseNotStored);
    assert_eq!(effects.get(), 1);
}

// A completed record heavier than the whole MemoryStore is kept as a "not stored"
// marker, never silently dropped (which would let a retry run again).
#[tokio::test]
async fn record_heavier_than_the_store_is_kept_as_a_marker() {
    let store = MemoryStore::new().max_bytes(4096).build().unwrap();
    let (app, effects) = make_app(IdempotencyLayer::new(store));
    let mk = || {
        post_req(Some("k"), "")
            .header("x-big", "10000")
            .body(Body::from("a"))
            .unwrap()
    };
    assert_eq!(send(&app, mk()).await.2.len(), 10_000);
    assert_problem(&send(&app, mk()).await, ProblemKind::ResponseNotStored);
    assert_eq!(effects.get(), 1);
}
