//! RedisStore on a Redis Cluster (feature `cluster`): a local cluster of 3 primaries and
//! 3 replicas on loopback ports ([`LocalCluster`], made once for this test binary with
//! `redis-cli --cluster create`; the tests fail, saying why, when `redis-server` or
//! `redis-cli` is missing). The store and reconcile conformance suites, then what is
//! specific to a cluster: the in-flight index per hash slot and `replicated_writes`.
#![cfg(feature = "cluster")]
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

mod common;

use std::time::Duration;

use redis::cluster_async::ClusterConnection;
use retrysafe_core::idempotency::{
    CommitPoint, Completed, Fingerprint, Record, RecordId, Token, UnknownReason,
};
use retrysafe_core::recovery::{ReconcilableStore, Settlement};
use retrysafe_core::store::conformance::fresh_id;
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, StoreError};
use retrysafe_redis::{RedisStore, RedisStoreOptions};
use retrysafe_test_support::redis_nodes::LocalCluster;

mod conformance {
    retrysafe_core::store_conformance_tests! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        store = super::store,
        clock = retrysafe_core::store::conformance::RealClock::default(),
    }
}

// Leases of 1.5 s, not the default 400 ms: a `due` walks the index of every hash slot
// (16 385 scripts, about 1 s on this machine), and the cases that check what is not yet
// due must make their next call before `stale` (3 leases) has passed.
mod reconcile_conformance {
    retrysafe_core::reconcilable_store_tests! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        store = super::store,
        clock = retrysafe_core::store::conformance::RealClock::with_lease(
            std::time::Duration::from_millis(1500)
        ),
    }
}

/// A cluster connection to the shared local cluster.
async fn connection() -> ClusterConnection {
    let cluster = tokio::task::spawn_blocking(LocalCluster::shared)
        .await
        .unwrap();
    redis::cluster::ClusterClient::new(cluster.urls())
        .unwrap()
        .get_async_connection()
        .await
        .unwrap_or_else(|e| panic!("cannot connect to the local cluster: {e}"))
}

/// A store on the shared local cluster with a fresh key prefix (made as users make
/// one over their own connection: the configuration check finds the cluster).
async fn store() -> RedisStore<ClusterConnection> {
    with_options(RedisStore::options().key_prefix(common::fresh_prefix())).await
}

/// A store on the cluster with `options`.
async fn with_options(options: RedisStoreOptions) -> RedisStore<ClusterConnection> {
    options
        .build(connection().await)
        .await
        .unwrap_or_else(|e| panic!("options: {e}"))
}

fn claim() -> Claim<'static> {
    Claim::new(
        Token::random(),
        Fingerprint::from_bytes([1; 32]),
        Duration::from_secs(10),
        Duration::from_secs(60),
        CommitPoint::Undeclared,
    )
}

/// The slot Redis gives `key`.
async fn keyslot(conn: &mut ClusterConnection, key: &str) -> i64 {
    redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query_async(conn)
        .await
        .unwrap()
}

