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
//! - [`answer`]: the answers layers give by themselves (local failures as gRPC statuses,
//!   and the body of a response that is a layer's own or the inner service's).
//! - [`server`]: a helper that assembles the recommended server order.
#![cfg_attr(docsrs, feature(doc_cfg))]

/// `get_ref`, `get_mut` and `into_inner` on a service whose field `inner` is its inner
/// service `S` (called in an `impl` block of the service), as tower-http's services have.
macro_rules! define_inner_service_accessors {
    () => {
        /// The inner service.
        pub fn get_ref(&self) -> &S {
            &self.inner
        }

        /// The inner service, mutably.
        pub fn get_mut(&mut self) -> &mut S {
            &mut self.inner
        }

        /// The inner service, `self` consumed.
        pub fn into_inner(self) -> S {
            self.inner
        }
    };
}

pub mod answer;
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
#[cfg(feature = "propagate")]
pub mod propagate;
#[cfg(feature = "retry")]
pub mod retry;
#[cfg(feature = "idempotency")]
pub mod server;
#[cfg(feature = "throttle")]
pub mod throttle;

pub use retrysafe_core::error::BoxError;

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

#[cfg(all(
    test,
    feature = "breaker",
    feature = "budget",
    feature = "client",
    feature = "deadline",
    feature = "edge",
    feature = "hedge",
    feature = "propagate",
    feature = "retry",
    feature = "throttle",
))]
mod tests {
    use std::time::Duration;

    use retrysafe_core::budget::RetryBudget;
    use tower_layer::Layer;

    use crate::answer::GrpcStatusLayer;
    use crate::breaker::CircuitBreakerLayer;
    use crate::budget::RetryBudgetLayer;
    use crate::client::ClientLayers;
    use crate::deadline::DeadlineLayer;
    use crate::edge::EdgeLayer;
    use crate::hedge::HedgeLayer;
    use crate::propagate::PropagateLayer;
    use crate::retry::RetryLayer;
    use crate::throttle::AdaptiveThrottleLayer;

    /// An inner service told apart by its number.
    #[derive(Debug, Clone, PartialEq)]
    struct Inner(u32);

    /// The service's accessors reach the `Inner(1)` it was made over.
    macro_rules! reaches_the_inner_service {
        ($service:expr) => {{
            let mut service = $service;
            assert_eq!(service.get_ref(), &Inner(1));
            service.get_mut().0 = 2;
            assert_eq!(service.get_ref(), &Inner(2));
            assert_eq!(service.into_inner(), Inner(2));
        }};
    }

    #[test]
    fn every_service_lends_and_gives_back_its_inner_service() {
        let inner = || Inner(1);
        let budget = RetryBudgetLayer::new(RetryBudget::ratio());
        reaches_the_inner_service!(GrpcStatusLayer::new().layer(inner()));
        reaches_the_inner_service!(RetryLayer::new().layer(inner()));
        reaches_the_inner_service!(budget.layer(inner()));
        reaches_the_inner_service!(budget.server().layer(inner()));
        reaches_the_inner_service!(CircuitBreakerLayer::default().layer(inner()));
        reaches_the_inner_service!(DeadlineLayer::new(Duration::from_secs(1)).layer(inner()));
        reaches_the_inner_service!(DeadlineLayer::server().layer(inner()));
        reaches_the_inner_service!(PropagateLayer::new().layer(inner()));
        reaches_the_inner_service!(EdgeLayer::new().layer(inner()));
        reaches_the_inner_service!(HedgeLayer::new().layer(inner()));
        reaches_the_inner_service!(AdaptiveThrottleLayer::new().layer(inner()));
        reaches_the_inner_service!(ClientLayers::new().layer(inner()));
        reaches_the_inner_service!(
            crate::idempotency::IdempotencyLayer::in_memory().layer(inner())
        );
        #[cfg(feature = "tonic")]
        reaches_the_inner_service!(ClientLayers::new().grpc().layer(inner()));
    }
}
