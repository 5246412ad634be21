//! Resharding under load (feature `cluster`): slots move between the primaries of a
//! local cluster of 3 primaries and 3 replicas while claims and completions run. (The
//! failovers under load, through HTTP, the fault proxy and two app instances, are the
//! workspace's `tests/redis_failover.rs`.)
#![cfg(feature = "cluster")]
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::indexing_slicing,
    missing_docs
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use retrysafe_redis::RedisStore;
use retrysafe_test_support::redis_nodes::LocalCluster;

/// The pause before a failed store call is made again.
const PAUSE: Duration = Duration::from_millis(25);

/// A store call retried until it succeeds (a call may fail while its slot moves);
/// failures are counted in `$errors`.
macro_rules! until_ok {
    ($what:expr, $errors:expr, $call:expr) => {{
        let mut tries = 0;
        loop {
            match $call.await {
                Ok(v) => break v,
                Err(_) => {
                    tries += 1;
                    assert!(tries < 400, "{} kept failing for 10 s", $what);
                    $errors.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(PAUSE).await;
                }
            }
        }
    }};
}

/// Slots move between primaries (`redis-cli --cluster reshard`, 2000 slots) while
/// claims and completions run: the cluster client follows `ASK` and `MOVED`, every
/// completed record reads back, and the pending records listed by the per-slot index
/// are still found where their slots went.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resharding_under_load_keeps_records_and_their_index() {
    use retrysafe_core::idempotency::{CommitPoint, Completed, Fingerprint, Record, Token};
    use retrysafe_core::recovery::ReconcilableStore;
    use retrysafe_core::store::conformance::fresh_id;
    use retrysafe_core::store::{Claim, IdempotencyStore};

    let cluster = tokio::task::spawn_blocking(|| {
        LocalCluster::start().unwrap_or_else(|e| panic!("cannot start a local Redis Cluster: {e}"))
    })
    .await
    .unwrap();
    let store = RedisStore::options()
        .connect_cluster(cluster.urls())
        .await
        .unwrap();
    let claim = || {
        Claim::new(
            Token::random(),
            Fingerprint::from_bytes([2; 32]),
            Duration::from_secs(10),
            Duration::from_secs(600),
            CommitPoint::Before,
        )
    };
    // Pending records whose slots may move: unknown outcomes, due at once.
    let mut pending = Vec::new();
    for _ in 0..50 {
        let (id, c) = (fresh_id(), claim());
        store.claim(&id, &c).await.unwrap();
        store
            .mark_unknown(
                &id,
                c.token,
                Duration::from_secs(600),
                retrysafe_core::idempotency::UnknownReason::Panicked,
            )
            .await
            .unwrap();
        pending.push(id);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for _ in 0..8 {
        let (store, stop, errors) = (store.clone(), Arc::clone(&stop), Arc::clone(&errors));
        workers.push(tokio::spawn(async move {
            let mut done = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let (id, c) = (fresh_id(), claim());
                until_ok!("claim", errors, store.claim(&id, &c));
                let record = Completed::new(c.fingerprint, None);
                let retention = Duration::from_secs(600);
                until_ok!(
                    "complete",
                    errors,
                    store.complete(&id, c.token, &record, retention)
                );
                done.push((id, record));
            }
            done
        }));
    }
    let cluster = tokio::task::spawn_blocking(move || {
        let primaries = cluster.primaries().unwrap();
        cluster.reshard(primaries[0], primaries[1], 2000).unwrap();
        cluster
    })
    .await
    .unwrap();
    stop.store(true, Ordering::Relaxed);
    let mut completed = Vec::new();
    for w in workers {
        completed.extend(w.await.unwrap());
    }
    let errors = &AtomicU64::new(0);
    for (id, record) in &completed {
        let read = until_ok!("get", errors, store.get(id));
        assert_eq!(read, Some(Record::Completed(record.clone())));
    }
    let due = until_ok!("due", errors, store.due(Duration::ZERO, 10_000));
    for id in &pending {
        assert!(due.contains(id), "{} is still listed", id.to_hex());
    }
    println!(
        "{{\"resharded_slots\": 2000, \"completed\": {}, \"pending_found\": {}, \"failed_calls_retried\": {}}}",
        completed.len(),
        pending.len(),
        errors.load(Ordering::Relaxed)
    );
    assert!(!completed.is_empty());
    drop(cluster);
}
