//! The real parts the outbox tests run against: a schema of their own in PostgreSQL,
//! an order service behind the transactional layer that enqueues, a downstream axum
//! server behind an `IdempotencyLayer` that counts its effects per key, the relay's
//! hyper client, and RabbitMQ queues of their own.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use retrysafe::idempotency::{IdempotencyLayer, Principal};
use retrysafe::memory::MemoryStore;
use retrysafe_postgres::PostgresStore;
use retrysafe_postgres::outbox::amqp::declare_queue;
use retrysafe_postgres::outbox::amqp::lapin::options::{
    BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use retrysafe_postgres::outbox::amqp::lapin::types::FieldTable;
use retrysafe_postgres::outbox::amqp::lapin::{Channel, Connection, ConnectionProperties};
use retrysafe_postgres::outbox::{Message, Outbox};
use retrysafe_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use retrysafe_postgres::sqlx::{self, PgPool};
use retrysafe_postgres::tx::{IdempotentTx, TxBackend, TxIdempotencyLayer};
use retrysafe_test_support::services::{database_url, pg_admin};
use tower::ServiceExt;

/// `AMQP_URL`, or the development broker.
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// A name no other test uses.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{prefix}{}_{}_{}",
        nanos % 1_000_000_000_000,
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A schema of one test, with a pool whose `search_path` is that schema, so the
/// default table names (store, outbox, processed ids) land in it. Dropped at the end.
pub struct Db {
    pub schema: String,
    pub pool: PgPool,
}

impl Db {
    pub async fn new() -> Db {
        let schema = unique("outbox_test_");
        let mut admin = pg_admin().await;
        sqlx::raw_sql(&format!("CREATE SCHEMA {schema}"))
            .execute(&mut admin)
            .await
            .unwrap();
        let options = PgConnectOptions::from_str(&database_url())
            .unwrap()
            .options([("search_path", schema.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await
            .unwrap();
        Outbox::new().migrate(&pool).await.unwrap();
        sqlx::raw_sql("CREATE TABLE orders (id bigserial PRIMARY KEY, body bytea NOT NULL);
                       CREATE TABLE consumed (id bigserial PRIMARY KEY, message_id text NOT NULL, body bytea NOT NULL);")
            .execute(&pool)
            .await
            .unwrap();
        Db { schema, pool }
    }

    /// The states of every outbox row, by id.
    pub async fn states(&self) -> Vec<(i64, i16, i32)> {
        sqlx::query_as("SELECT id, state, attempts FROM retrysafe_outbox ORDER BY id")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    /// Rows of the outbox in state `state`.
    pub async fn count(&self, state: i16) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM retrysafe_outbox WHERE state = $1")
            .bind(state)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// The child keys of the outbox rows, by id.
    pub async fn keys(&self) -> Vec<String> {
        sqlx::query_scalar("SELECT child_key FROM retrysafe_outbox ORDER BY id")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    /// Effects the consumer committed, per message id.
    pub async fn consumed(&self) -> HashMap<String, i64> {
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT message_id, count(*) FROM consumed GROUP BY message_id")
                .fetch_all(&self.pool)
                .await
                .unwrap();
        rows.into_iter().collect()
    }

    /// Enqueues `outgoing` with key `key` in a committed transaction of its own.
    pub async fn enqueue(
        &self,
        key: &str,
        outgoing: impl Into<retrysafe_postgres::outbox::Outgoing>,
    ) {
        let mut tx = self.pool.begin().await.unwrap();
        let key = retrysafe::wire::IdempotencyKey::new(key).unwrap();
        Outbox::new()
            .enqueue(&mut tx, &key, outgoing)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }

    /// The stored headers and the last error of the row with key `key`.
    pub async fn row(&self, key: &str) -> (Vec<u8>, Option<String>) {
        sqlx::query_as("SELECT headers, last_error FROM retrysafe_outbox WHERE child_key = $1")
            .bind(key)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Enqueues `n` HTTP posts to `url` (and, with `queue`, as many messages) in one
    /// committed transaction each, as a handler would, with keys `k-0`, `k-1`, ….
    pub async fn enqueue_posts(
        &self,
        url: &str,
        queue: Option<&str>,
        n: usize,
        ordering: Option<&str>,
    ) {
        for i in 0..n {
            let mut tx = self.pool.begin().await.unwrap();
            let request = http::Request::post(url)
                .body(Bytes::from(format!("{i}")))
                .unwrap();
            let mut outgoing = retrysafe_postgres::outbox::Outgoing::from(request);
            if let Some(o) = ordering {
                outgoing = outgoing.ordering_key(o);
            }
            let key = retrysafe::wire::IdempotencyKey::new(&format!("k-{i}")).unwrap();
            Outbox::new()
                .enqueue(&mut tx, &key, outgoing)
                .await
                .unwrap();
            if let Some(queue) = queue {
                let key = retrysafe::wire::IdempotencyKey::new(&format!("m-{i}")).unwrap();
                Outbox::new()
                    .enqueue(&mut tx, &key, Message::new("", queue, format!("{i}")))
                    .await
                    .unwrap();
            }
            tx.commit().await.unwrap();
        }
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        let schema = self.schema.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let mut admin = pg_admin().await;
                let _ = sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                    .execute(&mut admin)
                    .await;
            });
        })
        .join();
    }
}

/// What the downstream saw.
#[derive(Default)]
pub struct Seen {
    /// Requests that reached the handler, per key (an effect each).
    pub effects: Mutex<HashMap<String, u64>>,
    /// Bodies in the order their effects happened.
    pub order: Mutex<Vec<String>>,
    /// Requests that reached the server at all (replays and refusals too).
    pub requests: AtomicU64,
    /// Answer 503 to this many requests first.
    pub fail_first: AtomicU64,
    /// Answer 422 to every request.
    pub reject: std::sync::atomic::AtomicBool,
}

impl Seen {
    pub fn effects_of(&self, key: &str) -> u64 {
        self.effects.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    pub fn total_effects(&self) -> u64 {
        self.effects.lock().unwrap().values().sum()
    }

    pub fn duplicates(&self) -> u64 {
        self.effects
            .lock()
            .unwrap()
            .values()
            .map(|n| n.saturating_sub(1))
            .sum()
    }
}

/// The downstream service: `POST /effects`, behind an `IdempotencyLayer` over a
/// `MemoryStore` (key required); each run of the handler is one effect.
pub async fn downstream() -> (SocketAddr, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let app = Router::new()
        .route("/effects", post(effect))
        .with_state(Arc::clone(&seen))
        .layer(IdempotencyLayer::new(MemoryStore::new()).require_key())
        .layer(axum::middleware::map_request(
            |mut req: Request| async move {
                req.extensions_mut().insert(Principal::new("relay"));
                req
            },
        ));
    let counted = Arc::clone(&seen);
    let app = app.layer(axum::middleware::map_request(move |req: Request| {
        counted.requests.fetch_add(1, Ordering::SeqCst);
        async move { req }
    }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, seen)
}

async fn effect(
    State(seen): State<Arc<Seen>>,
    headers: HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if seen.reject.load(Ordering::SeqCst) {
        return StatusCode::UNPROCESSABLE_ENTITY.into_response();
    }
    if seen.fail_first.load(Ordering::SeqCst) > 0 {
        seen.fail_first.fetch_sub(1, Ordering::SeqCst);
        // Nothing happened: marked so, the key is released and the retry runs.
        let mut answer = (StatusCode::SERVICE_UNAVAILABLE, [("retry-after", "0")]).into_response();
        answer
            .extensions_mut()
            .insert(retrysafe::idempotency::NoEffect);
        return answer;
    }
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    *seen.effects.lock().unwrap().entry(key).or_default() += 1;
    seen.order
        .lock()
        .unwrap()
        .push(String::from_utf8_lossy(&body).into_owned());
    StatusCode::CREATED.into_response()
}

/// The relay's HTTP client: hyper's, as a tower service.
pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// The order service: `POST /orders` writes an order and enqueues a call to
/// `downstream` and, with `queue`, a message, in the request's transaction.
pub async fn order_service(db: &Db, downstream: SocketAddr, queue: Option<String>) -> Router {
    let store = PostgresStore::options()
        .connect_with(
            PgConnectOptions::from_str(&database_url())
                .unwrap()
                .options([("search_path", db.schema.as_str())]),
        )
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let target = Arc::new((format!("http://{downstream}/effects"), queue));
    Router::new()
        .route(
            "/orders",
            post(move |mut tx: IdempotentTx, body: Bytes| {
                let target = Arc::clone(&target);
                async move {
                    sqlx::query("INSERT INTO orders (body) VALUES ($1)")
                        .bind(&body[..])
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    let call = http::Request::post(&target.0)
                        .header("authorization", "Bearer s3cret")
                        .body(body.clone())
                        .unwrap();
                    tx.enqueue(call).await.unwrap();
                    if let Some(queue) = &target.1 {
                        tx.enqueue(Message::new("", queue.as_str(), body))
                            .await
                            .unwrap();
                    }
                    StatusCode::CREATED
                }
            }),
        )
        .layer(TxIdempotencyLayer::with_backend(TxBackend::from_store(&store)).require_key())
        .layer(axum::middleware::map_request(
            |mut req: Request| async move {
                req.extensions_mut().insert(Principal::new("shop"));
                req
            },
        ))
}

/// Posts an order with `key` to the order service.
pub async fn place_order(app: &Router, key: &str, body: &str) -> StatusCode {
    let request = http::Request::post("/orders")
        .header("idempotency-key", key)
        .body(axum::body::Body::from(body.to_owned()))
        .unwrap();
    app.clone().oneshot(request).await.unwrap().status()
}

/// A connection to the broker, and a fresh durable queue with its dead-letter queue
/// (deleted when dropped is not needed: names are unique, and the queues auto-expire).
pub struct Broker {
    pub conn: Connection,
    pub channel: Channel,
    pub queue: String,
}

impl Broker {
    pub async fn new() -> Broker {
        Self::at(&amqp_url()).await
    }

    pub async fn at(url: &str) -> Broker {
        let conn = Connection::connect(url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("cannot reach RabbitMQ at AMQP_URL={url} ({e}); start it (rabbitmq-server -detached)"));
        let channel = conn.create_channel().await.unwrap();
        let queue = unique("outbox_test_q_");
        declare_queue(&channel, &queue).await.unwrap();
        Broker {
            conn,
            channel,
            queue,
        }
    }

    /// Messages ready in `queue`.
    pub async fn ready(&self, queue: &str) -> u32 {
        let q = self
            .channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        q.message_count()
    }

    /// Takes one message of `queue`, if any (acknowledged), and returns its body.
    pub async fn get(&self, queue: &str) -> Option<Vec<u8>> {
        let m = self
            .channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()?;
        Some(m.delivery.data)
    }

    pub async fn cleanup(self) {
        for q in [self.queue.clone(), format!("{}.dead", self.queue)] {
            let _ = self
                .channel
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = self.conn.close(200, "bye".into()).await;
    }
}

/// Polls `check` every 50 ms until it is `Some`, for at most `within` (a bound on the
/// test, not a timing assertion).
pub async fn eventually<T, F, Fut>(what: &str, within: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let end = tokio::time::Instant::now() + within;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
