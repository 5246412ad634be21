//! RedisStore: a retrysafe idempotency store on Redis, shared by every app server.
//!
//! [`RedisStore`] implements [`IdempotencyStore`](retrysafe_core::store::IdempotencyStore)
//! on [redis-rs](https://docs.rs/redis): hand it to the `IdempotencyLayer` and copies of
//! a request arriving at any app server that shares the Redis see one record.
//!
//! ```no_run
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use retrysafe_redis::RedisStore;
//! use retrysafe_tower::idempotency::IdempotencyLayer;
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
//! See [`RedisStore`] for the details.
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
//!   `always` nothing) or at least RDB snapshots. Replication is asynchronous: a
//!   failover can lose the last writes, a recent claim among them.
//! - **Clocks**: leases are measured by the Redis server's clock only; app-server clocks
//!   do not matter.
//! - **Cluster**: supported (feature `cluster`, `RedisStore::connect_cluster`): each
//!   record is one key and each script touches only that key.
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
//! more round trips to load it.
#![forbid(unsafe_code)]

mod check;
mod scripts;
mod store;
#[cfg(feature = "test-util")]
pub mod test_util;

pub use check::{CheckError, ConfigReport, EvictionPolicy};
pub use store::{RedisStore, RedisStoreOptions};

/// The redis-rs crate this store is built on, for building connections.
pub use redis;
