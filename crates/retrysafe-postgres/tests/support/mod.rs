//! Test support: isolated stores on the real PostgreSQL at `DATABASE_URL`, and a TCP
//! proxy that counts what the client sends.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    dead_code,
    unreachable_pub,
    missing_docs
)]

use std::net::SocketAddr;
use std::ops::Deref;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use retrysafe_core::idempotency::{Completed, Record, RecordId, Token};
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, StoreError};
use retrysafe_postgres::sqlx::postgres::{PgConnectOptions, PgSslMode};
use retrysafe_postgres::sqlx::{self, Connection, PgConnection};
use retrysafe_postgres::{PostgresStore, PostgresStoreBuilder};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// Prefix of the schemas tests create: `rspg_<unix seconds>_<random>`.
const SCHEMA_PREFIX: &str = "rspg_";

/// `DATABASE_URL`, or the development default.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned())
}

/// The connection options of `DATABASE_URL`; fails the test with a clear message.
pub fn connect_options() -> PgConnectOptions {
    let url = database_url();
    PgConnectOptions::from_str(&url)
        .unwrap_or_else(|e| panic!("DATABASE_URL={url} is not a PostgreSQL URL: {e}"))
}

fn unreachable(e: impl std::fmt::Display) -> ! {
    panic!(
        "cannot reach PostgreSQL at DATABASE_URL={} ({e}); start it or point DATABASE_URL \
         at a server (default {DEFAULT_DATABASE_URL})",
        database_url()
    )
}

/// A fresh schema name, unique to one test.
pub fn fresh_schema() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let rand = Token::random().to_hex();
    format!("{SCHEMA_PREFIX}{secs}_{}", &rand[..12])
}

/// An isolated, migrated store in its own schema (dropped, best effort, when the store
/// is dropped), with a pool of at most 4 connections. `configure` adjusts the builder.
pub async fn isolated_store(
    configure: impl FnOnce(PostgresStoreBuilder) -> PostgresStoreBuilder,
) -> TestStore {
    isolated_store_with(connect_options(), configure).await
}

/// Like [`isolated_store`], connecting with `options`.
pub async fn isolated_store_with(
    options: PgConnectOptions,
    configure: impl FnOnce(PostgresStoreBuilder) -> PostgresStoreBuilder,
) -> TestStore {
    drop_stale_schemas().await;
    let schema = fresh_schema();
    let builder = PostgresStore::builder()
        .schema(schema.clone())
        .max_connections(4)
        // Generous: a loaded test machine must not turn slowness into failures.
        .call_timeout(Duration::from_secs(10))
        .connect_timeout(Duration::from_secs(10));
    let store = configure(builder)
        .connect_with(options)
        .await
        .unwrap_or_else(|e| unreachable(e));
    store.migrate().await.unwrap();
    TestStore { store, schema }
}

/// Drops schemas left by earlier runs (older than an hour), once per process.
async fn drop_stale_schemas() {
    static DONE: AtomicBool = AtomicBool::new(false);
    if DONE.swap(true, Ordering::AcqRel) {
        return;
    }
    let mut conn = admin().await;
    let names: Vec<String> =
        sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'rspg\\_%'")
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

/// One plain connection to `DATABASE_URL`, for inspecting and tampering with rows.
pub async fn admin() -> PgConnection {
    PgConnection::connect_with(&connect_options())
        .await
        .unwrap_or_else(|e| unreachable(e))
}

/// A store in its own schema; drops the schema when dropped.
#[derive(Debug)]
pub struct TestStore {
    pub store: PostgresStore,
    pub schema: String,
}

impl Deref for TestStore {
    type Target = PostgresStore;
    fn deref(&self) -> &PostgresStore {
        &self.store
    }
}

impl Drop for TestStore {
    fn drop(&mut self) {
        // Best effort, on a thread of its own: Drop may run inside (or outside) a
        // runtime of either flavour.
        let schema = self.schema.clone();
        let options = connect_options();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async move {
                let mut conn = PgConnection::connect_with(&options).await.ok()?;
                let _ = sqlx::raw_sql(&format!(
                    "SET lock_timeout = '5s'; DROP SCHEMA IF EXISTS {schema} CASCADE"
                ))
                .execute(&mut conn)
                .await;
                conn.close().await.ok()
            })
        })
        .join();
    }
}

impl IdempotencyStore for TestStore {
    async fn claim(&self, id: &RecordId, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        self.store.claim(id, claim).await
    }
    async fn complete(
        &self,
        id: &RecordId,
        token: Token,
        record: &Completed,
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.store.complete(id, token, record, retention).await
    }
    async fn release(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        self.store.release(id, token).await
    }
    async fn renew(&self, id: &RecordId, token: Token, lease: Duration) -> Result<(), StoreError> {
        self.store.renew(id, token, lease).await
    }
    async fn commit_point(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        self.store.commit_point(id, token).await
    }
    async fn mark_unknown(
        &self,
        id: &RecordId,
        token: Token,
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.store.mark_unknown(id, token, retention).await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.store.get(id).await
    }
    async fn wait(&self, id: &RecordId, max: Duration) -> Result<(), StoreError> {
        self.store.wait(id, max).await
    }
}

