//! Request bodies: replayed byte for byte under the cap, sent once over it.

use http::{Request, StatusCode};
use retrysafe_core::CallContext;
use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::Form;

use super::{layer, run, stack, stacked, status, with};

async fn a_body_under_the_cap_is_replayed_byte_for_byte(form: Form) {
    let body = "{\"amount\": 125, \"note\": \"ünïcödé\"}";
    let req = Request::post("http://api.local/payments")
        .header("idempotency-key", "pay-1")
        .body(body.to_owned())
        .unwrap();
    let (res, seen) = run(
        stack(form),
        req,
        vec![Ok(status(503)), Ok(status(502)), Ok(status(201))],
    )
    .await;
    res.unwrap();
    assert_eq!(seen.len(), 3);
    for s in &seen {
        assert_eq!(s.body, body.as_bytes());
    }

    // Exactly at the cap is still replayable.
    let req = Request::post("http://api.local/payments")
        .header("idempotency-key", "pay-2")
        .body("12345678".to_owned())
        .unwrap();
    let (_, seen) = run(
        stacked(form, layer().max_replay_body(8)),
        req,
        vec![Ok(status(503)), Ok(status(201))],
    )
    .await;
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].body, "12345678");
}

both_forms!(
    a_body_under_the_cap_is_replayed_byte_for_byte,
    start_paused = true
);

async fn a_body_over_the_cap_is_sent_once(form: Form) {
    let ctx = CallContext::new();
    let req = Request::post("http://api.local/payments")
        .header("idempotency-key", "pay-3")
        .body("123456789".to_owned())
        .unwrap();
    let (res, seen) = run(
        stacked(form, layer().max_replay_body(8)),
        with(req, ctx.clone()),
        vec![Ok(status(503))],
    )
    .await;
    assert_eq!(res.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body, "123456789");
    assert!(!ctx.downstream_gave_up());
    assert!(layer().max_replay_body((1 << 30) + 1).build().is_err());
}

both_forms!(a_body_over_the_cap_is_sent_once, start_paused = true);
