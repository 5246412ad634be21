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
use retrysafe_core::idempotency::{Principal, Record, RecordId, Scope, Token};
use retrysafe_core::store::IdempotencyStore;
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_postgres::sqlx::postgres::PgConnectOptions;
use retrysafe_postgres::sqlx::{self, Connection, PgConnection};
use retrysafe_redis::RedisStore;
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

/// A key prefix of one test on the Redis at `REDIS_URL`, with direct access to what the
/// example writes under it. Its keys are deleted (best effort) when dropped.
pub struct RedisSpace {
    /// `PAYMENTS_REDIS_PREFIX` for the example.
    pub prefix: String,
    pub conn: ConnectionManager,
    /// The idempotency store the example uses, seen directly.
    pub store: RedisStore,
}

impl RedisSpace {
    pub async fn new() -> RedisSpace {
        let url = redis_url();
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
        let prefix = format!("payments-test:{}:", unique());
        let store = RedisStore::builder(conn.clone())
            .key_prefix(format!("{prefix}idem:"))
            .call_timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        RedisSpace {
            prefix,
            conn,
            store,
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

impl Drop for RedisSpace {
    fn drop(&mut self) {
        let pattern = format!("{}*", self.prefix);
        let url = redis_url();
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

/// A schema of one test in the database at `DATABASE_URL`, with direct access to what
/// the example writes in it. Dropped (best effort) when dropped.
pub struct PgSpace {
    /// `PAYMENTS_PG_SCHEMA` for the example.
    pub schema: String,
    admin: tokio::sync::Mutex<PgConnection>,
}

impl PgSpace {
    pub async fn new() -> PgSpace {
        drop_stale_schemas().await;
        PgSpace {
            schema: format!("{SCHEMA_PREFIX}{}", unique()),
            admin: tokio::sync::Mutex::new(pg_admin().await),
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
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let Ok(options) = PgConnectOptions::from_str(&database_url()) else {
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
