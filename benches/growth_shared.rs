//! Costs that grow with work: shared state against the number of concurrent callers.
//!
//! **`shared`** (rounds, no criterion): 1, 2, 4 and 8 threads (`GROWTH_THREADS`) share
//! ONE breaker or budget and each make the same number of calls; the time is the wall
//! time from the first thread's start to the last thread's end. Cases:
//! - `bare_loop`: an empty call (`black_box(())`), the control of every case below
//!   that is not a tower service: the machine's own scaling of pure CPU work;
//! - `core_breaker`: `retrysafe_core::breaker::CircuitBreaker::try_acquire` and
//!   `Permit::record(Success, ..)` on one default breaker (Closed);
//! - `core_breaker_unshared`: the same, each thread with its own breaker (nothing
//!   shared: separates contention from time-sharing);
//! - `failsafe`: `failsafe::CircuitBreaker::call` of a closure answering `Ok` on one
//!   `failsafe::Config::new().build()` state machine (its clones share it);
//! - `ratio`, `token_bucket`: `RetryBudget::{ratio, token_bucket}()` as the
//!   `RetryLayer`'s strategy calls them on the success path: `deposit()` (once per
//!   logical request), then `record_success(None)`;
//! - `ratio_retry10`, `token_bucket_retry10`: the same, but every 10th call of a
//!   thread is a request that needed one retry: `deposit()`,
//!   `withdraw(RetryCost::Failure)`, `record_success(Some(RetryCost::Failure))`;
//! - `tower_tps`, `tower_tps_retry10`: tower's `TpsBudget::default()` as tower's
//!   `Retry` policy calls it: `deposit()` per request, and `withdraw()` for every 10th;
//! - `bare_service`: a `service_fn` answering 200 at once, called as a tower service
//!   (build a `GET` with an empty body, `poll_ready`, `call`, poll the future once):
//!   the control of the two cases below;
//! - `breaker_layer`: `CircuitBreakerLayer::default()` around that `service_fn`, one
//!   service cloned per thread (clones share the breaker);
//! - `failsafe_service`: failsafe's futures breaker around the same `service_fn` (a
//!   small tower `Service`, as in `benches/breaker.rs`).
//!
//! Every round measures every case at every thread count, the order of the cases
//! rotating and the order of the thread counts reversing from round to round. Per case
//! and thread count it reports the time per call per thread, the total throughput
//! (calls/s), and the scaling: (throughput at t threads / at 1 thread) of the same
//! round, divided by the control's same ratio of the same round. Medians and ranges
//! over the rounds. Settings: `GROWTH_ROUNDS` (8), `GROWTH_THREADS` ("1 2 4 8"),
//! `GROWTH_MS` (time aimed at per measurement at 1 thread, 200: the calls per thread
//! are calibrated once, then fixed), `GROWTH_CASES` (a subset, by name; their
//! controls are kept), `GROWTH_MAX_OTHER` (wait before each round until other
//! processes use at most that % of the CPUs, and measure a round again when they
//! used more). A withdrawal that a budget refuses in the `_retry10` cases (none
//! should be: each allows more than the 10 % they ask for) is counted, the first one
//! per case printed with the budget's state, and the counts reported after the table.
//!
//! `scripts/bench-growth shared`, or `GROWTH_ROUNDS=8 cargo bench --bench growth_shared`.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout, // the rounds modes print their tables
    clippy::cast_possible_truncation,
    missing_docs,
    unreachable_pub
)]

use std::convert::Infallible;
use std::error::Error;
use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Empty;
use retrysafe::CircuitBreakerLayer;
use retrysafe_core::breaker::{CircuitBreaker, State};
use retrysafe_core::budget::{RetryBudget, RetryCost};
use retrysafe_core::classify::BreakerOutcome;
use retrysafe_test_support::bench::failsafe_service::Failsafe;
use retrysafe_test_support::bench::load::*;
use retrysafe_test_support::bench::report::{env_or, grouped, median, min_max};
use tokio::time::Instant;
use tower::retry::budget::{Budget, TpsBudget};
use tower::{Layer, Service};

