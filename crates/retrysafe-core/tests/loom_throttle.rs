//! Loom models of the adaptive throttle's counts (run by `scripts/loom`; empty unless
//! `--cfg loom`).
//!
//! The counts are striped rings of packed (lap, count) words, like the ratio budget's
//! deposits. Every model explores every interleaving of its threads and asserts that no
//! request or accept is lost or counted twice — with threads on one stripe or on two,
//! and while a bucket rotates into a new lap — and that the rejection probability read
//! at any point is one of the formula's values for counts that really occurred. Every
//! decision reads all the stripes' buckets, so the models are bounded to 2 preemptions.
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
use retrysafe_core::loom_clock;
use retrysafe_core::throttle::{AdaptiveThrottle, ThrottleConfig};

/// A throttle over the shortest window (1 s in 10 buckets), K = 2.
fn throttle() -> AdaptiveThrottle {
    AdaptiveThrottle::new(
        ThrottleConfig::default()
            .with_window(Duration::from_secs(1))
            .with_k(2.0),
    )
}

/// Two threads each admit a call and record an accept while a third reads the
/// probability: every count lands exactly once, and the probability read is never
/// above what the counts at any point allow (requests ≤ 2, accepts ≥ 0: at most 2/3).
#[test]
fn concurrent_calls_are_counted_once() {
    check("throttle_counts", Some(2), || {
        let t = throttle();
        let callers: Vec<_> = (0..2)
            .map(|_| {
                let t = t.clone();
                thread::spawn(move || {
                    assert!(t.admit(1.0), "a draw of 1.0 is never rejected");
                    t.record_accept();
                })
            })
            .collect();
        let p = t.rejection_probability();
        assert!((0.0..=2.0 / 3.0).contains(&p), "probability {p}");
        for c in callers {
            c.join().unwrap();
        }
        assert_eq!(t.counts(), (2, 2));
        assert_eq!(t.rejection_probability(), 0.0);
    });
}

/// A bucket rotates into a new lap (the clock moves by a whole window) while another
/// thread counts: the counts made after the step are never lost, and nothing of the
/// old lap leaks into the new window.
#[test]
fn rotation_loses_no_count_of_the_new_lap() {
    check("throttle_rotation", Some(2), || {
        let t = throttle();
        let old = {
            let t = t.clone();
            thread::spawn(move || {
                let _ = t.admit(1.0);
            })
        };
        loom_clock::advance(Duration::from_secs(1));
        assert!(t.admit(1.0));
        t.record_accept();
        old.join().unwrap();
        let (requests, accepts) = t.counts();
        assert_eq!(accepts, 1);
        assert!(
            requests == 1 || requests == 2,
            "the new lap's request is kept; the other counted at most once: {requests}"
        );
    });
}
