//! Shared by the tests that drive the `payments` example as an outside user would: the
//! binary, a running server, an HTTP client with the example's routes, isolated Redis
//! and PostgreSQL namespaces with direct readers of what the example wrote, and a TCP
//! proxy that a test can cut and restore to take a store away mid-run.
// These helpers drive real child processes on the wall clock (reading their output from
// threads, waiting for them to exit), so they use std's clock and sleeps on purpose.
#![allow(
    clippy::disallowed_methods,
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    dead_code,
    unreachable_pub,
    missing_docs
)]

pub mod private;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use retrysafe_core::idempotency::{CommitPoint, Principal, Record, RecordId, Scope, Token};
use retrysafe_core::store::IdempotencyStore;
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_postgres::sqlx::postgres::PgConnectOptions;
use retrysafe_postgres::sqlx::{self, Connection, PgConnection};
use retrysafe_redis::RedisStore;
use retrysafe_redis::redis::cluster_async::ClusterConnection;
use retrysafe_redis::redis::{self, aio::ConnectionManager};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The principal of requests without an `Authorization` header (the example's
/// `app::ANONYMOUS`).
pub const ANONYMOUS: &str = "anonymous client";

/// The `payments` example's binary.
pub fn binary() -> PathBuf {
    crate::example_bin::example_binary("payments")
}

/// A running `payments` process, killed when dropped.
pub struct Server {
    child: Child,
    pub base: String,
    stderr: Arc<Mutex<String>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `payments --listen 127.0.0.1:0 ARGS` and waits for its ready line.
    pub fn start(args: &[&str]) -> Server {
        Server::start_with(args, &[])
    }

    /// Like [`start`](Self::start), with extra environment variables.
    pub fn start_with(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(binary())
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the payments example");
        let stderr = Arc::new(Mutex::new(String::new()));
        drain(child.stderr.take().unwrap(), Arc::clone(&stderr));

        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let mut server = Server {
            child,
            base: String::new(),
            stderr,
        };
        let line = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_default();
        let Some(addr) = line.trim_end().strip_prefix("listening on http://") else {
            std::thread::sleep(Duration::from_millis(200));
            panic!(
                "no ready line: stdout {line:?}, exit {:?}, stderr:\n{}",
                server.child.try_wait(),
                server.stderr()
            );
        };
        let port = addr.rsplit(':').next().unwrap();
        assert_ne!(
            port, "0",
            "the ready line must show the port actually bound"
        );
        assert!(addr.starts_with("127.0.0.1:"), "ready line {line:?}");
        server.base = format!("http://{addr}");
        server
    }

    /// Kills the process with SIGKILL (on Unix) and waits for it: no graceful shutdown,
    /// no drain, nothing of it runs after this returns.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        let status = self.child.wait().unwrap();
        assert!(!status.success(), "killed, yet {status:?}");
    }

    /// Whether the process is still running (it has not exited or been killed).
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the process wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }
}

fn drain(mut from: impl Read + Send + 'static, into: Arc<Mutex<String>>) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 {
                break;
            }
            into.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
}

/// Runs `payments ARGS` to its exit (killed after 30 s): its status and stderr.
pub fn run_to_exit(args: &[&str], env: &[(&str, &str)]) -> (ExitStatus, String) {
    let mut child = Command::new(binary())
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the payments example");
    let stderr = Arc::new(Mutex::new(String::new()));
    drain(child.stderr.take().unwrap(), Arc::clone(&stderr));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("payments {args:?} did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // Let the reader thread see the end of the pipe.
    std::thread::sleep(Duration::from_millis(50));
    let text = stderr.lock().unwrap().clone();
    (status, text)
}

#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// A `status` problem+json answer with a `type`; returns the type.
    pub fn assert_problem(&self, status: u16) -> String {
        assert_eq!(self.status.as_u16(), status, "{self:?}");
        let ct = self.headers.get("content-type").unwrap().to_str().unwrap();
        assert!(ct.starts_with("application/problem+json"), "{self:?}");
        let ty = self.json()["type"].as_str().unwrap().to_owned();
        assert!(!ty.is_empty(), "{self:?}");
        ty
    }

    /// A `status` problem whose type ends with `slug`.
    pub fn assert_problem_type(&self, status: u16, slug: &str) {
        let ty = self.assert_problem(status);
        assert!(ty.ends_with(&format!(":{slug}")), "{slug}: {self:?}");
    }

    /// A 503 problem with a `retry-after`.
    pub fn assert_unavailable(&self) {
        self.assert_problem(503);
        assert!(self.headers.contains_key("retry-after"), "{self:?}");
    }

    /// A 201 for `account` / `amount`; returns the payment id.
    pub fn assert_created(&self, account: &str, amount: i64) -> String {
        assert_eq!(self.status, StatusCode::CREATED, "{self:?}");
        let v = self.json();
        assert_eq!(v["account"], account, "{self:?}");
        assert_eq!(v["amount_cents"], amount, "{self:?}");
        let id = v["id"].as_str().unwrap();
        assert!(!id.is_empty(), "{self:?}");
        id.to_owned()
    }
}

