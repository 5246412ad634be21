//! A handler past `max_execution`, or whose lease was lost, is cancelled; the record
//! follows the protocol's rules for a cancelled handler.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode;
use axum::{Extension, Router};
use retrysafe_core::idempotency::{
    CommitPoint, Fingerprint, IdempotencyContext, Principal, RecordId, Scope, Token,
};
use retrysafe_core::store::{Claim, ClaimOutcome, FaultyStore, IdempotencyStore, StoreError};
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_memory::MemoryStore;
use retrysafe_tower::idempotency::{IdempotencyLayer, ProblemKind, UnknownOutcome, UnknownReason};

use super::{app, send};

/// What the handlers saw and did.
#[derive(Default)]
struct Seen {
    effects: AtomicUsize,
    context: Mutex<Option<IdempotencyContext>>,
}

/// `layer` over a handler that takes a minute, declares its commit point (when
/// `commit`), then has its effect.
fn slow(layer: IdempotencyLayer, seen: &Arc<Seen>, commit: bool) -> Router {
    let seen = Arc::clone(seen);
    let handler = move |Extension(ctx): Extension<IdempotencyContext>| {
        let seen = Arc::clone(&seen);
        async move {
            *seen.context.lock().unwrap() = Some(ctx.clone());
            tokio::time::sleep(Duration::from_secs(60)).await;
            if commit {
                ctx.commit_point().await.unwrap();
            }
            seen.effects.fetch_add(1, Ordering::SeqCst);
            (StatusCode::CREATED, "paid")
        }
    };
    app(layer, handler)
}

// Past max_execution, a handler with no declared commit point is cancelled: its effect
// never happens, its client gets 500 `outcome-unknown`, the record is outcome_unknown
// (reason: cancelled) and a retry is answered from it.
#[tokio::test(start_paused = true)]
async fn a_handler_past_max_execution_is_cancelled_before_its_effect() {
    let seen = Arc::new(Seen::default());
    let unknown = Arc::new(Mutex::new(Vec::<UnknownOutcome>::new()));
    let layer = {
        let unknown = Arc::clone(&unknown);
        IdempotencyLayer::in_memory()
            .max_execution(Duration::from_secs(5))
            .on_outcome_unknown(move |u| unknown.lock().unwrap().push(u.clone()))
            .build()
            .unwrap()
    };
    let app = slow(layer, &seen, false);
    let first = send(&app, "alice", "k", "x").await;
    assert_eq!(first.0, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(first.3, Some(ProblemKind::OutcomeUnknown));
    assert_eq!(first.1["do-not-retry"], "1");
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert_eq!(
        seen.effects.load(Ordering::SeqCst),
        0,
        "cancelled, never ran on"
    );
    let reasons: Vec<_> = unknown.lock().unwrap().iter().map(|u| u.reason).collect();
    assert_eq!(reasons, [UnknownReason::Cancelled]);
    let again = send(&app, "alice", "k", "x").await;
    assert_eq!(again.3, Some(ProblemKind::OutcomeUnknown));
    assert_eq!(seen.effects.load(Ordering::SeqCst), 0);
}

// A handler cancelled before its declared commit point had no effect: the key is
// released, its client gets a retryable 5xx, and the retry runs.
#[tokio::test(start_paused = true)]
async fn a_handler_cancelled_before_its_commit_point_is_released() {
    let seen = Arc::new(Seen::default());
    let layer = IdempotencyLayer::in_memory()
        .handlers_declare_commit_point()
        .max_execution(Duration::from_secs(5))
        .build()
        .unwrap();
    let app = slow(layer, &seen, true);
    let first = send(&app, "alice", "k", "x").await;
    assert!(first.0.is_server_error());
    assert!(!first.1.contains_key("do-not-retry"), "a retry is safe");
    assert_eq!(seen.effects.load(Ordering::SeqCst), 0);
    // The retry runs (and is slow too, so it is cancelled the same way).
    let again = send(&app, "alice", "k", "x").await;
    assert!(!again.1.contains_key("do-not-retry"));
    assert_ne!(again.3, Some(ProblemKind::InFlight), "the key was released");
    assert_eq!(seen.effects.load(Ordering::SeqCst), 0);
}

// A renewal refused with a stale token: the handler's context says its lease was lost,
// its commit point fails, and the layer cancels it before its effect.
#[tokio::test(start_paused = true)]
async fn a_handler_whose_lease_was_lost_is_cancelled() {
    let seen = Arc::new(Seen::default());
    // Renewals refused with a stale token, as after a takeover.
    let store = FaultyStore::new(MemoryStore::new());
    store.refuse_renewals(true);
    let layer = IdempotencyLayer::new(store).build().unwrap();
    let app = slow(layer, &seen, false);
    let first = send(&app, "alice", "k", "x").await;
    assert!(first.0.is_server_error());
    let ctx = seen.context.lock().unwrap().clone().unwrap();
    assert!(ctx.lease_lost());
    ctx.until_lease_lost().await;
    assert!(matches!(
        ctx.commit_point().await,
        Err(StoreError::StaleToken)
    ));
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert_eq!(
        seen.effects.load(Ordering::SeqCst),
        0,
        "cancelled, never ran on"
    );
}

// After another copy took the claim over, the old holder's commit point fails: it must
// not perform its effect.
#[tokio::test(start_paused = true)]
async fn the_commit_point_fails_after_a_takeover() {
    let store = MemoryStore::new();
    let scope = Scope::from(&Principal::new("alice"));
    let key = IdempotencyKey::new("k").unwrap();
    let id = RecordId::new(&scope, &key);
    let fingerprint = Fingerprint::from_bytes([1; 32]);
    let lease = Duration::from_secs(1);
    let retention = Duration::from_secs(60);
    let claim = |token| Claim::new(token, fingerprint, lease, retention, CommitPoint::Before);
    let (old, new) = (Token::random(), Token::random());
    let ours = store.claim(&id, &claim(old)).await.unwrap();
    assert!(matches!(ours, ClaimOutcome::Claimed { takeover: false }));
    tokio::time::sleep(lease * 2).await;
    let theirs = store.claim(&id, &claim(new)).await.unwrap();
    assert!(matches!(theirs, ClaimOutcome::Claimed { takeover: true }));
    let ctx = IdempotencyContext::new(
        scope,
        key,
        old,
        retrysafe_core::store::BoxStore::new(store),
        Duration::from_millis(100),
    );
    assert!(matches!(
        ctx.commit_point().await,
        Err(StoreError::StaleToken)
    ));
    assert!(!ctx.is_committed());
}

// A lease must exceed three store call timeouts.
#[test]
fn the_lease_must_outlast_three_store_timeouts() {
    let l = || IdempotencyLayer::in_memory().lease(Duration::from_secs(3));
    let refused = l().build().unwrap_err();
    assert_eq!(refused.fields().collect::<Vec<_>>(), ["lease"]);
    assert!(
        l().store_timeout(Duration::from_millis(999))
            .build()
            .is_ok()
    );
    let short = IdempotencyLayer::in_memory()
        .lease(Duration::from_millis(400))
        .store_timeout(Duration::from_millis(100));
    assert!(short.build().is_ok());
}
