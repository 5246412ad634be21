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

use std::ops::Deref;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use retrysafe_core::idempotency::{Completed, Record, RecordId, Token, UnknownReason};
use retrysafe_core::recovery::{PendingRecord, ReconcilableStore, Settlement};
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, StoreError};
use retrysafe_postgres::sqlx::postgres::PgConnectOptions;
use retrysafe_postgres::sqlx::{self, Connection, PgConnection};
use retrysafe_postgres::{PostgresStore, PostgresStoreOptions};
use retrysafe_test_support::proxy::postgres::{PgProxy, Seen};

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
/// is dropped), with a pool of at most 4 connections. `configure` adjusts its settings.
pub async fn isolated_store(
    configure: impl FnOnce(PostgresStoreOptions) -> PostgresStoreOptions,
) -> TestStore {
    isolated_store_with(connect_options(), configure).await
}

/// Like [`isolated_store`], connecting with `options`.
pub async fn isolated_store_with(
    options: PgConnectOptions,
    configure: impl FnOnce(PostgresStoreOptions) -> PostgresStoreOptions,
) -> TestStore {
    drop_stale_schemas().await;
    let schema = fresh_schema();
    let settings = PostgresStore::options()
        .schema(schema.clone())
        .max_connections(4)
        // Generous: a loaded test machine must not turn slowness into failures.
        .call_timeout(Duration::from_secs(10))
        .connect_timeout(Duration::from_secs(10));
    let store = configure(settings)
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
    async fn claim(&self, id: &RecordId, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
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
    async fn commit_point_with(
        &self,
        id: &RecordId,
        token: Token,
        note: &[u8],
    ) -> Result<(), StoreError> {
        self.store.commit_point_with(id, token, note).await
    }
    async fn mark_notified(&self, id: &RecordId) -> Result<(), StoreError> {
        self.store.mark_notified(id).await
    }
    fn reconciled(&self) -> bool {
        self.store.reconciled()
    }
    async fn mark_unknown(
        &self,
        id: &RecordId,
        token: Token,
        retention: Duration,
        reason: UnknownReason,
    ) -> Result<(), StoreError> {
        self.store.mark_unknown(id, token, retention, reason).await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.store.get(id).await
    }
    async fn wait(&self, id: &RecordId, max: Duration) -> Result<(), StoreError> {
        self.store.wait(id, max).await
    }
}

/// A [`TestStore`] shared by clones (a reconciler holds one): the schema is dropped
/// with the last clone.
#[derive(Debug, Clone)]
pub struct SharedStore(pub Arc<TestStore>);

/// An isolated store (see [`isolated_store`]) that a reconciler can hold.
pub async fn shared_store() -> SharedStore {
    SharedStore(Arc::new(isolated_store(|b| b).await))
}

impl IdempotencyStore for SharedStore {
    async fn claim(&self, id: &RecordId, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        self.0.claim(id, claim).await
    }
    async fn complete(
        &self,
        id: &RecordId,
        token: Token,
        record: &Completed,
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.0.complete(id, token, record, retention).await
    }
    async fn release(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        self.0.release(id, token).await
    }
    async fn renew(&self, id: &RecordId, token: Token, lease: Duration) -> Result<(), StoreError> {
        self.0.renew(id, token, lease).await
    }
    async fn commit_point(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        self.0.commit_point(id, token).await
    }
    async fn commit_point_with(
        &self,
        id: &RecordId,
        token: Token,
        note: &[u8],
    ) -> Result<(), StoreError> {
        self.0.commit_point_with(id, token, note).await
    }
    async fn mark_unknown(
        &self,
        id: &RecordId,
        token: Token,
        retention: Duration,
        reason: UnknownReason,
    ) -> Result<(), StoreError> {
        self.0.mark_unknown(id, token, retention, reason).await
    }
    async fn mark_notified(&self, id: &RecordId) -> Result<(), StoreError> {
        self.0.mark_notified(id).await
    }
    fn reconciled(&self) -> bool {
        self.0.reconciled()
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.0.get(id).await
    }
    async fn wait(&self, id: &RecordId, max: Duration) -> Result<(), StoreError> {
        self.0.wait(id, max).await
    }
}

impl ReconcilableStore for SharedStore {
    async fn due(&self, stale: Duration, limit: usize) -> Result<Vec<RecordId>, StoreError> {
        self.0.store.due(stale, limit).await
    }
    async fn list_pending(&self, limit: usize) -> Result<Vec<RecordId>, StoreError> {
        self.0.store.list_pending(limit).await
    }
    async fn adopt(
        &self,
        id: &RecordId,
        token: Token,
        hold: Duration,
        stale: Option<Duration>,
    ) -> Result<Option<PendingRecord>, StoreError> {
        self.0.store.adopt(id, token, hold, stale).await
    }
    async fn peek(&self, id: &RecordId) -> Result<Option<PendingRecord>, StoreError> {
        self.0.store.peek(id).await
    }
    async fn settle(
        &self,
        id: &RecordId,
        token: Token,
        settlement: Settlement,
        notified: bool,
    ) -> Result<(), StoreError> {
        self.0.store.settle(id, token, settlement, notified).await
    }
    fn set_reconciled(&self, running: bool) {
        self.0.store.set_reconciled(running);
    }
}

/// The round-trip counting proxy, in front of the PostgreSQL of `DATABASE_URL`.
#[derive(Debug)]
pub struct Proxy(PgProxy);

impl Proxy {
    pub async fn start() -> Proxy {
        Proxy(
            PgProxy::start(&connect_options())
                .await
                .unwrap_or_else(|e| unreachable(e)),
        )
    }

    /// Connection options to PostgreSQL through the proxy.
    pub fn connect_options(&self) -> PgConnectOptions {
        self.0.connect_options(&connect_options())
    }

    pub fn seen(&self) -> Seen {
        self.0.seen()
    }

    /// Stops (or resumes) forwarding bytes: a server that hangs.
    pub fn freeze(&self, frozen: bool) {
        self.0.proxy().stall(frozen);
    }
}
