//! What a stored record of the idempotency stores takes, in bytes, against real Redis
//! and PostgreSQL servers (`cargo bench --bench stores_bytes`).
//!
//! **Bytes per stored record**: a record stored through the layer (bodies of 100 B,
//! 1 KiB and 16 KiB of incompressible text, a 36-character key), measured as its
//! `Record::encoded_len`, the `MemoryStore`'s weight and the RSS growth per record of
//! a fresh child process filling a `MemoryStore`, Redis `MEMORY USAGE` and
//! `used_memory` growth per record, and PostgreSQL `pg_column_size(row)` and
//! table-plus-index growth per record, next to the bound
//! 2 × payload + 256 (payload = body + stored header bytes + key).
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

use std::time::Duration;

use bytes::Bytes;
use retrysafe::idempotency::{MemoryStore, Principal, RecordId, Scope};
use retrysafe_core::idempotency::{CommitPoint, Completed, Record, Token};
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore};
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_postgres::sqlx::{self, PgPool};
use retrysafe_redis::redis;
use retrysafe_redis::redis::aio::ConnectionManager;
use retrysafe_test_support::bench::body::blob_body;
use retrysafe_test_support::bench::http1::open_http;
use retrysafe_test_support::bench::stores;
use retrysafe_test_support::bench::stores::*;
use tokio::task::JoinSet;

/// Set (to a record count) in the child process that measures the `MemoryStore`'s RSS
/// growth; the record comes hex-encoded in [`RSS_RECORD`].
const RSS_CHILD: &str = "STORE_BENCH_RSS_CHILD";
const RSS_RECORD: &str = "STORE_BENCH_RSS_RECORD";

/// Body sizes of the stored-record measurements.
const RECORD_BODIES: [usize; 3] = [100, 1024, 16 * 1024];

fn main() -> Res<()> {
    if let Ok(n) = std::env::var(RSS_CHILD) {
        return rss_child(&n);
    }
    stores::run(
        "bytes per stored record (`benches/stores_bytes.rs`)",
        async |_, env| {
            let servers = Servers::start(env).await?;
            record_sizes(env, &servers).await
        },
    )
}

/// A 36-character key (the length of a UUID), unique per `(tag, n)`.
fn uuid_key(tag: u32, n: usize) -> String {
    format!("{tag:08x}-0000-4000-8000-{n:012x}")
}

fn record_id(key: &str) -> Res<RecordId> {
    Ok(RecordId::new(
        &Scope::from(&Principal::new(TENANT)),
        &IdempotencyKey::new(key)?,
    ))
}

/// Stores `n` completed records holding `record`, keys `uuid_key(tag, 0..n)`, through
/// the store's own calls (claim, complete), `tasks` at a time.
async fn fill<S: IdempotencyStore + Clone>(
    store: &S,
    tag: u32,
    n: usize,
    record: &Completed,
    tasks: usize,
) -> Res<()> {
    let mut set = JoinSet::new();
    for t in 0..tasks {
        let store = store.clone();
        let record = record.clone();
        set.spawn(async move {
            for i in (t..n).step_by(tasks) {
                let id = record_id(&uuid_key(tag, i))?;
                let claim = Claim::new(
                    Token::random(),
                    record.fingerprint,
                    Duration::from_secs(10),
                    RETENTION,
                    CommitPoint::Undeclared,
                );
                match store.claim(&id, &claim).await? {
                    ClaimOutcome::Claimed { .. } => {}
                    other => {
                        return Err(format!("fill: claim found {other:?}").into());
                    }
                }
                store.complete(&id, claim.token, &record, RETENTION).await?;
            }
            Ok::<_, BoxError>(())
        });
    }
    while let Some(done) = set.join_next().await {
        done??;
    }
    Ok(())
}

/// The completed record of `key` in `store`, with its response.
async fn completed_of(store: &impl IdempotencyStore, key: &str) -> Res<Completed> {
    match store.get(&record_id(key)?).await? {
        Some(Record::Completed(c)) if c.response.is_some() => Ok(c),
        other => Err(format!("record of {key}: {other:?}").into()),
    }
}

