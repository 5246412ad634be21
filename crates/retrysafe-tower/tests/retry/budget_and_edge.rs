//! The `RetryBudgetLayer` below a retry layer, alone and in its server form, and the
//! `EdgeLayer` in front of it.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use retrysafe_core::__private::RetryCharged;
use retrysafe_core::CallContext;
use retrysafe_core::error::BudgetExhausted;
use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::Form;
use retrysafe_tower::answer::GrpcStatusLayer;
use retrysafe_tower::budget::RetryBudgetLayer;
use retrysafe_tower::edge::EdgeLayer;
use retrysafe_tower::retry::RetryLayer;
use tower::{Layer, Service, ServiceExt};
use tower_test::mock;

use super::{
    Req, Res, answer, call, client, get, grpc_call, layer, marked, no_more_attempts, ratio,
    ratio_counts, status, strategy, with,
};

async fn the_budget_layer_skips_attempts_the_retry_layer_charged(form: Form) {
    // One budget shared by the RetryLayer and the RetryBudgetLayer below it (given
    // once to ClientLayers): still
    // exactly one deposit for the logical request and one withdrawal for the retry.
    let budget = ratio(0, 1.0);
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = client().budget(budget.clone()).layer(form).layer(mock);
    let join = call(&mut svc, get("http://api.local/x")).await;
    let seen = answer(&mut handle, vec![Ok(status(503)), Ok(status(200))]).await;
    assert_eq!(join.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(seen[1].header("retry-attempt"), Some("2"));
    assert_eq!(ratio_counts(&budget), (1, 1));
}

both_forms!(
    the_budget_layer_skips_attempts_the_retry_layer_charged,
    start_paused = true
);

#[tokio::test(start_paused = true)]
async fn a_buffer_between_the_retry_and_budget_layers_keeps_one_deposit_per_request() {
    // The "already counted" mark travels in the request's extensions, so a `Buffer`
    // (which calls the layers below on another task) keeps it: one deposit per logical
    // request and one withdrawal per retry, however many attempts pass the budget layer.
    let budget = ratio(0, 1.0);
    let calls = Arc::new(Mutex::new(0u32));
    let count = calls.clone();
    // Fails every first attempt with 503, then succeeds.
    let flaky = tower::service_fn(move |req: Req| {
        let retry = req.headers().contains_key("retry-attempt");
        *count.lock().unwrap() += 1;
        async move { Ok::<_, Infallible>(if retry { status(200) } else { status(503) }) }
    });
    let below = tower::ServiceBuilder::new()
        .layer(RetryBudgetLayer::new(budget.clone()))
        .service(flaky);
    let buffered = tower::buffer::Buffer::new(below, 8);
    let mut svc = RetryLayer::new()
        .strategy(strategy().budget(budget.clone()))
        .layer(buffered);
    for n in 1..=3u64 {
        let response = svc
            .ready()
            .await
            .unwrap()
            .call(get("http://api.local/x"))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(ratio_counts(&budget), (n, n));
    }
    assert_eq!(*calls.lock().unwrap(), 6);
}

#[tokio::test(start_paused = true)]
async fn without_a_budget_above_the_budget_layer_counts_every_attempt() {
    // The RetryLayer has no budget, so it marks nothing: the RetryBudgetLayer deposits
    // for the first attempt and withdraws for the retry (`retry-attempt: 2`).
    let budget = ratio(0, 1.0);
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = tower::ServiceBuilder::new()
        .layer(RetryLayer::new().strategy(strategy().no_budget()))
        .layer(RetryBudgetLayer::new(budget.clone()))
        .service(mock);
    let join = call(&mut svc, get("http://api.local/x")).await;
    let seen = answer(&mut handle, vec![Ok(status(503)), Ok(status(200))]).await;
    assert_eq!(join.await.unwrap().unwrap().status(), StatusCode::OK);
    assert!(seen[1].parts.extensions.get::<RetryCharged>().is_none());
    assert_eq!(ratio_counts(&budget), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn the_budget_layer_charges_foreign_retries() {
    let budget = ratio(0, 0.5);
    let (mock, mut handle) = mock::pair::<Request<String>, Response<String>>();
    let mut svc = RetryBudgetLayer::new(budget.clone()).layer(mock);
    let retry = || {
        Request::get("http://api.local/x")
            .header("retry-attempt", "2")
            .body(String::new())
            .unwrap()
    };

    // Nothing deposited yet: a marked retry is refused without reaching the service.
    let err = svc.ready().await.unwrap().call(retry()).await.unwrap_err();
    assert!(err.is::<BudgetExhausted>());
    assert_eq!(ratio_counts(&budget), (0, 0));

    // Two first attempts deposit; half of them may be retried.
    for _ in 0..2 {
        let fut = svc.ready().await.unwrap().call(get("http://api.local/x"));
        let (_, reply) = handle.next_request().await.unwrap();
        reply.send_response(status(200));
        fut.await.unwrap();
    }
    assert_eq!(ratio_counts(&budget), (2, 0));
    let fut = svc.ready().await.unwrap().call(retry());
    let (_, reply) = handle.next_request().await.unwrap();
    reply.send_response(status(200));
    fut.await.unwrap();
    assert_eq!(ratio_counts(&budget), (2, 1));
    let err = svc.ready().await.unwrap().call(retry()).await.unwrap_err();
    assert!(err.is::<BudgetExhausted>());
    assert_eq!(ratio_counts(&budget), (2, 1));

    // `retry-attempt: 1` is a first attempt; a RetryCharged extension is skipped.
    let first = Request::get("http://api.local/x")
        .header("retry-attempt", "1")
        .body(String::new())
        .unwrap();
    let fut = svc.ready().await.unwrap().call(first);
    let (_, reply) = handle.next_request().await.unwrap();
    reply.send_response(status(200));
    fut.await.unwrap();
    assert_eq!(ratio_counts(&budget), (3, 1));
    let charged = with(retry(), RetryCharged::new(2, budget.id()));
    let fut = svc.ready().await.unwrap().call(charged);
    let (_, reply) = handle.next_request().await.unwrap();
    reply.send_response(status(200));
    fut.await.unwrap();
    assert_eq!(ratio_counts(&budget), (3, 1));
    // Charged to another budget: this one still counts it.
    let other = ratio(0, 0.0);
    let charged_elsewhere = with(retry(), RetryCharged::new(2, other.id()));
    // (3 deposits at 50 % afford one retry, already taken: refused, not skipped.)
    let err = svc
        .ready()
        .await
        .unwrap()
        .call(charged_elsewhere)
        .await
        .unwrap_err();
    assert!(err.is::<BudgetExhausted>());
    assert_eq!(ratio_counts(&budget), (3, 1));

    // Under a GrpcStatusLayer, a refused gRPC retry is UNAVAILABLE.
    let (mock, _handle) = mock::pair::<Request<String>, Response<String>>();
    let mut svc = GrpcStatusLayer::new().layer(RetryBudgetLayer::new(ratio(0, 0.0)).layer(mock));
    let mut req = grpc_call();
    req.headers_mut()
        .insert("retry-attempt", "3".parse().unwrap());
    let res = svc.ready().await.unwrap().call(req).await.unwrap();
    assert_eq!(res.headers()["grpc-status"], "14");
    assert!(marked(&res));
}

async fn problem_body<B>(res: Response<B>) -> serde_json::Value
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap()
}

/// Answers every request with the `retry-attempt` header it saw (or `none`).
#[derive(Clone, Copy)]
struct Echo;

impl Service<Request<Full<Bytes>>> for Echo {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Full<Bytes>>) -> Self::Future {
        let seen = req
            .headers()
            .get("retry-attempt")
            .map_or("none".to_owned(), |v| v.to_str().unwrap().to_owned());
        std::future::ready(Ok(Response::new(Full::new(Bytes::from(seen)))))
    }
}

fn raw(uri: &str, headers: &[(&'static str, &str)]) -> Request<Full<Bytes>> {
    let mut b = Request::get(uri);
    for (name, value) in headers {
        b = b.header(*name, *value);
    }
    b.body(Full::new(Bytes::new())).unwrap()
}

#[tokio::test(start_paused = true)]
async fn the_server_budget_layer_answers_503_problems_with_do_not_retry() {
    let budget = ratio(0, 0.0);
    let svc = RetryBudgetLayer::new(budget.clone()).server().layer(Echo);
    let res = svc
        .clone()
        .oneshot(raw("http://api.local/x", &[("retry-attempt", "2")]))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    assert!(res.headers().get("do-not-retry").is_some_and(|v| v == "1"));
    let problem = problem_body(res).await;
    assert_eq!(
        problem["type"],
        "urn:retrysafe:problem:retry-budget-exhausted"
    );
    assert_eq!(problem["status"], 503);

    // A first attempt passes (and deposits).
    let res = svc
        .clone()
        .oneshot(raw("http://api.local/x", &[]))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(ratio_counts(&budget), (1, 0));

    // gRPC on the server path: UNAVAILABLE.
    let res = svc
        .oneshot(raw(
            "http://api.local/pkg.S/M",
            &[("content-type", "application/grpc"), ("retry-attempt", "2")],
        ))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["grpc-status"], "14");
    assert!(res.headers().get("do-not-retry").is_some_and(|v| v == "1"));
}

#[tokio::test(start_paused = true)]
async fn the_edge_layer_strips_a_forged_retry_attempt_before_the_budget() {
    let budget = ratio(0, 0.0);
    let behind_edge = tower::ServiceBuilder::new()
        .layer(EdgeLayer::new())
        .layer(RetryBudgetLayer::new(budget.clone()).server())
        .service(Echo);
    let forged = || {
        raw(
            "http://api.local/x",
            &[("retry-attempt", "5"), ("retry-point", "caller")],
        )
    };
    let res = behind_edge.oneshot(forged()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // The handler never saw it, and the budget counted a first attempt.
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "none");
    assert_eq!(ratio_counts(&budget), (1, 0));

    // Without the edge, the same forged header is charged (and refused).
    let exposed = RetryBudgetLayer::new(budget.clone()).server().layer(Echo);
    let res = exposed.oneshot(forged()).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(ratio_counts(&budget), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_budget_layer_with_its_own_budget_counts_a_retry_layers_attempts() {
    // `RetryLayer::new()` keeps a private ratio budget; a shared budget below it is
    // another budget, so it still sees one deposit and one withdrawal per retry.
    let shared = ratio(0, 1.0);
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = tower::ServiceBuilder::new()
        .layer(layer())
        .layer(RetryBudgetLayer::new(shared.clone()))
        .service(mock);
    let join = call(&mut svc, get("http://api.local/x")).await;
    let seen = answer(&mut handle, vec![Ok(status(503)), Ok(status(200))]).await;
    assert_eq!(join.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(seen.len(), 2);
    assert_eq!(ratio_counts(&shared), (1, 1));

    // A shared budget that affords no retry stops the RetryLayer's retries.
    let strict = ratio(0, 0.0);
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = tower::ServiceBuilder::new()
        .layer(layer())
        .layer(RetryBudgetLayer::new(strict.clone()))
        .service(mock);
    let ctx = CallContext::new();
    let join = call(&mut svc, with(get("http://api.local/x"), ctx.clone())).await;
    let seen = answer(&mut handle, vec![Ok(status(503))]).await;
    // The refused retry never reaches the service; the caller gets the last real
    // response, marked, and the context records that downstream gave up.
    let res = join.await.unwrap().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(marked(&res));
    assert!(ctx.downstream_gave_up());
    no_more_attempts(&mut handle).await;
}
