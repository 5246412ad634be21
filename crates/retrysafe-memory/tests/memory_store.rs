//! Tests of the `MemoryStore`: the shared store conformance suite on tokio's paused
//! clock, and what is particular to this store (bounds, eviction, sweeping, memory).
// A failed expectation panics with what was found.
#![allow(clippy::panic)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use retrysafe_core::idempotency::{
    CommitPoint, Completed, Fingerprint, OutcomeUnknown, Record, RecordId, Scope, StoredResponse,
    Token,
};
use retrysafe_core::store::conformance::fresh_id;
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, StoreError};
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_memory::MemoryStore;
use tokio::time::Instant;

retrysafe_core::store_conformance_tests! {
    #[tokio::test(start_paused = true)]
    store = || async { retrysafe_memory::MemoryStore::new() },
    clock = retrysafe_core::store::conformance::PausedClock::default(),
}

mod reconcile {
    retrysafe_core::reconcilable_store_tests! {
        #[tokio::test(start_paused = true)]
        store = || async { retrysafe_memory::MemoryStore::new() },
        clock = retrysafe_core::store::conformance::PausedClock::default(),
    }
}

const LEASE: Duration = Duration::from_secs(10);
const RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

fn fp(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

fn claim(commit_point: CommitPoint) -> Claim<'static> {
    Claim::new(Token::random(), fp(1), LEASE, RETENTION, commit_point)
}

