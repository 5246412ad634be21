use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use retrysafe_core::__private::Validate;
use retrysafe_core::ConfigError;
use retrysafe_tower::__private::duration_setting;
use sqlx::PgPool;

use super::sql::{self, TxSql};
use crate::{PostgresStore, SynchronousCommit};

/// The backend of the
/// [`TxIdempotencyLayer`](super::TxIdempotencyLayer): where the transactions run (the
/// pool, the key table) and how long their steps may take. See the
/// [module docs](super) for the pattern.
///
/// Its builder methods take and return it and never fail: a refused value keeps the
/// default and is named by the layer's [`build`](retrysafe_tower::idempotency::IdempotencyLayer::build).
/// The guard's options (methods, key, scope, limits,
/// retention, in-flight policy, …) are methods of the layer:
///
/// ```no_run
/// use std::time::Duration;
/// use retrysafe::postgres::PostgresStore;
/// use retrysafe::postgres::tx::{TxBackend, TxIdempotencyLayer};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
/// let backend = TxBackend::from_store(&store).acquire_timeout(Duration::from_millis(500));
/// let layer = TxIdempotencyLayer::with_backend(backend)
///     .require_key()
///     .wait_for_in_flight(Duration::from_secs(5))
///     .build()?;
/// assert_eq!(layer.backend().table_name(), store.table());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct TxBackend {
    pub(crate) pool: PgPool,
    pub(crate) schema: Option<String>,
    pub(crate) table: String,
    pub(crate) sql: Arc<TxSql>,
    pub(crate) begin: String,
    pub(crate) acquire_timeout: Duration,
    pub(crate) commit_timeout: Duration,
    pub(crate) idle_in_transaction: Duration,
    /// The `synchronous_commit` level set (`SET LOCAL`) on every transaction: the
    /// store's, for a store built on a pool of yours with one.
    pub(crate) synchronous_commit: Option<SynchronousCommit>,
    /// The settings a setter refused, reported by the layer's `build`.
    pub(crate) checks: Validate,
}

impl fmt::Debug for TxBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TxBackend")
            .field("table", &self.sql.store.table)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("commit_timeout", &self.commit_timeout)
            .field("idle_in_transaction_timeout", &self.idle_in_transaction)
            .finish_non_exhaustive()
    }
}

/// The longest timeout accepted (30 days).
const MAX_SPAN: Duration = retrysafe_core::wire::MAX_TIMEOUT;
/// The longest `idle_in_transaction_session_timeout` PostgreSQL accepts (an `int` of
/// milliseconds).
const MAX_IDLE: Duration = Duration::from_millis(i32::MAX as u64);

impl TxBackend {
    /// Transactions on `pool`, with the [`PostgresStore`]'s default table
    /// (`retrysafe_idempotency`, created by [`PostgresStore::migrate`]) and the
    /// defaults: 1 s to acquire a connection and open the transaction, 5 s to complete
    /// and commit, a 10 s `idle_in_transaction_session_timeout`.
    ///
    /// Each request checks a connection out of `pool`: with sqlx's default
    /// `test_before_acquire`, that adds a ping (one round trip) per request; the pools
    /// [`PostgresStore::connect`] makes skip it.
    pub fn new(pool: PgPool) -> Self {
        Self::make(pool, None, crate::sql::DEFAULT_TABLE.to_owned())
    }

    /// Transactions on the store's pool and table: key rows the layer commits are
    /// records that the store reads
    /// ([`get`](retrysafe_core::store::IdempotencyStore::get)) and that its sweeper
    /// deletes once expired.
    ///
    /// A pool made by [`PostgresStore::connect`] sets the server's `statement_timeout` to
    /// the store's call timeout (1 s by default): it then bounds the handlers'
    /// statements too. Give the layer a pool of its own with [`new`](Self::new) and
    /// [`schema`](Self::schema) / [`table`](Self::table) for other settings. The
    /// transactions commit at the store's
    /// [`synchronous_commit`](crate::PostgresStoreOptions::synchronous_commit) level: a
    /// connected pool's sessions have it, and on a pool given to
    /// [`build`](crate::PostgresStoreOptions::build) each transaction sets it
    /// (`SET LOCAL`).
    pub fn from_store(store: &PostgresStore) -> Self {
        // The store's table name is validated, and qualified as `schema.table` when it
        // has a schema.
        let (schema, table) = match store.table().split_once('.') {
            Some((s, t)) => (Some(s.to_owned()), t.to_owned()),
            None => (None, store.table().to_owned()),
        };
        let mut backend = Self::make(store.pool().clone(), schema, table);
        backend.synchronous_commit = store.local_level();
        backend.begin = sql::begin(backend.idle_in_transaction, backend.synchronous_commit);
        backend
    }