#[derive(Clone)]
pub struct Api {
    pub http: reqwest::Client,
    pub base: String,
}

impl Api {
    pub fn new(server: &Server) -> Api {
        Api {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(40))
                .build()
                .unwrap(),
            base: server.base.clone(),
        }
    }

    pub async fn try_send(&self, req: reqwest::RequestBuilder) -> reqwest::Result<Answer> {
        let res = req.send().await?;
        Ok(Answer {
            status: res.status(),
            headers: res.headers().clone(),
            body: res.bytes().await?,
        })
    }

    pub async fn send(&self, req: reqwest::RequestBuilder) -> Answer {
        self.try_send(req).await.unwrap()
    }

    pub fn post(&self) -> reqwest::RequestBuilder {
        self.http.post(format!("{}/payments", self.base))
    }

    fn payment(
        &self,
        key: &str,
        account: &str,
        amount: i64,
        extra: &[(&str, &str)],
    ) -> reqwest::RequestBuilder {
        let mut req = self
            .post()
            .header("idempotency-key", key)
            .json(&json!({ "account": account, "amount_cents": amount }));
        for (name, value) in extra {
            req = req.header(*name, *value);
        }
        req
    }

    /// `POST /payments` with `key`, a JSON payment and extra headers.
    pub async fn pay(
        &self,
        key: &str,
        account: &str,
        amount: i64,
        extra: &[(&str, &str)],
    ) -> Answer {
        self.send(self.payment(key, account, amount, extra)).await
    }

    /// Like [`pay`](Self::pay), for a request whose server may die under it.
    pub async fn try_pay(
        &self,
        key: &str,
        account: &str,
        amount: i64,
        extra: &[(&str, &str)],
    ) -> reqwest::Result<Answer> {
        self.try_send(self.payment(key, account, amount, extra))
            .await
    }

    /// `copies` identical payments sent at once, each delayed by the server for
    /// `delay_ms` before its effect.
    pub async fn pay_concurrently(
        &self,
        copies: usize,
        key: &str,
        account: &str,
        amount: i64,
        delay_ms: &str,
    ) -> Vec<Answer> {
        pay_split(
            std::slice::from_ref(self),
            copies,
            key,
            account,
            amount,
            delay_ms,
        )
        .await
    }

    /// `GET /payments?account=A`.
    pub async fn try_totals(&self, account: &str) -> Answer {
        self.send(
            self.http
                .get(format!("{}/payments", self.base))
                .query(&[("account", account)]),
        )
        .await
    }

    /// `GET /payments?account=A`: (count, total_cents).
    pub async fn totals(&self, account: &str) -> (u64, i64) {
        let res = self.try_totals(account).await;
        assert_eq!(res.status, StatusCode::OK, "{res:?}");
        let v = res.json();
        (
            v["count"].as_u64().unwrap(),
            v["total_cents"].as_i64().unwrap(),
        )
    }
}

/// `copies` identical payments sent at once, spread in turn over `apis` (one server
/// each), each delayed by the server for `delay_ms` before its effect.
pub async fn pay_split(
    apis: &[Api],
    copies: usize,
    key: &str,
    account: &str,
    amount: i64,
    delay_ms: &str,
) -> Vec<Answer> {
    let sends = (0..copies).map(|i| {
        let api = apis[i % apis.len()].clone();
        let (key, account, delay) = (key.to_owned(), account.to_owned(), delay_ms.to_owned());
        tokio::spawn(async move {
            api.pay(
                &key,
                &account,
                amount,
                &[("x-simulate-delay-ms", delay.as_str())],
            )
            .await
        })
    });
    futures_util::future::join_all(sends)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

/// Polls `check` every 20 ms until it is `Some`, for at most `within`; panics naming
/// `what` otherwise.
pub async fn eventually<T, F, Fut>(what: &str, within: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(started.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The record id the example gives `key` of an anonymous client.
pub fn record_id(key: &str) -> RecordId {
    RecordId::new(
        &Scope::from(&Principal::new(ANONYMOUS)),
        &IdempotencyKey::new(key).unwrap(),
    )
}

/// Something unique to one test, usable in Redis keys and PostgreSQL names:
/// `<unix seconds>_<12 hex digits>`.
fn unique() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let rand = Token::random().to_hex();
    format!("{secs}_{}", &rand[..12])
}

/// `host:port` of a `scheme://[user[:password]@]host[:port][/…]` URL.
pub fn host_port(url: &str, default_port: u16) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    let hp = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    if hp.contains(':') {
        hp.to_owned()
    } else {
        format!("{hp}:{default_port}")
    }
}

/// `url` with its `host:port` replaced by `addr`.
pub fn with_addr(url: &str, addr: SocketAddr) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let userinfo = authority
        .rsplit_once('@')
        .map_or(String::new(), |(u, _)| format!("{u}@"));
    format!("{scheme}://{userinfo}{addr}{tail}")
}

