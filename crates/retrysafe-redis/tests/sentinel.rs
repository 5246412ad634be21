//! RedisStore where users run Redis without a cluster (feature `sentinel`): through
//! Redis Sentinel, on a primary with two replicas and three sentinels of its own on
//! loopback ports ([`LocalSentinel`]); and behind a fixed name whose node is demoted.
//!
//! The store and reconcile conformance suites run through the sentinels. Then: the
//! primary killed (SIGKILL) or frozen (SIGSTOP) under load, and the same store answering
//! again once a replica is promoted, with no restart; a store refused on a read-only
//! replica; and a node demoted under a running store behind a forwarder (as a DNS name
//! or a proxy in front of a managed Redis): 503 `store-unavailable`, one log line naming
//! the cause, and a reconnection that follows the name.
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

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::extract::Request;
use axum::http::StatusCode;
use axum::routing::post;
use common::events::Events;
use common::{fresh_prefix, manager_to};
use retrysafe_core::idempotency::{CommitPoint, Completed, Fingerprint, Record, Token};
use retrysafe_core::store::conformance::fresh_id;
use retrysafe_core::store::{Claim, IdempotencyStore, StoreError};
use retrysafe_redis::{RedisStore, RedisStoreError, SentinelConnection};
use retrysafe_test_support::proxy::FaultProxy;
use retrysafe_test_support::redis_nodes::LocalReplicaPair;
use retrysafe_test_support::redis_nodes::LocalSentinel;
use retrysafe_tower::idempotency::{IdempotencyLayer, Principal};
use tower::ServiceExt;

mod conformance {
    retrysafe_core::store_conformance_tests! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        store = super::store,
        clock = retrysafe_core::store::conformance::RealClock::default(),
    }
}

mod reconcile_conformance {
    retrysafe_core::reconcilable_store_tests! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        store = super::store,
        clock = retrysafe_core::store::conformance::RealClock::default(),
    }
}

/// How long a test waits for the store to answer again after a failover.
const PATIENCE: Duration = Duration::from_secs(60);

/// A store with a fresh key prefix on the shared setup, through its sentinels.
async fn store() -> RedisStore<SentinelConnection> {
    let setup = tokio::task::spawn_blocking(LocalSentinel::shared)
        .await
        .unwrap();
    store_on(setup).await
}

