//! An idempotent consumer: a message's effect and the record that it was processed
//! commit in one PostgreSQL transaction, so a message delivered twice has its effect
//! once.
//!
//! Brokers deliver at least once: a consumer that dies after its effect committed but
//! before it acknowledged gets the message again. [`Consumer::process`] makes that
//! harmless. In one transaction it inserts (consumer name, message id) into a
//! processed-messages table and runs the effect; it acknowledges only after the commit;
//! a message whose id is already there is skipped and acknowledged. A message without
//! an id, and one redelivered more than [`max_redeliveries`](Consumer::max_redeliveries)
//! times without success (a poison message), goes to the dead-letter queue.
//!
//! | path | guarantee |
//! |---|---|
//! | effect and processed id | once: one transaction |
//! | acknowledgement | after the commit; lost → redelivered → skipped |
//! | a message the effect fails on | rolled back, requeued; dead-lettered after the limit |
//!
//! Processed ids are kept for a [retention](Consumer::retention) that covers every
//! later copy of the message, then deleted by a sweep: schedule one, with
//! [`Consumer::spawn_sweeper`] or by calling [`Consumer::sweep`].
//!
//! The broker side is an [`Inbound`] message: with feature `amqp`, a lapin
//! [`Delivery`](lapin::message::Delivery) (see [`crate::outbox::amqp`]).
//!
//! ```no_run
//! use retrysafe::postgres::consumer::{Consumer, Inbound, Processed};
//! # async fn run(pool: sqlx::PgPool, message: impl Inbound) -> Result<(), Box<dyn std::error::Error>> {
//! let consumer = Consumer::new(pool, "billing").build()?;
//! consumer.migrate().await?;
//! let outcome = consumer
//!     .process(message, |tx, body| {
//!         let body = body.to_vec();
//!         Box::pin(async move {
//!             sqlx::query("INSERT INTO invoices (payload) VALUES ($1)")
//!                 .bind(body)
//!                 .execute(&mut *tx)
//!                 .await
//!                 .map(|_| ())
//!         })
//!     })
//!     .await?;
//! assert!(matches!(outcome, Processed::Done(()) | Processed::Duplicate));
//! # Ok(()) }
//! # use retrysafe::postgres::sqlx;
//! ```

mod inbound;
mod sweeper;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use retrysafe_core::__private::Validate;
use retrysafe_core::ConfigError;
use retrysafe_core::store::StoreError;
use sqlx::{Connection, PgConnection, PgPool};

pub use inbound::Inbound;
pub use sweeper::SweeperHandle;

use crate::sql::{check_schema, check_table};
use crate::store::db_error;
use sweeper::Sweep;

/// The effect's future, borrowing the transaction's connection.
pub type Effect<'c, T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'c>>;