/// The process's resident set size, in bytes.
fn rss_bytes() -> Res<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .ok_or("no VmRSS in /proc/self/status")?;
    Ok(kb * 1024)
}

/// Runs this executable again as a child that stores `n` copies of `record` in a fresh
/// `MemoryStore` and reports its RSS growth: a fresh process, so that memory freed by
/// an earlier measurement cannot be reused.
fn rss_per_record(record: &Record, n: usize) -> Res<f64> {
    let hex: String = record.encode().iter().map(|b| format!("{b:02x}")).collect();
    let out = std::process::Command::new(std::env::current_exe()?)
        .env(RSS_CHILD, n.to_string())
        .env(RSS_RECORD, hex)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "RSS child failed ({}): {text} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let grown: i64 = text
        .trim()
        .parse()
        .map_err(|e| format!("RSS child said {text:?}: {e}"))?;
    Ok(per(grown, n))
}

/// The child of [`rss_per_record`]: prints the RSS growth, in bytes, over storing the
/// records.
fn rss_child(n: &str) -> Res<()> {
    let n: usize = n.parse()?;
    let hex = std::env::var(RSS_RECORD)?;
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2).unwrap_or("zz"), 16))
        .collect::<Result<Vec<u8>, _>>()?;
    let Record::Completed(record) = Record::decode(Bytes::from(bytes))? else {
        return Err("RSS child: not a completed record".into());
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let store = MemoryStore::new().max_bytes(1 << 30).build()?;
        let before = rss_bytes()?;
        fill(&store, 1, n, &record, 1).await?;
        let after = rss_bytes()?;
        if store.cached_len() != u64::try_from(n)? {
            return Err("RSS child: records missing".into());
        }
        println!("{}", i64::try_from(after)? - i64::try_from(before)?);
        Ok(())
    })
}

async fn redis_used_memory(conn: &mut ConnectionManager) -> Res<i64> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(conn).await?;
    Ok(info_field(&info, "used_memory")
        .and_then(|v| v.parse().ok())
        .ok_or("no used_memory in INFO memory")?)
}

/// `pg_total_relation_size`, `pg_relation_size` (heap) and `pg_indexes_size` of a
/// table.
async fn pg_sizes(pool: &PgPool, table: &str) -> Res<(i64, i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT pg_total_relation_size($1::text::regclass), \
         pg_relation_size($1::text::regclass), pg_indexes_size($1::text::regclass)",
    )
    .bind(table)
    .fetch_one(pool)
    .await?)
}

fn per(delta: i64, n: usize) -> f64 {
    delta as f64 / n as f64
}

