//! Recovery with real processes: every key reaches a definite state.
//!
//! Two `payments` instances share one store. Instance A runs with `--test-hooks` and
//! is made to crash (`x-simulate-crash`, which aborts the process) at a point of a
//! keyed payment; instance B runs the reconciler with the payments resolver, which
//! looks the payment up in the ledger by (scope, key). The same request is then resent
//! to B until it has its final answer:
//!
//! - crash `after-commit-point` (no payment made): the resolver says the payment did
//!   not happen, the key is released, and the resend runs: a fresh 201;
//! - crash `after-effect` (payment made, no answer stored): the resolver finds the
//!   payment, the record is completed with its 201, and the resend replays it
//!   (`idempotent-replayed: true`, the ledger's payment id).
//!
//! Meanwhile a resend may only get 409 `request-in-flight` (the dead holder's lease), 503
//! `outcome-pending` (being resolved) or, when the store is slower than B's short store
//! timeout on a busy machine, 503 `store-unavailable` — each a wait, with `Retry-After`
//! on the 503s —, never a 500 and never a second payment: the
//! ledger holds exactly one payment for the key at the end. With the transactional
//! PostgreSQL layer the crash rolls key and payment back together, so the resend runs
//! fresh whatever the point. Tested on Redis, on PostgreSQL in the plain mode and on
//! PostgreSQL with the transactional layer.
#![allow(
    clippy::disallowed_methods,
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use std::time::{Duration, Instant};

use http::StatusCode;
use retrysafe_core::idempotency::Token;
use retrysafe_test_support::payments::{Answer, Api, PgSpace, RedisSpace, Server};
use retrysafe_test_support::services::{database_url, redis_url};

/// How long a key may take to reach its final answer after the crash.
const PATIENCE: Duration = Duration::from_secs(30);

/// Short leases and execution bounds, so the reconciler may adopt a dead holder's
/// claim about 1.5 s after its last renewal.
const TIMING: [&str; 4] = ["--lease-ms", "500", "--max-execution-ms", "800"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Point {
    AfterCommitPoint,
    AfterEffect,
}

impl Point {
    fn header(self) -> &'static str {
        match self {
            Point::AfterCommitPoint => "after-commit-point",
            Point::AfterEffect => "after-effect",
        }
    }
}

/// Starts A (crash hooks on, no reconciler) and B (reconciler every 200 ms).
fn instances(store: &str, env: &[(&str, &str)]) -> (Server, Server) {
    let mut a = vec!["--store", store, "--test-hooks", "--reconcile-ms", "0"];
    a.extend(TIMING);
    let mut b = vec!["--store", store, "--reconcile-ms", "200"];
    b.extend(TIMING);
    (Server::start_with(&a, env), Server::start_with(&b, env))
}

