//! [`PostgresStore`]: an [`IdempotencyStore`] on one PostgreSQL table, and its sweeper.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use retrysafe_core::__private::{Reconcilers, Validate};
use retrysafe_core::ConfigError;
use retrysafe_core::idempotency::{
    CommitPoint, Completed, DecodeError, Fingerprint, InProgress, OutcomeUnknown, Record, RecordId,
    RequestInfo, Resolving, Token, UnknownReason,
};
use retrysafe_core::observe::Name;
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, MAX_NOTE, StoreError};
use sqlx::Row;
use sqlx::postgres::{
    PgArguments, PgConnectOptions, PgPool, PgPoolOptions, PgQueryResult, PgRow, Postgres,
};
use sqlx::query::Query;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::replication::{self, SynchronousCommit};
use crate::sql::{self, STATE_COMPLETED, STATE_IN_PROGRESS, STATE_UNKNOWN, Sql};

/// Durations longer than this (a century) are clamped.
pub(crate) const MAX_SPAN: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// How many times a claim statement is repeated when it found the key taken by a row
/// its snapshot could not see yet (a concurrent first claim committed meanwhile).
const CLAIM_ATTEMPTS: usize = 8;

/// An [`IdempotencyStore`] on a PostgreSQL table, through a sqlx [`PgPool`].
///
/// One row per record, keyed by the [`RecordId`] bytes (the table is described in the
/// [crate docs](crate)). Every store call is one SQL statement — one round trip once
/// the statement is prepared on the connection — timed out after the
/// [`call_timeout`](PostgresStoreOptions::call_timeout) (default 1 s):
///
/// - a claim is one `INSERT … ON CONFLICT (k) DO UPDATE … WHERE … RETURNING …` that
///   inserts the claim, replaces a row past its retention, takes over an expired lease
///   whose holder had not reached its commit point (same fingerprint), or turns an
///   expired lease past the commit point into `outcome_unknown`, atomically; any other
///   existing row is returned by the same statement. (When a concurrent first claim of
///   the same key commits while the statement runs, the statement's snapshot cannot
///   see the winner's row and is repeated: a second round trip on that losing path.
///   A claim that leaves an existing row alone — a replay, a copy of a request in
///   flight — still locks it for the moment of the statement, as
///   `ON CONFLICT DO UPDATE` does.)
/// - complete, release, renew, commit point and mark-unknown are one `UPDATE` whose
///   `WHERE` checks the token; no row means [`StoreError::StaleToken`] (a token that
///   never held the record, one that lost it, and an absent record alike). Each
///   matches the same call sent again after a lost reply too: a completion the
///   identical completed row, a mark the `outcome_unknown` row it made (which keeps its
///   token), a release the row it released, which stays dead (absent to every reader,
///   replaced by the next claim) with its token for
///   [`RESEND_WINDOW`](retrysafe_core::store::RESEND_WINDOW) before the sweeper deletes
///   it;
/// - the reconciler's calls ([`ReconcilableStore`](retrysafe_core::recovery::ReconcilableStore))
///   are one statement each too (a completing settlement reads the fingerprint first);
///   a live adoption makes every token call above fail with
///   [`StoreError::StaleToken`], and reads and claims see
///   [`Record::Resolving`];
/// - all time comes from `clock_timestamp()`, the database's clock;
/// - a record is absent from the end of its retention; the rows stay until deleted by
///   [`sweep_expired`](Self::sweep_expired) or a [sweeper](Self::spawn_sweeper).
///
/// On a pool given to [`build`](PostgresStoreOptions::build) with a
/// [`synchronous_commit`](PostgresStoreOptions::synchronous_commit) level, each write
/// runs in a transaction of its own that sets the level: `BEGIN` and `COMMIT` add two
/// round trips to it.
///
/// A timed-out call is [`StoreError::Timeout`] (also when the pool could not hand out a
/// connection in time), any other database failure [`StoreError::Unavailable`], and a
/// row that does not decode [`StoreError::Corrupt`].
///
/// Cloning is cheap and shares the pool.
///
/// ```no_run
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use retrysafe::postgres::PostgresStore;
///
/// let store = PostgresStore::options()
///     .schema("idempotency")
///     .table("records")
///     .call_timeout(Duration::from_millis(500))
///     .connect("postgres://postgres@127.0.0.1:5432/test")
///     .await?;
/// store.migrate().await?;
/// let sweeper = store.spawn_sweeper(Duration::from_secs(60), 1_000)?;
/// // … serve requests …
/// sweeper.stop().await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    sql: Sql,
    call_timeout: Duration,
    reconcilers: Reconcilers,
    name: Name,
    /// On a pool given to `build` with a `synchronous_commit` level: the level, and the
    /// `BEGIN` (with its `SET LOCAL`s) of the transaction each write runs in.
    local: Option<(SynchronousCommit, String)>,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("name", &self.inner.name)
            .field("table", &self.inner.sql.table)
            .field("call_timeout", &self.inner.call_timeout)
            .field("pool_size", &self.inner.pool.size())
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// The default table name, `retrysafe_idempotency` (in the connection's
    /// `search_path`).
    #[doc(hidden)]
    pub const DEFAULT_TABLE: &'static str = sql::DEFAULT_TABLE;

    /// The default store-call timeout: 1 s.
    #[doc(hidden)]
    pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(1);

    /// The store's name ([`PostgresStoreOptions::name`]; `default` unless set).
    pub fn name(&self) -> &Name {
        &self.inner.name
    }

    /// A store on `pool` with the default table and call timeout. See
    /// [`PostgresStoreOptions`] for the pool settings the store relies on.
    pub fn new(pool: PgPool) -> Self {
        PostgresStore {
            inner: Arc::new(Inner {
                pool,
                sql: Sql::new(None, sql::DEFAULT_TABLE),
                call_timeout: Self::DEFAULT_CALL_TIMEOUT,
                reconcilers: Reconcilers::default(),
                local: None,
                name: Name::default(),
            }),
        }
    }

    /// Connects a pool to `url` with the defaults of [`options`](Self::options) and
    /// makes a store on it. Does not create the table: see [`migrate`](Self::migrate).
    pub async fn connect(url: &str) -> Result<Self, PostgresStoreError> {
        Self::options().connect(url).await
    }

    /// The settings of a store (table, call timeout, connected pool) with their
    /// defaults, to be changed and then [connected](PostgresStoreOptions::connect) or
    /// [built](PostgresStoreOptions::build) on a pool of yours.
    pub fn options() -> PostgresStoreOptions {
        PostgresStoreOptions::new()
    }

    /// The pool the store uses.
    #[doc(hidden)]
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The table, qualified by its schema when one is set.
    #[doc(hidden)]
    pub fn table(&self) -> &str {
        &self.inner.sql.table
    }

    /// The SQL that [`migrate`](Self::migrate) runs, for users who run their own
    /// migrations: `CREATE SCHEMA IF NOT EXISTS` (when a schema is set),
    /// `CREATE TABLE IF NOT EXISTS`, `CREATE INDEX IF NOT EXISTS` for the expiry,
    /// `ALTER TABLE … ADD COLUMN IF NOT EXISTS` for the recovery columns, and
    /// `CREATE INDEX IF NOT EXISTS` for the pending rows, each ending with `;`.
    ///
    /// ```
    /// use retrysafe::postgres::PostgresStore;
    /// let sql = PostgresStore::options().schema("app").table("keys").migration_sql().unwrap();
    /// assert!(sql.contains("CREATE TABLE IF NOT EXISTS app.keys ("));
    /// assert!(sql.contains("ON app.keys (expires_at)"));
    /// assert!(sql.contains("ALTER TABLE app.keys\n    ADD COLUMN IF NOT EXISTS request"));
    /// ```
    #[doc(hidden)]
    pub fn migration_sql(&self) -> String {
        self.inner.sql.migration_script()
    }

    /// Creates the schema (when one is set), the table and its indexes if they do not
    /// exist, and adds the recovery columns to a table made by an earlier release (see
    /// the [crate docs](crate#the-table)). Idempotent, and safe to run from several
    /// processes at once: it is one script, run as one transaction under an advisory
    /// lock on the table name. Not bounded by the call timeout.
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(&self.inner.sql.migrate)
            .execute(&self.inner.pool)
            .await
            .map(drop)
    }

    /// Deletes the rows past their retention, in batches of `batch` rows (one statement
    /// each, skipping rows another session holds locked), until a batch comes back
    /// short. A `batch` of 0 counts as 1.
    ///
    /// An `in_progress` row is kept until its lease end plus its claim's retention:
    /// that is as long as the `outcome_unknown` record an expired lease would become.
    ///
    /// On a pool made by [`connect`](PostgresStoreOptions::connect) each batch runs
    /// under the server's `statement_timeout`, set to the call timeout: keep batches to
    /// a few thousand rows.
    pub async fn sweep_expired(&self, batch: u32) -> Result<Swept, sqlx::Error> {
        self.sweep_until(batch, || false).await
    }

    async fn sweep_until(
        &self,
        batch: u32,
        mut stop: impl FnMut() -> bool,
    ) -> Result<Swept, sqlx::Error> {
        let batch = batch.max(1);
        let mut swept = Swept::default();
        loop {
            let rows = sqlx::query(&self.inner.sql.sweep)
                .bind(i64::from(batch))
                .execute(&self.inner.pool)
                .await?
                .rows_affected();
            swept.rows += rows;
            swept.batches += 1;
            if rows < u64::from(batch) || stop() {
                return Ok(swept);
            }
        }
    }

    /// Spawns a task that runs [`sweep_expired`](Self::sweep_expired) every `interval`
    /// (first right away), logging failures with `tracing` and carrying on. The task
    /// stops when the handle is dropped or [stopped](SweeperHandle::stop), after the
    /// batch it is running.
    ///
    /// Refuses a zero interval or batch, and a call outside a tokio runtime.
    pub fn spawn_sweeper(
        &self,
        interval: Duration,
        batch: u32,
    ) -> Result<SweeperHandle, ConfigError> {
        if interval.is_zero() {
            return Err(ConfigError::new("interval", "must be greater than zero"));
        }
        if batch == 0 {
            return Err(ConfigError::new("batch", "must be greater than zero"));
        }
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| ConfigError::new("runtime", "spawn_sweeper needs a tokio runtime"))?;
        let (stop_tx, mut stop_rx) = oneshot::channel::<()>();
        let store = self.clone();
        let task = runtime.spawn(async move {
            let mut ticks = tokio::time::interval(interval.min(MAX_SPAN));
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    biased;
                    _ = &mut stop_rx => break,
                    _ = ticks.tick() => {}
                }
                let stopped =
                    || !matches!(stop_rx.try_recv(), Err(oneshot::error::TryRecvError::Empty));
                match store.sweep_until(batch, stopped).await {
                    Ok(swept) => tracing::debug!(
                        name = store.name().as_str(),
                        table = %store.table(),
                        rows = swept.rows,
                        batches = swept.batches,
                        "swept expired idempotency records"
                    ),
                    Err(error) => tracing::warn!(
                        name = store.name().as_str(),
                        table = %store.table(),
                        %error,
                        "sweeping expired idempotency records failed"
                    ),
                }
            }
        });
        Ok(SweeperHandle {
            stop: stop_tx,
            task,
        })
    }

    /// The rendered statements of the table.
    pub(crate) fn sql(&self) -> &Sql {
        &self.inner.sql
    }

    /// The count of reconcilers running for this store.
    pub(crate) fn reconcilers(&self) -> &Reconcilers {
        &self.inner.reconcilers
    }

    /// Runs `f` under the call timeout: [`StoreError::Timeout`] when it runs out.
    pub(crate) async fn call<T>(
        &self,
        f: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(self.inner.call_timeout, f)
            .await
            .unwrap_or(Err(StoreError::Timeout))
    }

    /// The `synchronous_commit` level the store sets with `SET LOCAL` on each write's
    /// transaction: on a pool given to [`build`](PostgresStoreOptions::build) with a
    /// level; `None` otherwise (a connected pool sets it on its sessions).
    pub(crate) fn local_level(&self) -> Option<SynchronousCommit> {
        self.inner.local.as_ref().map(|(level, _)| *level)
    }

    /// Runs a write statement: on its own, or, on a pool given to
    /// [`build`](PostgresStoreOptions::build) with a `synchronous_commit` level, in a
    /// transaction of its own that sets the level (`SET LOCAL`), so that its commit
    /// waits as asked, and only its own.
    pub(crate) async fn write(
        &self,
        query: Query<'_, Postgres, PgArguments>,
    ) -> Result<PgQueryResult, sqlx::Error> {
        let Some((_, begin)) = &self.inner.local else {
            return query.execute(&self.inner.pool).await;
        };
        let mut tx = self.inner.pool.begin_with(begin.clone()).await?;
        let done = query.execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(done)
    }

    /// Like [`write`](Self::write), for a write that returns at most one row.
    pub(crate) async fn write_returning(
        &self,
        query: Query<'_, Postgres, PgArguments>,
    ) -> Result<Option<PgRow>, sqlx::Error> {
        let Some((_, begin)) = &self.inner.local else {
            return query.fetch_optional(&self.inner.pool).await;
        };
        let mut tx = self.inner.pool.begin_with(begin.clone()).await?;
        let row = query.fetch_optional(&mut *tx).await?;
        tx.commit().await?;
        Ok(row)
    }

    /// Runs a token-checked change: one row changed, or the token is stale.
    pub(crate) async fn change(
        &self,
        query: Query<'_, Postgres, PgArguments>,
    ) -> Result<(), StoreError> {
        self.call(async {
            let done = self.write(query).await.map_err(db_error)?;
            if done.rows_affected() == 0 {
                Err(StoreError::StaleToken)
            } else {
                Ok(())
            }
        })
        .await
    }
}

