//! Lease takeover against a late holder, exhaustively, on the MemoryStore: every
//! interleaving of a late holder's operations with a takeover's, run by the engine of
//! `retrysafe_test_support::lease_race` on tokio's paused clock (exact, instant), which
//! checks after every step that the store behaves as one record with one holder.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::print_stdout,
    missing_docs,
    reason = "test code: panics are the assertions; the counts are printed"
)]

use retrysafe_core::store::conformance::PausedClock;
use retrysafe_test_support::lease_race::{Outcome, run_all};

/// Every interleaving against the MemoryStore, on tokio's paused clock.
#[tokio::test(start_paused = true)]
async fn memory_store_lease_takeover_races() {
    let store = retrysafe_memory::MemoryStore::new();
    let traces = run_all(&store, &PausedClock::default()).await;
    let takeovers = traces
        .iter()
        .filter(|(_, t)| {
            t.steps
                .iter()
                .any(|(_, o, _)| *o == Outcome::Claimed { takeover: true })
        })
        .count();
    println!(
        "MemoryStore: {} interleavings, {takeovers} with a takeover",
        traces.len()
    );
    // LEASE_RACE_PRINT=1 prints every interleaving's trace.
    if std::env::var_os("LEASE_RACE_PRINT").is_some() {
        for (case, trace) in &traces {
            println!("{:?} {:?}", case.commit_point, trace.steps);
        }
    }
    assert_eq!(traces.len(), 108);
    assert!(takeovers > 0, "no case took over: the race was not reached");
}
