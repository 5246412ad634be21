//! Redis failovers under load: keyed POSTs go through the fault proxy and the client
//! stack to two app instances (each an `IdempotencyLayer` over its own `RedisStore` on
//! one local cluster of 3 primaries and 3 replicas, [`LocalCluster`]) while a primary
//! is killed with SIGKILL, its replica is promoted, and the killed node comes back as a
//! replica, again and again (the load: `retrysafe_test_support::failover`).
//!
//! A key with two effects is a claim or completion acknowledged by a primary that died
//! before its replica had it. Two runs on the same cluster: without and with
//! `replicated_writes(1, …)`. The run with the setting must have no duplicate; the one
//! without is measured (Redis replicates asynchronously: it may or may not lose a write
//! in a short run). One JSON line per run (`--nocapture` to see it).
//!
//! `FAILOVER_PROMOTIONS` (default 2 per run; 50 for the figures of RELIABILITY.md),
//! `FAILOVER_CONCURRENCY` (default 32), `FAILOVER_RUNS` (`both`, the default;
//! `replicated` or `default` for one of the two runs).
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::indexing_slicing,
    missing_docs
)]

use std::time::Duration;

use retrysafe_core::idempotency::Token;
use retrysafe_redis::RedisStore;
use retrysafe_redis::redis::{self, cluster_async::ClusterConnection};
use retrysafe_test_support::failover::{Effects, Front, Load, app, duplicates};
use retrysafe_test_support::redis_nodes::LocalCluster;
use retrysafe_test_support::rng::env_number;
use retrysafe_tower::idempotency::IdempotencyLayer;

/// One app instance, served behind its own fault proxy: its own cluster connection,
/// its own layer.
async fn instance(
    cluster: &LocalCluster,
    prefix: &str,
    replicated: bool,
    (effects, seed): (&Effects, u64),
) -> Front {
    let client = redis::cluster::ClusterClient::builder(cluster.urls())
        .connection_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    // Bounded: a connection that never comes is a failure, not a hang.
    let conn: ClusterConnection =
        tokio::time::timeout(Duration::from_secs(30), client.get_async_connection())
            .await
            .unwrap_or_else(|_| panic!("no cluster connection within 30 s"))
            .unwrap();
    let mut options = RedisStore::options().key_prefix(prefix).per_slot_index();
    if replicated {
        options = options.replicated_writes(1, Duration::from_millis(500));
    }
    let store = options.build(conn).await.unwrap();
    let layer = IdempotencyLayer::new(store)
        .lease(Duration::from_secs(4))
        .build()
        .unwrap();
    Front::start(app(layer, effects), seed).await
}

/// Kills a primary, waits for its replica's promotion, starts it again (it rejoins as
/// a replica), `promotions` times, turning through the primaries.
fn kill_primaries(mut cluster: LocalCluster, promotions: u64) -> LocalCluster {
    for p in 0..promotions {
        let primaries = cluster.primaries().unwrap();
        let victim = primaries[usize::try_from(p).unwrap() % primaries.len()];
        // Let the load run on a healthy cluster for a moment.
        #[allow(clippy::disallowed_methods)]
        std::thread::sleep(Duration::from_millis(300));
        cluster.kill(victim).unwrap();
        cluster.wait_promoted(victim).unwrap();
        cluster.restart(victim).unwrap();
    }
    cluster
}

/// One run: load through two instances while `promotions` failovers happen. Returns
/// the cluster, and the number of keys with two effects.
async fn run(cluster: LocalCluster, replicated: bool, promotions: u64) -> (LocalCluster, u64) {
    let effects = Effects::default();
    let run = Token::random().to_hex()[..8].to_owned();
    let prefix = format!("failover-{run}:");
    let fronts = [
        instance(&cluster, &prefix, replicated, (&effects, 1)).await,
        instance(&cluster, &prefix, replicated, (&effects, 2)).await,
    ];
    let concurrency = env_number("FAILOVER_CONCURRENCY", 32);
    let load = Load::start([fronts[0].addr, fronts[1].addr], &run, concurrency, 3);
    let cluster = tokio::task::spawn_blocking(move || kill_primaries(cluster, promotions))
        .await
        .unwrap();
    let (tally, _) = load.stop().await;
    let duplicates = duplicates(&effects);
    let total: u64 = effects
        .lock()
        .unwrap()
        .values()
        .map(|&n| u64::from(n))
        .sum();
    println!(
        "{{\"replicated_writes\": {replicated}, \"promotions\": {promotions}, {}, \
         \"effects\": {total}, \"keys_with_two_effects\": {duplicates}, \
         \"faults\": [{}, {}]}}",
        tally.json_fields(),
        fronts[0].faults_json(),
        fronts[1].faults_json(),
    );
    assert!(tally.created() > 0, "the load went through");
    (cluster, duplicates)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_writes_keep_every_key_to_one_effect_across_promotions() {
    let promotions = env_number("FAILOVER_PROMOTIONS", 2);
    let cluster = tokio::task::spawn_blocking(|| {
        LocalCluster::start().unwrap_or_else(|e| panic!("cannot start a local Redis Cluster: {e}"))
    })
    .await
    .unwrap();
    let runs = std::env::var("FAILOVER_RUNS").unwrap_or_else(|_| "both".to_owned());
    assert!(
        ["both", "replicated", "default"].contains(&runs.as_str()),
        "FAILOVER_RUNS={runs}: expected both, replicated or default"
    );
    let cluster = if runs == "replicated" {
        cluster
    } else {
        run(cluster, false, promotions).await.0
    };
    if runs != "default" {
        let (_cluster, with) = run(cluster, true, promotions).await;
        assert_eq!(with, 0, "keys with two effects with replicated_writes");
    }
}
