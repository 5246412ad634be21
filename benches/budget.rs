//! What a retry budget costs per request on the success path, and how it scales when two
//! threads share one budget.
//!
//! Every iteration is what a client does for one request that succeeds at once:
//! - `retrysafe_ratio`: `deposit()` + `record_success(None)` on the default ratio budget
//!   (the success is a no-op there; the deposit reads the clock and bumps this thread's
//!   stripe);
//! - `retrysafe_token_bucket`: the same calls on the default token bucket (the deposit
//!   is a no-op; the success only loads the level of a full bucket);
//! - `tower_tps_budget`: `deposit()` on tower's `TpsBudget::default()` (same defaults as
//!   our ratio budget: 10 s, 10/s, 20 %), which takes a mutex and reads the clock;
//! - `bare`: an empty call, for the machine's own two-thread scaling.
//!
//! Group `budget_1_thread` runs the calls on one thread; group `budget_2_threads` on two
//! threads at once sharing one budget (a barrier starts them together; the time of an
//! iteration is the slower thread's, so it is the time per call *per thread*). The
//! two-thread scaling of a case is its `budget_1_thread` time divided by its
//! `budget_2_threads` time: 1.0 is perfect scaling, 0.5 means two threads do no more
//! than one. Compare it with `bare`'s: on a 2-core machine the bare ratio is the best
//! any shared state can reach.
//!
//! No runtime is running: time comes from `tokio::time::Instant`, which reads the real
//! clock outside a paused runtime.
//!
//! `cargo bench --bench budget -- --warm-up-time 1 --measurement-time 3`
#![allow(clippy::unwrap_used, missing_docs)]

use std::hint::black_box;
use std::sync::Barrier;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use retrysafe_core::budget::{RetryBudget, RetryCost};
use tokio::time::Instant;
use tower::retry::budget::{Budget, TpsBudget};

/// Runs `call` `iters` times on each of `threads` threads started together; returns the
/// slowest thread's time.
fn timed<F: Fn() + Sync>(threads: usize, iters: u64, call: &F) -> Duration {
    let barrier = Barrier::new(threads);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    let start = Instant::now();
                    for _ in 0..iters {
                        call();
                    }
                    start.elapsed()
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap())
            .max()
            .unwrap_or_default()
    })
}

/// One group: every case on `threads` threads.
fn group(c: &mut Criterion, name: &str, threads: usize) {
    let ratio = RetryBudget::ratio();
    let bucket = RetryBudget::token_bucket();
    let tower = TpsBudget::default();

    let mut g = c.benchmark_group(name);
    g.bench_function("bare", |b| {
        b.iter_custom(|iters| timed(threads, iters, &|| black_box(())));
    });
    g.bench_function("retrysafe_ratio", |b| {
        b.iter_custom(|iters| {
            timed(threads, iters, &|| {
                ratio.deposit();
                ratio.record_success(None);
            })
        });
    });
    // The deposits went through (those of the last 10 s are still in the window).
    assert!(ratio.available_retries() > 100, "{ratio:?}");
    g.bench_function("retrysafe_token_bucket", |b| {
        b.iter_custom(|iters| {
            timed(threads, iters, &|| {
                bucket.deposit();
                bucket.record_success(None);
            })
        });
    });
    g.bench_function("tower_tps_budget", |b| {
        b.iter_custom(|iters| timed(threads, iters, &|| tower.deposit()));
    });
    g.finish();

    // The token bucket is still full, and every budget still allows a retry.
    assert_eq!(bucket.available_retries(), 100, "{bucket:?}");
    assert!(ratio.withdraw(RetryCost::Failure));
    assert!(bucket.withdraw(RetryCost::Failure));
    assert!(tower.withdraw());
}

fn one_thread(c: &mut Criterion) {
    group(c, "budget_1_thread", 1);
}

fn two_threads(c: &mut Criterion) {
    group(c, "budget_2_threads", 2);
}

criterion_group!(benches, one_thread, two_threads);
criterion_main!(benches);
