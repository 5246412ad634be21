//! Loom models of the circuit breaker (run by `scripts/loom`; empty unless `--cfg loom`).
//!
//! Every model explores every interleaving of its threads (and every value a relaxed or
//! acquire load may read) within loom's bounds, and asserts the state machine's
//! invariants through the breaker's `on_state_change` hook and its public API:
//!
//! - closed → open when the failure threshold is crossed, exactly once, however the
//!   failures race;
//! - open → half-open only once the open duration has passed (a clock step racing the
//!   callers), exactly once;
//! - half-open probe admission: with N probes and more callers racing, exactly N are
//!   admitted; half-open → closed only after N probe successes; → open on a probe
//!   failure or a dropped probe, which then wins over a racing success; a neutral probe
//!   gives back exactly one slot, and a dropped probe frees nothing;
//! - the window's packed (lap, counts) buckets lose no increment across a rotation, in
//!   a time window (clock step racing a record, and the sweep of stale rings) and in a
//!   count window.
//!
//! Each model prints how many executions loom explored and how long it took.
#![cfg(loom)]
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::disallowed_methods,
    reason = "test code; std::time::Instant only times the model run, and panics are the \
              models' assertions"
)]

mod loom_support;
use loom_support::check;

use std::time::Duration;

use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;
use retrysafe_core::breaker::{BreakerConfig, CircuitBreaker, Permit, SlidingWindow, State};
use retrysafe_core::classify::BreakerOutcome;
use retrysafe_core::loom_clock;

const SECOND: Duration = Duration::from_secs(1);
const FAST: Duration = Duration::from_millis(1);

/// The state changes a breaker reported, in order.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<(State, State)>>>);

impl Log {
    /// How many changes from `from` to `to` were reported.
    fn count(&self, from: State, to: State) -> usize {
        let changes = self.0.lock().unwrap();
        changes.iter().filter(|&&c| c == (from, to)).count()
    }

    /// Every change reported.
    fn all(&self) -> Vec<(State, State)> {
        self.0.lock().unwrap().clone()
    }
}

/// A breaker on a time window of 1 s in one bucket (every second is a new lap of the
/// bucket), opening at 50 % failures of at least `minimum_calls`, open for 1 s, with
/// `probes` half-open probes; its state changes go to the returned log.
fn breaker(probes: u32, minimum_calls: u32, window: SlidingWindow) -> (CircuitBreaker, Log) {
    let log = Log::default();
    let mut config = BreakerConfig::default();
    config = config.with_window(window);
    config = config.with_failure_rate_threshold(50.0);
    config = config.with_minimum_calls(minimum_calls);
    config = config.with_open_duration(SECOND);
    config = config.with_max_open_duration(60 * SECOND);
    config = config.with_half_open_probes(probes);
    config = config.with_half_open_timeout(10 * SECOND);
    let hook = log.clone();
    config = config.with_on_state_change(move |change| {
        hook.0.lock().unwrap().push((change.from, change.to));
    });
    (CircuitBreaker::new(config), log)
}

/// One call with `outcome`, which must be let through.
fn call(breaker: &CircuitBreaker, outcome: BreakerOutcome) {
    breaker.try_acquire().unwrap().record(outcome, FAST);
}

/// A breaker opened by two failures in this thread, whose open duration has passed.
fn opened(probes: u32) -> (CircuitBreaker, Log) {
    let (breaker, log) = breaker(probes, 2, SlidingWindow::time(SECOND, 1));
    call(&breaker, BreakerOutcome::Failure);
    call(&breaker, BreakerOutcome::Failure);
    assert_eq!(breaker.state(), State::Open);
    loom_clock::advance(SECOND);
    (breaker, log)
}

/// Runs `f` on a new loom thread with a clone of `breaker`.
fn on_thread<T: Send + 'static>(
    breaker: &CircuitBreaker,
    f: impl FnOnce(CircuitBreaker) -> T + Send + 'static,
) -> thread::JoinHandle<T> {
    let breaker = breaker.clone();
    thread::spawn(move || f(breaker))
}

