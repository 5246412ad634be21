//! Duplicates never park on the pool: another request with the same key, a copy in
//! flight, keys sharing 32 bits of their record id, fifty concurrent copies (also in
//! wait mode), and a waiter after the holder rolls back.

use std::time::Duration;

use axum::http::StatusCode;
use retrysafe_core::idempotency::{Principal, RecordId, Scope};
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_postgres::sqlx;
use retrysafe_test_support::pg_store::pg_admin;
use retrysafe_tower::idempotency::ProblemKind;

use super::{Env, pay_req, problem_type, send};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_other_request_is_422() {
    let env = Env::new(4).await;
    let app = env.app(env.layer());
    assert_eq!(
        send(&app, pay_req(Some("k"), "ok", "acc-1")).await.status,
        StatusCode::CREATED
    );
    let other = send(&app, pay_req(Some("k"), "ok", "acc-2")).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.problem(), problem_type(ProblemKind::KeyMismatch));
    assert!(other.do_not_retry());
    assert_eq!(env.payments().await, 1);
}

/// A copy of a request in flight is answered 409 at once, while the first still holds
/// its transaction: it never parks on the first one's uncommitted key row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_copy_gets_409_at_once() {
    let env = Env::new(4).await;
    let app = env.app(env.layer());

    let holder = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay_req(Some("k"), "hold", "acc")).await }
    });
    env.hooks.started.acquire().await.unwrap().forget();

    let copy = send(&app, pay_req(Some("k"), "hold", "acc")).await;
    assert_eq!(copy.status, StatusCode::CONFLICT);
    assert_eq!(copy.problem(), problem_type(ProblemKind::InFlight));
    assert_eq!(copy.headers["retry-after"], "1");
    assert!(!copy.do_not_retry());
    assert!(!holder.is_finished(), "the first request is still running");

    env.hooks.release.add_permits(1);
    let first = holder.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(env.payments().await, 1);
}

/// Two keys whose record ids share their first 32 bits (found offline; under a lock on
/// 32 bits they collided): while one holds its transaction, the other runs — no false
/// 409 between unrelated keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_sharing_32_bits_of_their_record_id_do_not_block_each_other() {
    const A: &str = "collide-14294";
    const B: &str = "collide-32700";
    let scope = Scope::from(&Principal::new("alice"));
    let id = |k: &str| RecordId::new(&scope, &IdempotencyKey::new(k).unwrap());
    assert_eq!(
        id(A).as_bytes()[..4],
        id(B).as_bytes()[..4],
        "the fixture collides"
    );
    assert_ne!(id(A), id(B));

    let env = Env::new(4).await;
    let app = env.app(env.layer());
    let holder = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay_req(Some(A), "hold", "acc-a")).await }
    });
    env.hooks.started.acquire().await.unwrap().forget();

    let other = send(&app, pay_req(Some(B), "ok", "acc-b")).await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert!(!holder.is_finished(), "the first request is still running");

    env.hooks.release.add_permits(1);
    assert_eq!(holder.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(env.payments().await, 2);
}

/// Fifty copies of one request at once, on a pool of five connections: one runs, the
/// other 49 get 409 while it still holds its transaction (none of them waits for it),
/// and meanwhile an unrelated request still gets a connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_copies_one_effect_pool_not_exhausted() {
    let env = Env::new(5).await;
    let app = env.app(env.layer());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..50 {
        let app = app.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut req = pay_req(Some("dup"), "hold", "acc");
            req.headers_mut()
                .insert("x-deadline-ms", "20000".parse().unwrap());
            tx.send(send(&app, req).await).unwrap();
        });
    }
    let mut conflicts = 0;
    for _ in 0..49 {
        let answer = rx.recv().await.unwrap();
        assert_eq!(
            answer.status,
            StatusCode::CONFLICT,
            "{:?}",
            String::from_utf8_lossy(&answer.body)
        );
        assert_eq!(answer.problem(), problem_type(ProblemKind::InFlight));
        conflicts += 1;
    }
    assert_eq!(conflicts, 49);
    // The one that runs is still holding its transaction.
    env.hooks.started.acquire().await.unwrap().forget();
    let unrelated = send(&app, pay_req(Some("other"), "ok", "acc-2")).await;
    assert_eq!(unrelated.status, StatusCode::CREATED);

    env.hooks.release.add_permits(1);
    let first = rx.recv().await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    let dup_payments: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {}.payments WHERE account = 'acc'",
        env.store.schema
    ))
    .fetch_one(&mut pg_admin().await)
    .await
    .unwrap();
    assert_eq!(dup_payments, 1, "exactly one effect");
    env.pool_settles().await;
    assert!(env.store.pool().size() <= 5);
}

/// The same fifty copies in wait mode: 49 wait without holding a connection (an
/// unrelated request still runs meanwhile) and all get the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_copies_in_wait_mode_get_the_replay() {
    let env = Env::new(5).await;
    let layer = env
        .layer()
        .wait_for_in_flight(Duration::from_secs(30))
        .build()
        .unwrap();
    let app = env.app(layer);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..50 {
        let app = app.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut req = pay_req(Some("dup"), "hold", "acc");
            req.headers_mut()
                .insert("x-deadline-ms", "40000".parse().unwrap());
            tx.send(send(&app, req).await).unwrap();
        });
    }
    env.hooks.started.acquire().await.unwrap().forget();
    // Let the copies reach their wait (not a timing assertion: only more of them are
    // waiting for the next request to squeeze past).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let unrelated = send(&app, pay_req(Some("other"), "ok", "acc-2")).await;
    assert_eq!(unrelated.status, StatusCode::CREATED);
    assert!(
        rx.is_empty(),
        "nobody answered while the first one holds its key"
    );

    env.hooks.release.add_permits(1);
    let mut ran = 0;
    let mut replayed = 0;
    let mut body = None;
    for _ in 0..50 {
        let answer = rx.recv().await.unwrap();
        assert_eq!(answer.status, StatusCode::CREATED);
        if answer.replayed() {
            replayed += 1;
        } else {
            ran += 1;
        }
        match &body {
            None => body = Some(answer.body),
            Some(b) => assert_eq!(b, &answer.body),
        }
    }
    assert_eq!((ran, replayed), (1, 49));
    assert_eq!(env.payments().await, 2, "one for the copies, one unrelated");
    env.pool_settles().await;
}

/// In wait mode, a waiter whose holder rolled back takes the key and runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_runs_when_the_holder_rolls_back() {
    let env = Env::new(4).await;
    let layer = env
        .layer()
        .wait_for_in_flight(Duration::from_secs(30))
        .build()
        .unwrap();
    let app = env.app(layer);
    let holder = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay_req(Some("k"), "hold500", "acc")).await }
    });
    env.hooks.started.acquire().await.unwrap().forget();
    let waiter = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay_req(Some("k"), "ok", "acc")).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiter.is_finished(), "the copy waits");
    env.hooks.release.add_permits(1);
    assert_eq!(
        holder.await.unwrap().status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let waited = waiter.await.unwrap();
    assert_eq!(waited.status, StatusCode::CREATED);
    assert!(!waited.replayed(), "the waiter ran the handler itself");
    assert_eq!(env.payments().await, 1);
}
