//! The reconcile conformance suite, against the real PostgreSQL at `DATABASE_URL`
//! (default `postgres://postgres@127.0.0.1:5432/test`): each case in its own schema
//! (the reconciler case adopts whatever is due in its store), with real leases of
//! 400 ms measured by the database's clock.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

retrysafe_core::reconcilable_store_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    store = retrysafe_test_support::pg_store::shared_store,
    clock = retrysafe_core::store::conformance::RealClock::default(),
}
