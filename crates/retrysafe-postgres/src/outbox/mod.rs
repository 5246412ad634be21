//! Middleware that delivers a transaction's remote calls after it commits: the
//! transactional outbox, and a relay that sends what it holds.
//!
//! A handler behind the [`TxIdempotencyLayer`](crate::tx::TxIdempotencyLayer) must not
//! call remote services inside its transaction: their effects would not roll back with
//! it. It enqueues them instead. [`IdempotentTx::enqueue`](crate::tx::IdempotentTx::enqueue)
//! writes an HTTP request (method, URI, headers, body) or a [`Message`] (exchange,
//! routing key, headers, body) — never their `authorization`, `proxy-authorization` or
//! `cookie` headers — into the outbox table **in the same transaction** as the key
//! and the effect, with a deterministic child key of the record
//! ([`IdempotencyContext::child_key`](retrysafe_core::idempotency::IdempotencyContext::child_key)).
//! The entry exists if and only if the effect committed.
//!
//! An [`OutboxRelay`] (a background task; every application server may run one) takes
//! due rows with `FOR UPDATE SKIP LOCKED` and a lease, sends each through a user-given
//! tower client stack (which adds authentication) with its child key as
//! `Idempotency-Key`, or through a [`Publisher`] with it as the message id, and ends
//! each row in one terminal state:
//!
//! | answer | the row |
//! |---|---|
//! | 2xx (a replay included) | `succeeded` |
//! | 408, 409 with `retry-after` (the downstream's `request-in-flight`), 425, 429, 5xx, a transport error, a publisher's failure (a returned or nacked message, a lost connection) | retried with backoff (`retry-after` is a minimum), until the dead-letter age |
//! | any other 4xx, 3xx | `rejected` ([`on_rejected`](OutboxRelay::on_rejected)) |
//! | still failing past the [dead-letter age](OutboxRelay::dead_letter_age) | `dead` ([`on_dead`](OutboxRelay::on_dead), and a `tracing` event) |
//!
//! Marks are fenced by the row's lease token: a relay whose lease ran out cannot mark
//! a row another relay took. A send is bounded by a timeout shorter than the lease,
//! and a row is dead-lettered only by a relay holding a fresh lease on it, before it
//! sends: a row whose send is in flight is never dead-lettered.
//!
//! **Delivery is at least once**: a relay that dies between a send and its mark leaves
//! the row leased, and once the lease ends another relay sends it again. The child key
//! makes the downstream effect once — as long as the downstream keeps the key, which is
//! why the dead-letter age must be shorter than the
//! [downstream's key retention](OutboxRelay::downstream_key_retention) (checked by
//! [`build`](OutboxRelay::build)).
//!
//! Rows with the same [ordering key](Outgoing::ordering_key) are delivered one at a
//! time, in the order their transactions committed: enqueueing with an ordering key
//! locks the key until the transaction ends, so transactions enqueueing for one key
//! commit one after another, in the order of their rows. Finished rows are deleted
//! after a [retention](OutboxRelay::retention).
//!
//! ```no_run
//! use std::time::Duration;
//! use axum::{Router, routing::post, http::StatusCode};
//! use bytes::Bytes;
//! use retrysafe::postgres::PostgresStore;
//! use retrysafe::postgres::outbox::{Outbox, OutboxRelay};
//! use retrysafe::postgres::tx::{IdempotentTx, TxBackend, TxIdempotencyLayer};
//!
//! async fn order(mut tx: IdempotentTx, body: Bytes) -> Result<StatusCode, StatusCode> {
//!     sqlx::query("INSERT INTO orders (body) VALUES ($1)")
//!         .bind(&body[..])
//!         .execute(&mut *tx)
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     // Sent after the commit, with a child key of this request's key.
//!     let call = http::Request::post("http://ledger.internal/entries").body(body).unwrap();
//!     tx.enqueue(call).await.map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     Ok(StatusCode::CREATED)
//! }
//!
//! # async fn run<C>(client: C) -> Result<(), Box<dyn std::error::Error>>
//! # where
//! #     C: tower::Service<http::Request<Bytes>, Response = http::Response<String>, Error = std::io::Error>
//! #         + Clone + Send + Sync + 'static,
//! #     C::Future: Send + 'static,
//! # {
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
//! store.migrate().await?;
//! Outbox::new().migrate(store.pool()).await?;
//! let relay = OutboxRelay::new(store.pool().clone())
//!     .http_client(client) // your tower client stack, with authentication
//!     .downstream_key_retention(Duration::from_secs(24 * 3600))
//!     .build()?
//!     .spawn();
//! let app: Router = Router::new()
//!     .route("/orders", post(order))
//!     .layer(TxIdempotencyLayer::with_backend(TxBackend::from_store(&store)).require_key());
//! // … serve app; on shutdown:
//! relay.stop().await;
//! # drop(app);
//! # Ok(()) }
//! # use retrysafe::postgres::sqlx;
//! ```
//!
//! # The table
//!
//! [`Outbox::migrate`] creates it; [`Outbox::migration_sql`] gives the SQL for users
//! who run their own migrations.
//!
//! | column | meaning |
//! |---|---|
//! | `id` | the order of enqueueing |
//! | `child_key` | sent as `Idempotency-Key`, or as the message id |
//! | `kind`, `method`, `target` | 1: HTTP, with its method and URI; 2: a message, with its exchange and routing key |
//! | `headers`, `body` | the request's or message's headers (length-prefixed pairs) and body |
//! | `ordering_key` | the optional ordering key |
//! | `state` | 0 `pending`, 1 `succeeded`, 2 `rejected`, 3 `dead` |
//! | `attempts`, `next_attempt` | sends started so far; when the next may start |
//! | `lease_token`, `lease_until` | the relay holding the row, and until when |
//! | `created_at`, `finished_at` | for the dead-letter age and the retention |
//! | `last_status`, `last_error` | the last answer's status, or the last error |

