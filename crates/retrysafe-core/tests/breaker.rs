//! Tests of the circuit breaker's state machine, on tokio's paused clock: every
//! transition, the rates and their minimum, the time and count windows, neutral and slow
//! calls, the open duration's doubling, half-open probes (racing, dropped, timed out),
//! forced-open and disabled, concurrency and configuration.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use retrysafe_core::breaker::{
    BreakerConfig, CircuitBreaker, Permit, SlidingWindow, State, StateChange, WindowCounts,
};
use retrysafe_core::classify::{BreakerOutcome, Classification, FaultSide, RetrySafety};
use tokio::time::{Instant, advance};

const FAST: Duration = Duration::from_millis(1);
const SECOND: Duration = Duration::from_secs(1);

fn breaker_with(change: impl FnOnce(BreakerConfig) -> BreakerConfig) -> CircuitBreaker {
    CircuitBreaker::new(change(BreakerConfig::default()))
}

/// Makes `n` calls with `outcome`, each taking `elapsed`; every one must be let through.
fn calls(breaker: &CircuitBreaker, n: usize, outcome: BreakerOutcome, elapsed: Duration) {
    for i in 0..n {
        let permit = breaker
            .try_acquire()
            .unwrap_or_else(|e| panic!("call {i} of {n} refused: {e}"));
        permit.record(outcome, elapsed);
    }
}

fn failures(breaker: &CircuitBreaker, n: usize) {
    calls(breaker, n, BreakerOutcome::Failure, FAST);
}

fn successes(breaker: &CircuitBreaker, n: usize) {
    calls(breaker, n, BreakerOutcome::Success, FAST);
}

/// The time a refused call is told to wait; panics if the call is let through.
fn refused(breaker: &CircuitBreaker) -> Duration {
    match breaker.try_acquire() {
        Ok(permit) => panic!("expected a refusal, got {permit:?}"),
        Err(open) => open.retry_in(),
    }
}

fn counts(breaker: &CircuitBreaker) -> (u64, u64, u64) {
    let WindowCounts {
        successes,
        failures,
        slow_calls,
        ..
    } = breaker.window();
    (successes, failures, slow_calls)
}

/// A hook that logs every change, and the log.
fn logged(config: &mut BreakerConfig) -> Arc<Mutex<Vec<StateChange>>> {
    let log: Arc<Mutex<Vec<StateChange>>> = Arc::default();
    let sink = Arc::clone(&log);
    *config = config
        .clone()
        .with_on_state_change(move |change| sink.lock().unwrap().push(change));
    log
}

fn transitions(log: &Mutex<Vec<StateChange>>) -> Vec<(State, State)> {
    log.lock().unwrap().iter().map(|c| (c.from, c.to)).collect()
}

/// Opens a default-configured breaker with 20 failures.
fn trip(breaker: &CircuitBreaker) {
    failures(breaker, 20);
    assert_eq!(breaker.state(), State::Open);
}

/// Takes `n` probes (the breaker must let them through).
fn probes(breaker: &CircuitBreaker, n: usize) -> Vec<Permit> {
    (0..n)
        .map(|i| {
            let permit = breaker
                .try_acquire()
                .unwrap_or_else(|e| panic!("probe {i} refused: {e}"));
            assert!(permit.is_probe());
            permit
        })
        .collect()
}

// ----- closed → open: rates, minimum calls, thresholds -----

#[tokio::test(start_paused = true)]
async fn opens_at_the_failure_rate_once_the_window_holds_minimum_calls() {
    let breaker = CircuitBreaker::default();
    failures(&breaker, 19);
    assert_eq!(
        breaker.state(),
        State::Closed,
        "19 calls are below the minimum"
    );
    assert_eq!(counts(&breaker), (0, 19, 0));
    failures(&breaker, 1);
    assert_eq!(breaker.state(), State::Open);
    assert_eq!(refused(&breaker), Duration::from_secs(5));
    advance(Duration::from_secs(2)).await;
    assert_eq!(refused(&breaker), Duration::from_secs(3));
    // Reading the state changes nothing, even once the open duration has passed.
    advance(Duration::from_secs(3)).await;
    assert_eq!(breaker.state(), State::Open);
}

