//! Declared commit points on every store and mode, over loopback HTTP: a handler that
//! declares its commit point and fails (a 5xx, a panic) *before* reaching it had no
//! effect by its own declaration, so its key is released and the answer invites a
//! retry (no `do-not-retry`); the next copy runs. A failure *past* the commit point is
//! `outcome_unknown` (marked `do-not-retry`, later copies get 500 `outcome-unknown`),
//! except in the transactional mode, where it rolls back like everything else.
//!
//! Stores: `MemoryStore`, `RedisStore` (`REDIS_URL`, default 127.0.0.1:6379),
//! `PostgresStore` and the transactional layer (`DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`), each test in its own key prefix or schema.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    reason = "test code: panics are the assertions"
)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use retrysafe::idempotency::{IdempotencyContext, IdempotencyLayer};
use retrysafe::memory::MemoryStore;
use retrysafe::postgres::PostgresStore;
use retrysafe::postgres::sqlx::postgres::PgConnectOptions;
use retrysafe::postgres::tx::{IdempotentTx, TxBackend, TxIdempotencyLayer};
use retrysafe::redis::RedisStore;
use retrysafe::redis::redis;
use retrysafe::server::ServerLayers;

/// Effects per idempotency key, as the handler made them.
type Effects = Arc<Mutex<HashMap<String, u32>>>;

/// The handler: `x-mode` (outside the fingerprint) says how it behaves.
/// - `fail-before`: answers 503 "busy" before its commit point;
/// - `panic-before`: panics before its commit point;
/// - `fail-after`: passes its commit point, then answers 503;
/// - otherwise: passes its commit point, makes its effect and answers 201.
async fn pay(
    State(effects): State<Effects>,
    context: Option<Extension<IdempotencyContext>>,
    tx: Option<IdempotentTx>,
    headers: HeaderMap,
) -> Response {
    let mode = headers
        .get("x-mode")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("ok")
        .to_owned();
    match mode.as_str() {
        "fail-before" => return (StatusCode::SERVICE_UNAVAILABLE, "busy").into_response(),
        "panic-before" => panic!("the handler fails before its commit point"),
        _ => {}
    }
    let Some(Extension(context)) = context else {
        return (StatusCode::INTERNAL_SERVER_ERROR, "no idempotency context").into_response();
    };
    context.commit_point().await.unwrap();
    if mode == "fail-after" {
        return (StatusCode::SERVICE_UNAVAILABLE, "lost the ledger").into_response();
    }
    // The transactional layer would commit this with the key; here the count is what
    // the assertions read.
    drop(tx);
    *effects
        .lock()
        .unwrap()
        .entry(context.key().as_str().to_owned())
        .or_default() += 1;
    (StatusCode::CREATED, "paid").into_response()
}

/// The handler's router, to be layered.
fn app(effects: Effects) -> Router {
    Router::new().route("/pay", post(pay)).with_state(effects)
}

/// Serves `app` on a loopback port; its base URL.
async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// A name no other run uses.
fn unique() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{:x}{:x}", std::process::id(), nanos)
}

struct Answer {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: String,
}

impl Answer {
    fn do_not_retry(&self) -> bool {
        self.headers.contains_key("do-not-retry")
    }

    fn replayed(&self) -> bool {
        self.headers.contains_key("idempotent-replayed")
    }

    fn problem_type(&self) -> String {
        let json: serde_json::Value = serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not a problem ({e}): {} {}", self.status, self.body));
        json["type"].as_str().unwrap_or_default().to_owned()
    }
}

async fn post_as(base: &str, key: &str, mode: &str) -> Answer {
    let res = reqwest::Client::new()
        .post(format!("{base}/pay"))
        .header("idempotency-key", key)
        .header("x-mode", mode)
        .body("{}")
        .send()
        .await
        .unwrap();
    Answer {
        status: res.status(),
        headers: res.headers().clone(),
        body: res.text().await.unwrap(),
    }
}

/// Whether a failure past the commit point is rolled back (the transactional mode)
/// rather than left `outcome_unknown`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Store,
    Transactional,
}

