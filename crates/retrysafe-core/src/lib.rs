//! Sans-IO core of retrysafe.
//!
//! This crate holds the logic every retrysafe layer and adapter shares, with no tower
//! dependency and no I/O:
//!
//! - [`wire`]: the header convention (names in a [`wire::Convention`], total parsers and
//!   encoders);
//! - [`Deadline`]: the time a call has left, which can only be tightened;
//! - [`idempotency`]: scopes, record keys, fingerprints, tokens, the record states and
//!   their versioned byte encoding, the decision table of the `IdempotencyLayer`, and the
//!   [`IdempotencyContext`](idempotency::IdempotencyContext) handlers see;
//! - [`problem`]: the RFC 9457 answers of the server layers, written in one place;
//! - [`CallContext`]: what an inbound request passes to the outbound calls made for it
//!   (deadline, retry point, idempotency record, whether downstream gave up);
//! - [`classify`]: what an attempt's outcome means (retry safety, throttle, timeout,
//!   fault side, requested delay), shared by retry, budget and breaker;
//! - [`backoff`], [`budget`] and [`strategy`]: delays with jitter, retry budgets, and
//!   the Smithy-shaped retry strategy; [`error`]: the client layers' typed errors;
//! - [`retry`]: what the hooks of a retrying client see; and, for the adapters only,
//!   the retry planner — everything a retrying client decides for one request (keys,
//!   retry point, deadline, per-attempt headers, classify, retry or give up, hooks) —
//!   that the tower `RetryLayer` and the reqwest `RetryMiddleware` drive;
//! - [`breaker`]: the circuit breaker's state machine and sliding windows;
//! - [`throttle`]: the adaptive client-side throttle of Google
//!   SRE's "Handling Overload";
//! - [`recovery`]: the reconciler, which brings every pending record to a definite
//!   state through the application's resolver, and an operator's API;
//! - [`store`]: the [`IdempotencyStore`](store::IdempotencyStore) trait every backend
//!   implements, its boxed object-safe form, and (feature `test-util`) the conformance
//!   suite every backend passes.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod backoff;
pub mod breaker;
pub mod budget;
pub mod classify;
mod config;
mod context;
mod deadline;
mod driver;
pub mod error;
mod hash;
mod hedge;
pub mod idempotency;
pub mod observe;
pub mod problem;
pub mod recovery;
pub mod retry;
mod ring;
pub mod store;
pub mod strategy;
mod stripe;
mod sync;
pub mod throttle;
pub mod wire;

pub use config::ConfigError;

/// Plumbing shared by the retrysafe crates (the tower layers, the stores, the reqwest
/// adapters). Not part of the public API: it may change in any release.
#[doc(hidden)]
pub mod __private {
    pub use crate::backoff::RngSource;
    pub use crate::budget::BudgetId;
    pub use crate::classify::BreakerFacts;

    /// Whether headers describe a gRPC message (`content-type: application/grpc…`).
    pub fn is_grpc(headers: &http::HeaderMap) -> bool {
        crate::classify::is_grpc(headers)
    }

    /// Whether a deadline of `given` had run out, or nearly, `elapsed` after the request
    /// was sent: within a tenth of `given` (at least 50 ms) of its end.
    pub fn deadline_spent(given: std::time::Duration, elapsed: std::time::Duration) -> bool {
        crate::classify::deadline_spent(given, elapsed)
    }

    /// The least time an attempt is started with: 1 ms, the smallest
    /// `request-timeout-ms`.
    pub const MIN_ATTEMPT_TIME: std::time::Duration = crate::strategy::MIN_ATTEMPT_TIME;
    pub use crate::config::Validate;
    pub use crate::deadline::ExpiryObserver;
    pub use crate::driver::DriverSlot;
    pub use crate::hash::{DigestHash, DigestHasher};
    pub use crate::hedge::{HedgeCopy, HedgeDelay, HedgeRace, LatencyTracker};

    /// `Record::Completed(done.clone()).encode()`, without the clone.
    pub fn encode_completed(done: &crate::idempotency::Completed) -> bytes::Bytes {
        done.encode_record()
    }
    pub use crate::idempotency::decision::Disposition;

    /// [`IdempotencyContext::new`](crate::idempotency::IdempotencyContext::new) for a
    /// layer that already holds the record id of `scope` and `key` (`id` must be
    /// `RecordId::new(&scope, &key)`): the id is not hashed a second time.
    pub fn idempotency_context(
        id: crate::idempotency::RecordId,
        scope: crate::idempotency::Scope,
        key: crate::wire::IdempotencyKey,
        token: crate::idempotency::Token,
        store: crate::store::BoxStore,
        store_timeout: std::time::Duration,
    ) -> crate::idempotency::IdempotencyContext {
        crate::idempotency::IdempotencyContext::of_record(
            id,
            scope,
            key,
            token,
            Some(store),
            store_timeout,
        )
    }
    /// The claim → wait → run → complete protocol of one guarded request, which every
    /// idempotency engine drives.
    pub mod protocol {
        pub use crate::idempotency::protocol::*;
    }

    /// The metric handles of the retrysafe crates.
    pub mod handles {
        pub use crate::observe::handles::*;
    }
    pub use crate::recovery::Reconcilers;
    pub use crate::retry::{
        Attempt, IdempotentIf, RequestHead, RetryCall, RetryPolicy, Verdict, child_key_label,
    };
    pub use crate::store::{DynIdempotencyStore, StoreFuture};
    pub use crate::strategy::RetryCharged;
    pub use crate::stripe::{CachePadded, Local, MAX_ANCHORS, Striped};

    /// This thread's stripe index (any `usize`; reduce it modulo a stripe count),
    /// the one the striped counters use.
    pub fn thread_stripe() -> usize {
        crate::stripe::thread_stripe()
    }

    /// How many stripes the striped counters have (a power of two).
    pub fn stripe_count() -> usize {
        crate::stripe::stripe_count()
    }
}
pub use context::{CallContext, Scoped};
pub use deadline::{Deadline, DeadlineExpiry};
/// The clock of the loom models (`tests/loom_*.rs`); only under `--cfg loom`.
#[cfg(loom)]
#[doc(hidden)]
pub use sync::loom_clock;

/// The README's Rust code blocks, compiled and run as doc-tests
/// (`cargo test --doc -p retrysafe-core`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