async fn resolve(host_port: &str) -> SocketAddr {
    tokio::net::lookup_host(host_port)
        .await
        .unwrap_or_else(|e| panic!("cannot resolve {host_port}: {e}"))
        .next()
        .unwrap_or_else(|| panic!("{host_port} resolves to nothing"))
}

// ---------------------------------------------------------------------------------
// Redis

/// `REDIS_URL`, default `redis://127.0.0.1:6379`.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A key prefix of one test on the Redis at `REDIS_URL` (or on a Redis Cluster: `C` is
/// then a `ClusterConnection`), with direct access to what the example writes under it.
/// On one server its keys are deleted (best effort) when dropped; a test cluster is
/// private and goes away with the test process.
pub struct RedisSpace<C = ConnectionManager> {
    /// `PAYMENTS_REDIS_PREFIX` for the example.
    pub prefix: String,
    /// The Redis server's URL (`REDIS_URL`, or the one given to [`at`](Self::at)); for
    /// a cluster, one node's.
    pub url: String,
    pub conn: C,
    /// The idempotency store the example uses, seen directly.
    pub store: RedisStore<C>,
    /// Whether the keys are deleted when dropped (one server, not a cluster).
    cleanup: bool,
}

impl RedisSpace {
    pub async fn new() -> RedisSpace {
        RedisSpace::at(&redis_url()).await
    }

    /// A key prefix of one test on the Redis server at `url` (a private server).
    pub async fn at(url: &str) -> RedisSpace {
        let url = url.to_owned();
        let client = redis::Client::open(url.as_str())
            .unwrap_or_else(|e| panic!("REDIS_URL={url} is not a valid Redis URL: {e}"));
        let conn =
            match tokio::time::timeout(Duration::from_secs(10), ConnectionManager::new(client))
                .await
            {
                Ok(Ok(conn)) => conn,
                Ok(Err(e)) => panic!(
                    "cannot reach Redis at REDIS_URL={url}: {e}. Start redis-server (or run \
                 scripts/test) or point REDIS_URL at a running server."
                ),
                Err(_) => panic!("timed out connecting to Redis at REDIS_URL={url}"),
            };
        RedisSpace::on(url, conn, true).await
    }
}

impl RedisSpace<ClusterConnection> {
    /// A key prefix of one test on the Redis Cluster whose nodes are `urls` (the
    /// example is given the first).
    pub async fn cluster(urls: &[String]) -> RedisSpace<ClusterConnection> {
        let client = redis::cluster::ClusterClient::new(urls.to_vec()).unwrap();
        let conn = tokio::time::timeout(Duration::from_secs(30), client.get_async_connection())
            .await
            .unwrap_or_else(|_| panic!("timed out connecting to the Redis Cluster at {urls:?}"))
            .unwrap_or_else(|e| panic!("cannot reach the Redis Cluster at {urls:?}: {e}"));
        RedisSpace::on(urls[0].clone(), conn, false).await
    }
}

impl<C> RedisSpace<C>
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
{
    async fn on(url: String, conn: C, cleanup: bool) -> RedisSpace<C> {
        let prefix = format!("payments-test:{}:", unique());
        let store = RedisStore::options()
            .key_prefix(format!("{prefix}idem:"))
            .call_timeout(Duration::from_secs(5))
            .build(conn.clone())
            .await
            .unwrap();
        RedisSpace {
            prefix,
            url,
            conn,
            store,
            cleanup,
        }
    }

    /// The environment that points the example at this prefix.
    pub fn env(&self) -> [(&str, &str); 1] {
        [("PAYMENTS_REDIS_PREFIX", self.prefix.as_str())]
    }

    /// The payments of `account` in the example's Redis ledger: id → amount.
    pub async fn payments(&self, account: &str) -> BTreeMap<String, i64> {
        redis::cmd("HGETALL")
            .arg(format!("{}{{ledger}}:account:{account}", self.prefix))
            .query_async(&mut self.conn.clone())
            .await
            .unwrap()
    }

    /// The amounts of `account`'s payments in the example's Redis ledger.
    pub async fn amounts(&self, account: &str) -> Vec<i64> {
        self.payments(account).await.into_values().collect()
    }

    /// The idempotency record of an anonymous client's `key`.
    pub async fn record(&self, key: &str) -> Option<Record> {
        self.store.get(&record_id(key)).await.unwrap()
    }
}

