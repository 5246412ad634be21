//! Requests off the common path: an oversized response, and unkeyed requests (in a
//! transaction of their own, or timed out while their body trickles).

use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use bytes::Bytes;
use retrysafe_tower::idempotency::ProblemKind;

use super::{Env, pay_req, problem_type, send};

/// A response too large to store commits a key row marking it not stored, and is sent
/// in full; later copies get 409 `response-not-stored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_response_commits_a_not_stored_marker() {
    let env = Env::new(4).await;
    let app = env.app(env.layer().max_stored_response(16));
    let first = send(&app, pay_req(Some("k"), "big", "acc")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body.len(), 100);
    assert_eq!(env.key_rows().await, (1, 1));
    assert_eq!(env.payments().await, 1);

    let again = send(&app, pay_req(Some("k"), "big", "acc")).await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert_eq!(
        again.problem(),
        problem_type(ProblemKind::ResponseNotStored)
    );
    assert!(again.do_not_retry());
    assert_eq!(env.payments().await, 1);
}

/// Without a key (not required), the handler still gets a transaction, committed or
/// rolled back by the same rules, with no key row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unkeyed_request_runs_in_a_transaction_of_its_own() {
    let env = Env::new(4).await;
    let app = env.app(env.layer());
    assert_eq!(
        send(&app, pay_req(None, "ok", "acc")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        send(&app, pay_req(None, "fail500", "acc")).await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        send(&app, pay_req(None, "ok", "acc")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        env.payments().await,
        2,
        "not deduplicated; the 500 rolled back"
    );
    assert_eq!(env.key_rows().await, (0, 0));
}

/// A request without a key whose body trickles in (one byte, then nothing) gets 408
/// `body-timeout`: its body is read, within `request_body_timeout`, before the
/// transaction begins, so it never holds a connection, and its in-flight slot is freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unkeyed_trickled_body_times_out_before_any_transaction() {
    use futures_util::StreamExt;
    let env = Env::new(2).await;
    let layer = env
        .layer()
        .max_in_flight(1)
        .request_body_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let app = env.app(layer);
    let trickle = futures_util::stream::once(async { Ok::<_, std::io::Error>(Bytes::from("a")) })
        .chain(futures_util::stream::pending());
    let req = Request::post("/pay")
        .header("content-type", "text/plain")
        .header("x-mode", "ok")
        .body(Body::from_stream(trickle))
        .unwrap();
    let answer = send(&app, req).await;
    assert_eq!(answer.status, StatusCode::REQUEST_TIMEOUT);
    assert_eq!(answer.problem(), problem_type(ProblemKind::BodyTimeout));
    assert!(!answer.do_not_retry(), "nothing happened: a retry is safe");
    env.pool_settles().await;
    // The one slot is free again, and nothing ran.
    assert_eq!(env.payments().await, 0);
    assert_eq!(
        send(&app, pay_req(None, "ok", "acc")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(env.payments().await, 1);
}
