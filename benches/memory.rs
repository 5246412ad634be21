//! Memory per stored record at 10 000 and 1 000 000 records, for each store, next to
//! the bound `2 × payload + 256` (payload = response body + stored header
//! bytes + idempotency key).
//!
//! Every record is stored through the store's public API, as the layer stores it: a
//! `claim`, then a `complete` with a `Completed` record holding a 201 response, one
//! stored header (`content-type: application/json`, 28 bytes) and a body of
//! incompressible JSON text (100 B, 1 KiB, and 16 KiB at 10 000 records only), under
//! 36-character keys (the length of a UUID) and a retention of one hour.
//!
//! - **MemoryStore**: each fill runs in a fresh child process of this executable, so
//!   that memory freed by an earlier fill cannot be reused. The process's allocator is
//!   counted (`stats_alloc` around the system allocator): the heap figure is the live
//!   bytes requested after the fill minus before, over `n`, exactly; with it the live
//!   allocations per record, an upper bound on what glibc malloc really holds (each
//!   chunk is at most the request + 23 bytes: an 8-byte header and rounding to 16), the
//!   RSS growth per record (a cross-check that sees every allocator cost), and the
//!   store's own weight per record (`cached_bytes() / cached_len()`). One more child
//!   fills a store bounded by `max_bytes` = 64 MiB far past its bound (1 000 000 records
//!   of 1 KiB) and compares the cache's live heap with `max_bytes`.
//! - **RedisStore** (Redis at `REDIS_URL`, default `redis://127.0.0.1:6379`, keys under a
//!   random prefix, deleted after each fill): the growth of `INFO memory` `used_memory`
//!   over the fill, per record (server-wide: other clients of the same server move it
//!   too), `MEMORY USAGE … SAMPLES 0` averaged over 100 sample keys (the key and its
//!   value, without the expiry entry), and the growth of the server's RSS.
//! - **PostgresStore** (PostgreSQL at `DATABASE_URL`, default
//!   `postgres://postgres@127.0.0.1:5432/test`, a fresh table per fill in a fresh schema
//!   `rsmem_<unix time>_<random>`, dropped at the end): the growth of
//!   `pg_total_relation_size` (heap, indexes, TOAST and maps) over the fill, per
//!   record, as written (the `in_progress` row versions replaced by `complete` are
//!   still in the heap and the indexes, as they are until a vacuum). The store's
//!   connections set `synchronous_commit = off`: it makes a million commits affordable
//!   and changes nothing in what is stored.
//!
//! Redis and PostgreSQL are filled by `MEMORY_BENCH_TASKS` tasks (default 64) sharing
//! one store (Redis: one multiplexed connection, so the calls are pipelined;
//! PostgreSQL: a pool of `MEMORY_BENCH_PG_CONNECTIONS`, default 32). A fill stops
//! issuing records after `MEMORY_BENCH_FILL_SECS` (default 300); the table then says
//! how many it stored, and every figure is over that many.
//!
//! `cargo bench --bench memory` (or `scripts/bench-memory`). Environment:
//! `MEMORY_BENCH_N` (default `10000,1000000`), `MEMORY_BENCH_STORES` (default
//! `memory,redis,postgres`), `MEMORY_BENCH_BOUNDED` (default `1`: run the bounded fill).
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    clippy::print_stdout, // the bench's output is its tables
    missing_docs
)]

use std::alloc::System;
use std::error::Error;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderName, HeaderValue, StatusCode};
use retrysafe::memory::MemoryStore;
use retrysafe_core::idempotency::{
    CommitPoint, Completed, Fingerprint, RecordId, Scope, StoredResponse, Token,
};
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore};
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_postgres::PostgresStore;
use retrysafe_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use retrysafe_postgres::sqlx::{self, PgPool};
use retrysafe_redis::RedisStore;
use retrysafe_redis::redis;
use retrysafe_redis::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use retrysafe_test_support::bench::body::blob_body;
use retrysafe_test_support::bench::load::*;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Counts every allocation of this process (the fill's and the store's).
#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

type BoxError = Box<dyn Error + Send + Sync>;
type Res<T> = Result<T, BoxError>;

