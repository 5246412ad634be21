//! A lease is renewed by a timer of its own: a handler that blocks its thread keeps
//! its claim. On a multi-thread runtime with real time (a blocked worker cannot be
//! simulated on the paused clock).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::http::StatusCode;
use retrysafe_tower::idempotency::{IdempotencyLayer, ProblemKind};

use super::{app, send};

const LEASE: Duration = Duration::from_millis(300);

// The handler blocks its worker thread from its first poll for two leases. The lease
// is renewed all the same, so a copy sent after the first lease would have expired
// finds the claim in flight (409), not a claim to take over (the holder had declared
// nothing yet, so an expired lease would have been taken over and run again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(
    clippy::disallowed_methods,
    reason = "the handler under test blocks its thread on purpose"
)]
async fn a_handler_blocking_its_thread_keeps_its_lease() {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::in_memory()
        .lease(LEASE)
        .store_timeout(Duration::from_millis(50))
        .handlers_declare_commit_point()
        .build()
        .unwrap();
    let handler = {
        let runs = Arc::clone(&runs);
        move || {
            let runs = Arc::clone(&runs);
            async move {
                if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                    std::thread::sleep(LEASE * 2);
                }
                (StatusCode::CREATED, "paid")
            }
        }
    };
    let app = app(layer, handler);
    // Served in a task of the runtime, as a server's connection task is.
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, "alice", "k1", "{}").await }
    });
    tokio::time::sleep(LEASE + LEASE / 2).await;
    let (status, _, _, kind) = send(&app, "alice", "k1", "{}").await;
    assert_eq!(
        (status, kind),
        (StatusCode::CONFLICT, Some(ProblemKind::InFlight))
    );
    let (status, _, body, _) = first.await.unwrap();
    assert_eq!((status, &body[..]), (StatusCode::CREATED, &b"paid"[..]));
    let (status, headers, body, _) = send(&app, "alice", "k1", "{}").await;
    assert_eq!((status, &body[..]), (StatusCode::CREATED, &b"paid"[..]));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
