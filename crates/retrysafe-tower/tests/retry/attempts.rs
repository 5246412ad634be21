//! Attempt headers and safe requests: numbered attempts, the budget's mark, what is
//! retried without a key, the request's own `NoRetry` and `Idempotent`, and a custom
//! convention.

use std::io;

use http::{HeaderName, StatusCode};
use retrysafe_core::__private::RetryCharged;
use retrysafe_core::error::find;
use retrysafe_core::strategy::{Idempotent, NoRetry};
use retrysafe_core::wire::Convention;
use retrysafe_core::{CallContext, Deadline};
use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::Form;

use super::{
    Seen, get, grpc_call, grpc_status, io_error, layer, marked, ms, post, response, run, stack,
    stacked, status, with,
};

#[tokio::test(start_paused = true)]
async fn every_attempt_of_a_budgeted_request_is_tagged() {
    let (_, seen) = run(
        layer(),
        with(grpc_call(), Idempotent),
        vec![
            Ok(grpc_status("14", &[])),
            Ok(grpc_status("14", &[])),
            Ok(grpc_status("0", &[])),
        ],
    )
    .await;
    let charged = |s: &Seen| s.parts.extensions.get::<RetryCharged>().map(|c| c.attempt);
    // The first included: a budget layer below skips them all.
    assert_eq!(
        seen.iter().map(charged).collect::<Vec<_>>(),
        [Some(1), Some(2), Some(3)]
    );
}

async fn attempts_two_and_later_are_numbered(form: Form) {
    let (res, seen) = run(
        stack(form),
        with(grpc_call(), Idempotent),
        vec![
            Ok(grpc_status("14", &[])),
            Ok(grpc_status("14", &[])),
            Ok(grpc_status("0", &[])),
        ],
    )
    .await;
    assert_eq!(res.unwrap().headers()["grpc-status"], "0");
    let attempt = |s: &Seen| s.header("retry-attempt").map(str::to_owned);
    let previous = |s: &Seen| s.header("grpc-previous-rpc-attempts").map(str::to_owned);
    assert_eq!(
        seen.iter().map(attempt).collect::<Vec<_>>(),
        [None, Some("2".to_owned()), Some("3".to_owned())]
    );
    assert_eq!(
        seen.iter().map(previous).collect::<Vec<_>>(),
        [None, Some("1".to_owned()), Some("2".to_owned())]
    );

    // Plain HTTP: no grpc-previous-rpc-attempts.
    let (_, seen) = run(
        stack(form),
        get("http://api.local/x"),
        vec![Ok(status(503)), Ok(status(200))],
    )
    .await;
    assert_eq!(seen[1].header("retry-attempt"), Some("2"));
    assert_eq!(seen[1].header("grpc-previous-rpc-attempts"), None);
}

both_forms!(attempts_two_and_later_are_numbered, start_paused = true);

async fn a_post_without_a_key_is_sent_once_unless_nothing_was_sent(form: Form) {
    let ctx = CallContext::new();
    let req = with(post("http://api.local/orders", "{}"), ctx.clone());
    let (res, seen) = run(stack(form), req, vec![Ok(status(503))]).await;
    let res = res.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.len(), 1);
    // Not a give-up: nothing retryable was refused, so nothing is marked.
    assert!(!marked(&res));
    assert!(!ctx.downstream_gave_up());

    // A failed connect: nothing was sent, so even a POST is retried.
    let (res, seen) = run(
        stack(form),
        post("http://api.local/orders", "{\"n\":1}"),
        vec![io_error(io::ErrorKind::ConnectionRefused), Ok(status(201))],
    )
    .await;
    assert_eq!(res.unwrap().status(), StatusCode::CREATED);
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].body, "{\"n\":1}");

    // A reset after sending: maybe processed, so not retried; the error comes back.
    let (res, seen) = run(
        stack(form),
        post("http://api.local/orders", "{}"),
        vec![io_error(io::ErrorKind::ConnectionReset)],
    )
    .await;
    let err = res.unwrap_err();
    assert_eq!(
        find::<io::Error>(&*err).unwrap().kind(),
        io::ErrorKind::ConnectionReset
    );
    assert_eq!(seen.len(), 1);

    // The same reset on a GET is retried.
    let (res, seen) = run(
        stack(form),
        get("http://api.local/orders"),
        vec![io_error(io::ErrorKind::ConnectionReset), Ok(status(200))],
    )
    .await;
    res.unwrap();
    assert_eq!(seen.len(), 2);
}

