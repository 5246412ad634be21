//! What the client stack costs per call, in process, next to tower's own `Retry` with a
//! `TpsBudget` and tower-resilience's retry, around the same inner service.
//!
//! The inner service is a `service_fn` that answers at once: always 200, or, in the
//! `*_fail10` cases, a 503 on every 10th call it receives on its thread (a thread-local
//! counter: deterministic, and no shared state between the threads of the two-thread
//! group). Each iteration builds a `GET` request (empty body), waits for readiness and
//! calls the service. Success cases poll once with `now_or_never` (every one completes on
//! its first poll), so no runtime or timer is involved; the `*_fail10` cases run the whole
//! loop in one `block_on` of a current-thread tokio runtime with a paused clock, because
//! tower-resilience's retry sleeps (`tokio::time::sleep(ZERO)`) before every retry, which
//! needs a timer. Every case is boxed the same way (`BoxCloneSyncService`).
//!
//! Cases (retry layers: zero backoff, at most 3 attempts counting the first):
//!
//! - `bare`: the inner service alone;
//! - `deadline`: `DeadlineLayer` (10 s) alone;
//! - `retrysafe`: `RetryLayer` alone — standard strategy with backoff base 0, cap 1 ms,
//!   no jitter (so every retry is immediate), its own ratio budget, the default
//!   classifier, a `ReplayBody` around the body and a copy of the request head;
//! - `budget_layer`: `RetryBudgetLayer` (ratio budget) alone;
//! - `breaker`: `CircuitBreakerLayer::default()` alone;
//! - `retrysafe_with_budget_layer`: `RetryLayer` + `RetryBudgetLayer` on one budget;
//! - `full_stack`: the recommended stack — `DeadlineLayer` (10 s) →
//!   `RetryLayer` → `RetryBudgetLayer` (one shared budget) → `CircuitBreakerLayer`;
//! - `client_layers`: the same stack as `full_stack` assembled by `ClientLayers` (one
//!   fused service, the budget given once);
//! - `tower_retry_tps`: tower's `Retry` with a policy that deposits into a `TpsBudget`
//!   on success and withdraws on a retry of a 5xx (tower's documented pattern), cloning
//!   the request for a possible retry, 2 retries, no delay (`Ready<()>`);
//! - `tower_resilience_retry`: tower-resilience 0.13's `RetryLayer`, `max_attempts(3)`,
//!   `fixed_backoff(ZERO)`, `retry_on_response(status == 503)`, no budget (it clones the
//!   request for every attempt and boxes its future);
//! - `seatbelt_retry`: seatbelt 0.11's `Retry` alone (Microsoft's resilience crate),
//!   `max_retry_attempts(2)`, `base_delay(ZERO)`, a retry on a 5xx, the request head
//!   copied for a retry, no budget (one boxed future per call);
//! - `seatbelt`: seatbelt's `Retry` (as above) over its `Breaker` (its defaults), the
//!   closest it comes to the stack; no budget, no deadline (see
//!   `retrysafe_test_support::bench::seatbelt`);
//! - `floor`: not a product, a yardstick — the least per-call work required of
//!   the four layers on the success path, written as one hand-made service with no
//!   layering: one clock read for the deadline, a copy of the request head kept for a
//!   retry (as tower's policy keeps), the `request-timeout-ms` header written, one
//!   deposit into a retrysafe ratio budget, a breaker permit taken and its success
//!   recorded (`retrysafe_core::breaker::CircuitBreaker`), the status classified;
//! - `floor_required`: `floor` plus the reads of the request every retrying call must
//!   make and the floor leaves out (inherited context, the request's own extensions,
//!   its key, content-type and timeout headers);
//! - `floor_separate`: `floor` plus what separate layers must hand each other through
//!   the request (the `Deadline` extension, the whole head kept, the "counted" mark, the
//!   breaker's reading of the timeout header): the least a hand-made stack of the four
//!   layers can cost;
//! - `floor_flat`: the same work as `client_layers` on the success path, by hand, in
//!   one future that nests nothing but the inner service's. It uses retrysafe's planner
//!   (the call, its token and its decision), the request's own breaker or the service's
//!   (its permit, classification and slow-call timing), a `ReplayBody` with its copy
//!   kept for a retry, the whole head kept, the call's span, a response body with room
//!   for a gRPC answer's pending record, and a deadline timer made when the call first
//!   waits. This is the yardstick of a flattened design;
//! - `floor_flat_features`: `floor_flat` plus, by hand and still flat, what the fused
//!   stack carries per call besides that work (the front's check and dispatch, a
//!   transport handle for retries, the breaker's configuration held for the call, the
//!   request's own budget and hedge-race checks, the transport's readiness checked in
//!   place, the retry loop's states): the yardstick of the flattened product;
//! - `floor_header`: `bare` plus only the `request-timeout-ms` header write of `floor`
//!   (the one piece of it that tower's `Retry` has no counterpart for and that the
//!   wire convention makes mandatory on every attempt).
//!
//! Group `client_1_thread`: one thread. Group `client_2_threads`: two threads share one
//! service (so one budget and one breaker) and each makes the same number of calls; the
//! time reported is per call of one thread, so `scaling = t(1 thread) / t(2 threads)` is
//! 1.0 for perfect scaling and 0.5 when the two threads serialize.
//!
//! `cargo bench --bench client -- --warm-up-time 1 --measurement-time 3`
//!
//! Instructions per call (exact, unlike time on a shared machine): `scripts/bench-callgrind`
//! (`CLIENT_BENCH_CASE=name CLIENT_BENCH_CALLS=n`; a case name ending in `_2t` runs the
//! `n` calls split over two threads sharing the service).
#![allow(clippy::unwrap_used, clippy::panic, missing_docs)]