/// What [`Consumer::process`] did with a message.
#[derive(Debug)]
#[non_exhaustive]
pub enum Processed<T, E> {
    /// The effect ran and committed; the message was acknowledged.
    Done(T),
    /// The id was processed before: skipped and acknowledged.
    Duplicate,
    /// The effect failed: rolled back, the message requeued.
    Failed(E),
    /// Sent to the dead-letter queue (no id, or too many redeliveries).
    DeadLettered(&'static str),
    /// Test hook: stopped between the commit and the acknowledgement.
    #[doc(hidden)]
    Crashed,
}

const DAY: Duration = Duration::from_secs(24 * 3600);

type CrashHook = std::sync::Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// An idempotent consumer named `name` (its ids are its own: two consumers of one
/// message each process it once). See the [module docs](self).
///
/// Defaults: table `retrysafe_processed`; at most 5 redeliveries; processed ids kept
/// 8 days, which must cover the publisher's dead-letter age (default 1 h) plus the
/// broker's redelivery horizon (default 7 days): a message can come back until then.
///
/// Ids past the retention are deleted only by a sweep: run
/// [`spawn_sweeper`](Self::spawn_sweeper) once per application (every
/// [`sweep_interval`](Self::sweep_interval), default 60 s), or call
/// [`sweep`](Self::sweep) from a scheduler of your own. Without either, the table
/// grows with every message.
///
/// ```
/// use std::time::Duration;
/// use retrysafe::postgres::consumer::Consumer;
/// use retrysafe::postgres::sqlx::postgres::PgPoolOptions;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let pool = PgPoolOptions::new().connect_lazy("postgres://postgres@127.0.0.1:5432/test").unwrap();
/// let error = Consumer::new(pool, "")
///     .retention(Duration::from_secs(3600))
///     .build()
///     .unwrap_err();
/// assert_eq!(error.fields().collect::<Vec<_>>(), ["name", "retention"]);
/// # }
/// ```
#[must_use]
pub struct Consumer {
    pool: PgPool,
    name: String,
    table: String,
    schema: Option<String>,
    max_redeliveries: u32,
    retention: Duration,
    publisher_dead_letter_age: Duration,
    redelivery_horizon: Duration,
    sweep_interval: Duration,
    crash_after_commit: Option<CrashHook>,
}

impl fmt::Debug for Consumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("name", &self.name)
            .field("table", &self.qualified())
            .field("max_redeliveries", &self.max_redeliveries)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl Consumer {
    /// A consumer named `name` on `pool`, with the defaults above.
    pub fn new(pool: PgPool, name: impl Into<String>) -> Self {
        Consumer {
            pool,
            name: name.into(),
            table: "retrysafe_processed".to_owned(),
            schema: None,
            max_redeliveries: 5,
            retention: 8 * DAY,
            publisher_dead_letter_age: Duration::from_secs(3600),
            redelivery_horizon: 7 * DAY,
            sweep_interval: Duration::from_secs(60),
            crash_after_commit: None,
        }
    }

    /// The processed-messages table's schema.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// The processed-messages table (default `retrysafe_processed`).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Redeliveries allowed before a message goes to the dead-letter queue (default 5).
    pub fn max_redeliveries(mut self, n: u32) -> Self {
        self.max_redeliveries = n;
        self
    }

    /// How long processed ids are kept (default 8 days).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The publishing outbox's dead-letter age (default 1 h): how long after its
    /// commit a message may still be published.
    pub fn publisher_dead_letter_age(mut self, age: Duration) -> Self {
        self.publisher_dead_letter_age = age;
        self
    }

    /// How long the broker may hold a message and deliver it again (default 7 days).
    pub fn redelivery_horizon(mut self, horizon: Duration) -> Self {
        self.redelivery_horizon = horizon;
        self
    }

    /// How often the [sweeper](Self::spawn_sweeper) deletes ids past the retention
    /// (default 60 s).
    pub fn sweep_interval(mut self, every: Duration) -> Self {
        self.sweep_interval = every;
        self
    }

    /// Test hook: called with a message id after its commit, before its
    /// acknowledgement; `true` stops there, as a crash would.
    #[doc(hidden)]
    pub fn __crash_after_commit(
        mut self,
        hook: impl Fn(&str) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.crash_after_commit = Some(std::sync::Arc::new(hook));
        self
    }

    /// Validates the settings, naming every refused one.
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        v.check(
            !self.name.is_empty() && self.name.len() <= 200,
            "name",
            "must be 1 to 200 bytes",
        );
        if let Some(schema) = &self.schema {
            v.take(check_schema(schema));
        }
        v.take(check_table(&self.table));
        v.check(
            self.retention >= self.publisher_dead_letter_age + self.redelivery_horizon
                && self.retention <= 366 * DAY,
            "retention",
            "must cover the publisher's dead-letter age plus the redelivery horizon, and at most 366 days",
        );
        v.timeout(self.sweep_interval, "sweep_interval");
        v.finish(self)
    }

    fn qualified(&self) -> String {
        match &self.schema {
            Some(s) => format!("{s}.{}", self.table),
            None => self.table.clone(),
        }
    }

    /// The SQL that creates the processed-messages table (idempotent).
    pub fn migration_sql(&self) -> String {
        let t = self.qualified();
        let table = &self.table;
        let schema = self
            .schema
            .as_ref()
            .map(|s| format!("CREATE SCHEMA IF NOT EXISTS {s};\n"))
            .unwrap_or_default();
        format!(
            "{schema}CREATE TABLE IF NOT EXISTS {t} (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz,
    redeliveries integer     NOT NULL DEFAULT 0,
    seen_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS {table}_seen_idx ON {t} (seen_at);"
        )
    }

