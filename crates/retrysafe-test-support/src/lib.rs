//! What retrysafe's tests, benches and examples share, so that no fixture is written
//! twice: one TCP fault proxy ([`proxy`]), the client stack of the fault runs
//! ([`client_stack`]) and the two forms of the client stack ([`forms`]), the drivers
//! of the example binaries ([`example`], [`payments`]), the Redis and PostgreSQL every
//! test shares ([`services`]), the PostgreSQL store's own fixtures ([`pg_store`]),
//! private servers a test may kill ([`private`]), local Redis Clusters and Sentinel
//! services and a connection that counts round trips ([`redis_nodes`]), the failover
//! load ([`failover`]), the observability probes ([`observe`]), the test
//! authentication ([`bearer`]), the lease race engine ([`lease_race`]), the
//! measurement examples' harness ([`measurement`]), seeded randomness ([`rng`]), and
//! the benches' yardsticks and load helpers ([`bench`](mod@bench)).
//!
//! Not published: a dev-dependency of the workspace's crates, never a dependency.
// Test support: a broken invariant of the test itself is a panic, and the helpers that
// drive child processes wait on the wall clock (std's clock and sleeps) on purpose.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::disallowed_methods,
    reason = "test support: panics are the failures of the test that calls it"
)]

pub mod bearer;
pub mod bench;
pub mod client_stack;
pub mod example;
pub mod failover;
pub mod forms;
pub mod lease_race;
pub mod measurement;
pub mod observe;
pub mod payments;
pub mod pg_store;
pub mod private;
pub mod proxy;
pub mod redis_nodes;
pub mod rng;
pub mod services;

use std::future::Future;
use std::time::{Duration, Instant};

/// Polls `check` every 20 ms until it is `Some`, for at most `within`; panics naming
/// `what` otherwise.
pub async fn eventually<T, F, Fut>(what: &str, within: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(started.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
