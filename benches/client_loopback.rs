//! Client stacks over loopback HTTP/1.1 with keep-alive: throughput of the bare
//! hyper-util client against the full retrysafe stack over it and tower's `Retry` with a
//! `TpsBudget` over it; plain reqwest against reqwest-middleware with no middleware,
//! with reqwest-retry, and with retrysafe's deadline + retry + breaker middleware.
//!
//! The server is an axum app answering `GET /` with 200 and a 2-byte body, run by this
//! same binary in a **child process** (`CLIENT_LOOPBACK_SERVER=1`, a current-thread tokio
//! runtime) so that client and server do not share one runtime's scheduling; the client
//! side is a current-thread runtime too (the machine has 2 cores: one each).
//!
//! For each connection count (`CONNS`, default "1 16"), each round runs every case once
//! in a rotated order (A/B alternation: shared load hits every case), each case making
//! `REQUESTS` requests (default 4000) from `CONNS` concurrent tasks on one client (so
//! `CONNS` keep-alive connections), reading every body to its end. A round's figure is
//! requests per second; the report gives the median over `ROUNDS` rounds (default 11),
//! the min and max, and the median of the per-round ratio to the group's baseline.
//!
//! Configurations: retry layers at most 3 attempts; retrysafe with its defaults (ratio
//! budget, full-jitter backoff) and a 10 s `DeadlineLayer` / `DeadlineMiddleware`;
//! tower's `Retry` deposits into a `TpsBudget` per success, 2 retries; reqwest-retry's
//! `ExponentialBackoff` with 2 retries. No request fails, so only overhead is measured.
//!
//! The peers over the same hyper client, each as close to `ClientLayers` as it comes:
//! - `hyper_tower_retry_tps`: tower's `Retry` with its documented `TpsBudget` pattern
//!   (`retrysafe_test_support::bench::tower_policy`): a budget, no breaker, no deadline;
//! - `hyper_tower_resilience`: tower-resilience 0.13's `RetryLayer` (3 attempts, a retry
//!   on a 5xx, no backoff) over its `CircuitBreakerLayer` (its defaults); no budget, no
//!   deadline; it clones the whole request for every attempt and boxes both futures;
//! - `hyper_failsafe`: failsafe 1's breaker (its defaults) and nothing else: it has no
//!   retry; a 5xx answer counts as a success, only a transport error as a failure;
//! - `hyper_seatbelt`: seatbelt 0.11's `Retry` (3 attempts, a retry on a 5xx, its default
//!   backoff: exponential from 10 ms, with jitter) over its `Breaker` (its defaults):
//!   no budget, no deadline (see
//!   `retrysafe_test_support::bench::seatbelt`).
//!
//! Yardsticks (not products): `hyper_floor` is the hyper client under the `floor` of
//! `retrysafe_test_support::bench::floor` with its deadline timer — the least
//! per-request work the whole stack must do, hand-written in one service; `reqwest_noop3` is
//! reqwest-middleware with three middlewares that only pass the request on (the hops of
//! `reqwest_retrysafe`); `reqwest_floor` is the same floor as one middleware.
//!
//! `hyper_client_layers` is the same stack as `hyper_retrysafe_full` assembled by
//! `ClientLayers` (one fused service); `reqwest_client_middlewares` is the same as
//! `reqwest_retrysafe` assembled by `ClientMiddlewares` (the budget given once). Beside
//! each case's throughput, the report gives the client process's CPU time per request
//! (user + system from `/proc/self/stat` around each run, median over the rounds; 10 ms
//! ticks, so use enough `REQUESTS`), which does not depend on which side is the
//! bottleneck.
//!
//! `cargo bench --bench client_loopback` (env: `ROUNDS`, `REQUESTS`, `CONNS`).
//!
//! The client's CPU per request comes from its threads' run time in
//! `/proc/self/task/*/schedstat` (nanoseconds; `/proc/self/stat`'s 10 ms ticks where
//! that is missing). After each group's table, a second one gives the same figures in
//! user terms — client CPU per request, CPU over the group's bare client and
//! throughput ÷ bare, each the median and quartiles of the rounds' own figures — and
//! the round-by-round CPU difference of `ClientLayers` less tower's `Retry` +
//! `TpsBudget`, and of `ClientMiddlewares` less reqwest-retry.
//!
//! Instructions per request of the client process (callgrind does not follow the server
//! child): `CLIENT_LOOPBACK_BENCH_CASE=name CLIENT_LOOPBACK_BENCH_CALLS=n` runs a fixed
//! warm-up of 200 requests and then `n` requests of one case on `CONNS` (first value)
//! connections; `BENCH=client_loopback scripts/bench-callgrind` reports
//! (instructions(n) - instructions(0)) / n.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    missing_docs
)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use retrysafe::{
    CircuitBreakerLayer, ClientLayers, DeadlineLayer, RetryBudget, RetryBudgetLayer, RetryLayer,
    StandardRetryStrategy,
};
use retrysafe_reqwest::{
    CircuitBreakerMiddleware, ClientMiddlewares, DeadlineMiddleware, RetryMiddleware,
};
use retrysafe_test_support::bench::failsafe_service::Failsafe;
use retrysafe_test_support::bench::floor::Floor;
use retrysafe_test_support::bench::seatbelt;
use retrysafe_test_support::bench::tower_policy::TowerPolicy;
use tokio::time::Instant;
use tower::util::BoxCloneService;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Req = Request<Empty<Bytes>>;
type HyperSvc = BoxCloneService<Req, Response<Bytes>, BoxError>;

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn serve() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("{}", listener.local_addr().unwrap().port());
        std::io::stdout().flush().unwrap();
        // Serve until the parent closes our stdin.
        tokio::select! {
            r = axum::serve(listener, app) => r.unwrap(),
            _ = tokio::task::spawn_blocking(|| {
                let mut line = String::new();
                let _ = std::io::stdin().read_line(&mut line);
            }) => {}
        }
    });
}

