//! Recovery particular to the `MemoryStore`: the `outcome_unknown` records its own sweep
//! and its claims make are heard of by a reconciler, and pressure shrinks completed
//! records, never pending ones.
// A failed expectation panics with what was found.
#![allow(clippy::panic)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use retrysafe_core::idempotency::{
    CommitPoint, Completed, Fingerprint, Record, RecordId, RequestInfo, Scope, StoredResponse,
    Token, UnknownOutcome, UnknownReason,
};
use retrysafe_core::recovery::{
    PendingRecord, PendingState, ReconcilableStore, Resolution, Resolver,
};
use retrysafe_core::store::conformance::fresh_id;
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, StoreError};
use retrysafe_memory::MemoryStore;

const LEASE: Duration = Duration::from_secs(10);
const RETENTION: Duration = Duration::from_secs(60 * 60);

fn request() -> RequestInfo {
    RequestInfo::new(Scope::new("tenant"), Method::POST, "/payments")
}

fn claim(request: &RequestInfo) -> Claim<'_> {
    Claim::new(
        Token::random(),
        Fingerprint::from_bytes([1; 32]),
        LEASE,
        RETENTION,
        CommitPoint::Undeclared,
    )
    .with_request(request)
}

async fn must_claim(store: &MemoryStore, id: &RecordId, c: &Claim<'_>) {
    match store.claim(id, c).await.expect("claim") {
        ClaimOutcome::Claimed { .. } => {}
        other => panic!("expected a claim, got {other:?}"),
    }
}

struct NeverKnows;

impl Resolver for NeverKnows {
    async fn resolve(&self, _record: &PendingRecord) -> Resolution {
        Resolution::Unknown
    }
}

/// Runs one reconcile pass; returns the records its hook heard of.
async fn reconcile(store: &MemoryStore) -> Vec<UnknownOutcome> {
    let heard = Arc::new(Mutex::new(Vec::new()));
    let h = Arc::clone(&heard);
    store
        .reconciler(NeverKnows)
        .max_execution(Duration::from_millis(1))
        .grace(Duration::from_millis(1))
        .on_outcome_unknown(move |u| h.lock().expect("heard").push(u.clone()))
        .run_once()
        .await;
    heard.lock().expect("heard").clone()
}

async fn pending(store: &MemoryStore, id: &RecordId) -> PendingRecord {
    store.peek(id).await.expect("peek").expect("pending")
}

/// A full in-flight map sweeps an expired claim into `outcome_unknown`: reason
/// `LeaseExpired`, not notified, so the reconciler's hook hears of it, once.
#[tokio::test(start_paused = true)]
async fn the_sweep_makes_unknown_records_the_reconciler_tells_of() {
    let store = MemoryStore::new().max_in_flight(1).build().expect("store");
    let info = request();
    let gone = fresh_id();
    must_claim(&store, &gone, &claim(&info)).await;
    tokio::time::advance(LEASE + Duration::from_secs(1)).await;
    // The map is full: this claim sweeps the expired one first.
    must_claim(&store, &fresh_id(), &claim(&info)).await;
    let p = pending(&store, &gone).await;
    assert_eq!(
        p.state,
        PendingState::Unknown {
            reason: Some(UnknownReason::LeaseExpired)
        }
    );
    assert!(!p.notified);
    assert_eq!(p.request.as_deref(), Some(&info));
    let heard = reconcile(&store).await;
    assert_eq!(heard.iter().filter(|u| u.record == gone).count(), 1);
    assert!(pending(&store, &gone).await.notified);
    // Due again after the backoff: asked again, not told again.
    tokio::time::advance(Duration::from_secs(60)).await;
    assert!(
        store
            .due(Duration::ZERO, 100)
            .await
            .expect("due")
            .contains(&gone)
    );
    assert!(reconcile(&store).await.iter().all(|u| u.record != gone));
}

/// A claim the sweep made unknown waits for a reconciler as the claim would have: only
/// once `stale` has passed since its lease ended (its holder may still run until then).
#[tokio::test(start_paused = true)]
async fn a_swept_claim_waits_like_the_claim() {
    let store = MemoryStore::new().max_in_flight(1).build().expect("store");
    let info = request();
    let gone = fresh_id();
    must_claim(&store, &gone, &claim(&info)).await;
    tokio::time::advance(LEASE + Duration::from_secs(1)).await;
    must_claim(&store, &fresh_id(), &claim(&info)).await;
    assert!(matches!(
        pending(&store, &gone).await.state,
        PendingState::Unknown { .. }
    ));
    let stale = Duration::from_secs(65);
    assert!(!store.due(stale, 100).await.expect("due").contains(&gone));
    let early = store
        .adopt(&gone, Token::random(), LEASE, Some(stale))
        .await
        .expect("adopt");
    assert!(early.is_none());
    tokio::time::advance(stale).await;
    assert!(store.due(stale, 100).await.expect("due").contains(&gone));
}