/// Set in a child process: `<body>:<n>:<max_bytes>`.
const CHILD: &str = "MEMORY_BENCH_CHILD";
const TENANT: &str = "tenant-1";
const RETENTION: Duration = Duration::from_secs(60 * 60);
/// The stored header: 12 + 16 = 28 payload bytes.
const CONTENT_TYPE: &str = "content-type";
const JSON: &str = "application/json";
/// The bytes glibc malloc may hold beyond a request: an 8-byte chunk header and
/// rounding up to 16 (for requests of at least 9 bytes).
const MALLOC_SLACK: f64 = 23.0;
/// The bound of the bounded fill.
const BOUNDED_MAX_BYTES: u64 = 64 << 20;

fn main() -> Res<()> {
    if let Ok(spec) = std::env::var(CHILD) {
        return child(&spec);
    }
    let ns = env_list("MEMORY_BENCH_N", "10000,1000000")?;
    let stores =
        std::env::var("MEMORY_BENCH_STORES").unwrap_or_else(|_| "memory,redis,postgres".to_owned());
    let bounded = std::env::var("MEMORY_BENCH_BOUNDED").map_or(true, |v| v != "0");
    let cases: Vec<(usize, usize)> = [100, 1024, 16 * 1024]
        .into_iter()
        .flat_map(|body| ns.iter().map(move |&n| (body, n)))
        // 16 KiB records are measured at 10 000 only: a million of them is 16 GiB.
        .filter(|&(body, n)| body < 16 * 1024 || n <= 10_000)
        .collect();
    eprintln!(
        "memory bench: n {ns:?}, stores {stores}, load {}, {}",
        loadavg(),
        git_rev()
    );

    let mut rows = Vec::new();
    if stores.contains("memory") {
        for &(body, n) in &cases {
            eprintln!("memory: {body} B × {n}");
            rows.push(memory_row(body, n)?);
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if stores.contains("redis") {
        runtime.block_on(async {
            let env = RedisEnv::setup().await?;
            for &(body, n) in &cases {
                eprintln!("redis: {body} B × {n}");
                let row = env.row(body, n).await;
                // Deleted whatever happened.
                env.clear().await?;
                rows.push(row?);
            }
            Ok::<_, BoxError>(())
        })?;
    }
    if stores.contains("postgres") {
        runtime.block_on(async {
            let env = PgEnv::setup().await?;
            let mut result = Ok(());
            for &(body, n) in &cases {
                eprintln!("postgres: {body} B × {n}");
                match env.row(body, n).await {
                    Ok(row) => rows.push(row),
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
            env.teardown().await?;
            result
        })?;
    }

    println!("## Memory per stored record\n");
    println!(
        "payload = body + stored header bytes (28) + key (36); bound = 2 × payload + 256. \
         bytes/record: MemoryStore = live heap requested (exact, counted allocator), \
         Redis = `used_memory` growth, PostgreSQL = `pg_total_relation_size` growth. \
         Within bound? judges bytes/record, and for the MemoryStore also its RSS growth \
         and its weight. Load at the start: {}.\n",
        loadavg()
    );
    println!(
        "| store | body | n | payload | bound | bytes/record | heap incl. malloc (≤) | \
         allocations/record | RSS/record | weight | other | fill time | within bound? |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for row in &rows {
        println!("{}", row.markdown());
    }
    if bounded && stores.contains("memory") {
        eprintln!("memory: bounded fill");
        let out = run_child(1024, 1_000_000, BOUNDED_MAX_BYTES)?;
        let over = out.heap - BOUNDED_MAX_BYTES as f64;
        println!("\n### MemoryStore bounded by `max_bytes` = 64 MiB, 1 000 000 records of 1 KiB\n");
        println!(
            "| max_bytes | records kept | `cached_bytes` | live heap of the store | … incl. \
             malloc (≤) | RSS growth | heap − max_bytes |"
        );
        println!("|---|---|---|---|---|---|---|");
        println!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            BOUNDED_MAX_BYTES,
            out.len,
            out.cached_bytes,
            out.heap,
            out.heap + MALLOC_SLACK * out.allocs,
            out.rss,
            over,
        );
    }
    Ok(())
}

fn env_list(name: &str, default: &str) -> Res<Vec<usize>> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_owned())
        .split(',')
        .map(|s| {
            s.trim()
                .replace('_', "")
                .parse()
                .map_err(|e| format!("{name}: {s:?}: {e}").into())
        })
        .collect()
}

fn env_or<T: FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn git_rev() -> String {
    std::process::Command::new("git")
        .args([
            "-C",
            env!("CARGO_MANIFEST_DIR"),
            "rev-parse",
            "--short",
            "HEAD",
        ])
        .output()
        .ok()
        .map(|o| format!("HEAD {}", String::from_utf8_lossy(&o.stdout).trim()))
        .unwrap_or_default()
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

// ---------------------------------------------------------------------------------------
// Records
// ---------------------------------------------------------------------------------------

/// The completed record the layer stores for a 201 with a JSON body of `body` bytes.
fn completed(body: usize) -> Completed {
    let headers = vec![(
        HeaderName::from_static(CONTENT_TYPE),
        HeaderValue::from_static(JSON),
    )];
    let stored = StoredResponse::new(StatusCode::CREATED, headers, blob_body(body), Vec::new());
    Completed::new(Fingerprint::from_bytes([0x5a; 32]), Some(stored))
}

/// A 36-character key (the length of a UUID), unique per `(tag, i)`.
fn uuid_key(tag: u32, i: usize) -> String {
    format!("{tag:08x}-0000-4000-8000-{i:012x}")
}

fn record_id(tag: u32, i: usize) -> Res<RecordId> {
    Ok(RecordId::new(
        &Scope::new(TENANT),
        &IdempotencyKey::new(&uuid_key(tag, i))?,
    ))
}

/// Payload and bound of a record with a body of `body` bytes.
fn payload_and_bound(body: usize) -> (usize, usize) {
    let payload = body + CONTENT_TYPE.len() + JSON.len() + uuid_key(0, 0).len();
    (payload, 2 * payload + 256)
}

/// Stores one record the way the layer does: a claim, then its completion.
async fn store_one<S: IdempotencyStore>(store: &S, id: &RecordId, record: &Completed) -> Res<()> {
    let claim = Claim::new(
        Token::random(),
        record.fingerprint,
        Duration::from_secs(30),
        RETENTION,
        CommitPoint::Undeclared,
    );
    match store.claim(id, &claim).await? {
        ClaimOutcome::Claimed { .. } => {}
        other => {
            return Err(format!("fill: claim found {other:?}").into());
        }
    }
    store.complete(id, claim.token, record, RETENTION).await?;
    Ok(())
}

/// Stores up to `n` records (keys `uuid_key(tag, 0..)`) with `tasks` tasks sharing
/// `store`; stops issuing new ones at `deadline`. Returns how many were stored (keys
/// `0..stored`, every one of them).
async fn fill<S: IdempotencyStore + Clone + Send + Sync + 'static>(
    store: &S,
    tag: u32,
    n: usize,
    record: &Completed,
    tasks: usize,
    deadline: Instant,
) -> Res<usize> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut set = JoinSet::new();
    for _ in 0..tasks {
        let (store, record, next) = (store.clone(), record.clone(), Arc::clone(&next));
        set.spawn(async move {
            let mut done = 0usize;
            loop {
                if Instant::now() >= deadline {
                    break;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                store_one(&store, &record_id(tag, i)?, &record).await?;
                done += 1;
            }
            Ok::<_, BoxError>(done)
        });
    }
    let mut stored = 0;
    while let Some(done) = set.join_next().await {
        stored += done??;
    }
    // Every index below `next` was taken by exactly one task, which stored it.
    Ok(stored)
}

// ---------------------------------------------------------------------------------------
// Rows
// ---------------------------------------------------------------------------------------

struct Row {
    store: &'static str,
    body: usize,
    /// Records asked for and records stored.
    n: usize,
    stored: usize,
    /// The per-record figure compared with the bound.
    per_record: f64,
    /// MemoryStore: heap incl. malloc (upper bound) and allocations per record.
    with_malloc: Option<f64>,
    allocs: Option<f64>,
    rss: Option<f64>,
    weight: Option<f64>,
    other: String,
    secs: f64,
}

impl Row {
    fn markdown(&self) -> String {
        let (payload, bound) = payload_and_bound(self.body);
        let opt = |v: Option<f64>, digits: usize| {
            v.map_or_else(|| "–".to_owned(), |v| format!("{v:.digits$}"))
        };
        let n = if self.stored == self.n {
            format!("{}", self.n)
        } else {
            format!("{} (of {} asked; time limit)", self.stored, self.n)
        };
        let bound_f = bound as f64;
        let mut over = Vec::new();
        if self.per_record > bound_f {
            over.push("bytes/record");
        }
        if self.rss.is_some_and(|v| v > bound_f) && self.store == "MemoryStore" {
            over.push("RSS");
        }
        if self.weight.is_some_and(|v| v > bound_f) {
            over.push("weight");
        }
        let within = if over.is_empty() {
            "yes".to_owned()
        } else {
            format!("**no** ({} over)", over.join(", "))
        };
        format!(
            concat!(
                "| {} | {} B | {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | ",
                "{:.2} s | {} |"
            ),
            self.store,
            self.body,
            n,
            payload,
            bound,
            self.per_record,
            opt(self.with_malloc, 0),
            opt(self.allocs, 2),
            opt(self.rss, 0),
            opt(self.weight, 0),
            if self.other.is_empty() {
                "–"
            } else {
                &self.other
            },
            self.secs,
            within,
        )
    }
}

// ---------------------------------------------------------------------------------------
// MemoryStore, in child processes
// ---------------------------------------------------------------------------------------

/// What a child measured, in bytes (totals, not per record).
struct ChildOut {
    heap: f64,
    allocs: f64,
    rss: f64,
    cached_bytes: f64,
    len: f64,
    secs: f64,
}

fn memory_row(body: usize, n: usize) -> Res<Row> {
    let out = run_child(body, n, 1 << 42)?;
    if out.len as usize != n {
        return Err(format!("memory child kept {} of {n} records", out.len).into());
    }
    let per = |v: f64| v / n as f64;
    Ok(Row {
        store: "MemoryStore",
        body,
        n,
        stored: n,
        per_record: per(out.heap),
        with_malloc: Some(per(out.heap + MALLOC_SLACK * out.allocs)),
        allocs: Some(per(out.allocs)),
        rss: Some(per(out.rss)),
        weight: Some(out.cached_bytes / out.len),
        other: String::new(),
        secs: out.secs,
    })
}

/// Runs this executable again as a child that fills a fresh `MemoryStore`.
fn run_child(body: usize, n: usize, max_bytes: u64) -> Res<ChildOut> {
    let out = std::process::Command::new(std::env::current_exe()?)
        .env(CHILD, format!("{body}:{n}:{max_bytes}"))
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "memory child failed ({}): {text} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let v: Vec<f64> = text
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("memory child said {text:?}: {e}"))?;
    let [heap, allocs, rss, cached_bytes, len, secs] = v[..] else {
        return Err(format!("memory child said {text:?}").into());
    };
    Ok(ChildOut {
        heap,
        allocs,
        rss,
        cached_bytes,
        len,
        secs,
    })
}

