//! The timeout headers of each attempt (`request-timeout-ms`, `grpc-timeout`): rewritten
//! from the time left, rounded down, and honoured when set by the caller or inherited.

use std::time::Duration;

use http::{Request, StatusCode};
use retrysafe_core::classify::FaultSide;
use retrysafe_core::strategy::Idempotent;
use retrysafe_core::wire::encode_grpc_timeout;
use retrysafe_core::{CallContext, Deadline};
use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::Form;
use tokio::time::Instant;
use tower::Layer;
use tower_test::mock;

use super::{
    Req, Res, call, ceil_ms, events, expect_attempt_after, get, grpc_call, grpc_status, hooked,
    jitter_delays, layer, ms, next, run, stack, stacked, status, with,
};

async fn the_deadline_header_is_rewritten_on_every_attempt_rounded_down(form: Form) {
    let [d1, d2] = jitter_delays::<2>();
    let budget = Duration::from_micros(1_000_500); // 1000.5 ms
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let join = call(
        &mut svc,
        with(get("http://api.local/items"), Deadline::after(budget)),
    )
    .await;
    let start = Instant::now();
    let (req, reply) = next(&mut handle).await;
    assert_eq!(req.headers()["request-timeout-ms"], "1000");
    assert!(req.headers().get("grpc-timeout").is_none());
    reply.send_response(status(503));
    let (req, reply) = expect_attempt_after(&mut handle, start, d1).await;
    let left = budget - (Instant::now() - start);
    assert_eq!(
        req.headers()["request-timeout-ms"],
        left.as_millis().to_string()
    );
    let t1 = Instant::now();
    reply.send_response(status(503));
    let (req, reply) = expect_attempt_after(&mut handle, t1, d2).await;
    let left = budget - (Instant::now() - start);
    assert_eq!(
        req.headers()["request-timeout-ms"],
        left.as_millis().to_string()
    );
    reply.send_response(status(200));
    join.await.unwrap().unwrap();
}

both_forms!(
    the_deadline_header_is_rewritten_on_every_attempt_rounded_down,
    start_paused = true
);

async fn grpc_timeout_is_rewritten_on_every_attempt_rounded_down(form: Form) {
    let [d1] = jitter_delays::<1>();
    let budget = Duration::from_micros(1_000_500);
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let req = with(with(grpc_call(), Idempotent), Deadline::after(budget));
    let join = call(&mut svc, req).await;
    let start = Instant::now();
    let (req, reply) = next(&mut handle).await;
    assert_eq!(req.headers()["grpc-timeout"], "1000500u");
    assert!(req.headers().get("request-timeout-ms").is_none());
    reply.send_response(grpc_status("14", &[]));
    let (req, reply) = expect_attempt_after(&mut handle, start, d1).await;
    let left = budget - (Instant::now() - start);
    assert_eq!(req.headers()["grpc-timeout"], encode_grpc_timeout(left));
    let sent = retrysafe_core::wire::parse_grpc_timeout(req.headers()["grpc-timeout"].as_bytes());
    assert!(sent.unwrap() <= left);
    reply.send_response(grpc_status("0", &[]));
    join.await.unwrap().unwrap();
}

both_forms!(
    grpc_timeout_is_rewritten_on_every_attempt_rounded_down,
    start_paused = true
);

async fn a_timeout_header_set_by_the_caller_or_an_inherited_deadline_is_honoured(form: Form) {
    let [d1] = jitter_delays::<1>();
    // A header the caller set, with no Deadline extension.
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let req = Request::get("http://api.local/items")
        .header("request-timeout-ms", "300")
        .body(String::new())
        .unwrap();
    let join = call(&mut svc, req).await;
    let start = Instant::now();
    let (req, reply) = next(&mut handle).await;
    assert_eq!(req.headers()["request-timeout-ms"], "300");
    reply.send_response(status(503));
    let (req, reply) = expect_attempt_after(&mut handle, start, d1).await;
    let left = ms(300) - ceil_ms(d1);
    assert_eq!(
        req.headers()["request-timeout-ms"],
        left.as_millis().to_string()
    );
    reply.send_response(status(200));
    join.await.unwrap().unwrap();

    // The inherited context's deadline, tightened by a sooner request deadline.
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let ctx = CallContext::new().with_deadline(Deadline::after(ms(800)));
    let join = ctx
        .clone()
        .scope(call(&mut svc, get("http://api.local/a")))
        .await;
    let (req, reply) = next(&mut handle).await;
    assert_eq!(req.headers()["request-timeout-ms"], "800");
    reply.send_response(status(200));
    join.await.unwrap().unwrap();
    let req = with(
        with(get("http://api.local/b"), ctx),
        Deadline::after(ms(250)),
    );
    let join = call(&mut svc, req).await;
    let (req, reply) = next(&mut handle).await;
    assert_eq!(req.headers()["request-timeout-ms"], "250");
    reply.send_response(status(200));
    join.await.unwrap().unwrap();
}

both_forms!(
    a_timeout_header_set_by_the_caller_or_an_inherited_deadline_is_honoured,
    start_paused = true
);

async fn a_504_long_before_the_deadline_is_the_callees_own_timeout(form: Form) {
    // The deadline sent was 5 s and the 504 came at once: not the caller's deadline at
    // work (that is a 504 as the deadline runs out), the callee's fault. Retried either
    // way.
    let (layer, retries, _) = hooked(layer());
    let req = with(
        get("http://api.local/items"),
        Deadline::after(Duration::from_secs(5)),
    );
    let (res, seen) = run(
        stacked(form, layer),
        req,
        vec![Ok(status(504)), Ok(status(200))],
    )
    .await;
    assert_eq!(res.unwrap().status(), StatusCode::OK);
    assert_eq!(seen.len(), 2);
    let retries = events(&retries);
    assert_eq!(retries[0].classification.fault, Some(FaultSide::Server));
    assert!(retries[0].classification.timeout);

    // Without a deadline, the callee's own fault.
    let (layer, retries, _) = hooked(self::layer());
    let (res, _) = run(
        stacked(form, layer),
        get("http://api.local/items"),
        vec![Ok(status(504)), Ok(status(200))],
    )
    .await;
    res.unwrap();
    assert_eq!(
        retries.lock().unwrap()[0].classification.fault,
        Some(FaultSide::Server)
    );
}

both_forms!(
    a_504_long_before_the_deadline_is_the_callees_own_timeout,
    start_paused = true
);
