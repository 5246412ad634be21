//! Costs that grow with work: shared state against the number
//! of concurrent callers, `ReplayBody` against the body size, and the ceiling of the
//! machine for a bare axum server, measured with `wrk` next to our own load driver.
//!
//! Three modes, chosen by `GROWTH_MODE` (`scripts/bench-growth` runs each):
//!
//! - **`shared`** (rounds, no criterion): 1, 2, 4 and 8 threads (`GROWTH_THREADS`) share
//!   ONE breaker or budget and each make the same number of calls; the time is the wall
//!   time from the first thread's start to the last thread's end. Cases:
//!   - `bare_loop`: an empty call (`black_box(())`), the control of every case below
//!     that is not a tower service: the machine's own scaling of pure CPU work;
//!   - `core_breaker`: `retrysafe_core::breaker::CircuitBreaker::try_acquire` and
//!     `Permit::record(Success, ..)` on one default breaker (Closed);
//!   - `core_breaker_unshared`: the same, each thread with its own breaker (nothing
//!     shared: separates contention from time-sharing);
//!   - `failsafe`: `failsafe::CircuitBreaker::call` of a closure answering `Ok` on one
//!     `failsafe::Config::new().build()` state machine (its clones share it);
//!   - `ratio`, `token_bucket`: `RetryBudget::{ratio, token_bucket}()` as the
//!     `RetryLayer`'s strategy calls them on the success path: `deposit()` (once per
//!     logical request), then `record_success(None)`;
//!   - `ratio_retry10`, `token_bucket_retry10`: the same, but every 10th call of a
//!     thread is a request that needed one retry: `deposit()`,
//!     `withdraw(RetryCost::Failure)`, `record_success(Some(RetryCost::Failure))`;
//!   - `tower_tps`, `tower_tps_retry10`: tower's `TpsBudget::default()` as tower's
//!     `Retry` policy calls it: `deposit()` per request, and `withdraw()` for every 10th;
//!   - `bare_service`: a `service_fn` answering 200 at once, called as a tower service
//!     (build a `GET` with an empty body, `poll_ready`, `call`, poll the future once):
//!     the control of the two cases below;
//!   - `breaker_layer`: `CircuitBreakerLayer::default()` around that `service_fn`, one
//!     service cloned per thread (clones share the breaker);
//!   - `failsafe_service`: failsafe's futures breaker around the same `service_fn` (a
//!     small tower `Service`, as in `benches/breaker.rs`).
//!
//!   Every round measures every case at every thread count, the order of the cases
//!   rotating and the order of the thread counts reversing from round to round. Per case
//!   and thread count it reports the time per call per thread, the total throughput
//!   (calls/s), and the scaling: (throughput at t threads / at 1 thread) of the same
//!   round, divided by the control's same ratio of the same round. Medians and ranges
//!   over the rounds. Settings: `GROWTH_ROUNDS` (8), `GROWTH_THREADS` ("1 2 4 8"),
//!   `GROWTH_MS` (time aimed at per measurement at 1 thread, 200: the calls per thread
//!   are calibrated once, then fixed), `GROWTH_CASES` (a subset, by name; their
//!   controls are kept), `GROWTH_MAX_OTHER` (wait before each round until other
//!   processes use at most that % of the CPUs, and measure a round again when they
//!   used more). A withdrawal that a budget refuses in the `_retry10` cases (none
//!   should be: each allows more than the 10 % they ask for) is counted, the first one
//!   per case printed with the budget's state, and the counts reported after the table.
//!
//! - **default** (criterion, group `replay_body`): what the `RetryLayer`'s `ReplayBody`
//!   costs against the bare body, at 1, 4, 16 and 64 KiB (the default cap) and at
//!   64 KiB + 1 byte (over the cap), for three bodies: `one_chunk` (`Full<Bytes>`, exact
//!   size hint), `16_chunks` (16 `Bytes` frames, no size hint, as a streamed body) and
//!   `one_chunk_slice` (`Full<&[u8]>`: data that is not `Bytes`, which `ReplayBody`
//!   copies). Cases: `bare` (poll the body to its end), `first` (wrap it in
//!   `ReplayBody::new(body, 64 KiB)`, keep a clone for a retry as the `RetryLayer` does,
//!   poll the first attempt to its end, drop both) and `replay` (the retry's body: a
//!   clone of the kept body polled to its end, after a first attempt that was not
//!   timed; over the cap, the replay fails at once, and the bench checks that it does).
//!
//! - **`wrk`**: a child process (`GROWTH_MODE=serve`, multi-thread runtime with
//!   `GROWTH_WORKERS` = 2 workers) serves the bare app of
//!   `benches/idempotency_loopback.rs` (an authentication layer inserting a `Principal`,
//!   then POST `/payments` answering 201 with a 100-byte JSON body). Each round runs, for
//!   each connection count of `GROWTH_WRK_CONNS` ("32 1"), `wrk -t1 -c<C> -d<D>s
//!   --latency` (POST with the same 64-byte JSON body and headers) and this binary's
//!   own driver (the bare case of `benches/idempotency_loopback.rs`: a current-thread
//!   runtime, C hyper HTTP/1.1 keep-alive connections, one request at a time per
//!   connection, every answer checked) for the same D seconds, against the same server
//!   process; which of the two goes first alternates every round. Settings:
//!   `GROWTH_WRK_ROUNDS` (3), `GROWTH_WRK_SECS` (10), `GROWTH_WRK_CONNS`, `GROWTH_WRK`
//!   (the wrk binary, `wrk`).
//!
//! ```sh
//! scripts/bench-growth            # all of it; scripts/bench-growth shared|replay|idempotency|wrk
//! GROWTH_MODE=shared GROWTH_ROUNDS=8 cargo bench --bench growth
//! cargo bench --bench growth -- --warm-up-time 0.5 --measurement-time 2 replay_body
//! GROWTH_MODE=wrk cargo bench --bench growth
//! ```
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
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use criterion::{BatchSize, BenchmarkId, Criterion, Throughput};
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{Empty, Full};
use retrysafe::{CircuitBreakerLayer, ReplayBody};
use retrysafe_core::breaker::{CircuitBreaker, State};
use retrysafe_core::budget::{RetryBudget, RetryCost};
use retrysafe_core::classify::BreakerOutcome;
use retrysafe_test_support::bench::failsafe_service::Failsafe;
use retrysafe_test_support::bench::http1;
use retrysafe_test_support::bench::load::*;
use tokio::time::Instant;
use tower::retry::budget::{Budget, TpsBudget};
use tower::{Layer, Service};

