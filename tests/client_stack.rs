//! The recommended client stack end to end over loopback, in both forms (the separate
//! layers, and `ClientLayers`): `DeadlineLayer` →
//! `RetryLayer` → `RetryBudgetLayer` → `CircuitBreakerLayer` → hyper-util's client,
//! against real axum servers. A failing downstream opens the breaker, which then fails
//! fast even when the transport is not ready; half-open probes close it on recovery; a
//! leaf outage opens only the breaker facing the leaf; and no attempt outlives its
//! deadline. No paused clock and no timing assertions: only counts and orderings.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub
)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State as AxumState;
use axum::response::{IntoResponse, Response as AxumResponse};
use axum::routing::get;
use bytes::Bytes;
use futures_util::FutureExt;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use retrysafe::breaker::ResponseBody;
use retrysafe::breaker::{BreakerConfig, CircuitBreaker, SlidingWindow, State};
use retrysafe::error::{CircuitOpen, DeadlineExceeded, find};
use retrysafe::retry::{Backoff, Jitter};
use retrysafe::{
    CallContext, CircuitBreakerLayer, ClientLayers, DeadlineLayer, PropagateLayer, ReplayBody,
    RetryBudget, RetryBudgetLayer, RetryLayer, StandardRetryStrategy,
};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tower::limit::ConcurrencyLimit;
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Layer, Service, ServiceBuilder, ServiceExt};

use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::Form;

/// The breaker's state changes, in order, as (from, to).
type Changes = Arc<Mutex<Vec<(State, State)>>>;
type Http = Client<HttpConnector, ReplayBody<Full<Bytes>>>;
type Stack = BoxCloneSyncService<Request<Full<Bytes>>, Response<ResponseBody<Incoming>>, BoxError>;