/// Reads a hyper response's body to the end (so the connection is reused).
async fn collect<B>(response: Response<B>) -> Result<Response<Bytes>, BoxError>
where
    B: http_body::Body,
    B::Error: Into<BoxError>,
{
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.map_err(Into::into)?.to_bytes();
    Ok(Response::from_parts(parts, bytes))
}

/// A middleware that only passes the request on: what one reqwest-middleware hop costs
/// (its boxed `async_trait` future), three of them being as many hops as
/// `reqwest_retrysafe` has.
struct Noop;

#[async_trait::async_trait]
impl reqwest_middleware::Middleware for Noop {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut http::Extensions,
        next: reqwest_middleware::Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        next.run(req, extensions).await
    }
}

/// The `floor` of `retrysafe_test_support::bench::floor` as ONE reqwest middleware: the
/// least per-request work of the client stack (clock read, a copy of the request kept for a retry,
/// `request-timeout-ms`, budget deposit, breaker permit and record, the deadline
/// enforced by a timer) in one hop.
struct ReqwestFloor {
    budget: RetryBudget,
    breaker: retrysafe::breaker::CircuitBreaker,
}

impl ReqwestFloor {
    fn new() -> Self {
        ReqwestFloor {
            budget: RetryBudget::ratio(),
            breaker: retrysafe::breaker::CircuitBreaker::default(),
        }
    }
}

#[async_trait::async_trait]
impl reqwest_middleware::Middleware for ReqwestFloor {
    async fn handle(
        &self,
        mut req: reqwest::Request,
        extensions: &mut http::Extensions,
        next: reqwest_middleware::Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        use retrysafe::classify::BreakerOutcome;
        let timeout = Duration::from_secs(10);
        let now = Instant::now();
        let at = now + timeout;
        let left = u64::try_from(at.saturating_duration_since(now).as_millis()).unwrap_or(0);
        let kept = req.try_clone();
        req.headers_mut().insert(
            http::HeaderName::from_static("request-timeout-ms"),
            http::HeaderValue::from(left),
        );
        self.budget.deposit();
        let permit = self.breaker.try_acquire().ok();
        let result = tokio::time::timeout_at(at, next.run(req, extensions)).await;
        let outcome = match &result {
            Ok(Ok(r)) if !r.status().is_server_error() => BreakerOutcome::Success,
            _ => BreakerOutcome::Failure,
        };
        if let Some(permit) = permit {
            permit.record(outcome, Duration::ZERO);
        }
        drop(kept);
        match result {
            Ok(r) => r,
            Err(_) => Err(reqwest_middleware::Error::middleware(
                retrysafe::error::DeadlineExceeded::new(),
            )),
        }
    }
}

fn hyper_client<B>(conns: usize) -> Client<HttpConnector, B>
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
{
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(conns)
        .build_http()
}