/// Two failures race in a closed breaker that needs two calls to judge: the breaker
/// opens exactly once. Each thread records its failure on its own stripe and then reads
/// the other stripes: without the `fence(SeqCst)` after the record in
/// `Shared::record_closed` this is the store-buffering pattern, in which both reads may
/// miss the other thread's record (allowed by the memory model and by ARM and POWER
/// hardware), and the breaker stayed closed with 2 failures of 2 until the next call.
/// Loom found that in its first executions (a regression model since the fix).
#[test]
fn racing_failures_open_the_breaker_once() {
    check("closed_to_open_once", None, || {
        let (breaker, log) = breaker(1, 2, SlidingWindow::time(SECOND, 1));
        let threads: Vec<_> = (0..2)
            .map(|_| on_thread(&breaker, |b| call(&b, BreakerOutcome::Failure)))
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(log.all(), [(State::Closed, State::Open)]);
        assert_eq!(breaker.state(), State::Open);
    });
}

/// A failure and a success race in a closed breaker that needs two calls to judge, at
/// 50 %: the breaker opens exactly once. Before the fix the success could check the
/// "suspect" flag between the failure's read of the window (1 call: too few, but
/// failing) and its store of the flag, so neither saw the other and the breaker stayed
/// closed with 1 failure of 2 calls until the next call (a plain race, even under
/// sequential consistency). `Shared::evaluate` now fences after raising the flag and
/// evaluates once more (a regression model since the fix).
#[test]
fn a_success_racing_a_failure_opens_the_breaker_once() {
    check("closed_to_open_suspect", None, || {
        let (breaker, log) = breaker(1, 2, SlidingWindow::time(SECOND, 1));
        let failure = on_thread(&breaker, |b| call(&b, BreakerOutcome::Failure));
        let success = on_thread(&breaker, |b| call(&b, BreakerOutcome::Success));
        failure.join().unwrap();
        success.join().unwrap();
        assert_eq!(log.all(), [(State::Closed, State::Open)]);
    });
}

/// A success working from an older reading of the window must not lower the
/// "suspect" flag for good: with the flag raised (1 failure, 1 success; 6 calls needed),
/// a success reads the window (1 of 3: not failing) and, before it stores "not
/// suspect", two failures find the window failing (3 of 5) with the flag still up, so
/// they store nothing. Once both threads are done, the flag must be up again, so that
/// the next success evaluates and opens the breaker at 3 of 6. Before the fix the
/// success's late store won and the breaker stayed closed (found by review; the
/// models above start with the flag down).
#[test]
fn a_stale_evaluation_cannot_lower_the_suspect_flag_for_good() {
    check("closed_suspect_lowered", Some(3), || {
        let (breaker, log) = breaker(1, 6, SlidingWindow::time(SECOND, 1));
        call(&breaker, BreakerOutcome::Failure);
        call(&breaker, BreakerOutcome::Success);
        let success = on_thread(&breaker, |b| call(&b, BreakerOutcome::Success));
        let failures = on_thread(&breaker, |b| {
            call(&b, BreakerOutcome::Failure);
            call(&b, BreakerOutcome::Failure);
        });
        success.join().unwrap();
        failures.join().unwrap();
        assert_eq!(breaker.state(), State::Closed, "5 calls: too few to judge");
        call(&breaker, BreakerOutcome::Success);
        assert_eq!(log.all(), [(State::Closed, State::Open)]);
    });
}

/// The clock passes the open duration while two callers ask for a permit (one probe):
/// a caller is admitted only after the step, at most one is (the probe), and the
/// breaker goes half-open at most once — exactly once if anyone was admitted.
#[test]
fn open_goes_half_open_once_after_the_open_duration() {
    check("open_to_half_open", Some(3), || {
        let (breaker, log) = breaker(1, 2, SlidingWindow::time(SECOND, 1));
        call(&breaker, BreakerOutcome::Failure);
        call(&breaker, BreakerOutcome::Failure);
        let stepped = Arc::new(AtomicBool::new(false));
        let clock = {
            let stepped = Arc::clone(&stepped);
            thread::spawn(move || {
                loom_clock::advance(SECOND);
                stepped.store(true, Ordering::Release);
            })
        };
        let callers: Vec<_> = (0..2)
            .map(|_| {
                on_thread(&breaker, |b| match b.try_acquire() {
                    Ok(permit) => {
                        assert!(permit.is_probe());
                        // Held, not recorded: a result would change the state again.
                        Some(permit)
                    }
                    Err(_) => None,
                })
            })
            .collect();
        let permits: Vec<Permit> = callers
            .into_iter()
            .filter_map(|t| t.join().unwrap())
            .collect();
        clock.join().unwrap();
        assert!(stepped.load(Ordering::Acquire));
        assert!(permits.len() <= 1, "{} probes of 1 admitted", permits.len());
        // The caller that half-opens the breaker goes on to take the probe, unless the
        // other caller took it first: half-opened once exactly when a probe is out.
        assert_eq!(log.count(State::Open, State::HalfOpen), permits.len());
        if let Some(permit) = permits.into_iter().next() {
            assert_eq!(breaker.state(), State::HalfOpen);
            permit.record(BreakerOutcome::Success, FAST);
            assert_eq!(breaker.state(), State::Closed);
        }
    });
}