/// What [`PostgresStore::sweep_expired`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Swept {
    /// Rows deleted.
    pub rows: u64,
    /// Statements run (one per batch).
    pub batches: u64,
}

/// Stops the sweeper of [`PostgresStore::spawn_sweeper`] when dropped or
/// [stopped](Self::stop).
#[derive(Debug)]
pub struct SweeperHandle {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl SweeperHandle {
    /// Stops the sweeper and waits for it to finish the batch it is running.
    pub async fn stop(self) {
        let SweeperHandle { stop, task } = self;
        drop(stop);
        // A panicked or cancelled task has stopped too.
        let _ = task.await;
    }

    /// Whether the sweeper task has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

/// The settings of a [`PostgresStore`]: made by [`PostgresStore::options`] (or `new`, or
/// `default`) with the defaults, changed by setters that never fail, and validated once
/// where the store is made: [`connect`](Self::connect) /
/// [`connect_with`](Self::connect_with), which open a pool with these settings, or
/// [`build`](Self::build), on a pool of yours. Every refused setting is named.
///
/// A value of its own rather than setters on the store: a store holds a pool, and the
/// pool a connected store opens depends on these settings (its size, its timeouts), so
/// they exist before the store does; and the store's [`table`](PostgresStore::table)
/// reads its setting back.
///
/// A connected pool:
///
/// - does not ping a connection before handing it out (sqlx's `test_before_acquire`,
///   which would add a round trip to every store call): a connection the server closed
///   fails one call with [`StoreError::Unavailable`] and is replaced;
/// - sets the server's `statement_timeout` to the call timeout (twice that with a
///   [`synchronous_commit`](Self::synchronous_commit) level that waits for a standby),
///   so a statement the store gave up on does not keep running (and holding its
///   connection) on the server;
/// - reads the replication settings once ([`PostgresStore::check_replication`]) and
///   logs a warning when a promoted standby could miss acknowledged records;
/// - opens a first connection at once, so that a server that is down is reported
///   straight away with its address ("connection refused at 127.0.0.1:5432"); waits at
///   most [`connect_timeout`](Self::connect_timeout) (default 5 s) for a connection,
///   and holds up to [`max_connections`](Self::max_connections) (default 10).
///
/// A pool given to [`build`](Self::build) is used as it is (a
/// [`synchronous_commit`](Self::synchronous_commit) level aside, which the store sets on
/// its own transactions); consider the same settings.
///
/// ```
/// use std::time::Duration;
/// use retrysafe::postgres::PostgresStore;
/// let options = PostgresStore::options()
///     .schema("idempotency")
///     .table("records")
///     .call_timeout(Duration::from_millis(250));
/// assert!(options.migration_sql().unwrap().contains("idempotency.records"));
///
/// let refused = PostgresStore::options()
///     .table("Bad-Name")
///     .call_timeout(Duration::ZERO)
///     .migration_sql()
///     .unwrap_err();
/// assert_eq!(refused.fields().collect::<Vec<_>>(), ["call_timeout", "table"]);
/// ```
#[must_use]
#[derive(Debug, Clone)]
pub struct PostgresStoreOptions {
    schema: Option<String>,
    table: String,
    call_timeout: Duration,
    connect_timeout: Duration,
    max_connections: u32,
    synchronous_commit: Option<SynchronousCommit>,
    name: Name,
}

impl Default for PostgresStoreOptions {
    fn default() -> Self {
        PostgresStoreOptions {
            schema: None,
            table: sql::DEFAULT_TABLE.to_owned(),
            call_timeout: PostgresStore::DEFAULT_CALL_TIMEOUT,
            connect_timeout: Duration::from_secs(5),
            max_connections: 10,
            synchronous_commit: None,
            name: Name::default(),
        }
    }
}

impl PostgresStoreOptions {
    /// The defaults: the table `retrysafe_idempotency` in the connection's
    /// `search_path`, a 1 s call timeout, and a connected pool of up to 10 connections
    /// with a 5 s connect timeout.
    pub fn new() -> Self {
        PostgresStoreOptions::default()
    }

