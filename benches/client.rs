//! What the client retry stack costs per call on the success path, in process, next to
//! tower's own `Retry` with a `TpsBudget`, around the same inner service.
//!
//! The inner service is a `service_fn` that answers 200 at once. Each iteration builds a
//! `GET` request (empty body), waits for readiness and calls the service; the futures are
//! polled once with `now_or_never` (every case completes on its first poll), so no
//! runtime or timer is involved and only the layers differ:
//!
//! - `bare`: the inner service alone;
//! - `retrysafe`: `RetryLayer::new()` — the standard strategy with its ratio budget (one
//!   deposit per call), the default classifier, a `ReplayBody` around the body and a
//!   copy of the request head;
//! - `retrysafe_with_budget_layer`: the same plus a `RetryBudgetLayer` sharing the
//!   budget (it skips the attempts the `RetryLayer` charged);
//! - `full_stack` (one thread): the recommended stack of DESIGN §6 — `DeadlineLayer`
//!   (10 s) → `RetryLayer` → `RetryBudgetLayer` (one shared budget) →
//!   `CircuitBreakerLayer` (defaults);
//! - `tower_retry_tps`: tower's `Retry` with a policy that deposits into a `TpsBudget`
//!   on success and withdraws on a retry (tower's documented pattern), cloning the
//!   request for a possible retry.
//!
//! Group `client_1_thread`: one thread. Group `client_2_threads`: two threads share one
//! service (so one budget) and each makes the same number of calls; the time reported is
//! per call of one thread, so `scaling = t(1 thread) / t(2 threads)` is 1.0 for perfect
//! scaling and 0.5 when the two threads serialize.
//!
//! `cargo bench --bench client -- --warm-up-time 1 --measurement-time 3`
//!
//! Instructions per call (exact, unlike time on a shared machine): `scripts/bench-callgrind`.
#![allow(clippy::unwrap_used, clippy::panic, missing_docs)]

use std::convert::Infallible;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, criterion_group};
use futures_util::FutureExt;
use http::{Request, Response, StatusCode};
use http_body_util::Empty;
use retrysafe::breaker::ResponseBody;
use retrysafe::{
    CircuitBreakerLayer, DeadlineLayer, RetryBudget, RetryBudgetLayer, RetryLayer,
    StandardRetryStrategy,
};
use tokio::time::Instant;
use tower::retry::budget::{Budget, TpsBudget};
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceBuilder, ServiceExt};

type Req = Request<Empty<Bytes>>;
type Res = Response<()>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Svc = BoxCloneSyncService<Req, Res, BoxError>;

fn ok<B>(_: Request<B>) -> std::future::Ready<Result<Res, Infallible>> {
    std::future::ready(Ok(Response::new(())))
}

fn request() -> Req {
    Request::get("http://inner/items")
        .body(Empty::new())
        .unwrap()
}

#[derive(Clone)]
struct TowerPolicy {
    budget: Arc<TpsBudget>,
    attempts_left: u32,
}

impl tower::retry::Policy<Req, Res, BoxError> for TowerPolicy {
    type Future = std::future::Ready<()>;

    fn retry(&mut self, _: &mut Req, result: &mut Result<Res, BoxError>) -> Option<Self::Future> {
        match result {
            Ok(r) if !r.status().is_server_error() => {
                self.budget.deposit();
                None
            }
            _ if self.attempts_left > 0 && self.budget.withdraw() => {
                self.attempts_left -= 1;
                Some(std::future::ready(()))
            }
            _ => None,
        }
    }

    fn clone_request(&mut self, req: &Req) -> Option<Req> {
        let mut clone = Request::new(Empty::new());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.headers_mut() = req.headers().clone();
        Some(clone)
    }
}