/// Three callers (two threads and the model's own) race for the two probes of a breaker
/// whose open duration has passed: exactly two are admitted, whichever of them moved the
/// breaker to half-open, which happened once; the breaker closes only when the second
/// probe succeeds.
#[test]
fn half_open_admits_exactly_the_probes() {
    check("half_open_admission", Some(2), || {
        let (breaker, log) = opened(2);
        let callers: Vec<_> = (0..2)
            .map(|_| on_thread(&breaker, |b| b.try_acquire().ok()))
            .collect();
        let mine = breaker.try_acquire().ok();
        let permits: Vec<Permit> = callers
            .into_iter()
            .filter_map(|t| t.join().unwrap())
            .chain(mine)
            .collect();
        assert_eq!(permits.len(), 2, "probes admitted");
        assert!(permits.iter().all(Permit::is_probe));
        assert_eq!(log.count(State::Open, State::HalfOpen), 1);
        assert!(breaker.try_acquire().is_err(), "a third probe");
        let mut permits = permits.into_iter();
        permits
            .next()
            .unwrap()
            .record(BreakerOutcome::Success, FAST);
        assert_eq!(breaker.state(), State::HalfOpen, "closed after one of two");
        permits
            .next()
            .unwrap()
            .record(BreakerOutcome::Success, FAST);
        assert_eq!(breaker.state(), State::Closed);
        assert_eq!(
            log.all(),
            [
                (State::Closed, State::Open),
                (State::Open, State::HalfOpen),
                (State::HalfOpen, State::Closed)
            ]
        );
    });
}

/// How the second probe ends in [`probe_results_race`].
#[derive(Clone, Copy, Debug)]
enum Second {
    Success,
    Failure,
    Dropped,
}

/// Two probes end on two threads while a third caller asks for a permit: both
/// successes close the breaker exactly once; a failure or a dropped probe reopens it
/// exactly once and it never closes, whatever the order; the third caller is never let
/// through while the breaker is not closed.
fn probe_results_race(second: Second) {
    let (breaker, log) = opened(2);
    let first = breaker.try_acquire().unwrap();
    let other = breaker.try_acquire().unwrap();
    assert_eq!(breaker.state(), State::HalfOpen);
    let a = thread::spawn(move || first.record(BreakerOutcome::Success, FAST));
    let b = thread::spawn(move || match second {
        Second::Success => other.record(BreakerOutcome::Success, FAST),
        Second::Failure => other.record(BreakerOutcome::Failure, FAST),
        Second::Dropped => drop(other),
    });
    let caller = on_thread(&breaker, |b| {
        b.try_acquire().ok().map(|permit| {
            let probe = permit.is_probe();
            drop(permit);
            probe
        })
    });
    a.join().unwrap();
    b.join().unwrap();
    let third = caller.join().unwrap();
    match second {
        Second::Success => {
            assert_eq!(log.count(State::HalfOpen, State::Closed), 1);
            assert_eq!(breaker.state(), State::Closed);
            assert_ne!(third, Some(true), "a third probe");
        }
        Second::Failure | Second::Dropped => {
            assert_eq!(log.count(State::HalfOpen, State::Open), 1, "{second:?}");
            assert_eq!(log.count(State::HalfOpen, State::Closed), 0, "{second:?}");
            assert_eq!(breaker.state(), State::Open);
            assert_eq!(third, None, "let through while reopened");
        }
    }
}

#[test]
fn probe_successes_race_and_close_once() {
    check("probes_success_success", None, || {
        probe_results_race(Second::Success);
    });
}

#[test]
fn probe_failure_wins_over_a_racing_success() {
    check("probes_success_failure", None, || {
        probe_results_race(Second::Failure);
    });
}

#[test]
fn dropped_probe_reopens_despite_a_racing_success() {
    check("probes_success_dropped", None, || {
        probe_results_race(Second::Dropped);
    });
}