    /// The store's name (default `default`), carried by its tracing events (the
    /// sweeper's); see [`retrysafe_core::observe`].
    pub fn name(mut self, name: impl Into<Name>) -> Self {
        self.name = name.into();
        self
    }

    /// The schema of the table (default: none, the connection's `search_path`).
    /// [`migrate`](PostgresStore::migrate) creates it if needed. Lowercase ASCII
    /// letters, digits and underscores, not starting with a digit; at most 63 bytes.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// The table name (default `retrysafe_idempotency`). Lowercase ASCII letters,
    /// digits and underscores, not starting with a digit; at most 48 bytes (the index
    /// is named after it).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// How long one store call may take (default 1 s), pool checkout included; a call
    /// that takes longer fails with [`StoreError::Timeout`]. Must be greater than zero.
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// How long [`connect`](Self::connect) tries to open its first connection, and the
    /// pool's checkout timeout (default 5 s). Only for a connected pool. Must be greater
    /// than zero.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The most connections a connected pool holds (default 10). Only for a connected
    /// pool. Must be greater than zero.
    pub fn max_connections(mut self, max: u32) -> Self {
        self.max_connections = max;
        self
    }

    /// The `synchronous_commit` level of the store's writes (default: the server's, or
    /// the pool's sessions'). With a synchronous standby named in the server's
    /// `synchronous_standby_names`, [`SynchronousCommit::RemoteApply`] makes every claim,
    /// commit point and completion wait, before it is acknowledged, until the standby
    /// has applied it: a standby promoted after a failover then has every record the
    /// store acknowledged. With asynchronous replication a promoted standby may miss
    /// the last ones, and a copy of such a request runs again there.
    ///
    /// On a connected pool it is set on each connection as it opens (a startup
    /// parameter, like `statement_timeout`): no round trip per call. On a pool given to
    /// [`build`](Self::build), whose sessions are yours, each write of the store (claim,
    /// commit point, completion, release, renewal, mark, and the reconciler's adoptions
    /// and settlements) runs in a transaction of its own that begins with
    /// `SET LOCAL synchronous_commit` (and, for a level that waits for a standby,
    /// `SET LOCAL statement_timeout`, see below): the level applies to the store's
    /// commits and to nothing else on the pool, at the cost of two round trips per
    /// write (`BEGIN` and `COMMIT`). Reads are not affected. Either way, the
    /// transactional layer's transactions on the store's pool
    /// ([`TxBackend::from_store`](crate::tx::TxBackend::from_store)) commit at the same
    /// level. [`connect`](Self::connect) checks the server's settings and logs a warning
    /// when they do not match ([`PostgresStore::check_replication`]).
    ///
    /// A commit that waits for the standby and is cancelled (by `statement_timeout` or
    /// `pg_cancel_backend`) is committed on the primary but may be missing after a
    /// promotion, and PostgreSQL answers such a COMMIT with success and a warning, not
    /// an error. So with a level that waits for a standby, the store sets the server's
    /// `statement_timeout` to twice the call timeout: the store gives up first,
    /// and a call that runs out of its call timeout is [`StoreError::Timeout`], which
    /// the layer treats as an unknown outcome (a claim answered 503, a completion as
    /// `completion_lost`), never as success. (A client that stalls for longer than
    /// twice the call timeout could still read such a success.) End store sessions with
    /// `pg_terminate_backend`, which fails the call, never with `pg_cancel_backend`.
    pub fn synchronous_commit(mut self, level: SynchronousCommit) -> Self {
        self.synchronous_commit = Some(level);
        self
    }

