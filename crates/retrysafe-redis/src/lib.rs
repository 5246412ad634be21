//! RedisStore: a retrysafe idempotency store on Redis (one server, Redis Sentinel or a
//! Redis Cluster), shared by every app server.
//!
//! [`RedisStore`] implements [`IdempotencyStore`](retrysafe_core::store::IdempotencyStore)
//! on [redis-rs](https://docs.rs/redis): hand it to the `IdempotencyLayer` and copies of
//! a request arriving at any app server that shares the Redis see one record.
//!
//! ```no_run
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use retrysafe::redis::RedisStore;
//! use retrysafe::idempotency::IdempotencyLayer;
//!
//! // Refuses a server whose eviction policy could drop records (anything but
//! // `maxmemory-policy noeviction`).
//! let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
//! let layer = IdempotencyLayer::new(store);
//! // let app = Router::new().route(...).layer(layer);
//! # let _ = layer;
//! # Ok(()) }
//! ```
//!
//! # How records are kept
//!
//! One Redis string key per record, `{prefix}{<record id in hex>}` (the braces are a
//! Redis Cluster hash tag), holding the record's versioned byte encoding, so that app
//! servers of two releases share records during a rolling deploy. Each transition
//! (claim, complete, release, renew, commit point, mark unknown) is one Lua script that
//! checks the claim token and, for a claim, returns the existing record: one round
//! trip per store call. Lease ends come from Redis's clock (`TIME`), expiry from `PX`.
//!
//! What recovery needs beside the record lives in a companion hash in the same hash
//! slot, `…:meta`, with the record's expiry: the request's method, path and scope
//! (and the key when the layer stores keys for resolution), the handler's resolution
//! note, why an outcome is unknown, whether the reconcile hook was told, a reconciler's
//! adoption, and the claim time. An in-flight index, a sorted set per key prefix
//! (`{prefix}inflight`; on a cluster one per hash slot), lists the records that are pending (claims and unknown
//! outcomes) by when each becomes due. The same scripts keep both, so the request path
//! gains no round trip. See [`RedisStore`] for the details.
//!
//! # Recovery
//!
//! [`RedisStore`] is a
//! [`ReconcilableStore`](retrysafe_core::recovery::ReconcilableStore): a
//! [`Reconciler`](retrysafe_core::recovery::Reconciler) finds pending records in the
//! index, adopts each with one script (the record's bytes are not touched, so a lapsed
//! adoption leaves it exactly as it was), and settles it with another. While adopted,
//! copies are told the record is being resolved and the late holder's calls are
//! refused.
//!
//! # Redis requirements
//!
//! - **Version**: Redis 5 or later, or a compatible server (Valkey); tested with
//!   Redis 7. Scripting (`EVAL`, `EVALSHA`, `SCRIPT LOAD`) must be allowed.
//! - **Eviction**: `maxmemory-policy` must be `noeviction` (writes then fail once
//!   `maxmemory` is reached, and the layer answers 503, failing closed). An `allkeys-*`
//!   policy can evict an in-flight claim, and then a copy of the request runs a second
//!   time; so can a `volatile-*` policy, since every record (an in-flight claim
//!   included) has an expiry. Making a store ([`RedisStore::connect`],
//!   [`RedisStoreOptions::build`]) checks the policy and refuses any other, or one it
//!   cannot read; on a managed service that refuses the `CONFIG` command, set
//!   [`skip_config_check`](RedisStoreOptions::skip_config_check), and making sure of
//!   `noeviction` is then yours.
//! - **Durability**: a record is only as durable as Redis. Without persistence a
//!   restart forgets every record, and copies of requests already served run again.
//!   Use AOF (`appendonly yes`, `appendfsync everysec` loses at most about a second;
//!   `always` nothing) or at least RDB snapshots.
//! - **Clocks**: leases are measured by the Redis server's clock only; app-server clocks
//!   do not matter.
//! - **Cluster**: feature `cluster`, `RedisStore::options().connect_cluster`: each record, its
//!   `:last` and `:meta` keys share the record id's hash tag, so each script runs on
//!   the node that owns them. The in-flight index is then one key per hash slot,
//!   `{prefix}inflight:{<tag>}`, the tag a short number that hashes to the slot of the
//!   records it lists, so every script touches keys of one slot and record key names
//!   are those of a single server. A reconciler walks the slots, 512 at a time, only
//!   those whose scan lease it holds (16 leases of 1024 slots, taken for 30 s and
//!   renewed by each walk, so several app servers' reconcilers split the work), and
//!   drops index entries of expired records as it finds them. The cluster client
//!   follows `MOVED` and `ASK` during resharding and may send a request again after a
//!   lost connection: every script is idempotent per token.
//! - **Sentinel**: feature `sentinel`, `RedisStore::options().connect_sentinel` (or a
//!   `SentinelConnection` given to [`RedisStoreOptions::build`]): the primary Redis
//!   Sentinel names, asked for again when its connection breaks, when it answers
//!   `READONLY`, or when it stops answering, so a failover needs no restart.
//! - **Replicas**: making a store refuses a read-only replica
//!   ([`RedisStoreError::ReadOnlyReplica`], naming its primary). A node made a replica under
//!   a running store (a failover behind a DNS name, a proxy or a managed service's
//!   endpoint) answers `READONLY`: the call is refused as unavailable (503 under the
//!   layer), a warning is logged once, and the connection is made again to the same
//!   name, which then leads to the new primary.
//! - **Replication**: asynchronous, so a failover can lose the last acknowledged
//!   writes, a claim or a completion among them, and a copy of the request may then run
//!   again. [`RedisStoreOptions::replicated_writes`] waits for replicas (`WAIT`) on each
//!   claim, commit point and completion: it reduces that loss, it does not remove it.
//!   Keep your own effect on the record's node ([`slots`]) and a failover loses both
//!   or neither.
//!
//! # Timeouts and failures
//!
//! Every call is bounded by the store's call timeout (default 1 s); the layer bounds
//! its calls by the request's deadline too. A call that times out is
//! [`StoreError::Timeout`](retrysafe_core::store::StoreError::Timeout), any other
//! failure [`StoreError::Unavailable`](retrysafe_core::store::StoreError::Unavailable);
//! the layer fails closed (503) on both by default. A call abandoned by its timeout may
//! still have run on the server: a claim then holds its key until its lease ends, and
//! the next copy resolves it as for a holder that died.
//!
//! The first call of each script after a server start (or `SCRIPT FLUSH`) takes two
//! more round trips to load it. On a cluster, a reconciler's walk over the hash slots
//! loads its scripts on every primary first, so that a primary with an empty script
//! cache is not sent one load per slot.
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod check;
mod recovery;
mod scripts;
#[cfg(feature = "sentinel")]
mod sentinel;
pub mod slots;
mod store;

pub use check::{ConfigReport, EvictionPolicy, RedisStoreError};
#[cfg(feature = "sentinel")]
#[cfg_attr(docsrs, doc(cfg(feature = "sentinel")))]
pub use sentinel::SentinelConnection;
pub use store::{RedisStore, RedisStoreOptions};

/// The redis-rs crate this store is built on, for building connections.
pub use redis;

/// The README's Rust code blocks, compiled and run as doc-tests
/// (`cargo test --doc -p retrysafe-redis`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
