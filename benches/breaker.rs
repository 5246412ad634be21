//! What a circuit breaker costs per call on the success path (Closed), in process, next
//! to the breakers of tower-resilience and failsafe around the same inner service, and
//! how each scales when two threads share ONE breaker; and, for scale, what the
//! `DeadlineLayer` costs per call (client form, and server form on a request with a
//! `request-timeout-ms` header).
//!
//! The inner service is a `service_fn` that answers 200 (an empty `Bytes` body) at once.
//! Every iteration builds a `GET http://inner/items` with an empty body, waits for
//! readiness and calls the service. Unlike `benches/client.rs`, the cases are not boxed:
//! each is its own monomorphised type, so a case costs exactly its layer. The futures
//! are driven by a minimal executor: poll, and if the future is pending, park the thread
//! until its waker unparks it (every case completes on its first poll on one thread;
//! tower-resilience's `tokio::sync::Mutex` can make a call wait when two threads share
//! it, and the number of such waits is reported). No runtime is entered, except for
//! `deadline_server`, whose layer creates a `tokio::time::Sleep` per call (a
//! current-thread runtime with the timer enabled, entered on the measuring threads; it
//! is never polled, so it never registers).
//!
//! Cases:
//!
//! - `bare`: the inner service alone;
//! - `retrysafe_breaker`: `CircuitBreakerLayer::default()` (one breaker, default
//!   config: 30 s time window in 10 buckets, Closed);
//! - `retrysafe_breaker_unshared`: a control for the two-thread group: the same as
//!   `retrysafe_breaker`, but each of the two threads gets its own new layer and
//!   breaker, so the threads share nothing (on one thread it is `retrysafe_breaker`);
//! - `retrysafe_breaker_count`: `retrysafe_breaker` with a count window of 100 calls
//!   in 10 buckets (tower-resilience's default window is 100 calls);
//! - `retrysafe_breaker_keyed`:
//!   `CircuitBreakerLayer::keyed(KeyedBreakers::per_authority(..))` (default config;
//!   every request has the authority `inner`, so one breaker, looked up in the bounded
//!   map on every call);
//! - `retrysafe_breaker_timeout_header`: `retrysafe_breaker` on a request that carries
//!   `request-timeout-ms: 10000`, as every attempt does below a `RetryLayer` that has a
//!   deadline (the breaker then times the call, to tell a spent caller deadline from the
//!   callee's own timeout);
//! - `tower_resilience`: tower-resilience's `CircuitBreakerLayer::builder().build()`
//!   (its defaults: count window of 100 calls), the service built once and cloned (its
//!   clones share the circuit);
//! - `failsafe`: `failsafe::Config::new().build()` (its defaults: EMA success rate over
//!   a time window, or 5 consecutive failures) and
//!   `failsafe::futures::CircuitBreaker::call` around the inner future, in a small tower
//!   `Service` written here (`Failsafe`), since failsafe ships none;
//! - `deadline_client`: `DeadlineLayer::new(Duration::from_secs(10))`;
//! - `bare_timeout_header`: `bare` on a request with `request-timeout-ms: 10000` (the
//!   baseline of the next case and of `retrysafe_breaker_timeout_header`);
//! - `deadline_server`: `DeadlineLayer::server()` on that request.
//!
//! Group `breaker_1_thread`: one thread. Group `breaker_2_threads`: two threads share
//! one service (clones of it, so one breaker) and each makes the same number of calls;
//! the time reported is per call of the slower thread, so `scaling = t(1 thread) /
//! t(2 threads)` is 1.0 for perfect scaling and 0.5 when the two threads serialize
//! (the same as throughput of 2 threads / 2 × throughput of 1).
//!
//! ```sh
//! cargo bench --bench breaker -- --warm-up-time 1 --measurement-time 3   # criterion
//! BREAKER_BENCH_ROUNDS=12 BREAKER_BENCH_MAX_OTHER=10 cargo bench --bench breaker  # rounds
//! BENCH=breaker scripts/bench-callgrind                 # instructions per call
//! ```
//!
//! `BREAKER_BENCH_ROUNDS=n` (with `BREAKER_BENCH_MS`, default 300, the time aimed at
//! per measurement) measures every case on one and on two threads in each of `n`
//! rounds, rotating the order of the cases from round to round (and alternating
//! whether one or two threads go first), and prints a markdown table of the medians and
//! ranges across rounds, with each case's two-thread scaling divided by `bare`'s of the
//! same round, then each case's scaling in every round. It also measures the share of
//! the CPUs that other processes used in each round (`/proc/stat` less this process's
//! own time); with
//! `BREAKER_BENCH_MAX_OTHER=p`, each round waits until they use at most `p` % over a
//! second (up to an hour), and a round in which they used more than `p` % is discarded
//! and measured again (at most `10 n` times). `BREAKER_BENCH_CASE=name
//! BREAKER_BENCH_CALLS=n` runs `n` calls of one case on one thread and exits (for
//! `valgrind --tool=callgrind`); with `BREAKER_BENCH_THREADS=2`, on each of two threads
//! sharing the service (for `perf record`).
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout, // the rounds mode's output is its table
    missing_docs
)]