    /// The migration SQL for this table (see [`PostgresStore::migration_sql`]), without
    /// a pool; refuses the invalid table settings, naming each.
    pub fn migration_sql(&self) -> Result<String, ConfigError> {
        let mut v = Validate::new();
        let sql = self.render(&mut v);
        Ok(v.finish(sql)?.migration_script())
    }

    /// Validates the settings and makes the store on `pool`, used as it is: refuses the
    /// invalid settings named on each method (the connected pool's own settings aside),
    /// naming each ([`PostgresStoreError::Config`]).
    pub fn build(self, pool: PgPool) -> Result<PostgresStore, PostgresStoreError> {
        let mut v = Validate::new();
        let sql = self.render(&mut v);
        let sql = v.finish(sql)?;
        let local = self.synchronous_commit.map(|level| {
            let mut begin = format!("BEGIN; SET LOCAL synchronous_commit = {level}");
            if level.waits_for_standby() {
                let ms = self.statement_millis();
                begin.push_str(&format!("; SET LOCAL statement_timeout = {ms}"));
            }
            (level, begin)
        });
        Ok(self.store(pool, sql, local))
    }

    /// Validates the settings, connects a pool to `url` (a `postgres://` URL) as
    /// described on [`PostgresStoreOptions`] and makes the store on it.
    ///
    /// Refused settings are [`PostgresStoreError::Config`], naming each, before
    /// anything is connected; a URL that does not parse is
    /// [`PostgresStoreError::InvalidUrl`]; a server that is down or does not answer is
    /// [`PostgresStoreError::Unreachable`] at once, naming its address; a refusal by
    /// the server (a login, a database that does not exist) is
    /// [`PostgresStoreError::Database`].
    pub async fn connect(self, url: &str) -> Result<PostgresStore, PostgresStoreError> {
        let options = PgConnectOptions::from_str(url)
            .map_err(|e| PostgresStoreError::InvalidUrl(e.to_string()))?;
        self.connect_with(options).await
    }