fn hyper_case(name: &str, conns: usize) -> HyperSvc {
    match name {
        "hyper_bare" => BoxCloneService::new(
            hyper_client::<Empty<Bytes>>(conns)
                .map_err(BoxError::from)
                .and_then(collect),
        ),
        "hyper_retrysafe_full" => {
            let budget = RetryBudget::ratio();
            BoxCloneService::new(
                ServiceBuilder::new()
                    .layer(DeadlineLayer::new(Duration::from_secs(10)))
                    .layer(
                        RetryLayer::new()
                            .strategy(StandardRetryStrategy::new().budget(budget.clone())),
                    )
                    .layer(RetryBudgetLayer::new(budget))
                    .layer(CircuitBreakerLayer::default())
                    .service(hyper_client(conns))
                    .and_then(collect),
            )
        }
        "hyper_client_layers" => BoxCloneService::new(
            ServiceBuilder::new()
                .layer(
                    ClientLayers::new()
                        .deadline(Duration::from_secs(10))
                        .retry(RetryLayer::new().strategy(StandardRetryStrategy::new()))
                        .budget(RetryBudget::ratio())
                        .breaker(CircuitBreakerLayer::default()),
                )
                .service(hyper_client(conns))
                .and_then(collect),
        ),
        "hyper_floor" => BoxCloneService::new(
            ServiceBuilder::new()
                .service(Floor::new(hyper_client(conns), true).with_timer())
                .and_then(collect),
        ),
        "hyper_tower_retry_tps" => BoxCloneService::new(
            ServiceBuilder::new()
                .layer(tower::retry::RetryLayer::new(TowerPolicy::new(2)))
                .service(hyper_client::<Empty<Bytes>>(conns).map_err(BoxError::from))
                .and_then(collect),
        ),
        "hyper_tower_resilience" => {
            let breaker = tower_resilience::circuitbreaker::CircuitBreakerLayer::builder()
                .build()
                .unwrap();
            let retry =
                tower_resilience::retry::RetryLayer::<Req, Response<Incoming>, BoxError>::builder()
                    .max_attempts(3)
                    .fixed_backoff(Duration::ZERO)
                    .retry_on_response(|r: &Response<Incoming>| r.status().is_server_error())
                    .build();
            BoxCloneService::new(
                retry
                    .layer(breaker.layer(hyper_client(conns)).map_err(BoxError::from))
                    .and_then(collect),
            )
        }
        "hyper_failsafe" => BoxCloneService::new(
            Failsafe {
                inner: hyper_client(conns),
                breaker: failsafe::Config::new().build(),
            }
            .map_err(BoxError::from)
            .and_then(collect),
        ),
        "hyper_seatbelt" => BoxCloneService::new(
            ServiceBuilder::new()
                .layer(seatbelt::retry(Duration::from_millis(10)))
                .layer(seatbelt::breaker())
                .service(hyper_client::<Empty<Bytes>>(conns).map_err(BoxError::from))
                .and_then(collect),
        ),
        _ => panic!("unknown case {name}"),
    }
}

fn reqwest_case(name: &str, conns: usize) -> ClientWithMiddleware {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(conns)
        .build()
        .unwrap();
    match name {
        "reqwest_bare" | "reqwest_mw_none" => ClientBuilder::new(client).build(),
        "reqwest_retry" => {
            let policy =
                reqwest_retry::policies::ExponentialBackoff::builder().build_with_max_retries(2);
            ClientBuilder::new(client)
                .with(reqwest_retry::RetryTransientMiddleware::new_with_policy(
                    policy,
                ))
                .build()
        }
        "reqwest_noop3" => ClientBuilder::new(client)
            .with(Noop)
            .with(Noop)
            .with(Noop)
            .build(),
        "reqwest_floor" => ClientBuilder::new(client).with(ReqwestFloor::new()).build(),
        "reqwest_retrysafe" => ClientBuilder::new(client)
            .with(DeadlineMiddleware::new(Duration::from_secs(10)))
            .with(RetryMiddleware::new())
            .with(CircuitBreakerMiddleware::default())
            .build(),
        "reqwest_client_middlewares" => ClientMiddlewares::new()
            .deadline(Duration::from_secs(10))
            .build()
            .unwrap()
            .client(client),
        _ => panic!("unknown case {name}"),
    }
}

enum Case {
    Hyper(HyperSvc),
    /// Plain reqwest (the client inside is used directly).
    Reqwest(reqwest::Client),
    Middleware(ClientWithMiddleware),
}

