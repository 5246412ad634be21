//! A Redis Cluster primary that stops answering (SIGSTOP: a frozen process, a lost
//! network) is failed over to its replica by the cluster (feature `cluster`).
//!
//! What a store on the cluster does then is measured and its end asserted: redis-rs's
//! cluster client (1.8) sends a request again to the same node when its reply timed
//! out, and learns of the promotion only from a node that answers, so calls to the
//! frozen primary's slots fail (503 under the layer) until it answers again, demoted,
//! with `MOVED`; the store then answers with no restart. (A store through Redis
//! Sentinel gives a frozen primary up at once: `tests/sentinel.rs`.)
#![cfg(feature = "cluster")]
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::indexing_slicing,
    missing_docs
)]

mod common;

use std::time::Duration;

use retrysafe_core::idempotency::{CommitPoint, Fingerprint, RecordId, Token};
use retrysafe_core::store::{Claim, IdempotencyStore};
use retrysafe_redis::RedisStore;
use retrysafe_redis::slots::slot_of_record;
use retrysafe_test_support::redis_nodes::LocalCluster;
use tokio::time::Instant;

/// How long the store may take to answer again once the replica is promoted.
const PATIENCE: Duration = Duration::from_secs(30);

/// How long the store is watched while the frozen primary stays frozen.
const WATCHED: Duration = Duration::from_secs(5);

fn claim() -> Claim<'static> {
    Claim::new(
        Token::random(),
        Fingerprint::from_bytes([1; 32]),
        Duration::from_secs(10),
        Duration::from_secs(60),
        CommitPoint::Undeclared,
    )
}

/// The slot ranges the primary on `port` serves (`CLUSTER SLOTS`, asked of it).
async fn slots_of(port: u16) -> Vec<(u16, u16)> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let ranges: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut conn)
        .await
        .unwrap();
    ranges
        .into_iter()
        .filter_map(|range| {
            let int = |i: usize| range.get(i).cloned().map(redis::from_redis_value::<u16>);
            let master: Vec<redis::Value> = redis::from_redis_value(range.get(2)?.clone()).ok()?;
            let master_port: u16 = redis::from_redis_value(master.get(1)?.clone()).ok()?;
            match (int(0), int(1)) {
                (Some(Ok(first)), Some(Ok(last))) if master_port == port => Some((first, last)),
                _ => None,
            }
        })
        .collect()
}

/// A fresh record id in one of `ranges`.
fn id_in(ranges: &[(u16, u16)]) -> RecordId {
    loop {
        let id = retrysafe_core::store::conformance::fresh_id();
        let slot = slot_of_record(&id);
        if ranges.iter().any(|&(a, b)| (a..=b).contains(&slot)) {
            return id;
        }
    }
}

/// Claims fresh records in `ranges` until one succeeds or `within` passed: whether one
/// did, and the calls that failed first.
async fn answers<C>(store: &RedisStore<C>, ranges: &[(u16, u16)], within: Duration) -> (bool, u64)
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
{
    let until = Instant::now() + within;
    let mut failed = 0;
    while Instant::now() < until {
        if store.claim(&id_in(ranges), &claim()).await.is_ok() {
            return (true, failed);
        }
        failed += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (false, failed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_on_a_cluster_answers_again_once_a_frozen_primary_answers() {
    let cluster = tokio::task::spawn_blocking(|| LocalCluster::start().unwrap())
        .await
        .unwrap();
    let store = RedisStore::options()
        .connect_cluster(cluster.urls())
        .await
        .unwrap();
    let victim = cluster.primaries().unwrap()[0];
    let ranges = slots_of(victim).await;
    assert!(!ranges.is_empty(), "the primary on {victim} serves slots");
    assert!(
        answers(&store, &ranges, PATIENCE).await.0,
        "before the freeze"
    );

    cluster.pause(victim).unwrap();
    let cluster = tokio::task::spawn_blocking(move || {
        cluster.wait_promoted(victim).unwrap();
        cluster
    })
    .await
    .unwrap();
    let (while_frozen, failed_while_frozen) = answers(&store, &ranges, WATCHED).await;
    cluster.resume(victim).unwrap();
    let (again, failed_after) = answers(&store, &ranges, PATIENCE).await;
    println!(
        "{{\"answered_while_frozen_{}s\": {while_frozen}, \"failed_while_frozen\": \
         {failed_while_frozen}, \"answered_once_resumed\": {again}, \
         \"failed_once_resumed\": {failed_after}}}",
        WATCHED.as_secs()
    );
    assert!(
        again,
        "the store did not answer again within {PATIENCE:?} of the node's return"
    );
}
