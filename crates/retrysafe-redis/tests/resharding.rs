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

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use retrysafe_redis::RedisStore;
use retrysafe_test_support::redis_nodes::{LocalCluster, info_field};

/// The pause before a failed store call is made again.
const PAUSE: Duration = Duration::from_millis(25);

/// How long a store call is made again before the test gives up: a call may fail while
/// its slot moves, and a walk over every slot may time out on a busy machine.
const GIVE_UP: Duration = Duration::from_secs(60);

/// A store call retried until it succeeds; failures are counted in `$errors`, and the
/// last one is reported if the calls keep failing for [`GIVE_UP`], with `$state` (the
/// cluster's, as its nodes answer then).
macro_rules! until_ok {
    ($what:expr, $errors:expr, $call:expr) => {
        until_ok!($what, $errors, $call, String::new())
    };
    ($what:expr, $errors:expr, $call:expr, $state:expr) => {{
        let start = tokio::time::Instant::now();
        loop {
            match $call.await {
                Ok(v) => break v,
                Err(e) => {
                    let failed = $errors.fetch_add(1, Ordering::Relaxed) + 1;
                    assert!(
                        start.elapsed() < GIVE_UP,
                        "{} kept failing for {:?} ({failed} failures in all), last: {e} {}",
                        $what,
                        GIVE_UP,
                        $state,
                    );
                    tokio::time::sleep(PAUSE).await;
                }
            }
        }
    }};
}

/// How many times `SCRIPT LOAD` ran on the node on `port` since its statistics were
/// reset.
async fn script_loads(port: u16) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut node(port).await)
        .await
        .unwrap();
    // `cmdstat_script|load:calls=N,usec=...`; no line until the command has run.
    info_field(&info, "cmdstat_script|load").map_or(0, |stats| {
        let calls = stats.strip_prefix("calls=").unwrap();
        calls.split(',').next().unwrap().parse().unwrap()
    })
}

/// A connection to the node on `port` alone.
async fn node(port: u16) -> redis::aio::ConnectionManager {
    common::manager_to(&format!("redis://127.0.0.1:{port}/")).await
}

/// Slots move between primaries (`redis-cli --cluster reshard`, 2000 slots) while
/// claims and completions run: the cluster client follows `ASK` and `MOVED`, every
/// completed record reads back, and the pending records listed by the per-slot index
/// are still found where their slots went, also once every node's script cache is
/// empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resharding_under_load_keeps_records_and_their_index() {
    use retrysafe_core::idempotency::{CommitPoint, Completed, Fingerprint, Record, Token};
    use retrysafe_core::recovery::ReconcilableStore;
    use retrysafe_core::store::conformance::fresh_id;
    use retrysafe_core::store::{Claim, IdempotencyStore};

    let cluster = tokio::task::spawn_blocking(|| {
        let cluster = LocalCluster::start()
            .unwrap_or_else(|e| panic!("cannot start a local Redis Cluster: {e}"));
        // What a failure reports: three primaries and three replicas, all answering.
        let status = cluster.status();
        assert_eq!(
            status.matches("master, cluster_state:ok").count(),
            3,
            "{status}"
        );
        assert_eq!(
            status.matches("slave, cluster_state:ok").count(),
            3,
            "{status}"
        );
        cluster
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
        let read = until_ok!(
            "get",
            errors,
            store.get(id),
            format!("(nodes: {})", cluster.status())
        );
        assert_eq!(read, Some(Record::Completed(record.clone())));
    }
    // A restart or a failover leaves a node's script cache empty: a walk over every
    // slot loads its scripts once on each primary, not once per slot (a burst that
    // outlasts the call timeout on a busy client, and then again at every walk), and
    // not on the replicas, which do not run them.
    for &port in &cluster.ports() {
        let () = redis::pipe()
            .cmd("SCRIPT")
            .arg("FLUSH")
            .ignore()
            .cmd("CONFIG")
            .arg("RESETSTAT")
            .ignore()
            .query_async(&mut node(port).await)
            .await
            .unwrap();
    }
    let due = until_ok!(
        "due",
        errors,
        store.due(Duration::ZERO, 10_000),
        format!("(nodes: {})", cluster.status())
    );
    let primaries = cluster.primaries().unwrap();
    for &port in &cluster.ports() {
        let loads = script_loads(port).await;
        if primaries.contains(&port) {
            assert!(
                (1..=4).contains(&loads),
                "primary {port}: SCRIPT LOAD ran {loads} times"
            );
        } else {
            assert_eq!(loads, 0, "replica {port}: SCRIPT LOAD ran {loads} times");
        }
    }
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