/// One probe slot; one thread takes it and gives it back (a neutral result), twice,
/// while another takes it and drops it. At no point are two probes out; a neutral
/// result gives back exactly one slot and a dropped probe none (it reopens the breaker).
#[test]
fn neutral_probe_gives_back_one_slot_and_dropped_probe_none() {
    check("probe_neutral_and_dropped", Some(3), || {
        let (breaker, log) = opened(1);
        let out = Arc::new(AtomicUsize::new(0));
        let neutral = {
            let out = Arc::clone(&out);
            on_thread(&breaker, move |b| {
                let mut taken = 0;
                for _ in 0..2 {
                    if let Ok(permit) = b.try_acquire() {
                        taken += 1;
                        assert_eq!(out.fetch_add(1, Ordering::AcqRel), 0, "two probes out");
                        out.fetch_sub(1, Ordering::AcqRel);
                        permit.record(BreakerOutcome::Neutral, FAST);
                    }
                }
                taken
            })
        };
        let dropping = {
            let out = Arc::clone(&out);
            on_thread(&breaker, move |b| {
                b.try_acquire().is_ok_and(|permit| {
                    assert_eq!(out.fetch_add(1, Ordering::AcqRel), 0, "two probes out");
                    out.fetch_sub(1, Ordering::AcqRel);
                    drop(permit);
                    true
                })
            })
        };
        let neutral_taken = neutral.join().unwrap();
        let dropped = dropping.join().unwrap();
        if dropped {
            assert_eq!(breaker.state(), State::Open);
            assert_eq!(log.count(State::HalfOpen, State::Open), 1);
            assert!(breaker.try_acquire().is_err());
        } else {
            // Only neutral results: still half-open with the one slot free, once.
            assert!(neutral_taken >= 1, "nobody took the probe");
            assert_eq!(breaker.state(), State::HalfOpen);
            let probe = breaker.try_acquire().unwrap();
            assert!(probe.is_probe());
            assert!(
                breaker.try_acquire().is_err(),
                "a slot was given back twice"
            );
            probe.record(BreakerOutcome::Success, FAST);
            assert_eq!(breaker.state(), State::Closed);
        }
    });
}

/// A time window of one bucket: every second is a new lap of it. One thread records a
/// success while another steps the clock by a second (a new lap) and records a failure:
/// the failure of the new lap is never lost (the rotation and the increment are one
/// CAS; a record still in the old lap cannot overwrite it, and the sweep of stale rings
/// clears only old-lap words), and the success is counted whenever it followed the step.
#[test]
fn time_window_rotation_loses_no_increment() {
    check("time_window_rotation", Some(4), || {
        // 100 calls to judge: this breaker never opens.
        let (breaker, log) = breaker(1, 100, SlidingWindow::time(SECOND, 1));
        let stepped = Arc::new(AtomicBool::new(false));
        let old = {
            let stepped = Arc::clone(&stepped);
            on_thread(&breaker, move |b| {
                let after = stepped.load(Ordering::Acquire);
                call(&b, BreakerOutcome::Success);
                after
            })
        };
        let new = {
            let stepped = Arc::clone(&stepped);
            on_thread(&breaker, move |b| {
                loom_clock::advance(SECOND);
                stepped.store(true, Ordering::Release);
                call(&b, BreakerOutcome::Failure);
            })
        };
        let success_after_step = old.join().unwrap();
        new.join().unwrap();
        let counts = breaker.window();
        assert_eq!(counts.failures, 1, "the new lap's failure was lost");
        assert!(counts.successes <= 1);
        if success_after_step {
            assert_eq!(counts.successes, 1, "a success of the new lap was lost");
        }
        assert_eq!(counts.slow_calls, 0);
        assert!(log.all().is_empty());
    });
}

/// A count window of 2 calls in 2 buckets of 1: three calls from two threads take
/// epochs 0, 1 and 2, and epoch 2 rotates epoch 0's bucket. Whatever the order in which
/// the records land, the window ends with exactly the last two calls (a late record of
/// epoch 0 is dropped, never written over epoch 2's).
#[test]
fn count_window_rotation_keeps_exactly_the_last_calls() {
    check("count_window_rotation", None, || {
        // Successes only: never opens.
        let (breaker, log) = breaker(1, 2, SlidingWindow::count(2, 2));
        let two = on_thread(&breaker, |b| {
            call(&b, BreakerOutcome::Success);
            call(&b, BreakerOutcome::Success);
        });
        let one = on_thread(&breaker, |b| call(&b, BreakerOutcome::Success));
        two.join().unwrap();
        one.join().unwrap();
        assert_eq!(breaker.window().calls(), 2);
        assert!(log.all().is_empty());
    });
}
