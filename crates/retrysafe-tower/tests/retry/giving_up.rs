//! Giving up: the last response marked, a budget refusal, `do-not-retry` and replayed
//! answers, a synthesised refusal after a real response, and the context marked.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use retrysafe_core::CallContext;
use retrysafe_core::budget::RetryBudget;
use retrysafe_core::classify::FaultSide;
use retrysafe_core::strategy::{GiveUp, Idempotent, StandardRetryStrategy};
use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::{Client, Form};
use retrysafe_tower::retry::{GiveUpEvent, ReplayBody, RetryLayer};
use tower::{Layer, ServiceExt};

use super::{
    ceil_ms, client, events, get, grpc_statuses, hooked, jitter_delays, layer, marked, ratio,
    ratio_counts, response, run, stack, stacked, status, with,
};

async fn giving_up_after_the_last_attempt_marks_the_last_response(form: Form) {
    let [d1, d2] = jitter_delays::<2>();
    let (layer, retries, give_ups) = hooked(layer());
    let ctx = CallContext::new();
    let replies = vec![
        Ok(response(503, &[("x-n", "1")])),
        Ok(response(502, &[("x-n", "2")])),
        Ok(response(503, &[("x-n", "3")])),
    ];
    let (res, seen) = ctx
        .clone()
        .scope(run(
            stacked(form, layer),
            get("http://api.local/x"),
            replies,
        ))
        .await;
    let res = res.unwrap();
    assert_eq!(seen.len(), 3);
    assert_eq!(res.headers()["x-n"], "3");
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.body().get_ref(), "status 503");
    assert!(marked(&res));
    assert!(ctx.downstream_gave_up());

    let retries = events(&retries);
    assert_eq!(retries.len(), 2);
    assert_eq!((retries[0].attempt, retries[0].delay), (2, d1));
    assert_eq!(retries[0].status, Some(StatusCode::SERVICE_UNAVAILABLE));
    assert_eq!((retries[1].attempt, retries[1].delay), (3, d2));
    assert_eq!(retries[1].status, Some(StatusCode::BAD_GATEWAY));
    assert_eq!(retries[1].classification.fault, Some(FaultSide::Server));
    let give_ups = events(&give_ups);
    assert_eq!(give_ups.len(), 1);
    assert_eq!(give_ups[0].attempts, 3);
    assert_eq!(give_ups[0].reason, GiveUp::AttemptsExhausted);
    assert_eq!(give_ups[0].status, Some(StatusCode::SERVICE_UNAVAILABLE));
    // The attempts came when the hooks said.
    assert_eq!(seen[1].at - seen[0].at, ceil_ms(d1));
}

both_forms!(
    giving_up_after_the_last_attempt_marks_the_last_response,
    start_paused = true
);

async fn a_budget_refusal_on_the_first_retry_marks_the_response(form: Form) {
    let budget = ratio(0, 0.0);
    let (layer, retries, give_ups) = hooked(RetryLayer::new());
    let layer = client().retry(layer).budget(budget.clone()).layer(form);
    let ctx = CallContext::new();
    let req = with(get("http://api.local/x"), ctx.clone());
    let (res, seen) = run(layer, req, vec![Ok(status(503))]).await;
    let res = res.unwrap();
    assert_eq!(seen.len(), 1);
    assert!(marked(&res));
    assert!(ctx.downstream_gave_up());
    assert!(retries.lock().unwrap().is_empty());
    assert_eq!(give_ups.lock().unwrap()[0].reason, GiveUp::BudgetExhausted);
    assert_eq!(give_ups.lock().unwrap()[0].attempts, 1);
    // One deposit for the request, no withdrawal.
    assert_eq!(ratio_counts(&budget), (1, 0));

    // A per-request budget (extension) replaces the stack's in the retry's charges;
    // the stack's budget still counts the request as another budget's.
    let generous = RetryBudget::token_bucket();
    let shared = ratio(0, 1.0);
    let req = with(get("http://api.local/x"), generous.clone());
    let (res, seen) = run(
        client().budget(shared.clone()).layer(form),
        req,
        vec![Ok(status(503)), Ok(status(200))],
    )
    .await;
    res.unwrap();
    assert_eq!(seen.len(), 2);
    // The retry's cost, then refunded by its success.
    assert_eq!(generous.available_retries(), 100);
    assert_eq!(ratio_counts(&shared), (1, 1));

    // So a stack's budget that affords no retry refuses it all the same: below the
    // retry, after a real response.
    let (layer, retries, give_ups) = hooked(RetryLayer::new());
    let ctx = CallContext::new();
    let req = with(
        with(get("http://api.local/x"), generous.clone()),
        ctx.clone(),
    );
    let (res, seen) = run(
        client().retry(layer).budget(budget.clone()).layer(form),
        req,
        vec![Ok(status(503))],
    )
    .await;
    let res = res.unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(marked(&res));
    assert!(ctx.downstream_gave_up());
    assert_eq!(retries.lock().unwrap().len(), 1);
    assert_eq!(give_ups.lock().unwrap()[0].reason, GiveUp::RefusedBelow);
    assert_eq!(ratio_counts(&budget), (2, 0));
}

both_forms!(
    a_budget_refusal_on_the_first_retry_marks_the_response,
    start_paused = true
);

