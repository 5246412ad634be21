//! The transactional layer against the real PostgreSQL at `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`), each test in its own schema: the key row
//! and a `payments` row commit together or not at all, duplicates never park on the
//! pool, and the success path costs BEGIN, COMMIT and two statements on the wire.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, to_bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use bytes::Bytes;
use retrysafe_core::Deadline;
use retrysafe_core::idempotency::{Principal, Record, RecordId, Scope};
use retrysafe_core::store::IdempotencyStore;
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_postgres::sqlx;
use retrysafe_postgres::tx::{IdempotentTx, NoEffect, TxBackend, TxIdempotencyLayer};
use retrysafe_tower::idempotency::{EventKind, IdempotencyContext, ProblemKind};
use support::{Proxy, TestStore, admin, isolated_store, isolated_store_with};
use tokio::sync::Semaphore;
use tower::ServiceExt;

/// What the test and the handler share.
struct Hooks {
    /// A permit per handler that reached its "hold" point (after its insert).
    started: Semaphore,
    /// Permits the test hands out to let held handlers go on.
    release: Semaphore,
    /// A guard a handler kept ("keep" mode).
    kept: Mutex<Option<IdempotentTx>>,
    /// The backend pid of a handler's transaction ("kill" mode).
    pid: Mutex<Option<i32>>,
}

impl Default for Hooks {
    fn default() -> Self {
        Hooks {
            started: Semaphore::new(0),
            release: Semaphore::new(0),
            kept: Mutex::default(),
            pid: Mutex::default(),
        }
    }
}

#[derive(Clone)]
struct Ctx {
    schema: String,
    hooks: Arc<Hooks>,
}

/// The handler: records a payment in the request's transaction, then behaves as the
/// `x-mode` header says (headers other than `content-type` are not in the fingerprint).
async fn pay(
    State(ctx): State<Ctx>,
    headers: HeaderMap,
    mut tx: IdempotentTx,
    account: String,
) -> Response {
    let mode = headers
        .get("x-mode")
        .map_or("ok", |v| v.to_str().unwrap())
        .to_owned();
    // The guard also carries the detached context of the record.
    let id: i64 = sqlx::query_scalar(&format!(
        "INSERT INTO {}.payments (account, amount_cents) VALUES ($1, 500) RETURNING id",
        ctx.schema
    ))
    .bind(&account)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    let created = (StatusCode::CREATED, format!("payment {id} for {account}"));
    match mode.as_str() {
        "ok" => created.into_response(),
        "fail500" => (StatusCode::INTERNAL_SERVER_ERROR, "ledger failed").into_response(),
        "reject400" => (StatusCode::BAD_REQUEST, "insufficient funds").into_response(),
        "conflict409" => (StatusCode::CONFLICT, "duplicate order").into_response(),
        "unauthorized" => StatusCode::UNAUTHORIZED.into_response(),
        "noeffect" => (StatusCode::CREATED, Extension(NoEffect), "nothing").into_response(),
        "panic" => panic!("handler panics after its insert"),
        "big" => (StatusCode::CREATED, "x".repeat(100)).into_response(),
        "abort409" | "abort201" => {
            // A statement fails (aborting the transaction) and the handler goes on.
            let failed = sqlx::query("SELECT 1 / 0").execute(&mut *tx).await;
            assert!(failed.is_err());
            if mode == "abort409" {
                (StatusCode::CONFLICT, "no such account").into_response()
            } else {
                created.into_response()
            }
        }
        "hold" | "hold500" => {
            ctx.hooks.started.add_permits(1);
            ctx.hooks.release.acquire().await.unwrap().forget();
            if mode == "hold500" {
                (StatusCode::SERVICE_UNAVAILABLE, "gave up").into_response()
            } else {
                created.into_response()
            }
        }
        "leak" => {
            // The guard moves into a task that outlives the handler.
            tokio::spawn(async move {
                let _tx = tx;
                tokio::time::sleep(Duration::from_millis(200)).await;
            });
            created.into_response()
        }
        "keep" => {
            *ctx.hooks.kept.lock().unwrap() = Some(tx);
            created.into_response()
        }
        "kill" => {
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            *ctx.hooks.pid.lock().unwrap() = Some(pid);
            ctx.hooks.started.add_permits(1);
            ctx.hooks.release.acquire().await.unwrap().forget();
            // Does not touch the (now dead) connection again: the layer finds out.
            created.into_response()
        }
        other => panic!("unknown mode {other}"),
    }
}

