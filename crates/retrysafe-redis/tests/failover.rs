//! Failovers under load (feature `cluster`): keyed POSTs go through two app instances
//! (each an `IdempotencyLayer` over its own `RedisStore` on one local cluster of 3
//! primaries and 3 replicas) while a primary is killed with SIGKILL, its replica is
//! promoted, and the killed node comes back as a replica, again and again.
//!
//! Each logical request is sent to one instance until it gets a final answer (409 and
//! 503 are retried); a 201 is then sent again, as a client whose reply was lost would,
//! to the other instance, which must replay it. The handler counts its effects per key.
//! A key with two effects is a duplicate: a claim or completion acknowledged by a
//! primary that died before its replica had it.
//!
//! Two runs on the same cluster: without and with `replicated_writes(1, …)`. The run
//! with the setting must have no duplicate; the one without is measured (Redis
//! replicates asynchronously: it may or may not lose a write in a short run). One JSON
//! line per run (`--nocapture` to see it).
//!
//! `FAILOVER_PROMOTIONS` (default 2 per run; 50 for the figures of RELIABILITY.md),
//! `FAILOVER_CONCURRENCY` (default 32), `FAILOVER_RUNS` (`both`, the default;
//! `replicated` or `default` for one of the two runs).
#![cfg(feature = "cluster")]
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::indexing_slicing,
    missing_docs
)]

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use redis::cluster_async::ClusterConnection;
use retrysafe_redis::RedisStore;
use retrysafe_redis::test_util::LocalCluster;
use retrysafe_tower::idempotency::{IdempotencyLayer, Principal};
use tower::ServiceExt;

/// How long one logical request keeps trying (409, 503) before it is given up.
const PATIENCE: Duration = Duration::from_secs(40);

/// The pause between two tries of one logical request.
const PAUSE: Duration = Duration::from_millis(25);

/// How long the workers may take to stop once the promotions are over: a worker
/// finishes its logical request, which takes at most twice [`PATIENCE`].
const STOPPING: Duration = Duration::from_secs(120);

/// What one worker awaits now (key, instance, try), for the report of a worker that
/// does not stop.
type Stage = Arc<Mutex<String>>;

type Effects = Arc<Mutex<HashMap<String, u32>>>;

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One app instance: its own cluster connection, its own layer.
async fn instance(
    cluster: &LocalCluster,
    prefix: &str,
    replicated: bool,
    effects: &Effects,
) -> Router {
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
    let mut store = RedisStore::options()
        .key_prefix(prefix)
        .build(conn)
        .await
        .unwrap();
    if replicated {
        store = store.replicated_writes(1, Duration::from_millis(500));
    }
    let layer = IdempotencyLayer::new(store)
        .lease(Duration::from_secs(4))
        .build()
        .unwrap();
    let effects = Arc::clone(effects);
    Router::new()
        .route(
            "/pay",
            post(move |headers: HeaderMap| async move {
                let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                *effects.lock().unwrap().entry(key).or_insert(0) += 1;
                (StatusCode::CREATED, "paid")
            }),
        )
        .layer(layer)
        .layer(axum::middleware::map_request(
            |mut req: Request| async move {
                req.extensions_mut().insert(Principal::new("tenant-1"));
                req
            },
        ))
}

/// What the runs saw.
#[derive(Debug, Default)]
struct Tally {
    logical: AtomicU64,
    created: AtomicU64,
    replayed_copies: AtomicU64,
    unknown: AtomicU64,
    unavailable_tries: AtomicU64,
    given_up: AtomicU64,
}

/// The final status of `key` at `app` (409 and 503 retried), or `None` when it never
/// got one within [`PATIENCE`].
async fn final_status(
    (app, n): (&Router, usize),
    key: &str,
    tally: &Tally,
    stage: &Stage,
) -> Option<(StatusCode, bool)> {
    let tries = PATIENCE.as_millis() / PAUSE.as_millis();
    for t in 0..tries {
        *stage.lock().unwrap() = format!("{key}: try {t} on instance {n}");
        let req = Request::post("/pay")
            .header("idempotency-key", key)
            .body(Body::from("pay 10"))
            .unwrap();
        let res = app.clone().oneshot(req).await.unwrap();
        let replayed = res.headers().contains_key("idempotent-replayed");
        match res.status() {
            StatusCode::CONFLICT => {}
            StatusCode::SERVICE_UNAVAILABLE => {
                tally.unavailable_tries.fetch_add(1, Ordering::Relaxed);
            }
            status => return Some((status, replayed)),
        }
        tokio::time::sleep(PAUSE).await;
    }
    None
}

