//! The wire convention across real hops: axum servers on loopback, each calling the next
//! through a `RetryLayer` over hyper-util's client. Retries stay at one layer (the one
//! closest to the failure, or the caller that made itself the retry point), deadlines
//! shrink hop by hop, an `EdgeLayer` drops forged convention headers, and child keys
//! repeat when a guarded handler runs again. No paused clock and no timing assertions
//! here: only counts and orderings.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    missing_docs,
    unreachable_pub
)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request as AxumRequest, State};
use axum::response::{IntoResponse, Response as AxumResponse};
use axum::routing::{get, post};
use axum::{Extension, Router};
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use retrysafe_core::backoff::{Backoff, Jitter};
use retrysafe_core::budget::{RatioConfig, RetryBudget};
use retrysafe_core::classify::{
    Classification, Classifier, DefaultClassifier, Failure, RequestFacts,
};
use retrysafe_core::idempotency::{IdempotencyContext, NoEffect, Principal, Scope, Token};
use retrysafe_core::strategy::StandardRetryStrategy;
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_core::{CallContext, Deadline};
use retrysafe_tower::budget::RetryBudgetLayer;
use retrysafe_tower::edge::EdgeLayer;
use retrysafe_tower::idempotency::IdempotencyLayer;
use retrysafe_tower::propagate::PropagateLayer;
use retrysafe_tower::retry::{ReplayBody, RetryLayer, RetryService};
use tokio::net::TcpListener;
use tower::{Layer, ServiceExt};

type Http = Client<HttpConnector, ReplayBody<Full<Bytes>>>;
type Outbound = RetryService<Http>;

/// A classifier that ignores `do-not-retry`: what a stack without the convention does.
#[derive(Debug, Default)]
struct IgnoreMarks(DefaultClassifier);

impl Classifier for IgnoreMarks {
    fn classify_response(
        &self,
        status: StatusCode,
        headers: &HeaderMap,
        request: &RequestFacts,
    ) -> Classification {
        let mut headers = headers.clone();
        headers.remove("do-not-retry");
        self.0.classify_response(status, &headers, request)
    }

    fn classify_trailers(&self, trailers: &HeaderMap, request: &RequestFacts) -> Classification {
        self.0.classify_trailers(trailers, request)
    }

    fn classify_failure(&self, failure: Failure, request: &RequestFacts) -> Classification {
        self.0.classify_failure(failure, request)
    }
}

/// 3 attempts, backoff 1 to 5 ms with full jitter.
fn retry_layer() -> RetryLayer {
    let backoff = Backoff::new(
        Duration::from_millis(1),
        Duration::from_millis(5),
        Jitter::Full,
    );
    RetryLayer::new().strategy(StandardRetryStrategy::new().backoff(backoff))
}

fn naive_layer() -> RetryLayer {
    retry_layer().classifier(IgnoreMarks::default())
}

fn outbound(layer: &RetryLayer) -> Outbound {
    layer.layer(Client::builder(TokioExecutor::new()).build_http())
}

