//! Hedged requests, measured: `cargo run --release --example hedging`.
//!
//! A local axum server answers GETs in about 1 ms, except a seeded 2 % that take
//! 100 ms. The same number of GETs (5,000 by default, at 1,000/s, after an unmeasured
//! warm-up of 1.5 s that fills every latency histogram) goes through three clients over
//! loopback: no hedging, tower's `hedge` (p95 of its histogram of the last second, no
//! budget, no safety rule), and retrysafe's `HedgeLayer` (p95, at least 10 ms, above a
//! `RetryLayer` sharing its ratio budget). Then the server is overloaded — half of all
//! answers take 100 ms, where a hedge can only add load — and the three run again, with
//! a fourth: `HedgeLayer` with a fixed 5 ms delay, where only the budget holds hedges
//! back.
//!
//! It prints p50/p99/p99.9 latency and the extra load (server calls per logical
//! request − 1) of every run; the last stdout line is JSON with the keys `p99_plain_ms`,
//! `p99_tower_ms`, `p99_hedged_ms`, `extra_load_hedged`, `extra_load_tower`,
//! `extra_load_hedged_overload`, `extra_load_tower_overload`, `p99_hedged_overload_ms`,
//! `hedges_sent`, `budget_refusals` (both summed over the `HedgeLayer` runs) and
//! `extra_load_fixed_delay_overload`.
//!
//! Options (for quick runs): `--requests N` (measured per run, default 5000), `--rate N`
//! (requests/s, default 1000), `--seed N` (default 1).
#![allow(
    clippy::print_stdout,
    clippy::cast_possible_truncation,
    reason = "a program that prints its figures; counts and ranks far below 2^52"
)]

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::get;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use retrysafe::{HedgeLayer, RetryLayer};
use retrysafe_test_support::measurement;
use retrysafe_test_support::rng::SplitMix64;
use tokio::time::{Instant, MissedTickBehavior};
use tower::util::BoxCloneSyncService;
use tower::{ServiceBuilder, ServiceExt};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = Full<Bytes>;
type Svc = BoxCloneSyncService<Request<Body>, Response<Incoming>, BoxError>;

#[derive(Debug, Clone, Copy)]
struct Options {
    requests: u32,
    rate: u32,
    seed: u64,
}

impl Options {
    fn parse() -> Result<Self, String> {
        let mut o = Options {
            requests: 5000,
            rate: 1000,
            seed: 1,
        };
        for (flag, value) in measurement::flags()? {
            match flag.as_str() {
                "--requests" => o.requests = measurement::count(&flag, &value, u32::MAX)?,
                "--rate" => o.rate = measurement::count(&flag, &value, u32::MAX)?,
                "--seed" => o.seed = measurement::number(&flag, &value)?,
                other => return Err(format!("unknown option {other}")),
            }
        }
        Ok(o)
    }
}

/// The server: counts calls; a seeded share of them is slow.
#[derive(Debug)]
struct Server {
    calls: AtomicU64,
    /// Share of slow answers, in thousandths.
    slow_per_mille: AtomicU64,
    rng: Mutex<SplitMix64>,
}

async fn item(State(server): State<Arc<Server>>, headers: HeaderMap) -> &'static str {
    if headers.contains_key(MEASURED) {
        server.calls.fetch_add(1, Ordering::Relaxed);
    }
    let draw = server
        .rng
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .next_f64();
    let slow = draw * 1000.0 < server.slow_per_mille.load(Ordering::Relaxed) as f64;
    let wait = if slow { 100 } else { 1 };
    tokio::time::sleep(Duration::from_millis(wait)).await;
    "ok"
}

async fn serve(server: Arc<Server>) -> Result<SocketAddr, BoxError> {
    measurement::serve(Router::new().route("/item", get(item)).with_state(server)).await
}

fn http_client<B>() -> Client<HttpConnector, B>
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build_http()
}

/// tower's hedge policy: every GET may be copied.
#[derive(Debug, Clone, Copy)]
struct TowerPolicy;

impl tower::hedge::Policy<Request<Body>> for TowerPolicy {
    fn clone_request(&self, req: &Request<Body>) -> Option<Request<Body>> {
        let mut clone = Request::new(req.body().clone());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.headers_mut() = req.headers().clone();
        Some(clone)
    }

    fn can_retry(&self, _: &Request<Body>) -> bool {
        true
    }
}

fn plain() -> Svc {
    BoxCloneSyncService::new(http_client::<Body>().map_err(BoxError::from))
}

fn tower_hedge() -> Svc {
    let client = http_client::<Body>().map_err(BoxError::from);
    let hedge = tower::hedge::Hedge::new(client, TowerPolicy, 20, 0.95, Duration::from_secs(1));
    BoxCloneSyncService::new(tower::buffer::Buffer::new(hedge, 1024))
}

fn retrysafe_hedge(layer: &HedgeLayer) -> Svc {
    BoxCloneSyncService::new(
        ServiceBuilder::new()
            .layer(layer.clone())
            .layer(RetryLayer::new())
            .service(http_client()),
    )
}

/// One run's figures.
#[derive(Debug, Clone, Copy, Default)]
struct Figures {
    p50_ms: f64,
    p99_ms: f64,
    p999_ms: f64,
    extra_load: f64,
}

/// Marks the measured requests (and so their copies), after the warm-up.
const MEASURED: &str = "x-measured";

