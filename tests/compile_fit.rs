//! Compile-fit tests: every server layer in axum's `Router::layer` and `route_layer`
//! (and answering through them), the client stack over hyper-util's client, and `Send`
//! (and `Sync` where tower needs it) of every layer, service and future — so a user's
//! stack compiles where theirs does, in a spawned task.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub
)]

use std::time::Duration;

use axum::Router;
use axum::body::Body as AxumBody;
use axum::routing::{get, post};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use retrysafe::breaker::{BreakerConfig, CircuitBreaker};
use retrysafe::idempotency::IdempotencyLayer;
use retrysafe::server::ServerLayers;
use retrysafe::{
    CircuitBreakerLayer, DeadlineLayer, EdgeLayer, PropagateLayer, ReplayBody, RetryBudget,
    RetryBudgetLayer, RetryLayer,
};
use tower::{Layer, Service, ServiceBuilder, ServiceExt};

fn is_send<T: Send>(_: &T) {}
fn is_send_sync_clone<T: Send + Sync + Clone + 'static>(_: &T) {}

/// Every server layer, with `layer` and with `route_layer`, answers through axum.
#[tokio::test]
async fn server_layers_fit_router_layer_and_route_layer() {
    let budget = RetryBudget::default();
    let handler = || async { "ok" };
    let router = Router::new()
        .route(
            "/propagate",
            get(handler).route_layer(PropagateLayer::new()),
        )
        .route(
            "/deadline",
            get(handler).route_layer(DeadlineLayer::server()),
        )
        .route(
            "/budget",
            get(handler).route_layer(RetryBudgetLayer::new(budget.clone()).server()),
        )
        .route("/edge", get(handler).route_layer(EdgeLayer::new()))
        .route(
            "/guarded",
            post(handler).route_layer(IdempotencyLayer::in_memory().global_scope().require_key()),
        )
        .route(
            "/stacked",
            post(handler).route_layer(ServerLayers::new(
                IdempotencyLayer::in_memory().global_scope(),
            )),
        )
        .layer(PropagateLayer::new())
        .layer(DeadlineLayer::server())
        .layer(RetryBudgetLayer::new(budget).server());
    // (An `EdgeLayer` at the router level would strip the convention headers of every
    // request, as it should at an edge; here it guards one route.)
    is_send_sync_clone(&router);

    let call = |req: Request<AxumBody>| {
        let router = router.clone();
        async move { router.oneshot(req).await.unwrap() }
    };
    for path in ["/propagate", "/deadline", "/budget", "/edge"] {
        let res = call(Request::get(path).body(AxumBody::empty()).unwrap()).await;
        assert_eq!(res.status(), StatusCode::OK, "{path}");
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"ok");
    }
    // The server deadline answers a malformed timeout with 400, in both positions.
    let res = call(
        Request::get("/deadline")
            .header("request-timeout-ms", "soon")
            .body(AxumBody::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    // The idempotency layer requires its key where it guards, and replays.
    let res = call(Request::post("/guarded").body(AxumBody::empty()).unwrap()).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    for expected in [None, Some("true")] {
        let res = call(
            Request::post("/guarded")
                .header("idempotency-key", "k-1")
                .body(AxumBody::empty())
                .unwrap(),
        )
        .await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(
            res.headers()
                .get("idempotent-replayed")
                .map(|v| v.to_str().unwrap()),
            expected
        );
    }
    let res = call(
        Request::post("/stacked")
            .header("idempotency-key", "k-2")
            .body(AxumBody::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(res.status(), StatusCode::OK);
}

/// The recommended client stack over hyper-util's legacy client (`ReplayBody` as its
/// body type), in a spawned task: layers, service and future are `Send`; the layers and
/// the stack are `Clone`, so one stack serves many tasks.
#[tokio::test]
async fn the_client_stack_over_hyper_is_send_and_clone() {
    let breaker = CircuitBreaker::new(BreakerConfig::default());
    let deadline = DeadlineLayer::new(Duration::from_secs(2));
    let retry = RetryLayer::new().generate_idempotency_keys();
    let budget = RetryBudgetLayer::new(RetryBudget::default());
    let breaker_layer = CircuitBreakerLayer::new(breaker);
    is_send_sync_clone(&deadline);
    is_send_sync_clone(&retry);
    is_send_sync_clone(&budget);
    is_send_sync_clone(&breaker_layer);
    is_send_sync_clone(&PropagateLayer::new());
    is_send_sync_clone(&EdgeLayer::new());
    is_send_sync_clone(&DeadlineLayer::server());
    is_send_sync_clone(&IdempotencyLayer::in_memory());

    let client: Client<HttpConnector, ReplayBody<Full<Bytes>>> =
        Client::builder(TokioExecutor::new()).build_http();
    let stack = ServiceBuilder::new()
        .layer(deadline)
        .layer(retry)
        .layer(budget)
        .layer(breaker_layer)
        .service(client);
    is_send_sync_clone(&stack);

    // Nothing listens on port 1 of loopback: the call fails, in a spawned task.
    let mut svc = stack.clone();
    let task = tokio::spawn(async move {
        let req = Request::post("http://127.0.0.1:1/x")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let future = svc.ready().await.unwrap().call(req);
        is_send(&future);
        future.await
    });
    assert!(task.await.unwrap().is_err());

    // Each layer's service on its own over a `service_fn` is `Send` and `Clone` too.
    let inner = tower::service_fn(|_: Request<ReplayBody<Full<Bytes>>>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::new())))
    });
    let mut retried = RetryLayer::new().layer(inner);
    is_send_sync_clone(&retried);
    let future = retried.call(Request::new(Full::new(Bytes::new())));
    is_send(&future);
    assert_eq!(future.await.unwrap().status(), StatusCode::OK);
}