#[tokio::test(start_paused = true)]
async fn exactly_at_the_threshold_opens_and_just_below_does_not() {
    let at = CircuitBreaker::default();
    successes(&at, 10);
    failures(&at, 10);
    assert_eq!(at.state(), State::Open, "10 of 20 is exactly 50 %");

    let below = CircuitBreaker::default();
    successes(&below, 11);
    failures(&below, 9);
    assert_eq!(below.state(), State::Closed, "45 %");
    failures(&below, 1);
    assert_eq!(below.state(), State::Closed, "10 of 21");
    failures(&below, 1);
    assert_eq!(below.state(), State::Open, "11 of 22 is 50 %");

    let custom = breaker_with(|c| c.with_failure_rate_threshold(25.0).with_minimum_calls(4));
    successes(&custom, 4);
    failures(&custom, 1);
    assert_eq!(custom.state(), State::Closed, "1 of 5 is 20 %");
    successes(&custom, 2);
    failures(&custom, 1);
    assert_eq!(custom.state(), State::Open, "2 of 8 is 25 %");
}

#[tokio::test(start_paused = true)]
async fn a_success_that_brings_the_window_to_minimum_calls_opens_it() {
    let breaker = CircuitBreaker::default();
    failures(&breaker, 19);
    assert_eq!(breaker.state(), State::Closed);
    successes(&breaker, 1);
    assert_eq!(breaker.state(), State::Open, "19 failures of 20 calls");

    let healthy = CircuitBreaker::default();
    failures(&healthy, 9);
    successes(&healthy, 200);
    assert_eq!(healthy.state(), State::Closed);
    assert_eq!(counts(&healthy), (200, 9, 0));
}

#[tokio::test(start_paused = true)]
async fn neutral_outcomes_are_not_counted_and_client_faults_are_successes() {
    let dependency = Classification::failure(RetrySafety::No, FaultSide::Dependency);
    let deadline = Classification::failure(RetrySafety::Maybe, FaultSide::CallerDeadline);
    let client = Classification::failure(RetrySafety::No, FaultSide::Client);
    let server = Classification::failure(RetrySafety::Maybe, FaultSide::Server);
    assert_eq!(dependency.breaker_outcome(), BreakerOutcome::Neutral);
    assert_eq!(deadline.breaker_outcome(), BreakerOutcome::Neutral);
    assert_eq!(client.breaker_outcome(), BreakerOutcome::Success);
    assert_eq!(server.breaker_outcome(), BreakerOutcome::Failure);

    let breaker = CircuitBreaker::default();
    for _ in 0..500 {
        calls(&breaker, 1, dependency.breaker_outcome(), FAST);
        calls(&breaker, 1, deadline.breaker_outcome(), FAST);
    }
    assert_eq!(breaker.state(), State::Closed, "1000 neutral outcomes");
    assert_eq!(breaker.window().calls(), 0);

    calls(&breaker, 30, client.breaker_outcome(), FAST);
    failures(&breaker, 19);
    calls(&breaker, 50, BreakerOutcome::Neutral, FAST);
    assert_eq!(breaker.state(), State::Closed, "19 of 49");
    assert_eq!(counts(&breaker), (30, 19, 0));

    let short = CircuitBreaker::default();
    failures(&short, 19);
    calls(&short, 50, BreakerOutcome::Neutral, FAST);
    assert_eq!(
        short.state(),
        State::Closed,
        "neutral outcomes do not reach the minimum"
    );
}

// ----- windows -----

#[tokio::test(start_paused = true)]
async fn a_failure_slides_out_of_the_time_window_at_exactly_30_s() {
    let inside = CircuitBreaker::default();
    failures(&inside, 10);
    advance(Duration::from_millis(29_999)).await;
    assert_eq!(counts(&inside), (0, 10, 0));
    failures(&inside, 10);
    assert_eq!(inside.state(), State::Open, "20 failures within 30 s");

    let outside = CircuitBreaker::default();
    failures(&outside, 10);
    advance(Duration::from_secs(30)).await;
    assert_eq!(counts(&outside), (0, 0, 0));
    failures(&outside, 10);
    assert_eq!(outside.state(), State::Closed, "the first 10 slid out");
    assert_eq!(counts(&outside), (0, 10, 0));
}

