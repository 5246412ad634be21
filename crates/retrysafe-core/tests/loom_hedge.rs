//! Loom models of the hedge's latency window, `LatencyTracker` (run by `scripts/loom`;
//! empty unless `--cfg loom`).
//!
//! The tracker is two generations of histogram counts that take turns, a sample count
//! and a cached percentile, all relaxed atomics but the generations' epochs. Under loom
//! its histogram has four exact buckets (latencies below 4 µs) and it recomputes the
//! percentile every second sample, from two. The models check that concurrent samples
//! are counted once, that a percentile read at any point is one of the recorded
//! latencies, and that a generation moving on to a new window never lets a
//! recomputation publish a percentile of samples two windows old.
#![cfg(loom)]
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::disallowed_methods,
    reason = "test code; std::time::Instant only times the model run, and panics are the \
              models' assertions"
)]

mod loom_support;
use loom_support::check;

use std::time::Duration;

use loom::thread;
use retrysafe_core::__private::LatencyTracker;
use retrysafe_core::loom_clock;

const WINDOW: Duration = Duration::from_secs(1);

fn micros(n: u64) -> Duration {
    Duration::from_micros(n)
}

/// Two threads record a sample of 1 µs each and the one that counts the second
/// recomputes: the percentile it publishes is of the samples it saw — none yet, or
/// 1 µs. Once both are known (after the join), two samples of 3 µs give the median of
/// all four, 1 µs: a sample of 1 µs lost, or one of 3 µs counted twice, would make
/// it 3 µs.
#[test]
fn concurrent_samples_are_counted_once() {
    check("hedge_tracker_samples", Some(3), || {
        let t = LatencyTracker::new(0.5, WINDOW);
        let other = {
            let t = t.clone();
            thread::spawn(move || t.record(micros(1)))
        };
        t.record(micros(1));
        let p = t.percentile();
        assert!(p.is_none() || p == Some(micros(1)), "{p:?}");
        other.join().unwrap();
        t.record(micros(3));
        t.record(micros(3));
        assert_eq!(t.percentile(), Some(micros(1)));
    });
}

/// Two windows after a sample of 3 µs, two threads record 1 µs each: one of them
/// clears the old generation while the other may count into it. Whatever the
/// interleaving, the percentile published is never the old window's, and once both
/// are done, the next recomputation sees only the new window.
#[test]
fn a_new_window_never_publishes_the_old_one() {
    check("hedge_tracker_rotation", Some(3), || {
        let t = LatencyTracker::new(0.5, WINDOW);
        t.record(micros(3));
        t.record(micros(3));
        assert_eq!(t.percentile(), Some(micros(3)));
        loom_clock::advance(WINDOW * 2);
        let other = {
            let t = t.clone();
            thread::spawn(move || t.record(micros(1)))
        };
        t.record(micros(1));
        other.join().unwrap();
        let p = t.percentile();
        assert!(
            p.is_none() || p == Some(micros(1)),
            "stale percentile {p:?}"
        );
        t.record(micros(1));
        t.record(micros(1));
        assert_eq!(t.percentile(), Some(micros(1)));
    });
}