/// Authentication, outside the layer: every request belongs to `alice`; a
/// `x-deadline-ms` header becomes the request's `Deadline`.
async fn auth(mut req: Request) -> Request {
    req.extensions_mut().insert(Principal::new("alice"));
    if let Some(ms) = req.headers().get("x-deadline-ms") {
        let ms: u64 = ms.to_str().unwrap().parse().unwrap();
        req.extensions_mut()
            .insert(Deadline::after(Duration::from_millis(ms)));
    }
    req
}

struct Env {
    store: TestStore,
    hooks: Arc<Hooks>,
}

impl Env {
    async fn new(max_connections: u32) -> Env {
        Self::with(isolated_store(|b| b.max_connections(max_connections)).await).await
    }

    async fn with(store: TestStore) -> Env {
        sqlx::raw_sql(&format!(
            "CREATE TABLE {}.payments (id bigserial PRIMARY KEY, account text NOT NULL, \
             amount_cents bigint NOT NULL)",
            store.schema
        ))
        .execute(store.pool())
        .await
        .unwrap();
        Env {
            store,
            hooks: Arc::new(Hooks::default()),
        }
    }

    fn backend(&self) -> TxBackend {
        TxBackend::from_store(&self.store)
    }

    fn layer(&self) -> TxIdempotencyLayer {
        TxIdempotencyLayer::with_backend(self.backend())
    }

    fn app(&self, layer: TxIdempotencyLayer) -> Router {
        let ctx = Ctx {
            schema: self.store.schema.clone(),
            hooks: Arc::clone(&self.hooks),
        };
        Router::new()
            .route("/pay", post(pay))
            .route(
                "/tx",
                get(|_tx: IdempotentTx| async { "has a transaction" }),
            )
            .route("/plain", get(|| async { "plain" }))
            .route(
                "/maybe",
                get(|tx: Option<IdempotentTx>| async move {
                    if tx.is_some() { "some" } else { "none" }
                }),
            )
            .with_state(ctx)
            .layer(layer)
            .layer(axum::middleware::map_request(auth))
    }

    async fn payments(&self) -> i64 {
        let mut conn = admin().await;
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {}.payments",
            self.store.schema
        ))
        .fetch_one(&mut conn)
        .await
        .unwrap()
    }

    /// (all key rows, completed key rows)
    async fn key_rows(&self) -> (i64, i64) {
        let mut conn = admin().await;
        sqlx::query_as(&format!(
            "SELECT count(*), count(*) FILTER (WHERE state = 2) FROM {}",
            self.store.table()
        ))
        .fetch_one(&mut conn)
        .await
        .unwrap()
    }

    /// Waits until every connection of the pool is back and idle (connections return
    /// to the pool in tasks of their own).
    async fn pool_settles(&self) {
        let pool = self.store.pool();
        for _ in 0..500 {
            if pool.num_idle() == pool.size() as usize {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "pool never settled: {} connections, {} idle",
            pool.size(),
            pool.num_idle()
        );
    }
}

fn pay_req(key: Option<&str>, mode: &str, account: &str) -> Request {
    let mut b = Request::post("/pay")
        .header("content-type", "text/plain")
        .header("x-mode", mode);
    if let Some(key) = key {
        b = b.header("idempotency-key", key);
    }
    b.body(Body::from(account.to_owned())).unwrap()
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    /// The problem `type` of a problem+json answer.
    fn problem(&self) -> String {
        let v: serde_json::Value = serde_json::from_slice(&self.body)
            .unwrap_or_else(|_| panic!("not JSON: {:?}", String::from_utf8_lossy(&self.body)));
        v["type"].as_str().unwrap().to_owned()
    }

    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    fn do_not_retry(&self) -> bool {
        self.headers.contains_key("do-not-retry")
    }
}

fn problem_type(kind: ProblemKind) -> String {
    kind.type_uri()
}

async fn send(app: &Router, req: Request) -> Answer {
    let res = tokio::time::timeout(Duration::from_secs(60), app.clone().oneshot(req))
        .await
        .expect("no answer within 60 s")
        .unwrap();
    let (parts, body) = res.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: to_bytes(body, usize::MAX).await.unwrap(),
    }
}