type BoxError = Box<dyn Error + Send + Sync>;
type Res<T> = Result<T, BoxError>;

fn main() -> Res<()> {
    run()
}

// The in-process tower services of the `shared` mode

type Req = Request<Empty<Bytes>>;
type Answer = std::future::Ready<Result<Response<Bytes>, Infallible>>;
type Inner = tower::util::ServiceFn<fn(Req) -> Answer>;

fn ok(_: Req) -> Answer {
    std::future::ready(Ok(Response::new(Bytes::new())))
}

fn inner() -> Inner {
    tower::service_fn(ok as fn(Req) -> Answer)
}

/// One call of a service that is ready at once and answers on the first poll (every
/// service here; anything else is a bug of the bench, so it panics): build the request,
/// `poll_ready`, `call`, poll once.
fn call_service<S, B>(service: &mut S)
where
    S: Service<Req, Response = Response<B>>,
    S::Error: std::fmt::Debug,
{
    let mut cx = Context::from_waker(Waker::noop());
    match service.poll_ready(&mut cx) {
        Poll::Ready(Ok(())) => {}
        other => panic!("not ready at once: {:?}", other.map(|r| r.err())),
    }
    let request = Request::get("http://inner/items")
        .body(Empty::new())
        .unwrap();
    let mut future = pin!(service.call(request));
    match future.as_mut().poll(&mut cx) {
        Poll::Ready(Ok(response)) => {
            assert_eq!(response.status(), StatusCode::OK);
            black_box(response);
        }
        Poll::Ready(Err(e)) => panic!("{e:?}"),
        Poll::Pending => panic!("pending on the first poll"),
    }
}

/// A case: how one thread makes its calls. Generic underneath, so the loop of every
/// case is monomorphised and the call is inlined as in a real caller.
trait Case: Sync {
    fn name(&self) -> &'static str;
    /// The case whose scaling this one's is divided by.
    fn control(&self) -> &'static str;
    /// `calls` calls on this thread after `barrier`; returns (start, end).
    fn run(&self, calls: u64, barrier: &Barrier) -> (Instant, Instant);
    /// Panics if the shared state is not what the calls should have left.
    fn check(&self) {}
}

struct Looped<M, F, C> {
    name: &'static str,
    control: &'static str,
    /// Makes one thread's state (a clone of the shared handle, or a new one).
    make: M,
    /// One call, on the thread's state and the index of the call on this thread.
    step: F,
    check: C,
}

impl<M, S, F, C> Case for Looped<M, F, C>
where
    M: Fn() -> S + Sync,
    F: Fn(&mut S, u64) + Sync,
    C: Fn() + Sync,
{
    fn name(&self) -> &'static str {
        self.name
    }

    fn control(&self) -> &'static str {
        self.control
    }

    fn run(&self, calls: u64, barrier: &Barrier) -> (Instant, Instant) {
        let mut state = (self.make)();
        barrier.wait();
        let start = Instant::now();
        for i in 0..calls {
            (self.step)(&mut state, i);
        }
        (start, Instant::now())
    }

    fn check(&self) {
        (self.check)();
    }
}

fn case<M, S, F>(name: &'static str, control: &'static str, make: M, step: F) -> Box<dyn Case>
where
    M: Fn() -> S + Sync + 'static,
    F: Fn(&mut S, u64) + Sync + 'static,
{
    checked(name, control, make, step, || {})
}

fn checked<M, S, F, C>(
    name: &'static str,
    control: &'static str,
    make: M,
    step: F,
    check: C,
) -> Box<dyn Case>
where
    M: Fn() -> S + Sync + 'static,
    F: Fn(&mut S, u64) + Sync + 'static,
    C: Fn() + Sync + 'static,
{
    Box::new(Looped {
        name,
        control,
        make,
        step,
        check,
    })
}

/// Every 10th call of a thread needed a retry.
fn retried(i: u64) -> bool {
    i % 10 == 9
}

