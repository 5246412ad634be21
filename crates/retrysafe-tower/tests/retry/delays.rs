//! Delays between attempts: exact full jitter, `retry-after` as a minimum, gRPC
//! pushback, a delay longer than the time left, and an attempt timeout under a deadline.

use std::time::Duration;

use http::StatusCode;
use retrysafe_core::backoff::{Backoff, RngSource};
use retrysafe_core::error::DeadlineExceeded;
use retrysafe_core::strategy::{GiveUp, Idempotent};
use retrysafe_core::{CallContext, Deadline};
use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::{Client, Form};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};
use tower_test::mock;

use super::{
    Req, Res, SEED, call, ceil_ms, events, expect_attempt_after, get, grpc_call, grpc_status,
    hooked, jitter_delays, layer, marked, ms, next, no_more_attempts, response, settle, stack,
    stacked, status, strategy, take, with,
};

async fn full_jitter_delays_are_exact(form: Form) {
    let [d1, d2] = jitter_delays::<2>();
    assert!(d1 <= ms(50) && d2 <= ms(100), "{d1:?} {d2:?}");
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);

    let join = call(&mut svc, get("http://api.local/items")).await;
    let (req, reply) = next(&mut handle).await;
    assert!(req.headers().get("retry-attempt").is_none());
    let t0 = Instant::now();
    reply.send_response(status(503));

    let (req, reply) = expect_attempt_after(&mut handle, t0, d1).await;
    assert_eq!(req.headers()["retry-attempt"], "2");
    let t1 = Instant::now();
    reply.send_response(status(502));

    let (req, reply) = expect_attempt_after(&mut handle, t1, d2).await;
    assert_eq!(req.headers()["retry-attempt"], "3");
    reply.send_response(status(200));

    let res = join.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(!marked(&res));
    no_more_attempts(&mut handle).await;
}

both_forms!(full_jitter_delays_are_exact, start_paused = true);

async fn retry_after_is_a_minimum_delay(form: Form) {
    // Replay the generator: a 503 with retry-after is a throttle (base 1 s).
    let mut rng = RngSource::seeded(SEED).next_rng();
    let backoff = Backoff::default();
    let b0 = backoff.delay(0, Duration::ZERO, true, &mut rng);
    assert!(b0 <= Duration::from_secs(1));
    let d1 = Duration::from_secs(2); // retry-after 2 s is longer than the backoff
    let d2 = backoff.delay(1, d1, true, &mut rng); // retry-after 0: the backoff
    assert!(d2 > Duration::ZERO);

    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let join = call(&mut svc, get("http://api.local/items")).await;
    let (_, reply) = next(&mut handle).await;
    let t0 = Instant::now();
    reply.send_response(response(503, &[("retry-after", "2")]));
    let (_, reply) = expect_attempt_after(&mut handle, t0, d1).await;
    let t1 = Instant::now();
    reply.send_response(response(503, &[("retry-after", "0")]));
    let (_, reply) = expect_attempt_after(&mut handle, t1, d2).await;
    reply.send_response(status(204));
    assert_eq!(
        join.await.unwrap().unwrap().status(),
        StatusCode::NO_CONTENT
    );
}

both_forms!(retry_after_is_a_minimum_delay, start_paused = true);

async fn grpc_pushback_is_the_exact_delay_and_negative_means_no_retry(form: Form) {
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let join = call(&mut svc, with(grpc_call(), Idempotent)).await;
    let (req, reply) = next(&mut handle).await;
    assert!(req.headers().get("grpc-previous-rpc-attempts").is_none());
    let t0 = Instant::now();
    reply.send_response(grpc_status("14", &[("grpc-retry-pushback-ms", "1234")]));

    let (req, reply) = expect_attempt_after(&mut handle, t0, ms(1234)).await;
    assert_eq!(req.headers()["retry-attempt"], "2");
    assert_eq!(req.headers()["grpc-previous-rpc-attempts"], "1");
    let t1 = Instant::now();
    reply.send_response(grpc_status("14", &[("grpc-retry-pushback-ms", "-1")]));
    settle().await;
    // Answered at once, as the server said: not retried, and not marked by us.
    assert!(join.is_finished());
    assert_eq!(Instant::now(), t1);
    let res = join.await.unwrap().unwrap();
    assert_eq!(res.headers()["grpc-status"], "14");
    assert!(!marked(&res));
    no_more_attempts(&mut handle).await;

    // A pushback of 0: at once.
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let join = call(&mut svc, with(grpc_call(), Idempotent)).await;
    let (_, reply) = next(&mut handle).await;
    let t0 = Instant::now();
    reply.send_response(grpc_status("14", &[("grpc-retry-pushback-ms", "0")]));
    let (req, reply) = next(&mut handle).await;
    assert_eq!(Instant::now(), t0);
    assert_eq!(req.headers()["grpc-previous-rpc-attempts"], "1");
    reply.send_response(grpc_status("0", &[]));
    assert_eq!(join.await.unwrap().unwrap().headers()["grpc-status"], "0");
}

