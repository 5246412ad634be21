//! Retry amplification across hops, measured: `cargo run --release --example retry_storm`.
//!
//! A chain client → edge → A → B → D runs in this process: four retrying hops, each
//! tier a real axum server on loopback calling the next over HTTP (hyper's client), and a
//! dependency D that fails. Breakers are off, so the figures measure retries and budgets
//! only. Two stacks are compared:
//!
//! - **naive**: tower's own `Retry` with 3 attempts per hop and no budget, no convention;
//!   a full outage of D costs up to 3⁴ = 81 calls to D per top-level request;
//! - **retrysafe**: a `RetryLayer` (3 attempts, the default ratio budget) per hop and a
//!   `PropagateLayer` on every server (an `EdgeLayer` in front of the edge). The hop
//!   closest to D retries; when it gives up its answer is marked `do-not-retry: 1` and
//!   every hop above passes it on without retrying.
//!
//! It reports the calls reaching D per top-level request during a full outage — naive
//! (over a few requests: each costs about 120 HTTP calls), retrysafe "first" (the first
//! 100 requests) and "steady" (the requests issued in the last 30 s of a run at a fixed
//! rate of 200 logical requests/s for 60 s) — and the success rate of both stacks when
//! 10 % of D's answers fail (1,000 requests each). The last stdout line is JSON.
//!
//! Options (for quick runs): `--rate N` (logical requests/s, default 200), `--secs N`
//! (length of the outage run, default 60; "steady" is its second half), `--naive N`
//! (requests for the naive outage, default 20), `--requests N` (requests per stack at
//! 10 % failures, default 1000), `--seed N`.
#![allow(clippy::print_stdout)]

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use retrysafe::{EdgeLayer, PropagateLayer, ReplayBody, RetryLayer, StandardRetryStrategy};
use retrysafe_test_support::measurement;
use tokio::time::Instant;
use tower::util::BoxCloneSyncService;
use tower::{ServiceBuilder, ServiceExt};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = Full<Bytes>;
/// One hop's client to the next tier.
type HopClient = BoxCloneSyncService<Request<Body>, http::Response<Incoming>, BoxError>;

/// The header carrying the top-level request's sequence number down the chain.
const SEQ: &str = "x-storm-seq";

#[derive(Debug, Clone, Copy)]
struct Options {
    rate: u32,
    secs: u32,
    naive: u32,
    requests: u32,
    seed: u64,
}

impl Options {
    fn parse() -> Result<Self, String> {
        let mut o = Options {
            rate: 200,
            secs: 60,
            naive: 20,
            requests: 1000,
            seed: 42,
        };
        for (flag, value) in measurement::flags()? {
            let count = || measurement::count(&flag, &value, u32::MAX);
            match flag.as_str() {
                "--rate" => o.rate = count()?,
                "--secs" => o.secs = count()?,
                "--naive" => o.naive = count()?,
                "--requests" => o.requests = count()?,
                "--seed" => o.seed = measurement::number(&flag, &value)?,
                other => return Err(format!("unknown option {other}")),
            }
        }
        Ok(o)
    }
}

/// The failing dependency: counts calls per top-level request.
#[derive(Debug)]
struct Dependency {
    /// Failures per thousand answers (1000 = full outage).
    fail_permille: AtomicU32,
    calls: AtomicU64,
    per_seq: Vec<AtomicU32>,
    seed: u64,
}

impl Dependency {
    fn calls_for(&self, seqs: std::ops::Range<usize>) -> u64 {
        self.per_seq
            .get(seqs)
            .unwrap_or(&[])
            .iter()
            .map(|c| u64::from(c.load(Ordering::Relaxed)))
            .sum()
    }
}