#[cfg(feature = "amqp")]
pub mod amqp;
mod enqueue;
mod item;
mod publisher;
mod relay;
mod send;
mod sql;

use sqlx::{PgConnection, PgPool};

use retrysafe_core::ConfigError;
use retrysafe_core::store::StoreError;
use retrysafe_core::wire::IdempotencyKey;

pub use item::{Message, Outgoing};
pub use publisher::{PublishError, Publisher};
pub use relay::{OutboxRelay, RelayHandle, RelayPass, Settled};

use crate::store::db_error;
use sql::OutboxSql;

/// The outbox table: its name (default `retrysafe_outbox`, in the connection's
/// `search_path`), its migration, and [`enqueue`](Outbox::enqueue) on any connection.
///
/// ```
/// use retrysafe::postgres::outbox::Outbox;
///
/// let sql = Outbox::new().schema("app").table("outbox").migration_sql().unwrap();
/// assert!(sql.contains("CREATE TABLE IF NOT EXISTS app.outbox"));
/// let error = Outbox::new().schema("App").table("1x").migration_sql().unwrap_err();
/// assert_eq!(error.fields().collect::<Vec<_>>(), ["schema", "table"]);
/// ```
#[derive(Debug, Clone, Default)]
pub struct Outbox {
    schema: Option<String>,
    table: Option<String>,
}

/// The default table name.
const DEFAULT_TABLE: &str = "retrysafe_outbox";

impl Outbox {
    /// The default table, `retrysafe_outbox`, found through the `search_path`.
    pub fn new() -> Self {
        Outbox::default()
    }

    /// The table's schema (lowercase letters, digits and `_`).
    #[must_use]
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// The table's name (lowercase letters, digits and `_`).
    #[must_use]
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = Some(table.into());
        self
    }

    pub(crate) fn sql(&self) -> Result<OutboxSql, ConfigError> {
        OutboxSql::new(
            self.schema.as_deref(),
            self.table.as_deref().unwrap_or(DEFAULT_TABLE),
        )
    }

    /// The SQL that creates the table and its indexes (idempotent: `IF NOT EXISTS`).
    pub fn migration_sql(&self) -> Result<String, ConfigError> {
        Ok(self.sql()?.migration)
    }

    /// Creates the table and its indexes if they do not exist.
    pub async fn migrate(&self, pool: &PgPool) -> Result<(), StoreError> {
        let sql = self.sql().map_err(StoreError::unavailable)?;
        sqlx::raw_sql(&sql.migration)
            .execute(pool)
            .await
            .map_err(db_error)?;
        Ok(())
    }

    /// Writes `outgoing` into the table on `conn` (in whatever transaction it is in),
    /// to be sent with `key` as its `Idempotency-Key` or message id. Returns the row's
    /// id. [`IdempotentTx::enqueue`](crate::tx::IdempotentTx::enqueue) calls this with a
    /// child key of the request's record.
    ///
    /// An entry with an [ordering key](Outgoing::ordering_key) first takes a
    /// transaction-level advisory lock on that key (a 64-bit hash of the table and the
    /// key, held until the transaction ends): another transaction enqueueing for the
    /// same key waits until this one commits or rolls back.
    pub async fn enqueue(
        &self,
        conn: &mut PgConnection,
        key: &IdempotencyKey,
        outgoing: impl Into<Outgoing>,
    ) -> Result<i64, StoreError> {
        let sql = self.sql().map_err(StoreError::unavailable)?;
        let o = outgoing.into();
        if let Some(ordering_key) = o.ordering_key.as_deref() {
            sqlx::query(&sql.lock_order)
                .bind(ordering_key)
                .execute(&mut *conn)
                .await
                .map_err(db_error)?;
        }
        sqlx::query_scalar(&sql.insert)
            .bind(key.as_str())
            .bind(o.kind)
            .bind(&o.method)
            .bind(&o.target)
            .bind(item::encode_headers(&o.headers))
            .bind(&o.body[..])
            .bind(o.ordering_key.as_deref())
            .fetch_one(conn)
            .await
            .map_err(db_error)
    }
}