    /// Like [`connect`](Self::connect), from connection options.
    pub async fn connect_with(
        self,
        options: PgConnectOptions,
    ) -> Result<PostgresStore, PostgresStoreError> {
        let mut v = Validate::new();
        v.check(
            !self.connect_timeout.is_zero(),
            "connect_timeout",
            "must be greater than zero",
        );
        v.check(
            self.max_connections > 0,
            "max_connections",
            "must be greater than zero",
        );
        let sql = self.render(&mut v);
        let sql = v.finish(sql)?;
        let asked = self.synchronous_commit;
        let statement_ms = self.statement_millis();
        let mut options = options.options([("statement_timeout", statement_ms.to_string())]);
        if let Some(level) = asked {
            options = options.options([("synchronous_commit", level.as_str())]);
        }
        let connect_timeout = self.connect_timeout.min(MAX_SPAN);
        first_connection(&options, connect_timeout).await?;
        let pool = PgPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(connect_timeout)
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .map_err(PostgresStoreError::Database)?;
        let store = self.store(pool, sql, None);
        replication::warn_on_connect(&store, asked).await;
        Ok(store)
    }

    /// The statements of the table, when the call timeout, the schema and the table
    /// pass; otherwise their refusals go to `v`.
    fn render(&self, v: &mut Validate) -> Sql {
        v.check(
            !self.call_timeout.is_zero(),
            "call_timeout",
            "must be greater than zero",
        );
        if let Some(schema) = &self.schema {
            v.take(sql::check_schema(schema));
        }
        v.take(sql::check_table(&self.table));
        Sql::new(self.schema.as_deref(), &self.table)
    }