impl<C> Drop for RedisSpace<C> {
    fn drop(&mut self) {
        if !self.cleanup {
            return;
        }
        let pattern = format!("{}*", self.prefix);
        let url = self.url.clone();
        let _ = std::thread::spawn(move || {
            let Ok(client) = redis::Client::open(url.as_str()) else {
                return;
            };
            let Ok(mut conn) = client.get_connection() else {
                return;
            };
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(&pattern)
                .query(&mut conn)
                .unwrap_or_default();
            if !keys.is_empty() {
                let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(keys).query(&mut conn);
            }
        })
        .join();
    }
}

// ---------------------------------------------------------------------------------
// PostgreSQL

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// The prefix of the schemas these tests create.
const SCHEMA_PREFIX: &str = "payments_test_";

/// `DATABASE_URL`, or the development default.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned())
}

fn pg_unreachable(e: impl std::fmt::Display) -> ! {
    panic!(
        "cannot reach PostgreSQL at DATABASE_URL={} ({e}); start it or point DATABASE_URL \
         at a server (default {DEFAULT_DATABASE_URL})",
        database_url()
    )
}

/// One plain connection to `DATABASE_URL`.
pub async fn pg_admin() -> PgConnection {
    let url = database_url();
    let options = PgConnectOptions::from_str(&url)
        .unwrap_or_else(|e| panic!("DATABASE_URL={url} is not a PostgreSQL URL: {e}"));
    PgConnection::connect_with(&options)
        .await
        .unwrap_or_else(|e| pg_unreachable(e))
}

/// One plain connection to the PostgreSQL server at `url`.
pub async fn pg_connect(url: &str) -> PgConnection {
    let options = PgConnectOptions::from_str(url)
        .unwrap_or_else(|e| panic!("{url} is not a PostgreSQL URL: {e}"));
    PgConnection::connect_with(&options)
        .await
        .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {url}: {e}"))
}

/// A schema of one test in the database at `DATABASE_URL`, with direct access to what
/// the example writes in it. Dropped (best effort) when dropped.
pub struct PgSpace {
    /// `PAYMENTS_PG_SCHEMA` for the example.
    pub schema: String,
    /// The database's URL (`DATABASE_URL`, or the one given to [`at`](Self::at)).
    pub url: String,
    admin: tokio::sync::Mutex<PgConnection>,
}

impl PgSpace {
    pub async fn new() -> PgSpace {
        drop_stale_schemas().await;
        PgSpace {
            schema: format!("{SCHEMA_PREFIX}{}", unique()),
            url: database_url(),
            admin: tokio::sync::Mutex::new(pg_admin().await),
        }
    }

    /// A schema of one test in the database at `url` (a private cluster). The audits
    /// ([`audit`](Self::audit), [`table_counts`](Self::table_counts)) open a connection
    /// of their own, so they work across a restart of that server.
    pub async fn at(url: &str) -> PgSpace {
        PgSpace {
            schema: format!("{SCHEMA_PREFIX}{}", unique()),
            url: url.to_owned(),
            admin: tokio::sync::Mutex::new(pg_connect(url).await),
        }
    }

    /// The environment that points the example at this schema.
    pub fn env(&self) -> [(&str, &str); 1] {
        [("PAYMENTS_PG_SCHEMA", self.schema.as_str())]
    }

    /// `DATABASE_URL` with `application_name=NAME`, so that the sessions of one instance
    /// can be told apart in `pg_stat_activity`.
    pub fn url_named(name: &str) -> String {
        let url = database_url();
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}application_name={name}")
    }

    /// The amounts of `account`'s committed payments, by id.
    pub async fn amounts(&self, account: &str) -> Vec<i64> {
        let sql = format!(
            "SELECT amount_cents FROM {}.payments WHERE account = $1 ORDER BY id",
            self.schema
        );
        sqlx::query_scalar(&sql)
            .bind(account)
            .fetch_all(&mut *self.admin.lock().await)
            .await
            .unwrap()
    }

    /// Whether a committed key row exists for an anonymous client's `key`.
    pub async fn key_row_exists(&self, key: &str) -> bool {
        let sql = format!(
            "SELECT count(*) FROM {}.retrysafe_idempotency WHERE k = $1",
            self.schema
        );
        let n: i64 = sqlx::query_scalar(&sql)
            .bind(&record_id(key).as_bytes()[..])
            .fetch_one(&mut *self.admin.lock().await)
            .await
            .unwrap();
        n > 0
    }

    /// Whether a session of application `name` holds a row lock on the payments table
    /// of this schema: it has inserted a payment it has not committed yet.
    pub async fn uncommitted_insert(&self, name: &str) -> bool {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE a.application_name = $1 AND l.locktype = 'relation'
               AND l.mode = 'RowExclusiveLock' AND l.granted
               AND l.relation = to_regclass($2)",
        )
        .bind(name)
        .bind(format!("{}.payments", self.schema))
        .fetch_one(&mut *self.admin.lock().await)
        .await
        .unwrap();
        n > 0
    }

    /// Whether a session of application `name` holds an advisory lock: the
    /// transactional layer's lock on a key in flight.
    pub async fn holds_key_lock(&self, name: &str) -> bool {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE a.application_name = $1 AND l.locktype = 'advisory' AND l.granted",
        )
        .bind(name)
        .fetch_one(&mut *self.admin.lock().await)
        .await
        .unwrap();
        n > 0
    }

    /// How many sessions of application `name` the server still has.
    pub async fn sessions(&self, name: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
            .bind(name)
            .fetch_one(&mut *self.admin.lock().await)
            .await
            .unwrap()
    }
}