async fn store_on(setup: &LocalSentinel) -> RedisStore<SentinelConnection> {
    let conn = SentinelConnection::connect(setup.sentinel_urls(), setup.service(), None)
        .await
        .unwrap_or_else(|e| panic!("no primary through the sentinels: {e}"));
    RedisStore::options()
        .key_prefix(fresh_prefix())
        .build(conn)
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

/// One claim and completion of a fresh record, then the record read back.
async fn round(store: &RedisStore<SentinelConnection>) -> Result<(), StoreError> {
    let id = fresh_id();
    let c = claim();
    store.claim(&id, &c).await?;
    let done = Completed::new(c.fingerprint, None);
    store.complete(&id, c.token, &done, c.retention).await?;
    match store.get(&id).await? {
        Some(Record::Completed(_)) => Ok(()),
        other => panic!("read back {other:?}"),
    }
}

/// What the load saw: rounds done and failed.
#[derive(Default)]
struct Tally {
    done: AtomicU64,
    failed: AtomicU64,
}

/// `workers` tasks doing [`round`]s on `store` until `stop`.
fn load(
    store: &RedisStore<SentinelConnection>,
    workers: usize,
    stop: &Arc<AtomicBool>,
    tally: &Arc<Tally>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..workers)
        .map(|_| {
            let (store, stop, tally) = (store.clone(), Arc::clone(stop), Arc::clone(tally));
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let counter = match round(&store).await {
                        Ok(()) => &tally.done,
                        Err(_) => {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            &tally.failed
                        }
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect()
}

/// Waits until a round on `store` succeeds: the count of failed rounds before it.
async fn answers_again(store: &RedisStore<SentinelConnection>) -> u64 {
    let mut failed = 0;
    let give_up = tokio::time::Instant::now() + PATIENCE;
    loop {
        match round(store).await {
            Ok(()) => return failed,
            Err(e) => {
                failed += 1;
                assert!(
                    tokio::time::Instant::now() < give_up,
                    "the store did not answer again within {PATIENCE:?}: {e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Under load, `fail` takes the primary away (and returns its port); the same store
/// answers again once the sentinels promoted a replica, and uses the new primary.
async fn follows_a_failover(fail: impl FnOnce(&mut LocalSentinel) -> u16 + Send + 'static) {
    let setup = tokio::task::spawn_blocking(|| LocalSentinel::start().unwrap())
        .await
        .unwrap();
    let store = store_on(&setup).await;
    let before = store.connection().primary().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let workers = load(&store, 4, &stop, &tally);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let setup = tokio::task::spawn_blocking(move || {
        let mut setup = setup;
        let old = fail(&mut setup);
        setup.wait_promoted(old).unwrap();
        setup
    })
    .await
    .unwrap();
    let failed = answers_again(&store).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        tokio::time::timeout(PATIENCE, w).await.unwrap().unwrap();
    }
    let after = store.connection().primary().unwrap();
    assert_ne!(before, after, "the store moved to the promoted replica");
    assert_eq!(
        after,
        format!("127.0.0.1:{}", setup.primary().unwrap()),
        "the primary the sentinels name"
    );
    let (done, failed_under_load) = (
        tally.done.load(Ordering::Relaxed),
        tally.failed.load(Ordering::Relaxed),
    );
    println!(
        "rounds done {done}, failed during the failover {failed_under_load}, \
         then failed before answering again {failed}"
    );
    assert!(done > 0, "the load went through");
    // Scripts were loaded again on the promoted node (NOSCRIPT) as they were needed.
    round(&store).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_follows_a_killed_primary_without_a_restart() {
    follows_a_failover(|setup| {
        let old = setup.primary().unwrap();
        setup.kill(old).unwrap();
        old
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_gives_up_a_frozen_primary_and_follows_the_failover() {
    follows_a_failover(|setup| {
        let old = setup.primary().unwrap();
        setup.pause(old).unwrap();
        setup.wait_promoted(old).unwrap();
        // Back, it is demoted by the sentinels and must not take the store's writes.
        // Until they have demoted it, it still takes writes as a primary would (Redis
        // Sentinel's own window, which replicated writes narrow): the store is judged
        // once it is a replica.
        setup.resume(old).unwrap();
        setup.wait_healthy().unwrap();
        old
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_is_refused_on_a_read_only_replica() {
    let pair = LocalReplicaPair::start().unwrap();
    let (primary, _) = pair.ports();
    let expected = format!("127.0.0.1:{primary}");
    let connected = RedisStore::connect(pair.replica_url().as_str()).await;
    let built = RedisStore::options()
        .skip_config_check()
        .build(manager_to(&pair.replica_url()).await)
        .await;
    for made in [connected.map(drop), built.map(drop)] {
        match made {
            Err(e @ RedisStoreError::ReadOnlyReplica { .. }) => {
                let RedisStoreError::ReadOnlyReplica { primary } = &e else {
                    unreachable!()
                };
                assert_eq!(primary.as_deref(), Some(expected.as_str()));
                let message = e.to_string();
                assert!(
                    message.contains("read-only replica") && message.contains(&expected),
                    "{message}"
                );
            }
            other => panic!("a replica must be refused, got {other:?}"),
        }
    }
    // Its primary is accepted.
    RedisStore::connect(pair.url().as_str()).await.unwrap();
}

/// An app on `store`: `POST /pay` answers 201 under the layer.
fn app(store: RedisStore) -> Router {
    let layer = IdempotencyLayer::new(store).build().unwrap();
    Router::new()
        .route("/pay", post(|| async { (StatusCode::CREATED, "paid") }))
        .layer(layer)
        .layer(axum::middleware::map_request(
            |mut req: Request| async move {
                req.extensions_mut().insert(Principal::new("tenant-1"));
                req
            },
        ))
}

/// A keyed POST: its status and, for a problem, its type.
async fn pay(app: &Router) -> (StatusCode, String) {
    let req = Request::post("/pay")
        .header("idempotency-key", Token::random().to_hex())
        .body(Body::from("pay 10"))
        .unwrap();
    let res = app.clone().oneshot(req).await.unwrap();
    let status = res.status();
    let body = to_bytes(res.into_body(), 1 << 16).await.unwrap();
    let problem = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["type"].as_str().map(str::to_owned))
        .unwrap_or_default();
    (status, problem)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_demoted_under_a_running_store_answers_503_and_the_store_follows_its_name() {
    let pair = LocalReplicaPair::start().unwrap();
    let (a, b) = pair.ports();
    // The name in front, as a DNS name or a proxy in front of a managed Redis: new
    // connections go where it is told, connections already made keep their node.
    let loopback = |port: u16| std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let name = FaultProxy::tcp(loopback(a)).await.unwrap();
    let store = RedisStore::options()
        .key_prefix(fresh_prefix())
        .name("orders-redis")
        .build(manager_to(&format!("redis://{}", name.addr)).await)
        .await
        .unwrap();
    let app = app(store);
    assert_eq!(pay(&app).await.0, StatusCode::CREATED);

    // The failover a managed service makes behind its endpoint: B promoted, A its
    // replica, the name sent to B. The store's connection still leads to A.
    let mut conn_a = manager_to(&pair.url()).await;
    let mut conn_b = manager_to(&pair.replica_url()).await;
    let () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut conn_b)
        .await
        .unwrap();
    let () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(b)
        .query_async(&mut conn_a)
        .await
        .unwrap();
    name.switch(loopback(b));

    // For the whole process: the layer may poll the store on another worker thread.
    // The other tests' events are told apart by the store's name.
    let events = Events::default();
    let subscriber = tracing_subscriber::layer::SubscriberExt::with(
        tracing_subscriber::registry(),
        events.clone(),
    );
    tracing::subscriber::set_global_default(subscriber).unwrap();
    let (status, problem) = pay(&app).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{problem}");
    assert!(problem.ends_with("store-unavailable"), "{problem}");
    // The store reconnects through the name and reaches B, with no restart.
    let mut refused = 1;
    let give_up = tokio::time::Instant::now() + PATIENCE;
    loop {
        match pay(&app).await {
            (StatusCode::CREATED, _) => break,
            (StatusCode::SERVICE_UNAVAILABLE, problem) => {
                assert!(problem.ends_with("store-unavailable"), "{problem}");
                refused += 1;
            }
            other => panic!("{other:?}"),
        }
        assert!(tokio::time::Instant::now() < give_up, "never reached B");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("503 answers before the store reached the new primary: {refused}");
    let seen: Vec<_> = events
        .seen()
        .into_iter()
        .filter(|e| e.get("name").is_some_and(|n| n == "orders-redis"))
        .collect();
    let lines: Vec<_> = seen
        .iter()
        .filter(|e| e.get("message").is_some_and(|m| m.contains("READONLY")))
        .collect();
    assert_eq!(lines.len(), 1, "one line per spell: {seen:#?}");
    assert_eq!(lines[0]["name"], "orders-redis");
    assert!(
        lines[0]["error"].contains("read only replica"),
        "{:?}",
        lines[0]
    );
    assert!(
        seen.iter()
            .any(|e| e.get("message").is_some_and(|m| m.contains("writes again"))),
        "{seen:#?}"
    );
}
