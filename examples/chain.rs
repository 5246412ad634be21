//! A chain across HTTP and gRPC, in one process over loopback:
//!
//! ```text
//! client ──HTTP──▶ A (axum) ──reqwest + RetryMiddleware──▶ B (axum, IdempotencyLayer)
//!        ──tonic + RetryLayer──▶ C (tonic server)
//! ```
//!
//! `cargo run --example chain` plays two scenarios and prints what each tier saw, then
//! one JSON line:
//!
//! - **re-run**: B's first run calls C, then fails without an effect of its own (503
//!   marked `NoEffect`, so its `IdempotencyLayer` releases the key). A's reqwest retry
//!   sends the same generated key again, B runs again — and its call to C carries the
//!   same *child* key as the first run's (derived from B's idempotency record), so C,
//!   which applies one effect per key, applies it once. Deadlines shrink hop by hop:
//!   the client's `request-timeout-ms`, then what A's call to B carries, then the
//!   `grpc-timeout` of B's call to C.
//! - **outage**: C answers `UNAVAILABLE` to everything. B's tonic retry layer, the one
//!   facing the fault, makes its three attempts and gives up; B's 503 is then marked
//!   `do-not-retry: 1` (its `DeadlineLayer::server()` saw the outbound call give up), so
//!   A's retry middleware does not multiply the attempts: three calls reach C per
//!   request, not nine.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::unwrap_used,
    clippy::exit,
    missing_docs
)]

use std::collections::HashSet;
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request as AxumRequest, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response as AxumResponse};
use axum::routing::post;
use futures_util::Stream;
use http::Request;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use retrysafe::answer::GrpcStatusLayer;
use retrysafe::idempotency::{IdempotencyLayer, NoEffect};
use retrysafe::reqwest::RetryMiddleware;
use retrysafe::retry::{Backoff, Jitter};
use retrysafe::wire::{parse_grpc_timeout, parse_request_timeout_ms};
use retrysafe::{
    CircuitBreakerLayer, DeadlineLayer, ReplayBody, RetryBudget, RetryBudgetLayer, RetryLayer,
    StandardRetryStrategy,
};
use serde_json::json;
use tokio::net::TcpListener;
use tonic::body::Body as GrpcBody;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tower::ServiceBuilder;
use tower::util::{BoxCloneSyncService, MapRequestLayer};

/// The deadline the client gives A.
const CLIENT_DEADLINE_MS: u64 = 3000;
/// Requests of the outage scenario.
const OUTAGE_REQUESTS: usize = 5;

// ---------------------------------------------------------------------------------------
// C: a tonic server applying one effect per idempotency key
// ---------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct Leaf {
    outage: AtomicBool,
    calls: AtomicUsize,
    /// The key of every call, in order.
    keys: Mutex<Vec<String>>,
    /// The keys whose effect was applied.
    effects: Mutex<HashSet<String>>,
    /// The `grpc-timeout` of every call, in milliseconds.
    timeouts_ms: Mutex<Vec<u64>>,
}

struct LeafService(Arc<Leaf>);

#[tonic::async_trait]
impl Health for LeafService {
    async fn check(
        &self,
        request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<HealthCheckResponse>, Status> {
        let leaf = &self.0;
        leaf.calls.fetch_add(1, Ordering::SeqCst);
        let metadata = request.metadata();
        if let Some(t) = metadata
            .get("grpc-timeout")
            .and_then(|v| parse_grpc_timeout(v.as_bytes()).ok())
        {
            leaf.timeouts_ms.lock().unwrap().push(millis(t));
        }
        let key = metadata
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        leaf.keys.lock().unwrap().push(key.clone());
        if leaf.outage.load(Ordering::SeqCst) {
            return Err(Status::unavailable("C is down"));
        }
        // The effect, once per key (a repeated key is a replay).
        leaf.effects.lock().unwrap().insert(key);
        Ok(tonic::Response::new(HealthCheckResponse {
            status: ServingStatus::Serving.into(),
        }))
    }

    type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

    async fn watch(
        &self,
        _request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("not in this example"))
    }
}

async fn serve_c(leaf: Arc<Leaf>) -> SocketAddr {
    let (listener, addr) = bind().await;
    let router = Server::builder()
        .layer(DeadlineLayer::server())
        .add_service(HealthServer::new(LeafService(leaf)));
    tokio::spawn(router.serve_with_incoming(TcpIncoming::from(listener)));
    addr
}

// ---------------------------------------------------------------------------------------
// B: an axum service guarded by an IdempotencyLayer, calling C through tonic
// ---------------------------------------------------------------------------------------