impl Drop for PgSpace {
    fn drop(&mut self) {
        let schema = self.schema.clone();
        let url = self.url.clone();
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let Ok(options) = PgConnectOptions::from_str(&url) else {
                    return;
                };
                if let Ok(mut conn) = PgConnection::connect_with(&options).await {
                    let _ = sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                        .execute(&mut conn)
                        .await;
                    let _ = conn.close().await;
                }
            });
        })
        .join();
    }
}

/// Drops schemas left by earlier runs (older than an hour), once per process.
async fn drop_stale_schemas() {
    static DONE: AtomicBool = AtomicBool::new(false);
    if DONE.swap(true, Ordering::AcqRel) {
        return;
    }
    let mut conn = pg_admin().await;
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'payments\\_test\\_%'",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap_or_default();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    for name in names {
        let secs = name
            .strip_prefix(SCHEMA_PREFIX)
            .and_then(|rest| rest.split('_').next())
            .and_then(|s| s.parse::<u64>().ok());
        if secs.is_some_and(|s| s + 3600 < now) {
            let _ = sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS {name} CASCADE"))
                .execute(&mut conn)
                .await;
        }
    }
    let _ = conn.close().await;
}

// ---------------------------------------------------------------------------------
// A TCP proxy that can be cut

/// A TCP proxy in front of a server. [`cut`](Self::cut) closes every connection through
/// it and closes new ones at once (as a server that went away would look to its
/// clients); [`restore`](Self::restore) lets connections through again. Its tasks run
/// on the test's runtime and end with it.
pub struct Proxy {
    pub addr: SocketAddr,
    up: watch::Sender<bool>,
}

impl Proxy {
    /// A proxy on `127.0.0.1:0` to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> Proxy {
        let upstream = resolve(upstream).await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (up, state) = watch::channel(true);
        tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                let mut down = state.clone();
                if !*down.borrow_and_update() {
                    drop(client);
                    continue;
                }
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = down.wait_for(|up| !*up) => {}
                    }
                    // Both sockets close here.
                });
            }
        });
        Proxy { addr, up }
    }

    /// Closes every connection and refuses new ones until [`restore`](Self::restore).
    pub fn cut(&self) {
        self.up.send_replace(false);
    }

    /// Lets connections through again.
    pub fn restore(&self) {
        self.up.send_replace(true);
    }
}

// ---------------------------------------------------------------------------------
// Crash and outage audits: resend every key to a definitive answer, then read what the
// backend holds for it (its record and its account's payments) and tally the result.

/// A small seeded PRNG (SplitMix64): the crash and outage tests print their seed and
/// take it from the environment, so a failing run can be repeated.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..hi` (`lo` when the range is empty).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            lo
        } else {
            lo + self.next_u64() % (hi - lo)
        }
    }

    /// True with probability `1 / n`.
    pub fn one_in(&mut self, n: u64) -> bool {
        self.range(0, n.max(1)) == 0
    }
}

/// The seed in environment variable `var`, or a fresh one from the clock; printed
/// either way with the line that repeats the run.
#[allow(clippy::print_stdout, reason = "the seed must be seen to repeat a run")]
pub fn seed_from_env(var: &str, test: &str) -> u64 {
    let seed = std::env::var(var)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(1, |d| u64::try_from(d.as_nanos()).unwrap_or(1))
        });
    println!("{test}: seed {seed} (repeat with {var}={seed})");
    seed
}

/// A whole number from environment variable `var`, or `default`.
pub fn env_number(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(default)
}

/// Where a key's idempotency record stands, read directly from the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    /// No record (none was ever written, or it was released or rolled back).
    Absent,
    /// Claimed; `passed` once its holder passed its commit point, `expired` when its
    /// lease has ended by the store's clock.
    InProgress {
        passed: bool,
        expired: bool,
    },
    Completed,
    OutcomeUnknown,
}

/// What the backend holds for one key: its record and the ids of its account's
/// payments (every key of these tests has an account of its own), as the API shows
/// them (`pay_…`).
#[derive(Debug, Clone)]
pub struct KeyAudit {
    pub record: RecordState,
    pub payments: Vec<String>,
}