async fn check(name: &str, base: &str, effects: &Effects, mode: Mode) {
    let count = |key: &str| effects.lock().unwrap().get(key).copied().unwrap_or(0);

    // A 5xx before the commit point: answered as it is, without do-not-retry; released.
    let busy = post_as(base, "busy", "fail-before").await;
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE, "{name}");
    assert_eq!(busy.body, "busy", "{name}: the handler's own answer");
    assert!(
        !busy.do_not_retry(),
        "{name}: nothing happened, a retry is safe"
    );
    let retry = post_as(base, "busy", "ok").await;
    assert_eq!(retry.status, StatusCode::CREATED, "{name}: {}", retry.body);
    assert!(!retry.replayed(), "{name}: the retry ran the handler");
    let again = post_as(base, "busy", "ok").await;
    assert!(again.replayed(), "{name}: and its answer is kept");
    assert_eq!(count("busy"), 1, "{name}");

    // A panic before the commit point: the retryable 500 handler-panicked.
    let panicked = post_as(base, "panicked", "panic-before").await;
    assert_eq!(panicked.status, StatusCode::INTERNAL_SERVER_ERROR, "{name}");
    assert_eq!(
        panicked.problem_type(),
        "urn:retrysafe:problem:handler-panicked",
        "{name}"
    );
    assert!(!panicked.do_not_retry(), "{name}");
    let retry = post_as(base, "panicked", "ok").await;
    assert_eq!(retry.status, StatusCode::CREATED, "{name}: {}", retry.body);
    assert_eq!(count("panicked"), 1, "{name}");

    // A 5xx past the commit point.
    let lost = post_as(base, "lost", "fail-after").await;
    assert_eq!(lost.status, StatusCode::SERVICE_UNAVAILABLE, "{name}");
    let later = post_as(base, "lost", "ok").await;
    match mode {
        Mode::Store => {
            assert!(
                lost.do_not_retry(),
                "{name}: past the commit point: unknown"
            );
            assert_eq!(later.status, StatusCode::INTERNAL_SERVER_ERROR, "{name}");
            assert_eq!(
                later.problem_type(),
                "urn:retrysafe:problem:outcome-unknown",
                "{name}"
            );
            assert!(later.do_not_retry(), "{name}");
            assert_eq!(count("lost"), 0, "{name}: never run again");
        }
        Mode::Transactional => {
            assert!(!lost.do_not_retry(), "{name}: rolled back, a retry is safe");
            assert_eq!(later.status, StatusCode::CREATED, "{name}: {}", later.body);
            assert_eq!(count("lost"), 1, "{name}");
        }
    }
}

fn layer_over(layer: IdempotencyLayer) -> IdempotencyLayer {
    layer
        .global_scope()
        .require_key()
        .handlers_declare_commit_point()
        .build()
        .unwrap()
}

/// A fresh schema name; the PostgreSQL tests' support drops `rspg_<secs>_` schemas an
/// hour later.
fn schema() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("rspg_{secs}_{}", unique())
}

async fn postgres_store() -> PostgresStore {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let options: PgConnectOptions = url.parse().unwrap();
    let store = PostgresStore::options()
        .schema(schema())
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {url}: {e}"));
    store.migrate().await.unwrap();
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store() {
    let effects = Effects::default();
    let layer = layer_over(IdempotencyLayer::new(MemoryStore::new()));
    let base = serve(app(effects.clone()).layer(layer)).await;
    check("memory", &base, &effects, Mode::Store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store() {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let client = redis::Client::open(url.as_str()).unwrap();
    let conn = tokio::time::timeout(
        Duration::from_secs(10),
        redis::aio::ConnectionManager::new(client),
    )
    .await
    .unwrap_or_else(|_| panic!("Redis at {url} did not answer"))
    .unwrap_or_else(|e| panic!("cannot reach Redis at {url}: {e}"));
    let prefix = format!("commit_point:{}:", unique());
    let store = RedisStore::options()
        .key_prefix(prefix)
        .build(conn)
        .await
        .unwrap();
    let effects = Effects::default();
    let base = serve(app(effects.clone()).layer(layer_over(IdempotencyLayer::new(store)))).await;
    check("redis", &base, &effects, Mode::Store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_plain() {
    let store = postgres_store().await;
    let effects = Effects::default();
    let base = serve(app(effects.clone()).layer(layer_over(IdempotencyLayer::new(store)))).await;
    check("postgres", &base, &effects, Mode::Store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_transactional() {
    let store = postgres_store().await;
    let layer = TxIdempotencyLayer::with_backend(TxBackend::from_store(&store))
        .global_scope()
        .require_key()
        .build()
        .unwrap();
    // The recommended order takes the transactional layer as it takes the other.
    let layer = ServerLayers::new(layer).build().unwrap();
    let effects = Effects::default();
    let base = serve(app(effects.clone()).layer(layer)).await;
    check("transactional", &base, &effects, Mode::Transactional).await;
}
