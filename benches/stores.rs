//! What the idempotency stores cost over loopback HTTP, counted and timed against real
//! Redis and PostgreSQL servers: round trips per guarded request, latency and
//! throughput next to the bare app and to one store round trip measured in the same
//! run, and the bytes a stored record takes.
//!
//! One axum app (a POST handler answering 201 with a 100-byte JSON body, and the same
//! authentication layer inserting a `Principal` in front of every case) is served in
//! process on 127.0.0.1 once per case:
//!
//! - `bare`: no idempotency layer;
//! - `memory`: `IdempotencyLayer` over `MemoryStore` (defaults);
//! - `redis`: `IdempotencyLayer` over `RedisStore` (its own `ConnectionManager`);
//! - `postgres`: `IdempotencyLayer` over `PostgresStore` (its own pool, defaults:
//!   10 connections);
//! - `postgres-tx`: the transactional layer,
//!   `TxIdempotencyLayer::with_backend(TxBackend::from_store(..))`, over another
//!   `PostgresStore` (its own pool, defaults); the handler does not use the transaction.
//!
//! Each guarded case runs as `first` (a new key for every request: claim, handler,
//! complete) and `replay` (every client repeats its own completed key, which the
//! client stores again in the warm-up should the MemoryStore have evicted it). Clients
//! are hyper HTTP/1.1 connections (keep-alive, `TCP_NODELAY`), one per client, in the same
//! process and tokio runtime (2 worker threads; `STORE_BENCH_WORKERS=1` runs everything
//! on one current-thread runtime) as the servers. Every answer is checked
//! (status, body, `idempotent-replayed`); a wrong one counts as an error and is shown.
//!
//! Phases, in this order:
//!
//! 1. **Bytes per stored record**: a record stored through the layer (bodies of 100 B,
//!    1 KiB and 16 KiB of incompressible text, a 36-character key), measured as its
//!    `Record::encoded_len`, the `MemoryStore`'s weight and the RSS growth per record of
//!    a fresh child process filling a `MemoryStore`, Redis `MEMORY USAGE` and
//!    `used_memory` growth per record, and PostgreSQL `pg_column_size(row)` and
//!    table-plus-index growth per record, next to the bound
//!    2 × payload + 256 (payload = body + stored header bytes + key).
//! 2. **Round trips per guarded request**, counted exactly: Redis commands sent through
//!    a counting `ConnectionLike` wrapper (cross-checked with `INFO commandstats`
//!    deltas, which other clients of the same server can inflate); PostgreSQL frontend
//!    messages seen by a counting TCP proxy (statements, prepares, simple queries,
//!    pings), with the server's writing transactions (transaction ids assigned) and WAL
//!    bytes over each row. For 1 client and for 32, `first` and `replay`, after a
//!    warm-up.
//! 3. **Latency and throughput**, `STORE_BENCH_ROUNDS` alternated rounds (the order of
//!    the cases rotates each round). In each round: every case with 1 client for
//!    `STORE_BENCH_LATENCY_SECS` (the clean latency), then with `STORE_BENCH_CLIENTS`
//!    clients for `STORE_BENCH_SECS` (throughput), each after `STORE_BENCH_WARMUP_MS`
//!    of warm-up. The store's own round trip is measured as more cases of the same
//!    phase: Redis `PING` on the redis case's connection type, PostgreSQL `SELECT 1` on
//!    the postgres case's pool, and, since every PostgreSQL write waits for a WAL
//!    flush, one autocommit `INSERT` on that pool (a round trip with a durable commit).
//!
//! Redis keys live under a random 10-character prefix (as long as the default
//! `retrysafe:`), PostgreSQL tables in a schema `rsbench_<unix time>_<random>`; both are
//! removed at the end (schemas left by a crashed run are dropped after an hour; Redis
//! keys expire after the 1 h retention the bench configures).
//!
//! `cargo bench --bench stores` (or `scripts/bench-stores`), with Redis at `REDIS_URL`
//! (default `redis://127.0.0.1:6379`) and PostgreSQL at `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`).
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout, // the bench's output is its tables
    missing_docs
)]

use std::collections::HashMap;
use std::error::Error;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::http::header::{CONTENT_TYPE, HOST, HeaderName};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::serve::ListenerExt;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use retrysafe::idempotency::{IdempotencyLayer, MemoryStore, Principal, RecordId, Scope};
use retrysafe_core::idempotency::{CommitPoint, Completed, Record, Token};
use retrysafe_core::recovery::{PendingRecord, ReconcilableStore, Resolution, Resolver};
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore};
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_postgres::PostgresStore;
use retrysafe_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use retrysafe_postgres::sqlx::{self, PgPool};
use retrysafe_postgres::tx::{TxBackend, TxIdempotencyLayer};
use retrysafe_redis::RedisStore;
use retrysafe_redis::redis;
use retrysafe_redis::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use retrysafe_redis::test_util::CountingConnection;
use retrysafe_test_support::bench::body::blob_body;
use retrysafe_test_support::bench::http1::{Sender, open_http};
use retrysafe_test_support::bench::load::*;
use retrysafe_test_support::proxy::postgres::PgProxy;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::util::MapRequestLayer;