/// Withdrawals a budget refused, per case (none should be: every budget here allows
/// far more retries than the 10 % the `_retry10` cases ask for). Counted, not
/// asserted in the loop, so that a refusal is reported with the budget's state.
static REFUSED_RATIO: AtomicU64 = AtomicU64::new(0);
static REFUSED_BUCKET: AtomicU64 = AtomicU64::new(0);
static REFUSED_TPS: AtomicU64 = AtomicU64::new(0);

/// Counts a refusal; the first one of a case prints the budget's state.
#[cold]
fn refused(counter: &AtomicU64, case: &str, i: u64, state: &dyn std::fmt::Debug) {
    if counter.fetch_add(1, Ordering::Relaxed) == 0 {
        eprintln!("{case}: withdrawal refused at call {i} of a thread: {state:?}");
    }
}

fn ratio_step(budget: &mut RetryBudget, i: u64) {
    budget.deposit();
    if retried(i) {
        if budget.withdraw(RetryCost::Failure) {
            budget.record_success(Some(RetryCost::Failure));
        } else {
            refused(&REFUSED_RATIO, "ratio_retry10", i, &budget.snapshot());
        }
    } else {
        budget.record_success(None);
    }
}

/// The refusals counted, by case.
fn refusals() -> [(&'static str, u64); 3] {
    [
        ("ratio_retry10", REFUSED_RATIO.load(Ordering::Relaxed)),
        (
            "token_bucket_retry10",
            REFUSED_BUCKET.load(Ordering::Relaxed),
        ),
        ("tower_tps_retry10", REFUSED_TPS.load(Ordering::Relaxed)),
    ]
}

fn cases() -> Vec<Box<dyn Case>> {
    let breaker = CircuitBreaker::default();
    let breaker_check = breaker.clone();
    let failsafe_sm = failsafe::Config::new().build();
    let ratio = RetryBudget::ratio();
    let ratio_check = ratio.clone();
    let ratio10 = RetryBudget::ratio();
    let ratio10_check = ratio10.clone();
    let bucket = RetryBudget::token_bucket();
    let bucket_check = bucket.clone();
    let bucket10 = RetryBudget::token_bucket();
    let bucket10_check = bucket10.clone();
    let tps = Arc::new(TpsBudget::default());
    let tps10 = Arc::new(TpsBudget::default());
    let tps10_check = Arc::clone(&tps10);
    let layer = CircuitBreakerLayer::default().layer(inner());
    let failsafe_service = Failsafe {
        inner: inner(),
        breaker: failsafe::Config::new().build(),
    };

    vec![
        case("bare_loop", "bare_loop", || (), |(), _| black_box(())),
        checked(
            "core_breaker",
            "bare_loop",
            move || breaker.clone(),
            |b: &mut CircuitBreaker, _| {
                let permit = b.try_acquire().unwrap();
                permit.record(BreakerOutcome::Success, Duration::from_micros(50));
            },
            move || {
                assert_eq!(breaker_check.state(), State::Closed);
                assert!(breaker_check.window().calls() > 0);
            },
        ),
        case(
            "core_breaker_unshared",
            "bare_loop",
            CircuitBreaker::default,
            |b: &mut CircuitBreaker, _| {
                let permit = b.try_acquire().unwrap();
                permit.record(BreakerOutcome::Success, Duration::from_micros(50));
            },
        ),
        case(
            "failsafe",
            "bare_loop",
            move || failsafe_sm.clone(),
            |b, _| {
                failsafe::CircuitBreaker::call(b, || Ok::<(), ()>(())).unwrap();
            },
        ),
        checked(
            "ratio",
            "bare_loop",
            move || ratio.clone(),
            |b: &mut RetryBudget, _| {
                b.deposit();
                b.record_success(None);
            },
            move || assert!(ratio_check.available_retries() > 100),
        ),
        checked(
            "ratio_retry10",
            "bare_loop",
            move || ratio10.clone(),
            ratio_step,
            move || assert!(ratio10_check.available_retries() > 100),
        ),
        checked(
            "token_bucket",
            "bare_loop",
            move || bucket.clone(),
            |b: &mut RetryBudget, _| {
                b.deposit();
                b.record_success(None);
            },
            move || assert_eq!(bucket_check.available_retries(), 100),
        ),
        checked(
            "token_bucket_retry10",
            "bare_loop",
            move || bucket10.clone(),
            |b: &mut RetryBudget, i| {
                b.deposit();
                if retried(i) {
                    if b.withdraw(RetryCost::Failure) {
                        b.record_success(Some(RetryCost::Failure));
                    } else {
                        refused(&REFUSED_BUCKET, "token_bucket_retry10", i, &b.snapshot());
                    }
                } else {
                    b.record_success(None);
                }
            },
            // Each retried request gives back what it took: the bucket stays near
            // full.
            move || assert!(bucket10_check.available_retries() >= 90),
        ),
        case(
            "tower_tps",
            "bare_loop",
            move || Arc::clone(&tps),
            |b: &mut Arc<TpsBudget>, _| b.deposit(),
        ),
        checked(
            "tower_tps_retry10",
            "bare_loop",
            move || Arc::clone(&tps10),
            |b: &mut Arc<TpsBudget>, i| {
                b.deposit();
                if retried(i) && !b.withdraw() {
                    refused(&REFUSED_TPS, "tower_tps_retry10", i, &**b);
                }
            },
            move || assert!(tps10_check.withdraw()),
        ),
        case("bare_service", "bare_service", inner, |s, _| {
            call_service(s);
        }),
        case(
            "breaker_layer",
            "bare_service",
            move || layer.clone(),
            |s, _| call_service(s),
        ),
        case(
            "failsafe_service",
            "bare_service",
            move || failsafe_service.clone(),
            |s, _| call_service(s),
        ),
    ]
}

/// `calls` calls on each of `threads` threads sharing the case's state; the wall
/// time from the first thread's start to the last thread's end.
fn measure(case: &dyn Case, threads: usize, calls: u64) -> Duration {
    let barrier = Barrier::new(threads);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| s.spawn(|| case.run(calls, &barrier)))
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    let start = spans.iter().map(|s| s.0).min().unwrap();
    let end = spans.iter().map(|s| s.1).max().unwrap();
    end - start
}