/// The child: fills a fresh store and prints the live heap growth, the allocation
/// count growth, the RSS growth, `cached_bytes`, `cached_len` and the fill's seconds.
fn child(spec: &str) -> Res<()> {
    let parts: Vec<u64> = spec
        .split(':')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{CHILD}={spec}: {e}"))?;
    let [body, n, max_bytes] = parts[..] else {
        return Err(format!("{CHILD}={spec}").into());
    };
    let (body, n) = (usize::try_from(body)?, usize::try_from(n)?);
    let record = completed(body);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let store = MemoryStore::new().max_bytes(max_bytes).build()?;
        // Everything the fill leaves behind but the store's records is transient: the
        // keys and ids are made and dropped one at a time.
        let _ = store.cached_len();
        let rss0 = rss_bytes()?;
        let region = Region::new(GLOBAL);
        let started = Instant::now();
        for i in 0..n {
            store_one(&store, &record_id(0x5eed, i)?, &record).await?;
        }
        let len = store.cached_len();
        let secs = started.elapsed().as_secs_f64();
        let change = region.change();
        let rss1 = rss_bytes()?;
        let cached_bytes = store.cached_bytes();
        // `stats_alloc` counts a reallocation's growth or shrinkage in these two.
        let heap = change.bytes_allocated as f64 - change.bytes_deallocated as f64;
        let allocs = change.allocations as f64 - change.deallocations as f64;
        println!(
            "{heap} {allocs} {} {cached_bytes} {len} {secs}",
            rss1 as f64 - rss0 as f64
        );
        Ok(())
    })
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

