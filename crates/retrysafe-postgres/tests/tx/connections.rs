//! The pool and the wire: acquisition bounded by the deadline, a killed connection, the
//! success path's round trips, an aborted transaction, and a cancelled `BEGIN`.

use std::time::Duration;

use axum::http::StatusCode;
use retrysafe_postgres::sqlx;
use retrysafe_postgres::tx::TxIdempotencyLayer;
use retrysafe_test_support::pg_store::{Proxy, isolated_store_with, pg_admin};
use retrysafe_tower::idempotency::ProblemKind;

use super::{Env, pay_req, problem_type, send};

/// No connection within the request's deadline: 503 with `retry-after`, and nothing
/// happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_acquisition_is_bounded_by_the_deadline() {
    let env = Env::new(1).await;
    let app = env.app(env.layer());
    let held = env.store.pool().acquire().await.unwrap();

    let mut req = pay_req(Some("k"), "ok", "acc");
    req.headers_mut()
        .insert("x-deadline-ms", "200".parse().unwrap());
    let busy = send(&app, req).await;
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(busy.problem(), problem_type(ProblemKind::StoreUnavailable));
    assert!(busy.headers.contains_key("retry-after"));

    // Without a deadline, the layer's acquire timeout bounds it.
    let quick = env.app(TxIdempotencyLayer::with_backend(
        env.backend()
            .acquire_timeout(Duration::from_millis(200))
            .build()
            .unwrap(),
    ));
    let busy = send(&quick, pay_req(Some("k"), "ok", "acc")).await;
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE);

    drop(held);
    let ok = send(&app, pay_req(Some("k"), "ok", "acc")).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert!(!ok.replayed());
    assert_eq!(env.payments().await, 1);
}

/// The transaction's connection is killed while the handler runs: neither the key
/// row nor the payment exists, and the retry runs exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_connection_leaves_no_row_and_the_retry_runs_once() {
    let env = Env::new(4).await;
    let app = env.app(env.layer());
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay_req(Some("k"), "kill", "acc")).await }
    });
    env.hooks.started.acquire().await.unwrap().forget();
    let pid = env.hooks.pid.lock().unwrap().unwrap();
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&mut pg_admin().await)
        .await
        .unwrap();
    assert!(killed);
    env.hooks.release.add_permits(1);

    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(first.problem(), problem_type(ProblemKind::StoreUnavailable));
    assert_eq!(env.payments().await, 0);
    assert_eq!(env.key_rows().await, (0, 0));

    let retry = send(&app, pay_req(Some("k"), "ok", "acc")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    let again = send(&app, pay_req(Some("k"), "ok", "acc")).await;
    assert!(again.replayed());
    assert_eq!(env.payments().await, 1);
}

/// On the wire, once the statements are prepared on the connection: a first request
/// is BEGIN (with its SET LOCAL) and COMMIT as simple queries, plus two statements of
/// the layer (the key statement, the key row's completion) around the handler's one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn success_path_is_begin_commit_and_two_statements() {
    let proxy = Proxy::start().await;
    let store = isolated_store_with(proxy.connect_options(), |b| b.max_connections(1)).await;
    let env = Env::with(store).await;
    let app = env.app(env.layer());

    // Warm up: prepares the statements on the single connection.
    assert_eq!(
        send(&app, pay_req(Some("warm"), "ok", "acc")).await.status,
        StatusCode::CREATED
    );
    assert!(
        send(&app, pay_req(Some("warm"), "ok", "acc"))
            .await
            .replayed()
    );
    env.pool_settles().await;

    let before = proxy.seen();
    let first = send(&app, pay_req(Some("k"), "ok", "acc")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    env.pool_settles().await;
    let seen = proxy.seen() - before;
    assert_eq!(seen.simple_queries, 2, "BEGIN and COMMIT: {seen:?}");
    assert_eq!(
        seen.statements, 3,
        "the key statement, the handler's insert, the completion: {seen:?}"
    );
    assert_eq!(seen.prepares, 0, "{seen:?}");
    assert_eq!(seen.connections, 0, "{seen:?}");

    // A replay: BEGIN and the key statement; its ROLLBACK goes out with the ping of the
    // connection's return to the pool.
    let before = proxy.seen();
    assert!(send(&app, pay_req(Some("k"), "ok", "acc")).await.replayed());
    env.pool_settles().await;
    let seen = proxy.seen() - before;
    assert_eq!(seen.simple_queries, 2, "BEGIN and ROLLBACK: {seen:?}");
    assert_eq!(seen.statements, 1, "the key statement: {seen:?}");
    assert_eq!(env.payments().await, 2);
}

/// A handler whose statement failed (aborting the transaction) and that answers
/// anyway: nothing is committed; its client error is passed on unstored, and a success
/// becomes a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_transaction_commits_nothing() {
    let env = Env::new(4).await;
    let app = env.app(env.layer());
    for _ in 0..2 {
        let refused = send(&app, pay_req(Some("k-4xx"), "abort409", "acc")).await;
        assert_eq!(refused.status, StatusCode::CONFLICT);
        assert_eq!(&refused.body[..], b"no such account");
        assert!(!refused.replayed(), "not stored: the retry runs again");
    }
    let lie = send(&app, pay_req(Some("k-2xx"), "abort201", "acc")).await;
    assert_eq!(lie.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(lie.problem(), problem_type(ProblemKind::HandlerPanicked));
    assert_eq!(env.payments().await, 0);
    assert_eq!(env.key_rows().await, (0, 0));
    env.pool_settles().await;
}

/// A deadline that runs out while the layer's `BEGIN` is on the wire (the proxy holds
/// it) answers 503 and closes that connection: it is never handed to the next user
/// inside a transaction nobody knows about.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_begin_never_leaves_a_connection_in_a_transaction() {
    let proxy = Proxy::start().await;
    let store = isolated_store_with(proxy.connect_options(), |b| b.max_connections(1)).await;
    let env = Env::with(store).await;
    let app = env.app(env.layer());
    assert_eq!(
        send(&app, pay_req(Some("warm"), "ok", "acc")).await.status,
        StatusCode::CREATED
    );
    env.pool_settles().await;

    proxy.freeze(true);
    let mut req = pay_req(Some("k"), "ok", "acc");
    req.headers_mut()
        .insert("x-deadline-ms", "300".parse().unwrap());
    let cut = send(&app, req).await;
    assert_eq!(cut.status, StatusCode::SERVICE_UNAVAILABLE);
    proxy.freeze(false);

    // An autocommit write through the same pool is committed: its connection is not
    // inside the cut-off BEGIN's transaction.
    sqlx::query(&format!(
        "INSERT INTO {}.payments (account, amount_cents) VALUES ('autocommit', 1)",
        env.store.schema
    ))
    .execute(env.store.pool())
    .await
    .unwrap();
    let visible: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {}.payments WHERE account = 'autocommit'",
        env.store.schema
    ))
    .fetch_one(&mut pg_admin().await)
    .await
    .unwrap();
    assert_eq!(visible, 1);

    let ok = send(&app, pay_req(Some("k"), "ok", "acc")).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert!(!ok.replayed());
}