    fn make(pool: PgPool, schema: Option<String>, table: String) -> Self {
        let idle = Duration::from_secs(10);
        TxBackend {
            pool,
            sql: Arc::new(TxSql::new(schema.as_deref(), &table)),
            schema,
            table,
            begin: sql::begin(idle, None),
            acquire_timeout: Duration::from_secs(1),
            commit_timeout: Duration::from_secs(5),
            idle_in_transaction: idle,
            synchronous_commit: None,
            checks: Validate::new(),
        }
    }

    /// The schema of the key table (default: none, the connection's `search_path`), as
    /// in [`PostgresStoreOptions::schema`](crate::PostgresStoreOptions::schema).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        let schema = schema.into();
        if self
            .checks
            .take(crate::sql::check_schema(&schema))
            .is_some()
        {
            self.sql = Arc::new(TxSql::new(Some(&schema), &self.table));
            self.schema = Some(schema);
        }
        self
    }

    /// The key table (default `retrysafe_idempotency`), as in
    /// [`PostgresStoreOptions::table`](crate::PostgresStoreOptions::table).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        let table = table.into();
        if self.checks.take(crate::sql::check_table(&table)).is_some() {
            self.sql = Arc::new(TxSql::new(self.schema.as_deref(), &table));
            self.table = table;
        }
        self
    }

    /// How long a request may take to check a connection out of the pool, begin its
    /// transaction and take its key (default 1 s); with a
    /// [`Deadline`](retrysafe_core::Deadline) extension, the sooner of the two. Past it,
    /// 503 `store-unavailable` with `retry-after`.
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        let checked = duration_setting(timeout, "acquire_timeout", MAX_SPAN);
        if let Some(t) = self.checks.take(checked) {
            self.acquire_timeout = t;
        }
        self
    }

    /// How long writing the key row and committing may take after the handler answered
    /// (default 5 s). Past it, or when either fails, the answer is 503
    /// `store-unavailable`: the retry finds the key committed (and replays) or absent
    /// (and runs).
    pub fn commit_timeout(mut self, timeout: Duration) -> Self {
        let checked = duration_setting(timeout, "commit_timeout", MAX_SPAN);
        if let Some(t) = self.checks.take(checked) {
            self.commit_timeout = t;
        }
        self
    }

    /// The `idle_in_transaction_session_timeout` set (`SET LOCAL`) on every transaction
    /// (default 10 s, whole milliseconds, at most about 24 days): a transaction left
    /// idle that long — its application host vanished, a leaked guard, a handler waiting
    /// on something else — is ended by the server, which rolls it back and frees its
    /// key. Response bodies are collected for at most half of it.
    pub fn idle_in_transaction_timeout(mut self, timeout: Duration) -> Self {
        let checked =
            duration_setting(timeout, "idle_in_transaction_timeout", MAX_IDLE).and_then(|t| {
                if t < Duration::from_millis(1) {
                    Err(ConfigError::new(
                        "idle_in_transaction_timeout",
                        "must be at least 1 ms",
                    ))
                } else {
                    Ok(t)
                }
            });
        if let Some(t) = self.checks.take(checked) {
            self.idle_in_transaction = t;
            self.begin = sql::begin(t, self.synchronous_commit);
        }
        self
    }

    /// Validates the settings: every one a setter refused is named in the error. (The
    /// layer's [`build`](retrysafe_tower::idempotency::IdempotencyLayer::build) checks
    /// them too.)
    pub fn build(self) -> Result<Self, ConfigError> {
        self.checks.clone().finish(self)
    }

    /// The pool the layer takes its connections from.
    #[doc(hidden)]
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The key table, qualified by its schema when one is set.
    #[doc(hidden)]
    pub fn table_name(&self) -> &str {
        &self.sql.store.table
    }
}
