//! Round trips per request guarded by the idempotency stores, counted exactly against
//! real Redis and PostgreSQL servers (`cargo bench --bench stores_round_trips`).
//!
//! **Round trips per guarded request**, counted exactly: Redis commands sent through
//! a counting `ConnectionLike` wrapper (cross-checked with `INFO commandstats`
//! deltas, which other clients of the same server can inflate); PostgreSQL frontend
//! messages seen by a counting TCP proxy (statements, prepares, simple queries,
//! pings), with the server's writing transactions (transaction ids assigned) and WAL
//! bytes over each row. For 1 client and for 32, `first` and `replay`, after a
//! warm-up.
//!
//! Each guarded case runs as `first` (a new key for every request: claim, handler,
//! complete) and `replay` (every client repeats its own completed key, which the
//! client stores again in the warm-up should the MemoryStore have evicted it). Clients
//! are hyper HTTP/1.1 connections (keep-alive, `TCP_NODELAY`), one per client, in the
//! same process and tokio runtime (2 worker threads; `STORE_BENCH_WORKERS=1` runs
//! everything on one current-thread runtime) as the servers. Every answer is checked
//! (status, body, `idempotent-replayed`); a wrong one counts as an error and is shown.
//!
//! Redis keys live under a random 10-character prefix (as long as the default
//! `retrysafe:`), PostgreSQL tables in a schema `rsbench_<unix time>_<random>`; both are
//! removed at the end (schemas left by a crashed run are dropped after an hour; Redis
//! keys expire after the 1 h retention the bench configures). The cases and the app:
//! `retrysafe_test_support::bench::stores`.
//!
//! With Redis at `REDIS_URL` (default `redis://127.0.0.1:6379`) and PostgreSQL at
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`):
//! `scripts/bench-stores` runs the three store benches (`stores_bytes`,
//! `stores_round_trips`, `stores_load`) in that order.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout, // the bench's output is its tables
    missing_docs
)]

use std::collections::HashMap;
use std::time::Duration;

use retrysafe_core::recovery::{PendingRecord, ReconcilableStore, Resolution, Resolver};
use retrysafe_postgres::sqlx::{self, PgPool};
use retrysafe_redis::RedisStore;
use retrysafe_redis::redis;
use retrysafe_redis::redis::aio::ConnectionManager;
use retrysafe_test_support::bench::stores;
use retrysafe_test_support::bench::stores::*;
use retrysafe_test_support::proxy::postgres::PgProxy;
use retrysafe_test_support::redis_nodes::CountingConnection;

/// How long the PostgreSQL pools get to finish the pings they send as connections go
/// back to the pool, before the proxy's counts are read.
const POOL_SETTLE: Duration = Duration::from_millis(300);

fn main() -> Res<()> {
    stores::run(
        "round trips per guarded request (`benches/stores_round_trips.rs`)",
        async |settings, env| count_round_trips(settings, env).await,
    )
}

/// A resolver that never knows: the reconcilers of the count phase only scan.
struct NeverKnown;

impl Resolver for NeverKnown {
    async fn resolve(&self, _record: &PendingRecord) -> Resolution {
        Resolution::Unknown
    }
}

/// `INFO commandstats` as command → (calls, µs spent by the server).
async fn command_calls(conn: &mut ConnectionManager) -> Res<HashMap<String, (u64, u64)>> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let mut calls = HashMap::new();
    for line in info.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let field = |key: &str| {
            rest.split(',')
                .find_map(|kv| kv.strip_prefix(key))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        calls.insert(name.to_owned(), (field("calls="), field("usec=")));
    }
    Ok(calls)
}

/// The calls of `name` and the server's µs spent on them between two snapshots.
fn calls_delta(
    before: &HashMap<String, (u64, u64)>,
    after: &HashMap<String, (u64, u64)>,
    name: &str,
) -> (u64, u64) {
    let (c0, u0) = before.get(name).copied().unwrap_or((0, 0));
    let (c1, u1) = after.get(name).copied().unwrap_or((0, 0));
    (c1 - c0, u1 - u0)
}

/// The counting shape of one row: `clients` × `per_client` requests.
fn count_shapes(settings: &Settings) -> [(usize, usize); 2] {
    let clients = settings.clients;
    [
        (1, settings.count_requests),
        (clients, (settings.count_requests / clients).max(1)),
    ]
}

async fn count_round_trips(settings: &Settings, env: &Env) -> Res<()> {
    eprintln!("phase 2: round trips per guarded request");
    println!("## Round trips per guarded request\n");
    println!(
        "Counted after a warm-up (scripts loaded, statements prepared on the pooled \
         connections). Per request: the total over the row's requests divided by their \
         number. A reconciler runs on each store throughout (every second, on a \
         connection of its own): recovery adds nothing to the request path. Its scans \
         are in the server-wide `INFO commandstats` figure (a few `EVALSHA` per second), \
         not in the request path's counting connection nor the PostgreSQL proxy's \
         counts.\n"
    );

    // Redis, with a reconciler running on its own connection.
    let counting = CountingConnection::new(redis_manager(&env.redis_url).await?);
    let store = RedisStore::options()
        .key_prefix(env.prefix.clone())
        .build(counting.clone())
        .await?;
    let _redis_reconciler = env
        .redis_store()
        .await?
        .reconciler(NeverKnown)
        .interval(Duration::from_secs(1))
        .spawn()?;
    let addr = serve(router(layer(store)?)).await?;
    burst(addr, settings.clients, 2, "redis-warm", Expect::Ran).await?;
    burst(addr, settings.clients, 2, "redis-warm", Expect::Replayed).await?;
    let mut admin = env.redis.clone();
    println!(
        "| Redis | clients | requests | commands sent / request (counting connection) | \
         `EVALSHA` / request (`INFO commandstats`) | server µs per `EVALSHA` |"
    );
    println!("|---|---|---|---|---|---|");
    for (clients, per_client) in count_shapes(settings) {
        for (load, expect) in [("first", Expect::Ran), ("replay", Expect::Replayed)] {
            let before = command_calls(&mut admin).await?;
            counting.take();
            let prefix = format!("redis-count-{clients}");
            burst(addr, clients, per_client, &prefix, expect).await?;
            let sent = counting.take();
            let after = command_calls(&mut admin).await?;
            let n = (clients * per_client) as f64;
            let (evalsha, usec) = calls_delta(&before, &after, "evalsha");
            println!(
                "| {load} | {clients} | {} | {:.3} | {:.3} | {:.1} |",
                clients * per_client,
                sent as f64 / n,
                evalsha as f64 / n,
                usec as f64 / evalsha.max(1) as f64,
            );
        }
    }

    // PostgreSQL, through a counting proxy.
    let proxy = PgProxy::start(&env.pg_options).await?;
    let store = env
        .pg_store("counted", proxy.connect_options(&env.pg_options), None)
        .await?;
    let tx_store = env
        .pg_store("counted_tx", proxy.connect_options(&env.pg_options), None)
        .await?;
    let _pg_reconciler = env
        .pg_store("counted", env.pg_options.clone(), Some(2))
        .await?
        .reconciler(NeverKnown)
        .interval(Duration::from_secs(1))
        .spawn()?;
    let cases = [
        ("postgres", serve(router(layer(store.clone())?)).await?),
        ("postgres-tx", serve(router(tx_layer(&tx_store)?)).await?),
    ];
    println!(
        "\n| PostgreSQL | load | clients | requests | statements | prepares | simple queries \
         | round trips before the answer (see below) | pings after the answer (pool \
         release) | new connections | writing transactions (xids) | WAL bytes |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (name, addr) in cases {
        // Warm every pooled connection: it prepares each statement on first use.
        for _ in 0..2 {
            burst(
                addr,
                settings.clients,
                4,
                &format!("{name}-warm"),
                Expect::Either,
            )
            .await?;
        }
        for (clients, per_client) in count_shapes(settings) {
            for (load, expect) in [("first", Expect::Ran), ("replay", Expect::Replayed)] {
                tokio::time::sleep(POOL_SETTLE).await;
                let wal_before = pg_xid_wal(&env.pg).await?;
                let before = proxy.seen();
                let prefix = format!("{name}-count-{clients}");
                burst(addr, clients, per_client, &prefix, expect).await?;
                tokio::time::sleep(POOL_SETTLE).await;
                let seen = proxy.seen() - before;
                let wal_after = pg_xid_wal(&env.pg).await?;
                let n = (clients * per_client) as f64;
                let f = |v: u64| v as f64 / n;
                // A transactional replay's ROLLBACK is sent with the release ping, after
                // the answer.
                let after_answer_queries = if name == "postgres-tx" && load == "replay" {
                    1.0
                } else {
                    0.0
                };
                println!(
                    "| {name} | {load} | {clients} | {} | {:.3} | {:.3} | {:.3} | {:.3} | \
                     {:.3} | {} | {:.2} | {:.0} |",
                    clients * per_client,
                    f(seen.statements),
                    f(seen.prepares),
                    f(seen.simple_queries),
                    f(seen.statements + seen.prepares + seen.simple_queries) - after_answer_queries,
                    f(seen.pings),
                    seen.connections,
                    (wal_after.0 - wal_before.0) as f64 / n,
                    (wal_after.1 - wal_before.1) as f64 / n,
                );
            }
        }
    }
    store.pool().close().await;
    tx_store.pool().close().await;
    println!(
        "\nRound trips before the answer = statements + prepares + simple queries (for a \
         `postgres-tx` replay less its `ROLLBACK`, which sqlx sends with the release \
         ping after the connection goes back to the pool). Pings are sqlx's check of a \
         connection as it returns to the pool: after the store call has returned, off \
         the request's path, but they keep the connection busy for one more round trip. \
         Writing transactions (transaction ids assigned) and WAL bytes are server-wide \
         deltas over the row, per request (other clients of the server add to them); \
         with `synchronous_commit = on` the commit of every writing transaction waits for \
         a WAL flush to disk.\n"
    );
    Ok(())
}

/// The server's next transaction id and WAL insert position (bytes): their deltas
/// count the transactions that wrote (each is assigned an id, and its commit waits for
/// a WAL flush) and the WAL they wrote, server-wide, at once (unlike `pg_stat_wal`,
/// which backends report about once a second). Neither query assigns an id itself.
async fn pg_xid_wal(pool: &PgPool) -> Res<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::int8, \
         pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::int8",
    )
    .fetch_one(pool)
    .await?)
}
