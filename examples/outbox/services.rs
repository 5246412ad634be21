//! The three services of the example, on loopback: the order service, the downstream
//! service, and the database and queue they share.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use retrysafe::idempotency::{IdempotencyLayer, Principal};
use retrysafe::memory::MemoryStore;
use retrysafe::postgres::PostgresStore;
use retrysafe::postgres::consumer::Consumer;
use retrysafe::postgres::outbox::amqp::declare_queue;
use retrysafe::postgres::outbox::amqp::lapin::options::QueueDeleteOptions;
use retrysafe::postgres::outbox::amqp::lapin::{Connection, ConnectionProperties};
use retrysafe::postgres::outbox::{Message, Outbox};
use retrysafe::postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use retrysafe::postgres::sqlx::{self, PgPool};
use retrysafe::postgres::tx::{IdempotentTx, TxBackend, TxIdempotencyLayer};

use crate::Options;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Microseconds since the epoch, now.
pub(crate) fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// The run's schema (every table) and queue, removed by [`Env::cleanup`].
pub(crate) struct Env {
    pub(crate) schema: String,
    pub(crate) queue: String,
    pub(crate) pool: PgPool,
    pub(crate) store: PostgresStore,
}

impl Env {
    pub(crate) async fn new(options: &Options) -> Result<Env, Error> {
        let suffix = format!("{}_{}", std::process::id(), now_micros() % 1_000_000_000);
        let schema = format!("outbox_example_{suffix}");
        let connect = PgConnectOptions::from_str(&options.database)?;
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(connect.clone())
            .await?;
        sqlx::raw_sql(&format!("CREATE SCHEMA {schema}"))
            .execute(&admin)
            .await?;
        admin.close().await;
        let scoped = connect.options([("search_path", schema.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(12)
            .connect_with(scoped.clone())
            .await?;
        let store = PostgresStore::options().connect_with(scoped).await?;
        store.migrate().await?;
        Outbox::new().migrate(&pool).await?;
        Consumer::new(pool.clone(), "example").migrate().await?;
        sqlx::raw_sql(
            "CREATE TABLE orders (id bigserial PRIMARY KEY, body text NOT NULL);
             CREATE TABLE consumed (message_id text NOT NULL, body text NOT NULL,
                                    at timestamptz NOT NULL DEFAULT clock_timestamp());",
        )
        .execute(&pool)
        .await?;
        let queue = format!("outbox_example_{suffix}");
        let conn = Connection::connect(&options.amqp, ConnectionProperties::default()).await?;
        let channel = conn.create_channel().await?;
        declare_queue(&channel, &queue).await?;
        let _ = conn.close(200, "declared".into()).await;
        Ok(Env {
            schema,
            queue,
            pool,
            store,
        })
    }

    /// The consumer of the run.
    pub(crate) fn consumer(&self) -> Result<Consumer, Error> {
        Ok(Consumer::new(self.pool.clone(), "example").build()?)
    }

    pub(crate) async fn cleanup(&self, options: &Options) {
        if let Ok(conn) = Connection::connect(&options.amqp, ConnectionProperties::default()).await
        {
            if let Ok(channel) = conn.create_channel().await {
                for q in [self.queue.clone(), format!("{}.dead", self.queue)] {
                    let _ = channel
                        .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                        .await;
                }
            }
            let _ = conn.close(200, "done".into()).await;
        }
        let _ = sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema))
            .execute(&self.pool)
            .await;
    }
}

/// What the downstream service saw.
#[derive(Default)]
pub(crate) struct Downstream {
    /// Effects per key, with the time of the first.
    pub(crate) effects: Mutex<HashMap<String, (u64, i64)>>,
    /// Requests that reached the server (replays included).
    pub(crate) requests: AtomicU64,
}

/// Starts the downstream service: `POST /effects` behind an `IdempotencyLayer`.
pub(crate) async fn downstream() -> Result<(SocketAddr, Arc<Downstream>), Error> {
    let seen = Arc::new(Downstream::default());
    let counted = Arc::clone(&seen);
    let app = Router::new()
        .route("/effects", post(effect))
        .with_state(Arc::clone(&seen))
        .layer(IdempotencyLayer::new(MemoryStore::new()).require_key())
        .layer(axum::middleware::map_request(
            |mut req: Request| async move {
                req.extensions_mut().insert(Principal::new("order-service"));
                req
            },
        ))
        .layer(axum::middleware::map_request(move |req: Request| {
            counted.requests.fetch_add(1, Ordering::Relaxed);
            async move { req }
        }));
    serve(app).await.map(|addr| (addr, seen))
}

async fn effect(State(seen): State<Arc<Downstream>>, headers: HeaderMap) -> StatusCode {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let mut effects = seen.effects.lock().unwrap();
    let entry = effects.entry(key).or_insert((0, now_micros()));
    entry.0 += 1;
    StatusCode::CREATED
}

/// Starts the order service: `POST /orders` writes the order and enqueues the
/// downstream call and the event, in the request's transaction.
pub(crate) async fn orders(env: &Env, downstream: SocketAddr) -> Result<SocketAddr, Error> {
    let target = Arc::new((format!("http://{downstream}/effects"), env.queue.clone()));
    let app = Router::new()
        .route(
            "/orders",
            post(move |tx: IdempotentTx, body: String| place(tx, body, Arc::clone(&target))),
        )
        .layer(TxIdempotencyLayer::with_backend(TxBackend::from_store(&env.store)).require_key())
        .layer(axum::middleware::map_request(
            |mut req: Request| async move {
                req.extensions_mut().insert(Principal::new("shop"));
                req
            },
        ));
    serve(app).await
}

async fn place(mut tx: IdempotentTx, body: String, target: Arc<(String, String)>) -> StatusCode {
    let call = http::Request::post(&target.0)
        .header("content-type", "text/plain")
        .body(Bytes::from(body.clone()));
    let result = async {
        sqlx::query("INSERT INTO orders (body) VALUES ($1)")
            .bind(&body)
            .execute(&mut *tx)
            .await?;
        tx.enqueue(call?).await?;
        tx.enqueue(Message::new("", target.1.as_str(), body))
            .await?;
        Ok::<_, Error>(())
    }
    .await;
    match result {
        Ok(()) => StatusCode::CREATED,
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

async fn serve(app: Router) -> Result<SocketAddr, Error> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}