/// One worker: logical requests, one after another, until `stop`.
async fn worker(
    apps: [Router; 2],
    run: String,
    n: usize,
    (stop, stage): (Arc<AtomicBool>, Stage),
    tally: Arc<Tally>,
) {
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let key = format!("{run}-{n}-{i}");
        let (first, other) = if i.is_multiple_of(2) { (0, 1) } else { (1, 0) };
        i += 1;
        tally.logical.fetch_add(1, Ordering::Relaxed);
        match final_status((&apps[first], first), &key, &tally, &stage).await {
            Some((StatusCode::CREATED, _)) => {
                tally.created.fetch_add(1, Ordering::Relaxed);
                // The reply was lost, say: the same request again, to the other one.
                match final_status((&apps[other], other), &key, &tally, &stage).await {
                    Some((StatusCode::CREATED, true)) => {
                        tally.replayed_copies.fetch_add(1, Ordering::Relaxed);
                    }
                    Some((StatusCode::INTERNAL_SERVER_ERROR, _)) => {
                        tally.unknown.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {}
                }
            }
            Some((StatusCode::INTERNAL_SERVER_ERROR, _)) => {
                tally.unknown.fetch_add(1, Ordering::Relaxed);
            }
            Some(_) => {}
            None => {
                tally.given_up.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
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
    let prefix = common::fresh_prefix();
    let apps = [
        instance(&cluster, &prefix, replicated, &effects).await,
        instance(&cluster, &prefix, replicated, &effects).await,
    ];
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let concurrency = env_number("FAILOVER_CONCURRENCY", 32);
    let mut workers = Vec::new();
    let mut stages = Vec::new();
    for n in 0..concurrency {
        let stage = Stage::default();
        stages.push(Arc::clone(&stage));
        workers.push(tokio::spawn(worker(
            apps.clone(),
            prefix.clone(),
            usize::try_from(n).unwrap(),
            (Arc::clone(&stop), stage),
            Arc::clone(&tally),
        )));
    }
    let cluster = tokio::task::spawn_blocking(move || kill_primaries(cluster, promotions))
        .await
        .unwrap();
    stop.store(true, Ordering::Relaxed);
    // Bounded: a worker that does not stop is a failure that says what it awaits.
    let stopped = tokio::time::timeout(STOPPING, async {
        for w in &mut workers {
            w.await.unwrap();
        }
    })
    .await;
    if stopped.is_err() {
        let stuck: Vec<String> = workers
            .iter()
            .zip(&stages)
            .filter(|(w, _)| !w.is_finished())
            .map(|(_, stage)| stage.lock().unwrap().clone())
            .collect();
        panic!("workers still running {STOPPING:?} after the promotions: {stuck:?}");
    }
    let effects = effects.lock().unwrap();
    let duplicates = effects.values().filter(|&&n| n >= 2).count() as u64;
    let total: u64 = effects.values().map(|&n| u64::from(n)).sum();
    let t = &tally;
    println!(
        "{{\"replicated_writes\": {replicated}, \"promotions\": {promotions}, \
         \"logical\": {}, \"created\": {}, \"replayed_copies\": {}, \"effects\": {total}, \
         \"keys_with_two_effects\": {duplicates}, \"outcome_unknown\": {}, \
         \"unavailable_tries\": {}, \"given_up\": {}}}",
        t.logical.load(Ordering::Relaxed),
        t.created.load(Ordering::Relaxed),
        t.replayed_copies.load(Ordering::Relaxed),
        t.unknown.load(Ordering::Relaxed),
        t.unavailable_tries.load(Ordering::Relaxed),
        t.given_up.load(Ordering::Relaxed),
    );
    assert!(
        t.created.load(Ordering::Relaxed) > 0,
        "the load went through"
    );
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
    let store = RedisStore::connect_cluster(cluster.urls()).await.unwrap();
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