/// B's tonic client stack: retry (with child keys) → budget → breaker → the adapter
/// line → `Channel`. The deadline is the inherited one (B's inbound, less a margin).
type ToC = HealthClient<
    BoxCloneSyncService<
        Request<GrpcBody>,
        http::Response<retrysafe::breaker::ResponseBody<GrpcBody>>,
        Status,
    >,
>;

fn client_to_c(addr: SocketAddr) -> ToC {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy();
    let strategy = StandardRetryStrategy::new().backoff(fast_backoff()).seed(7);
    let stack = ServiceBuilder::new()
        .map_err(Status::from_error)
        .layer(GrpcStatusLayer::new())
        .layer(
            RetryLayer::new()
                .strategy(strategy)
                // gRPC calls are POSTs: a key (the child of B's record) makes them safe.
                .generate_idempotency_keys(),
        )
        .layer(RetryBudgetLayer::new(RetryBudget::default()))
        .layer(CircuitBreakerLayer::default())
        .layer(MapRequestLayer::new(|r: Request<ReplayBody<GrpcBody>>| {
            r.map(GrpcBody::new)
        }))
        .service(channel);
    HealthClient::new(BoxCloneSyncService::new(stack))
}

#[derive(Debug, Default)]
struct Middle {
    /// HTTP requests that reached B (before its idempotency layer).
    requests: AtomicUsize,
    /// Runs of B's handler.
    runs: AtomicUsize,
    /// Fail the first run after calling C (without an effect of B's own).
    fail_first_run: AtomicBool,
    /// The `request-timeout-ms` of every request, in milliseconds.
    timeouts_ms: Mutex<Vec<u64>>,
}

#[derive(Clone)]
struct BState {
    middle: Arc<Middle>,
    to_c: ToC,
}

async fn b_handler(State(b): State<BState>) -> AxumResponse {
    let run = b.middle.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let mut to_c = b.to_c.clone();
    match to_c.check(HealthCheckRequest::default()).await {
        Ok(_) if run == 1 && b.middle.fail_first_run.load(Ordering::SeqCst) => {
            // B's own part failed before it did anything: safe to run again.
            let mut response = (StatusCode::SERVICE_UNAVAILABLE, "B failed").into_response();
            response.extensions_mut().insert(NoEffect);
            response
        }
        Ok(_) => (StatusCode::CREATED, "done").into_response(),
        Err(status) => {
            let code = match status.code() {
                Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
                _ => StatusCode::SERVICE_UNAVAILABLE,
            };
            (code, format!("C: {}", status.message())).into_response()
        }
    }
}

async fn serve_b(middle: Arc<Middle>, c: SocketAddr) -> SocketAddr {
    let state = BState {
        middle: Arc::clone(&middle),
        to_c: client_to_c(c),
    };
    let app = Router::new()
        .route("/b", post(b_handler))
        .with_state(state)
        // One caller (A) in this example: one scope for its keys.
        .layer(IdempotencyLayer::in_memory().global_scope())
        .layer(DeadlineLayer::server())
        .layer(axum::middleware::map_request(
            move |request: AxumRequest| {
                let middle = Arc::clone(&middle);
                async move {
                    middle.requests.fetch_add(1, Ordering::SeqCst);
                    if let Some(ms) = timeout_ms(request.headers()) {
                        middle.timeouts_ms.lock().unwrap().push(ms);
                    }
                    request
                }
            },
        ));
    serve_http(app).await
}

// ---------------------------------------------------------------------------------------
// A: an axum service calling B through reqwest-middleware
// ---------------------------------------------------------------------------------------

#[derive(Clone)]
struct AState {
    to_b: ClientWithMiddleware,
    b: SocketAddr,
    /// The `request-timeout-ms` of every request, in milliseconds.
    timeouts_ms: Arc<Mutex<Vec<u64>>>,
}

async fn a_handler(State(a): State<AState>, headers: HeaderMap) -> AxumResponse {
    if let Some(ms) = timeout_ms(&headers) {
        a.timeouts_ms.lock().unwrap().push(ms);
    }
    // The deadline and the retry point come from the inherited context.
    let sent = a
        .to_b
        .post(format!("http://{}/b", a.b))
        .body("order")
        .send()
        .await;
    match sent {
        Ok(response) => {
            let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
            let body = response.text().await.unwrap_or_default();
            (status, body).into_response()
        }
        Err(error) => (StatusCode::BAD_GATEWAY, error.to_string()).into_response(),
    }
}

async fn serve_a(b: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<u64>>>) {
    let to_b = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new()
                .strategy(
                    StandardRetryStrategy::new()
                        .backoff(fast_backoff())
                        .seed(11),
                )
                // A POST is retried only with a key: B honours keys.
                .generate_idempotency_keys(),
        )
        .build();
    let timeouts_ms = Arc::new(Mutex::new(Vec::new()));
    let state = AState {
        to_b,
        b,
        timeouts_ms: Arc::clone(&timeouts_ms),
    };
    let app = Router::new()
        .route("/a", post(a_handler))
        .with_state(state)
        .layer(DeadlineLayer::server());
    (serve_http(app).await, timeouts_ms)
}