#[tokio::test(start_paused = true)]
async fn calls_leave_the_time_window_with_their_bucket() {
    // 30 s in 10 buckets of 3 s: a call counts until the end of the 10th bucket after
    // its own, so between 27 and 30 s.
    let breaker = CircuitBreaker::default();
    advance(Duration::from_millis(2_999)).await; // bucket 0
    failures(&breaker, 1);
    advance(Duration::from_millis(1)).await; // bucket 1
    failures(&breaker, 2);
    advance(Duration::from_millis(26_999)).await; // 29.999 s: both still in
    assert_eq!(counts(&breaker), (0, 3, 0));
    advance(Duration::from_millis(1)).await; // 30 s: bucket 0 leaves
    assert_eq!(counts(&breaker), (0, 2, 0));
    advance(Duration::from_millis(2_999)).await;
    assert_eq!(counts(&breaker), (0, 2, 0));
    advance(Duration::from_millis(1)).await; // 33 s: bucket 1 leaves
    assert_eq!(counts(&breaker), (0, 0, 0));
    // An idle window starts over, hours later.
    advance(Duration::from_secs(5 * 3600)).await;
    successes(&breaker, 3);
    assert_eq!(counts(&breaker), (3, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_count_window_holds_the_last_calls() {
    let exact = breaker_with(|c| {
        c.with_window(SlidingWindow::count(10, 10))
            .with_minimum_calls(10)
    });
    successes(&exact, 10);
    failures(&exact, 4);
    assert_eq!(counts(&exact), (6, 4, 0));
    assert_eq!(exact.state(), State::Closed);
    failures(&exact, 1);
    assert_eq!(exact.state(), State::Open, "5 of the last 10 failed");

    // 20 calls in 4 buckets of 5: the current bucket and the 3 before it.
    let bucketed = breaker_with(|c| {
        c.with_window(SlidingWindow::count(20, 4))
            .with_minimum_calls(1)
    });
    successes(&bucketed, 20);
    assert_eq!(bucketed.window().calls(), 20);
    successes(&bucketed, 3);
    assert_eq!(bucketed.window().calls(), 18, "calls 6 to 23");
    successes(&bucketed, 2);
    assert_eq!(bucketed.window().calls(), 20, "calls 6 to 25");
    // Time plays no part.
    advance(Duration::from_secs(3600)).await;
    assert_eq!(bucketed.window().calls(), 20);
}

#[tokio::test(start_paused = true)]
async fn a_very_busy_bucket_halves_its_counts_and_keeps_its_rates() {
    let breaker = breaker_with(|c| c.with_slow_call_duration(SECOND));
    // 60 000 calls in one bucket of one thread: a third failures, a third slow.
    for _ in 0..20_000 {
        calls(&breaker, 1, BreakerOutcome::Success, FAST);
        calls(&breaker, 1, BreakerOutcome::Success, SECOND);
        calls(&breaker, 1, BreakerOutcome::Failure, FAST);
    }
    assert_eq!(breaker.state(), State::Closed);
    let (ok, failed, slow) = counts(&breaker);
    let total = ok + failed;
    assert!((8_191..60_000).contains(&total), "halved: {total}");
    assert!(
        failed * 3 >= total - 3 && failed * 3 <= total + 3,
        "{failed} of {total}"
    );
    assert!(
        slow * 3 >= total - 3 && slow * 3 <= total + 3,
        "{slow} of {total}"
    );
    // The rate still decides: a run of failures pushes it to 50 %, where it opens.
    let mut run = 0;
    while let Ok(permit) = breaker.try_acquire() {
        permit.record(BreakerOutcome::Failure, FAST);
        run += 1;
    }
    assert_eq!(breaker.state(), State::Open);
    assert!(run > 1000 && run <= total, "opened after {run} failures");
}

// ----- slow calls -----

#[tokio::test(start_paused = true)]
async fn slow_calls_open_the_breaker_at_their_rate() {
    let breaker = breaker_with(|c| {
        c.with_slow_call_duration(SECOND)
            .with_slow_call_rate_threshold(50.0)
    });
    successes(&breaker, 10);
    calls(&breaker, 9, BreakerOutcome::Success, Duration::from_secs(5));
    assert_eq!(counts(&breaker), (19, 0, 9));
    assert_eq!(breaker.state(), State::Closed);
    // Exactly the slow-call duration is slow.
    calls(&breaker, 1, BreakerOutcome::Success, SECOND);
    assert_eq!(breaker.state(), State::Open, "10 slow calls of 20");

    // A slow failure counts as both.
    let both = breaker_with(|c| c.with_slow_call_duration(SECOND));
    calls(&both, 3, BreakerOutcome::Failure, SECOND);
    calls(
        &both,
        1,
        BreakerOutcome::Success,
        Duration::from_millis(999),
    );
    assert_eq!(counts(&both), (1, 3, 3));

    // Without a slow-call duration, time does not matter.
    let untracked = CircuitBreaker::default();
    calls(
        &untracked,
        50,
        BreakerOutcome::Success,
        Duration::from_secs(3600),
    );
    assert_eq!(counts(&untracked), (50, 0, 0));
    assert_eq!(untracked.state(), State::Closed);
}

// ----- open and half-open -----

#[tokio::test(start_paused = true)]
async fn open_duration_doubles_up_to_the_maximum_and_resets_after_closing() {
    let breaker = CircuitBreaker::default();
    trip(&breaker);
    for secs in [5, 10, 20, 40, 60, 60] {
        let open = Duration::from_secs(secs);
        assert_eq!(refused(&breaker), open, "opened for {secs} s");
        advance(open - FAST).await;
        assert_eq!(refused(&breaker), FAST);
        advance(FAST).await;
        let probe = breaker.try_acquire().unwrap();
        assert_eq!(breaker.state(), State::HalfOpen);
        probe.record(BreakerOutcome::Failure, FAST);
        assert_eq!(breaker.state(), State::Open);
    }
    advance(Duration::from_secs(60)).await;
    for probe in probes(&breaker, 3) {
        probe.record(BreakerOutcome::Success, FAST);
    }
    assert_eq!(breaker.state(), State::Closed);
    assert_eq!(breaker.window().calls(), 0, "closing empties the window");
    trip(&breaker);
    assert_eq!(refused(&breaker), Duration::from_secs(5), "back to 5 s");
}

#[tokio::test(start_paused = true)]
async fn every_transition_is_reported_with_its_time() {
    let mut config = BreakerConfig::default();
    let log = logged(&mut config);
    let breaker = CircuitBreaker::new(config);
    let t0 = Instant::now();
    trip(&breaker);
    advance(Duration::from_secs(5)).await;
    let mut all = probes(&breaker, 3);
    assert!(matches!(breaker.try_acquire(), Err(e) if e.retry_in() == Duration::from_secs(10)));
    all.pop().unwrap().record(BreakerOutcome::Failure, FAST); // HalfOpen → Open
    drop(all); // late results of a reopened phase change nothing
    advance(Duration::from_secs(10)).await;
    for probe in probes(&breaker, 3) {
        probe.record(BreakerOutcome::Success, FAST);
    }
    breaker.force_open();
    breaker.force_open(); // no change, no report
    breaker.reset();
    breaker.disable();
    breaker.reset();
    breaker.reset();
    assert_eq!(
        transitions(&log),
        [
            (State::Closed, State::Open),
            (State::Open, State::HalfOpen),
            (State::HalfOpen, State::Open),
            (State::Open, State::HalfOpen),
            (State::HalfOpen, State::Closed),
            (State::Closed, State::ForcedOpen),
            (State::ForcedOpen, State::Closed),
            (State::Closed, State::Disabled),
            (State::Disabled, State::Closed),
        ]
    );
    let at: Vec<Duration> = log.lock().unwrap().iter().map(|c| c.at - t0).collect();
    let s = Duration::from_secs;
    assert_eq!(
        at,
        [s(0), s(5), s(5), s(15), s(15), s(15), s(15), s(15), s(15)]
    );
}

#[tokio::test(start_paused = true)]
async fn half_open_hands_exactly_the_probes_to_racing_threads() {
    const THREADS: usize = 8;
    let breaker = CircuitBreaker::default();
    trip(&breaker);
    advance(Duration::from_secs(5)).await;
    let handle = tokio::runtime::Handle::current();
    let barrier = Barrier::new(THREADS);
    // Every thread races for the transition to half-open and for the probes.
    let permits: Vec<Permit> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|_| {
                let (breaker, handle, barrier) = (breaker.clone(), handle.clone(), &barrier);
                s.spawn(move || {
                    let _runtime = handle.enter(); // the paused clock
                    barrier.wait();
                    (0..200)
                        .filter_map(|_| breaker.try_acquire().ok())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    assert_eq!(permits.len(), 3);
    assert!(permits.iter().all(Permit::is_probe));
    assert_eq!(breaker.state(), State::HalfOpen);
    for permit in permits {
        permit.record(BreakerOutcome::Success, FAST);
    }
    assert_eq!(breaker.state(), State::Closed);
}

#[tokio::test(start_paused = true)]
async fn half_open_hands_exactly_the_probes_to_racing_tasks() {
    let breaker = breaker_with(|c| c.with_half_open_probes(5));
    trip(&breaker);
    advance(Duration::from_secs(5)).await;
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let breaker = breaker.clone();
            tokio::spawn(async move { breaker.try_acquire().ok() })
        })
        .collect();
    let mut permits = Vec::new();
    for task in tasks {
        permits.extend(task.await.unwrap());
    }
    assert_eq!(permits.len(), 5);
}

#[tokio::test(start_paused = true)]
async fn a_probe_failure_reopens_and_a_dropped_probe_counts_as_one() {
    let breaker = CircuitBreaker::default();
    trip(&breaker);
    advance(Duration::from_secs(5)).await;
    let mut taken = probes(&breaker, 3);
    taken.pop().unwrap().record(BreakerOutcome::Success, FAST);
    drop(taken.pop()); // no result
    assert_eq!(breaker.state(), State::Open);
    assert_eq!(refused(&breaker), Duration::from_secs(10));
    // The last probe's late success belongs to a phase that is over.
    taken.pop().unwrap().record(BreakerOutcome::Success, FAST);
    assert_eq!(breaker.state(), State::Open);

    // A permit of a closed breaker dropped without a result counts for nothing.
    let closed = CircuitBreaker::default();
    for _ in 0..100 {
        let permit = closed.try_acquire().unwrap();
        assert!(!permit.is_probe());
        drop(permit);
    }
    assert_eq!(closed.window().calls(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_slow_probe_is_a_failure_and_a_neutral_one_gives_its_turn_back() {
    let breaker = breaker_with(|c| c.with_slow_call_duration(SECOND));
    calls(&breaker, 20, BreakerOutcome::Failure, FAST);
    advance(Duration::from_secs(5)).await;
    let mut taken = probes(&breaker, 3);
    assert!(breaker.try_acquire().is_err());
    taken.pop().unwrap().record(BreakerOutcome::Neutral, FAST);
    assert_eq!(breaker.state(), State::HalfOpen);
    taken.extend(probes(&breaker, 1)); // the neutral probe's turn
    assert!(breaker.try_acquire().is_err());
    taken.pop().unwrap().record(BreakerOutcome::Success, FAST);
    taken.pop().unwrap().record(BreakerOutcome::Success, SECOND); // slow
    assert_eq!(breaker.state(), State::Open);
    assert_eq!(refused(&breaker), Duration::from_secs(10));
}

#[tokio::test(start_paused = true)]
async fn probes_that_never_report_time_out_and_reopen() {
    let breaker = CircuitBreaker::default();
    trip(&breaker);
    advance(Duration::from_secs(5)).await;
    let first = probes(&breaker, 1);
    advance(Duration::from_secs(8)).await;
    let later = probes(&breaker, 2); // the timeout counts from the last probe handed out
    advance(Duration::from_secs(9)).await;
    assert_eq!(refused(&breaker), SECOND);
    assert_eq!(breaker.state(), State::HalfOpen);
    advance(SECOND - FAST).await;
    assert_eq!(refused(&breaker), FAST);
    advance(FAST).await;
    // 10 s after the last probe left: this caller reopens the breaker (a second opening).
    assert_eq!(refused(&breaker), Duration::from_secs(10));
    assert_eq!(breaker.state(), State::Open);
    for probe in first.into_iter().chain(later) {
        probe.record(BreakerOutcome::Success, FAST);
    }
    assert_eq!(breaker.state(), State::Open, "late results are ignored");

    // While probes are still to be handed out, nothing times out.
    let idle = CircuitBreaker::default();
    trip(&idle);
    advance(Duration::from_secs(5)).await;
    probes(&idle, 1)
        .pop()
        .unwrap()
        .record(BreakerOutcome::Success, FAST);
    advance(Duration::from_secs(3600)).await;
    for probe in probes(&idle, 2) {
        probe.record(BreakerOutcome::Success, FAST);
    }
    assert_eq!(idle.state(), State::Closed);
}

#[tokio::test(start_paused = true)]
async fn results_from_an_earlier_phase_are_ignored() {
    let breaker = CircuitBreaker::default();
    let early = breaker.try_acquire().unwrap();
    trip(&breaker);
    advance(Duration::from_secs(5)).await;
    for probe in probes(&breaker, 3) {
        probe.record(BreakerOutcome::Success, FAST);
    }
    assert_eq!(breaker.state(), State::Closed);
    early.record(BreakerOutcome::Failure, FAST);
    assert_eq!(breaker.window().calls(), 0);

    // reset() starts a new phase too.
    let before_reset = breaker.try_acquire().unwrap();
    breaker.reset();
    before_reset.record(BreakerOutcome::Failure, FAST);
    assert_eq!(breaker.window().calls(), 0);
}

// ----- forced open, disabled, reset -----

#[tokio::test(start_paused = true)]
async fn forced_open_refuses_everything_until_reset() {
    let breaker = CircuitBreaker::default();
    successes(&breaker, 5);
    breaker.force_open();
    assert_eq!(breaker.state(), State::ForcedOpen);
    assert_eq!(refused(&breaker), Duration::from_secs(60));
    advance(Duration::from_secs(24 * 3600)).await;
    assert_eq!(refused(&breaker), Duration::from_secs(60));
    assert_eq!(breaker.state(), State::ForcedOpen);
    breaker.reset();
    assert_eq!(breaker.state(), State::Closed);
    assert_eq!(breaker.window().calls(), 0);
    successes(&breaker, 1);
}

#[tokio::test(start_paused = true)]
async fn disabled_lets_everything_through_and_counts_nothing() {
    let breaker = CircuitBreaker::default();
    trip(&breaker);
    breaker.disable();
    assert_eq!(breaker.state(), State::Disabled);
    failures(&breaker, 1000);
    for _ in 0..10 {
        let permit = breaker.try_acquire().unwrap();
        assert!(!permit.is_probe());
        drop(permit);
    }
    assert_eq!(breaker.state(), State::Disabled);
    breaker.reset();
    assert_eq!(breaker.state(), State::Closed);
    assert_eq!(breaker.window().calls(), 0);
}

#[tokio::test(start_paused = true)]
async fn reset_closes_with_an_empty_window_and_the_first_open_duration() {
    let breaker = CircuitBreaker::default();
    trip(&breaker);
    advance(Duration::from_secs(5)).await;
    probes(&breaker, 1)
        .pop()
        .unwrap()
        .record(BreakerOutcome::Failure, FAST);
    assert_eq!(refused(&breaker), Duration::from_secs(10));
    breaker.reset();
    assert_eq!(breaker.state(), State::Closed);
    failures(&breaker, 19);
    breaker.reset();
    failures(&breaker, 19);
    assert_eq!(breaker.state(), State::Closed, "the first 19 were cleared");
    failures(&breaker, 1);
    assert_eq!(refused(&breaker), Duration::from_secs(5));
}

// ----- concurrency -----

#[tokio::test(start_paused = true)]
async fn concurrent_records_from_threads_count_exactly() {
    const THREADS: u64 = 6;
    const ROUNDS: u64 = 500; // 9000 calls: within the count windows
    for window in [
        SlidingWindow::default(),
        SlidingWindow::count(10_000, 10),
        SlidingWindow::count(10_000, 1_000),
    ] {
        let breaker = breaker_with(|c| c.with_window(window).with_slow_call_duration(SECOND));
        let handle = tokio::runtime::Handle::current();
        std::thread::scope(|s| {
            for _ in 0..THREADS {
                let (breaker, handle) = (breaker.clone(), handle.clone());
                s.spawn(move || {
                    let _runtime = handle.enter();
                    // Never more than a third failures, or slow calls: the breaker stays
                    // closed whatever the interleaving.
                    for _ in 0..ROUNDS {
                        calls(&breaker, 1, BreakerOutcome::Success, FAST);
                        calls(&breaker, 1, BreakerOutcome::Success, SECOND);
                        calls(&breaker, 1, BreakerOutcome::Failure, FAST);
                    }
                });
            }
        });
        assert_eq!(breaker.state(), State::Closed, "{window:?}");
        assert_eq!(
            counts(&breaker),
            (2 * THREADS * ROUNDS, THREADS * ROUNDS, THREADS * ROUNDS),
            "{window:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn concurrent_failures_open_the_breaker_once() {
    let mut config = BreakerConfig::default();
    let log = logged(&mut config);
    let breaker = CircuitBreaker::new(config);
    let handle = tokio::runtime::Handle::current();
    std::thread::scope(|s| {
        for _ in 0..4 {
            let (breaker, handle) = (breaker.clone(), handle.clone());
            s.spawn(move || {
                let _runtime = handle.enter();
                for _ in 0..1000 {
                    if let Ok(permit) = breaker.try_acquire() {
                        permit.record(BreakerOutcome::Failure, FAST);
                    }
                }
            });
        }
    });
    assert_eq!(breaker.state(), State::Open);
    assert_eq!(transitions(&log), [(State::Closed, State::Open)]);
}

// ----- configuration -----

#[tokio::test(start_paused = true)]
async fn configuration_is_validated() {
    type Change = fn(BreakerConfig) -> BreakerConfig;
    let cases: &[(Change, &str)] = &[
        (
            |c| c.with_window(SlidingWindow::time(Duration::ZERO, 10)),
            "window.length",
        ),
        (
            |c| c.with_window(SlidingWindow::time(Duration::from_millis(999), 1)),
            "window.length",
        ),
        (
            |c| c.with_window(SlidingWindow::time(Duration::from_secs(31 * 86_400), 10)),
            "window.length",
        ),
        (
            |c| c.with_window(SlidingWindow::time(Duration::from_secs(1), 101)),
            "window.buckets",
        ),
        (
            |c| c.with_window(SlidingWindow::time(Duration::from_secs(30), 0)),
            "window.buckets",
        ),
        (
            |c| c.with_window(SlidingWindow::count(0, 1)),
            "window.calls",
        ),
        (
            |c| c.with_window(SlidingWindow::count(10_001, 1)),
            "window.calls",
        ),
        (
            |c| c.with_window(SlidingWindow::count(100, 0)),
            "window.buckets",
        ),
        (
            |c| c.with_window(SlidingWindow::count(100, 7)),
            "window.calls",
        ),
        (
            |c| c.with_window(SlidingWindow::count(10_000, 2_000)),
            "window.buckets",
        ),
        (
            |c| c.with_window(SlidingWindow::count(10, 10)),
            "minimum_calls",
        ), // 20 > 10
        (
            |c| c.with_failure_rate_threshold(0.0),
            "failure_rate_threshold",
        ),
        (
            |c| c.with_failure_rate_threshold(100.5),
            "failure_rate_threshold",
        ),
        (
            |c| c.with_failure_rate_threshold(f64::NAN),
            "failure_rate_threshold",
        ),
        (
            |c| c.with_failure_rate_threshold(-1.0),
            "failure_rate_threshold",
        ),
        (|c| c.with_minimum_calls(0), "minimum_calls"),
        (|c| c.with_minimum_calls(8_001), "minimum_calls"),
        (
            |c| c.with_slow_call_duration(Duration::ZERO),
            "slow_call_duration",
        ),
        (
            |c| c.with_slow_call_duration(Duration::from_secs(31 * 86_400)),
            "slow_call_duration",
        ),
        (
            |c| c.with_slow_call_rate_threshold(0.0),
            "slow_call_rate_threshold",
        ),
        (
            |c| c.with_slow_call_rate_threshold(f64::INFINITY),
            "slow_call_rate_threshold",
        ),
        (|c| c.with_open_duration(Duration::ZERO), "open_duration"),
        (
            |c| c.with_open_duration(Duration::from_secs(61)),
            "max_open_duration",
        ),
        (
            |c| c.with_max_open_duration(Duration::from_secs(4)),
            "max_open_duration",
        ),
        (
            |c| c.with_max_open_duration(Duration::from_secs(31 * 86_400)),
            "max_open_duration",
        ),
        (|c| c.with_half_open_probes(0), "half_open_probes"),
        (|c| c.with_half_open_probes(1_001), "half_open_probes"),
        (
            |c| c.with_half_open_timeout(Duration::ZERO),
            "half_open_timeout",
        ),
        (
            |c| c.with_half_open_timeout(Duration::from_secs(31 * 86_400)),
            "half_open_timeout",
        ),
    ];
    for (i, (change, field)) in cases.iter().enumerate() {
        let error = change(BreakerConfig::default()).build().unwrap_err();
        assert_eq!(error.field(), *field, "case {i}: {error}");
    }

    // The limits themselves are accepted.
    let ok: &[Change] = &[
        |c| c.with_window(SlidingWindow::time(Duration::from_secs(1), 100)),
        |c| c.with_window(SlidingWindow::time(Duration::from_secs(30 * 86_400), 1)),
        |c| {
            c.with_window(SlidingWindow::count(10_000, 1_000))
                .with_minimum_calls(8_000)
        },
        |c| {
            c.with_window(SlidingWindow::count(1, 1))
                .with_minimum_calls(1)
        },
        |c| c.with_failure_rate_threshold(100.0),
        |c| c.with_failure_rate_threshold(0.0001),
        |c| c.with_slow_call_rate_threshold(100.0),
        |c| c.with_slow_call_duration(Duration::from_nanos(1)),
        |c| {
            c.with_open_duration(Duration::from_secs(30 * 86_400))
                .with_max_open_duration(Duration::from_secs(30 * 86_400))
        },
        |c| c.with_half_open_probes(1_000),
    ];
    for (i, change) in ok.iter().enumerate() {
        assert!(change(BreakerConfig::default()).build().is_ok(), "case {i}");
    }
    let breaker = CircuitBreaker::new(BreakerConfig::default());
    assert_eq!(breaker.config().minimum_calls(), 20);
    assert_eq!(
        breaker.config().window(),
        SlidingWindow::time(Duration::from_secs(30), 10)
    );
}

#[test]
fn every_bad_breaker_setting_is_named() {
    let error = BreakerConfig::default()
        .with_window(SlidingWindow::time(Duration::from_millis(10), 10))
        .with_minimum_calls(0)
        .with_half_open_timeout(Duration::ZERO)
        .build()
        .unwrap_err();
    assert_eq!(
        error.fields().collect::<Vec<_>>(),
        ["window.length", "minimum_calls", "half_open_timeout"]
    );
}

#[tokio::test(start_paused = true)]
async fn an_unbuilt_configuration_is_clamped_into_range() {
    // Never built: every field out of range is used as the nearest valid value, and
    // nothing panics.
    let breaker = CircuitBreaker::new(
        BreakerConfig::default()
            .with_window(SlidingWindow::count(0, 0))
            .with_failure_rate_threshold(f64::NAN)
            .with_minimum_calls(0)
            .with_half_open_probes(0)
            .with_open_duration(Duration::ZERO),
    );
    assert_eq!(breaker.config().window(), SlidingWindow::count(1, 1));
    assert_eq!(breaker.config().minimum_calls(), 1);
    assert_eq!(breaker.config().half_open_probes(), 1);
    failures(&breaker, 1);
    assert_eq!(breaker.state(), State::Open);
}

#[tokio::test(start_paused = true)]
async fn a_single_probe_with_a_long_open_duration_closes_and_reopens() {
    let breaker = breaker_with(|c| {
        c.with_half_open_probes(1)
            .with_minimum_calls(1)
            .with_failure_rate_threshold(100.0)
            .with_open_duration(Duration::from_secs(30 * 86_400))
            .with_max_open_duration(Duration::from_secs(30 * 86_400))
    });
    successes(&breaker, 1);
    failures(&breaker, 1);
    assert_eq!(breaker.state(), State::Closed, "1 of 2 is below 100 %");
    advance(Duration::from_secs(30)).await;
    failures(&breaker, 1);
    assert_eq!(refused(&breaker), Duration::from_secs(30 * 86_400));
    advance(Duration::from_secs(30 * 86_400)).await;
    probes(&breaker, 1)
        .pop()
        .unwrap()
        .record(BreakerOutcome::Success, FAST);
    assert_eq!(breaker.state(), State::Closed);
}

#[tokio::test(start_paused = true)]
async fn debug_shows_the_state_and_hides_the_hook() {
    let mut config = BreakerConfig::default();
    let _log = logged(&mut config);
    let breaker = CircuitBreaker::new(config);
    failures(&breaker, 2);
    let text = format!("{breaker:?}");
    assert!(text.contains("state: Closed"), "{text}");
    assert!(text.contains("failures: 2"), "{text}");
    assert!(text.contains("on_state_change: Some(\"..\")"), "{text}");
    let permit = breaker.try_acquire().unwrap();
    assert_eq!(
        format!("{permit:?}"),
        "Permit { state: Closed, probe: false }"
    );
    permit.record(BreakerOutcome::Success, FAST);
    assert_eq!(State::ForcedOpen.to_string(), "forced-open");
}