type BoxError = Box<dyn Error + Send + Sync>;
type Res<T> = Result<T, BoxError>;

fn main() -> Res<()> {
    match std::env::var("GROWTH_MODE").as_deref() {
        Ok("shared") => shared::run(),
        Ok("serve") => ceiling::serve_child(),
        Ok("wrk") => ceiling::run(),
        Ok(other) if !other.is_empty() => {
            Err(format!("GROWTH_MODE={other}: shared, wrk, serve, or unset (criterion)").into())
        }
        _ => {
            let mut c = Criterion::default().configure_from_args();
            replay::group(&mut c);
            c.final_summary();
            Ok(())
        }
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> Res<T>
where
    T::Err: std::fmt::Display,
{
    match std::env::var(name) {
        Ok(v) => Ok(v.parse().map_err(|e| format!("{name}={v}: {e}"))?),
        Err(_) => Ok(default),
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn min_max(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

/// Thousands separated by a thin space, as in BENCHMARKS.md.
fn grouped(x: f64) -> String {
    let digits = format!("{:.0}", x.round());
    let (sign, digits) = digits
        .strip_prefix('-')
        .map_or(("", digits.as_str()), |d| ("-", d));
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(' ');
        }
        out.push(ch);
    }
    format!("{sign}{out}")
}

// ---------------------------------------------------------------------------------------
// The in-process tower services of the `shared` mode
// ---------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------
// `shared`: breaker and budget cost against the number of concurrent callers
// ---------------------------------------------------------------------------------------

mod shared {
    use super::*;

    /// A case: how one thread makes its calls. Generic underneath, so the loop of every
    /// case is monomorphised and the call is inlined as in a real caller.
    pub(super) trait Case: Sync {
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
    pub(super) fn refusals() -> [(&'static str, u64); 3] {
        [
            ("ratio_retry10", REFUSED_RATIO.load(Ordering::Relaxed)),
            (
                "token_bucket_retry10",
                REFUSED_BUCKET.load(Ordering::Relaxed),
            ),
            ("tower_tps_retry10", REFUSED_TPS.load(Ordering::Relaxed)),
        ]
    }

    pub(super) fn cases() -> Vec<Box<dyn Case>> {
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

    pub(super) fn run() -> Res<()> {
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
}

// ---------------------------------------------------------------------------------------
// default (criterion): ReplayBody against the body size
// ---------------------------------------------------------------------------------------

mod replay {
    use super::*;

    /// The `RetryLayer`'s default replay cap.
    const CAP: usize = 64 * 1024;

    /// A body of `Bytes` frames handed out one per poll, with no size hint, as a
    /// streamed request body is (hyper's would carry the same refcounted `Bytes`).
    #[derive(Clone)]
    struct Chunks {
        frames: Arc<[Bytes]>,
        next: usize,
    }

    impl Body for Chunks {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            let frame = self.frames.get(self.next).cloned();
            self.next += 1;
            Poll::Ready(frame.map(|data| Ok(Frame::data(data))))
        }

        fn is_end_stream(&self) -> bool {
            self.next >= self.frames.len()
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::default()
        }
    }

    /// Polls `body` to its end (every body here is ready at once); returns the data
    /// bytes, or the error it ended with.
    fn drain<B>(body: B) -> Result<u64, B::Error>
    where
        B: Body,
    {
        let mut body = pin!(body);
        let mut cx = Context::from_waker(Waker::noop());
        let mut bytes = 0u64;
        loop {
            match body.as_mut().poll_frame(&mut cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        bytes += bytes::Buf::remaining(data) as u64;
                    }
                    black_box(frame);
                }
                Poll::Ready(Some(Err(e))) => return Err(e),
                Poll::Ready(None) => return Ok(bytes),
                Poll::Pending => panic!("body pending"),
            }
        }
    }

    /// The three shapes of body, each made fresh for an attempt from a template.
    #[derive(Clone, Copy)]
    enum Shape {
        OneChunk,
        SixteenChunks,
        OneChunkSlice,
    }

    impl Shape {
        fn name(self) -> &'static str {
            match self {
                Shape::OneChunk => "one_chunk",
                Shape::SixteenChunks => "16_chunks",
                Shape::OneChunkSlice => "one_chunk_slice",
            }
        }
    }

    /// One size's body templates.
    struct Template {
        whole: Bytes,
        frames: Arc<[Bytes]>,
        slice: &'static [u8],
    }

    impl Template {
        fn new(len: usize) -> Self {
            // Not `Bytes::from_static`: refcounted like the frames hyper hands out (the
            // slices taken below move `whole` to the shared representation up front).
            let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let whole = Bytes::from(data.clone());
            let piece = len / 16;
            let frames: Arc<[Bytes]> = (0..16)
                .map(|i| {
                    let end = if i == 15 { len } else { (i + 1) * piece };
                    whole.slice(i * piece..end)
                })
                .collect();
            Template {
                whole,
                frames,
                slice: Box::leak(data.into_boxed_slice()),
            }
        }
    }

    /// A fresh body of `shape` from `t`, boxed behind one type so every case pays the
    /// same.
    enum AnyBody {
        Full(Full<Bytes>),
        Chunks(Chunks),
        Slice(Full<&'static [u8]>),
    }

    impl Body for AnyBody {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            match self.get_mut() {
                AnyBody::Full(b) => Pin::new(b).poll_frame(cx),
                AnyBody::Chunks(b) => Pin::new(b).poll_frame(cx),
                // The copy of a non-`Bytes` buffer into `Bytes` is what a transport (or
                // `ReplayBody`) has to do with such data anyway.
                AnyBody::Slice(b) => Pin::new(b)
                    .poll_frame(cx)
                    .map(|f| f.map(|f| f.map(|f| f.map_data(Bytes::from_static)))),
            }
        }

        fn is_end_stream(&self) -> bool {
            match self {
                AnyBody::Full(b) => b.is_end_stream(),
                AnyBody::Chunks(b) => b.is_end_stream(),
                AnyBody::Slice(b) => b.is_end_stream(),
            }
        }

        fn size_hint(&self) -> SizeHint {
            match self {
                AnyBody::Full(b) => b.size_hint(),
                AnyBody::Chunks(b) => b.size_hint(),
                AnyBody::Slice(b) => b.size_hint(),
            }
        }
    }

    fn make(shape: Shape, t: &Template) -> AnyBody {
        match shape {
            Shape::OneChunk => AnyBody::Full(Full::new(t.whole.clone())),
            Shape::SixteenChunks => AnyBody::Chunks(Chunks {
                frames: Arc::clone(&t.frames),
                next: 0,
            }),
            Shape::OneChunkSlice => AnyBody::Slice(Full::new(t.slice)),
        }
    }

    /// Wraps a slice body so `ReplayBody` sees `&[u8]` data (which it copies into
    /// `Bytes`), not the `Bytes` that `AnyBody` hands the bare case.
    enum Wrapped {
        Any(AnyBody),
        Slice(Full<&'static [u8]>),
    }

    fn make_for_replay(shape: Shape, t: &Template) -> Wrapped {
        match shape {
            Shape::OneChunkSlice => Wrapped::Slice(Full::new(t.slice)),
            other => Wrapped::Any(make(other, t)),
        }
    }

    /// The first attempt of the `RetryLayer`: wrap, keep a clone for a retry, send the
    /// first attempt to its end. Returns the kept clone and the bytes sent.
    fn first<B>(body: B) -> (ReplayBody<B>, u64)
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        let body = ReplayBody::new(body, CAP);
        let backup = body.clone();
        let sent = drain(body).unwrap();
        (backup, sent)
    }

    /// A retry: a clone of the kept body, sent to its end (an error when the body was
    /// not replayable).
    fn replay<B>(kept: &ReplayBody<B>) -> Result<u64, BoxError>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        drain(kept.clone())
    }

    pub(super) fn group(c: &mut Criterion) {
        let sizes = [
            ("1KiB", 1024),
            ("4KiB", 4 * 1024),
            ("16KiB", 16 * 1024),
            ("64KiB", CAP),
            ("64KiB+1", CAP + 1),
        ];
        let shapes = [Shape::OneChunk, Shape::SixteenChunks, Shape::OneChunkSlice];
        let mut g = c.benchmark_group("replay_body");
        for (label, len) in sizes {
            let t = Template::new(len);
            g.throughput(Throughput::Bytes(len as u64));
            for shape in shapes {
                let over = len > CAP;
                // Checks before timing: every case sends the whole body once; a replay
                // sends it again below the cap and fails above it.
                assert_eq!(drain(make(shape, &t)).unwrap(), len as u64);
                let (kept, sent) = match make_for_replay(shape, &t) {
                    Wrapped::Any(b) => {
                        let (k, s) = first(b);
                        (Ok(k), s)
                    }
                    Wrapped::Slice(b) => {
                        let (k, s) = first(b);
                        (Err(k), s)
                    }
                };
                assert_eq!(sent, len as u64);
                let replayed = match &kept {
                    Ok(k) => (k.is_replayable(), replay(k).ok()),
                    Err(k) => (k.is_replayable(), replay(k).ok()),
                };
                if over {
                    assert_eq!(replayed, (false, None), "{label} {}", shape.name());
                } else {
                    assert_eq!(replayed, (true, Some(len as u64)), "{label}");
                }

                let id = |case: &str| BenchmarkId::new(format!("{}/{case}", shape.name()), label);
                g.bench_function(id("bare"), |b| {
                    b.iter(|| drain(make(shape, &t)).unwrap());
                });
                g.bench_function(id("first"), |b| {
                    b.iter(|| match make_for_replay(shape, &t) {
                        Wrapped::Any(body) => first(body).1,
                        Wrapped::Slice(body) => first(body).1,
                    });
                });
                // Only the replay is timed: the first attempt and the drop of the kept
                // body (and of the chunks it holds) are set up and torn down outside.
                g.bench_function(id("replay"), |b| match shape {
                    Shape::OneChunkSlice => b.iter_batched(
                        || first(Full::new(t.slice)).0,
                        |kept| {
                            let r = replay(&kept).ok();
                            (r, kept)
                        },
                        BatchSize::SmallInput,
                    ),
                    _ => b.iter_batched(
                        || first(make(shape, &t)).0,
                        |kept| {
                            let r = replay(&kept).ok();
                            (r, kept)
                        },
                        BatchSize::SmallInput,
                    ),
                });
            }
        }
        g.finish();
    }
}

// ---------------------------------------------------------------------------------------
// `wrk`: the machine's ceiling for the bare server, next to our own driver
// ---------------------------------------------------------------------------------------

mod ceiling {
    use super::http1::{Sender, open_http};
    use super::*;

    use axum::Router;
    use axum::body::Body as AxumBody;
    use axum::http::HeaderName;
    use axum::http::header::{CONTENT_TYPE, HOST};
    use axum::routing::post;
    use axum::serve::ListenerExt;
    use http_body_util::BodyExt;
    use retrysafe::idempotency::Principal;
    use tokio::net::TcpListener;
    use tokio::task::JoinSet;
    use tower::util::MapRequestLayer;

    /// The handler's answer: 100 bytes of JSON (as in `benches/idempotency_loopback.rs`).
    const RESPONSE_JSON: &str = r#"{"id":"pay_0123456789abcde","status":"accepted","amount":1000,"currency":"EUR","created":1767225600}"#;
    /// A 64-byte request body.
    const REQUEST_JSON: &str =
        r#"{"amount":1000,"currency":"EUR","reference":"order-00000000042"}"#;
    const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
    /// Untimed requests per connection before the timed part (as the loopback bench).
    const WARMUP_PER_CONN: usize = 20;

    async fn create() -> (StatusCode, [(HeaderName, &'static str); 1], &'static str) {
        (
            StatusCode::CREATED,
            [(CONTENT_TYPE, "application/json")],
            RESPONSE_JSON,
        )
    }

    /// The bare app of `benches/idempotency_loopback.rs`.
    fn router() -> Router {
        let principal = Principal::new("tenant-1");
        Router::new()
            .route("/payments", post(create))
            .layer(MapRequestLayer::new(move |mut req: Request<AxumBody>| {
                req.extensions_mut().insert(principal.clone());
                req
            }))
    }

    /// The child: serve the bare app, print its address, run until stdin closes.
    pub(super) fn serve_child() -> Res<()> {
        let workers: usize = env_or("GROWTH_WORKERS", 2)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()?;
        let addr = runtime.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            let listener = listener.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
            tokio::spawn(async move {
                let _ = axum::serve(listener, router()).await;
            });
            Ok::<_, BoxError>(addr)
        })?;
        println!("{addr}");
        std::io::stdout().flush()?;
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        Ok(())
    }

    struct ServerChild {
        child: Child,
        addr: SocketAddr,
    }

    impl ServerChild {
        fn start(workers: usize) -> Res<Self> {
            let mut child = Command::new(std::env::current_exe()?)
                .env("GROWTH_MODE", "serve")
                .env("GROWTH_WORKERS", workers.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()?;
            let stdout = child.stdout.take().ok_or("no stdout")?;
            let mut line = String::new();
            BufReader::new(stdout).read_line(&mut line)?;
            match line.trim().parse() {
                Ok(addr) => Ok(ServerChild { child, addr }),
                Err(_) => {
                    let _ = child.kill();
                    Err(format!("server child said {line:?}").into())
                }
            }
        }
    }

    impl Drop for ServerChild {
        fn drop(&mut self) {
            drop(self.child.stdin.take());
            let _ = self.child.wait();
        }
    }

    /// What one run saw.
    #[derive(Clone, Copy, Default)]
    struct Run {
        rps: f64,
        /// p50, p75, p90, p99 in µs.
        latency: [f64; 4],
        other: f64,
    }

    // ---- wrk ----

    fn wrk_script() -> Res<std::path::PathBuf> {
        let path = std::env::temp_dir().join(format!("growth-wrk-{}.lua", std::process::id()));
        // The same request as the driver's: POST, the 64-byte JSON body, content-type,
        // and an idempotency key of the same length as the driver's keys (the bare
        // server ignores it).
        let key = format!("f-{}-{:012}", std::process::id(), 0);
        std::fs::write(
            &path,
            format!(
                "wrk.method = \"POST\"\nwrk.body = '{REQUEST_JSON}'\n\
                 wrk.headers[\"Content-Type\"] = \"application/json\"\n\
                 wrk.headers[\"Idempotency-Key\"] = \"{key}\"\n"
            ),
        )?;
        Ok(path)
    }

    /// `450.00us`, `1.20ms`, `2.00s` in µs.
    fn duration_us(s: &str) -> Option<f64> {
        let split = s.find(|c: char| c.is_ascii_alphabetic())?;
        let (n, unit) = s.split_at(split);
        let n: f64 = n.parse().ok()?;
        Some(match unit {
            "us" => n,
            "ms" => n * 1e3,
            "s" => n * 1e6,
            "m" => n * 60e6,
            _ => return None,
        })
    }

    fn parse_wrk(out: &str) -> Res<(f64, [f64; 4])> {
        if out.contains("Non-2xx") || out.contains("Socket errors") {
            return Err(format!("wrk saw errors:\n{out}").into());
        }
        let mut rps = None;
        let mut latency = [f64::NAN; 4];
        for line in out.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words[..] {
                ["Requests/sec:", n] => rps = n.parse().ok(),
                [p, d] if p.ends_with('%') => {
                    let i = match p {
                        "50%" => 0,
                        "75%" => 1,
                        "90%" => 2,
                        "99%" => 3,
                        _ => continue,
                    };
                    latency[i] = duration_us(d).ok_or_else(|| format!("latency {d:?}"))?;
                }
                _ => {}
            }
        }
        Ok((
            rps.ok_or_else(|| format!("no Requests/sec in:\n{out}"))?,
            latency,
        ))
    }

    fn run_wrk(
        wrk: &str,
        script: &std::path::Path,
        addr: SocketAddr,
        conns: usize,
        secs: u64,
        server: u32,
    ) -> Res<Run> {
        let me = std::process::id();
        let before = ticks(&[me, server]);
        let mut child = Command::new(wrk)
            .args([
                "-t1",
                &format!("-c{conns}"),
                &format!("-d{secs}s"),
                "--latency",
            ])
            .arg("-s")
            .arg(script)
            .arg(format!("http://{addr}/payments"))
            .stdout(Stdio::piped())
            .spawn()?;
        // wrk's own CPU time, sampled while it runs (it is not in the ticks once it has
        // exited); the last sample misses at most 100 ms of it.
        let pid = child.id();
        let mut wrk_ticks = 0;
        while child.try_wait()?.is_none() {
            if let Some(t) = process_ticks(pid) {
                wrk_ticks = t;
            }
            pause(Duration::from_millis(100));
        }
        let after = ticks(&[me, server]);
        let mut out = String::new();
        child
            .stdout
            .take()
            .ok_or("no stdout")?
            .read_to_string(&mut out)?;
        let (rps, latency) = parse_wrk(&out)?;
        Ok(Run {
            rps,
            latency,
            other: others(before, after, wrk_ticks),
        })
    }

    // ---- our driver: the bare case of benches/idempotency_loopback.rs ----

    static KEYS: AtomicU64 = AtomicU64::new(0);

    fn fresh_key() -> String {
        format!(
            "f-{}-{:012}",
            std::process::id(),
            KEYS.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// One POST with a new key, answer checked (201 and the handler's body), as
    /// `post_checked` of the loopback bench does for its bare case.
    async fn post_one(sender: &mut Sender) -> Res<()> {
        let key = fresh_key();
        let req = Request::post("/payments")
            .header(HOST, "127.0.0.1")
            .header(IDEMPOTENCY_KEY, &key)
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from_static(REQUEST_JSON.as_bytes())))?;
        sender.ready().await?;
        let res = sender.send_request(req).await?;
        let (parts, body) = res.into_parts();
        let body = body.collect().await?.to_bytes();
        if parts.status != StatusCode::CREATED || body != RESPONSE_JSON.as_bytes() {
            return Err(format!("key {key}: status {}", parts.status).into());
        }
        Ok(())
    }

    async fn drive(addr: SocketAddr, conns: usize, secs: u64) -> Res<(usize, f64, Vec<u32>)> {
        let mut senders = Vec::with_capacity(conns);
        for _ in 0..conns {
            senders.push(open_http(addr).await?);
        }
        let mut set = JoinSet::new();
        for mut sender in senders.drain(..) {
            set.spawn(async move {
                for _ in 0..WARMUP_PER_CONN {
                    post_one(&mut sender).await?;
                }
                Ok::<_, BoxError>(sender)
            });
        }
        while let Some(s) = set.join_next().await {
            senders.push(s??);
        }
        let started = Instant::now();
        let deadline = started + Duration::from_secs(secs);
        let mut set = JoinSet::new();
        for mut sender in senders {
            set.spawn(async move {
                let mut latencies: Vec<u32> = Vec::with_capacity(1 << 16);
                loop {
                    let t0 = Instant::now();
                    if t0 >= deadline {
                        return Ok::<_, BoxError>(latencies);
                    }
                    post_one(&mut sender).await?;
                    latencies.push(t0.elapsed().as_nanos().min(u128::from(u32::MAX)) as u32);
                }
            });
        }
        let mut all = Vec::new();
        while let Some(done) = set.join_next().await {
            all.extend(done??);
        }
        let secs = started.elapsed().as_secs_f64();
        Ok((all.len(), secs, all))
    }

    fn run_driver(addr: SocketAddr, conns: usize, secs: u64, server: u32) -> Res<Run> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let pids = [std::process::id(), server];
        let before = ticks(&pids);
        let (n, took, mut lat) = runtime.block_on(drive(addr, conns, secs))?;
        let after = ticks(&pids);
        lat.sort_unstable();
        let at = |q: f64| {
            let i = ((lat.len() as f64 * q).ceil() as usize).clamp(1, lat.len()) - 1;
            f64::from(lat[i]) / 1e3
        };
        Ok(Run {
            rps: n as f64 / took,
            latency: [at(0.50), at(0.75), at(0.90), at(0.99)],
            other: others(before, after, 0),
        })
    }

    pub(super) fn run() -> Res<()> {
        let rounds: usize = env_or("GROWTH_WRK_ROUNDS", 3)?;
        let secs: u64 = env_or("GROWTH_WRK_SECS", 10)?;
        let workers: usize = env_or("GROWTH_WORKERS", 2)?;
        let wrk = std::env::var("GROWTH_WRK").unwrap_or_else(|_| "wrk".to_owned());
        let conns: Vec<usize> = std::env::var("GROWTH_WRK_CONNS")
            .unwrap_or_else(|_| "32 1".to_owned())
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()?;
        let version = Command::new(&wrk)
            .arg("-v")
            .output()
            .map_err(|e| format!("{wrk}: {e} (apt-get install -y wrk)"))?;
        let version = String::from_utf8_lossy(&version.stdout)
            .lines()
            .next()
            .map(str::to_owned);
        let script = wrk_script()?;
        let server = ServerChild::start(workers)?;
        let spid = server.child.id();
        eprintln!(
            "server: child pid {spid} ({workers} workers) at {}; {}; load average {}",
            server.addr,
            version.as_deref().unwrap_or("wrk ?"),
            loadavg()
        );
        // runs[conns][tool] (tool 0 = wrk, 1 = driver)
        let mut runs = vec![[Vec::new(), Vec::new()]; conns.len()];
        for round in 0..rounds {
            for (ci, &c) in conns.iter().enumerate() {
                for k in 0..2 {
                    let tool = (k + round) % 2;
                    let load = loadavg();
                    let r = if tool == 0 {
                        run_wrk(&wrk, &script, server.addr, c, secs, spid)?
                    } else {
                        run_driver(server.addr, c, secs, spid)?
                    };
                    eprintln!(
                        "round {} conns {c:2} {:6}: {:.0} req/s, \
                         p50/75/90/99 {:.0}/{:.0}/{:.0}/{:.0} µs; \
                         load average {load}, other processes {:.0} %",
                        round + 1,
                        ["wrk", "driver"][tool],
                        r.rps,
                        r.latency[0],
                        r.latency[1],
                        r.latency[2],
                        r.latency[3],
                        r.other
                    );
                    runs[ci][tool].push(r);
                }
            }
        }
        drop(server);
        let _ = std::fs::remove_file(&script);

        println!(
            "\n{rounds} rounds of {secs} s per tool and connection count; load average now {}\n",
            loadavg()
        );
        println!(
            "| conns | load driver | req/s median (min–max) | p50 µs | p75 µs | p90 µs | p99 µs | \
             driver ÷ wrk, per round | other processes % |"
        );
        println!("|---:|---|---|---|---|---|---|---|---|");
        for (ci, &c) in conns.iter().enumerate() {
            for tool in 0..2 {
                let v = &runs[ci][tool];
                let rps: Vec<f64> = v.iter().map(|r| r.rps).collect();
                let (lo, hi) = min_max(&rps);
                let lat = |i: usize| {
                    let l: Vec<f64> = v.iter().map(|r| r.latency[i]).collect();
                    let (a, b) = min_max(&l);
                    format!("{:.0} ({a:.0}–{b:.0})", median(&l))
                };
                let ratio = if tool == 1 {
                    let r: Vec<f64> = runs[ci][1]
                        .iter()
                        .zip(&runs[ci][0])
                        .map(|(d, w)| d.rps / w.rps)
                        .collect();
                    let (a, b) = min_max(&r);
                    format!("{:.3} ({a:.3}–{b:.3})", median(&r))
                } else {
                    "—".to_owned()
                };
                let other: Vec<String> = v.iter().map(|r| format!("{:.0}", r.other)).collect();
                println!(
                    "| {c} | {} | {} ({}–{}) | {} | {} | {} | {} | {ratio} | {} |",
                    ["`wrk -t1`", "our driver"][tool],
                    grouped(median(&rps)),
                    grouped(lo),
                    grouped(hi),
                    lat(0),
                    lat(1),
                    lat(2),
                    lat(3),
                    other.join(" / ")
                );
            }
        }
        Ok(())
    }
}