async fn record_sizes(env: &Env, servers: &Servers) -> Res<()> {
    eprintln!("phase 1: bytes per stored record");
    println!("## Bytes per stored record\n");
    println!(
        "payload = response body + stored header bytes (names and values) + idempotency \
         key (36 characters); bound = 2 × payload + 256. `n` = records \
         stored for the per-record growth figures.\n"
    );
    println!(
        "| body | payload | bound | `encoded_len` | memory: weight | memory: RSS growth / \
         record (n) | Redis `MEMORY USAGE` | Redis `used_memory` growth / record (n) | \
         PostgreSQL `pg_column_size(row)` | PostgreSQL table + indexes / record, as \
         written (n) | … after `VACUUM FULL` |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut admin = env.redis.clone();
    let mut notes = Vec::new();
    for (i, &size) in RECORD_BODIES.iter().enumerate() {
        let tag = 0x5eed_0000 + u32::try_from(i)?;
        let key = uuid_key(tag, usize::MAX >> 16);
        let path = format!("/blob/{size}");
        let body = blob_body(size);
        // One record through each layer.
        for addr in [servers.memory, servers.redis, servers.postgres, servers.tx] {
            let mut sender = open_http(addr).await?;
            let answer = post_once(&mut sender, &path, &key).await?;
            check(&answer, Expect::Ran, &body).map_err(|e| format!("{addr} {path}: {e}"))?;
        }
        let from_memory = completed_of(&servers.memory_store, &key).await?;
        let from_redis = completed_of(&servers.redis_store, &key).await?;
        let from_pg = completed_of(&servers.postgres_store, &key).await?;
        let from_tx = completed_of(&servers.tx_store, &key).await?;
        for other in [&from_redis, &from_pg, &from_tx] {
            if other.response != from_memory.response {
                return Err(format!("{size} B: the stores hold different responses").into());
            }
        }
        let response = from_memory.response.as_ref().ok_or("no response")?;
        let payload = response.payload_len() + key.len();
        let bound = 2 * payload + 256;
        let encoded = Record::Completed(from_memory.clone()).encoded_len();
        let weight = u64::try_from(encoded)? + 32 + MemoryStore::ENTRY_OVERHEAD;

        // Redis: the one key, as Redis accounts it.
        let usage: Option<i64> = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(servers.redis_store.key(&record_id(&key)?))
            .arg("SAMPLES")
            .arg(0)
            .query_async(&mut admin)
            .await?;
        let usage = usage.ok_or("MEMORY USAGE: no such key")?;
        // PostgreSQL: the row, as PostgreSQL accounts it (composite datum: tuple header
        // and columns; without the line pointer and index entries).
        let row: i32 = sqlx::query_scalar(&format!(
            "SELECT pg_column_size(t.*) FROM {} t WHERE k = $1",
            servers.postgres_store.table()
        ))
        .bind(&record_id(&key)?.as_bytes()[..])
        .fetch_one(&env.pg)
        .await?;
        let tx_row: i32 = sqlx::query_scalar(&format!(
            "SELECT pg_column_size(t.*) FROM {} t WHERE k = $1",
            servers.tx_store.table()
        ))
        .bind(&record_id(&key)?.as_bytes()[..])
        .fetch_one(&env.pg)
        .await?;
        if tx_row != row {
            eprintln!("note: {size} B: the tx layer's row is {tx_row} bytes, the store's {row}");
        }

        // Many records: growth per record.
        let mem_n = ((32 << 20) / (payload + 64).max(1)).min(50_000);
        let rss_per = rss_per_record(&Record::Completed(from_memory.clone()), mem_n)?;

        let far_n = ((8 << 20) / (payload + 64).max(1)).min(10_000);
        let used0 = redis_used_memory(&mut admin).await?;
        fill(&servers.redis_store, tag, far_n, &from_memory, 16).await?;
        let used1 = redis_used_memory(&mut admin).await?;
        let redis_per = per(used1 - used0, far_n);

        let table = format!("sizes_{size}");
        let store = env.pg_store(&table, env.pg_options.clone(), None).await?;
        let (empty, _, _) = pg_sizes(&env.pg, store.table()).await?;
        fill(&store, tag, far_n, &from_memory, 16).await?;
        let (written, heap, indexes) = pg_sizes(&env.pg, store.table()).await?;
        sqlx::raw_sql(&format!("VACUUM FULL {}", store.table()))
            .execute(&env.pg)
            .await?;
        let (vacuumed, vheap, vindexes) = pg_sizes(&env.pg, store.table()).await?;
        store.pool().close().await;
        let pg_written = per(written - empty, far_n);
        let pg_vacuumed = per(vacuumed - empty, far_n);
        notes.push(format!(
            "- {size} B, PostgreSQL, {far_n} rows: heap {heap} and indexes {indexes} bytes \
             as written, {vheap} and {vindexes} after `VACUUM FULL` (the rest of the \
             total is TOAST and the free-space and visibility maps)"
        ));

        let mark = |v: f64| {
            if v <= bound as f64 {
                format!("{v:.0}")
            } else {
                format!("{v:.0} (over)")
            }
        };
        println!(
            "| {size} B | {payload} | {bound} | {encoded} | {} | {} ({mem_n}) | {} | {} \
             ({far_n}) | {} | {} ({far_n}) | {} |",
            mark(weight as f64),
            mark(rss_per),
            mark(usage as f64),
            mark(redis_per),
            mark(f64::from(row)),
            mark(pg_written),
            mark(pg_vacuumed),
        );
    }
    println!("\n{}", notes.join("\n"));
    println!(
        "\n(over) marks a figure above the bound. Redis `used_memory` is server-wide: other \
         clients of the same server move it too.\n"
    );
    Ok(())
}
