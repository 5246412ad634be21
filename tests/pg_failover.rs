//! A PostgreSQL streaming standby promoted under load: keyed POSTs go through the fault
//! proxy and the client stack to two app instances (each an `IdempotencyLayer` over its
//! own `PostgresStore`) on a private primary with one standby (`pg_basebackup`, on
//! loopback ports of their own); the primary is stopped at once (`pg_ctl -m
//! immediate`, as a crash), the standby is promoted, and the TCP proxy in front of
//! them sends new connections to it (the load: `retrysafe_test_support::failover`).
//!
//! A key with two effects is a claim or completion acknowledged by the primary and
//! missing on the promoted standby.
//!
//! Two runs: asynchronous replication (measured: it may or may not lose a write in a
//! short run), and a synchronous standby with `synchronous_commit = remote_apply`
//! (`PostgresStoreOptions::synchronous_commit`), which must have no key with two
//! effects. One JSON line per run (`--nocapture`). `PG_FAILOVER_PROMOTIONS` (default 1
//! per run; each promotion is a fresh primary and standby), `PG_FAILOVER_CONCURRENCY`
//! (default 16).
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::indexing_slicing,
    missing_docs
)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use retrysafe_core::idempotency::{CommitPoint, Fingerprint, Token};
use retrysafe_core::store::conformance::fresh_id;
use retrysafe_core::store::{Claim, IdempotencyStore, StoreError};
use retrysafe_postgres::{PostgresStore, SynchronousCommit};
use retrysafe_test_support::eventually;
use retrysafe_test_support::failover::{Effects, Front, Load, app, duplicates};
use retrysafe_test_support::private::PrivatePg;
use retrysafe_test_support::proxy::FaultProxy;
use retrysafe_test_support::rng::env_number;
use retrysafe_tower::idempotency::IdempotencyLayer;

/// 127.0.0.1:`port`.
fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Runs each statement on its own (`ALTER SYSTEM` refuses a transaction block).
async fn execute(url: &str, statements: &[&str]) {
    use retrysafe_postgres::sqlx::{self, Connection};
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    for statement in statements {
        sqlx::raw_sql(statement).execute(&mut conn).await.unwrap();
    }
}

async fn scalar(url: &str, query: &str) -> i64 {
    use retrysafe_postgres::sqlx::{self, Connection};
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    sqlx::query_scalar(query)
        .fetch_one(&mut conn)
        .await
        .unwrap()
}

/// A primary (with a synchronous standby named when `sync`) and its standby,
/// streaming.
async fn pair(sync: bool) -> (PrivatePg, PrivatePg) {
    let primary = PrivatePg::start().await;
    let store = PostgresStore::connect(&primary.url()).await.unwrap();
    store.migrate().await.unwrap();
    // Named after the base backup, so that the promoted standby does not wait for a
    // standby of its own.
    let standby = primary.standby().await;
    if sync {
        execute(
            &primary.url(),
            &[
                "ALTER SYSTEM SET synchronous_standby_names = '*'",
                "SELECT pg_reload_conf()",
            ],
        )
        .await;
    }
    let state = if sync { "sync" } else { "async" };
    let query = format!(
        "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' \
         AND sync_state = '{state}'"
    );
    eventually("the standby to stream", Duration::from_secs(30), || async {
        (scalar(&primary.url(), &query).await == 1).then_some(())
    })
    .await;
    (primary, standby)
}

/// One app instance, served behind its own fault proxy: its own pool (through the
/// forwarder), its own layer.
async fn instance(url: &str, sync: bool, (effects, seed): (&Effects, u64)) -> Front {
    let mut options = PostgresStore::options()
        .connect_timeout(Duration::from_secs(1))
        .max_connections(8);
    if sync {
        options = options.synchronous_commit(SynchronousCommit::RemoteApply);
    }
    let store = options.connect(url).await.unwrap();
    if sync {
        let report = store.check_replication().await.unwrap();
        assert!(report.survives_promotion(), "{report:?}");
    }
    let layer = IdempotencyLayer::new(store)
        .lease(Duration::from_secs(4))
        .build()
        .unwrap();
    Front::start(app(layer, effects), seed).await
}