    /// The server's `statement_timeout` for the store's statements, in whole
    /// milliseconds rounded up, so that the server never gives up first. A
    /// statement_timeout that ends a commit's wait for the standby makes the COMMIT
    /// answer success (with a warning) though the standby may not have it: with a level
    /// that waits, it is twice the call timeout, so that the store gives up first and
    /// reports a timeout, an unknown outcome.
    fn statement_millis(&self) -> u128 {
        let ms = self.call_timeout.min(MAX_SPAN).as_micros().div_ceil(1000);
        match self.synchronous_commit {
            Some(level) if level.waits_for_standby() => ms.saturating_mul(2),
            _ => ms,
        }
    }

    fn store(
        self,
        pool: PgPool,
        sql: Sql,
        local: Option<(SynchronousCommit, String)>,
    ) -> PostgresStore {
        PostgresStore {
            inner: Arc::new(Inner {
                pool,
                sql,
                call_timeout: self.call_timeout,
                reconcilers: Reconcilers::default(),
                name: self.name,
                local,
            }),
        }
    }
}

/// Opens one connection before the pool does, so that a server that is down or
/// refuses the login says so at once, naming its address — the pool would retry until
/// its acquire timeout and then report only that it timed out.
async fn first_connection(
    options: &PgConnectOptions,
    within: Duration,
) -> Result<(), PostgresStoreError> {
    use sqlx::{ConnectOptions, Connection};
    let at = match options.get_socket() {
        Some(socket) => socket.display().to_string(),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    };
    match tokio::time::timeout(within, options.connect()).await {
        Ok(Ok(connection)) => {
            let _ = connection.close().await;
            Ok(())
        }
        Ok(Err(sqlx::Error::Io(e))) => Err(PostgresStoreError::Unreachable {
            at,
            cause: io_cause(&e),
        }),
        Ok(Err(e)) => Err(PostgresStoreError::Database(e)),
        Err(_) => Err(PostgresStoreError::Unreachable {
            at,
            cause: format!("no answer within {within:?}"),
        }),
    }
}

/// Why a [`PostgresStore`] could not be made.
#[derive(Debug)]
#[non_exhaustive]
pub enum PostgresStoreError {
    /// The store's settings were refused (every refused one is named).
    Config(ConfigError),
    /// The URL does not parse.
    InvalidUrl(String),
    /// The server could not be reached: nothing answers at `at`, or it refused the
    /// connection.
    Unreachable {
        /// The address asked, `host:port` or a socket's path.
        at: String,
        /// Why, in a few words (`connection refused`, `no answer within 5s`).
        cause: String,
    },
    /// The server refused (a login, a database that does not exist), or the pool
    /// failed.
    Database(sqlx::Error),
}

impl fmt::Display for PostgresStoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PostgresStoreError::Config(e) => write!(f, "invalid PostgreSQL store settings: {e}"),
            PostgresStoreError::InvalidUrl(e) => write!(f, "invalid PostgreSQL URL: {e}"),
            PostgresStoreError::Unreachable { at, cause } => {
                write!(f, "cannot connect to PostgreSQL at {at}: {cause}")
            }
            PostgresStoreError::Database(e) => write!(f, "PostgreSQL refused: {e}"),
        }
    }
}

impl std::error::Error for PostgresStoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PostgresStoreError::Config(e) => Some(e),
            PostgresStoreError::Database(e) => Some(e),
            PostgresStoreError::InvalidUrl(_) | PostgresStoreError::Unreachable { .. } => None,
        }
    }
}

impl From<ConfigError> for PostgresStoreError {
    fn from(e: ConfigError) -> Self {
        PostgresStoreError::Config(e)
    }
}

/// An I/O error as a short cause: "connection refused" rather than "Connection
/// refused (os error 111)".
fn io_cause(e: &std::io::Error) -> String {
    use std::io::ErrorKind;
    match e.kind() {
        ErrorKind::ConnectionRefused => "connection refused".to_owned(),
        ErrorKind::ConnectionReset => "connection reset".to_owned(),
        ErrorKind::TimedOut => "connection timed out".to_owned(),
        ErrorKind::HostUnreachable => "host unreachable".to_owned(),
        ErrorKind::NetworkUnreachable => "network unreachable".to_owned(),
        ErrorKind::NotFound => "no such socket".to_owned(),
        _ => e.to_string(),
    }
}