fn completed(body_len: usize) -> Completed {
    Completed::new(
        fp(1),
        Some(StoredResponse::new(
            StatusCode::CREATED,
            vec![(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            Bytes::from(vec![b'x'; body_len]),
            Vec::new(),
        )),
    )
}

async fn must_claim(store: &MemoryStore, id: &RecordId, c: &Claim<'_>) -> bool {
    match store.claim(id, c).await {
        Ok(ClaimOutcome::Claimed { takeover }) => takeover,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// Claims `id` and completes it at once with a body of `body_len` bytes.
async fn store_completed(store: &MemoryStore, id: &RecordId, body_len: usize, retention: Duration) {
    let c = claim(CommitPoint::Undeclared);
    must_claim(store, id, &c).await;
    store
        .complete(id, c.token, &completed(body_len), retention)
        .await
        .expect("complete");
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

#[test]
fn build_refuses_zero_bounds() {
    let e = MemoryStore::new()
        .max_in_flight(0)
        .build()
        .expect_err("zero in-flight bound");
    assert_eq!(e.field(), "max_in_flight");
    let e = MemoryStore::new()
        .max_bytes(0)
        .build()
        .expect_err("zero byte bound");
    assert_eq!(e.field(), "max_bytes");
    let store = MemoryStore::new()
        .max_in_flight(1)
        .max_bytes(1)
        .build()
        .expect("valid");
    assert_eq!(store.in_flight_len(), 0);
    assert_eq!(store.cached_len(), 0);
    let debug = format!("{:?}", MemoryStore::new().on_evicted(|_| {}));
    assert!(debug.contains("on_evicted: true"), "{debug}");
}

#[test]
fn build_names_every_refused_bound() {
    let e = MemoryStore::new()
        .max_in_flight(0)
        .max_bytes(0)
        .build()
        .expect_err("two zero bounds");
    assert_eq!(
        e.fields().collect::<Vec<_>>(),
        ["max_in_flight", "max_bytes"]
    );
}

/// Each setter keeps the settings made before it.
#[test]
fn setters_keep_earlier_settings() {
    let store = MemoryStore::new()
        .on_evicted(|_| {})
        .max_in_flight(7)
        .max_bytes(4096);
    let debug = format!("{store:?}");
    for part in ["max_in_flight: 7", "max_bytes: 4096", "on_evicted: true"] {
        assert!(debug.contains(part), "{part} in {debug}");
    }
}

/// A store whose settings were never validated still answers: a zero in-flight bound
/// refuses every claim as full.
#[tokio::test(start_paused = true)]
async fn unvalidated_zero_bound_refuses_claims() {
    let store = MemoryStore::new().max_in_flight(0);
    let c = claim(CommitPoint::Undeclared);
    assert!(matches!(
        store.claim(&fresh_id(), &c).await,
        Err(StoreError::Full)
    ));
    assert_eq!(store.in_flight_len(), 0);
}

/// 64 claims of one id race on two worker threads, many times: one wins each round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_race_on_threads_has_one_winner() {
    let store = MemoryStore::new();
    for _round in 0..50 {
        let id = fresh_id();
        let barrier = Arc::new(tokio::sync::Barrier::new(64));
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let (store, barrier) = (store.clone(), Arc::clone(&barrier));
                tokio::spawn(async move {
                    let c = claim(CommitPoint::Undeclared);
                    barrier.wait().await;
                    (c.token, store.claim(&id, &c).await.expect("claim"))
                })
            })
            .collect();
        let mut winners = Vec::new();
        for task in tasks {
            match task.await.expect("task") {
                (token, ClaimOutcome::Claimed { takeover: false }) => winners.push(token),
                (
                    _,
                    ClaimOutcome::Existing {
                        record: Record::InProgress(_),
                        became_unknown: false,
                    },
                ) => {}
                (_, other) => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(winners.len(), 1, "exactly one claim wins");
        match store.get(&id).await.expect("get") {
            Some(Record::InProgress(p)) => assert_eq!(Some(&p.token), winners.first()),
            other => panic!("expected in_progress, got {other:?}"),
        }
    }
    assert_eq!(store.in_flight_len(), 50);
}

/// A waiter registered while the holder completes on another thread is never lost: it
/// wakes at once, not at its maximum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_misses_no_wake_up_across_threads() {
    let store = MemoryStore::new();
    for round in 0..200u32 {
        let id = fresh_id();
        let c = {
            let mut c = claim(CommitPoint::Undeclared);
            c.lease = Duration::from_secs(60);
            c
        };
        must_claim(&store, &id, &c).await;
        let waiter = {
            let store = store.clone();
            tokio::spawn(async move { store.wait(&id, Duration::from_secs(60)).await })
        };
        if round % 2 == 0 {
            tokio::task::yield_now().await;
        }
        store
            .complete(&id, c.token, &completed(10), RETENTION)
            .await
            .expect("complete");
        tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("the waiter woke on completion")
            .expect("task")
            .expect("wait");
    }
}

/// A waiter also wakes when the lease expires, and can then take over.
#[tokio::test(start_paused = true)]
async fn wait_wakes_at_lease_expiry_for_a_takeover() {
    let store = MemoryStore::new();
    let id = fresh_id();
    let first = claim(CommitPoint::Before);
    must_claim(&store, &id, &first).await;
    let start = Instant::now();
    store
        .wait(&id, Duration::from_secs(60))
        .await
        .expect("wait");
    assert_eq!(start.elapsed(), LEASE, "woke exactly at the lease end");
    let second = claim(CommitPoint::Before);
    assert!(must_claim(&store, &id, &second).await, "a takeover");
    // Nothing in progress: no wait at all.
    store
        .complete(&id, second.token, &completed(1), RETENTION)
        .await
        .expect("complete");
    let start = Instant::now();
    store
        .wait(&id, Duration::from_secs(60))
        .await
        .expect("wait");
    store
        .wait(&fresh_id(), Duration::from_secs(60))
        .await
        .expect("wait");
    assert_eq!(start.elapsed(), Duration::ZERO);
}

/// `lease_until_ms` counts tokio milliseconds since the store was created.
#[tokio::test(start_paused = true)]
async fn lease_until_is_tokio_millis_since_creation() {
    let store = MemoryStore::new();
    tokio::time::advance(Duration::from_secs(5)).await;
    let id = fresh_id();
    let c = claim(CommitPoint::Undeclared);
    must_claim(&store, &id, &c).await;
    let lease_until = |r: Option<Record>| match r {
        Some(Record::InProgress(p)) => p.lease_until_ms,
        other => panic!("expected in_progress, got {other:?}"),
    };
    assert_eq!(lease_until(store.get(&id).await.expect("get")), 15_000);
    tokio::time::advance(Duration::from_secs(3)).await;
    store
        .renew(&id, c.token, Duration::from_secs(20))
        .await
        .expect("renew");
    assert_eq!(lease_until(store.get(&id).await.expect("get")), 28_000);
}

/// At `max_in_flight` a new claim is refused with `Full`, and in-flight claims are never
/// evicted, however far the completed records overflow meanwhile.
#[tokio::test(start_paused = true)]
async fn in_flight_bound_is_full_and_never_evicted() {
    let max_bytes = 64 * 1024;
    let store = MemoryStore::new()
        .max_in_flight(100)
        .max_bytes(max_bytes)
        .build()
        .expect("store");
    let mut held = Vec::new();
    for _ in 0..90 {
        let (id, c) = (fresh_id(), claim(CommitPoint::Undeclared));
        must_claim(&store, &id, &c).await;
        held.push((id, c));
    }
    // 1000 completed records of 1 KiB: about 25 times the byte bound.
    for _ in 0..1000 {
        store_completed(&store, &fresh_id(), 1024, RETENTION).await;
    }
    assert!(store.cached_bytes() <= max_bytes);
    assert!(store.cached_len() < 100, "records were shrunk");
    for _ in 0..10 {
        let (id, c) = (fresh_id(), claim(CommitPoint::Undeclared));
        must_claim(&store, &id, &c).await;
        held.push((id, c));
    }
    assert_eq!(store.in_flight_len(), 100);
    let refused = store
        .claim(&fresh_id(), &claim(CommitPoint::Undeclared))
        .await;
    assert!(matches!(refused, Err(StoreError::Full)), "{refused:?}");
    // A claim of an id already held is not a new claim: it sees the holder.
    let (id, _) = held.first().expect("held");
    let again = store
        .claim(id, &claim(CommitPoint::Undeclared))
        .await
        .expect("claim");
    assert!(matches!(
        again,
        ClaimOutcome::Existing {
            record: Record::InProgress(_),
            ..
        }
    ));
    for (id, c) in &held {
        match store.get(id).await.expect("get") {
            Some(Record::InProgress(p)) => assert_eq!(p.token, c.token),
            other => panic!("an in-flight claim was lost: {other:?}"),
        }
    }
    // A slot frees when a holder finishes.
    let (id, c) = held.pop().expect("held");
    store.release(&id, c.token).await.expect("release");
    must_claim(&store, &fresh_id(), &claim(CommitPoint::Undeclared)).await;
    for (id, c) in &held {
        store
            .complete(id, c.token, &completed(16), RETENTION)
            .await
            .expect("complete");
    }
    assert_eq!(store.in_flight_len(), 1);
}

/// With a full store (tiny byte bound), a fresh completion is always kept whole: a
/// duplicate sees the claim in progress, then completed, and never claims again (an
/// admission filter favouring popular records could refuse the fresh one).
#[tokio::test(start_paused = true)]
async fn fresh_completion_is_admitted_into_a_full_cache() {
    let store = MemoryStore::new()
        .max_bytes(16 * 1024)
        .build()
        .expect("store");
    // Popular old records: read often, so a frequency-based filter would favour them.
    let old: Vec<_> = (0..50).map(|_| fresh_id()).collect();
    for id in &old {
        store_completed(&store, id, 1024, RETENTION).await;
    }
    for _ in 0..5 {
        for id in &old {
            let _ = store.get(id).await.expect("get");
        }
    }
    for round in 0..300 {
        let id = fresh_id();
        let c = claim(CommitPoint::Undeclared);
        must_claim(&store, &id, &c).await;
        let dup = claim(CommitPoint::Undeclared);
        match store.claim(&id, &dup).await.expect("claim") {
            ClaimOutcome::Existing {
                record: Record::InProgress(p),
                ..
            } => {
                assert_eq!(p.token, c.token);
            }
            other => panic!("round {round}: duplicate got {other:?} while in flight"),
        }
        store
            .complete(&id, c.token, &completed(1024), RETENTION)
            .await
            .expect("complete");
        if round % 3 == 0 {
            assert!(store.cached_bytes() <= 16 * 1024);
        }
        match store.claim(&id, &dup).await.expect("claim") {
            ClaimOutcome::Existing {
                record: Record::Completed(_),
                became_unknown: false,
            } => {}
            other => panic!("round {round}: duplicate got {other:?} after completion"),
        }
        // Keep reading an old record so that it stays hot.
        if let Some(hot) = old.get(round % old.len()) {
            let _ = store.get(hot).await.expect("get");
        }
    }
}

/// Records pushed out for size shrink to tombstones; tombstones dropped for size before
/// their retention ended are reported to the hook; records past their retention are
/// not, whether read or pushed out.
#[tokio::test(start_paused = true)]
async fn early_eviction_calls_the_hook_and_expiry_does_not() {
    let (seen, hook) = recorder();
    let store = MemoryStore::new()
        .max_bytes(16 * 1024)
        .on_evicted(hook)
        .build()
        .expect("store");
    let short = Duration::from_secs(1);
    let (read_after_expiry, evicted_after_expiry) = (fresh_id(), fresh_id());
    store_completed(&store, &read_after_expiry, 1024, short).await;
    store_completed(&store, &evicted_after_expiry, 1024, short).await;
    tokio::time::advance(short * 2).await;
    assert_eq!(store.get(&read_after_expiry).await.expect("get"), None);
    assert_eq!(store.effective_retention(), None, "nothing forgotten yet");
    let fillers: Vec<_> = (0..50).map(|_| fresh_id()).collect();
    for id in &fillers {
        store_completed(&store, id, 1024, RETENTION).await;
    }
    let (cached, tombstones) = (store.cached_len(), store.tombstones_len());
    assert!(cached > 0 && cached < 50, "{cached}");
    assert!(tombstones > 0, "{tombstones}");
    assert!(tombstones * MemoryStore::TOMBSTONE_BYTES <= 4 * 1024);
    let seen = seen.lock().expect("recorder").clone();
    assert!(!seen.is_empty(), "tombstones were dropped");
    assert!(
        !seen.contains(&read_after_expiry),
        "expiry is not an early eviction"
    );
    assert!(
        !seen.contains(&evicted_after_expiry),
        "an expired record is not evicted early"
    );
    assert_eq!(
        seen.len() as u64,
        50 - cached - tombstones,
        "every forgotten record was reported once"
    );
    assert!(store.effective_retention().is_some());
    for id in &seen {
        assert!(fillers.contains(id));
        assert_eq!(
            store.get(id).await.expect("get"),
            None,
            "reported records are gone"
        );
    }
    let mut kept = 0;
    for id in fillers.iter().filter(|id| !seen.contains(id)) {
        match store.get(id).await.expect("get") {
            Some(Record::Completed(_)) => kept += 1,
            Some(Record::Evicted(_)) => {}
            other => panic!("a record not reported is kept or a tombstone, got {other:?}"),
        }
    }
    assert_eq!(kept, cached);
    // LRU: the most recent records are the ones kept whole.
    for id in fillers
        .iter()
        .rev()
        .take(usize::try_from(cached).expect("small"))
    {
        assert!(matches!(
            store.get(id).await.expect("get"),
            Some(Record::Completed(_))
        ));
    }
}

/// A full map first resolves claims whose lease expired: before the commit point they
/// are dropped, otherwise they become `outcome_unknown` for their claim's retention.
#[tokio::test(start_paused = true)]
async fn expired_in_flight_entries_are_swept_when_full() {
    let store = MemoryStore::new().max_in_flight(4).build().expect("store");
    let retention = Duration::from_secs(100);
    let with = |cp| {
        let mut c = claim(cp);
        c.retention = retention;
        c
    };
    let (a, ca) = (fresh_id(), with(CommitPoint::Before));
    let (b, cb) = (fresh_id(), with(CommitPoint::Undeclared));
    let (c, cc) = (fresh_id(), with(CommitPoint::Before));
    let (d, cd) = (fresh_id(), with(CommitPoint::Before));
    for (id, cl) in [(&a, &ca), (&b, &cb), (&c, &cc), (&d, &cd)] {
        must_claim(&store, id, cl).await;
    }
    store
        .commit_point(&c, cc.token)
        .await
        .expect("commit point");
    // All live: refused, nothing swept.
    let e = fresh_id();
    assert!(matches!(
        store.claim(&e, &claim(CommitPoint::Undeclared)).await,
        Err(StoreError::Full)
    ));
    assert_eq!(store.in_flight_len(), 4);
    tokio::time::advance(LEASE + Duration::from_secs(1)).await;
    assert!(!must_claim(&store, &e, &claim(CommitPoint::Undeclared)).await);
    assert_eq!(store.in_flight_len(), 1);
    assert_eq!(
        store.get(&a).await.expect("get"),
        None,
        "before the commit point: dropped"
    );
    assert_eq!(store.get(&d).await.expect("get"), None);
    let unknown = Some(Record::OutcomeUnknown(OutcomeUnknown::new(fp(1))));
    assert_eq!(
        store.get(&b).await.expect("get"),
        unknown,
        "undeclared: outcome unknown"
    );
    assert_eq!(
        store.get(&c).await.expect("get"),
        unknown,
        "past the commit point: unknown"
    );
    for (id, token) in [(&a, ca.token), (&b, cb.token), (&c, cc.token)] {
        let late = store.complete(id, token, &completed(1), RETENTION).await;
        assert!(matches!(late, Err(StoreError::StaleToken)), "{late:?}");
    }
    // Kept for the retention of the claim, then the key is new again.
    tokio::time::advance(retention - Duration::from_secs(1)).await;
    assert_eq!(store.get(&b).await.expect("get"), unknown);
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(store.get(&b).await.expect("get"), None);
}

/// A full map of live claims is swept again as soon as the earliest lease ends, not
/// before and not later.
#[tokio::test(start_paused = true)]
async fn sweeping_follows_the_earliest_lease() {
    let store = MemoryStore::new().max_in_flight(2).build().expect("store");
    let short = claim(CommitPoint::Before);
    let long = {
        let mut c = claim(CommitPoint::Before);
        c.lease = LEASE * 2;
        c
    };
    must_claim(&store, &fresh_id(), &short).await;
    must_claim(&store, &fresh_id(), &long).await;
    let full = |r: Result<ClaimOutcome, StoreError>| matches!(r, Err(StoreError::Full));
    assert!(full(
        store.claim(&fresh_id(), &claim(CommitPoint::Before)).await
    ));
    tokio::time::advance(LEASE - Duration::from_millis(1)).await;
    assert!(full(
        store.claim(&fresh_id(), &claim(CommitPoint::Before)).await
    ));
    tokio::time::advance(Duration::from_millis(1)).await;
    // The short lease ended: swept, and its slot taken by a claim with a short lease.
    let brief = {
        let mut c = claim(CommitPoint::Before);
        c.lease = Duration::from_secs(1);
        c
    };
    must_claim(&store, &fresh_id(), &brief).await;
    assert!(full(
        store.claim(&fresh_id(), &claim(CommitPoint::Before)).await
    ));
    tokio::time::advance(Duration::from_secs(1)).await;
    must_claim(&store, &fresh_id(), &claim(CommitPoint::Before)).await;
    assert_eq!(store.in_flight_len(), 2);
}

/// The records stay within their byte bound, whatever their sizes.
#[tokio::test(start_paused = true)]
async fn cached_bytes_stay_within_max_bytes() {
    let max_bytes = 100 * 1024;
    let store = MemoryStore::new()
        .max_bytes(max_bytes)
        .build()
        .expect("store");
    for i in 0..1000usize {
        store_completed(&store, &fresh_id(), (i * 37) % 4096, RETENTION).await;
        if i % 100 == 99 {
            let bytes = store.cached_bytes();
            assert!(bytes <= max_bytes, "{bytes} > {max_bytes}");
            assert!(bytes > max_bytes / 2, "the bound is used: {bytes}");
        }
    }
    let (bytes, len) = (store.cached_bytes(), store.cached_len());
    assert!(
        bytes / len >= MemoryStore::ENTRY_OVERHEAD + 32,
        "every entry weighs its overhead"
    );
}

/// Memory per stored record is at most 2 × its payload + 256 bytes, where
/// payload is body + stored header bytes + key, from a body of 130 bytes on (with a
/// 36-character key and the one 28-byte header). The measure is the store's
/// accounting (encoded length + key + [`MemoryStore::ENTRY_OVERHEAD`], the per-entry
/// cost checked with a counting allocator in `tests/heap.rs`), the same weight
/// `max_bytes` bounds. Smaller records miss the bound: the store's own structures take
/// up to 400 bytes per record.
#[tokio::test(start_paused = true)]
async fn memory_per_record_is_within_twice_the_payload() {
    let scope = Scope::new("tenant");
    for body in [136, 1024, 16 * 1024] {
        let store = MemoryStore::new();
        let record = completed(body);
        let mut key_len = 0;
        for i in 0..1_000u32 {
            // As long as a UUID.
            let key =
                IdempotencyKey::new(&format!("{i:08x}-0000-4000-8000-000000000000")).expect("key");
            key_len = key.as_str().len();
            let id = RecordId::new(&scope, &key);
            let c = claim(CommitPoint::Undeclared);
            must_claim(&store, &id, &c).await;
            store
                .complete(&id, c.token, &record, RETENTION)
                .await
                .expect("complete");
        }
        assert_eq!(
            store.cached_len(),
            1_000,
            "all kept: far below the default byte bound"
        );
        let response = record.response.as_ref().expect("response");
        let payload = u64::try_from(response.payload_len() + key_len).expect("small");
        let per_record = store.cached_bytes() / 1_000;
        assert!(
            per_record <= 2 * payload + 256,
            "{body}-byte body: {per_record} bytes per record for a payload of {payload}"
        );
    }
}