both_forms!(
    grpc_pushback_is_the_exact_delay_and_negative_means_no_retry,
    start_paused = true
);

async fn a_delay_longer_than_the_time_left_gives_up_at_once(form: Form) {
    let (layer, retries, give_ups) = hooked(layer());
    let ctx = CallContext::new();
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stacked(form, layer).layer(mock);
    let req = with(
        get("http://api.local/items"),
        Deadline::after(Duration::from_secs(1)),
    );
    // The context is the task's current one while `call` runs.
    svc.ready().await.unwrap();
    let join = ctx.clone().sync_scope(|| tokio::spawn(svc.call(req)));
    let (_, reply) = next(&mut handle).await;
    let t0 = Instant::now();
    reply.send_response(response(503, &[("retry-after", "5")]));
    settle().await;
    assert!(join.is_finished());
    assert_eq!(Instant::now(), t0);
    let res = join.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(marked(&res));
    assert!(ctx.downstream_gave_up());
    assert!(retries.lock().unwrap().is_empty());
    let give_ups = events(&give_ups);
    assert_eq!(give_ups.len(), 1);
    assert_eq!(give_ups[0].reason, GiveUp::NotEnoughTime);
    assert_eq!(give_ups[0].attempts, 1);
    assert_eq!(give_ups[0].status, Some(StatusCode::SERVICE_UNAVAILABLE));
    no_more_attempts(&mut handle).await;
}

both_forms!(
    a_delay_longer_than_the_time_left_gives_up_at_once,
    start_paused = true
);

/// An attempt that never answers (a black hole) under a deadline: an explicit
/// `attempt_timeout` cuts it and leaves time for a retry; the attempt's time-left header
/// is the attempt's bound. Without one, the attempt may use the whole deadline.
async fn an_explicit_attempt_timeout_cuts_a_black_hole_under_a_deadline(form: Form) {
    let bounded = Client::new()
        .strategy(strategy().attempt_timeout(ms(200)))
        .layer(form);
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = bounded.layer(mock);
    let req = with(get("http://api.local/items"), Deadline::after(ms(1000)));
    let t0 = Instant::now();
    let join = call(&mut svc, req).await;
    let (first, _black_hole) = take(&mut handle).await;
    assert_eq!(first.header("request-timeout-ms"), Some("200"));
    let (second, reply) = take(&mut handle).await;
    // Cut at 200 ms, then the seeded backoff.
    let [delay] = jitter_delays::<1>();
    assert_eq!(second.at, t0 + ms(200) + ceil_ms(delay));
    assert_eq!(second.header("retry-attempt"), Some("2"));
    reply.send_response(status(200));
    assert_eq!(join.await.unwrap().unwrap().status(), StatusCode::OK);
    no_more_attempts(&mut handle).await;

    // The default attempt timeout does not apply under a deadline.
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let req = with(get("http://api.local/items"), Deadline::after(ms(1000)));
    let join = call(&mut svc, req).await;
    let (first, _black_hole) = take(&mut handle).await;
    assert_eq!(first.header("request-timeout-ms"), Some("1000"));
    let err = join.await.unwrap().unwrap_err();
    assert!(err.is::<DeadlineExceeded>(), "{err}");
    no_more_attempts(&mut handle).await;
}

both_forms!(
    an_explicit_attempt_timeout_cuts_a_black_hole_under_a_deadline,
    start_paused = true
);