/// One logical payment of a run: its own key and account.
#[derive(Debug, Clone)]
pub struct Payment {
    pub key: String,
    pub account: String,
    pub amount: i64,
}

impl Payment {
    /// A payment whose key is `key` and whose account is `acct-KEY`.
    pub fn new(key: String, amount: i64) -> Payment {
        Payment {
            account: format!("acct-{key}"),
            key,
            amount,
        }
    }
}

impl RedisSpace {
    /// The record and payments of each of `payments`, read in two pipelines, with the
    /// lease of an `in_progress` record compared with Redis's own clock (`TIME`).
    pub async fn audit(&self, payments: &[Payment]) -> Vec<KeyAudit> {
        let mut conn = self.conn.clone();
        let mut out = Vec::with_capacity(payments.len());
        for chunk in payments.chunks(500) {
            let mut pipe = redis::pipe();
            for p in chunk {
                pipe.cmd("GET").arg(self.store.key(&record_id(&p.key)));
            }
            for p in chunk {
                pipe.cmd("HKEYS")
                    .arg(format!("{}{{ledger}}:account:{}", self.prefix, p.account));
            }
            pipe.cmd("TIME");
            // The connection may have been broken by a restart of the server: the
            // manager reconnects after the first failed call.
            let mut tries = 0;
            let mut replies: Vec<redis::Value> = loop {
                match pipe.query_async(&mut conn).await {
                    Ok(replies) => break replies,
                    Err(e) if tries < 50 => {
                        tries += 1;
                        let _ = e;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => panic!("cannot read Redis: {e}"),
                }
            };
            let time: (u64, u64) = redis::from_redis_value(replies.pop().unwrap()).unwrap();
            let now_ms = time.0 * 1000 + time.1 / 1000;
            let ledgers = replies.split_off(chunk.len());
            for (record, ledger) in replies.into_iter().zip(ledgers) {
                let record: Option<Vec<u8>> = redis::from_redis_value(record).unwrap();
                let record = match record.map(|b| Record::decode(Bytes::from(b)).unwrap()) {
                    None => RecordState::Absent,
                    Some(Record::InProgress(p)) => RecordState::InProgress {
                        passed: p.commit_point == CommitPoint::Passed,
                        expired: p.lease_until_ms <= now_ms,
                    },
                    Some(Record::Completed(_)) => RecordState::Completed,
                    Some(Record::OutcomeUnknown(_)) => RecordState::OutcomeUnknown,
                    Some(other) => panic!("a record state this check does not know: {other:?}"),
                };
                let payments: Vec<String> = redis::from_redis_value(ledger).unwrap();
                out.push(KeyAudit { record, payments });
            }
        }
        out
    }
}

impl PgSpace {
    /// The record and committed payments of each of `payments`, on a connection of its
    /// own, with the lease of an `in_progress` row compared with `clock_timestamp()`.
    pub async fn audit(&self, payments: &[Payment]) -> Vec<KeyAudit> {
        let mut conn = pg_connect(&self.url).await;
        let ks: Vec<Vec<u8>> = payments
            .iter()
            .map(|p| record_id(&p.key).as_bytes().to_vec())
            .collect();
        let accounts: Vec<String> = payments.iter().map(|p| p.account.clone()).collect();
        let rows: Vec<(Vec<u8>, i16, bool, bool)> = sqlx::query_as(&format!(
            "SELECT k, state, coalesce(commit_point = 2, false),
                    coalesce(lease_until <= clock_timestamp(), false)
             FROM {}.retrysafe_idempotency WHERE k = ANY($1)",
            self.schema
        ))
        .bind(&ks)
        .fetch_all(&mut conn)
        .await
        .unwrap();
        let records: BTreeMap<Vec<u8>, RecordState> = rows
            .into_iter()
            .map(|(k, state, passed, expired)| {
                let state = match state {
                    1 => RecordState::InProgress { passed, expired },
                    2 => RecordState::Completed,
                    3 => RecordState::OutcomeUnknown,
                    other => panic!("unknown state {other}"),
                };
                (k, state)
            })
            .collect();
        let paid: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT account, id FROM {}.payments WHERE account = ANY($1) ORDER BY id",
            self.schema
        ))
        .bind(&accounts)
        .fetch_all(&mut conn)
        .await
        .unwrap();
        let mut by_account: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (account, id) in paid {
            by_account
                .entry(account)
                .or_default()
                .push(format!("pay_{id}"));
        }
        let _ = conn.close().await;
        payments
            .iter()
            .zip(&ks)
            .map(|(p, k)| KeyAudit {
                record: records.get(k).copied().unwrap_or(RecordState::Absent),
                payments: by_account.remove(&p.account).unwrap_or_default(),
            })
            .collect()
    }

    /// Every row of the key table and of the payments table in this schema:
    /// `(key rows, in_progress key rows, payments)`.
    pub async fn table_counts(&self) -> (i64, i64, i64) {
        let mut conn = pg_connect(&self.url).await;
        let counts = sqlx::query_as(&format!(
            "SELECT (SELECT count(*) FROM {s}.retrysafe_idempotency),
                    (SELECT count(*) FROM {s}.retrysafe_idempotency WHERE state = 1),
                    (SELECT count(*) FROM {s}.payments)",
            s = self.schema
        ))
        .fetch_one(&mut conn)
        .await
        .unwrap();
        let _ = conn.close().await;
        counts
    }
}