    /// Creates the processed-messages table if it does not exist.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        sqlx::raw_sql(&self.migration_sql())
            .execute(&self.pool)
            .await
            .map_err(db_error)?;
        Ok(())
    }

    /// Processes `message` once: see the [module docs](self). `effect` gets the
    /// transaction's connection and the body; an `Err` rolls back and requeues.
    /// `Err` from `process` itself: the database failed (the message was requeued).
    pub async fn process<M, T, E, F>(
        &self,
        message: M,
        effect: F,
    ) -> Result<Processed<T, E>, StoreError>
    where
        M: Inbound,
        F: for<'c> FnOnce(&'c mut PgConnection, &'c [u8]) -> Effect<'c, T, E>,
    {
        let Some(id) = message.message_id().map(str::to_owned) else {
            message
                .dead_letter()
                .await
                .map_err(StoreError::unavailable)?;
            return Ok(Processed::DeadLettered("the message has no id"));
        };
        if message.redelivered()
            && let Some(settled) = self.redelivered(&message, &id).await?
        {
            return Ok(settled);
        }
        match self.transact(&id, message.body(), effect).await {
            Ok(Some(Ok(value))) => {
                if self.crash_after_commit.as_ref().is_some_and(|h| h(&id)) {
                    return Ok(Processed::Crashed);
                }
                message.ack().await.map_err(StoreError::unavailable)?;
                Ok(Processed::Done(value))
            }
            Ok(None) => {
                message.ack().await.map_err(StoreError::unavailable)?;
                Ok(Processed::Duplicate)
            }
            Ok(Some(Err(e))) => {
                message.requeue().await.map_err(StoreError::unavailable)?;
                Ok(Processed::Failed(e))
            }
            Err(e) => {
                let _ = message.requeue().await;
                Err(e)
            }
        }
    }

    /// The insert and the effect in one transaction: `None` for an id already
    /// processed, `Some(Err)` for a failed (rolled back) effect.
    async fn transact<T, E, F>(
        &self,
        id: &str,
        body: &[u8],
        effect: F,
    ) -> Result<Option<Result<T, E>>, StoreError>
    where
        F: for<'c> FnOnce(&'c mut PgConnection, &'c [u8]) -> Effect<'c, T, E>,
    {
        let mut conn = self.pool.acquire().await.map_err(db_error)?;
        let mut tx = conn.begin().await.map_err(db_error)?;
        let fresh = sqlx::query(&format!(
            "INSERT INTO {} (consumer, message_id, processed_at) VALUES ($1, $2, clock_timestamp())
             ON CONFLICT (consumer, message_id) DO UPDATE SET processed_at = clock_timestamp()
             WHERE {0}.processed_at IS NULL",
            self.qualified()
        ))
        .bind(&self.name)
        .bind(id)
        .execute(&mut *tx)
        .await
        .map_err(db_error)?
        .rows_affected()
            == 1;
        if !fresh {
            return Ok(None);
        }
        match effect(&mut tx, body).await {
            Ok(value) => {
                tx.commit().await.map_err(db_error)?;
                Ok(Some(Ok(value)))
            }
            Err(e) => Ok(Some(Err(e))),
        }
    }

    /// A redelivered message: acknowledged when its id was processed already (an
    /// acknowledgement lost after the commit, however often), dead-lettered when
    /// redelivered too often; `None`: process it.
    async fn redelivered<M: Inbound, T, E>(
        &self,
        message: &M,
        id: &str,
    ) -> Result<Option<Processed<T, E>>, StoreError> {
        let (redeliveries, processed) = self.redeliveries(id).await?;
        if processed {
            message.ack().await.map_err(StoreError::unavailable)?;
            return Ok(Some(Processed::Duplicate));
        }
        if redeliveries > self.max_redeliveries {
            message
                .dead_letter()
                .await
                .map_err(StoreError::unavailable)?;
            return Ok(Some(Processed::DeadLettered("redelivered too often")));
        }
        Ok(None)
    }

    /// Counts one more redelivery of `id` (autocommit, outside the effect's
    /// transaction, so a crash or a failure still counts) and returns the count and
    /// whether the id was processed already.
    async fn redeliveries(&self, id: &str) -> Result<(u32, bool), StoreError> {
        let (n, processed): (i32, bool) = sqlx::query_as(&format!(
            "INSERT INTO {} (consumer, message_id, redeliveries) VALUES ($1, $2, 1)
             ON CONFLICT (consumer, message_id) DO UPDATE SET redeliveries = {0}.redeliveries + 1
             RETURNING redeliveries, processed_at IS NOT NULL",
            self.qualified()
        ))
        .bind(&self.name)
        .bind(id)
        .fetch_one(&self.pool)
        .await
        .map_err(db_error)?;
        Ok((u32::try_from(n).unwrap_or(0), processed))
    }

    /// Deletes up to `batch` ids older than the retention; returns how many. For a
    /// consumer swept by a scheduler of its own; [`spawn_sweeper`](Self::spawn_sweeper)
    /// does it on a task.
    pub async fn sweep(&self, batch: i64) -> Result<u64, StoreError> {
        self.sweeper().once(batch).await
    }

    /// Deletes the ids past the retention now and then every
    /// [`sweep_interval`](Self::sweep_interval), on a tokio task, until
    /// [`SweeperHandle::stop`]. One sweeper per consumer name is enough (several only
    /// share the work). Errors (the database away) are logged and retried at the next
    /// interval.
    pub fn spawn_sweeper(&self) -> SweeperHandle {
        self.sweeper().spawn(self.sweep_interval)
    }

    fn sweeper(&self) -> Sweep {
        Sweep {
            pool: self.pool.clone(),
            sql: Sweep::statement(&self.qualified()),
            name: self.name.clone(),
            retention: self.retention,
        }
    }
}