use std::convert::Infallible;
use std::future::Future;
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, criterion_group};
use http::{Request, Response, StatusCode};
use http_body_util::Empty;
use retrysafe::breaker::KeyedBreakers;
use retrysafe::breaker::{BreakerConfig, SlidingWindow};
use retrysafe::{CircuitBreakerLayer, DeadlineLayer};
use retrysafe_test_support::bench::failsafe_service::Failsafe;
use retrysafe_test_support::bench::load::*;
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};

type Req = Request<Empty<Bytes>>;
type Res = Response<Bytes>;

type Answer = std::future::Ready<Result<Res, Infallible>>;
type Inner = tower::util::ServiceFn<fn(Req) -> Answer>;

fn ok(_: Req) -> Answer {
    std::future::ready(Ok(Response::new(Bytes::new())))
}

fn inner() -> Inner {
    tower::service_fn(ok as fn(Req) -> Answer)
}

fn request() -> Req {
    Request::get("http://inner/items")
        .body(Empty::new())
        .unwrap()
}

fn request_with_timeout() -> Req {
    Request::get("http://inner/items")
        .header("request-timeout-ms", "10000")
        .body(Empty::new())
        .unwrap()
}

/// Wakes the thread that parked waiting for a pending future.
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// A one-thread executor for one future at a time: poll; when pending, park until woken.
struct Driver {
    waker: Waker,
    /// Polls that returned `Pending` (a call that had to wait).
    pendings: u64,
}

impl Driver {
    fn new() -> Self {
        Driver {
            waker: Waker::from(Arc::new(Unpark(std::thread::current()))),
            pendings: 0,
        }
    }

    fn drive<F: Future>(&mut self, future: F) -> F::Output {
        let mut future = std::pin::pin!(future);
        let mut cx = Context::from_waker(&self.waker);
        loop {
            match future.as_mut().poll(&mut cx) {
                Poll::Ready(output) => return output,
                Poll::Pending => {
                    self.pendings += 1;
                    std::thread::park();
                }
            }
        }
    }
}

/// What one measurement on one thread saw.
#[derive(Clone, Copy, Default)]
struct Run {
    elapsed: Duration,
    pendings: u64,
}

/// A case whose service type is erased at the level of a whole run (never per call).
trait Case {
    fn name(&self) -> &'static str;
    /// `calls` calls on this thread, timed after `barrier` (if any) is passed.
    fn run(&self, calls: u64, barrier: Option<&Barrier>) -> Run;
    /// `calls` calls on each of two threads sharing the service; the slower thread's run.
    fn run_two(&self, calls: u64) -> Run;
}

struct Named<S> {
    name: &'static str,
    service: S,
    request: fn() -> Req,
    runtime: Option<tokio::runtime::Handle>,
    /// A control: on two threads, each thread gets its own new service (nothing shared).
    unshared: Option<fn() -> S>,
}

/// One call: readiness, then the call, both driven to completion.
fn call<S: Service<Req>>(
    service: &mut S,
    request: Req,
    driver: &mut Driver,
) -> Result<S::Response, S::Error> {
    driver.drive(service.ready())?;
    driver.drive(service.call(request))
}