both_forms!(
    a_post_without_a_key_is_sent_once_unless_nothing_was_sent,
    start_paused = true
);

async fn no_retry_and_idempotent_extensions_and_idempotent_if(form: Form) {
    let ctx = CallContext::new();
    let req = with(with(get("http://api.local/x"), NoRetry), ctx.clone());
    let (res, seen) = run(stack(form), req, vec![Ok(status(503))]).await;
    let res = res.unwrap();
    assert_eq!(seen.len(), 1);
    assert!(!marked(&res));
    assert!(!ctx.downstream_gave_up());

    // NoRetry also keeps a POST from getting a generated key.
    let req = with(post("http://api.local/x", "b"), NoRetry);
    let (_, seen) = run(
        stacked(form, layer().generate_idempotency_keys()),
        req,
        vec![Ok(status(503))],
    )
    .await;
    assert_eq!(seen[0].header("idempotency-key"), None);

    let req = with(post("http://api.local/x", "b"), Idempotent);
    let (res, seen) = run(stack(form), req, vec![Ok(status(503)), Ok(status(200))]).await;
    res.unwrap();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].body, "b");

    let read_only = stacked(
        form,
        layer().idempotent_if(|parts| parts.uri.path().starts_with("/query")),
    );
    let (_, seen) = run(
        read_only.clone(),
        post("http://api.local/query/items", "q"),
        vec![Ok(status(503)), Ok(status(200))],
    )
    .await;
    assert_eq!(seen.len(), 2);
    let (_, seen) = run(
        read_only,
        post("http://api.local/orders", "q"),
        vec![Ok(status(503))],
    )
    .await;
    assert_eq!(seen.len(), 1);
}

both_forms!(
    no_retry_and_idempotent_extensions_and_idempotent_if,
    start_paused = true
);

async fn a_custom_convention_renames_every_header(form: Form) {
    let convention = Convention::default()
        .with_request_timeout_ms(HeaderName::from_static("x-envoy-expected-rq-timeout-ms"))
        .with_retry_attempt(HeaderName::from_static("x-attempt"))
        .with_do_not_retry(HeaderName::from_static("x-final"))
        .with_idempotency_key(HeaderName::from_static("x-key"))
        .with_retry_point(HeaderName::from_static("x-retry-point"));
    let ctx = CallContext::new();
    let req = with(
        with(
            post("http://api.local/orders", "x"),
            Deadline::after(ms(900)),
        ),
        ctx.clone(),
    );
    let (res, seen) = run(
        stacked(
            form,
            layer()
                .convention(convention)
                .generate_idempotency_keys()
                .retry_point(),
        ),
        req,
        vec![Ok(status(503)), Ok(status(503)), Ok(status(503))],
    )
    .await;
    let res = res.unwrap();
    assert_eq!(seen.len(), 3);
    for (n, s) in seen.iter().enumerate() {
        assert!(s.header("x-envoy-expected-rq-timeout-ms").is_some());
        assert!(s.header("request-timeout-ms").is_none());
        assert!(s.header("x-key").is_some());
        assert!(s.header("idempotency-key").is_none());
        assert_eq!(s.header("x-retry-point"), Some("caller"));
        let attempt = (n > 0).then(|| (n + 1).to_string());
        assert_eq!(s.header("x-attempt").map(str::to_owned), attempt);
        assert!(s.header("retry-attempt").is_none());
    }
    assert_eq!(res.headers()["x-final"], "1");
    assert!(res.headers().get("do-not-retry").is_none());
    assert!(ctx.downstream_gave_up());

    // A renamed mark from below stops the retries; the default name is just a header.
    let convention = Convention::default().with_do_not_retry(HeaderName::from_static("x-final"));
    let (_, seen) = run(
        stacked(form, layer().convention(convention.clone())),
        get("http://api.local/x"),
        vec![Ok(response(503, &[("x-final", "1")]))],
    )
    .await;
    assert_eq!(seen.len(), 1);
    let (_, seen) = run(
        stacked(form, layer().convention(convention)),
        get("http://api.local/x"),
        vec![Ok(response(503, &[("do-not-retry", "1")])), Ok(status(200))],
    )
    .await;
    assert_eq!(seen.len(), 2);
}

both_forms!(
    a_custom_convention_renames_every_header,
    start_paused = true
);
