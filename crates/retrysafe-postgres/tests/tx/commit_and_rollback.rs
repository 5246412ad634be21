//! The key row and the effect commit together or not at all: replays, server errors,
//! client errors, `NoEffect`, panics, a guard moved into a task or kept too long.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode;
use retrysafe_core::idempotency::Record;
use retrysafe_core::store::IdempotencyStore;
use retrysafe_postgres::tx::TxIdempotencyLayer;
use retrysafe_tower::idempotency::{EventKind, ProblemKind};

use super::{Env, pay_req, problem_type, record_id, send};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_and_effect_commit_together_and_replay_has_no_second_effect() {
    let env = Env::new(4).await;
    let events = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&events);
    let app = env.app(
        env.layer()
            .on_event(move |e| seen.lock().unwrap().push(e.kind)),
    );

    let first = send(&app, pay_req(Some("k-1"), "ok", "acc-1")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(env.payments().await, 1);
    assert_eq!(env.key_rows().await, (1, 1));

    // The committed key row is a PostgresStore record: the store reads it.
    match env.store.get(&record_id("k-1")).await.unwrap() {
        Some(Record::Completed(done)) => {
            let stored = done.response.unwrap();
            assert_eq!(stored.status, StatusCode::CREATED);
            assert_eq!(stored.body, first.body);
        }
        other => panic!("expected a completed record, got {other:?}"),
    }

    let again = send(&app, pay_req(Some("k-1"), "ok", "acc-1")).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(env.payments().await, 1, "a replay has no effect");
    assert_eq!(env.key_rows().await, (1, 1));

    // Another key is another payment.
    let other = send(&app, pay_req(Some("k-2"), "ok", "acc-1")).await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert!(!other.replayed());
    assert_eq!(env.payments().await, 2);
    assert_eq!(
        *events.lock().unwrap(),
        [EventKind::Claimed, EventKind::Replayed, EventKind::Claimed]
    );
    env.pool_settles().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_error_rolls_back_key_and_effect_and_the_retry_runs() {
    let env = Env::new(4).await;
    let app = env.app(env.layer());

    let failed = send(&app, pay_req(Some("k"), "fail500", "acc")).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        &failed.body[..],
        b"ledger failed",
        "the handler's own answer"
    );
    assert!(!failed.do_not_retry(), "a rolled-back 5xx may be retried");
    assert_eq!(env.payments().await, 0);
    assert_eq!(env.key_rows().await, (0, 0));

    let retry = send(&app, pay_req(Some("k"), "ok", "acc")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed(), "the retry ran the handler");
    assert_eq!(env.payments().await, 1);
    assert_eq!(env.key_rows().await, (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_errors_commit_and_replay() {
    let env = Env::new(4).await;
    let app = env.app(env.layer());
    for (key, mode, status) in [
        ("k-400", "reject400", StatusCode::BAD_REQUEST),
        ("k-409", "conflict409", StatusCode::CONFLICT),
    ] {
        let first = send(&app, pay_req(Some(key), mode, "acc")).await;
        assert_eq!(first.status, status);
        let again = send(&app, pay_req(Some(key), "ok", "acc")).await;
        assert_eq!(again.status, status, "{key}: the stored 4xx is replayed");
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
    }
    // Both effects were committed with their keys.
    assert_eq!(env.payments().await, 2);
    assert_eq!(env.key_rows().await, (2, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_effect_and_401_roll_back() {
    let env = Env::new(4).await;
    let app = env.app(env.layer());
    for (key, mode, status) in [
        ("k-ne", "noeffect", StatusCode::CREATED),
        ("k-401", "unauthorized", StatusCode::UNAUTHORIZED),
    ] {
        let first = send(&app, pay_req(Some(key), mode, "acc")).await;
        assert_eq!(first.status, status);
        assert_eq!(env.payments().await, 0, "{mode}: rolled back");
        assert_eq!(env.key_rows().await, (0, 0));
    }
    let retry = send(&app, pay_req(Some("k-ne"), "ok", "acc")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(env.payments().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panic_rolls_back_and_answers_500() {
    let env = Env::new(4).await;
    let app = env.app(env.layer());

    let panicked = send(&app, pay_req(Some("k"), "panic", "acc")).await;
    assert_eq!(panicked.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        panicked.problem(),
        problem_type(ProblemKind::HandlerPanicked)
    );
    assert!(!panicked.do_not_retry(), "rolled back: nothing happened");
    assert_eq!(env.payments().await, 0);
    assert_eq!(env.key_rows().await, (0, 0));

    let retry = send(&app, pay_req(Some("k"), "ok", "acc")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(env.payments().await, 1);
    env.pool_settles().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_moved_into_a_task_rolls_back_and_answers_500() {
    let env = Env::new(4).await;
    let app = env.app(env.layer());

    let leaked = send(&app, pay_req(Some("k"), "leak", "acc")).await;
    assert_eq!(leaked.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        leaked.problem(),
        problem_type(ProblemKind::TransactionLeaked)
    );
    // Once the task drops the guard, its connection rolls back and returns to the
    // pool; nothing was committed.
    env.pool_settles().await;
    assert_eq!(env.payments().await, 0);
    assert_eq!(env.key_rows().await, (0, 0));

    let retry = send(&app, pay_req(Some("k"), "ok", "acc")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(env.payments().await, 1);
}

/// A guard kept forever: the layer answers 500 at once; the server ends the idle
/// transaction after the layer's `idle_in_transaction_session_timeout`, which frees the
/// key; the kept insert is never committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_guard_is_freed_by_the_idle_timeout() {
    let env = Env::new(4).await;
    let layer = TxIdempotencyLayer::with_backend(
        env.backend()
            .idle_in_transaction_timeout(Duration::from_millis(300))
            .build()
            .unwrap(),
    );
    let app = env.app(layer);

    let kept = send(&app, pay_req(Some("k"), "keep", "acc")).await;
    assert_eq!(kept.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(kept.problem(), problem_type(ProblemKind::TransactionLeaked));
    assert!(env.hooks.kept.lock().unwrap().is_some());

    // Until the server ends the kept transaction its lock is held: 409. Then the retry
    // runs.
    let mut answer = send(&app, pay_req(Some("k"), "ok", "acc")).await;
    for _ in 0..200 {
        if answer.status != StatusCode::CONFLICT {
            break;
        }
        assert_eq!(answer.problem(), problem_type(ProblemKind::InFlight));
        tokio::time::sleep(Duration::from_millis(50)).await;
        answer = send(&app, pay_req(Some("k"), "ok", "acc")).await;
    }
    assert_eq!(answer.status, StatusCode::CREATED);
    assert!(!answer.replayed());
    assert_eq!(
        env.payments().await,
        1,
        "the kept transaction's insert is gone"
    );

    // Dropping the dead guard is harmless.
    drop(env.hooks.kept.lock().unwrap().take());
    env.pool_settles().await;
}