async fn a_do_not_retry_reply_is_not_retried_and_recorded(form: Form) {
    let (layer, retries, give_ups) = hooked(layer());
    let ctx = CallContext::new();
    let req = with(get("http://api.local/x"), ctx.clone());
    let (res, seen) = run(
        stacked(form, layer),
        req,
        vec![Ok(response(503, &[("do-not-retry", "1")]))],
    )
    .await;
    let res = res.unwrap();
    assert_eq!(seen.len(), 1);
    assert!(marked(&res));
    assert!(ctx.downstream_gave_up());
    assert!(retries.lock().unwrap().is_empty());
    // Not this layer's give-up: the reply was final already.
    assert!(give_ups.lock().unwrap().is_empty());

    // `do-not-retry: 0` is no mark.
    let ctx = CallContext::new();
    let req = with(get("http://api.local/x"), ctx.clone());
    let (_, seen) = run(
        stack(form),
        req,
        vec![Ok(response(503, &[("do-not-retry", "0")])), Ok(status(200))],
    )
    .await;
    assert_eq!(seen.len(), 2);
    assert!(!ctx.downstream_gave_up());
}

both_forms!(
    a_do_not_retry_reply_is_not_retried_and_recorded,
    start_paused = true
);

async fn a_replayed_response_is_not_retried(form: Form) {
    for code in [503, 409, 429] {
        let req = Request::post("http://api.local/orders")
            .header("idempotency-key", "k-1")
            .body("x".to_owned())
            .unwrap();
        let replayed = response(
            code,
            &[("idempotent-replayed", "true"), ("retry-after", "1")],
        );
        let (res, seen) = run(stack(form), req, vec![Ok(replayed)]).await;
        assert_eq!(res.unwrap().status().as_u16(), code);
        assert_eq!(seen.len(), 1, "{code}");
    }
    // Without the mark, the keyed 409 "in flight" is retried after retry-after.
    let req = Request::post("http://api.local/orders")
        .header("idempotency-key", "k-1")
        .body("x".to_owned())
        .unwrap();
    let (res, seen) = run(
        stack(form),
        req,
        vec![Ok(response(409, &[("retry-after", "1")])), Ok(status(201))],
    )
    .await;
    res.unwrap();
    assert_eq!(seen.len(), 2);
    assert!(seen[1].at - seen[0].at >= Duration::from_secs(1));
}

both_forms!(a_replayed_response_is_not_retried, start_paused = true);

/// A layer below that refuses after a real response: the retry layer gives up with that
/// real response, marked — also under the `GrpcStatusLayer` of a gRPC stack, which
/// synthesises statuses only for refusals that reach it.
async fn a_synthesised_refusal_below_after_a_real_response_gives_up_with_the_real_one(form: Form) {
    use retrysafe_core::breaker::{BreakerConfig, CircuitBreaker};
    use retrysafe_tower::breaker::CircuitBreakerLayer;

    fn unavailable() -> Response<String> {
        Response::builder()
            .header("content-type", "application/grpc")
            .header("grpc-status", "14")
            .header("grpc-message", "real")
            .body(String::new())
            .unwrap()
    }
    for synthesised in [false, true] {
        let mut config = BreakerConfig::default();
        config = config.with_minimum_calls(1); // the first failure opens it
        let breaker = CircuitBreaker::new(config);
        let calls = Arc::new(Mutex::new(0u32));
        let count = Arc::clone(&calls);
        let inner = tower::service_fn(move |_r: Request<ReplayBody<String>>| {
            *count.lock().unwrap() += 1;
            async move { Ok::<_, Infallible>(unavailable()) }
        });
        let gave_up = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&gave_up);
        let retry = RetryLayer::new()
            .on_give_up(move |e: &GiveUpEvent| seen.lock().unwrap().push(e.reason));
        let stack = Client::new()
            .strategy(StandardRetryStrategy::new().seed(1))
            .retry(retry)
            .breaker(CircuitBreakerLayer::new(breaker))
            .layer(form);
        let mut req = Request::post("http://svc/pkg.Svc/Get")
            .header("content-type", "application/grpc")
            .body(String::new())
            .unwrap();
        req.extensions_mut().insert(Idempotent);
        let res = if synthesised {
            grpc_statuses(stack)
                .service(inner)
                .oneshot(req)
                .await
                .unwrap()
        } else {
            stack.layer(inner).oneshot(req).await.unwrap()
        };
        assert_eq!(*calls.lock().unwrap(), 1, "synthesised: {synthesised}");
        assert_eq!(
            res.headers()["grpc-message"],
            "real",
            "synthesised: {synthesised}"
        );
        assert_eq!(res.headers()["do-not-retry"], "1");
        assert_eq!(*gave_up.lock().unwrap(), vec![GiveUp::RefusedBelow]);
    }
}

both_forms!(
    a_synthesised_refusal_below_after_a_real_response_gives_up_with_the_real_one,
    start_paused = true
);

/// Retried, then a failure that is not retryable: the layer gave up all the same, so
/// the inherited context records it (the server above marks its own failure).
async fn a_final_failure_after_retries_marks_the_context(form: Form) {
    for (second, marked) in [(500, true), (404, false)] {
        let answers = Arc::new(Mutex::new(vec![503u16, second]));
        let inner = tower::service_fn(move |_r: Request<ReplayBody<String>>| {
            let code = answers.lock().unwrap().remove(0);
            async move {
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(code)
                        .body(String::new())
                        .unwrap(),
                )
            }
        });
        let svc = Client::new()
            .strategy(StandardRetryStrategy::new().seed(1))
            .layer(form)
            .layer(inner);
        let ctx = CallContext::new();
        let res = ctx
            .clone()
            .scope(svc.oneshot(Request::get("http://api/x").body(String::new()).unwrap()))
            .await
            .unwrap();
        assert_eq!(res.status().as_u16(), second);
        assert!(res.headers().get("do-not-retry").is_none());
        assert_eq!(ctx.downstream_gave_up(), marked, "{second}");
    }
}

both_forms!(
    a_final_failure_after_retries_marks_the_context,
    start_paused = true
);