async fn serve(app: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

async fn body_text(res: Response<Incoming>) -> String {
    String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

fn empty_get(uri: &str) -> Request<Full<Bytes>> {
    Request::get(uri).body(Full::default()).unwrap()
}

#[derive(Default)]
struct Counter(AtomicUsize);

impl Counter {
    fn hit(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    fn reset(&self) {
        self.0.store(0, Ordering::SeqCst);
    }
}

/// A middle tier: counts its calls, forwards a GET to `next` through its outbound
/// client, and answers with the status it got (the `PropagateLayer` does the rest).
#[derive(Clone)]
struct Hop {
    client: Outbound,
    next: String,
    calls: Arc<Counter>,
}

async fn forward(State(hop): State<Hop>) -> AxumResponse {
    hop.calls.hit();
    match hop.client.clone().oneshot(empty_get(&hop.next)).await {
        Ok(res) => {
            let status = res.status();
            (status, body_text(res).await).into_response()
        }
        Err(e) => (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    }
}

async fn hop(layer: &RetryLayer, next: SocketAddr, calls: Arc<Counter>) -> SocketAddr {
    let hop = Hop {
        client: outbound(layer),
        next: format!("http://{next}/"),
        calls,
    };
    let app = Router::new()
        .route("/", get(forward))
        .with_state(hop)
        .layer(PropagateLayer::new());
    serve(app).await
}

/// The dependency D: always 503.
async fn failing_dependency(calls: Arc<Counter>) -> SocketAddr {
    let app = Router::new().route(
        "/",
        get(move || async move {
            calls.hit();
            StatusCode::SERVICE_UNAVAILABLE
        }),
    );
    serve(app).await
}

struct Chain {
    a: SocketAddr,
    a_calls: Arc<Counter>,
    b_calls: Arc<Counter>,
    d_calls: Arc<Counter>,
}

/// client → A → B → D, with `layer()` on each hop's outbound calls.
async fn chain(layer: fn() -> RetryLayer) -> Chain {
    let (a_calls, b_calls, d_calls) = (Arc::default(), Arc::default(), Arc::default());
    let d = failing_dependency(Arc::clone(&d_calls)).await;
    let b = hop(&layer(), d, Arc::clone(&b_calls)).await;
    let a = hop(&layer(), b, Arc::clone(&a_calls)).await;
    Chain {
        a,
        a_calls,
        b_calls,
        d_calls,
    }
}

impl Chain {
    fn counts(&self) -> (usize, usize, usize) {
        (self.a_calls.get(), self.b_calls.get(), self.d_calls.get())
    }

    fn reset(&self) {
        self.a_calls.reset();
        self.b_calls.reset();
        self.d_calls.reset();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amplification_stays_at_one_layer() {
    let chain = chain(retry_layer).await;
    let client = outbound(&retry_layer());
    for _ in 0..3 {
        chain.reset();
        let res = client
            .clone()
            .oneshot(empty_get(&format!("http://{}/", chain.a)))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        // Every tier above B saw B's give-up and passed it on.
        assert_eq!(res.headers()["do-not-retry"], "1");
        // Only B, the layer closest to the failure, retried: 3 calls reach D.
        assert_eq!(chain.counts(), (1, 1, 3));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_convention_attempts_multiply() {
    let chain = chain(naive_layer).await;
    let client = outbound(&naive_layer());
    let res = client
        .oneshot(empty_get(&format!("http://{}/", chain.a)))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    // 3 attempts at each of three tiers: 3³.
    assert_eq!(chain.counts(), (3, 9, 27));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_retry_point_is_the_only_one() {
    let chain = chain(retry_layer).await;
    let client = outbound(&retry_layer().retry_point());
    for _ in 0..2 {
        chain.reset();
        let res = client
            .clone()
            .oneshot(empty_get(&format!("http://{}/", chain.a)))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        // The client retried and gave up: it marks what it returns.
        assert_eq!(res.headers()["do-not-retry"], "1");
        // A and B made one attempt each per client attempt.
        assert_eq!(chain.counts(), (3, 3, 3));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_shrink_hop_by_hop() {
    // B reports what is left of its inherited deadline.
    let b_app = Router::new()
        .route(
            "/",
            get(|| async {
                let ctx = CallContext::current().expect("a context");
                let left = ctx.deadline().expect("a deadline").remaining();
                left.as_millis().to_string()
            }),
        )
        .layer(PropagateLayer::new());
    let b = serve(b_app).await;

    // A reports its inbound header and B's answer.
    let client = outbound(&retry_layer());
    let a_app = Router::new()
        .route(
            "/",
            get(move |headers: HeaderMap| async move {
                let inbound = headers["request-timeout-ms"].to_str().unwrap().to_owned();
                let res = client
                    .oneshot(empty_get(&format!("http://{b}/")))
                    .await
                    .unwrap();
                format!("{inbound} {}", body_text(res).await)
            }),
        )
        .layer(PropagateLayer::new());
    let a = serve(a_app).await;

    let mut req = empty_get(&format!("http://{a}/"));
    req.extensions_mut()
        .insert(Deadline::after(Duration::from_secs(2)));
    // Some of the 2 s is gone before the request leaves.
    tokio::time::sleep(Duration::from_millis(2)).await;
    let res = outbound(&retry_layer()).oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let text = body_text(res).await;
    let (a_inbound, b_left) = text.split_once(' ').unwrap();
    let a_inbound: u64 = a_inbound.parse().unwrap();
    let b_left: u64 = b_left.parse().unwrap();
    assert!(a_inbound < 2000, "{text}");
    assert!(b_left < a_inbound, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_drops_forged_convention_headers() {
    let seen = Arc::new(Mutex::new(Vec::<HeaderMap>::new()));
    let record = Arc::clone(&seen);
    let router = Router::new().route(
        "/",
        get(move |headers: HeaderMap| async move {
            record.lock().unwrap().push(headers);
            StatusCode::OK
        }),
    );
    // No floor and no share: any retry this budget is asked to pay for is refused.
    let mut config = RatioConfig::default();
    config = config.with_min_per_sec(0);
    config = config.with_retry_ratio(0.0);
    let budget = RetryBudget::ratio_with(config);
    // The edge outermost, then the budget (`Router::layer` wraps what is there).
    let app = router
        .layer(RetryBudgetLayer::new(budget).server())
        .layer(EdgeLayer::new());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });

    // An untrusted client, straight over hyper.
    let raw: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let forged = Request::get(format!("http://{addr}/"))
        .header("retry-attempt", "7")
        .header("retry-point", "caller")
        .header("request-timeout-ms", "999999")
        .header("x-kept", "yes")
        .body(Full::default())
        .unwrap();
    let res = raw.request(forged).await.unwrap();
    // Not charged to the budget as a retry.
    assert_eq!(res.status(), StatusCode::OK);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1);
    for name in ["retry-attempt", "retry-point", "request-timeout-ms"] {
        assert!(seen[0].get(name).is_none(), "{name} reached the handler");
    }
    assert_eq!(seen[0]["x-kept"], "yes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_keys_repeat_when_a_guarded_handler_runs_again() {
    // B records the keys it is sent.
    let keys = Arc::new(Mutex::new(Vec::<String>::new()));
    let record = Arc::clone(&keys);
    let b_app = Router::new().route(
        "/b",
        post(move |headers: HeaderMap| async move {
            let key = headers
                .get("idempotency-key")
                .map(|v| v.to_str().unwrap().to_owned());
            record.lock().unwrap().push(key.unwrap_or_default());
            StatusCode::CREATED
        }),
    );
    let b = serve(b_app).await;

    // A is guarded; its first run calls B, then fails without an effect.
    let runs = Arc::new(Counter::default());
    let client = outbound(&retry_layer().generate_idempotency_keys());
    let a_runs = Arc::clone(&runs);
    let a_app = Router::new()
        .route(
            "/a",
            post(
                move |ctx: Option<Extension<IdempotencyContext>>| async move {
                    assert!(ctx.is_some(), "the handler is guarded");
                    a_runs.hit();
                    let req = Request::post(format!("http://{b}/b"))
                        .body(Full::new(Bytes::from_static(b"entry")))
                        .unwrap();
                    let res = client.oneshot(req).await.unwrap();
                    assert_eq!(res.status(), StatusCode::CREATED);
                    if a_runs.get() == 1 {
                        let mut res = StatusCode::SERVICE_UNAVAILABLE.into_response();
                        res.extensions_mut().insert(NoEffect);
                        res
                    } else {
                        StatusCode::CREATED.into_response()
                    }
                },
            ),
        )
        .layer(IdempotencyLayer::in_memory())
        .layer(axum::middleware::map_request(
            |mut req: AxumRequest| async move {
                req.extensions_mut().insert(Principal::new("alice"));
                req
            },
        ));
    let a = serve(a_app).await;

    let req = Request::post(format!("http://{a}/a"))
        .header("idempotency-key", "order-1")
        .body(Full::new(Bytes::from_static(b"order")))
        .unwrap();
    let res = outbound(&retry_layer()).oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(runs.get(), 2);

    let expected = IdempotencyContext::detached(
        Scope::from(&Principal::new("alice")),
        IdempotencyKey::new("order-1").unwrap(),
        Token::random(),
    )
    .next_child_key(&format!("POST {b}/b"));
    let keys = keys.lock().unwrap();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0], keys[1]);
    assert_eq!(IdempotencyKey::parse(keys[0].as_bytes()).unwrap(), expected);
}

/// A layer counting its retries.
fn counting(layer: RetryLayer) -> (RetryLayer, Arc<Counter>) {
    let retries = Arc::new(Counter::default());
    let count = Arc::clone(&retries);
    (layer.on_retry(move |_| count.hit()), retries)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_retried_even_for_a_post() {
    // A port nobody listens on.
    let closed = {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        listener.local_addr().unwrap()
    };
    let (layer, retries) = counting(retry_layer());
    let req = Request::post(format!("http://{closed}/orders"))
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let err = outbound(&layer).oneshot(req).await.unwrap_err();
    assert_eq!(
        retrysafe_tower::retry::failure_of(&*err),
        Failure::ConnectFailed,
        "{err:?}"
    );
    // Nothing was sent, so all 3 attempts were made.
    assert_eq!(retries.get(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_closed_before_the_response_is_retried_for_a_get_only() {
    // Accepts, reads the request, and hangs up without answering.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(Counter::default());
    let count = Arc::clone(&accepted);
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            count.hit();
            let mut buf = [0u8; 4096];
            let _ = tokio::io::AsyncReadExt::read(&mut socket, &mut buf).await;
            drop(socket);
        }
    });

    let (layer, retries) = counting(retry_layer());
    let err = outbound(&layer)
        .oneshot(empty_get(&format!("http://{addr}/")))
        .await
        .unwrap_err();
    assert_eq!(
        retrysafe_tower::retry::failure_of(&*err),
        Failure::NoResponse,
        "{err:?}"
    );
    assert_eq!(retries.get(), 2);
    assert_eq!(accepted.get(), 3);

    accepted.reset();
    let (layer, retries) = counting(retry_layer());
    let req = Request::post(format!("http://{addr}/"))
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let err = outbound(&layer).oneshot(req).await.unwrap_err();
    assert_eq!(
        retrysafe_tower::retry::failure_of(&*err),
        Failure::NoResponse,
        "{err:?}"
    );
    // Maybe processed: a POST without a key is sent once.
    assert_eq!(retries.get(), 0);
    assert_eq!(accepted.get(), 1);
}
