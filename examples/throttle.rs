//! Adaptive client-side throttling, measured: `cargo run --release --example throttle`.
//!
//! A local axum backend can do C units of work per second (C = 250 by default): an
//! accepted request costs one unit, and a request it has no room for is rejected with
//! `503` and `retry-after: 1` — which still costs it a tenth of a unit. Clients offer
//! 4 × C requests/s, open loop, for 20 s: once plainly, once through an
//! `AdaptiveThrottleLayer` (window 5 s, a quarter of the run; `K` = 2; seeded). Without
//! the throttle the backend spends much of its capacity refusing; with it, the clients
//! keep about `K` × accepts on the wire and reject the rest at home.
//!
//! The last stdout line is JSON with the keys `offered_rps`, `capacity_rps`,
//! `backend_rps_plain`, `backend_rps_throttled`, `accepted_rps_plain`,
//! `accepted_rps_throttled`, `client_rejected_rps` and `k`.
//!
//! Options (for quick runs): `--secs N` (length of each run, default 20), `--capacity N`
//! (C, default 250), `--seed N` (default 1).
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
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use retrysafe::AdaptiveThrottleLayer;
use retrysafe::throttle::Throttled;
use retrysafe_test_support::measurement;
use tokio::time::{Instant, MissedTickBehavior};
use tower::util::BoxCloneSyncService;
use tower::{ServiceBuilder, ServiceExt};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = Full<Bytes>;
type Svc = BoxCloneSyncService<Request<Body>, Response<Incoming>, BoxError>;

/// `K`, the multiple of the accepts the throttled clients may send.
const K: f64 = 2.0;
/// Offered load, as a multiple of the capacity.
const OFFERED: u64 = 4;
/// What a rejection costs the backend, in units of an accepted request's work.
const REJECTION_COST: f64 = 0.1;

#[derive(Debug, Clone, Copy)]
struct Options {
    secs: u32,
    capacity: u32,
    seed: u64,
}

impl Options {
    fn parse() -> Result<Self, String> {
        let mut o = Options {
            secs: 20,
            capacity: 250,
            seed: 1,
        };
        for (flag, value) in measurement::flags()? {
            match flag.as_str() {
                "--secs" => o.secs = measurement::count(&flag, &value, 100_000)?,
                "--capacity" => o.capacity = measurement::count(&flag, &value, 100_000)?,
                "--seed" => o.seed = measurement::number(&flag, &value)?,
                other => return Err(format!("unknown option {other}")),
            }
        }
        Ok(o)
    }
}

/// The backend: a bucket of work refilled at the capacity.
#[derive(Debug)]
struct Backend {
    capacity: f64,
    /// Work units available (negative: owed for rejections), and when last refilled.
    work: Mutex<(f64, Instant)>,
    calls: AtomicU64,
    accepted: AtomicU64,
}

impl Backend {
    /// Takes the work of one request: `true` when there was room to accept it.
    fn admit(&self) -> bool {
        let mut work = self.work.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        let burst = self.capacity / 20.0;
        let refill = now.duration_since(work.1).as_secs_f64() * self.capacity;
        work.0 = (work.0 + refill).min(burst);
        work.1 = now;
        if work.0 >= 1.0 {
            work.0 -= 1.0;
            true
        } else {
            work.0 = (work.0 - REJECTION_COST).max(-burst);
            false
        }
    }
}

async fn item(State(backend): State<Arc<Backend>>) -> Response<axum::body::Body> {
    backend.calls.fetch_add(1, Ordering::Relaxed);
    if backend.admit() {
        backend.accepted.fetch_add(1, Ordering::Relaxed);
        "ok".into_response()
    } else {
        let retry_after = [(header::RETRY_AFTER, HeaderValue::from_static("1"))];
        (StatusCode::SERVICE_UNAVAILABLE, retry_after, "overloaded").into_response()
    }
}

async fn serve(backend: Arc<Backend>) -> Result<SocketAddr, BoxError> {
    measurement::serve(Router::new().route("/item", get(item)).with_state(backend)).await
}

