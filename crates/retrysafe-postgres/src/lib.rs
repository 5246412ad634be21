//! PostgreSQL backends of retrysafe, through sqlx: [`PostgresStore`], an idempotency
//! store on one table, and the transactional layer [`tx::TxIdempotencyLayer`], in which
//! the idempotency key and the handler's effects commit together; with it, the
//! transactional [`outbox`] (remote calls and messages sent after the commit by an
//! [`OutboxRelay`](outbox::OutboxRelay)) and the idempotent [`consumer`].
//!
//! Several application servers sharing one database behave as one: a key is claimed
//! by exactly one of them, a takeover of an expired lease is atomic, and leases and
//! retention are measured by the database's `clock_timestamp()`, so clock skew between
//! the servers cannot break a lease.
//!
//! ```no_run
//! use std::time::Duration;
//! use retrysafe::postgres::PostgresStore;
//! use retrysafe::idempotency::IdempotencyLayer;
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
//! ALTER TABLE retrysafe_idempotency
//!     ADD COLUMN IF NOT EXISTS request        bytea,
//!     ADD COLUMN IF NOT EXISTS note           bytea,
//!     ADD COLUMN IF NOT EXISTS unknown_reason integer,
//!     ADD COLUMN IF NOT EXISTS notified       boolean,
//!     ADD COLUMN IF NOT EXISTS adopt_token    bytea,
//!     ADD COLUMN IF NOT EXISTS adopt_until    timestamptz,
//!     ADD COLUMN IF NOT EXISTS next_pass      timestamptz,
//!     ADD COLUMN IF NOT EXISTS claimed_at     timestamptz,
//!     ADD COLUMN IF NOT EXISTS lease_ended    timestamptz;
//! CREATE INDEX IF NOT EXISTS retrysafe_idempotency_pending_idx ON retrysafe_idempotency (state, lease_until, next_pass)
//!     WHERE state IN (1, 3);
//! ```
//!
//! The recovery columns are appended by `ALTER TABLE … ADD COLUMN IF NOT EXISTS`, so
//! `migrate` upgrades the table of an earlier release in place. They are all nullable
//! and the earlier release names only its own columns, so during a rolling deploy both
//! releases work on the one table: a row the earlier release wrote reads as before
//! (without request information or note), and its unknown outcomes are due at once.
//! The earlier release does not know adoptions, though: start reconcilers once every
//! server runs this release.
//!
//! | column | meaning |
//! |---|---|
//! | `k` | the [`RecordId`](retrysafe_core::idempotency::RecordId): 32 bytes, a hash of scope and idempotency key |
//! | `state` | 1 `in_progress`, 2 `completed`, 3 `outcome_unknown` (a released record has no row, or a dead one kept for the resend window) |
//! | `fingerprint` | the 32-byte request fingerprint |
//! | `token`, `commit_point`, `lease_until` | `in_progress` only: the holder's 16-byte token; 0 undeclared, 1 before, 2 passed; the lease end |
//! | `takeovers` | how often an expired lease of this record was taken over |
//! | `expires_at` | the end of the retention: from then on the key is new again, and the sweeper deletes the row. For an `in_progress` row, its lease end plus its claim's retention |
//! | `record` | `completed` only: the record in retrysafe's versioned encoding ([`Record::encode`](retrysafe_core::idempotency::Record::encode)), so its size is the encoded length |
//! | `request` | while pending: the claim's [`RequestInfo`](retrysafe_core::idempotency::RequestInfo), encoded ([`RequestInfo::encode`](retrysafe_core::idempotency::RequestInfo::encode)), written by the claim statement itself |
//! | `note` | while pending: the resolution note of [`commit_point_with`](retrysafe_core::store::IdempotencyStore::commit_point_with), at most [`MAX_NOTE`](retrysafe_core::store::MAX_NOTE) bytes |
//! | `unknown_reason`, `notified` | `outcome_unknown` only: why ([`UnknownReason::to_code`](retrysafe_core::idempotency::UnknownReason::to_code)); whether the reconcile hook was told |
//! | `adopt_token`, `adopt_until` | a reconciler's adoption: its token and end (never after `expires_at`). While it lasts the record reads as `resolving` and the holder's token calls are refused; nothing else of the row changes, so when it lapses the record is what it was |
//! | `next_pass` | `outcome_unknown` only: when a reconciler looks again |
//! | `claimed_at` | when the record was claimed, for the pending record's age |
//!
//! `retrysafe_idempotency_pending_idx` is a partial index on the pending rows (claims
//! and unknown outcomes) by lease end and next pass: what
//! [`ReconcilableStore::due`](retrysafe_core::recovery::ReconcilableStore::due) scans.
//!
//! # Recovery
//!
//! [`PostgresStore`] is a
//! [`ReconcilableStore`](retrysafe_core::recovery::ReconcilableStore): a
//! [`Reconciler`](retrysafe_core::recovery::Reconciler) (`store.reconciler(resolver)`)
//! finds the claims whose holder vanished and the unknown outcomes, adopts each with one
//! atomic `UPDATE`, and settles it (complete, release, or look again later), each
//! settlement idempotent per adoption token. Several reconcilers and application
//! servers on one database never act on one record at once. The request path gains no
//! round trip: the request information is written by the claim statement.
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
//! Every store call is one statement (a reconciler's completing settlement aside: it
//! first reads the adopted record's fingerprint); with the prepared-statement cache of
//! sqlx warm, that is one round trip (the first use of a statement on a connection
//! prepares it).
//! A guarded request that runs costs a claim and a completion: two round trips. sqlx
//! also pings a connection as it goes back to the pool, after the call has returned.
//! On a pool given to [`PostgresStoreOptions::build`] with a
//! [`synchronous_commit`](PostgresStoreOptions::synchronous_commit) level, each write
//! runs in a transaction of its own that sets the level (`BEGIN …; SET LOCAL …` and
//! `COMMIT`): two round trips more per write.
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
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod consumer;
pub mod outbox;
mod recovery;
mod replication;
mod sql;
mod store;
pub mod tx;

pub use replication::{ReplicationReport, SynchronousCommit};
pub use store::{PostgresStore, PostgresStoreError, PostgresStoreOptions, SweeperHandle, Swept};

/// The sqlx this crate is built on, for [`PgPool`](sqlx::PgPool) and connection
/// options of the same version.
pub use sqlx;

/// The README's Rust code blocks, compiled and run as doc-tests
/// (`cargo test --doc -p retrysafe-postgres`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