fn record_id(key: &str) -> RecordId {
    RecordId::new(
        &Scope::from(&Principal::new("alice")),
        &IdempotencyKey::new(key).unwrap(),
    )
}

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
    .fetch_one(&mut admin().await)
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
        .fetch_one(&mut admin().await)
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
    .fetch_one(&mut admin().await)
    .await
    .unwrap();
    assert_eq!(visible, 1);

    let ok = send(&app, pay_req(Some("k"), "ok", "acc")).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert!(!ok.replayed());
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_rules_as_the_idempotency_layer() {
    let env = Env::new(4).await;
    let app = env.app(env.layer());

    // Unguarded methods pass untouched: no transaction for them.
    let plain = send(&app, Request::get("/plain").body(Body::empty()).unwrap()).await;
    assert_eq!(plain.status, StatusCode::OK);
    let no_tx = send(&app, Request::get("/tx").body(Body::empty()).unwrap()).await;
    assert_eq!(no_tx.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        no_tx.problem(),
        problem_type(ProblemKind::TransactionMissing)
    );
    let maybe = send(&app, Request::get("/maybe").body(Body::empty()).unwrap()).await;
    assert_eq!(&maybe.body[..], b"none");

    // gRPC passes untouched too.
    let grpc = Request::post("/pay")
        .header("content-type", "application/grpc")
        .header("idempotency-key", "g")
        .body(Body::from("acc"))
        .unwrap();
    let grpc = send(&app, grpc).await;
    assert_eq!(grpc.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        grpc.problem(),
        problem_type(ProblemKind::TransactionMissing)
    );

    // Invalid keys.
    let bad = send(&app, pay_req(Some(""), "ok", "acc")).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(bad.problem(), problem_type(ProblemKind::KeyInvalid));

    // Required keys.
    let strict = env.app(env.layer().require_key());
    let missing = send(&strict, pay_req(None, "ok", "acc")).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.problem(), problem_type(ProblemKind::KeyMissing));

    // Body over the limit: 413 before anything.
    let small = env.app(env.layer().max_request_body(8));
    let large = send(&small, pay_req(Some("k"), "ok", "a-long-account-name")).await;
    assert_eq!(large.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(large.problem(), problem_type(ProblemKind::BodyTooLarge));

    // No principal: 500 scope-missing.
    let ctx = Ctx {
        schema: env.store.schema.clone(),
        hooks: Arc::clone(&env.hooks),
    };
    let anonymous = Router::new()
        .route("/pay", post(pay))
        .with_state(ctx)
        .layer(env.layer());
    let refused = send(&anonymous, pay_req(Some("k"), "ok", "acc")).await;
    assert_eq!(refused.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(refused.problem(), problem_type(ProblemKind::ScopeMissing));

    assert_eq!(env.payments().await, 0);
    assert_eq!(env.key_rows().await, (0, 0));
}

/// Key rows follow the retention: the store's sweeper deletes them once expired, and
/// the key is new again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_key_rows_go_by_the_store_sweeper() {
    let env = Env::new(4).await;
    let app = env.app(env.layer().retention(Duration::from_millis(300)));
    assert_eq!(
        send(&app, pay_req(Some("k"), "ok", "acc")).await.status,
        StatusCode::CREATED
    );
    let id = record_id("k");
    assert!(env.store.get(&id).await.unwrap().is_some());
    for _ in 0..200 {
        if env.store.get(&id).await.unwrap().is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(env.store.get(&id).await.unwrap().is_none(), "expired");
    let swept = env.store.sweep_expired(100).await.unwrap();
    assert_eq!(swept.rows, 1);
    assert_eq!(env.key_rows().await, (0, 0));

    let again = send(&app, pay_req(Some("k"), "ok", "acc")).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.replayed(), "the key is new again");
    assert_eq!(env.payments().await, 2);
}

