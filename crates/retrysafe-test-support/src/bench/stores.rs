//! What the store benches share (`benches/stores_bytes.rs`, `stores_round_trips.rs`,
//! `stores_load.rs`): their settings, the Redis and PostgreSQL they run against (a key
//! prefix and a schema of the run's own, removed at the end), the app they serve once
//! per case, and a checked HTTP/1.1 client.
//!
//! One axum app (a POST handler answering 201 with a 100-byte JSON body, and the same
//! authentication layer inserting a `Principal` in front of every case) is served on
//! 127.0.0.1 once per case: `bare` (no idempotency layer), `memory`, `redis` and
//! `postgres` (an `IdempotencyLayer` over each store, with its own connections), and
//! `postgres-tx` (the transactional layer over another `PostgresStore`).

use std::error::Error;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::http::header::{CONTENT_TYPE, HOST, HeaderName};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::serve::ListenerExt;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use retrysafe_core::idempotency::Principal;
use retrysafe_core::idempotency::Token;
use retrysafe_core::store::IdempotencyStore;
use retrysafe_memory::MemoryStore;
use retrysafe_postgres::PostgresStore;
use retrysafe_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use retrysafe_postgres::sqlx::{self, PgPool};
use retrysafe_postgres::tx::{TxBackend, TxIdempotencyLayer};
use retrysafe_redis::RedisStore;
use retrysafe_redis::redis;
use retrysafe_redis::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use retrysafe_tower::idempotency::IdempotencyLayer;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tower::util::MapRequestLayer;

use super::body::blob_body;
use super::http1::{Sender, open_http};
use super::load::*;
use crate::services::{database_url, drop_stale_schemas, redis_url, unique};

/// Any error of a bench.
pub type BoxError = Box<dyn Error + Send + Sync>;
/// A bench's result.
pub type Res<T> = Result<T, BoxError>;

/// The handler's answer: 100 bytes of JSON.
pub const RESPONSE_JSON: &str = r#"{"id":"pay_0123456789abcde","status":"accepted","amount":1000,"currency":"EUR","created":1767225600}"#;

/// A 64-byte request body.
pub const REQUEST_JSON: &str =
    r#"{"amount":1000,"currency":"EUR","reference":"order-00000000042"}"#;

/// `idempotency-key`.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// `idempotent-replayed`.
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The principal every request is authenticated as.
pub const TENANT: &str = "tenant-1";

/// The retention the layers use: long enough for the run, short enough that keys a
/// crashed run leaves in Redis go by themselves.
pub const RETENTION: Duration = Duration::from_secs(60 * 60);

/// The bound on one request (or store ping) of the load driver.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Prefix of the PostgreSQL schemas the bench creates.
pub const SCHEMA_PREFIX: &str = "rsbench_";

/// Runs one program of the store benches: on the runtime `STORE_BENCH_WORKERS` asks
/// for (2 workers; 1 is a current-thread runtime), with the settings and a fresh
/// environment (described first, removed last), `phase` prints its tables.
#[allow(clippy::print_stdout, reason = "the benches' output is their tables")]
pub fn run(title: &str, phase: impl AsyncFnOnce(&Settings, &Env) -> Res<()>) -> Res<()> {
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
    runtime.block_on(async {
        let settings = Settings::from_env()?;
        let env = Env::setup().await?;
        println!("# Store benchmarks: {title}\n");
        println!("{}\n", settings.describe());
        let result = match env.describe().await {
            Ok(described) => {
                println!("{described}\n");
                phase(&settings, &env).await
            }
            Err(e) => Err(e),
        };
        println!("\nload average at the end: {}", loadavg());
        env.cleanup().await;
        result
    })
}

// ---------------------------------------------------------------------------------------
// Settings and environment
// ---------------------------------------------------------------------------------------

