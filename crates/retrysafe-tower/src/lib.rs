//! Tower layers of retrysafe.
//!
//! - [`idempotency`] (feature `idempotency`): the server-side `IdempotencyLayer` that makes
//!   POST and PATCH safe to retry by `Idempotency-Key` (over retrysafe-memory's `MemoryStore`
//!   by default).
//! - [`retry`] (feature `retry`): the client-side `RetryLayer` and its `ReplayBody`.
//! - [`budget`] (feature `budget`): the `RetryBudgetLayer`, a budget on every attempt
//!   marked as a retry.
//! - [`breaker`] (feature `breaker`): the `CircuitBreakerLayer`, plain or keyed per
//!   authority, failing fast while a downstream keeps failing.
//! - [`client`] (feature `client`): [`ClientLayers`](client::ClientLayers), the
//!   standard client order (deadline → retry → budget → breaker) with the budget given
//!   once, fused into one service; with the `tonic` feature, its `.grpc()` form for
//!   tonic's generated clients.
//! - [`deadline`] (feature `deadline`): the `DeadlineLayer`, bounding a whole client call
//!   by a deadline, and its server form enforcing the inbound deadline.
//! - [`propagate`] (feature `propagate`) and [`edge`] (feature `edge`): the server side
//!   of the wire convention — inbound deadline and retry point into the inherited
//!   [`CallContext`](retrysafe_core::CallContext), and stripping convention headers
//!   from untrusted peers.
//! - [`hedge`] (feature `hedge`): the `HedgeLayer`, which sends a second copy of a slow
//!   safe request and keeps the first acceptable answer, within the retry budget.
//! - [`throttle`] (feature `throttle`): the `AdaptiveThrottleLayer`, which rejects calls
//!   locally while the callee refuses many of them (Google SRE's adaptive throttling).
//! - [`chaos`] (feature `chaos`, not on by default): the `FaultLayer`, which injects
//!   seeded latency, error answers, connection resets and replies lost after the
//!   effect, for tests and staging.
//! - [`local`]: how client layers answer the failures they generate themselves.
//! - [`server`]: a helper that assembles the recommended server order.
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "breaker")]
pub mod breaker;
#[cfg(feature = "budget")]
pub mod budget;
#[cfg(feature = "chaos")]
pub mod chaos;
#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "deadline")]
pub mod deadline;
#[cfg(feature = "edge")]
pub mod edge;
#[cfg(feature = "hedge")]
pub mod hedge;
#[cfg(feature = "idempotency")]
pub mod idempotency;
pub mod local;
#[cfg(feature = "propagate")]
pub mod propagate;
#[cfg(feature = "retry")]
pub mod retry;
#[cfg(feature = "idempotency")]
pub mod server;
#[cfg(feature = "throttle")]
pub mod throttle;

pub use retrysafe_core as core;

/// Plumbing shared with the other retrysafe crates (the transactional layer of
/// `retrysafe-postgres`): not part of the public API, it may change in any release.
#[doc(hidden)]
pub mod __private {
    #[cfg(feature = "idempotency")]
    pub use crate::idempotency::plumbing::*;
}

/// The README's Rust code blocks, compiled and run as doc-tests
/// (`cargo test --doc -p retrysafe-tower`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