async fn dependency(State(d): State<Arc<Dependency>>, headers: HeaderMap) -> StatusCode {
    let n = d.calls.fetch_add(1, Ordering::Relaxed);
    if let Some(seq) = headers
        .get(SEQ)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        && let Some(c) = d.per_seq.get(seq)
    {
        c.fetch_add(1, Ordering::Relaxed);
    }
    // A seeded, deterministic pattern of failures.
    if splitmix(d.seed ^ n) % 1000 < u64::from(d.fail_permille.load(Ordering::Relaxed)) {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[derive(Clone)]
struct Hop {
    next: SocketAddr,
    client: HopClient,
}

/// A tier: forwards to the next one and answers with its status. No retry logic here:
/// the layers do it.
async fn forward(State(hop): State<Hop>, headers: HeaderMap) -> StatusCode {
    status_of(call(&hop.client, hop.next, headers.get(SEQ).cloned()).await)
}

fn status_of(result: Result<StatusCode, BoxError>) -> StatusCode {
    result.unwrap_or(StatusCode::BAD_GATEWAY)
}

async fn call(
    client: &HopClient,
    next: SocketAddr,
    seq: Option<http::HeaderValue>,
) -> Result<StatusCode, BoxError> {
    let mut request = Request::get(format!("http://{next}/work")).body(Full::new(Bytes::new()))?;
    if let Some(seq) = seq {
        request.headers_mut().insert(SEQ, seq);
    }
    let response = client.clone().oneshot(request).await?;
    let status = response.status();
    // Read the body to the end so the connection goes back to the pool.
    response.into_body().collect().await?;
    Ok(status)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stack {
    Naive,
    Retrysafe,
}

fn http_client<B>() -> Client<HttpConnector, B>
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build_http()
}

/// A client of one hop in `stack`.
fn hop_client(stack: Stack, seed: u64) -> HopClient {
    match stack {
        Stack::Naive => BoxCloneSyncService::new(
            ServiceBuilder::new()
                .layer(tower::retry::RetryLayer::new(Naive { left: 2 }))
                .service(http_client::<Body>().map_err(BoxError::from)),
        ),
        Stack::Retrysafe => BoxCloneSyncService::new(
            ServiceBuilder::new()
                .layer(RetryLayer::new().strategy(StandardRetryStrategy::new().seed(seed)))
                .service(http_client::<ReplayBody<Body>>()),
        ),
    }
}

/// tower's retry as most stacks use it: 3 attempts on any 5xx or error, no budget.
#[derive(Debug, Clone, Copy)]
struct Naive {
    left: u32,
}

impl tower::retry::Policy<Request<Body>, http::Response<Incoming>, BoxError> for Naive {
    type Future = std::future::Ready<()>;

    fn retry(
        &mut self,
        _: &mut Request<Body>,
        result: &mut Result<http::Response<Incoming>, BoxError>,
    ) -> Option<Self::Future> {
        let failed = match result {
            Ok(r) => r.status().is_server_error(),
            Err(_) => true,
        };
        (failed && self.left > 0).then(|| {
            self.left -= 1;
            std::future::ready(())
        })
    }

    fn clone_request(&mut self, req: &Request<Body>) -> Option<Request<Body>> {
        let mut clone = Request::new(req.body().clone());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.headers_mut() = req.headers().clone();
        Some(clone)
    }
}

/// A chain edge → A → B → `d` in `stack`; returns the top-level client and the edge.
async fn chain(
    stack: Stack,
    d: SocketAddr,
    seed: u64,
) -> Result<(HopClient, SocketAddr), BoxError> {
    let mut next = d;
    for (i, name) in ["B", "A", "edge"].into_iter().enumerate() {
        let hop = Hop {
            next,
            client: hop_client(stack, seed.wrapping_add(i as u64 + 1)),
        };
        let router = Router::new().route("/work", get(forward)).with_state(hop);
        let router = match (stack, name) {
            (Stack::Naive, _) => router,
            (Stack::Retrysafe, "edge") => router.layer(
                ServiceBuilder::new()
                    .layer(EdgeLayer::new())
                    .layer(PropagateLayer::new()),
            ),
            (Stack::Retrysafe, _) => router.layer(PropagateLayer::new()),
        };
        next = measurement::serve(router).await?;
    }
    Ok((hop_client(stack, seed), next))
}

/// Sends `count` top-level requests at `rate`/s, numbered from `first_seq`; returns how
/// many succeeded and when each was issued (seconds since the start).
async fn drive(
    client: &HopClient,
    edge: SocketAddr,
    rate: u32,
    count: u32,
    first_seq: usize,
) -> Result<(u32, Vec<f64>), BoxError> {
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1) / rate);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::with_capacity(count as usize);
    let mut issued = Vec::with_capacity(count as usize);
    for i in 0..count as usize {
        tick.tick().await;
        issued.push(start.elapsed().as_secs_f64());
        let client = client.clone();
        let seq = http::HeaderValue::from(first_seq + i);
        tasks.push(tokio::spawn(async move {
            matches!(call(&client, edge, Some(seq)).await, Ok(StatusCode::OK))
        }));
    }
    let mut ok = 0;
    for t in tasks {
        if t.await? {
            ok += 1;
        }
    }
    Ok((ok, issued))
}

#[derive(Debug, Default)]
struct Report {
    naive_outage: f64,
    first: f64,
    steady: f64,
    steady_requests: usize,
    naive_success: f64,
    retrysafe_success: f64,
}