/// The settings of the store benches (environment, see `scripts/bench-stores`).
#[derive(Debug)]
pub struct Settings {
    /// `STORE_BENCH_ROUNDS`: alternated rounds of the load phase.
    pub rounds: usize,
    /// `STORE_BENCH_SECS`: per case with [`clients`](Self::clients) clients.
    pub secs: Duration,
    /// `STORE_BENCH_LATENCY_SECS`: per case with 1 client.
    pub latency_secs: Duration,
    /// `STORE_BENCH_WARMUP_MS`: before each measurement.
    pub warmup: Duration,
    /// `STORE_BENCH_CLIENTS`: the clients of the throughput measurement.
    pub clients: usize,
    /// `STORE_BENCH_COUNT_REQUESTS`: requests per row of the round-trip counts.
    pub count_requests: usize,
}

/// A whole number from the environment variable `name`, or `default`.
pub fn env_u64(name: &str, default: u64) -> Res<u64> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map_err(|e| format!("{name}={v} is not a whole number: {e}").into()),
        Err(_) => Ok(default),
    }
}

/// Like [`env_u64`], as a `usize`.
pub fn env_usize(name: &str, default: usize) -> Res<usize> {
    let v = env_u64(name, u64::try_from(default)?)?;
    Ok(usize::try_from(v)?)
}

