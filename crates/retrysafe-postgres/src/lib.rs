//! PostgreSQL backends of retrysafe, through sqlx: [`PostgresStore`], an idempotency
//! store on one table, and the transactional layer [`tx::TxIdempotencyLayer`], in which
//! the idempotency key and the handler's effects commit together.
//!
//! Several application servers sharing one database behave as one: a key is claimed
//! by exactly one of them, a takeover of an expired lease is atomic, and leases and
//! retention are measured by the database's `clock_timestamp()`, so clock skew between
//! the servers cannot break a lease.
//!
//! ```no_run
//! use std::time::Duration;
//! use retrysafe_postgres::PostgresStore;
//! use retrysafe_tower::idempotency::IdempotencyLayer;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
//! store.migrate().await?; // or run `store.migration_sql()` with your own migrations
//! let sweeper = store.spawn_sweeper(Duration::from_secs(60), 1_000)?;
//!
//! let layer = IdempotencyLayer::new(store);
//! // let app = axum::Router::new().route("/payments", post(pay)).layer(layer);
//! # drop(layer);
//!
//! // On shutdown:
//! sweeper.stop().await;
//! # Ok(()) }
//! ```
//!
//! # The table
//!
//! [`PostgresStore::migrate`] creates it; for users who run their own migrations, this
//! is the SQL for the default table (with [`PostgresStoreOptions::schema`] and
//! [`PostgresStoreOptions::table`], [`PostgresStore::migration_sql`] renders it for
//! another name):
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS retrysafe_idempotency (
//!     k            bytea       PRIMARY KEY,
//!     state        smallint    NOT NULL CHECK (state IN (1, 2, 3)),
//!     fingerprint  bytea       NOT NULL,
//!     token        bytea,
//!     commit_point smallint,
//!     lease_until  timestamptz,
//!     takeovers    integer     NOT NULL DEFAULT 0,
//!     expires_at   timestamptz NOT NULL,
//!     record       bytea
//! );
//! CREATE INDEX IF NOT EXISTS retrysafe_idempotency_expires_at_idx ON retrysafe_idempotency (expires_at);
//! ```
//!
//! | column | meaning |
//! |---|---|
//! | `k` | the [`RecordId`](retrysafe_core::idempotency::RecordId): 32 bytes, a hash of scope and idempotency key |
//! | `state` | 1 `in_progress`, 2 `completed`, 3 `outcome_unknown` (a released record has no row) |
//! | `fingerprint` | the 32-byte request fingerprint |
//! | `token`, `commit_point`, `lease_until` | `in_progress` only: the holder's 16-byte token; 0 undeclared, 1 before, 2 passed; the lease end |
//! | `takeovers` | how often an expired lease of this record was taken over |
//! | `expires_at` | the end of the retention: from then on the key is new again, and the sweeper deletes the row. For an `in_progress` row, its lease end plus its claim's retention |
//! | `record` | `completed` only: the record in retrysafe's versioned encoding ([`Record::encode`](retrysafe_core::idempotency::Record::encode)), so its size is the encoded length |
//!
//! # Sweeping
//!
//! A record past its retention is absent to every call, but its row stays until
//! deleted. [`PostgresStore::spawn_sweeper`] deletes expired rows periodically in short
//! batches (`DELETE … WHERE k IN (SELECT … LIMIT n FOR UPDATE SKIP LOCKED)`), and
//! [`PostgresStore::sweep_expired`] does one pass on demand, for a cron job. One
//! sweeper per database is enough; more are harmless.
//!
//! # Round trips
//!
//! Every store call is one statement; with the prepared-statement cache of sqlx warm,
//! that is one round trip (the first use of a statement on a connection prepares it).
//! A guarded request that runs costs a claim and a completion: two round trips. sqlx
//! also pings a connection as it goes back to the pool, after the call has returned.
//!
//! # The transactional layer
//!
//! [`tx::TxIdempotencyLayer`] goes further than a store can: it runs each guarded
//! request in one transaction that also writes its key row, so the key and the
//! handler's effects commit together — exactly once — and a failed call rolls both
//! back. Handlers reach the transaction through the [`tx::IdempotentTx`] extractor. Its
//! key rows live in the store's table, in the store's format; see the [`tx`] module.
//!
//! It is retrysafe-tower's
//! [`IdempotencyLayer`](retrysafe_tower::idempotency::IdempotencyLayer) over a
//! [`tx::TxBackend`] (built with
//! `TxIdempotencyLayer::with_backend(TxBackend::from_store(&store))`), so the two layers
//! share one guard and one set of builder methods; see
//! [the `tx` module](tx#one-layer-two-backends) for what changed.

#![forbid(unsafe_code)]

mod sql;
mod store;
#[cfg(feature = "test-util")]
pub mod test_util;
pub mod tx;

pub use store::{PostgresStore, PostgresStoreOptions, SweeperHandle, Swept};

/// Another name of [`PostgresStoreOptions`], hidden: for code and doc links that name it.
#[doc(hidden)]
pub type PostgresStoreBuilder = PostgresStoreOptions;

/// The sqlx this crate is built on, for [`PgPool`](sqlx::PgPool) and connection
/// options of the same version.
pub use sqlx;
