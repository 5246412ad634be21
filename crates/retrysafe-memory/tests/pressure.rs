//! The `MemoryStore` under byte pressure: records shrink to tombstones (copies are
//! refused, never run again), the oldest tombstones are dropped and measured, a
//! fail-closed store refuses new claims instead, and a flooding scope is the one shrunk.
// A failed expectation panics with what was found.
#![allow(clippy::panic)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use retrysafe_core::idempotency::{
    CommitPoint, Completed, Fingerprint, Record, RecordId, RequestInfo, Scope, StoredResponse,
    Token,
};
use retrysafe_core::store::conformance::fresh_id;
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, StoreError};
use retrysafe_memory::MemoryStore;

const LEASE: Duration = Duration::from_secs(10);
const RETENTION: Duration = Duration::from_secs(60 * 60);

fn fp(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

fn completed(body_len: usize) -> Completed {
    Completed::new(
        fp(1),
        Some(StoredResponse::new(
            StatusCode::CREATED,
            Vec::new(),
            Bytes::from(vec![b'x'; body_len]),
            Vec::new(),
        )),
    )
}

fn request(scope: &str) -> RequestInfo {
    RequestInfo::new(Scope::new(scope), Method::POST, "/payments")
}

fn claim(request: Option<&RequestInfo>) -> Claim<'_> {
    let c = Claim::new(
        Token::random(),
        fp(1),
        LEASE,
        RETENTION,
        CommitPoint::Undeclared,
    );
    match request {
        Some(r) => c.with_request(r),
        None => c,
    }
}

/// Claims `id` in `scope` (anonymous if `None`) and completes it with a body of
/// `body_len` bytes.
async fn store_completed(
    store: &MemoryStore,
    id: &RecordId,
    scope: Option<&RequestInfo>,
    body_len: usize,
) -> Result<(), StoreError> {
    let c = claim(scope);
    match store.claim(id, &c).await? {
        ClaimOutcome::Claimed { .. } => {}
        other => panic!("expected a claim, got {other:?}"),
    }
    store
        .complete(id, c.token, &completed(body_len), RETENTION)
        .await
}

/// What a copy of the request of `id` finds: never a claim.
async fn copy_finds(store: &MemoryStore, id: &RecordId, scope: Option<&RequestInfo>) -> Record {
    match store.claim(id, &claim(scope)).await.expect("claim") {
        ClaimOutcome::Existing {
            record,
            became_unknown: false,
        } => record,
        other => panic!("a copy of a completed request must not run again: {other:?}"),
    }
}

fn recorder() -> (
    Arc<Mutex<Vec<RecordId>>>,
    impl Fn(&RecordId) + Send + Sync + 'static,
) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let hook = {
        let seen = Arc::clone(&seen);
        move |id: &RecordId| seen.lock().expect("recorder").push(*id)
    };
    (seen, hook)
}

/// A record pushed out of a full store leaves a tombstone: copies, whatever their body,
/// get `Evicted` (409 `response-evicted`), never a claim, until its retention ends.
#[tokio::test(start_paused = true)]
async fn a_pushed_out_record_answers_evicted_never_a_rerun() {
    let store = MemoryStore::new()
        .max_bytes(32 * 1024)
        .build()
        .expect("store");
    let first = fresh_id();
    store_completed(&store, &first, None, 1024)
        .await
        .expect("complete");
    assert!(matches!(
        copy_finds(&store, &first, None).await,
        Record::Completed(_)
    ));
    for _ in 0..30 {
        store_completed(&store, &fresh_id(), None, 1024)
            .await
            .expect("complete");
    }
    assert!(store.tombstones_len() > 0);
    assert!(matches!(
        copy_finds(&store, &first, None).await,
        Record::Evicted(_)
    ));
    let mut other_body = claim(None);
    other_body.fingerprint = fp(9);
    assert!(matches!(
        store.claim(&first, &other_body).await.expect("claim"),
        ClaimOutcome::Existing {
            record: Record::Evicted(_),
            ..
        }
    ));
    assert!(matches!(
        store.get(&first).await.expect("get"),
        Some(Record::Evicted(_))
    ));
    assert_eq!(store.effective_retention(), None, "no key forgotten");
    // Once the retention has passed, the key is new again.
    tokio::time::advance(RETENTION + Duration::from_secs(1)).await;
    assert_eq!(store.get(&first).await.expect("get"), None);
    store_completed(&store, &first, None, 10)
        .await
        .expect("a new request after the retention runs");
}

/// When tombstones no longer fit, the oldest are dropped, each reported once; the
/// effective retention says how far back every key is still remembered, and every key
/// younger than that is remembered.
#[tokio::test(start_paused = true)]
async fn the_oldest_tombstones_are_dropped_and_the_gauge_tells_how_far_back() {
    let (seen, hook) = recorder();
    let store = MemoryStore::new()
        .max_bytes(32 * 1024)
        .on_evicted(hook)
        .build()
        .expect("store");
    let ids: Vec<RecordId> = (0..300).map(|_| fresh_id()).collect();
    for id in &ids {
        store_completed(&store, id, None, 512)
            .await
            .expect("complete");
        tokio::time::advance(Duration::from_secs(1)).await;
    }
    let seen = seen.lock().expect("recorder").clone();
    assert!(!seen.is_empty());
    // The oldest were dropped: a prefix of the keys, in order.
    assert_eq!(ids.get(..seen.len()), Some(&seen[..]));
    let remembered = store.effective_retention().expect("keys were forgotten");
    assert!(
        remembered < Duration::from_secs(300) && remembered > Duration::from_secs(10),
        "{remembered:?}"
    );
    let remembered_secs = usize::try_from(remembered.as_secs()).expect("small");
    for (age, id) in ids.iter().rev().enumerate() {
        let found = store.get(id).await.expect("get");
        if age < remembered_secs {
            assert!(
                matches!(found, Some(Record::Completed(_) | Record::Evicted(_))),
                "{age} s old, within the effective retention: {found:?}"
            );
        }
        if seen.contains(id) {
            assert_eq!(found, None);
        }
    }
    // Every forgotten key would have expired by now: nothing is missing any more.
    tokio::time::advance(RETENTION).await;
    assert_eq!(store.effective_retention(), None);
}