/// The in-flight index keys that exist for `store`'s prefix, on every primary.
async fn index_keys(store: &RedisStore<ClusterConnection>) -> Vec<String> {
    let cluster = LocalCluster::shared();
    let mut keys = Vec::new();
    for port in cluster.primaries().unwrap() {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let found: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}inflight*", store.key_prefix()))
            .query_async(&mut conn)
            .await
            .unwrap();
        keys.extend(found);
    }
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_record_is_indexed_in_a_key_of_its_own_slot() {
    let store = store().await;
    let mut conn = connection().await;
    let ids: Vec<RecordId> = (0..20).map(|_| fresh_id()).collect();
    for id in &ids {
        store.claim(id, &claim()).await.unwrap();
    }
    let keys = index_keys(&store).await;
    for id in &ids {
        let slot = keyslot(&mut conn, &store.key(id)).await;
        let mut found = false;
        for k in &keys {
            let members: Vec<String> = redis::cmd("ZRANGE")
                .arg(k)
                .arg(0)
                .arg(-1)
                .query_async(&mut conn)
                .await
                .unwrap();
            if members.contains(&id.to_hex()) {
                assert_eq!(keyslot(&mut conn, k).await, slot, "{k}");
                assert!(k.starts_with(&format!("{}inflight:{{", store.key_prefix())));
                found = true;
            }
        }
        assert!(found, "{} is indexed", id.to_hex());
        // Record key names are those of a single server.
        assert_eq!(
            store.key(id),
            format!("{}{{{}}}", store.key_prefix(), id.to_hex())
        );
    }
    // A reconciler finds every one of them once its lease has ended.
    let due = store.due(Duration::ZERO, 100).await.unwrap();
    assert!(due.is_empty(), "leases are live: {due:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_call_and_recovery_works_on_a_cluster() {
    let store = store().await;
    for _ in 0..20 {
        let id = fresh_id();
        let c = claim();
        assert_eq!(
            store.claim(&id, &c).await.unwrap(),
            ClaimOutcome::Claimed { takeover: false }
        );
        store
            .renew(&id, c.token, Duration::from_secs(10))
            .await
            .unwrap();
        store.commit_point_with(&id, c.token, b"n").await.unwrap();
        let done = Completed::new(c.fingerprint, None);
        store
            .complete(&id, c.token, &done, Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(store.get(&id).await.unwrap(), Some(Record::Completed(done)));

        let other = fresh_id();
        let c = claim();
        store.claim(&other, &c).await.unwrap();
        store
            .mark_unknown(
                &other,
                c.token,
                Duration::from_secs(60),
                UnknownReason::Panicked,
            )
            .await
            .unwrap();
        store.mark_notified(&other).await.unwrap();
        let p = store.peek(&other).await.unwrap().unwrap();
        assert!(p.notified);
        // The reconciler lists it (an unknown record is due at once) and settles it.
        let due = store.due(Duration::ZERO, 1000).await.unwrap();
        assert!(due.contains(&other), "{due:?}");
        let t = Token::random();
        store
            .adopt(&other, t, Duration::from_secs(10), None)
            .await
            .unwrap()
            .expect("adoptable");
        assert!(matches!(
            store.get(&other).await.unwrap(),
            Some(Record::Resolving(_))
        ));
        store
            .settle(&other, t, Settlement::Release, false)
            .await
            .unwrap();
        assert_eq!(store.get(&other).await.unwrap(), None);
    }
    assert!(store.due(Duration::ZERO, 1000).await.unwrap().is_empty());
    assert!(
        index_keys(&store).await.is_empty(),
        "empty indexes are gone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limited_walk_goes_on_where_the_last_one_stopped() {
    let store = store().await;
    let mut ids = Vec::new();
    for _ in 0..30 {
        let id = fresh_id();
        let c = claim();
        store.claim(&id, &c).await.unwrap();
        store
            .mark_unknown(
                &id,
                c.token,
                Duration::from_secs(60),
                UnknownReason::Panicked,
            )
            .await
            .unwrap();
        ids.push(id);
    }
    // A reconciler that takes four at a time settles every one in turn.
    let mut settled = std::collections::HashSet::new();
    for _ in 0..ids.len() {
        for id in store.due(Duration::ZERO, 4).await.unwrap() {
            let t = Token::random();
            if store
                .adopt(&id, t, Duration::from_secs(10), None)
                .await
                .unwrap()
                .is_some()
            {
                store
                    .settle(&id, t, Settlement::Release, false)
                    .await
                    .unwrap();
                settled.insert(id);
            }
        }
        if settled.len() == ids.len() {
            break;
        }
    }
    assert_eq!(settled.len(), ids.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_writes_wait_for_the_replica_of_the_records_primary() {
    let options = RedisStore::options().key_prefix(common::fresh_prefix());
    // The longest wait the default 1 s call timeout allows (a longer one is clamped to
    // it): room for a running replica on a loaded machine, and the wait ends as soon
    // as it acknowledges.
    let store = with_options(options.clone().replicated_writes(1, Duration::from_secs(1))).await;
    for _ in 0..20 {
        let id = fresh_id();
        let c = claim();
        assert_eq!(
            store.claim(&id, &c).await.unwrap(),
            ClaimOutcome::Claimed { takeover: false }
        );
        store.commit_point(&id, c.token).await.unwrap();
        let done = Completed::new(c.fingerprint, None);
        store
            .complete(&id, c.token, &done, Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(store.get(&id).await.unwrap(), Some(Record::Completed(done)));
    }
    // Asking for more replicas than there are: refused, and the claim released.
    let store = with_options(options.replicated_writes(2, Duration::from_millis(20))).await;
    let id = fresh_id();
    let err = store.claim(&id, &claim()).await.unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
    assert!(err.to_string().contains("replica"), "{err}");
    assert_eq!(store.get(&id).await.unwrap(), None, "released");
}

/// The cost of `replicated_writes` on a guarded request (a claim and a completion), as
/// multiples of one store round trip (a `get`), sequential calls on the local cluster.
/// Prints one JSON line (`--nocapture`); asserts nothing about time. `COST_CALLS`
/// (default 300) calls of each kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_of_replicated_writes_in_round_trips() {
    let calls: u32 = std::env::var("COST_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let options = RedisStore::options().key_prefix(common::fresh_prefix());
    let plain = with_options(options.clone()).await;
    let replicated = with_options(options.replicated_writes(1, Duration::from_secs(1))).await;
    let mean = |total: Duration| total.as_secs_f64() * 1e6 / f64::from(calls);
    let started = tokio::time::Instant::now();
    for _ in 0..calls {
        plain.get(&fresh_id()).await.unwrap();
    }
    let round_trip = mean(started.elapsed());
    let mut guarded = Vec::new();
    for store in [&plain, &replicated] {
        let started = tokio::time::Instant::now();
        for _ in 0..calls {
            let id = fresh_id();
            let c = claim();
            store.claim(&id, &c).await.unwrap();
            let done = Completed::new(c.fingerprint, None);
            store
                .complete(&id, c.token, &done, Duration::from_secs(60))
                .await
                .unwrap();
        }
        guarded.push(mean(started.elapsed()));
    }
    #[allow(clippy::print_stdout)]
    {
        println!(
            "{{\"calls\": {calls}, \"round_trip_us\": {round_trip:.0}, \
             \"guarded_us\": {:.0}, \"guarded_replicated_us\": {:.0}, \
             \"guarded_round_trips\": {:.2}, \"guarded_replicated_round_trips\": {:.2}}}",
            guarded[0],
            guarded[1],
            guarded[0] / round_trip,
            guarded[1] / round_trip
        );
    }
    assert!(guarded.iter().all(|g| *g > 0.0));
}

/// Two app servers' reconcilers on one cluster split the slots by scan leases: the
/// first to walk takes every free lease, the other walks none of those slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcilers_walk_only_the_slots_they_hold_a_lease_on() {
    let first = store().await;
    let second = RedisStore::options()
        .key_prefix(first.key_prefix())
        .build(connection().await)
        .await
        .unwrap();
    let mut ids = Vec::new();
    for _ in 0..20 {
        let (id, c) = (fresh_id(), claim());
        first.claim(&id, &c).await.unwrap();
        first
            .mark_unknown(
                &id,
                c.token,
                Duration::from_secs(60),
                UnknownReason::Panicked,
            )
            .await
            .unwrap();
        ids.push(id);
    }
    let due = first.due(Duration::ZERO, 1000).await.unwrap();
    assert!(ids.iter().all(|id| due.contains(id)), "{due:?}");
    assert!(second.due(Duration::ZERO, 1000).await.unwrap().is_empty());
    // A clone of the first store shares its leases.
    assert_eq!(
        first.clone().due(Duration::ZERO, 1000).await.unwrap().len(),
        due.len()
    );
}