/// Crashes A at `point` during a payment of `key`, then resends it to B until it has a
/// final answer; returns that answer and the answers on the way.
async fn crash_and_resend(
    a: &Api,
    b: &Api,
    key: &str,
    account: &str,
    point: Point,
) -> (Answer, Vec<u16>) {
    let crash = [("x-simulate-crash", point.header())];
    let died = a.try_pay(key, account, 1250, &crash).await;
    assert!(
        died.is_err(),
        "A must crash at {point:?}, answered {died:?}"
    );
    let started = Instant::now();
    let mut seen = Vec::new();
    loop {
        let answer = b.pay(key, account, 1250, &[]).await;
        match answer.status.as_u16() {
            201 => return (answer, seen),
            409 => answer.assert_problem_type(409, "request-in-flight"),
            503 => {
                // Being resolved; or, on a busy machine, the store slower than B's
                // store timeout (a quarter of the 500 ms lease): both are waits.
                let ty = answer.assert_problem(503);
                assert!(
                    ty.ends_with(":outcome-pending") || ty.ends_with(":store-unavailable"),
                    "{point:?}: {answer:?}"
                );
                assert!(answer.headers.contains_key("retry-after"), "{answer:?}");
            }
            _ => panic!("{point:?}: a resend may only wait, got {answer:?}"),
        }
        seen.push(answer.status.as_u16());
        assert!(
            started.elapsed() < PATIENCE,
            "{point:?}: no final answer within {PATIENCE:?}: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The final answer is the one the crash point calls for: a replay of the payment made
/// before the crash, or a fresh run.
fn assert_final(answer: &Answer, point: Point, rolls_back: bool) -> String {
    let id = answer.assert_created("acme", 1250);
    let replay_expected = point == Point::AfterEffect && !rolls_back;
    assert_eq!(answer.replayed(), replay_expected, "{point:?}: {answer:?}");
    id
}

async fn run_redis(point: Point) {
    let space = RedisSpace::new().await;
    let url = redis_url();
    let (a, b) = instances(&url, &space.env());
    let (api_a, api_b) = (Api::new(&a), Api::new(&b));
    let key = format!("rec-{}", Token::random().to_hex());
    let (answer, seen) = crash_and_resend(&api_a, &api_b, &key, "acme", point).await;
    let id = assert_final(&answer, point, false);
    let ledger = space.payments("acme").await;
    assert_eq!(
        ledger.len(),
        1,
        "{point:?}: exactly one payment: {ledger:?} (resends {seen:?})"
    );
    assert!(
        ledger.contains_key(&id),
        "{point:?}: the 201 is the ledger's payment: {ledger:?} vs {id}"
    );
    // Replays after the resolution are the same answer.
    let again = api_b.pay(&key, "acme", 1250, &[]).await;
    assert_eq!(again.assert_created("acme", 1250), id);
    assert!(again.replayed());
    drop(a);
}

async fn run_postgres(point: Point, transactional: bool) {
    let space = PgSpace::new().await;
    let url = database_url();
    let mode = if transactional {
        "transactional"
    } else {
        "plain"
    };
    let mut env = space.env().to_vec();
    env.push(("PAYMENTS_PG_MODE", mode));
    let (a, b) = instances(&url, &env);
    let (api_a, api_b) = (Api::new(&a), Api::new(&b));
    let key = format!("rec-{}", Token::random().to_hex());
    let (answer, seen) = crash_and_resend(&api_a, &api_b, &key, "acme", point).await;
    let id = assert_final(&answer, point, transactional);
    let amounts = space.amounts("acme").await;
    assert_eq!(
        amounts,
        [1250],
        "{mode} {point:?}: exactly one payment (resends {seen:?})"
    );
    let again = api_b.pay(&key, "acme", 1250, &[]).await;
    assert_eq!(again.assert_created("acme", 1250), id);
    assert!(again.replayed());
    assert_eq!(api_b.totals("acme").await, (1, 1250));
    drop(a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_crashed_holder_is_resolved_from_the_ledger() {
    run_redis(Point::AfterCommitPoint).await;
    run_redis(Point::AfterEffect).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_plain_a_crashed_holder_is_resolved_from_the_ledger() {
    run_postgres(Point::AfterCommitPoint, false).await;
    run_postgres(Point::AfterEffect, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_transactional_a_crash_rolls_back_and_the_resend_runs() {
    run_postgres(Point::AfterCommitPoint, true).await;
    run_postgres(Point::AfterEffect, true).await;
}

/// Without `--test-hooks` the crash header is ignored: the payment is made and answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_crash_hook_is_off_without_the_flag() {
    let server = Server::start(&[]);
    let api = Api::new(&server);
    let answer = api
        .pay(
            "no-crash-1",
            "acme",
            100,
            &[("x-simulate-crash", "after-effect")],
        )
        .await;
    assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    let hooked = Server::start(&["--test-hooks"]);
    let api = Api::new(&hooked);
    let bad = api
        .pay(
            "no-crash-2",
            "acme",
            100,
            &[("x-simulate-crash", "sometime")],
        )
        .await;
    bad.assert_problem(400);
}

/// Sends `SIGSTOP` or `SIGCONT` to `server`.
fn signal(server: &Server, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &server.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {sig}");
}

/// A holder paused (SIGSTOP) for twice its lease, before or after its commit point,
/// while a copy goes to the other instance; then resumed (SIGCONT). Before the commit
/// point the copy takes over and pays, and the resumed holder finds its claim gone
/// (its commit point fails): one payment. After it, the copy waits (503
/// `outcome-pending`) until the reconciler finds the paused holder's payment, then gets
/// it replayed; the resumed holder cannot store its answer over the resolution, and
/// answers its own 201 of the same payment. Nothing lost, nothing twice.
async fn paused_holder(store: &str, env: &[(&str, &str)], after_commit_point: bool) {
    let args = |reconcile: &'static str| {
        vec![
            "--store",
            store,
            "--reconcile-ms",
            reconcile,
            "--lease-ms",
            "500",
            "--max-execution-ms",
            "10000",
        ]
    };
    let a = Server::start_with(&args("0"), env);
    let b = Server::start_with(&args("200"), env);
    let (api_a, api_b) = (Api::new(&a), Api::new(&b));
    let account = format!("acct-{}", &Token::random().to_hex()[..8]);
    let key = format!("pause-{}", Token::random().to_hex());
    let hook = if after_commit_point {
        ("x-simulate-delay-after-ms", "1500")
    } else {
        ("x-simulate-delay-ms", "1500")
    };
    let held = {
        let (api, key, account) = (api_a.clone(), key.clone(), account.clone());
        tokio::spawn(async move { api.pay(&key, &account, 300, &[hook]).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(&a, "-STOP");
    tokio::time::sleep(Duration::from_millis(1000)).await;

    let started = Instant::now();
    let copy = loop {
        let answer = api_b.pay(&key, &account, 300, &[]).await;
        match answer.status.as_u16() {
            201 => break answer,
            409 | 503 => {}
            _ => panic!("the copy may only wait, got {answer:?}"),
        }
        assert!(started.elapsed() < PATIENCE, "no answer for the copy");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let id = copy.assert_created(&account, 300);
    // Before its commit point the paused holder had not paid: the copy ran. After it,
    // the payment was the holder's: the copy gets it replayed.
    assert_eq!(copy.replayed(), after_commit_point, "{copy:?}");

    signal(&a, "-CONT");
    let held = tokio::time::timeout(PATIENCE, held).await.unwrap().unwrap();
    if after_commit_point {
        assert_eq!(
            held.assert_created(&account, 300),
            id,
            "the holder paid this payment"
        );
    } else {
        assert_ne!(
            held.status,
            StatusCode::CREATED,
            "the resumed holder must not pay: {held:?}"
        );
    }
    assert_eq!(
        api_b.totals(&account).await,
        (1, 300),
        "exactly one payment"
    );
    let again = api_a.pay(&key, &account, 300, &[]).await;
    assert_eq!(again.assert_created(&account, 300), id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_paused_holder_makes_no_duplicate_and_loses_nothing() {
    let space = RedisSpace::new().await;
    let url = redis_url();
    paused_holder(&url, &space.env(), false).await;
    paused_holder(&url, &space.env(), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_plain_a_paused_holder_makes_no_duplicate_and_loses_nothing() {
    let space = PgSpace::new().await;
    let url = database_url();
    let mut env = space.env().to_vec();
    env.push(("PAYMENTS_PG_MODE", "plain"));
    paused_holder(&url, &env, false).await;
    paused_holder(&url, &env, true).await;
}
