//! Local failures: typed errors by default, trailers-only gRPC answers with
//! `GrpcStatusLayer`.

use http::StatusCode;
use retrysafe_core::error::{BudgetExhausted, DeadlineExceeded, find};
use retrysafe_core::strategy::Idempotent;
use retrysafe_core::{CallContext, Deadline};
use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::Form;
use tower::Layer;
use tower_test::mock;

use super::{
    Req, Res, call, get, grpc_call, grpc_statuses, marked, ms, next, no_more_attempts, run, settle,
    stack, with,
};

async fn grpc_statuses_answer_local_failures_with_trailers_only_responses(form: Form) {
    // An expired deadline: nothing is sent.
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = grpc_statuses(stack(form)).service(mock);
    let deadline = Deadline::after(ms(10));
    tokio::time::advance(ms(10)).await;
    let join = call(&mut svc, with(grpc_call(), deadline)).await;
    let res = join.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["content-type"], "application/grpc");
    assert_eq!(res.headers()["grpc-status"], "4");
    assert!(marked(&res));
    assert!(res.body().get_ref().is_empty());
    no_more_attempts(&mut handle).await;

    // A budget refusal from below: UNAVAILABLE, not retried.
    let (res, seen) = run(
        grpc_statuses(stack(form)),
        with(grpc_call(), Idempotent),
        vec![Err(Box::new(BudgetExhausted::new()))],
    )
    .await;
    let res = res.unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(res.headers()["grpc-status"], "14");
    assert!(marked(&res));

    // The deadline running out during an attempt: DEADLINE_EXCEEDED.
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = grpc_statuses(stack(form)).service(mock);
    let join = call(
        &mut svc,
        with(with(grpc_call(), Idempotent), Deadline::after(ms(300))),
    )
    .await;
    let (_req, _reply) = next(&mut handle).await;
    tokio::time::advance(ms(300)).await;
    settle().await;
    assert!(join.is_finished());
    let res = join.await.unwrap().unwrap();
    assert_eq!(res.headers()["grpc-status"], "4");
    assert!(marked(&res));

    // Other (non-gRPC) requests still get errors in this mode.
    let (mock, _handle) = mock::pair::<Req, Res>();
    let mut svc = grpc_statuses(stack(form)).service(mock);
    let deadline = Deadline::after(ms(1));
    tokio::time::advance(ms(1)).await;
    let err = call(&mut svc, with(get("http://api.local/x"), deadline))
        .await
        .await
        .unwrap()
        .unwrap_err();
    assert!(err.is::<DeadlineExceeded>());
}

both_forms!(
    grpc_statuses_answer_local_failures_with_trailers_only_responses,
    start_paused = true
);

async fn local_failures_are_typed_errors_by_default(form: Form) {
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let deadline = Deadline::after(ms(10));
    tokio::time::advance(ms(10)).await;
    let err = call(&mut svc, with(grpc_call(), deadline))
        .await
        .await
        .unwrap()
        .unwrap_err();
    assert!(err.is::<DeadlineExceeded>(), "{err}");
    no_more_attempts(&mut handle).await;

    let (res, seen) = run(
        stack(form),
        with(grpc_call(), Idempotent),
        vec![Err(Box::new(BudgetExhausted::new()))],
    )
    .await;
    assert_eq!(seen.len(), 1);
    assert!(find::<BudgetExhausted>(&*res.unwrap_err()).is_some());

    // The deadline running out during an attempt of a GET: an error, after giving up.
    let ctx = CallContext::new().with_deadline(Deadline::after(ms(300)));
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let mut svc = stack(form).layer(mock);
    let join = call(&mut svc, with(get("http://api.local/x"), ctx.clone())).await;
    let (_req, _reply) = next(&mut handle).await;
    let err = join.await.unwrap().unwrap_err();
    assert!(err.is::<DeadlineExceeded>());
    assert!(ctx.downstream_gave_up());
    no_more_attempts(&mut handle).await;
}

both_forms!(
    local_failures_are_typed_errors_by_default,
    start_paused = true
);