/// What a [`Proxy`] saw the clients send, by PostgreSQL frontend message.
///
/// In the extended query protocol a client waits for the server at each `Sync` (and a
/// simple `Query`): each is one round trip. A batch up to a `Sync` that holds an
/// `Execute` runs a statement; one that holds a `Parse` (and no `Execute`) prepares
/// one; an empty one is a ping (sqlx pings connections as they return to the pool).
#[derive(Debug, Default)]
pub struct Counts {
    pub statements: AtomicU64,
    pub prepares: AtomicU64,
    pub pings: AtomicU64,
    pub simple_queries: AtomicU64,
    pub connections: AtomicU64,
}

/// A snapshot of [`Counts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Seen {
    pub statements: u64,
    pub prepares: u64,
    pub pings: u64,
    pub simple_queries: u64,
    pub connections: u64,
}

impl std::ops::Sub for Seen {
    type Output = Seen;
    fn sub(self, o: Seen) -> Seen {
        Seen {
            statements: self.statements - o.statements,
            prepares: self.prepares - o.prepares,
            pings: self.pings - o.pings,
            simple_queries: self.simple_queries - o.simple_queries,
            connections: self.connections - o.connections,
        }
    }
}

/// A TCP proxy in front of the PostgreSQL of `DATABASE_URL` that counts the client's
/// round trips, and can stop forwarding ("freeze") to play a server that hangs.
#[derive(Debug)]
pub struct Proxy {
    pub addr: SocketAddr,
    counts: Arc<Counts>,
    frozen: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    pub async fn start() -> Proxy {
        let upstream = connect_options();
        let target = format!("{}:{}", upstream.get_host(), upstream.get_port());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counts = Arc::new(Counts::default());
        let (frozen, frozen_rx) = watch::channel(false);
        let task = {
            let counts = Arc::clone(&counts);
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let server = TcpStream::connect(&target)
                        .await
                        .unwrap_or_else(|e| unreachable(e));
                    counts.connections.fetch_add(1, Ordering::Relaxed);
                    tokio::spawn(pipe(client, server, Arc::clone(&counts), frozen_rx.clone()));
                }
            })
        };
        Proxy {
            addr,
            counts,
            frozen,
            task,
        }
    }

    /// Connection options to PostgreSQL through the proxy (TLS off, so that the
    /// protocol can be read).
    pub fn connect_options(&self) -> PgConnectOptions {
        connect_options()
            .host("127.0.0.1")
            .port(self.addr.port())
            .ssl_mode(PgSslMode::Disable)
    }

    pub fn seen(&self) -> Seen {
        let c = &self.counts;
        let get = |a: &AtomicU64| a.load(Ordering::SeqCst);
        Seen {
            statements: get(&c.statements),
            prepares: get(&c.prepares),
            pings: get(&c.pings),
            simple_queries: get(&c.simple_queries),
            connections: get(&c.connections),
        }
    }

    /// Stops (or resumes) forwarding client bytes to the server.
    pub fn freeze(&self, frozen: bool) {
        self.frozen.send_replace(frozen);
    }
}

async fn pipe(
    client: TcpStream,
    server: TcpStream,
    counts: Arc<Counts>,
    mut frozen: watch::Receiver<bool>,
) {
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    let back = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut server_rx, &mut client_tx).await;
        let _ = client_tx.shutdown().await;
    });
    let mut parser = Parser::default();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match client_rx.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        // Frozen: hold the bytes until thawed.
        if frozen.wait_for(|f| !*f).await.is_err() {
            break;
        }
        parser.feed(&buf[..n], &counts);
        if server_tx.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = server_tx.shutdown().await;
    let _ = back.await;
}

/// Splits the client's byte stream into frontend messages.
#[derive(Default)]
struct Parser {
    started: bool,
    pending: Vec<u8>,
    saw_execute: bool,
    saw_parse: bool,
}

impl Parser {
    fn feed(&mut self, bytes: &[u8], counts: &Counts) {
        self.pending.extend_from_slice(bytes);
        loop {
            if !self.started {
                // The startup packet: length, protocol version, parameters (no type).
                if self.pending.len() < 4 {
                    return;
                }
                let len = u32::from_be_bytes(self.pending[..4].try_into().unwrap()) as usize;
                if self.pending.len() < len {
                    return;
                }
                self.pending.drain(..len);
                self.started = true;
                continue;
            }
            if self.pending.len() < 5 {
                return;
            }
            let kind = self.pending[0];
            let len = u32::from_be_bytes(self.pending[1..5].try_into().unwrap()) as usize;
            if self.pending.len() < 1 + len {
                return;
            }
            self.pending.drain(..1 + len);
            match kind {
                b'P' => self.saw_parse = true,
                b'E' => self.saw_execute = true,
                b'Q' => {
                    counts.simple_queries.fetch_add(1, Ordering::SeqCst);
                }
                b'S' => {
                    let counter = if self.saw_execute {
                        &counts.statements
                    } else if self.saw_parse {
                        &counts.prepares
                    } else {
                        &counts.pings
                    };
                    counter.fetch_add(1, Ordering::SeqCst);
                    self.saw_execute = false;
                    self.saw_parse = false;
                }
                _ => {}
            }
        }
    }
}