/// Sends GETs through `client` at `options.rate` per second: a warm-up (a fifth of
/// the measured count, at least 1.5 s, so that every latency histogram is filled),
/// then `options.requests` measured ones.
async fn run(
    name: &str,
    client: Svc,
    server: &Server,
    addr: SocketAddr,
    options: Options,
) -> Result<Figures, BoxError> {
    server.calls.store(0, Ordering::Relaxed);
    let measured = u64::from(options.requests);
    let warm_up = (measured / 5).max(u64::from(options.rate) * 3 / 2);
    let total = warm_up + measured;
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let mut ticks = tokio::time::interval(Duration::from_millis(1));
    ticks.set_missed_tick_behavior(MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut sent = 0u64;
    while sent < total {
        ticks.tick().await;
        let due =
            ((started.elapsed().as_secs_f64() * f64::from(options.rate)) as u64 + 1).min(total);
        for seq in sent..due {
            let mut request = Request::get(format!("http://{addr}/item"));
            if seq >= warm_up {
                request = request.header(MEASURED, "1");
            }
            let request = request.body(Body::default())?;
            let (client, latencies) = (client.clone(), Arc::clone(&latencies));
            tasks.spawn(async move {
                let begun = Instant::now();
                let response = client.oneshot(request).await?;
                response.into_body().collect().await?;
                if seq >= warm_up {
                    latencies
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(begun.elapsed());
                }
                Ok::<_, BoxError>(())
            });
        }
        sent = due;
        while let Some(done) = tasks.try_join_next() {
            done??;
        }
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    // Let the cancelled copies that were already sent land.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut latencies =
        std::mem::take(&mut *latencies.lock().unwrap_or_else(PoisonError::into_inner));
    latencies.sort_unstable();
    let at = |q: f64| {
        let rank = ((q * latencies.len() as f64).ceil() as usize).clamp(1, latencies.len());
        latencies
            .get(rank - 1)
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    let calls = server.calls.load(Ordering::Relaxed);
    let figures = Figures {
        p50_ms: at(0.5),
        p99_ms: at(0.99),
        p999_ms: at(0.999),
        extra_load: calls as f64 / measured as f64 - 1.0,
    };
    println!(
        "{name:<28} p50 {:>7.2} ms  p99 {:>7.2} ms  p99.9 {:>7.2} ms  extra load {:.3}",
        figures.p50_ms, figures.p99_ms, figures.p999_ms, figures.extra_load
    );
    Ok(figures)
}

fn round(x: f64, places: i32) -> f64 {
    let scale = 10f64.powi(places);
    (x * scale).round() / scale
}

async fn measure(options: Options) -> Result<String, BoxError> {
    let server = Arc::new(Server {
        calls: AtomicU64::new(0),
        slow_per_mille: AtomicU64::new(20),
        rng: Mutex::new(SplitMix64::new(options.seed)),
    });
    let addr = serve(Arc::clone(&server)).await?;
    println!(
        "{} GETs per run at {}/s after a warm-up; server: 1 ms, 2 % take 100 ms",
        options.requests, options.rate
    );
    let plain_fig = run("no hedging", plain(), &server, addr, options).await?;
    let tower_fig = run("tower hedge (p95)", tower_hedge(), &server, addr, options).await?;
    let hedged = HedgeLayer::new().name("hedged");
    let hedged_fig = run(
        "HedgeLayer (p95, >= 10 ms)",
        retrysafe_hedge(&hedged),
        &server,
        addr,
        options,
    )
    .await?;

    server.slow_per_mille.store(500, Ordering::Relaxed);
    println!("overload: half of all answers take 100 ms");
    run("no hedging", plain(), &server, addr, options).await?;
    let tower_over = run("tower hedge (p95)", tower_hedge(), &server, addr, options).await?;
    let over = HedgeLayer::new().name("overload");
    let over_fig = run(
        "HedgeLayer (p95, >= 10 ms)",
        retrysafe_hedge(&over),
        &server,
        addr,
        options,
    )
    .await?;
    let fixed = HedgeLayer::new()
        .name("fixed")
        .delay(Duration::from_millis(5));
    let fixed_fig = run(
        "HedgeLayer (fixed 5 ms)",
        retrysafe_hedge(&fixed),
        &server,
        addr,
        options,
    )
    .await?;

    let stats = [hedged.stats(), over.stats(), fixed.stats()];
    for (name, s) in ["p95", "p95 overload", "fixed 5 ms overload"]
        .iter()
        .zip(&stats)
    {
        println!(
            "HedgeLayer {name}: {} hedges sent, {} won, {} refused by the budget",
            s.sent, s.won, s.budget_refusals
        );
    }
    let json = serde_json::json!({
        "p99_plain_ms": round(plain_fig.p99_ms, 2),
        "p99_tower_ms": round(tower_fig.p99_ms, 2),
        "p99_hedged_ms": round(hedged_fig.p99_ms, 2),
        "extra_load_hedged": round(hedged_fig.extra_load, 4),
        "extra_load_tower": round(tower_fig.extra_load, 4),
        "extra_load_hedged_overload": round(over_fig.extra_load, 4),
        "extra_load_tower_overload": round(tower_over.extra_load, 4),
        "p99_hedged_overload_ms": round(over_fig.p99_ms, 2),
        "hedges_sent": stats.iter().map(|s| s.sent).sum::<u64>(),
        "budget_refusals": stats.iter().map(|s| s.budget_refusals).sum::<u64>(),
        "extra_load_fixed_delay_overload": round(fixed_fig.extra_load, 4),
    });
    Ok(json.to_string())
}

#[tokio::main]
async fn main() -> ExitCode {
    let usage = "hedging [--requests N] [--rate N] [--seed N]";
    measurement::main(usage, Options::parse, measure).await
}
