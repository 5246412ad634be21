//! What the tests of `retrysafe-postgres` share: isolated, migrated stores in schemas
//! of their own on the PostgreSQL at `DATABASE_URL`, stores shared by reference, and
//! the round-trip counting proxy in front of that server.

use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use retrysafe_core::idempotency::{Completed, Record, RecordId, Token, UnknownReason};
use retrysafe_core::recovery::{PendingRecord, ReconcilableStore, Settlement};
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, StoreError};
use retrysafe_postgres::sqlx::postgres::PgConnectOptions;
use retrysafe_postgres::sqlx::{self, Connection, PgConnection};
use retrysafe_postgres::{PostgresStore, PostgresStoreOptions};

use crate::proxy::postgres::{PgProxy, Seen};
pub use crate::services::{database_url, pg_admin, pg_options};
use crate::services::{drop_stale_schemas, pg_unreachable, unique};

/// Prefix of the schemas the tests create: `rspg_<unix seconds>_<random>`.
const SCHEMA_PREFIX: &str = "rspg_";

/// A fresh schema name, unique to one test.
pub fn fresh_schema() -> String {
    format!("{SCHEMA_PREFIX}{}", unique())
}

/// An isolated, migrated store in its own schema (dropped, best effort, when the store
/// is dropped), with a pool of at most 4 connections. `configure` adjusts its settings.
pub async fn isolated_store(
    configure: impl FnOnce(PostgresStoreOptions) -> PostgresStoreOptions,
) -> TestStore {
    isolated_store_with(pg_options(), configure).await
}

/// Like [`isolated_store`], connecting with `options`.
pub async fn isolated_store_with(
    options: PgConnectOptions,
    configure: impl FnOnce(PostgresStoreOptions) -> PostgresStoreOptions,
) -> TestStore {
    drop_stale_schemas(SCHEMA_PREFIX).await;
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
        .unwrap_or_else(|e| pg_unreachable(e));
    store.migrate().await.unwrap();
    TestStore { store, schema }
}

/// A store in its own schema; drops the schema when dropped.
#[derive(Debug)]
pub struct TestStore {
    /// The store.
    pub store: PostgresStore,
    /// Its schema.
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
        let options = pg_options();
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
    /// A proxy to the server of `DATABASE_URL`.
    pub async fn start() -> Proxy {
        Proxy(
            PgProxy::start(&pg_options())
                .await
                .unwrap_or_else(|e| pg_unreachable(e)),
        )
    }

    /// Connection options to PostgreSQL through the proxy.
    pub fn connect_options(&self) -> PgConnectOptions {
        self.0.connect_options(&pg_options())
    }

    /// What the clients sent so far, by round trip.
    pub fn seen(&self) -> Seen {
        self.0.seen()
    }

    /// Stops (or resumes) forwarding bytes: a server that hangs.
    pub fn freeze(&self, frozen: bool) {
        self.0.proxy().stall(frozen);
    }
}