/// One promotion under load: the number of keys with two effects, and the load's
/// counts as JSON fields.
async fn promotion(sync: bool, seed: u64) -> (u64, String) {
    let (primary, standby) = pair(sync).await;
    let forwarder = FaultProxy::tcp(loopback(primary.port)).await.unwrap();
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        forwarder.addr.port()
    );
    let effects = Effects::default();
    let fronts = [
        instance(&url, sync, (&effects, seed)).await,
        instance(&url, sync, (&effects, seed + 1)).await,
    ];
    let run = Token::random().to_hex()[..8].to_owned();
    let concurrency = env_number("PG_FAILOVER_CONCURRENCY", 16);
    let load = Load::start([fronts[0].addr, fronts[1].addr], &run, concurrency, seed);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    primary.stop_immediate().await;
    standby.promote().await;
    forwarder.switch(loopback(standby.port));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (tally, _) = load.stop().await;
    assert!(tally.created() > 0, "the load went through");
    (duplicates(&effects), tally.json_fields())
}

async fn run(sync: bool, promotions: u64) -> u64 {
    let mut duplicates = 0;
    for p in 0..promotions {
        let (found, counts) = promotion(sync, 2 * p + 1).await;
        duplicates += found;
        println!(
            "{{\"synchronous_commit\": \"{}\", \"promotion\": {}, {counts}, \
             \"keys_with_two_effects\": {found}}}",
            if sync { "remote_apply" } else { "async" },
            p + 1,
        );
    }
    println!(
        "{{\"synchronous_commit\": \"{}\", \"promotions\": {promotions}, \
         \"keys_with_two_effects\": {duplicates}}}",
        if sync { "remote_apply" } else { "async" },
    );
    duplicates
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synchronous_standby_keeps_every_key_to_one_effect_across_promotion() {
    let promotions = env_number("PG_FAILOVER_PROMOTIONS", 1);
    let _without = run(false, promotions).await;
    let with = run(true, promotions).await;
    assert_eq!(with, 0, "keys with two effects with remote_apply");
}

/// The warnings of target `retrysafe::postgres` logged on this thread (the test's, on
/// a current-thread runtime) while the guard of [`capture`](Self::capture) lives.
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Text<'a>(&'a mut String);
        impl tracing::field::Visit for Text<'_> {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.push_str(&format!("{}={value:?} ", field.name()));
            }
        }
        let meta = event.metadata();
        if *meta.level() == tracing::Level::WARN && meta.target() == "retrysafe::postgres" {
            let mut text = String::new();
            event.record(&mut Text(&mut text));
            self.0.lock().unwrap().push(text);
        }
    }
}

impl Warnings {
    fn capture(&self) -> tracing::subscriber::DefaultGuard {
        use tracing_subscriber::layer::SubscriberExt as _;
        tracing::subscriber::set_default(tracing_subscriber::registry().with(self.clone()))
    }
}

/// The check `connect` makes, against a primary that streams to a standby: an
/// asynchronous one draws a warning that names the way out; a synchronous one, with a
/// level that waits for it, none.
#[tokio::test]
async fn connect_warns_of_an_asynchronous_standby_only() {
    for sync in [false, true] {
        let (primary, _standby) = pair(sync).await;
        let warnings = Warnings::default();
        let guard = warnings.capture();
        let mut options = PostgresStore::options();
        if sync {
            options = options.synchronous_commit(SynchronousCommit::RemoteApply);
        }
        let store = options.connect(&primary.url()).await.unwrap();
        drop(guard);
        let seen = warnings.0.lock().unwrap().clone();
        if sync {
            assert_eq!(seen, Vec::<String>::new());
            assert!(
                store
                    .check_replication()
                    .await
                    .unwrap()
                    .survives_promotion()
            );
        } else {
            assert_eq!(seen.len(), 1, "{seen:?}");
            assert!(
                seen[0].contains("standbys replicate asynchronously")
                    && seen[0].contains("standbys=1")
                    && seen[0].contains("synchronous_commit"),
                "{seen:?}"
            );
        }
    }
}