/// A copy finding an expired claim past its commit point makes it `outcome_unknown`
/// (the layer tells the hook and marks it notified); the note stays for the resolver.
#[tokio::test(start_paused = true)]
async fn a_claim_over_an_expired_lease_makes_an_unknown_record_with_its_note() {
    let store = MemoryStore::new();
    let info = request();
    let id = fresh_id();
    let first = claim(&info);
    must_claim(&store, &id, &first).await;
    store
        .commit_point_with(&id, first.token, &[7u8; 2000])
        .await
        .expect("commit point");
    tokio::time::advance(LEASE + Duration::from_secs(1)).await;
    match store.claim(&id, &claim(&info)).await.expect("claim") {
        ClaimOutcome::Existing {
            record: Record::OutcomeUnknown(_),
            became_unknown: true,
        } => {}
        other => panic!("{other:?}"),
    }
    let p = pending(&store, &id).await;
    assert_eq!(
        p.note.as_deref().map(<[u8]>::len),
        Some(1024),
        "notes are cut to MAX_NOTE"
    );
    assert!(!p.notified);
    store.mark_notified(&id).await.expect("notified");
    assert!(pending(&store, &id).await.notified);
}

/// Under byte pressure, completed records shrink before an `outcome_unknown` one, which
/// stays pending for the reconciler.
#[tokio::test(start_paused = true)]
async fn pressure_shrinks_completed_records_before_pending_ones() {
    let store = MemoryStore::new()
        .max_bytes(32 * 1024)
        .build()
        .expect("store");
    let info = request();
    let unknown = fresh_id();
    let c = claim(&info);
    must_claim(&store, &unknown, &c).await;
    store
        .mark_unknown(
            &unknown,
            c.token,
            RETENTION,
            UnknownReason::Status(StatusCode::BAD_GATEWAY),
        )
        .await
        .expect("mark");
    let body = Completed::new(
        Fingerprint::from_bytes([1; 32]),
        Some(StoredResponse::new(
            StatusCode::CREATED,
            Vec::new(),
            Bytes::from(vec![b'x'; 1024]),
            Vec::new(),
        )),
    );
    for _ in 0..100 {
        let (id, c) = (fresh_id(), claim(&info));
        must_claim(&store, &id, &c).await;
        store
            .complete(&id, c.token, &body, RETENTION)
            .await
            .expect("complete");
    }
    assert!(store.tombstones_len() > 0);
    assert!(matches!(
        store.get(&unknown).await.expect("get"),
        Some(Record::OutcomeUnknown(_))
    ));
    assert!(
        store
            .due(Duration::ZERO, 100)
            .await
            .expect("due")
            .contains(&unknown)
    );
}

/// Makes `n` `outcome_unknown` records; their ids.
async fn unknowns(store: &MemoryStore, info: &RequestInfo, n: usize) -> Vec<RecordId> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let (id, c) = (fresh_id(), claim(info));
        must_claim(store, &id, &c).await;
        store
            .mark_unknown(
                &id,
                c.token,
                RETENTION,
                UnknownReason::Status(StatusCode::BAD_GATEWAY),
            )
            .await
            .expect("mark");
        ids.push(id);
    }
    ids
}

/// However many `outcome_unknown` records are the least recently used, byte pressure
/// never shrinks one to a tombstone: each stays pending, for the reconciler and its
/// hook.
#[tokio::test(start_paused = true)]
async fn pressure_never_shrinks_a_pending_record() {
    let store = MemoryStore::new()
        .max_bytes(256 * 1024)
        .build()
        .expect("store");
    let info = request();
    let pending_ids = unknowns(&store, &info, 100).await;
    let body = Completed::new(
        Fingerprint::from_bytes([1; 32]),
        Some(StoredResponse::new(
            StatusCode::CREATED,
            Vec::new(),
            Bytes::from(vec![b'x'; 1024]),
            Vec::new(),
        )),
    );
    for _ in 0..400 {
        let (id, c) = (fresh_id(), claim(&info));
        must_claim(&store, &id, &c).await;
        store
            .complete(&id, c.token, &body, RETENTION)
            .await
            .expect("complete");
    }
    assert!(store.tombstones_len() > 0, "there was pressure");
    let due = store.due(Duration::ZERO, 1000).await.expect("due");
    for id in &pending_ids {
        assert!(matches!(
            store.get(id).await.expect("get"),
            Some(Record::OutcomeUnknown(_))
        ));
        assert!(due.contains(id));
    }
}

/// When `outcome_unknown` records alone fill the record bound, new claims are refused
/// (the layer answers 503 `overloaded`) rather than any of them shrinking.
#[tokio::test(start_paused = true)]
async fn pending_records_filling_the_bound_refuse_new_claims() {
    let store = MemoryStore::new()
        .max_bytes(64 * 1024)
        .build()
        .expect("store");
    let info = request();
    let mut pending_ids = Vec::new();
    let refused = loop {
        let (id, c) = (fresh_id(), claim(&info));
        match store.claim(&id, &c).await {
            Ok(_) => {}
            Err(e) => break e,
        }
        store
            .mark_unknown(&id, c.token, RETENTION, UnknownReason::Panicked)
            .await
            .expect("mark");
        pending_ids.push(id);
        assert!(pending_ids.len() < 1000, "never refused");
    };
    assert!(matches!(refused, StoreError::Full), "{refused:?}");
    assert_eq!(store.tombstones_len(), 0);
    for id in &pending_ids {
        assert!(matches!(
            store.get(id).await.expect("get"),
            Some(Record::OutcomeUnknown(_))
        ));
    }
}