/// The definitive answer to a key: its 201 (the first answer replayed, or a run), or the
/// 500 `outcome-unknown` problem.
#[derive(Debug)]
pub enum Final {
    Created(Answer),
    OutcomeUnknown(Answer),
}

/// Whether `answer` is the idempotency layer's 500 `outcome-unknown` problem.
pub fn is_outcome_unknown(answer: &Answer) -> bool {
    answer.status == StatusCode::INTERNAL_SERVER_ERROR
        && answer
            .headers
            .get("content-type")
            .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"))
        && answer.json()["type"]
            .as_str()
            .is_some_and(|t| t.ends_with(":outcome-unknown"))
}

/// Sends `payment` to the servers in turn until it has a definitive answer (a 201, or
/// the 500 `outcome-unknown` problem), pausing `pause` between tries. A 409 (in flight:
/// a dead holder's lease has not expired yet), a 503 with `retry-after`, the app's own
/// 500 `payment-outcome-unknown` (the next copy gets the stable problem) and a failed
/// connection are retried; anything else fails the test. Returns the answer and how
/// many sends it took.
pub async fn resolve_payment(
    apis: &[Api],
    payment: &Payment,
    pause: Duration,
    patience: Duration,
) -> (Final, u32) {
    let started = Instant::now();
    let mut sends = 0u32;
    loop {
        let api = &apis[sends as usize % apis.len()];
        sends += 1;
        match api
            .try_pay(&payment.key, &payment.account, payment.amount, &[])
            .await
        {
            Ok(a) if a.status == StatusCode::CREATED => {
                a.assert_created(&payment.account, payment.amount);
                return (Final::Created(a), sends);
            }
            Ok(a) if is_outcome_unknown(&a) => {
                assert_eq!(a.headers["do-not-retry"], "1", "{a:?}");
                return (Final::OutcomeUnknown(a), sends);
            }
            Ok(a) if a.status == StatusCode::CONFLICT => {
                a.assert_problem_type(409, "request-in-flight");
                assert!(a.headers.contains_key("retry-after"), "{a:?}");
            }
            Ok(a) if a.status == StatusCode::SERVICE_UNAVAILABLE => a.assert_unavailable(),
            Ok(a) if a.status == StatusCode::INTERNAL_SERVER_ERROR => {
                a.assert_problem_type(500, "payment-outcome-unknown");
            }
            Ok(a) => panic!("unexpected answer to {}: {a:?}", payment.key),
            Err(_) => {}
        }
        assert!(
            started.elapsed() < patience,
            "{}: no definitive answer within {patience:?} ({sends} sends)",
            payment.key
        );
        tokio::time::sleep(pause).await;
    }
}

/// Resolves every payment (at most `parallel` at once): the definitive answers, in
/// order, and the number of sends in all.
pub async fn resolve_all(
    apis: &[Api],
    payments: &[Payment],
    parallel: usize,
    patience: Duration,
) -> (Vec<Final>, u64) {
    use futures_util::StreamExt;
    let results: Vec<(Final, u32)> = futures_util::stream::iter(
        payments
            .iter()
            .map(|p| resolve_payment(apis, p, Duration::from_millis(50), patience)),
    )
    .buffered(parallel.max(1))
    .collect()
    .await;
    let sends = results.iter().map(|(_, n)| u64::from(*n)).sum();
    (results.into_iter().map(|(f, _)| f).collect(), sends)
}

/// What a run left in the backend, key by key, against what its clients were told.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    /// Logical payments (distinct keys).
    pub keys: u64,
    /// Payments in the ledger for those keys.
    pub effects: u64,
    /// Keys with more than one payment (must be 0).
    pub duplicates: u64,
    /// Keys whose definitive answer is a 201.
    pub created: u64,
    /// Keys whose definitive answer is `outcome-unknown`, with and without a payment.
    pub unknown_with_effect: u64,
    pub unknown_without_effect: u64,
    /// A 201 (now or earlier) whose payment is not in the ledger, or is another payment
    /// than the one answered (must be 0).
    pub lost: u64,
    /// Two different 201 answers for one key (must be 0).
    pub answers_differ: u64,
    /// Keys answered 201 whose record is `outcome_unknown` (the answer was returned but
    /// could not be stored; the payment is in the ledger).
    pub completion_lost: u64,
    /// A completed record without exactly one payment, an `outcome_unknown` answer
    /// without its record, or a record missing after a definitive answer (must be 0).
    pub record_mismatch: u64,
    /// `in_progress` records left after every key was answered, and those of them whose
    /// lease had expired: orphans (both must be 0).
    pub in_progress_left: u64,
    pub orphaned: u64,
}

