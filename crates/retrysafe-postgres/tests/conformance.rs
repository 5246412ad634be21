//! The shared store conformance suite, against the real PostgreSQL at `DATABASE_URL`
//! (default `postgres://postgres@127.0.0.1:5432/test`): each case in its own schema,
//! with real leases of 400 ms measured by the database's clock.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

retrysafe_core::store_conformance_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    store = || retrysafe_test_support::pg_store::isolated_store(|b| b),
    clock = retrysafe_core::store::conformance::RealClock::default(),
}