fn cases() -> Vec<(&'static str, Svc)> {
    let bare =
        BoxCloneSyncService::new(tower::service_fn(ok::<Empty<Bytes>>).map_err(BoxError::from));
    let retrysafe = BoxCloneSyncService::new(
        ServiceBuilder::new()
            .layer(RetryLayer::new())
            .service(tower::service_fn(ok)),
    );
    let budget = RetryBudget::ratio();
    let with_budget_layer = BoxCloneSyncService::new(
        ServiceBuilder::new()
            .layer(RetryLayer::new().strategy(StandardRetryStrategy::new().budget(budget.clone())))
            .layer(RetryBudgetLayer::new(budget))
            .service(tower::service_fn(ok)),
    );
    let tower_retry = BoxCloneSyncService::new(
        ServiceBuilder::new()
            .layer(tower::retry::RetryLayer::new(TowerPolicy {
                budget: Arc::new(TpsBudget::default()),
                attempts_left: 2,
            }))
            .service(tower::service_fn(ok::<Empty<Bytes>>).map_err(BoxError::from)),
    );
    let cases = vec![
        ("bare", bare),
        ("retrysafe", retrysafe),
        ("retrysafe_with_budget_layer", with_budget_layer),
        ("tower_retry_tps", tower_retry),
    ];
    // Every case answers 200 on the first poll.
    for (name, svc) in &cases {
        let response = call(&mut svc.clone()).unwrap_or_else(|| panic!("{name} did not complete"));
        assert_eq!(response.status(), StatusCode::OK, "{name}");
    }
    cases
}

fn call<S: Service<Req>>(svc: &mut S) -> Option<S::Response> {
    svc.ready().now_or_never()?.ok()?;
    svc.call(request()).now_or_never()?.ok()
}

fn run<S: Service<Req>>(svc: &mut S, iters: u64) {
    for _ in 0..iters {
        black_box(call(svc));
    }
}

/// The recommended client stack of DESIGN §6: deadline → retry → budget → breaker
/// (one shared budget; the breaker wraps the response body, hence its own type).
fn full_stack() -> BoxCloneSyncService<Req, Response<ResponseBody<()>>, BoxError> {
    let budget = RetryBudget::ratio();
    let svc = BoxCloneSyncService::new(
        ServiceBuilder::new()
            .layer(DeadlineLayer::new(Duration::from_secs(10)).unwrap())
            .layer(RetryLayer::new().strategy(StandardRetryStrategy::new().budget(budget.clone())))
            .layer(RetryBudgetLayer::new(budget))
            .layer(CircuitBreakerLayer::default())
            .service(tower::service_fn(ok)),
    );
    let response = call(&mut svc.clone()).expect("full_stack completes");
    assert_eq!(response.status(), StatusCode::OK);
    svc
}

fn one_thread(c: &mut Criterion) {
    let mut group = c.benchmark_group("client_1_thread");
    let stack = full_stack();
    group.bench_function("full_stack", |b| {
        b.iter_custom(|iters| {
            let mut svc = stack.clone();
            let start = Instant::now();
            run(&mut svc, iters);
            start.elapsed()
        });
    });
    for (name, svc) in cases() {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut svc = svc.clone();
                let start = Instant::now();
                run(&mut svc, iters);
                start.elapsed()
            });
        });
    }
    group.finish();
}

fn two_threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("client_2_threads");
    for (name, svc) in cases() {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let barrier = Arc::new(std::sync::Barrier::new(2));
                let threads: Vec<_> = (0..2)
                    .map(|_| {
                        let mut svc = svc.clone();
                        let barrier = barrier.clone();
                        std::thread::spawn(move || {
                            barrier.wait();
                            let start = Instant::now();
                            run(&mut svc, iters);
                            start.elapsed()
                        })
                    })
                    .collect();
                let times: Vec<Duration> = threads.into_iter().map(|t| t.join().unwrap()).collect();
                times.into_iter().max().unwrap_or_default()
            });
        });
    }
    group.finish();
}

criterion_group!(benches, one_thread, two_threads);

/// `CLIENT_BENCH_CASE=name CLIENT_BENCH_CALLS=n` runs `n` calls of one case and exits
/// (for `valgrind --tool=callgrind`, which counts instructions, not time); otherwise the
/// criterion benches.
fn main() {
    if let (Ok(case), Ok(calls)) = (
        std::env::var("CLIENT_BENCH_CASE"),
        std::env::var("CLIENT_BENCH_CALLS"),
    ) {
        let calls: u64 = calls.parse().unwrap();
        if case == "full_stack" {
            run(&mut full_stack(), calls);
            return;
        }
        let (_, svc) = cases().into_iter().find(|(n, _)| *n == case).unwrap();
        run(&mut svc.clone(), calls);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