use std::cell::Cell;
use std::convert::Infallible;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, criterion_group};
use futures_util::FutureExt;
use http::{Request, Response, StatusCode};
use http_body_util::Empty;
use retrysafe::retry::{Backoff, Jitter};
use retrysafe::{
    CircuitBreakerLayer, ClientLayers, DeadlineLayer, RetryBudget, RetryBudgetLayer, RetryLayer,
    StandardRetryStrategy,
};
use tokio::time::Instant;
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service, ServiceExt};

use retrysafe_test_support::bench::floor::{
    Floor, FloorFlat, FloorFlatFeatures, FloorSeparate, floor_required,
};
use retrysafe_test_support::bench::recorder;
use retrysafe_test_support::bench::seatbelt;
use retrysafe_test_support::bench::tower_policy::TowerPolicy;

type Req = Request<Empty<Bytes>>;
type Res = Response<()>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Answer = std::future::Ready<Result<Res, Infallible>>;

thread_local! {
    static CALLS: Cell<u64> = const { Cell::new(0) };
}

fn ok<B>(_: Request<B>) -> std::future::Ready<Result<Res, Infallible>> {
    std::future::ready(Ok(Response::new(())))
}

/// 503 on every 10th call of this thread, else 200.
fn flaky<B>(_: Request<B>) -> std::future::Ready<Result<Res, Infallible>> {
    let n = CALLS.with(|c| {
        let n = c.get() + 1;
        c.set(n);
        n
    });
    let mut response = Response::new(());
    if n.is_multiple_of(10) {
        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    }
    std::future::ready(Ok(response))
}

fn request() -> Req {
    Request::get("http://inner/items")
        .body(Empty::new())
        .unwrap()
}

/// A case: runs `iters` calls on a clone of its (shared) service, on this thread.
type Runner = Arc<dyn Fn(u64) + Send + Sync>;

