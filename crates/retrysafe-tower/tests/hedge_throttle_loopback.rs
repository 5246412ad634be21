//! The `HedgeLayer` and the `AdaptiveThrottleLayer` over real HTTP on loopback: axum
//! servers, hyper's client. A hedge of a slow GET reaches the server with
//! `retry-attempt: 2` and its answer wins; a POST is never hedged; a throttle in
//! front of a server that refuses keeps most calls home.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub
)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use retrysafe_core::error::find;
use retrysafe_tower::hedge::HedgeLayer;
use retrysafe_tower::retry::RetryLayer;
use retrysafe_tower::throttle::{AdaptiveThrottleLayer, Throttled};
use tower::{ServiceBuilder, ServiceExt};

type Body = Full<Bytes>;

/// Counts calls; the first is slow (300 ms), the others answer at once with their
/// `retry-attempt`.
async fn item(State(calls): State<Arc<AtomicU32>>, headers: HeaderMap) -> String {
    let n = calls.fetch_add(1, Ordering::SeqCst);
    if n == 0 {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let attempt = headers
        .get("retry-attempt")
        .map_or("1", |v| v.to_str().unwrap_or("?"));
    format!("call {n}, attempt {attempt}")
}

async fn refuse(
    State(calls): State<Arc<AtomicU32>>,
) -> (StatusCode, [(&'static str, &'static str); 1]) {
    calls.fetch_add(1, Ordering::SeqCst);
    (StatusCode::SERVICE_UNAVAILABLE, [("retry-after", "1")])
}

async fn serve(calls: &Arc<AtomicU32>) -> SocketAddr {
    let router = Router::new()
        .route("/item", get(item).post(item))
        .route("/refuse", post(refuse).get(refuse))
        .with_state(Arc::clone(calls));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

#[tokio::test]
async fn a_slow_get_is_hedged_over_http_and_a_post_is_not() {
    let calls = Arc::new(AtomicU32::new(0));
    let addr = serve(&calls).await;
    let layer = HedgeLayer::new()
        .delay(Duration::from_millis(50))
        .build()
        .unwrap();
    let client = ServiceBuilder::new()
        .layer(layer.clone())
        .layer(RetryLayer::new())
        .service(Client::builder(TokioExecutor::new()).build_http());
    let request = Request::get(format!("http://{addr}/item"))
        .body(Body::default())
        .unwrap();
    let response = client.clone().oneshot(request).await.unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "call 1, attempt 2");
    assert_eq!((layer.stats().sent, layer.stats().won), (1, 1));

    calls.store(0, Ordering::SeqCst);
    let request = Request::post(format!("http://{addr}/item"))
        .body(Body::from("{}"))
        .unwrap();
    let response = client.oneshot(request).await.unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "call 0, attempt 1", "the slow POST is waited for");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_throttle_keeps_calls_to_a_refusing_server_home() {
    let calls = Arc::new(AtomicU32::new(0));
    let addr = serve(&calls).await;
    let layer = AdaptiveThrottleLayer::new().seed(11).build().unwrap();
    let client = ServiceBuilder::new()
        .layer(layer.clone())
        .service(Client::builder(TokioExecutor::new()).build_http::<Body>());
    let mut throttled = 0;
    for _ in 0..200 {
        let request = Request::get(format!("http://{addr}/refuse"))
            .body(Body::default())
            .unwrap();
        match client.clone().oneshot(request).await {
            Ok(response) => assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE),
            Err(e) => {
                assert!(find::<Throttled>(&*e).is_some(), "{e}");
                throttled += 1;
            }
        }
    }
    assert_eq!(calls.load(Ordering::SeqCst) + throttled, 200);
    assert!(throttled > 180, "{throttled} of 200 throttled");
}

#[tokio::test]
async fn client_layers_hedge_and_throttle_over_http() {
    use retrysafe_core::budget::{BudgetSnapshot, RatioConfig, RetryBudget};
    use retrysafe_core::strategy::StandardRetryStrategy;
    use retrysafe_tower::client::ClientLayers;

    let calls = Arc::new(AtomicU32::new(0));
    let addr = serve(&calls).await;
    // No floor: the request's one deposit pays for its hedge.
    let budget = RetryBudget::ratio_with(
        RatioConfig::default()
            .with_min_per_sec(0)
            .with_retry_ratio(1.0),
    );
    let hedge = HedgeLayer::new().delay(Duration::from_millis(50));
    let throttle = AdaptiveThrottleLayer::new().seed(11);
    let layers = ClientLayers::new()
        .deadline(Duration::from_secs(5))
        // One attempt per copy: the refusing route is not retried here.
        .retry(RetryLayer::new().strategy(StandardRetryStrategy::new().max_attempts(1)))
        .budget(budget.clone())
        .throttle(throttle.clone())
        .hedge(hedge.clone())
        .build()
        .unwrap();
    let client = ServiceBuilder::new().layer(layers).service(
        Client::builder(TokioExecutor::new())
            .build_http::<retrysafe_tower::retry::ReplayBody<Body>>(),
    );

    let request = Request::get(format!("http://{addr}/item"))
        .body(Body::default())
        .unwrap();
    let response = client.clone().oneshot(request).await.unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "call 1, attempt 2");
    assert_eq!((hedge.stats().sent, hedge.stats().won), (1, 1));
    match budget.snapshot() {
        BudgetSnapshot::Ratio {
            deposits,
            withdrawals,
            ..
        } => assert_eq!((deposits, withdrawals), (1, 1)),
        other => panic!("{other:?}"),
    }

    calls.store(0, Ordering::SeqCst);
    let mut throttled = 0;
    for _ in 0..200 {
        let request = Request::get(format!("http://{addr}/refuse"))
            .body(Body::default())
            .unwrap();
        match client.clone().oneshot(request).await {
            Ok(response) => assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE),
            Err(e) => {
                assert!(find::<Throttled>(&*e).is_some(), "{e}");
                throttled += 1;
            }
        }
    }
    assert_eq!(calls.load(Ordering::SeqCst) + throttled, 200);
    assert!(throttled > 180, "{throttled} of 200 throttled");
    // The throttle counted the GET above and the 200 calls, once each.
    assert_eq!(throttle.throttle().counts().0, 201);
}