// ---------------------------------------------------------------------------------------
// The scenarios
// ---------------------------------------------------------------------------------------

struct Answer {
    status: u16,
    marked: bool,
}

async fn call_a(http: &reqwest::Client, a: SocketAddr) -> Answer {
    let response = http
        .post(format!("http://{a}/a"))
        .header("request-timeout-ms", CLIENT_DEADLINE_MS.to_string())
        .body("order")
        .send()
        .await
        .unwrap();
    Answer {
        status: response.status().as_u16(),
        marked: response
            .headers()
            .get("do-not-retry")
            .is_some_and(|v| v == "1"),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let http = reqwest::Client::new();

    // Re-run: one request; B's first run fails after calling C.
    let leaf = Arc::new(Leaf::default());
    let middle = Arc::new(Middle::default());
    middle.fail_first_run.store(true, Ordering::SeqCst);
    let c = serve_c(Arc::clone(&leaf)).await;
    let b = serve_b(Arc::clone(&middle), c).await;
    let (a, a_timeouts) = serve_a(b).await;
    let answer = call_a(&http, a).await;
    let keys = leaf.keys.lock().unwrap().clone();
    let distinct: HashSet<&String> = keys.iter().collect();
    let a_ms = first(&a_timeouts.lock().unwrap());
    let b_ms = first(&middle.timeouts_ms.lock().unwrap());
    let c_ms = first(&leaf.timeouts_ms.lock().unwrap());
    let b_requests = middle.requests.load(Ordering::SeqCst);
    let b_runs = middle.runs.load(Ordering::SeqCst);
    let c_calls = leaf.calls.load(Ordering::SeqCst);
    let c_effects = leaf.effects.lock().unwrap().len();
    let rerun = json!({
        "status": answer.status,
        "b_requests": b_requests,
        "b_runs": b_runs,
        "c_calls": c_calls,
        "c_distinct_keys": distinct.len(),
        "c_effects": c_effects,
        "deadline_ms": {"a": a_ms, "b": b_ms, "c": c_ms},
    });
    println!("re-run: the client got {}", answer.status);
    println!(
        "  B got {b_requests} requests and ran {b_runs} times; C got {c_calls} calls with {} \
         distinct key(s) and applied {c_effects} effect(s)",
        distinct.len()
    );
    println!("  deadlines seen: A {a_ms} ms, B {b_ms} ms, C {c_ms} ms");

    // Outage: C refuses everything.
    let leaf = Arc::new(Leaf::default());
    leaf.outage.store(true, Ordering::SeqCst);
    let middle = Arc::new(Middle::default());
    let c = serve_c(Arc::clone(&leaf)).await;
    let b = serve_b(Arc::clone(&middle), c).await;
    let (a, _) = serve_a(b).await;
    let mut statuses = HashSet::new();
    let mut all_marked = true;
    for _ in 0..OUTAGE_REQUESTS {
        let answer = call_a(&http, a).await;
        statuses.insert(answer.status);
        all_marked &= answer.marked;
    }
    let b_requests = middle.requests.load(Ordering::SeqCst);
    let c_calls = leaf.calls.load(Ordering::SeqCst);
    let outage = json!({
        "requests": OUTAGE_REQUESTS,
        "statuses": statuses.iter().collect::<Vec<_>>(),
        "marked": all_marked,
        "b_requests": b_requests,
        "c_calls": c_calls,
    });
    println!(
        "outage: {OUTAGE_REQUESTS} requests, answers {statuses:?} (do-not-retry: {all_marked}); \
         B got {b_requests} requests, C got {c_calls} calls ({:.1} per request)",
        c_calls as f64 / OUTAGE_REQUESTS as f64
    );
    println!("{}", json!({"rerun": rerun, "outage": outage}));
    ExitCode::SUCCESS
}

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// Retries without long waits (the standard strategy's other settings).
fn fast_backoff() -> Backoff {
    Backoff::new(
        Duration::from_millis(5),
        Duration::from_millis(50),
        Jitter::Full,
    )
}

fn timeout_ms(headers: &HeaderMap) -> Option<u64> {
    headers
        .get("request-timeout-ms")
        .and_then(|v| parse_request_timeout_ms(v.as_bytes()).ok())
        .map(millis)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn first(values: &[u64]) -> u64 {
    values.first().copied().unwrap_or(0)
}

async fn bind() -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    (listener, addr)
}

async fn serve_http(app: Router) -> SocketAddr {
    let (listener, addr) = bind().await;
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}