// ---------------------------------------------------------------------------------------
// Redis
// ---------------------------------------------------------------------------------------

struct RedisEnv {
    admin: ConnectionManager,
    store: RedisStore,
    prefix: String,
}

fn info_field(info: &str, name: &str) -> Option<f64> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
}

async fn redis_manager(url: &str) -> Res<ConnectionManager> {
    let client = redis::Client::open(url)?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(None);
    ConnectionManager::new_with_config(client, config)
        .await
        .map_err(|e| {
            format!(
                "cannot reach Redis at REDIS_URL={url}: {e} (start redis-server or set \
                 REDIS_URL)"
            )
            .into()
        })
}

impl RedisEnv {
    async fn setup() -> Res<Self> {
        let url =
            std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
        let admin = redis_manager(&url).await?;
        // As long as the default `retrysafe:`, so keys weigh what they would.
        let prefix = format!("rsm{}:", &Token::random().to_hex()[..6]);
        let store = RedisStore::options()
            .key_prefix(prefix.clone())
            .call_timeout(Duration::from_secs(30))
            .build(redis_manager(&url).await?)
            .await?;
        Ok(RedisEnv {
            admin,
            store,
            prefix,
        })
    }

    async fn memory(&self) -> Res<(f64, f64)> {
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut self.admin.clone())
            .await?;
        let field = |name| info_field(&info, name).ok_or(format!("INFO memory: no {name}"));
        Ok((field("used_memory")?, field("used_memory_rss")?))
    }

    async fn row(&self, body: usize, n: usize) -> Res<Row> {
        let record = completed(body);
        let tag = 0x7ed1_5000 + u32::try_from(body)?;
        let (used0, rss0) = self.memory().await?;
        let started = Instant::now();
        let deadline = started + Duration::from_secs(env_or("MEMORY_BENCH_FILL_SECS", 300));
        let stored = fill(
            &self.store,
            tag,
            n,
            &record,
            env_or("MEMORY_BENCH_TASKS", 64),
            deadline,
        )
        .await?;
        let secs = started.elapsed().as_secs_f64();
        let (used1, rss1) = self.memory().await?;
        // MEMORY USAGE of sample keys spread over the fill.
        let samples = 100.min(stored);
        let mut usage = 0.0;
        for s in 0..samples {
            let key = self.store.key(&record_id(tag, s * stored / samples)?);
            let bytes: Option<i64> = redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(&key)
                .arg("SAMPLES")
                .arg(0)
                .query_async(&mut self.admin.clone())
                .await?;
            usage += bytes.ok_or_else(|| format!("MEMORY USAGE {key}: no such key"))? as f64;
        }
        let per = |v: f64| v / stored as f64;
        Ok(Row {
            store: "RedisStore",
            body,
            n,
            stored,
            per_record: per(used1 - used0),
            with_malloc: None,
            allocs: None,
            // The server's RSS does not shrink when keys are deleted (its allocator keeps
            // the pages for reuse), so its growth says nothing after an earlier fill:
            // shown beside, not compared.
            rss: None,
            weight: None,
            other: format!(
                "`MEMORY USAGE` {:.0}; server RSS growth {:.0}",
                usage / samples.max(1) as f64,
                per(rss1 - rss0)
            ),
            secs,
        })
    }

    /// Deletes every key of this run (synchronously: `DEL`, so that the next fill's
    /// `used_memory` baseline is not still shrinking).
    async fn clear(&self) -> Res<()> {
        let mut conn = self.admin.clone();
        let mut cursor = 0u64;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{}*", self.prefix))
                .arg("COUNT")
                .arg(10_000)
                .query_async(&mut conn)
                .await?;
            if !keys.is_empty() {
                let _: i64 = redis::cmd("DEL").arg(&keys).query_async(&mut conn).await?;
            }
            if next == 0 {
                return Ok(());
            }
            cursor = next;
        }
    }
}