/// A fail-closed store refuses new claims rather than forgetting a key; claims in
/// flight still complete, and once records expire new claims are taken again.
#[tokio::test(start_paused = true)]
async fn fail_closed_refuses_new_claims_instead_of_forgetting() {
    let (seen, hook) = recorder();
    let store = MemoryStore::new()
        .max_bytes(32 * 1024)
        .fail_closed_when_full()
        .on_evicted(hook)
        .build()
        .expect("store");
    let held = fresh_id();
    let held_claim = claim(None);
    assert!(matches!(
        store.claim(&held, &held_claim).await.expect("claim"),
        ClaimOutcome::Claimed { .. }
    ));
    let mut done = Vec::new();
    let refused = loop {
        let id = fresh_id();
        match store_completed(&store, &id, None, 512).await {
            Ok(()) => done.push(id),
            Err(e) => break e,
        }
        assert!(done.len() < 10_000, "never refused");
    };
    assert!(matches!(refused, StoreError::Full), "{refused:?}");
    assert!(
        seen.lock().expect("recorder").is_empty(),
        "nothing forgotten"
    );
    assert_eq!(store.effective_retention(), None);
    store
        .complete(&held, held_claim.token, &completed(512), RETENTION)
        .await
        .expect("a claim in flight still completes");
    for id in done.iter().chain([&held]) {
        assert!(matches!(
            copy_finds(&store, id, None).await,
            Record::Completed(_) | Record::Evicted(_)
        ));
    }
    tokio::time::advance(RETENTION + Duration::from_secs(1)).await;
    store_completed(&store, &fresh_id(), None, 512)
        .await
        .expect("room again once records expired");
}

/// One scope flooding a small store with new keys shrinks its own records: another
/// scope's completed records stay completed (their copies replay), and the records
/// shrunk and forgotten are the flooder's.
#[tokio::test(start_paused = true)]
async fn a_flooding_scope_shrinks_its_own_records_not_another_scopes() {
    let (seen, hook) = recorder();
    let store = MemoryStore::new()
        .max_bytes(64 * 1024)
        .on_evicted(hook)
        .build()
        .expect("store");
    let (a, b) = (request("tenant-a"), request("tenant-b"));
    let quiet: Vec<RecordId> = (0..4).map(|_| fresh_id()).collect();
    for id in &quiet {
        store_completed(&store, id, Some(&b), 1024)
            .await
            .expect("complete");
    }
    let flood: Vec<RecordId> = (0..3_000).map(|_| fresh_id()).collect();
    for (i, id) in flood.iter().enumerate() {
        store_completed(&store, id, Some(&a), 512)
            .await
            .expect("complete");
        if i % 500 == 0 {
            for id in &quiet {
                assert!(
                    matches!(copy_finds(&store, id, Some(&b)).await, Record::Completed(_)),
                    "after {i} flooding keys"
                );
            }
        }
    }
    for id in &quiet {
        assert!(matches!(
            copy_finds(&store, id, Some(&b)).await,
            Record::Completed(_)
        ));
    }
    let seen = seen.lock().expect("recorder").clone();
    assert!(!seen.is_empty(), "the flood overflowed the tombstones too");
    assert!(seen.iter().all(|id| flood.contains(id)));
    let mut evicted = 0;
    for id in &flood {
        match store.get(id).await.expect("get") {
            Some(Record::Evicted(_)) => evicted += 1,
            Some(Record::Completed(_)) | None => {}
            other => panic!("{other:?}"),
        }
    }
    assert!(evicted > 0);
}

/// Ten light scopes keep their records while one heavy scope fills the store.
#[tokio::test(start_paused = true)]
async fn a_scope_under_its_share_keeps_its_records_among_many() {
    let store = MemoryStore::new()
        .max_bytes(256 * 1024)
        .build()
        .expect("store");
    let tenants: Vec<RequestInfo> = (0..10).map(|i| request(&format!("t-{i}"))).collect();
    let mut first = Vec::new();
    for t in &tenants {
        let id = fresh_id();
        store_completed(&store, &id, Some(t), 256)
            .await
            .expect("complete");
        first.push(id);
    }
    let heavy = request("heavy");
    for _ in 0..2_000 {
        store_completed(&store, &fresh_id(), Some(&heavy), 1024)
            .await
            .expect("complete");
    }
    for (id, t) in first.iter().zip(&tenants) {
        assert!(matches!(
            copy_finds(&store, id, Some(t)).await,
            Record::Completed(_)
        ));
    }
}