impl Settings {
    /// The settings the environment asks for; an error names a bad one.
    pub fn from_env() -> Res<Self> {
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

    /// The settings, as the line the tables start with.
    pub fn describe(&self) -> String {
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

/// The Redis and PostgreSQL of a run, with the key prefix and the schema of its own.
#[derive(Debug)]
pub struct Env {
    /// `REDIS_URL`.
    pub redis_url: String,
    /// `DATABASE_URL`.
    pub database_url: String,
    /// The options of `DATABASE_URL`.
    pub pg_options: PgConnectOptions,
    /// Redis key prefix of this run (10 characters, as long as `retrysafe:`).
    pub prefix: String,
    /// PostgreSQL schema of this run.
    pub schema: String,
    /// A connection of the run's own.
    pub redis: ConnectionManager,
    /// A pool of the run's own (2 connections).
    pub pg: PgPool,
}

/// A Redis connection manager without a response timeout of its own (the store's call
/// timeout decides), as the store's own `connect` builds it.
pub async fn redis_manager(url: &str) -> Res<ConnectionManager> {
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
    /// Connects to both servers and creates the run's schema.
    pub async fn setup() -> Res<Self> {
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
            schema: format!("{SCHEMA_PREFIX}{}", unique()),
            redis_url,
            database_url,
            pg_options,
            redis,
            pg,
        };
        drop_stale_schemas(SCHEMA_PREFIX).await;
        sqlx::raw_sql(&format!("CREATE SCHEMA {}", env.schema))
            .execute(&env.pg)
            .await?;
        Ok(env)
    }

    /// Removes the run's Redis keys and PostgreSQL schema; reports, never fails.
    pub async fn cleanup(&self) {
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

    /// The servers, their versions and settings, as a line of the report.
    pub async fn describe(&self) -> Res<String> {
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
    pub async fn pg_store(
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

    /// A `RedisStore` under the run's key prefix, on a connection of its own.
    pub async fn redis_store(&self) -> Res<RedisStore> {
        Ok(RedisStore::options()
            .key_prefix(self.prefix.clone())
            .build(redis_manager(&self.redis_url).await?)
            .await?)
    }
}

/// The value of field `name` in Redis `INFO` text.
pub fn info_field(info: &str, name: &str) -> Option<String> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
}

// ---------------------------------------------------------------------------------------
// The app and its servers
// ---------------------------------------------------------------------------------------

/// The handler of `POST /payments`: 201 with [`RESPONSE_JSON`].
pub async fn create() -> (StatusCode, [(HeaderName, &'static str); 1], &'static str) {
    (
        StatusCode::CREATED,
        [(CONTENT_TYPE, "application/json")],
        RESPONSE_JSON,
    )
}

/// 201 with a JSON body of exactly `n` bytes of incompressible text (at least 8).
pub async fn blob(Path(n): Path<usize>) -> (StatusCode, [(HeaderName, &'static str); 1], Bytes) {
    (
        StatusCode::CREATED,
        [(CONTENT_TYPE, "application/json")],
        blob_body(n),
    )
}

/// What guards a case's routes.
#[derive(Debug)]
pub enum Guard {
    /// Nothing (`bare`).
    None,
    /// An `IdempotencyLayer`.
    Layer(IdempotencyLayer),
    /// The transactional layer.
    Tx(TxIdempotencyLayer),
}

/// The routes, with the authentication layer outermost and the guard inside it.
pub fn router(guard: Guard) -> Router {
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

/// An `IdempotencyLayer` over `store`, with the run's retention.
pub fn layer(store: impl IdempotencyStore) -> Res<Guard> {
    Ok(Guard::Layer(
        IdempotencyLayer::new(store).retention(RETENTION).build()?,
    ))
}

/// The transactional layer over `store`, with the run's retention.
pub fn tx_layer(store: &PostgresStore) -> Res<Guard> {
    Ok(Guard::Tx(
        TxIdempotencyLayer::with_backend(TxBackend::from_store(store))
            .retention(RETENTION)
            .build()?,
    ))
}

/// Serves `router` on a fresh loopback port, with `TCP_NODELAY`.
pub async fn serve(router: Router) -> Res<SocketAddr> {
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

/// The servers of the cases, one per case, with their stores.
#[derive(Debug)]
pub struct Servers {
    /// The `bare` case.
    pub bare: SocketAddr,
    /// The `memory` case.
    pub memory: SocketAddr,
    /// Its store.
    pub memory_store: MemoryStore,
    /// Records the memory case's store evicted before their retention ended.
    pub memory_evicted: Arc<AtomicU64>,
    /// The `redis` case.
    pub redis: SocketAddr,
    /// Its store.
    pub redis_store: RedisStore,
    /// The `postgres` case.
    pub postgres: SocketAddr,
    /// Its store.
    pub postgres_store: PostgresStore,
    /// The `postgres-tx` case.
    pub tx: SocketAddr,
    /// Its store.
    pub tx_store: PostgresStore,
    /// The SQL of the durable-commit probe.
    pub probe_insert: String,
}

impl Servers {
    /// Serves every case, each on a port and with stores of its own.
    pub async fn start(env: &Env) -> Res<Self> {
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

/// An answer, read whole.
#[derive(Debug)]
pub struct Answer {
    /// Its status.
    pub status: StatusCode,
    /// Whether it is a replay (`idempotent-replayed: true`).
    pub replayed: bool,
    /// Its body.
    pub body: Bytes,
}

/// One keyed `POST path` with [`REQUEST_JSON`] on `sender`, bounded by
/// [`REQUEST_TIMEOUT`].
pub async fn post_once(sender: &mut Sender, path: &str, key: &str) -> Res<Answer> {
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

/// What answer a request is due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// The handler ran: 201, the body, no `idempotent-replayed`.
    Ran,
    /// A replay: 201, the body, `idempotent-replayed: true`.
    Replayed,
    /// Either.
    Either,
}

/// Whether `answer` is the 201 with `body` that `expect` says.
pub fn check(answer: &Answer, expect: Expect, body: &[u8]) -> Result<(), String> {
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
pub fn fresh_key(counter: &AtomicU64) -> String {
    format!("f-{:020}", counter.fetch_add(1, Ordering::Relaxed))
}

/// The key client `client` of case `tag` repeats in `replay`.
pub fn replay_key(tag: &str, client: usize) -> String {
    format!("r-{tag}-{client}")
}

/// `clients` connections sending `per_client` requests each, with keys
/// `{prefix}-{client}-{n}`, every answer checked; fails on the first wrong answer.
pub async fn burst(
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

/// One `PING` to Redis within [`REQUEST_TIMEOUT`]: the store's own round trip, measured
/// beside a guarded request.
pub async fn redis_ping(conn: &ConnectionManager) -> Result<(), String> {
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

/// One `SELECT 1` on PostgreSQL within [`REQUEST_TIMEOUT`]: the database's own round
/// trip, measured beside a guarded request.
pub async fn pg_select_1(pool: &PgPool) -> Result<(), String> {
    let one = sqlx::query_scalar::<_, i32>("SELECT 1").fetch_one(pool);
    match tokio::time::timeout(REQUEST_TIMEOUT, one).await {
        Ok(Ok(1)) => Ok(()),
        Ok(Ok(other)) => Err(format!("SELECT 1 answered {other}")),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("SELECT 1 timed out".to_owned()),
    }
}