impl IdempotencyStore for PostgresStore {
    async fn claim(&self, id: &RecordId, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        let sql = &self.inner.sql;
        let request = claim.request.map(RequestInfo::encode);
        self.call(async {
            for _ in 0..CLAIM_ATTEMPTS {
                let query = sqlx::query(&sql.claim)
                    .bind(&id.as_bytes()[..])
                    .bind(&claim.fingerprint.as_bytes()[..])
                    .bind(claim.token.to_bytes().to_vec())
                    .bind(commit_point_code(claim.commit_point))
                    .bind(micros(claim.lease))
                    .bind(micros(claim.retention))
                    .bind(request.as_deref());
                let row = self.write_returning(query).await.map_err(db_error)?;
                // No row: the key is held by a row this statement's snapshot predates
                // (a concurrent claim committed while it waited). Look again.
                let Some(row) = row else { continue };
                let mine: bool = row.try_get("mine").map_err(db_error)?;
                let takeovers: i32 = row.try_get("takeovers").map_err(db_error)?;
                let record = record_from_row(&row)?;
                return Ok(match (mine, record) {
                    (true, Record::InProgress(_)) => ClaimOutcome::Claimed {
                        takeover: takeovers > 0,
                    },
                    // The same claim sent again (its reply was lost): the caller holds it.
                    (false, record) if claim.holds(&record) => {
                        ClaimOutcome::Claimed { takeover: false }
                    }
                    (mine, record) => ClaimOutcome::Existing {
                        record,
                        became_unknown: mine,
                    },
                });
            }
            Err(StoreError::unavailable(
                "claim kept finding a concurrently changing row",
            ))
        })
        .await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: Token,
        record: &Completed,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let blob = Record::Completed(record.clone()).encode();
        self.change(
            sqlx::query(&self.inner.sql.complete)
                .bind(&id.as_bytes()[..])
                .bind(token.to_bytes().to_vec())
                .bind(&record.fingerprint.as_bytes()[..])
                .bind(micros(retention))
                .bind(&blob[..]),
        )
        .await
    }

    async fn release(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        self.change(
            sqlx::query(&self.inner.sql.release)
                .bind(&id.as_bytes()[..])
                .bind(token.to_bytes().to_vec()),
        )
        .await
    }

    async fn renew(&self, id: &RecordId, token: Token, lease: Duration) -> Result<(), StoreError> {
        self.change(
            sqlx::query(&self.inner.sql.renew)
                .bind(&id.as_bytes()[..])
                .bind(token.to_bytes().to_vec())
                .bind(micros(lease)),
        )
        .await
    }

    async fn commit_point(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        self.change(
            sqlx::query(&self.inner.sql.commit_point)
                .bind(&id.as_bytes()[..])
                .bind(token.to_bytes().to_vec())
                .bind(None::<&[u8]>),
        )
        .await
    }

    async fn commit_point_with(
        &self,
        id: &RecordId,
        token: Token,
        note: &[u8],
    ) -> Result<(), StoreError> {
        let note = note.get(..MAX_NOTE).unwrap_or(note);
        self.change(
            sqlx::query(&self.inner.sql.commit_point)
                .bind(&id.as_bytes()[..])
                .bind(token.to_bytes().to_vec())
                .bind(note),
        )
        .await
    }

    async fn mark_unknown(
        &self,
        id: &RecordId,
        token: Token,
        retention: Duration,
        reason: UnknownReason,
    ) -> Result<(), StoreError> {
        self.change(
            sqlx::query(&self.inner.sql.mark_unknown)
                .bind(&id.as_bytes()[..])
                .bind(token.to_bytes().to_vec())
                .bind(micros(retention))
                .bind(i32::from(reason.to_code())),
        )
        .await
    }

    async fn mark_notified(&self, id: &RecordId) -> Result<(), StoreError> {
        // No row: the record was resolved or expired meanwhile; nothing to tell.
        self.call(async {
            let query = sqlx::query(&self.inner.sql.mark_notified).bind(&id.as_bytes()[..]);
            self.write(query).await.map(drop).map_err(db_error)
        })
        .await
    }

    fn reconciled(&self) -> bool {
        self.inner.reconcilers.any()
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.call(async {
            let row = sqlx::query(&self.inner.sql.get)
                .bind(&id.as_bytes()[..])
                .fetch_optional(&self.inner.pool)
                .await
                .map_err(db_error)?;
            row.as_ref().map(record_from_row).transpose()
        })
        .await
    }
}

/// A duration in whole microseconds (clamped to a century), for
/// `$n * interval '1 microsecond'`.
pub(crate) fn micros(d: Duration) -> i64 {
    i64::try_from(d.min(MAX_SPAN).as_micros()).unwrap_or(i64::MAX)
}

fn commit_point_code(c: CommitPoint) -> i16 {
    match c {
        CommitPoint::Before => 1,
        CommitPoint::Passed => 2,
        // Undeclared, and any later state: an expired lease becomes outcome_unknown,
        // the safe reading.
        _ => 0,
    }
}

pub(crate) fn commit_point_from_code(code: i16) -> Result<CommitPoint, DecodeError> {
    match code {
        0 => Ok(CommitPoint::Undeclared),
        1 => Ok(CommitPoint::Before),
        2 => Ok(CommitPoint::Passed),
        _ => Err(DecodeError::Invalid("commit point")),
    }
}