/// Boxes `svc` (every case pays the same box) and makes its runner: `now_or_never`
/// per call on the success path, one paused-clock runtime for the `_fail10` cases.
fn runner<S, R>(svc: S, fail: bool) -> Runner
where
    S: Service<Req, Response = Response<R>> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    R: 'static,
{
    let svc: BoxCloneSyncService<Req, Response<R>, BoxError> =
        BoxCloneSyncService::new(svc.map_err(Into::into));
    // The case must answer on the first poll (success path) or at all (with failures).
    if fail {
        let mut first = svc.clone();
        runtime().block_on(async move {
            let r = first.ready().await.unwrap().call(request()).await.unwrap();
            assert!(r.status() == StatusCode::OK || r.status() == StatusCode::SERVICE_UNAVAILABLE);
        });
        Arc::new(move |iters| {
            let mut svc = svc.clone();
            runtime().block_on(async move {
                for _ in 0..iters {
                    let ready = svc.ready().await.map(|s| s.call(request()));
                    black_box(match ready {
                        Ok(f) => f.await.ok(),
                        Err(_) => None,
                    });
                }
            });
        })
    } else {
        let response = call(&mut svc.clone()).expect("the case completes on its first poll");
        assert_eq!(response.status(), StatusCode::OK);
        Arc::new(move |iters| {
            let mut svc = svc.clone();
            for _ in 0..iters {
                black_box(call(&mut svc));
            }
        })
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
}

fn call<S: Service<Req>>(svc: &mut S) -> Option<S::Response> {
    svc.ready().now_or_never()?.ok()?;
    svc.call(request()).now_or_never()?.ok()
}

/// Zero backoff: base 0, cap 1 ms, no jitter.
fn strategy(budget: Option<RetryBudget>) -> StandardRetryStrategy {
    let backoff = Backoff::new(Duration::ZERO, Duration::from_millis(1), Jitter::None);
    let strategy = StandardRetryStrategy::new().backoff(backoff);
    match budget {
        Some(budget) => strategy.budget(budget),
        None => strategy,
    }
}

const NAMES: [&str; 18] = [
    "bare",
    "deadline",
    "retrysafe",
    "budget_layer",
    "breaker",
    "retrysafe_with_budget_layer",
    "full_stack",
    "client_layers",
    "tower_retry_tps",
    "tower_resilience_retry",
    "seatbelt_retry",
    "seatbelt",
    "floor",
    "floor_header",
    "floor_separate",
    "floor_required",
    "floor_flat",
    "floor_flat_features",
];

/// The case `name` (a base name, `_fail10` for the flaky inner service).
fn case(name: &str) -> Option<Runner> {
    let (base, fail) = match name.strip_suffix("_fail10") {
        Some(base) => (base, true),
        None => (name, false),
    };
    // A fn pointer keeps one inner type for both variants.
    fn inner<B>(fail: bool) -> tower::util::ServiceFn<fn(Request<B>) -> Answer> {
        tower::service_fn(if fail { flaky::<B> } else { ok::<B> })
    }
    Some(match base {
        "bare" => runner(inner::<Empty<Bytes>>(fail), fail),
        "deadline" => runner(
            DeadlineLayer::new(Duration::from_secs(10)).layer(inner(fail)),
            fail,
        ),
        "retrysafe" => runner(
            RetryLayer::new()
                .strategy(strategy(None))
                .layer(inner(fail)),
            fail,
        ),
        "budget_layer" => runner(
            RetryBudgetLayer::new(RetryBudget::ratio()).layer(inner(fail)),
            fail,
        ),
        "breaker" => runner(CircuitBreakerLayer::default().layer(inner(fail)), fail),
        "retrysafe_with_budget_layer" => {
            let budget = RetryBudget::ratio();
            runner(
                RetryLayer::new()
                    .strategy(strategy(Some(budget.clone())))
                    .layer(RetryBudgetLayer::new(budget).layer(inner(fail))),
                fail,
            )
        }
        "full_stack" => {
            let budget = RetryBudget::ratio();
            runner(
                tower::ServiceBuilder::new()
                    .layer(DeadlineLayer::new(Duration::from_secs(10)))
                    .layer(RetryLayer::new().strategy(strategy(Some(budget.clone()))))
                    .layer(RetryBudgetLayer::new(budget))
                    .layer(CircuitBreakerLayer::default())
                    .service(inner(fail)),
                fail,
            )
        }
        "client_layers" => runner(
            ClientLayers::new()
                .deadline(Duration::from_secs(10))
                .retry(RetryLayer::new().strategy(strategy(None)))
                .budget(RetryBudget::ratio())
                .breaker(CircuitBreakerLayer::default())
                .layer(inner(fail)),
            fail,
        ),
        "tower_retry_tps" => runner(
            tower::retry::RetryLayer::new(TowerPolicy::new(2))
                .layer(inner::<Empty<Bytes>>(fail).map_err(BoxError::from)),
            fail,
        ),
        "tower_resilience_retry" => runner(
            tower_resilience::retry::RetryLayer::<Req, Res, Infallible>::builder()
                .max_attempts(3)
                .fixed_backoff(Duration::ZERO)
                .retry_on_response(|r: &Res| r.status() == StatusCode::SERVICE_UNAVAILABLE)
                .build()
                .layer(inner(fail)),
            fail,
        ),
        "seatbelt_retry" => runner(
            seatbelt::retry(Duration::ZERO)
                .layer(inner::<Empty<Bytes>>(fail).map_err(BoxError::from)),
            fail,
        ),
        "seatbelt" => runner(
            tower::ServiceBuilder::new()
                .layer(seatbelt::retry(Duration::ZERO))
                .layer(seatbelt::breaker())
                .service(inner::<Empty<Bytes>>(fail).map_err(BoxError::from)),
            fail,
        ),
        "floor" => runner(Floor::new(inner(fail), true), fail),
        "floor_header" => runner(Floor::new(inner(fail), false), fail),
        "floor_separate" => runner(FloorSeparate::new(inner(fail)), fail),
        "floor_required" => runner(floor_required(inner(fail)), fail),
        "floor_flat" => runner(
            FloorFlat::new(inner(fail), strategy(Some(RetryBudget::ratio()))),
            fail,
        ),
        "floor_flat_features" => runner(
            FloorFlatFeatures::new(inner(fail), strategy(Some(RetryBudget::ratio()))),
            fail,
        ),
        _ => return None,
    })
}

fn all_cases() -> impl Iterator<Item = String> {
    NAMES
        .iter()
        .map(|n| (*n).to_owned())
        .chain(NAMES.iter().map(|n| format!("{n}_fail10")))
}

/// `threads` threads each run `iters` calls of `run`; the slowest thread's time.
fn timed(run: &Runner, threads: usize, iters: u64) -> Duration {
    if threads == 1 {
        let start = Instant::now();
        run(iters);
        return start.elapsed();
    }
    let barrier = Arc::new(std::sync::Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let run = run.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                let start = Instant::now();
                run(iters);
                start.elapsed()
            })
        })
        .collect();
    let times: Vec<Duration> = handles.into_iter().map(|t| t.join().unwrap()).collect();
    times.into_iter().max().unwrap_or_default()
}