impl Tally {
    /// Adds one key: `earlier` are the 201 answers its clients got before the definitive
    /// answer `last`; `audit` is what the backend holds.
    pub fn add(&mut self, earlier: &[&Answer], last: &Final, audit: &KeyAudit) {
        self.keys += 1;
        self.effects += audit.payments.len() as u64;
        if audit.payments.len() > 1 {
            self.duplicates += 1;
        }
        if let RecordState::InProgress { expired, .. } = audit.record {
            self.in_progress_left += 1;
            if expired {
                self.orphaned += 1;
            }
        }
        match last {
            Final::Created(answer) => {
                self.created += 1;
                let id = answer.json()["id"].as_str().unwrap_or_default().to_owned();
                let answered_elsewhere = earlier.iter().any(|e| {
                    let id = e.json()["id"].as_str().unwrap_or_default().to_owned();
                    !audit.payments.contains(&id)
                });
                if audit.payments != [id] || answered_elsewhere {
                    self.lost += 1;
                }
                if earlier.iter().any(|e| e.body != answer.body) {
                    self.answers_differ += 1;
                }
                if audit.record != RecordState::Completed {
                    self.record_mismatch += 1;
                }
            }
            Final::OutcomeUnknown(_) => {
                if audit.payments.is_empty() {
                    self.unknown_without_effect += 1;
                } else {
                    self.unknown_with_effect += 1;
                }
                if let Some(first) = earlier.first() {
                    // A client was told 201, and later copies say unknown: its answer
                    // could not be stored (the store failed after the handler ran, a
                    // `completion_lost`), which is allowed when its payment is there.
                    let id = first.json()["id"].as_str().unwrap_or_default().to_owned();
                    if audit.payments == [id] {
                        self.completion_lost += 1;
                    } else {
                        self.lost += 1;
                    }
                }
                if audit.record != RecordState::OutcomeUnknown {
                    self.record_mismatch += 1;
                }
            }
        }
    }

    pub fn merge(&mut self, other: &Tally) {
        self.keys += other.keys;
        self.effects += other.effects;
        self.duplicates += other.duplicates;
        self.created += other.created;
        self.unknown_with_effect += other.unknown_with_effect;
        self.unknown_without_effect += other.unknown_without_effect;
        self.lost += other.lost;
        self.answers_differ += other.answers_differ;
        self.completion_lost += other.completion_lost;
        self.record_mismatch += other.record_mismatch;
        self.in_progress_left += other.in_progress_left;
        self.orphaned += other.orphaned;
    }

    pub fn outcome_unknown(&self) -> u64 {
        self.unknown_with_effect + self.unknown_without_effect
    }
}

/// The summary the crash and store-fault tests print: `keys N, effects N, …`.
impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "keys {}, effects {}, duplicates {}, created {}, outcome_unknown {} ({} with its \
             payment, {} without), completion_lost {}, answered payments missing {}, keys \
             answered two ways {}, in_progress left {} (orphaned {})",
            self.keys,
            self.effects,
            self.duplicates,
            self.created,
            self.outcome_unknown(),
            self.unknown_with_effect,
            self.unknown_without_effect,
            self.completion_lost,
            self.lost,
            self.answers_differ,
            self.in_progress_left,
            self.orphaned,
        )
    }
}

impl Tally {
    /// The invariants of every store: never two effects, nothing answered lost, one
    /// answer per key, records that match the ledger, no `in_progress` left. With
    /// `transactional` (PostgreSQL's transactional layer) also: exactly one effect per
    /// key and no `outcome_unknown` at all.
    pub fn assert_sound(&self, transactional: bool) {
        assert_eq!(self.duplicates, 0, "a key with two payments: {self:?}");
        assert_eq!(self.lost, 0, "an answered payment is missing: {self:?}");
        assert_eq!(self.answers_differ, 0, "two answers for one key: {self:?}");
        assert_eq!(
            self.record_mismatch, 0,
            "record and ledger disagree: {self:?}"
        );
        assert_eq!(
            self.orphaned, 0,
            "an expired in_progress record remains: {self:?}"
        );
        assert_eq!(
            self.in_progress_left, 0,
            "an in_progress record remains: {self:?}"
        );
        assert!(self.effects <= self.keys, "{self:?}");
        if transactional {
            assert_eq!(self.outcome_unknown(), 0, "exactly once: {self:?}");
            assert_eq!(self.created, self.keys, "{self:?}");
            assert_eq!(
                self.effects, self.keys,
                "exactly one effect per key: {self:?}"
            );
        }
    }
}