/// Calls per thread so that one thread takes about `target`.
fn calibrate(case: &dyn Case, target: Duration) -> u64 {
    let mut calls = 1_000u64;
    loop {
        let took = measure(case, 1, calls);
        if took >= Duration::from_millis(20) || calls >= 1 << 40 {
            let per_call = took.as_secs_f64() / calls as f64;
            return ((target.as_secs_f64() / per_call) as u64).max(1_000);
        }
        calls *= 4;
    }
}

fn run() -> Res<()> {
    let rounds: usize = env_or("GROWTH_ROUNDS", 8)?;
    let target = Duration::from_millis(env_or("GROWTH_MS", 200)?);
    let max_other: f64 = env_or("GROWTH_MAX_OTHER", 100.0)?;
    let threads: Vec<usize> = std::env::var("GROWTH_THREADS")
        .unwrap_or_else(|_| "1 2 4 8".to_owned())
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    if rounds == 0 || threads.first() != Some(&1) {
        return Err("GROWTH_ROUNDS > 0, and GROWTH_THREADS must start with 1".into());
    }
    let mut cases = cases();
    if let Ok(names) = std::env::var("GROWTH_CASES") {
        // The named cases and their controls.
        let mut keep: Vec<&str> = names.split_whitespace().collect();
        for c in &cases {
            if keep.contains(&c.name()) {
                keep.push(c.control());
            }
        }
        cases.retain(|c| keep.contains(&c.name()));
    }
    let names: Vec<&str> = cases.iter().map(|c| c.name()).collect();
    for c in &cases {
        if !names.contains(&c.control()) {
            return Err(format!("{}: control {} not selected", c.name(), c.control()).into());
        }
    }

    eprintln!("load average {}; calibrating", loadavg());
    let calls: Vec<u64> = cases.iter().map(|c| calibrate(&**c, target)).collect();
    for (c, n) in cases.iter().zip(&calls) {
        eprintln!("{}: {n} calls per thread", c.name());
    }

    // wall[case][threads] = seconds per round
    let mut wall = vec![vec![Vec::new(); threads.len()]; cases.len()];
    let mut other_pct = Vec::new();
    let me = [std::process::id()];
    let mut attempts = 0;
    while other_pct.len() < rounds {
        attempts += 1;
        if attempts > 10 * rounds {
            return Err("too many rounds discarded for load".into());
        }
        if max_other < 100.0 {
            wait_for_quiet(max_other);
        }
        let round = other_pct.len();
        let load = loadavg();
        let before = ticks(&me);
        let mut this = vec![vec![0.0; threads.len()]; cases.len()];
        for k in 0..cases.len() {
            let ci = (k + round) % cases.len();
            for j in 0..threads.len() {
                let ti = if round % 2 == 0 {
                    j
                } else {
                    threads.len() - 1 - j
                };
                this[ci][ti] = measure(&*cases[ci], threads[ti], calls[ci]).as_secs_f64();
            }
        }
        let other = others(before, ticks(&me), 0);
        if other > max_other {
            eprintln!(
                "round {}: other processes {other:.0} % > {max_other} %: measured again",
                round + 1
            );
            continue;
        }
        for (ci, row) in this.into_iter().enumerate() {
            for (ti, w) in row.into_iter().enumerate() {
                wall[ci][ti].push(w);
            }
        }
        other_pct.push(other);
        eprintln!(
            "round {}: load average {load}, other processes {other:.0} %",
            round + 1
        );
    }
    for (case, n) in refusals() {
        if n > 0 {
            println!("\n**{case}: {n} withdrawals refused** (see the first one's state above)");
        }
    }

    let index = |name: &str| names.iter().position(|n| *n == name).unwrap();
    println!(
        "\n{rounds} rounds; other processes' CPU share per round: {} %; load average now {}",
        other_pct
            .iter()
            .map(|p| format!("{p:.0}"))
            .collect::<Vec<_>>()
            .join(" / "),
        loadavg()
    );
    println!(
        "threads {threads:?}, {} cores; calls per thread fixed per case \
         (about {} ms at 1 thread)\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        target.as_millis()
    );
    println!(
        "| case | threads | ns/call per thread | calls/s (total) | throughput ÷ 1 thread's | \
         ÷ control's same ratio |"
    );
    println!("|---|---:|---|---|---|---|");
    let fmt = |v: &[f64], digits: usize| {
        let (lo, hi) = min_max(v);
        format!(
            "{:.*} ({:.*}–{:.*})",
            digits,
            median(v),
            digits,
            lo,
            digits,
            hi
        )
    };
    let fmt_big = |v: &[f64]| {
        let (lo, hi) = min_max(v);
        format!("{} ({}–{})", grouped(median(v)), grouped(lo), grouped(hi))
    };
    for (ci, c) in cases.iter().enumerate() {
        let ctrl = index(c.control());
        for (ti, &t) in threads.iter().enumerate() {
            let n = calls[ci] as f64;
            let ns: Vec<f64> = wall[ci][ti].iter().map(|w| w * 1e9 / n).collect();
            let tput: Vec<f64> = wall[ci][ti].iter().map(|w| t as f64 * n / w).collect();
            // Throughput ratio t / 1 thread within a round: (t · n / w_t) / (n / w_1).
            let ratio = |ci: usize| -> Vec<f64> {
                (0..rounds)
                    .map(|r| t as f64 * wall[ci][0][r] / wall[ci][ti][r])
                    .collect()
            };
            let own = ratio(ci);
            let control = ratio(ctrl);
            let rel: Vec<f64> = own.iter().zip(&control).map(|(a, b)| a / b).collect();
            let ns_digits = if median(&ns) < 10.0 { 2 } else { 1 };
            println!(
                "| `{}` | {t} | {} | {} | {} | {} |",
                c.name(),
                fmt(&ns, ns_digits),
                fmt_big(&tput),
                fmt(&own, 2),
                if ci == ctrl {
                    "1".to_owned()
                } else {
                    fmt(&rel, 2)
                }
            );
        }
    }
    // After the table, so that a failed check does not lose it.
    for c in &cases {
        c.check();
    }
    Ok(())
}