/// The handler sees the record's detached context (for child keys) and can open a
/// savepoint on the guard; the layer's commit is still the only one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_sees_the_context_and_nests_savepoints() {
    let env = Env::new(4).await;
    let schema = env.store.schema.clone();
    let app = Router::new()
        .route(
            "/nested",
            post(
                move |Extension(ctx): Extension<IdempotencyContext>, mut tx: IdempotentTx| {
                    let schema = schema.clone();
                    async move {
                        use retrysafe_postgres::sqlx::Connection;
                        let mut sp = tx.begin().await.unwrap();
                        sqlx::query(&format!(
                            "INSERT INTO {schema}.payments (account, amount_cents) VALUES ('sp', 1)"
                        ))
                        .execute(&mut *sp)
                        .await
                        .unwrap();
                        sp.commit().await.unwrap(); // releases the savepoint only
                        (StatusCode::CREATED, ctx.key().as_str().to_owned())
                    }
                },
            ),
        )
        .layer(env.layer())
        .layer(axum::middleware::map_request(auth));
    let req = || {
        Request::post("/nested")
            .header("idempotency-key", "nest")
            .body(Body::empty())
            .unwrap()
    };
    let first = send(&app, req()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(&first.body[..], b"nest");
    assert!(send(&app, req()).await.replayed());
    assert_eq!(env.payments().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_are_validated() {
    let env = Env::new(2).await;
    let l = || env.layer();
    let b = || env.backend();
    assert_eq!(b().table("Bad").build().unwrap_err().field(), "table");
    assert_eq!(b().schema("1x").build().unwrap_err().field(), "schema");
    assert_eq!(
        b().acquire_timeout(Duration::ZERO)
            .build()
            .unwrap_err()
            .field(),
        "acquire_timeout"
    );
    assert_eq!(
        b().idle_in_transaction_timeout(Duration::from_micros(10))
            .build()
            .unwrap_err()
            .field(),
        "idle_in_transaction_timeout"
    );
    assert_eq!(
        b().idle_in_transaction_timeout(Duration::from_secs(30 * 24 * 3600))
            .build()
            .unwrap_err()
            .field(),
        "idle_in_transaction_timeout"
    );
    assert_eq!(
        l().retention(Duration::ZERO).build().unwrap_err().field(),
        "retention"
    );
    assert_eq!(
        l().max_in_flight(0).build().unwrap_err().field(),
        "max_in_flight"
    );
    // Every refused setting is named, the backend's through the layer's build too.
    let both = b()
        .acquire_timeout(Duration::ZERO)
        .table("Bad")
        .build()
        .unwrap_err();
    assert_eq!(
        both.fields().collect::<Vec<_>>(),
        ["acquire_timeout", "table"]
    );
    let through_layer = TxIdempotencyLayer::with_backend(b().commit_timeout(Duration::ZERO))
        .max_in_flight(0)
        .build()
        .unwrap_err();
    assert_eq!(
        through_layer.fields().collect::<Vec<_>>(),
        ["max_in_flight", "commit_timeout"]
    );
    assert_eq!(l().backend().table_name(), env.store.table());
    let named = TxBackend::new(env.store.pool().clone())
        .schema(env.store.schema.clone())
        .build()
        .unwrap();
    assert_eq!(named.table_name(), env.store.table());
}

/// Guards outside the layer, through `from_extensions`.
#[test]
fn no_transaction_without_the_layer() {
    let err = IdempotentTx::from_extensions(&http::Extensions::new()).unwrap_err();
    assert_eq!(err.problem().kind(), ProblemKind::TransactionMissing);
}

/// The transactional layer reports like the store layer: one decision per request and
/// its round trips to the database (the opening with the key, the commit), under its
/// name, in the recorder it was built with.
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transactional_layer_counts_decisions_and_round_trips_by_name() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let env = Env::new(4).await;
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let layer =
        metrics::with_local_recorder(&recorder, || env.layer().name("ledger").build().unwrap());
    let app = env.app(layer);

    let first = send(&app, pay_req(Some("m-1"), "ok", "acc-1")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(
        send(&app, pay_req(Some("m-1"), "ok", "acc-1"))
            .await
            .replayed()
    );
    let changed = send(&app, pay_req(Some("m-1"), "ok", "acc-2")).await;
    assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);

    let seen = snapshotter.snapshot().into_vec();
    let value = |metric: &str, label: (&str, &str)| {
        seen.iter()
            .find(|(key, ..)| {
                let key = key.key();
                let labels: Vec<(&str, &str)> =
                    key.labels().map(|l| (l.key(), l.value())).collect();
                key.name() == metric && labels == [("name", "ledger"), label]
            })
            .map(|(.., value)| match value {
                DebugValue::Counter(n) => *n,
                DebugValue::Histogram(samples) => samples.len() as u64,
                DebugValue::Gauge(_) => panic!("{metric} is no gauge"),
            })
    };
    let requests = "retrysafe_idempotency_requests_total";
    assert_eq!(value(requests, ("decision", "first")), Some(1));
    assert_eq!(value(requests, ("decision", "replay")), Some(1));
    assert_eq!(value(requests, ("decision", "mismatch")), Some(1));
    assert_eq!(value(requests, ("decision", "in_flight")), Some(0));
    let store = "retrysafe_idempotency_store_seconds";
    assert_eq!(value(store, ("op", "claim")), Some(3));
    assert_eq!(value(store, ("op", "complete")), Some(1));
    assert_eq!(value(store, ("op", "release")), Some(0));
    env.pool_settles().await;
}