type BoxError = Box<dyn Error + Send + Sync>;
type Res<T> = Result<T, BoxError>;

/// The handler's answer: 100 bytes of JSON.
const RESPONSE_JSON: &str = r#"{"id":"pay_0123456789abcde","status":"accepted","amount":1000,"currency":"EUR","created":1767225600}"#;

/// A 64-byte request body.
const REQUEST_JSON: &str = r#"{"amount":1000,"currency":"EUR","reference":"order-00000000042"}"#;

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The principal every request is authenticated as.
const TENANT: &str = "tenant-1";

/// The retention the layers use: long enough for the run, short enough that keys a
/// crashed run leaves in Redis go by themselves.
const RETENTION: Duration = Duration::from_secs(60 * 60);

/// The bound on one request (or store ping) of the load driver.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the PostgreSQL pools get to finish the pings they send as connections go
/// back to the pool, before the proxy's counts are read.
const POOL_SETTLE: Duration = Duration::from_millis(300);

/// Prefix of the PostgreSQL schemas the bench creates.
const SCHEMA_PREFIX: &str = "rsbench_";

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
    let workers = env_usize("STORE_BENCH_WORKERS", 2)?;
    let runtime = if workers == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()?
    };
    runtime.block_on(run())
}

async fn run() -> Res<()> {
    let settings = Settings::from_env()?;
    let env = Env::setup().await?;
    let result = bench(&settings, &env).await;
    env.cleanup().await;
    result
}

async fn bench(settings: &Settings, env: &Env) -> Res<()> {
    println!("# Store benchmarks (`benches/stores.rs`)\n");
    println!("{}\n", settings.describe());
    println!("{}\n", env.describe().await?);
    let servers = Servers::start(env).await?;
    record_sizes(env, &servers).await?;
    count_round_trips(settings, env).await?;
    load_rounds(settings, &servers).await?;
    println!("\nload average at the end: {}", loadavg());
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Settings and environment
// ---------------------------------------------------------------------------------------

#[derive(Debug)]
struct Settings {
    rounds: usize,
    secs: Duration,
    latency_secs: Duration,
    warmup: Duration,
    clients: usize,
    count_requests: usize,
}

fn env_u64(name: &str, default: u64) -> Res<u64> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map_err(|e| format!("{name}={v} is not a whole number: {e}").into()),
        Err(_) => Ok(default),
    }
}

fn env_usize(name: &str, default: usize) -> Res<usize> {
    let v = env_u64(name, u64::try_from(default)?)?;
    Ok(usize::try_from(v)?)
}

impl Settings {
    fn from_env() -> Res<Self> {
        let s = Settings {
            rounds: env_usize("STORE_BENCH_ROUNDS", 3)?,
            secs: Duration::from_secs(env_u64("STORE_BENCH_SECS", 5)?),
            latency_secs: Duration::from_secs(env_u64("STORE_BENCH_LATENCY_SECS", 2)?),
            warmup: Duration::from_millis(env_u64("STORE_BENCH_WARMUP_MS", 500)?),
            clients: env_usize("STORE_BENCH_CLIENTS", 32)?,
            count_requests: env_usize("STORE_BENCH_COUNT_REQUESTS", 640)?,
        };
        if s.rounds == 0 || s.clients == 0 || s.secs.is_zero() || s.latency_secs.is_zero() {
            return Err("STORE_BENCH_ROUNDS, _CLIENTS, _SECS and _LATENCY_SECS must be > 0".into());
        }
        Ok(s)
    }

    fn describe(&self) -> String {
        format!(
            "settings: {} rounds; per round and case {} s with 1 client, then {} s with {} \
             clients, each after {} ms of warm-up; round trips counted over {} requests \
             per row; tokio runtime: {}",
            self.rounds,
            self.latency_secs.as_secs(),
            self.secs.as_secs(),
            self.clients,
            self.warmup.as_millis(),
            self.count_requests,
            match std::env::var("STORE_BENCH_WORKERS").ok().as_deref() {
                Some("1") => "current-thread".to_owned(),
                Some(n) => format!("multi-thread, {n} workers"),
                None => "multi-thread, 2 workers".to_owned(),
            }
        )
    }
}

struct Env {
    redis_url: String,
    database_url: String,
    pg_options: PgConnectOptions,
    /// Redis key prefix of this run (10 characters, as long as `retrysafe:`).
    prefix: String,
    /// PostgreSQL schema of this run.
    schema: String,
    redis: ConnectionManager,
    pg: PgPool,
}

fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A Redis connection manager without a response timeout of its own (the store's call
/// timeout decides), as the store's own `connect` builds it.
async fn redis_manager(url: &str) -> Res<ConnectionManager> {
    let client =
        redis::Client::open(url).map_err(|e| format!("REDIS_URL={url} is not a Redis URL: {e}"))?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(None)
        .set_number_of_retries(2);
    match tokio::time::timeout(
        Duration::from_secs(10),
        ConnectionManager::new_with_config(client, config),
    )
    .await
    {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(format!(
            "cannot reach Redis at REDIS_URL={url}: {e}. Start redis-server (scripts/test \
             starts it) or point REDIS_URL at a running server."
        )
        .into()),
        Err(_) => Err(format!("timed out connecting to Redis at REDIS_URL={url}").into()),
    }
}

impl Env {
    async fn setup() -> Res<Self> {
        let redis_url = redis_url();
        let database_url = database_url();
        let redis = redis_manager(&redis_url).await?;
        let pg_options = PgConnectOptions::from_str(&database_url)
            .map_err(|e| format!("DATABASE_URL={database_url} is not a PostgreSQL URL: {e}"))?;
        let pg = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(pg_options.clone())
            .await
            .map_err(|e| {
                format!(
                    "cannot reach PostgreSQL at DATABASE_URL={database_url}: {e}. Start it \
                     (scripts/test starts it) or point DATABASE_URL at a running server."
                )
            })?;
        let tag = Token::random().to_hex();
        let env = Env {
            prefix: format!("rsb{}:", &tag[..6]),
            schema: format!("{SCHEMA_PREFIX}{}_{}", unix_secs(), &tag[6..18]),
            redis_url,
            database_url,
            pg_options,
            redis,
            pg,
        };
        env.drop_stale_schemas().await?;
        sqlx::raw_sql(&format!("CREATE SCHEMA {}", env.schema))
            .execute(&env.pg)
            .await?;
        Ok(env)
    }

    /// Drops schemas of earlier runs older than an hour (a run that crashed).
    async fn drop_stale_schemas(&self) -> Res<()> {
        let names: Vec<String> = sqlx::query_scalar(
            "SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'rsbench\\_%'",
        )
        .fetch_all(&self.pg)
        .await?;
        let now = unix_secs();
        for name in names {
            let secs = name
                .strip_prefix(SCHEMA_PREFIX)
                .and_then(|rest| rest.split('_').next())
                .and_then(|s| s.parse::<u64>().ok());
            if secs.is_some_and(|s| s + 3600 < now) {
                sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS {name} CASCADE"))
                    .execute(&self.pg)
                    .await?;
            }
        }
        Ok(())
    }

    /// Removes the run's Redis keys and PostgreSQL schema; reports, never fails.
    async fn cleanup(&self) {
        let mut conn = self.redis.clone();
        let mut cursor: u64 = 0;
        let mut removed = 0usize;
        loop {
            let page: redis::RedisResult<(u64, Vec<String>)> = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{}*", self.prefix))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await;
            let Ok((next, keys)) = page else {
                eprintln!(
                    "cleanup: SCAN failed; keys under {} expire in 1 h",
                    self.prefix
                );
                break;
            };
            if !keys.is_empty() {
                removed += keys.len();
                let _: redis::RedisResult<i64> =
                    redis::cmd("UNLINK").arg(&keys).query_async(&mut conn).await;
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        let dropped = sqlx::raw_sql(&format!(
            "SET lock_timeout = '10s'; DROP SCHEMA IF EXISTS {} CASCADE",
            self.schema
        ))
        .execute(&self.pg)
        .await;
        eprintln!(
            "cleanup: {removed} Redis keys under {} removed; schema {} {}",
            self.prefix,
            self.schema,
            if dropped.is_ok() {
                "dropped"
            } else {
                "NOT dropped (dropped by the next run after an hour)"
            }
        );
        self.pg.close().await;
    }

    async fn describe(&self) -> Res<String> {
        let mut conn = self.redis.clone();
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut conn)
            .await?;
        let version = info_field(&info, "redis_version").unwrap_or_default();
        let mut config = Vec::new();
        for name in ["appendonly", "save", "maxmemory-policy"] {
            let kv: Vec<String> = redis::cmd("CONFIG")
                .arg("GET")
                .arg(name)
                .query_async(&mut conn)
                .await
                .unwrap_or_default();
            config.push(format!(
                "{name}={:?}",
                kv.get(1).cloned().unwrap_or_default()
            ));
        }
        let pg_version: String = sqlx::query_scalar("SHOW server_version")
            .fetch_one(&self.pg)
            .await?;
        let settings: Vec<(String, String)> = sqlx::query_as(
            "SELECT name, setting FROM pg_settings WHERE name IN \
             ('fsync', 'synchronous_commit', 'shared_buffers', 'max_connections') ORDER BY name",
        )
        .fetch_all(&self.pg)
        .await?;
        let settings: Vec<String> = settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
        Ok(format!(
            "servers: Redis {version} at {} ({}); PostgreSQL {pg_version} at {} ({}); \
             key prefix `{}`, schema `{}`; load average at the start: {}",
            self.redis_url,
            config.join(", "),
            self.database_url,
            settings.join(", "),
            self.prefix,
            self.schema,
            loadavg()
        ))
    }

    /// A `PostgresStore` on `table` of the run's schema (migrated), with the builder's
    /// defaults (10 connections, 1 s call timeout) unless `max` is given.
    async fn pg_store(
        &self,
        table: &str,
        options: PgConnectOptions,
        max: Option<u32>,
    ) -> Res<PostgresStore> {
        let mut settings = PostgresStore::options()
            .schema(self.schema.clone())
            .table(table);
        if let Some(max) = max {
            settings = settings.max_connections(max);
        }
        let store = settings.connect_with(options).await?;
        store.migrate().await?;
        Ok(store)
    }

    async fn redis_store(&self) -> Res<RedisStore> {
        Ok(RedisStore::options()
            .key_prefix(self.prefix.clone())
            .build(redis_manager(&self.redis_url).await?)
            .await?)
    }
}

fn info_field(info: &str, name: &str) -> Option<String> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
}

/// The CPU readings that count this process, `redis-server` and `postgres` as ours.
fn cpu_ticks() -> Option<Ticks> {
    ticks_named(&["redis-server", "postgres"])
}

/// The share of the machine's CPUs that other processes used since `since` (from
/// [`cpu_ticks`]), in percent.
fn foreign_cpu(since: Option<Ticks>) -> String {
    let share = others(since, cpu_ticks(), 0);
    if share.is_nan() {
        "?".to_owned()
    } else {
        format!("{share:.0} %")
    }
}

/// The time of day, UTC, `hh:mm:ss`.
fn utc_time() -> String {
    let secs = unix_secs() % 86_400;
    format!("{:02}:{:02}:{:02}", secs / 3600, secs / 60 % 60, secs % 60)
}

// ---------------------------------------------------------------------------------------
// The app and its servers
// ---------------------------------------------------------------------------------------

async fn create() -> (StatusCode, [(HeaderName, &'static str); 1], &'static str) {
    (
        StatusCode::CREATED,
        [(CONTENT_TYPE, "application/json")],
        RESPONSE_JSON,
    )
}

/// 201 with a JSON body of exactly `n` bytes of incompressible text (at least 8).
async fn blob(Path(n): Path<usize>) -> (StatusCode, [(HeaderName, &'static str); 1], Bytes) {
    (
        StatusCode::CREATED,
        [(CONTENT_TYPE, "application/json")],
        blob_body(n),
    )
}

enum Guard {
    None,
    Layer(IdempotencyLayer),
    Tx(TxIdempotencyLayer),
}

/// The routes, with the authentication layer outermost and the guard inside it.
fn router(guard: Guard) -> Router {
    let routes = Router::new()
        .route("/payments", post(create))
        .route("/blob/{n}", post(blob));
    let routes = match guard {
        Guard::None => routes,
        Guard::Layer(layer) => routes.layer(layer),
        Guard::Tx(layer) => routes.layer(layer),
    };
    let principal = Principal::new(TENANT);
    routes.layer(MapRequestLayer::new(move |mut req: Request<Body>| {
        req.extensions_mut().insert(principal.clone());
        req
    }))
}

fn layer(store: impl IdempotencyStore) -> Res<Guard> {
    Ok(Guard::Layer(
        IdempotencyLayer::new(store).retention(RETENTION).build()?,
    ))
}

fn tx_layer(store: &PostgresStore) -> Res<Guard> {
    Ok(Guard::Tx(
        TxIdempotencyLayer::with_backend(TxBackend::from_store(store))
            .retention(RETENTION)
            .build()?,
    ))
}

/// Serves `router` on a fresh loopback port, with `TCP_NODELAY`.
async fn serve(router: Router) -> Res<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(addr)
}

/// The servers of the load phase, one per case, with their stores.
struct Servers {
    bare: SocketAddr,
    memory: SocketAddr,
    memory_store: MemoryStore,
    /// Records the memory case's store evicted before their retention ended.
    memory_evicted: Arc<AtomicU64>,
    redis: SocketAddr,
    redis_store: RedisStore,
    postgres: SocketAddr,
    postgres_store: PostgresStore,
    tx: SocketAddr,
    tx_store: PostgresStore,
    /// The SQL of the durable-commit probe.
    probe_insert: String,
}

impl Servers {
    async fn start(env: &Env) -> Res<Self> {
        // The defaults (64 MiB of records), counting early evictions.
        let memory_evicted = Arc::new(AtomicU64::new(0));
        let evicted = Arc::clone(&memory_evicted);
        let memory_store = MemoryStore::new()
            .on_evicted(move |_| {
                evicted.fetch_add(1, Ordering::Relaxed);
            })
            .build()?;
        let redis_store = env.redis_store().await?;
        let postgres_store = env
            .pg_store("records", env.pg_options.clone(), None)
            .await?;
        let tx_store = env
            .pg_store("tx_records", env.pg_options.clone(), None)
            .await?;
        let probe = format!("{}.probe", env.schema);
        sqlx::raw_sql(&format!("CREATE TABLE {probe} (n integer NOT NULL)"))
            .execute(&env.pg)
            .await?;
        Ok(Servers {
            probe_insert: format!("INSERT INTO {probe} (n) VALUES (1)"),
            bare: serve(router(Guard::None)).await?,
            memory: serve(router(layer(memory_store.clone())?)).await?,
            redis: serve(router(layer(redis_store.clone())?)).await?,
            postgres: serve(router(layer(postgres_store.clone())?)).await?,
            tx: serve(router(tx_layer(&tx_store)?)).await?,
            memory_store,
            memory_evicted,
            redis_store,
            postgres_store,
            tx_store,
        })
    }
}

// ---------------------------------------------------------------------------------------
// The HTTP client
// ---------------------------------------------------------------------------------------

struct Answer {
    status: StatusCode,
    replayed: bool,
    body: Bytes,
}

async fn post_once(sender: &mut Sender, path: &str, key: &str) -> Res<Answer> {
    let req = Request::post(path)
        .header(HOST, "127.0.0.1")
        .header(IDEMPOTENCY_KEY, key)
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from_static(REQUEST_JSON.as_bytes())))?;
    let exchange = async {
        sender.ready().await?;
        let res = sender.send_request(req).await?;
        let (parts, body) = res.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok::<_, BoxError>((parts, body))
    };
    let (parts, body) = tokio::time::timeout(REQUEST_TIMEOUT, exchange)
        .await
        .map_err(|_| "request timed out")??;
    Ok(Answer {
        status: parts.status,
        replayed: parts.headers.get(&REPLAYED).is_some_and(|v| v == "true"),
        body,
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// The handler ran: 201, the body, no `idempotent-replayed`.
    Ran,
    /// A replay: 201, the body, `idempotent-replayed: true`.
    Replayed,
    /// Either.
    Either,
}

fn check(answer: &Answer, expect: Expect, body: &[u8]) -> Result<(), String> {
    if answer.status != StatusCode::CREATED {
        let text = String::from_utf8_lossy(&answer.body);
        return Err(format!(
            "status {} ({})",
            answer.status,
            text.chars().take(160).collect::<String>()
        ));
    }
    if answer.body != body {
        return Err(format!("wrong body ({} bytes)", answer.body.len()));
    }
    match (expect, answer.replayed) {
        (Expect::Ran, true) => Err("replayed where the handler should have run".to_owned()),
        (Expect::Replayed, false) => Err("not replayed where a replay was due".to_owned()),
        _ => Ok(()),
    }
}

/// Keys that are new for every request of the run: 22 characters.
fn fresh_key(counter: &AtomicU64) -> String {
    format!("f-{:020}", counter.fetch_add(1, Ordering::Relaxed))
}

/// The key client `client` of case `tag` repeats in `replay`.
fn replay_key(tag: &str, client: usize) -> String {
    format!("r-{tag}-{client}")
}

/// `clients` connections sending `per_client` requests each, with keys
/// `{prefix}-{client}-{n}`, every answer checked; fails on the first wrong answer.
async fn burst(
    addr: SocketAddr,
    clients: usize,
    per_client: usize,
    prefix: &str,
    expect: Expect,
) -> Res<()> {
    let mut set = JoinSet::new();
    for client in 0..clients {
        let prefix = prefix.to_owned();
        set.spawn(async move {
            let mut sender = open_http(addr).await?;
            for n in 0..per_client {
                let key = format!("{prefix}-{client}-{n}");
                let answer = post_once(&mut sender, "/payments", &key).await?;
                check(&answer, expect, RESPONSE_JSON.as_bytes())
                    .map_err(|e| format!("{addr} key {key}: {e}"))?;
            }
            Ok::<_, BoxError>(())
        });
    }
    while let Some(done) = set.join_next().await {
        done??;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Phase 1: bytes per stored record
// ---------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------
// Phase 2: round trips per guarded request
// ---------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------
// Phase 3: latency and throughput
// ---------------------------------------------------------------------------------------

#[derive(Clone)]
enum Op {
    /// A POST through one of the servers.
    Http {
        addr: SocketAddr,
        replay: bool,
        tag: &'static str,
    },
    /// Redis `PING` on a connection of the redis case's type.
    RedisPing(ConnectionManager),
    /// PostgreSQL `SELECT 1` on the postgres case's pool.
    PgSelect1(PgPool),
    /// PostgreSQL: one autocommit `INSERT` (one durable commit) on the postgres case's
    /// pool; the SQL.
    PgInsert(PgPool, Arc<str>),
}

enum Conn {
    Http(Sender),
    Shared,
}

impl Op {
    async fn open(&self) -> Res<Conn> {
        match self {
            Op::Http { addr, .. } => Ok(Conn::Http(open_http(*addr).await?)),
            Op::RedisPing(_) | Op::PgSelect1(_) | Op::PgInsert(..) => Ok(Conn::Shared),
        }
    }

    async fn call(&self, conn: &mut Conn, client: usize, keys: &AtomicU64) -> Result<(), String> {
        match (self, conn) {
            (Op::Http { replay, tag, .. }, Conn::Http(sender)) => {
                let (key, expect) = if *replay {
                    (replay_key(tag, client), Expect::Replayed)
                } else {
                    (fresh_key(keys), Expect::Ran)
                };
                let answer = post_once(sender, "/payments", &key)
                    .await
                    .map_err(|e| e.to_string())?;
                check(&answer, expect, RESPONSE_JSON.as_bytes())
            }
            (Op::RedisPing(conn), _) => {
                let mut conn = conn.clone();
                let cmd = redis::cmd("PING");
                let ping = cmd.query_async::<String>(&mut conn);
                match tokio::time::timeout(REQUEST_TIMEOUT, ping).await {
                    Ok(Ok(pong)) if pong == "PONG" => Ok(()),
                    Ok(Ok(other)) => Err(format!("PING answered {other}")),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("PING timed out".to_owned()),
                }
            }
            (Op::PgSelect1(pool), _) => {
                let one = sqlx::query_scalar::<_, i32>("SELECT 1").fetch_one(pool);
                match tokio::time::timeout(REQUEST_TIMEOUT, one).await {
                    Ok(Ok(1)) => Ok(()),
                    Ok(Ok(other)) => Err(format!("SELECT 1 answered {other}")),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("SELECT 1 timed out".to_owned()),
                }
            }
            (Op::PgInsert(pool, sql), _) => {
                let insert = sqlx::query(sql).execute(pool);
                match tokio::time::timeout(REQUEST_TIMEOUT, insert).await {
                    Ok(Ok(done)) if done.rows_affected() == 1 => Ok(()),
                    Ok(Ok(done)) => Err(format!("INSERT affected {}", done.rows_affected())),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("INSERT timed out".to_owned()),
                }
            }
            (Op::Http { .. }, Conn::Shared) => Err("no HTTP connection".to_owned()),
        }
    }
}

struct Case {
    name: &'static str,
    op: Op,
    /// The cases whose p50 this case's overhead is expressed in.
    probes: &'static [&'static str],
}

const BARE: &str = "bare";
const REDIS_PING: &str = "redis PING";
const PG_SELECT1: &str = "postgres SELECT 1";
const PG_INSERT: &str = "postgres INSERT";
const REDIS_PROBES: &[&str] = &[REDIS_PING];
const PG_PROBES: &[&str] = &[PG_SELECT1, PG_INSERT];

fn cases(servers: &Servers) -> Vec<Case> {
    let http = |name, addr, replay, tag, probes| Case {
        name,
        op: Op::Http { addr, replay, tag },
        probes,
    };
    let pool = servers.postgres_store.pool().clone();
    vec![
        http(BARE, servers.bare, false, "bare", &[]),
        http("memory first", servers.memory, false, "memory", &[]),
        http("memory replay", servers.memory, true, "memory", &[]),
        http("redis first", servers.redis, false, "redis", REDIS_PROBES),
        http("redis replay", servers.redis, true, "redis", REDIS_PROBES),
        http("postgres first", servers.postgres, false, "pg", PG_PROBES),
        http("postgres replay", servers.postgres, true, "pg", PG_PROBES),
        http("postgres-tx first", servers.tx, false, "tx", PG_PROBES),
        http("postgres-tx replay", servers.tx, true, "tx", PG_PROBES),
        Case {
            name: REDIS_PING,
            op: Op::RedisPing(servers.redis_store.connection().clone()),
            probes: &[],
        },
        Case {
            name: PG_SELECT1,
            op: Op::PgSelect1(pool.clone()),
            probes: &[],
        },
        Case {
            name: PG_INSERT,
            op: Op::PgInsert(pool, Arc::from(servers.probe_insert.as_str())),
            probes: &[],
        },
    ]
}

#[derive(Debug, Clone, Default)]
struct Summary {
    ops: u64,
    errors: u64,
    first_error: Option<String>,
    rps: f64,
    p50_us: f64,
    p99_us: f64,
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The value at quantile `permille` / 1000 of sorted `v` (nearest rank), in µs.
fn quantile_us(v: &[u64], permille: usize) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = (permille * v.len()).div_ceil(1000).clamp(1, v.len());
    v[rank - 1] as f64 / 1_000.0
}

/// `clients` closed-loop clients run `op` for `warmup + measure`; the requests that
/// complete within the measured window count (throughput, latency quantiles). Errors
/// are counted at any time.
async fn drive(
    op: &Op,
    clients: usize,
    warmup: Duration,
    measure: Duration,
    keys: &Arc<AtomicU64>,
) -> Res<Summary> {
    let mut conns = Vec::with_capacity(clients);
    for _ in 0..clients {
        conns.push(op.open().await?);
    }
    let start = Instant::now() + warmup;
    let end = start + measure;
    let mut set = JoinSet::new();
    for (client, mut conn) in conns.into_iter().enumerate() {
        let op = op.clone();
        let keys = Arc::clone(keys);
        set.spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0u64;
            let mut first_error = None;
            // A replay client's key, stored again if it is gone (the MemoryStore evicts
            // under its byte bound during the `first` runs); in the warm-up.
            if let (
                Op::Http {
                    replay: true, tag, ..
                },
                Conn::Http(sender),
            ) = (&op, &mut conn)
            {
                let primed = match post_once(sender, "/payments", &replay_key(tag, client)).await {
                    Ok(answer) => check(&answer, Expect::Either, RESPONSE_JSON.as_bytes()),
                    Err(e) => Err(e.to_string()),
                };
                if let Err(e) = primed {
                    errors += 1;
                    first_error = Some(format!("priming the replay key: {e}"));
                }
            }
            loop {
                let t0 = Instant::now();
                if t0 >= end {
                    break;
                }
                let result = op.call(&mut conn, client, &keys).await;
                let t1 = Instant::now();
                match result {
                    Ok(()) => {
                        if t1 >= start && t1 < end {
                            latencies.push(nanos(t1 - t0));
                        }
                    }
                    Err(e) => {
                        errors += 1;
                        first_error.get_or_insert(e);
                        let closed = matches!(&conn, Conn::Http(s) if s.is_closed());
                        if closed {
                            match op.open().await {
                                Ok(c) => conn = c,
                                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                            }
                        }
                    }
                }
            }
            (latencies, errors, first_error)
        });
    }
    let mut all = Vec::new();
    let mut summary = Summary::default();
    while let Some(done) = set.join_next().await {
        let (latencies, errors, first_error) = done?;
        all.extend(latencies);
        summary.errors += errors;
        if summary.first_error.is_none() {
            summary.first_error = first_error;
        }
    }
    all.sort_unstable();
    summary.ops = u64::try_from(all.len())?;
    summary.rps = all.len() as f64 / measure.as_secs_f64();
    summary.p50_us = quantile_us(&all, 500);
    summary.p99_us = quantile_us(&all, 990);
    Ok(summary)
}

struct PhaseResults {
    title: String,
    clients: usize,
    /// Per case name, one summary per round.
    by_case: HashMap<&'static str, Vec<Summary>>,
    loads: Vec<String>,
}

async fn load_rounds(settings: &Settings, servers: &Servers) -> Res<()> {
    eprintln!("phase 3: latency and throughput");
    let cases = cases(servers);
    let keys = Arc::new(AtomicU64::new(0));
    // Every client's replay key, completed once.
    for case in &cases {
        if let Op::Http {
            addr,
            replay: true,
            tag,
        } = &case.op
        {
            let mut sender = open_http(*addr).await?;
            for client in 0..settings.clients {
                let key = replay_key(tag, client);
                let answer = post_once(&mut sender, "/payments", &key).await?;
                check(&answer, Expect::Either, RESPONSE_JSON.as_bytes())
                    .map_err(|e| format!("{}: {e}", case.name))?;
            }
        }
    }
    let mut phases = [
        PhaseResults {
            title: format!(
                "1 client, {} s per case and round: latency",
                settings.latency_secs.as_secs()
            ),
            clients: 1,
            by_case: HashMap::new(),
            loads: Vec::new(),
        },
        PhaseResults {
            title: format!(
                "{} clients, {} s per case and round: throughput",
                settings.clients,
                settings.secs.as_secs()
            ),
            clients: settings.clients,
            by_case: HashMap::new(),
            loads: Vec::new(),
        },
    ];
    for round in 0..settings.rounds {
        for phase in &mut phases {
            let load = loadavg();
            let time = utc_time();
            eprintln!(
                "round {} of {} at {time} UTC, {}: load {load}",
                round + 1,
                settings.rounds,
                phase.title
            );
            let ticks = cpu_ticks();
            let measure = if phase.clients == 1 {
                settings.latency_secs
            } else {
                settings.secs
            };
            for i in 0..cases.len() {
                let case = &cases[(i + round) % cases.len()];
                let summary =
                    drive(&case.op, phase.clients, settings.warmup, measure, &keys).await?;
                eprintln!(
                    "  {:<20} {:>9.0} req/s  p50 {:>8.1} µs  p99 {:>8.1} µs  errors {}",
                    case.name, summary.rps, summary.p50_us, summary.p99_us, summary.errors
                );
                phase.by_case.entry(case.name).or_default().push(summary);
            }
            let foreign = foreign_cpu(ticks);
            eprintln!("  other processes used {foreign} of the CPUs");
            phase.loads.push(format!(
                "{time} UTC, load {load}, other processes {foreign}"
            ));
        }
    }
    for phase in &phases {
        print_phase(phase, &cases);
    }
    println!(
        "\nThe memory case's store after the run: {} records cached ({} bytes by its \
         weigher, bound {}), {} in flight, {} evicted before their retention ended (the \
         `first` runs fill it to its bound; the replay runs store their keys again when \
         evicted, in the warm-up).",
        servers.memory_store.cached_len(),
        servers.memory_store.cached_bytes(),
        MemoryStore::DEFAULT_MAX_BYTES,
        servers.memory_store.in_flight_len(),
        servers.memory_evicted.load(Ordering::Relaxed),
    );
    Ok(())
}

fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if s.is_empty() {
        return f64::NAN;
    }
    s.sort_by(f64::total_cmp);
    let mid = s.len() / 2;
    if s.len() % 2 == 1 {
        s[mid]
    } else {
        (s[mid - 1] + s[mid]) / 2.0
    }
}

/// (max − min) / median, in percent.
fn spread(v: &[f64]) -> f64 {
    let max = v.iter().copied().fold(f64::MIN, f64::max);
    let min = v.iter().copied().fold(f64::MAX, f64::min);
    (max - min) / median(v) * 100.0
}

fn joined(v: &[f64], decimals: usize) -> String {
    v.iter()
        .map(|x| format!("{x:.decimals$}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

fn print_phase(phase: &PhaseResults, cases: &[Case]) {
    let get = |name: &str| phase.by_case.get(name).cloned().unwrap_or_default();
    let bare = get(BARE);
    println!("\n## {}\n", phase.title);
    println!(
        "Per round: start, load average (1/5/15 min) at the start (the bench itself keeps \
         about 3 threads busy), and the share of the CPUs that processes other than the \
         bench, `redis-server` and `postgres` used during the round: {}\n",
        phase.loads.join("; ")
    );
    println!(
        "| case | req/s (per round) | median | spread | ratio to `bare` (per round) | p50 µs \
         (per round) | p99 µs (per round) | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for case in cases {
        let runs = get(case.name);
        let rps: Vec<f64> = runs.iter().map(|s| s.rps).collect();
        let ratio: Vec<f64> = runs.iter().zip(&bare).map(|(s, b)| s.rps / b.rps).collect();
        let p50: Vec<f64> = runs.iter().map(|s| s.p50_us).collect();
        let p99: Vec<f64> = runs.iter().map(|s| s.p99_us).collect();
        let errors: u64 = runs.iter().map(|s| s.errors).sum();
        let first_error = runs
            .iter()
            .find_map(|s| s.first_error.clone())
            .map(|e| format!(" (first: {e})"))
            .unwrap_or_default();
        let ratio = if case.name == BARE || !matches!(case.op, Op::Http { .. }) {
            "—".to_owned()
        } else {
            joined(&ratio, 3)
        };
        println!(
            "| {} | {} | {:.0} | {:.1} % | {} | {} | {} | {errors}{first_error} |",
            case.name,
            joined(&rps, 0),
            median(&rps),
            spread(&rps),
            ratio,
            joined(&p50, 1),
            joined(&p99, 1),
        );
    }
    println!(
        "\nOverhead in store round trips: (p50 of the case − p50 of `bare`, same round) / \
         p50 of the probe (same phase, same round). `{REDIS_PING}` and `{PG_SELECT1}` are \
         one round trip; `{PG_INSERT}` is one autocommit insert: a round trip with a \
         durable commit.\n"
    );
    println!(
        "| case | p50 − `bare` p50, µs (per round) | probe | probe p50, µs (per round) | \
         multiple (per round) | median multiple |"
    );
    println!("|---|---|---|---|---|---|");
    for case in cases {
        if !matches!(case.op, Op::Http { .. }) || case.name == BARE {
            continue;
        }
        let runs = get(case.name);
        let over: Vec<f64> = runs
            .iter()
            .zip(&bare)
            .map(|(s, b)| s.p50_us - b.p50_us)
            .collect();
        if case.probes.is_empty() {
            println!("| {} | {} | — | — | — | — |", case.name, joined(&over, 1));
        }
        for probe in case.probes {
            let rtt: Vec<f64> = get(probe).iter().map(|s| s.p50_us).collect();
            let multiple: Vec<f64> = over.iter().zip(&rtt).map(|(o, r)| o / r).collect();
            println!(
                "| {} | {} | {probe} | {} | {} | {:.2} |",
                case.name,
                joined(&over, 1),
                joined(&rtt, 1),
                joined(&multiple, 2),
                median(&multiple),
            );
        }
    }
}
