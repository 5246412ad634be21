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

mod commit_and_rollback;
mod connections;
mod duplicates;
mod layer;
mod requests;

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
use retrysafe_core::idempotency::{Principal, RecordId, Scope};
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_postgres::sqlx;
use retrysafe_postgres::tx::{IdempotentTx, NoEffect, TxBackend, TxIdempotencyLayer};
use retrysafe_test_support::pg_store::{TestStore, isolated_store, pg_admin};
use retrysafe_tower::idempotency::ProblemKind;
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
        let mut conn = pg_admin().await;
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
        let mut conn = pg_admin().await;
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
