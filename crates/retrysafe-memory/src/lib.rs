//! MemoryStore: the embedded retrysafe idempotency store, in memory for one process.
//!
//! [`MemoryStore`] implements [`IdempotencyStore`](retrysafe_core::store::IdempotencyStore)
//! without any server: it is the default store of the `IdempotencyLayer`
//! (`IdempotencyLayer::in_memory()`), for a service that runs as one process, and the
//! store of tests, where it runs on tokio's paused clock. Copies of a request reaching
//! *another* process do not see its records: several app servers share a
//! `RedisStore` or a `PostgresStore` instead.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use retrysafe_core::idempotency::{CommitPoint, Fingerprint, Record, RecordId, Scope, Token};
//! use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore};
//! use retrysafe::wire::IdempotencyKey;
//! use retrysafe::memory::MemoryStore;
//!
//! let store = MemoryStore::new().max_in_flight(1_000).build()?;
//! let id = RecordId::new(&Scope::new("tenant-1"), &IdempotencyKey::new("order-42")?);
//! let claim = Claim::new(
//!     Token::random(),
//!     Fingerprint::from_bytes([7; 32]),
//!     Duration::from_secs(10),
//!     Duration::from_secs(60),
//!     CommitPoint::Undeclared,
//! );
//! assert_eq!(store.claim(&id, &claim).await?, ClaimOutcome::Claimed { takeover: false });
//! assert!(matches!(store.get(&id).await?, Some(Record::InProgress(_))));
//! assert_eq!(store.in_flight_len(), 1);
//!
//! // The holder gives up before its effect: the key is free again.
//! store.release(&id, claim.token).await?;
//! assert_eq!(store.get(&id).await?, None);
//! assert_eq!(store.in_flight_len(), 0);
//! # Ok(()) }
//! ```
//!
//! # How records are kept
//!
//! Two structures, each with its own bound:
//!
//! - **in-flight claims** (`in_progress` records) live in a sharded map of plain
//!   mutexes, bounded by a count and *never evicted*: forgetting a running claim would
//!   let a duplicate run. When the map is full a new claim gets
//!   [`StoreError::Full`](retrysafe_core::store::StoreError::Full) (the layer answers
//!   503), after expired leases were swept out of the way;
//! - **completed and `outcome_unknown` records** live in the store's own LRU, bounded
//!   by bytes and changed under the same locks as the claims, so that no claim slips
//!   in while a record is being pushed out. A record pushed out leaves a compact
//!   *tombstone* until its retention ends: a copy of its request is refused (409
//!   `response-evicted`), never run again. Only when the tombstones no longer fit are
//!   the oldest dropped (reported, and measured by
//!   [`MemoryStore::effective_retention`]), or, with
//!   [`MemoryStore::fail_closed_when_full`], new claims are refused instead. The scopes
//!   holding the most bytes are shrunk first, so one tenant's flood does not push out
//!   another's records.
//!
//! All time is tokio time, so the store runs on tokio's paused clock in tests. See
//! [`MemoryStore`] for the details.
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod eviction;
mod inner;
mod order;
mod reconcile;
mod retained;
mod sketch;
mod store;
mod tombstones;

pub use eviction::{Eviction, EvictionKind};
pub use store::MemoryStore;

/// The README's Rust code blocks, compiled and run as doc-tests
/// (`cargo test --doc -p retrysafe-memory`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