async fn run(o: Options) -> Result<Report, BoxError> {
    let outage_requests = o.rate.saturating_mul(o.secs);
    let capacity = (o.naive + outage_requests + 2 * o.requests) as usize + 16;
    let d = Arc::new(Dependency {
        fail_permille: AtomicU32::new(1000),
        calls: AtomicU64::new(0),
        per_seq: (0..capacity).map(|_| AtomicU32::new(0)).collect(),
        seed: o.seed,
    });
    let d_addr = measurement::serve(
        Router::new()
            .route("/work", get(dependency))
            .with_state(d.clone()),
    )
    .await?;
    let mut report = Report::default();
    let mut seq = 0usize;

    println!("retry_storm: client -> edge -> A -> B -> D (four retrying hops, breakers off)");
    println!();
    println!("{:<62} {:>10}", "full outage of D", "D calls per request");

    // Naive, full outage.
    let (client, edge) = chain(Stack::Naive, d_addr, o.seed).await?;
    drive(&client, edge, o.rate, o.naive, seq).await?;
    report.naive_outage = d.calls_for(seq..seq + o.naive as usize) as f64 / f64::from(o.naive);
    println!(
        "{:<62} {:>10.2}",
        format!("naive (tower Retry, 3 attempts/hop), {} requests", o.naive),
        report.naive_outage
    );
    seq += o.naive as usize;

    // retrysafe, full outage: one run at a fixed rate.
    let (client, edge) = chain(Stack::Retrysafe, d_addr, o.seed).await?;
    let (_, issued) = drive(&client, edge, o.rate, outage_requests, seq).await?;
    let first = 100.min(outage_requests as usize);
    report.first = d.calls_for(seq..seq + first) as f64 / first as f64;
    let half = f64::from(o.secs) / 2.0;
    let from = issued
        .iter()
        .position(|t| *t >= half)
        .unwrap_or(issued.len());
    report.steady_requests = issued.len() - from;
    report.steady = if report.steady_requests == 0 {
        0.0
    } else {
        d.calls_for(seq + from..seq + issued.len()) as f64 / report.steady_requests as f64
    };
    println!(
        "{:<62} {:>10.2}",
        format!("retrysafe, first {first} requests (at {}/s)", o.rate),
        report.first
    );
    println!(
        "{:<62} {:>10.2}",
        format!(
            "retrysafe, steady: {} requests issued {half:.0}-{} s at {}/s",
            report.steady_requests, o.secs, o.rate
        ),
        report.steady
    );
    seq += issued.len();

    // 10 % failures: success rates.
    d.fail_permille.store(100, Ordering::Relaxed);
    println!();
    println!("{:<62} {:>10}", "10 % of D's answers fail", "success");
    for stack in [Stack::Naive, Stack::Retrysafe] {
        let (client, edge) = chain(stack, d_addr, o.seed).await?;
        let (ok, _) = drive(&client, edge, o.rate, o.requests, seq).await?;
        let rate = f64::from(ok) / f64::from(o.requests);
        let calls = d.calls_for(seq..seq + o.requests as usize) as f64 / f64::from(o.requests);
        seq += o.requests as usize;
        let name = match stack {
            Stack::Naive => {
                report.naive_success = rate;
                "naive"
            }
            Stack::Retrysafe => {
                report.retrysafe_success = rate;
                "retrysafe"
            }
        };
        println!(
            "{:<62} {:>10.4}",
            format!(
                "{name}, {} requests at {}/s ({calls:.2} D calls per request)",
                o.requests, o.rate
            ),
            rate
        );
    }
    Ok(report)
}

#[tokio::main]
async fn main() -> ExitCode {
    let usage = "retry_storm [--rate N] [--secs N] [--naive N] [--requests N] [--seed N]";
    measurement::main(usage, Options::parse, async |options| {
        let r = run(options).await?;
        println!();
        // The keys in the documented order.
        Ok(format!(
            "{{\"naive_outage\": {}, \"retrysafe_outage_first\": {}, \
             \"retrysafe_outage_steady\": {}, \"naive_success_10pct\": {}, \
             \"retrysafe_success_10pct\": {}}}",
            json_number(r.naive_outage),
            json_number(r.first),
            json_number(r.steady),
            json_number(r.naive_success),
            json_number(r.retrysafe_success),
        ))
    })
    .await
}

/// A JSON number with four decimals at most (`serde_json` formats it).
fn json_number(x: f64) -> serde_json::Value {
    serde_json::json!((x * 10_000.0).round() / 10_000.0)
}