fn make_case(name: &str, conns: usize) -> Case {
    match name {
        "reqwest_bare" => Case::Reqwest(
            reqwest::Client::builder()
                .pool_max_idle_per_host(conns)
                .build()
                .unwrap(),
        ),
        n if n.starts_with("hyper") => Case::Hyper(hyper_case(n, conns)),
        n => Case::Middleware(reqwest_case(n, conns)),
    }
}

/// Runs `requests` requests from `conns` tasks; returns requests per second.
async fn run(case: &Case, url: &str, requests: usize, conns: usize) -> f64 {
    let per_task = requests / conns;
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..conns {
        let url = url.to_owned();
        match case {
            Case::Hyper(svc) => {
                let mut svc = svc.clone();
                tasks.spawn_local(async move {
                    for _ in 0..per_task {
                        let req = Request::get(url.as_str()).body(Empty::new()).unwrap();
                        let r = svc.ready().await.unwrap().call(req).await.unwrap();
                        assert_eq!(r.status(), StatusCode::OK);
                    }
                });
            }
            Case::Reqwest(client) => {
                let client = client.clone();
                tasks.spawn_local(async move {
                    for _ in 0..per_task {
                        let r = client.get(url.as_str()).send().await.unwrap();
                        assert_eq!(r.status(), StatusCode::OK);
                        r.bytes().await.unwrap();
                    }
                });
            }
            Case::Middleware(client) => {
                let client = client.clone();
                tasks.spawn_local(async move {
                    for _ in 0..per_task {
                        let r = client.get(url.as_str()).send().await.unwrap();
                        assert_eq!(r.status(), StatusCode::OK);
                        r.bytes().await.unwrap();
                    }
                });
            }
        }
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    (per_task * conns) as f64 / start.elapsed().as_secs_f64()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

const GROUPS: [(&str, &[&str]); 2] = [
    (
        "hyper_bare",
        &[
            "hyper_bare",
            "hyper_retrysafe_full",
            "hyper_client_layers",
            "hyper_tower_retry_tps",
            "hyper_tower_resilience",
            "hyper_failsafe",
            "hyper_seatbelt",
            "hyper_floor",
        ],
    ),
    (
        "reqwest_mw_none",
        &[
            "reqwest_bare",
            "reqwest_mw_none",
            "reqwest_retry",
            "reqwest_retrysafe",
            "reqwest_client_middlewares",
            "reqwest_noop3",
            "reqwest_floor",
        ],
    ),
];

fn main() {
    if std::env::var("CLIENT_LOOPBACK_SERVER").is_ok() {
        serve();
        return;
    }
    // `cargo bench` passes `--bench`; nothing to parse.
    let one_case = std::env::var("CLIENT_LOOPBACK_BENCH_CASE").ok();
    let rounds: usize = env_or("ROUNDS", "11").parse().unwrap();
    let requests: usize = env_or("REQUESTS", "4000").parse().unwrap();
    let conns: Vec<usize> = env_or("CONNS", "1 16")
        .split_whitespace()
        .map(|c| c.parse().unwrap())
        .collect();

    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("CLIENT_LOOPBACK_SERVER", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = format!("http://127.0.0.1:{}/", line.trim());

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        if let Some(name) = one_case {
            // For callgrind: a fixed warm-up (200 requests), then `CALLS` requests.
            let calls: usize = env_or("CLIENT_LOOPBACK_BENCH_CALLS", "0").parse().unwrap();
            let c = conns.first().copied().unwrap_or(1);
            let case = make_case(&name, c);
            run(&case, &url, 200, c).await;
            if calls > 0 {
                run(&case, &url, calls, c).await;
            }
            return;
        }
        for &c in &conns {
            for (baseline, names) in GROUPS {
                let cases: Vec<(&str, Case)> = names
                    .iter()
                    .map(|&n| (n, make_case(n, c)))
                    .collect();
                // Warm-up: open the connections.
                for (_, case) in &cases {
                    run(case, &url, requests / 4, c).await;
                }
                let mut rps: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
                let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
                for round in 0..rounds {
                    for k in 0..cases.len() {
                        let i = (k + round) % cases.len();
                        let before = cpu_seconds();
                        rps[i].push(run(&cases[i].1, &url, requests, c).await);
                        cpu[i].push((cpu_seconds() - before) * 1e6 / requests as f64);
                    }
                }
                let base = names.iter().position(|n| *n == baseline).unwrap();
                println!(
                    "\nconns={c} requests/case/round={requests} rounds={rounds} (baseline {baseline})"
                );
                println!(
                    "{:<24} {:>10} {:>10} {:>10} {:>8} {:>15} {:>10}",
                    "case", "median/s", "min/s", "max/s", "ratio", "ratio min..max", "cpu µs/req"
                );
                for (i, (name, _)) in cases.iter().enumerate() {
                    let mut ratios: Vec<f64> = rps[i]
                        .iter()
                        .zip(&rps[base])
                        .map(|(a, b)| a / b)
                        .collect();
                    let (lo, hi) = ratios
                        .iter()
                        .fold((f64::MAX, f64::MIN), |(l, h), r| (l.min(*r), h.max(*r)));
                    let ratio = median(&mut ratios);
                    let mut v = rps[i].clone();
                    let (min, max) = v
                        .iter()
                        .fold((f64::MAX, f64::MIN), |(l, h), r| (l.min(*r), h.max(*r)));
                    println!(
                        "{name:<24} {:>10.0} {min:>10.0} {max:>10.0} {ratio:>8.3} {lo:>7.3}..{hi:.3} {:>10.2}",
                        median(&mut v),
                        median(&mut cpu[i].clone())
                    );
                }
                user_terms(&cases, &rps, &cpu);
            }
        }
    });
    drop(child.stdin.take());
    let _ = child.wait();
}

/// Quartiles (q1, median, q3) of `v`.
fn quartiles(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let at = |q: f64| {
        let pos = q * (s.len() - 1) as f64;
        let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
        s[lo] + (s[hi] - s[lo]) * (pos - lo as f64)
    };
    (at(0.25), at(0.5), at(0.75))
}

fn iqr(v: &[f64], digits: usize) -> String {
    let (q1, m, q3) = quartiles(v);
    format!("{m:.digits$} ({q1:.digits$}–{q3:.digits$})")
}

/// The pairs of the client-CPU targets: (retrysafe's case, the peer it is held to).
const TARGETS: [(&str, &str); 2] = [
    ("hyper_client_layers", "hyper_tower_retry_tps"),
    ("reqwest_client_middlewares", "reqwest_retry"),
];

/// The group's figures in user terms, against its first case (bare hyper, bare
/// reqwest): client CPU per request, CPU over bare and throughput ÷ bare, each the
/// median (quartiles) of the rounds' own figures; then each target pair's CPU
/// difference, round by round.
fn user_terms<C>(cases: &[(&str, C)], rps: &[Vec<f64>], cpu: &[Vec<f64>]) {
    let bare = cases[0].0;
    println!("\n| case | client CPU µs/request | over {bare}, µs/request | throughput ÷ {bare} |");
    println!("|---|---|---|---|");
    for (i, (name, _)) in cases.iter().enumerate() {
        let over: Vec<f64> = cpu[i].iter().zip(&cpu[0]).map(|(c, b)| c - b).collect();
        let ratio: Vec<f64> = rps[i].iter().zip(&rps[0]).map(|(c, b)| c / b).collect();
        println!(
            "| {name} | {} | {} | {} |",
            iqr(&cpu[i], 2),
            iqr(&over, 2),
            iqr(&ratio, 3)
        );
    }
    for (mine, peer) in TARGETS {
        let index = |n: &str| cases.iter().position(|(c, _)| *c == n);
        if let (Some(m), Some(p)) = (index(mine), index(peer)) {
            let diff: Vec<f64> = cpu[m].iter().zip(&cpu[p]).map(|(a, b)| a - b).collect();
            println!(
                "\nclient CPU of {mine} less {peer}, round by round: {} µs/request (target ≤ +1.5)",
                iqr(&diff, 2)
            );
        }
    }
}

/// This process's CPU time so far, in seconds: the sum of its threads' run time from
/// `/proc/self/task/*/schedstat` (nanoseconds), else user + system from
/// `/proc/self/stat` (10 ms ticks); 0 where there is no procfs.
fn cpu_seconds() -> f64 {
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        let mut ns = 0u64;
        let mut read = false;
        for task in tasks.flatten() {
            let path = task.path().join("schedstat");
            if let Some(run) = std::fs::read_to_string(path)
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            {
                ns += run;
                read = true;
            }
        }
        if read {
            return ns as f64 / 1e9;
        }
    }
    stat_cpu_seconds()
}

/// User + system time from `/proc/self/stat`, in seconds; 0 where there is no procfs.
fn stat_cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name (which may hold spaces): utime and stime are the
    // 12th and 13th, in clock ticks (100 per second on Linux).
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}