/// One run's rates, per second.
#[derive(Debug, Clone, Copy, Default)]
struct Rates {
    offered: f64,
    backend: f64,
    accepted: f64,
    client_rejected: f64,
}

/// Offers `OFFERED` × capacity requests/s through `client` for `options.secs`.
async fn run(
    name: &str,
    client: Svc,
    backend: &Backend,
    addr: SocketAddr,
    options: Options,
) -> Result<Rates, BoxError> {
    let (calls0, accepted0) = (
        backend.calls.load(Ordering::Relaxed),
        backend.accepted.load(Ordering::Relaxed),
    );
    let rejected = Arc::new(AtomicU64::new(0));
    let rate = OFFERED * u64::from(options.capacity);
    let total = rate * u64::from(options.secs);
    let mut ticks = tokio::time::interval(Duration::from_millis(1));
    ticks.set_missed_tick_behavior(MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut sent = 0u64;
    let mut tasks = tokio::task::JoinSet::new();
    while sent < total {
        ticks.tick().await;
        // Requests due by now, at `rate` per second.
        let due = ((started.elapsed().as_secs_f64() * rate as f64) as u64 + 1).min(total);
        for _ in sent..due {
            let (client, rejected) = (client.clone(), Arc::clone(&rejected));
            let request = Request::get(format!("http://{addr}/item")).body(Body::default())?;
            tasks.spawn(async move {
                match client.oneshot(request).await {
                    Ok(response) => drop(response.into_body().collect().await),
                    Err(e) if e.is::<Throttled>() => {
                        rejected.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => eprintln!("request failed: {e}"),
                }
            });
        }
        sent = due;
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    let secs = f64::from(options.secs);
    let rates = Rates {
        offered: total as f64 / secs,
        backend: (backend.calls.load(Ordering::Relaxed) - calls0) as f64 / secs,
        accepted: (backend.accepted.load(Ordering::Relaxed) - accepted0) as f64 / secs,
        client_rejected: rejected.load(Ordering::Relaxed) as f64 / secs,
    };
    println!(
        "{name:<12} offered {:>7.1}/s  backend {:>7.1}/s  accepted {:>7.1}/s  rejected at the client {:>7.1}/s",
        rates.offered, rates.backend, rates.accepted, rates.client_rejected
    );
    Ok(rates)
}

fn round(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

async fn measure(options: Options) -> Result<String, BoxError> {
    let capacity = f64::from(options.capacity);
    let backend = Arc::new(Backend {
        capacity,
        work: Mutex::new((capacity / 20.0, Instant::now())),
        calls: AtomicU64::new(0),
        accepted: AtomicU64::new(0),
    });
    let addr = serve(Arc::clone(&backend)).await?;
    let http = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(512)
        .build_http::<Body>();
    println!(
        "capacity {} requests/s, offered {}x for {} s per run",
        options.capacity, OFFERED, options.secs
    );
    let plain = BoxCloneSyncService::new(http.clone().map_err(BoxError::from));
    let plain_rates = run("plain", plain, &backend, addr, options).await?;

    let window = Duration::from_secs(u64::from(options.secs).div_ceil(4).max(1));
    let layer = AdaptiveThrottleLayer::new()
        .name("backend")
        .window(window)
        .k(K)
        .seed(options.seed)
        .build()?;
    let throttled = BoxCloneSyncService::new(
        ServiceBuilder::new()
            .layer(layer)
            .service(http.map_err(BoxError::from)),
    );
    let throttled_rates = run("throttled", throttled, &backend, addr, options).await?;
    let json = serde_json::json!({
        "offered_rps": round(plain_rates.offered),
        "capacity_rps": options.capacity,
        "backend_rps_plain": round(plain_rates.backend),
        "backend_rps_throttled": round(throttled_rates.backend),
        "accepted_rps_plain": round(plain_rates.accepted),
        "accepted_rps_throttled": round(throttled_rates.accepted),
        "client_rejected_rps": round(throttled_rates.client_rejected),
        "k": K,
    });
    Ok(json.to_string())
}

#[tokio::main]
async fn main() -> ExitCode {
    let usage = "throttle [--secs N] [--capacity N] [--seed N]";
    measurement::main(usage, Options::parse, measure).await
}