fn one_thread(c: &mut Criterion) {
    let mut group = c.benchmark_group("client_1_thread");
    for name in all_cases() {
        let run = case(&name).unwrap();
        group.bench_function(&name, |b| b.iter_custom(|iters| timed(&run, 1, iters)));
    }
    group.finish();
}

fn two_threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("client_2_threads");
    for name in all_cases() {
        let run = case(&name).unwrap();
        group.bench_function(&name, |b| b.iter_custom(|iters| timed(&run, 2, iters)));
    }
    group.finish();
}

criterion_group!(benches, one_thread, two_threads);

/// `CLIENT_BENCH_CASE=name CLIENT_BENCH_CALLS=n` runs `n` calls of one case and exits
/// (for `valgrind --tool=callgrind`, which counts instructions, not time); a name ending
/// in `_2t` splits the `n` calls over two threads sharing the service. Otherwise the
/// criterion benches.
fn main() {
    recorder::install_if_asked();
    if let (Ok(name), Ok(calls)) = (
        std::env::var("CLIENT_BENCH_CASE"),
        std::env::var("CLIENT_BENCH_CALLS"),
    ) {
        let calls: u64 = calls.parse().unwrap();
        let (name, threads) = match name.strip_suffix("_2t") {
            Some(base) => (base, 2),
            None => (name.as_str(), 1),
        };
        let run = case(name).unwrap_or_else(|| panic!("unknown case {name}"));
        timed(&run, threads, calls / threads as u64);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