impl<S, B> Named<S>
where
    S: Service<Req, Response = Response<B>> + Clone + Send,
    S::Error: std::fmt::Debug,
{
    /// Every case answers 200 before it is timed.
    fn checked(self) -> Self {
        let _entered = self.runtime.as_ref().map(|h| h.enter());
        let mut driver = Driver::new();
        let mut service = self.service.clone();
        for _ in 0..3 {
            let response = call(&mut service, (self.request)(), &mut driver)
                .unwrap_or_else(|e| panic!("{}: {e:?}", self.name));
            assert_eq!(response.status(), StatusCode::OK, "{}", self.name);
        }
        assert_eq!(driver.pendings, 0, "{}: one thread never waits", self.name);
        drop(_entered);
        self
    }
}

/// `calls` calls of `service` on this thread (in `runtime`'s context, if any), timed
/// after `barrier` (if any) is passed.
fn run_service<S, B>(
    mut service: S,
    make: fn() -> Req,
    runtime: Option<&tokio::runtime::Handle>,
    calls: u64,
    barrier: Option<&Barrier>,
) -> Run
where
    S: Service<Req, Response = Response<B>> + Clone + Send,
    S::Error: std::fmt::Debug,
{
    let _entered = runtime.map(|h| h.enter());
    let mut driver = Driver::new();
    if let Some(barrier) = barrier {
        barrier.wait();
    }
    let start = Instant::now();
    for _ in 0..calls {
        let _ = black_box(call(&mut service, make(), &mut driver));
    }
    Run {
        elapsed: start.elapsed(),
        pendings: driver.pendings,
    }
}

impl<S, B> Case for Named<S>
where
    S: Service<Req, Response = Response<B>> + Clone + Send,
    S::Error: std::fmt::Debug,
{
    fn name(&self) -> &'static str {
        self.name
    }

    fn run(&self, calls: u64, barrier: Option<&Barrier>) -> Run {
        let runtime = self.runtime.as_ref();
        run_service(self.service.clone(), self.request, runtime, calls, barrier)
    }

    fn run_two(&self, calls: u64) -> Run {
        let barrier = Barrier::new(2);
        let (a, b) = match self.unshared {
            Some(make) => (make(), make()),
            None => (self.service.clone(), self.service.clone()),
        };
        let (make, runtime) = (self.request, self.runtime.as_ref());
        let (ra, rb) = std::thread::scope(|scope| {
            let ta = scope.spawn(|| run_service(a, make, runtime, calls, Some(&barrier)));
            let tb = scope.spawn(|| run_service(b, make, runtime, calls, Some(&barrier)));
            (ta.join().unwrap(), tb.join().unwrap())
        });
        Run {
            elapsed: ra.elapsed.max(rb.elapsed),
            pendings: ra.pendings + rb.pendings,
        }
    }
}

fn named<S>(name: &'static str, service: S) -> Named<S> {
    Named {
        name,
        service,
        request,
        runtime: None,
        unshared: None,
    }
}

/// Holds the runtime of `deadline_server` for as long as the cases live.
struct Cases {
    cases: Vec<Box<dyn Case>>,
    _runtime: tokio::runtime::Runtime,
}