/// With a synchronous standby named that never connects, a write waits for ever: the
/// store gives up after its call timeout and says so (the layer: an unknown outcome),
/// it never reports success, though PostgreSQL answers a wait cancelled by its
/// `statement_timeout` with success (and a warning).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_waiting_for_a_standby_is_a_timeout_never_a_success() {
    let primary = PrivatePg::start().await;
    execute(
        &primary.url(),
        &[
            "ALTER SYSTEM SET synchronous_standby_names = 'nobody'",
            "SELECT pg_reload_conf()",
        ],
    )
    .await;
    let store = PostgresStore::options()
        .call_timeout(Duration::from_millis(300))
        .synchronous_commit(SynchronousCommit::RemoteApply)
        .connect(&primary.url())
        .await
        .unwrap();
    let report = store.check_replication().await.unwrap();
    assert_eq!(
        report.synchronous_commit,
        Some(SynchronousCommit::RemoteApply)
    );
    assert_eq!(report.synchronous_standby_names, "nobody");
    assert_eq!(report.synchronous_standbys, 0);
    // The table is made without waiting (a session of its own, local commits).
    execute(
        &primary.url(),
        &["SET synchronous_commit = local", &store.migration_sql()],
    )
    .await;
    let claim = Claim::new(
        Token::random(),
        Fingerprint::from_bytes([5; 32]),
        Duration::from_secs(10),
        Duration::from_secs(60),
        CommitPoint::Before,
    );
    let outcome = store.claim(&fresh_id(), &claim).await;
    assert!(matches!(outcome, Err(StoreError::Timeout)), "{outcome:?}");

    // Why: PostgreSQL's statement_timeout cancels the wait, and the COMMIT then
    // answers success (with a warning) though the standby may not have it. The store
    // sets the server's timeout above its own call timeout, so that it gives up first.
    use retrysafe_postgres::sqlx::{self, Connection};
    let mut conn = sqlx::PgConnection::connect(&primary.url()).await.unwrap();
    for set in [
        "SET statement_timeout = 100",
        "SET synchronous_commit = remote_apply",
    ] {
        sqlx::raw_sql(set).execute(&mut conn).await.unwrap();
    }
    let commit = sqlx::raw_sql("SELECT txid_current()").execute(&mut conn);
    let waited = tokio::time::timeout(Duration::from_secs(5), commit).await;
    assert!(
        matches!(waited, Ok(Ok(_))),
        "a cancelled wait answers success: {waited:?}"
    );
}

/// The cost of synchronous replication on a guarded request (a claim and a completion),
/// as multiples of one store round trip (a `get`), sequential calls: asynchronous
/// streaming against a synchronous standby with `remote_apply`. Prints one JSON line
/// (`--nocapture`); asserts nothing about time. `COST_CALLS` (default 300).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_of_synchronous_replication_in_round_trips() {
    let calls: u32 = std::env::var("COST_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let mean = |total: Duration| total.as_secs_f64() * 1e6 / f64::from(calls);
    let mut figures = Vec::new();
    for sync in [false, true] {
        let (primary, _standby) = pair(sync).await;
        let mut options = PostgresStore::options();
        if sync {
            options = options.synchronous_commit(SynchronousCommit::RemoteApply);
        }
        let store = options.connect(&primary.url()).await.unwrap();
        let started = tokio::time::Instant::now();
        for _ in 0..calls {
            store.get(&fresh_id()).await.unwrap();
        }
        let round_trip = mean(started.elapsed());
        let started = tokio::time::Instant::now();
        for _ in 0..calls {
            let id = fresh_id();
            let claim = Claim::new(
                Token::random(),
                Fingerprint::from_bytes([6; 32]),
                Duration::from_secs(10),
                Duration::from_secs(60),
                CommitPoint::Before,
            );
            store.claim(&id, &claim).await.unwrap();
            let done = retrysafe_core::idempotency::Completed::new(claim.fingerprint, None);
            store
                .complete(&id, claim.token, &done, Duration::from_secs(60))
                .await
                .unwrap();
        }
        figures.push((round_trip, mean(started.elapsed())));
    }
    let [(rt_async, g_async), (rt_sync, g_sync)] = [figures[0], figures[1]];
    println!(
        "{{\"calls\": {calls}, \"round_trip_us\": {rt_async:.0}, \"guarded_async_us\": {g_async:.0}, \
         \"guarded_remote_apply_us\": {g_sync:.0}, \"guarded_async_round_trips\": {:.2}, \
         \"guarded_remote_apply_round_trips\": {:.2}, \"round_trip_sync_us\": {rt_sync:.0}}}",
        g_async / rt_async,
        g_sync / rt_async
    );
    assert!(g_async > 0.0 && g_sync > 0.0);
}