/// Maps a database error: a checkout or statement timeout is [`StoreError::Timeout`],
/// anything else [`StoreError::Unavailable`].
pub(crate) fn db_error(e: sqlx::Error) -> StoreError {
    match &e {
        sqlx::Error::PoolTimedOut => StoreError::Timeout,
        // query_canceled (statement_timeout), lock_not_available (lock_timeout).
        sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("57014" | "55P03")) => {
            StoreError::Timeout
        }
        _ => StoreError::unavailable(e),
    }
}

/// Reads the record columns of a row (`state, fingerprint, token, commit_point,
/// lease_ms, record, adopt_ms`): a record under a live adoption is `resolving`. Total: a row that does not describe a record is
/// [`StoreError::Corrupt`].
pub(crate) fn record_from_row(row: &PgRow) -> Result<Record, StoreError> {
    let state: i16 = row.try_get("state").map_err(db_error)?;
    let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(db_error)?;
    let fingerprint = Fingerprint::from_bytes(exact(fingerprint, "fingerprint")?);
    let corrupt = StoreError::Corrupt;
    let adopt_ms: Option<i64> = row.try_get("adopt_ms").map_err(db_error)?;
    if let Some(ms) = adopt_ms {
        let until_ms = u64::try_from(ms).map_err(|_| corrupt(DecodeError::Invalid("adoption")))?;
        return Ok(Record::Resolving(Resolving::new(fingerprint, until_ms)));
    }
    match state {
        STATE_IN_PROGRESS => {
            let token: Option<Vec<u8>> = row.try_get("token").map_err(db_error)?;
            let commit_point: Option<i16> = row.try_get("commit_point").map_err(db_error)?;
            let lease_ms: Option<i64> = row.try_get("lease_ms").map_err(db_error)?;
            let token = token.ok_or(corrupt(DecodeError::Invalid("token")))?;
            let lease_until_ms = lease_ms
                .and_then(|ms| u64::try_from(ms).ok())
                .ok_or(corrupt(DecodeError::Invalid("lease")))?;
            let commit_point = commit_point
                .ok_or(DecodeError::Invalid("commit point"))
                .and_then(commit_point_from_code)
                .map_err(corrupt)?;
            Ok(Record::InProgress(InProgress::new(
                lease_until_ms,
                Token::from_bytes(exact(token, "token")?),
                fingerprint,
                commit_point,
            )))
        }
        STATE_COMPLETED => {
            let blob: Option<Vec<u8>> = row.try_get("record").map_err(db_error)?;
            let blob = blob.ok_or(corrupt(DecodeError::Truncated))?;
            match Record::decode(Bytes::from(blob)).map_err(corrupt)? {
                Record::Completed(c) if c.fingerprint == fingerprint => Ok(Record::Completed(c)),
                Record::Completed(_) => Err(corrupt(DecodeError::Invalid("fingerprint"))),
                _ => Err(corrupt(DecodeError::Invalid("state tag"))),
            }
        }
        STATE_UNKNOWN => Ok(Record::OutcomeUnknown(OutcomeUnknown::new(fingerprint))),
        _ => Err(corrupt(DecodeError::Invalid("state"))),
    }
}

/// A column that must hold exactly `N` bytes.
pub(crate) fn exact<const N: usize>(
    bytes: Vec<u8>,
    what: &'static str,
) -> Result<[u8; N], StoreError> {
    <[u8; N]>::try_from(bytes).map_err(|_| StoreError::Corrupt(DecodeError::Invalid(what)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_micros_clamped() {
        assert_eq!(micros(Duration::from_millis(1500)), 1_500_000);
        assert_eq!(micros(Duration::from_nanos(999)), 0);
        assert_eq!(micros(Duration::MAX), micros(MAX_SPAN));
    }

    #[test]
    fn commit_points_round_trip() {
        for c in [
            CommitPoint::Undeclared,
            CommitPoint::Before,
            CommitPoint::Passed,
        ] {
            assert_eq!(commit_point_from_code(commit_point_code(c)), Ok(c));
        }
        assert!(commit_point_from_code(7).is_err());
    }

    #[test]
    fn options_refuse_bad_settings() {
        let b = PostgresStore::options;
        assert_eq!(
            b().call_timeout(Duration::ZERO)
                .migration_sql()
                .unwrap_err()
                .field(),
            "call_timeout"
        );
        assert_eq!(b().table("").migration_sql().unwrap_err().field(), "table");
        assert_eq!(
            b().schema("9").migration_sql().unwrap_err().field(),
            "schema"
        );
    }

    #[test]
    fn every_refused_setting_is_named() {
        let e = PostgresStore::options()
            .schema("9")
            .table("")
            .call_timeout(Duration::ZERO)
            .migration_sql()
            .unwrap_err();
        assert_eq!(
            e.fields().collect::<Vec<_>>(),
            ["call_timeout", "schema", "table"]
        );
    }
}