fn cases() -> Cases {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();

    let count_window = {
        let mut config = BreakerConfig::default();
        config = config.with_window(SlidingWindow::count(100, 10));
        CircuitBreakerLayer::with_config(config)
    };
    let keyed = CircuitBreakerLayer::keyed(KeyedBreakers::per_authority(BreakerConfig::default()));
    let tower_resilience = tower_resilience::circuitbreaker::CircuitBreakerLayer::builder()
        .build()
        .unwrap();
    let failsafe = Failsafe {
        inner: inner(),
        breaker: failsafe::Config::new().build(),
    };

    let cases: Vec<Box<dyn Case>> = vec![
        Box::new(named("bare", inner()).checked()),
        Box::new(
            named(
                "retrysafe_breaker",
                CircuitBreakerLayer::default().layer(inner()),
            )
            .checked(),
        ),
        Box::new(
            Named {
                unshared: Some(|| CircuitBreakerLayer::default().layer(inner())),
                ..named(
                    "retrysafe_breaker_unshared",
                    CircuitBreakerLayer::default().layer(inner()),
                )
            }
            .checked(),
        ),
        Box::new(named("retrysafe_breaker_count", count_window.layer(inner())).checked()),
        Box::new(named("retrysafe_breaker_keyed", keyed.layer(inner())).checked()),
        Box::new(
            Named {
                request: request_with_timeout,
                ..named(
                    "retrysafe_breaker_timeout_header",
                    CircuitBreakerLayer::default().layer(inner()),
                )
            }
            .checked(),
        ),
        Box::new(named("tower_resilience", tower_resilience.layer(inner())).checked()),
        Box::new(named("failsafe", failsafe).checked()),
        Box::new(
            named(
                "deadline_client",
                DeadlineLayer::new(Duration::from_secs(10)).layer(inner()),
            )
            .checked(),
        ),
        Box::new(
            Named {
                request: request_with_timeout,
                ..named("bare_timeout_header", inner())
            }
            .checked(),
        ),
        Box::new(
            Named {
                request: request_with_timeout,
                runtime: Some(runtime.handle().clone()),
                ..named("deadline_server", DeadlineLayer::server().layer(inner()))
            }
            .checked(),
        ),
    ];
    Cases {
        cases,
        _runtime: runtime,
    }
}

fn one_thread(c: &mut Criterion) {
    let cases = cases();
    let mut group = c.benchmark_group("breaker_1_thread");
    for case in &cases.cases {
        group.bench_function(case.name(), |b| {
            b.iter_custom(|iters| case.run(iters, None).elapsed);
        });
    }
    group.finish();
}

fn two_threads(c: &mut Criterion) {
    let cases = cases();
    let mut group = c.benchmark_group("breaker_2_threads");
    for case in &cases.cases {
        group.bench_function(case.name(), |b| {
            b.iter_custom(|iters| case.run_two(iters).elapsed);
        });
    }
    group.finish();
}

criterion_group!(benches, one_thread, two_threads);

/// Nanoseconds per call of one thread.
fn per_call(run: Run, calls: u64) -> f64 {
    run.elapsed.as_secs_f64() * 1e9 / calls as f64
}

/// How many calls take about `target` (doubling from 1 000 until a run takes 20 ms).
fn calibrate(target: Duration, mut measure: impl FnMut(u64) -> Run) -> u64 {
    let mut calls = 1_000;
    loop {
        let elapsed = measure(calls).elapsed;
        if elapsed >= Duration::from_millis(20) {
            let scale = target.as_secs_f64() / elapsed.as_secs_f64();
            #[allow(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                reason = "a positive call count far below 2^53"
            )]
            let scaled = (calls as f64 * scale) as u64;
            return scaled.max(1_000);
        }
        calls *= 2;
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn range(values: &[f64]) -> (f64, f64) {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (min, max)
}