fn http() -> Http {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A count window of the last 10 calls, opening at 50 % failures of at least 5.
fn breaker(open_duration: Duration) -> CircuitBreaker {
    breaker_with(open_duration, None)
}

fn breaker_with(open_duration: Duration, changes: Option<Changes>) -> CircuitBreaker {
    let mut config = BreakerConfig::default();
    config = config.with_window(SlidingWindow::count(10, 10));
    config = config.with_minimum_calls(5);
    config = config.with_open_duration(open_duration);
    config = config.with_max_open_duration(open_duration * 4);
    if let Some(changes) = changes {
        config = config.with_on_state_change(move |change| {
            changes.lock().unwrap().push((change.from, change.to));
        });
    }
    CircuitBreaker::new(config)
}

/// The standard client stack over `transport`: deadline `timeout`, 3 attempts with a 1–5 ms backoff,
/// one ratio budget shared by the retry layer and the budget layer, `breaker`.
fn stack<T>(form: Form, transport: T, breaker: CircuitBreaker, timeout: Duration) -> Stack
where
    T: Service<Request<ReplayBody<Full<Bytes>>>, Response = Response<Incoming>>
        + Clone
        + Send
        + Sync
        + 'static,
    T::Error: Into<BoxError>,
    T::Future: Send + 'static,
{
    let backoff = Backoff::new(
        Duration::from_millis(1),
        Duration::from_millis(5),
        Jitter::Full,
    );
    let budget = RetryBudget::ratio();
    let strategy = StandardRetryStrategy::new()
        .backoff(backoff)
        .budget(budget.clone());
    match form {
        Form::Separate => BoxCloneSyncService::new(
            ServiceBuilder::new()
                .layer(DeadlineLayer::new(timeout))
                .layer(RetryLayer::new().strategy(strategy))
                .layer(RetryBudgetLayer::new(budget))
                .layer(CircuitBreakerLayer::new(breaker))
                .service(transport),
        ),
        Form::Fused => BoxCloneSyncService::new(
            ClientLayers::new()
                .deadline(timeout)
                .retry(RetryLayer::new().strategy(strategy))
                .budget(budget)
                .breaker(CircuitBreakerLayer::new(breaker))
                .layer(transport),
        ),
    }
}

async fn serve(app: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn get_req(uri: &str) -> Request<Full<Bytes>> {
    Request::get(uri).body(Full::default()).unwrap()
}

#[derive(Debug, Default)]
struct Counter(AtomicUsize);

impl Counter {
    fn hit(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// A downstream: `/fail` answers 503 until `healthy` is set, then 200; `/stuck` never
/// answers until `release` is notified.
#[derive(Debug, Clone, Default)]
struct Downstream {
    calls: Arc<Counter>,
    stuck_calls: Arc<Counter>,
    healthy: Arc<AtomicBool>,
    stuck_arrived: Arc<Notify>,
    release: Arc<Notify>,
}

async fn downstream(state: Downstream) -> SocketAddr {
    async fn flaky(AxumState(s): AxumState<Downstream>) -> StatusCode {
        s.calls.hit();
        if s.healthy.load(Ordering::SeqCst) {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        }
    }
    async fn stuck(AxumState(s): AxumState<Downstream>) -> StatusCode {
        s.stuck_calls.hit();
        s.stuck_arrived.notify_one();
        s.release.notified().await;
        StatusCode::OK
    }
    let app = Router::new()
        .route("/fail", get(flaky))
        .route("/stuck", get(stuck))
        .with_state(state);
    serve(app).await
}

/// Sends GETs to `uri` until `breaker` is open (at most 10 logical requests).
async fn open(client: &Stack, uri: &str, breaker: &CircuitBreaker) {
    for _ in 0..10 {
        if breaker.state() == State::Open {
            return;
        }
        match client.clone().oneshot(get_req(uri)).await {
            Ok(res) => {
                assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
                // The retry layer gave up: no layer above retries again.
                assert_eq!(res.headers()["do-not-retry"], "1");
            }
            Err(e) => assert!(find::<CircuitOpen>(&*e).is_some(), "unexpected error: {e}"),
        }
    }
    assert_eq!(breaker.state(), State::Open, "the breaker never opened");
}

fn assert_circuit_open(result: Result<Response<ResponseBody<Incoming>>, BoxError>) {
    match result {
        Err(e) => assert!(
            find::<CircuitOpen>(&*e).is_some(),
            "expected CircuitOpen, got: {e}"
        ),
        Ok(res) => panic!("expected CircuitOpen, got a response {}", res.status()),
    }
}

async fn failing_downstream_opens_the_breaker_which_then_fails_fast_even_when_not_ready(
    form: Form,
) {
    let server = Downstream::default();
    let addr = downstream(server.clone()).await;
    let fail = format!("http://{addr}/fail");

    // A concurrency limit of 1 below the breaker: the transport a test can make unready.
    let limited = ConcurrencyLimit::new(http(), 1);
    // Long enough that no half-open probe happens during the test.
    let cb = breaker(Duration::from_secs(60));
    let client = stack(form, limited.clone(), cb.clone(), Duration::from_secs(5));

    open(&client, &fail, &cb).await;
    // The breaker opened on the 5th failed attempt (minimum_calls, all failures); the
    // attempt after it was refused without reaching the server.
    assert_eq!(server.calls.get(), 5);
    assert_eq!(cb.window().failures, 5);

    // Open: refused at once, the server's counter does not move.
    for _ in 0..5 {
        assert_circuit_open(client.clone().oneshot(get_req(&fail)).await);
    }
    assert_eq!(server.calls.get(), 5);

    // Now make the transport not ready: a stuck request holds the only permit.
    let mut holder = limited.clone();
    holder.ready().await.unwrap();
    let stuck = tokio::spawn(
        holder.call(
            Request::get(format!("http://{addr}/stuck"))
                .body(ReplayBody::new(Full::default(), 0))
                .unwrap(),
        ),
    );
    server.stuck_arrived.notified().await;
    assert_eq!(server.stuck_calls.get(), 1);
    assert!(
        limited.clone().ready().now_or_never().is_none(),
        "the transport should not be ready while the stuck request holds the permit"
    );

    // Still refused at once (not waiting for the transport), and nothing reaches it.
    for _ in 0..5 {
        assert_circuit_open(client.clone().oneshot(get_req(&fail)).await);
    }
    assert_eq!(server.calls.get(), 5);
    assert_eq!(cb.state(), State::Open);

    // The stuck request completes once released: the permit was its, not ours.
    server.release.notify_one();
    let res = stuck.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(server.calls.get(), 5);
}

async fn half_open_probes_close_the_breaker_when_the_downstream_recovers(form: Form) {
    let server = Downstream::default();
    let addr = downstream(server.clone()).await;
    let fail = format!("http://{addr}/fail");

    let changes: Changes = Arc::default();
    let open_duration = Duration::from_millis(200);
    let cb = breaker_with(open_duration, Some(Arc::clone(&changes)));
    let client = stack(form, http(), cb.clone(), Duration::from_secs(5));

    open(&client, &fail, &cb).await;
    server.healthy.store(true, Ordering::SeqCst);

    // Keep calling until the breaker has closed again (bounded: the test fails rather
    // than hangs if it never does).
    let mut closed = false;
    for _ in 0..200 {
        match client.clone().oneshot(get_req(&fail)).await {
            Ok(res) => assert_eq!(res.status(), StatusCode::OK),
            Err(e) => assert!(find::<CircuitOpen>(&*e).is_some(), "unexpected error: {e}"),
        }
        if cb.state() == State::Closed {
            closed = true;
            break;
        }
        tokio::time::sleep(open_duration / 4).await;
    }
    assert!(
        closed,
        "the breaker never closed: {:?}",
        changes.lock().unwrap()
    );

    {
        let changes = changes.lock().unwrap();
        assert_eq!(changes.first(), Some(&(State::Closed, State::Open)));
        assert_eq!(changes.last(), Some(&(State::HalfOpen, State::Closed)));
        // One chain of changes, each from the state the last one left; every half-open
        // state was entered from open (after the open duration).
        for pair in changes.windows(2) {
            assert_eq!(pair[0].1, pair[1].0, "changes out of order: {changes:?}");
        }
        for change in changes.iter().filter(|c| c.1 == State::HalfOpen) {
            assert_eq!(change.0, State::Open, "{changes:?}");
        }
    }

    // Traffic flows: every call reaches the server and succeeds.
    let before = server.calls.get();
    for _ in 0..5 {
        let res = client.clone().oneshot(get_req(&fail)).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
    assert_eq!(server.calls.get(), before + 5);
    assert_eq!(cb.state(), State::Closed);
}

/// A middle tier: counts its calls and forwards a GET to `next` through its own full
/// client stack, answering with the status it got (502 on a local error); its
/// `PropagateLayer` does the rest.
#[derive(Clone)]
struct Hop {
    client: Stack,
    next: String,
    calls: Arc<Counter>,
}

async fn forward(AxumState(hop): AxumState<Hop>) -> AxumResponse {
    hop.calls.hit();
    match hop.client.clone().oneshot(get_req(&hop.next)).await {
        Ok(res) => res.status().into_response(),
        Err(e) => (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    }
}

async fn hop(
    form: Form,
    next: SocketAddr,
    breaker: CircuitBreaker,
    calls: Arc<Counter>,
) -> SocketAddr {
    let hop = Hop {
        client: stack(form, http(), breaker, Duration::from_secs(5)),
        next: format!("http://{next}/"),
        calls,
    };
    let app = Router::new()
        .route("/", get(forward))
        .with_state(hop)
        .layer(PropagateLayer::new());
    serve(app).await
}

async fn a_leaf_outage_opens_only_the_breaker_facing_the_leaf(form: Form) {
    let (a_calls, b_calls, c_calls): (Arc<Counter>, Arc<Counter>, Arc<Counter>) =
        (Arc::default(), Arc::default(), Arc::default());
    let leaf_calls = Arc::clone(&c_calls);
    let c = serve(Router::new().route(
        "/",
        get(move || async move {
            leaf_calls.hit();
            StatusCode::SERVICE_UNAVAILABLE
        }),
    ))
    .await;
    let long = Duration::from_secs(60);
    let (client_cb, a_cb, b_cb) = (breaker(long), breaker(long), breaker(long));
    let b = hop(form, c, b_cb.clone(), Arc::clone(&b_calls)).await;
    let a = hop(form, b, a_cb.clone(), Arc::clone(&a_calls)).await;
    let client = stack(form, http(), client_cb.clone(), Duration::from_secs(5));

    let n = 8;
    for i in 0..n {
        let res = client
            .clone()
            .oneshot(get_req(&format!("http://{a}/")))
            .await
            .unwrap();
        assert!(
            res.status().is_server_error(),
            "request {i}: {}",
            res.status()
        );
        assert_eq!(res.headers()["do-not-retry"], "1", "request {i}");
    }

    // B (facing C) retried C and opened; nobody above retried or counted a failure.
    assert_eq!(b_cb.state(), State::Open);
    assert_eq!(a_cb.state(), State::Closed);
    assert_eq!(client_cb.state(), State::Closed);
    assert_eq!(a_cb.window().failures, 0);
    assert_eq!(client_cb.window().failures, 0);
    // Retries at one layer only: one call per request at A and B; C got exactly the
    // attempts that opened B's breaker.
    assert_eq!(a_calls.get(), n);
    assert_eq!(b_calls.get(), n);
    assert_eq!(c_calls.get(), 5);
}

/// A slow downstream: `/slow` sleeps 2 s; `/deadline` reports the deadline its handler
/// inherited (in ms) in `x-inherited-ms`; `/slow-503` records the `request-timeout-ms`
/// of every attempt, then answers 503 after 120 ms.
#[derive(Debug, Clone, Default)]
struct Slow {
    calls: Arc<Counter>,
    timeouts: Arc<Mutex<Vec<u64>>>,
}

async fn slow_server(state: Slow, server_deadline: bool) -> SocketAddr {
    async fn slow(AxumState(s): AxumState<Slow>) -> StatusCode {
        s.calls.hit();
        tokio::time::sleep(Duration::from_secs(2)).await;
        StatusCode::OK
    }
    async fn deadline(AxumState(s): AxumState<Slow>) -> AxumResponse {
        s.calls.hit();
        let left = CallContext::current()
            .and_then(|c| c.deadline())
            .map(|d| d.remaining().as_millis().to_string())
            .unwrap_or_else(|| "none".to_owned());
        ([("x-inherited-ms", left)], StatusCode::OK).into_response()
    }
    async fn slow_503(AxumState(s): AxumState<Slow>, headers: HeaderMap) -> StatusCode {
        s.calls.hit();
        let ms = headers["request-timeout-ms"]
            .to_str()
            .unwrap()
            .parse::<u64>()
            .unwrap();
        s.timeouts.lock().unwrap().push(ms);
        tokio::time::sleep(Duration::from_millis(120)).await;
        StatusCode::SERVICE_UNAVAILABLE
    }
    let app = Router::new()
        .route("/slow", get(slow))
        .route("/deadline", get(deadline))
        .route("/slow-503", get(slow_503))
        .with_state(state);
    let app = if server_deadline {
        app.layer(DeadlineLayer::server())
    } else {
        app
    };
    serve(app).await
}

async fn no_attempt_outlives_the_deadline(form: Form) {
    let server = Slow::default();
    let addr = slow_server(server.clone(), false).await;
    let client = stack(
        form,
        http(),
        breaker(Duration::from_secs(60)),
        Duration::from_millis(300),
    );

    let err = client
        .clone()
        .oneshot(get_req(&format!("http://{addr}/slow")))
        .await
        .unwrap_err();
    assert!(
        find::<DeadlineExceeded>(&*err).is_some(),
        "expected DeadlineExceeded, got: {err}"
    );
    // One attempt: none is started once the deadline has passed, not even later.
    assert_eq!(server.calls.get(), 1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(server.calls.get(), 1);
}

async fn every_attempt_gets_a_shrinking_deadline_and_none_starts_after_it(form: Form) {
    let server = Slow::default();
    let addr = slow_server(server.clone(), true).await;
    let client = stack(
        form,
        http(),
        breaker(Duration::from_secs(60)),
        Duration::from_millis(300),
    );

    // The callee's handler inherits less than the client's 300 ms: what was sent (the
    // time left, rounded down) less the server layer's 10 ms margin.
    let res = client
        .clone()
        .oneshot(get_req(&format!("http://{addr}/deadline")))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let inherited: u64 = res.headers()["x-inherited-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(inherited <= 290, "inherited {inherited} ms");
    assert_eq!(server.calls.get(), 1);

    // A slow 503: retried while time is left, each attempt told what is left then.
    let before = server.calls.get();
    let outcome = client
        .clone()
        .oneshot(get_req(&format!("http://{addr}/slow-503")))
        .await;
    match &outcome {
        // 503 when the retry layer gave up; 504 when the callee's server deadline cut
        // the last attempt short (it had less time left than the handler takes).
        Ok(res) => {
            assert!(
                [StatusCode::SERVICE_UNAVAILABLE, StatusCode::GATEWAY_TIMEOUT]
                    .contains(&res.status()),
                "{}",
                res.status()
            );
            assert_eq!(res.headers()["do-not-retry"], "1");
        }
        Err(e) => assert!(
            find::<DeadlineExceeded>(&**e).is_some(),
            "expected DeadlineExceeded, got: {e}"
        ),
    }
    // Nothing more arrives after the call has ended.
    let attempts = server.calls.get() - before;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(server.calls.get() - before, attempts);

    let timeouts = server.timeouts.lock().unwrap().clone();
    assert_eq!(timeouts.len(), attempts);
    assert!((1..=3).contains(&attempts), "{attempts} attempts");
    assert!(timeouts.iter().all(|&t| t > 0 && t <= 300), "{timeouts:?}");
    // Deadlines only shrink.
    assert!(
        timeouts.windows(2).all(|w| w[1] < w[0]),
        "not shrinking: {timeouts:?}"
    );
}

both_forms!(
    failing_downstream_opens_the_breaker_which_then_fails_fast_even_when_not_ready,
    flavor = "multi_thread",
    worker_threads = 2
);
both_forms!(
    half_open_probes_close_the_breaker_when_the_downstream_recovers,
    flavor = "multi_thread",
    worker_threads = 2
);
both_forms!(
    a_leaf_outage_opens_only_the_breaker_facing_the_leaf,
    flavor = "multi_thread",
    worker_threads = 2
);
both_forms!(
    no_attempt_outlives_the_deadline,
    flavor = "multi_thread",
    worker_threads = 2
);
both_forms!(
    every_attempt_gets_a_shrinking_deadline_and_none_starts_after_it,
    flavor = "multi_thread",
    worker_threads = 2
);