// ---------------------------------------------------------------------------------------
// PostgreSQL
// ---------------------------------------------------------------------------------------

struct PgEnv {
    admin: PgPool,
    options: PgConnectOptions,
    schema: String,
}

impl PgEnv {
    async fn setup() -> Res<Self> {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let options = PgConnectOptions::from_str(&url)?;
        let admin = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options.clone())
            .await
            .map_err(|e| {
                format!(
                    "cannot reach PostgreSQL at DATABASE_URL={url}: {e} (start it or set \
                     DATABASE_URL)"
                )
            })?;
        let schema = format!("rsmem_{}_{}", unix_secs(), &Token::random().to_hex()[..8]);
        sqlx::raw_sql(&format!("CREATE SCHEMA {schema}"))
            .execute(&admin)
            .await?;
        Ok(PgEnv {
            admin,
            // Durability does not change what is stored, and a million durable commits
            // would not fit the time box.
            options: options.options([("synchronous_commit", "off")]),
            schema,
        })
    }

    async fn sizes(&self, table: &str) -> Res<(i64, i64, i64)> {
        Ok(sqlx::query_as(
            "SELECT pg_total_relation_size($1::text::regclass), \
             pg_relation_size($1::text::regclass), pg_indexes_size($1::text::regclass)",
        )
        .bind(table)
        .fetch_one(&self.admin)
        .await?)
    }

    async fn row(&self, body: usize, n: usize) -> Res<Row> {
        let record = completed(body);
        let store = PostgresStore::options()
            .schema(self.schema.clone())
            .table(format!("records_{body}_{n}"))
            .max_connections(env_or("MEMORY_BENCH_PG_CONNECTIONS", 32))
            .call_timeout(Duration::from_secs(30))
            .connect_with(self.options.clone())
            .await?;
        store.migrate().await?;
        let table = store.table().to_owned();
        let (empty, _, _) = self.sizes(&table).await?;
        let started = Instant::now();
        let deadline = started + Duration::from_secs(env_or("MEMORY_BENCH_FILL_SECS", 300));
        let stored = fill(
            &store,
            0x9a5e_0000,
            n,
            &record,
            env_or("MEMORY_BENCH_TASKS", 64),
            deadline,
        )
        .await;
        let secs = started.elapsed().as_secs_f64();
        store.pool().close().await;
        let stored = stored?;
        let (total, heap, indexes) = self.sizes(&table).await?;
        // Heap pages holding at least one row version, against all of them: a fill by
        // many connections makes PostgreSQL extend the table by many pages at a time
        // under contention, and pages it never uses count in the size.
        let (used, pages): (i64, i64) = sqlx::query_as(&format!(
            "SELECT count(DISTINCT (ctid::text::point)[0])::int8, \
             (pg_relation_size('{table}'::regclass) / current_setting('block_size')::int8) \
             FROM {table}"
        ))
        .fetch_one(&self.admin)
        .await?;
        sqlx::raw_sql(&format!("DROP TABLE {table}"))
            .execute(&self.admin)
            .await?;
        let per = |v: i64| v as f64 / stored as f64;
        Ok(Row {
            store: "PostgresStore",
            body,
            n,
            stored,
            per_record: per(total - empty),
            with_malloc: None,
            allocs: None,
            rss: None,
            weight: None,
            other: format!(
                "heap {:.0} + indexes {:.0}; heap pages used {used} of {pages}",
                per(heap),
                per(indexes)
            ),
            secs,
        })
    }

    async fn teardown(&self) -> Res<()> {
        sqlx::raw_sql(&format!("DROP SCHEMA {} CASCADE", self.schema))
            .execute(&self.admin)
            .await?;
        self.admin.close().await;
        Ok(())
    }
}