/// Every case on one and on two threads per round, the order rotated each round.
fn rounds(rounds: usize, target: Duration, max_other: f64) {
    let cases = cases();
    let cases = &cases.cases;
    let n = cases.len();
    eprintln!(
        "calibrating {n} cases for {} ms per measurement",
        target.as_millis()
    );
    let calls: Vec<(u64, u64)> = cases
        .iter()
        .map(|case| {
            let one = calibrate(target, |c| case.run(c, None));
            let two = calibrate(target, |c| case.run_two(c));
            (one, two)
        })
        .collect();

    // [case][round]
    let mut t1 = vec![Vec::with_capacity(rounds); n];
    let mut t2 = vec![Vec::with_capacity(rounds); n];
    let mut waits = vec![Vec::with_capacity(rounds); n];
    let mut round = 0;
    let mut discarded = 0;
    let mut other_kept = Vec::with_capacity(rounds);
    while round < rounds {
        if max_other < 100.0 {
            wait_for_quiet(max_other);
        }
        let before = ticks(&[std::process::id()]);
        let load = loadavg();
        let mut r1s = Vec::with_capacity(n);
        for k in 0..n {
            let i = (k + round) % n;
            let case = &cases[i];
            let (one, two) = calls[i];
            // Alternate which thread count goes first, too.
            let (r1, r2) = if round % 2 == 0 {
                let r1 = case.run(one, None);
                (r1, case.run_two(two))
            } else {
                let r2 = case.run_two(two);
                (case.run(one, None), r2)
            };
            r1s.push((
                i,
                per_call(r1, one),
                per_call(r2, two),
                r2.pendings as f64 / (2 * two) as f64,
            ));
        }
        let other = others(before, ticks(&[std::process::id()]), 0);
        let kept = other.is_nan() || other <= max_other;
        eprintln!(
            "round {}: load average at its start {load}, other processes {other:.1} % of the CPUs{}",
            round + 1,
            if kept {
                ""
            } else {
                " (discarded, measured again)"
            }
        );
        if !kept {
            discarded += 1;
            if discarded > 10 * rounds {
                panic!("{discarded} rounds discarded: the machine is too busy");
            }
            continue;
        }
        for (i, one, two, w) in r1s {
            t1[i].push(one);
            t2[i].push(two);
            waits[i].push(w);
        }
        other_kept.push(format!("{other:.0}"));
        round += 1;
    }
    eprintln!(
        "done, load average {}, {discarded} rounds discarded",
        loadavg()
    );
    println!(
        "{rounds} rounds of {} ms per measurement; other processes used {} % of the CPUs \
         in the rounds kept ({discarded} discarded over {max_other} %)\n",
        target.as_millis(),
        other_kept.join(" / ")
    );

    let bare = cases.iter().position(|c| c.name() == "bare").unwrap();
    let scaling: Vec<Vec<f64>> = (0..n)
        .map(|i| (0..rounds).map(|r| t1[i][r] / t2[i][r]).collect())
        .collect();
    println!(
        "| case | 1 thread ns/call, median (min–max) | 2 threads ns/call per thread, median (min–max) \
         | scaling t1/t2, median (min–max) | scaling / `bare`'s of the same round, median (min–max) \
         | waits per call (2 threads, median / max) |"
    );
    println!("|---|---|---|---|---|---|");
    for i in 0..n {
        let relative: Vec<f64> = (0..rounds)
            .map(|r| scaling[i][r] / scaling[bare][r])
            .collect();
        let cell = |values: &[f64], digits: usize| {
            let (lo, hi) = range(values);
            let mid = median(&mut values.to_vec());
            format!("{mid:.digits$} ({lo:.digits$}–{hi:.digits$})")
        };
        println!(
            "| `{}` | {} | {} | {} | {} | {:.3} / {:.3} |",
            cases[i].name(),
            cell(&t1[i], 1),
            cell(&t2[i], 1),
            cell(&scaling[i], 3),
            cell(&relative, 3),
            median(&mut waits[i].clone()),
            range(&waits[i]).1,
        );
    }
    println!("\nTwo-thread scaling in each round (rounds in the order they ran):\n");
    for i in 0..n {
        let per_round: Vec<String> = scaling[i].iter().map(|s| format!("{s:.2}")).collect();
        println!("- `{}`: {}", cases[i].name(), per_round.join(" / "));
    }
}

fn main() {
    if let (Ok(case), Ok(calls)) = (
        std::env::var("BREAKER_BENCH_CASE"),
        std::env::var("BREAKER_BENCH_CALLS"),
    ) {
        let calls: u64 = calls.parse().unwrap();
        let cases = cases();
        let case = cases
            .cases
            .iter()
            .find(|c| c.name() == case)
            .unwrap_or_else(|| panic!("no case {case}"));
        match std::env::var("BREAKER_BENCH_THREADS").as_deref() {
            Ok("2") => case.run_two(calls),
            _ => case.run(calls, None),
        };
        return;
    }
    if let Ok(n) = std::env::var("BREAKER_BENCH_ROUNDS") {
        let ms = std::env::var("BREAKER_BENCH_MS").map_or(300, |ms| ms.parse().unwrap());
        let max_other =
            std::env::var("BREAKER_BENCH_MAX_OTHER").map_or(100.0, |p| p.parse().unwrap());
        rounds(n.parse().unwrap(), Duration::from_millis(ms), max_other);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
