//! The relay against what a real downstream behind an `IdempotencyLayer` answers: a
//! send cut off while the downstream still runs it (then 409 `request-in-flight`), and
//! a relay whose client stack is retrysafe's own with a layer adding `authorization`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use retrysafe::ClientLayers;
use retrysafe::idempotency::{IdempotencyLayer, NoEffect, Principal};
use retrysafe::memory::MemoryStore;
use retrysafe::retry::ReplayBody;
use retrysafe_postgres::outbox::OutboxRelay;
use tokio::sync::Semaphore;
use tower::ServiceBuilder;

use crate::harness::{Db, client, eventually};

const SUCCEEDED: i16 = 1;

/// What the downstream saw and how it behaves.
#[derive(Default)]
struct Downstream {
    /// Runs of the handler (effects).
    effects: AtomicU64,
    /// Requests that reached the server, and their `authorization` headers.
    authorization: Mutex<Vec<Option<String>>>,
    /// 409 answers with a `retry-after`.
    in_flight_answers: AtomicU64,
    /// Answer the first request 503 (nothing happened), the retry runs.
    fail_first: AtomicBool,
    /// The handler, after its effect, waits for a permit of this gate.
    gate: Option<Arc<Semaphore>>,
}

/// `POST /effects` behind an `IdempotencyLayer` (key required). Each request runs on a
/// task of its own, so it completes even when the client goes away, as a downstream
/// that started an effect does.
async fn serve(downstream: Downstream) -> (SocketAddr, Arc<Downstream>) {
    let seen = Arc::new(downstream);
    let counted = Arc::clone(&seen);
    let app = Router::new()
        .route("/effects", post(effect))
        .with_state(Arc::clone(&seen))
        .layer(IdempotencyLayer::new(MemoryStore::new()).require_key())
        .layer(axum::middleware::map_request(
            |mut req: Request| async move {
                req.extensions_mut().insert(Principal::new("relay"));
                req
            },
        ))
        .layer(axum::middleware::from_fn(detached))
        .layer(axum::middleware::from_fn(
            move |req: Request, next: Next| {
                let seen = Arc::clone(&counted);
                async move {
                    let auth = req
                        .headers()
                        .get("authorization")
                        .map(|v| v.to_str().unwrap().to_owned());
                    seen.authorization.lock().unwrap().push(auth);
                    let answer = next.run(req).await;
                    if answer.status() == StatusCode::CONFLICT
                        && answer.headers().contains_key("retry-after")
                    {
                        seen.in_flight_answers.fetch_add(1, Ordering::SeqCst);
                    }
                    answer
                }
            },
        ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, seen)
}

/// Runs the rest of the stack on a task of its own.
async fn detached(req: Request, next: Next) -> Response {
    tokio::spawn(next.run(req)).await.unwrap()
}

async fn effect(State(seen): State<Arc<Downstream>>, _headers: HeaderMap) -> Response {
    if seen.fail_first.swap(false, Ordering::SeqCst) {
        let mut answer = (StatusCode::SERVICE_UNAVAILABLE, [("retry-after", "0")]).into_response();
        answer.extensions_mut().insert(NoEffect);
        return answer;
    }
    seen.effects.fetch_add(1, Ordering::SeqCst);
    if let Some(gate) = &seen.gate {
        let _permit = gate.acquire().await.unwrap();
    }
    StatusCode::CREATED.into_response()
}

/// A short-backoff relay of `db` through `client`.
fn relay_with<S, B, RB>(db: &Db, client: S, send_timeout: Duration) -> OutboxRelay
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<retrysafe::BoxError>,
    B: From<Bytes> + Send + 'static,
    RB: Send + 'static,
{
    OutboxRelay::new(db.pool.clone())
        .http_client(client)
        .send_timeout(send_timeout)
        .lease(send_timeout * 3)
        .backoff(retrysafe::retry::Backoff::new(
            Duration::from_millis(10),
            Duration::from_millis(50),
            retrysafe::retry::Jitter::Full,
        ))
}

#[tokio::test]
async fn a_send_cut_off_meets_request_in_flight_and_succeeds_later_with_one_effect() {
    let db = Db::new().await;
    let gate = Arc::new(Semaphore::new(0));
    let (addr, seen) = serve(Downstream {
        gate: Some(Arc::clone(&gate)),
        ..Downstream::default()
    })
    .await;
    db.enqueue(
        "k-0",
        http::Request::post(format!("http://{addr}/effects"))
            .body(Bytes::from_static(b"x"))
            .unwrap(),
    )
    .await;
    // The handler holds the first send until the gate opens, far past the relay's
    // send timeout: the relay gives up on it while the downstream still runs it.
    let relay = relay_with(&db, client(), Duration::from_millis(300))
        .build()
        .unwrap();
    let relay = Arc::new(relay);
    let passes = {
        let relay = Arc::clone(&relay);
        let pool = db.pool.clone();
        tokio::spawn(async move {
            let mut retried = 0;
            loop {
                retried += relay.run_once().await.unwrap().retried;
                let done: i64 = retrysafe_postgres::sqlx::query_scalar(
                    "SELECT count(*) FROM retrysafe_outbox WHERE state = 1",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                if done == 1 {
                    return retried;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    // A resend finds the key in flight: 409 with retry-after, retried later.
    eventually(
        "a 409 request-in-flight",
        Duration::from_secs(30),
        || async { (seen.in_flight_answers.load(Ordering::SeqCst) >= 1).then_some(()) },
    )
    .await;
    assert_eq!(db.count(0).await, 1, "still pending after the 409");
    gate.add_permits(1);
    let retried = tokio::time::timeout(Duration::from_secs(30), passes)
        .await
        .unwrap()
        .unwrap();
    // The cut-off send and at least one 409 were retried; the last send got the
    // replay of the one run.
    assert!(retried >= 2, "{retried}");
    assert_eq!(seen.effects.load(Ordering::SeqCst), 1);
    assert_eq!(db.count(SUCCEEDED).await, 1);
    let (_, _, attempts) = db.states().await[0];
    assert!(attempts >= 3, "{attempts}");
}

#[tokio::test]
async fn a_relay_through_client_layers_adds_authorization_the_row_never_stored() {
    type Transport = Client<HttpConnector, ReplayBody<Full<Bytes>>>;
    let db = Db::new().await;
    let (addr, seen) = serve(Downstream {
        fail_first: AtomicBool::new(true),
        ..Downstream::default()
    })
    .await;
    db.enqueue(
        "k-0",
        http::Request::post(format!("http://{addr}/effects"))
            .header("authorization", "Bearer user-token")
            .body(Bytes::from_static(b"x"))
            .unwrap(),
    )
    .await;
    let (stored, _) = db.row("k-0").await;
    assert!(!String::from_utf8_lossy(&stored).contains("token"));

    let transport: Transport = Client::builder(TokioExecutor::new()).build_http();
    let stack = ServiceBuilder::new()
        .map_request(|mut request: http::Request<Full<Bytes>>| {
            request.headers_mut().insert(
                http::header::AUTHORIZATION,
                http::HeaderValue::from_static("Bearer relay-token"),
            );
            request
        })
        .layer(ClientLayers::new().build().unwrap())
        .service(transport);
    let relay = relay_with(&db, stack, Duration::from_secs(5))
        .build()
        .unwrap();
    eventually("delivered", Duration::from_secs(30), || async {
        relay.run_once().await.unwrap();
        (db.count(SUCCEEDED).await == 1).then_some(())
    })
    .await;
    // The 503 and the send that followed both carried the stack's credentials.
    let seen_auth = seen.authorization.lock().unwrap().clone();
    assert_eq!(seen_auth.len(), 2, "{seen_auth:?}");
    assert!(
        seen_auth
            .iter()
            .all(|a| a.as_deref() == Some("Bearer relay-token")),
        "{seen_auth:?}"
    );
    assert_eq!(seen.effects.load(Ordering::SeqCst), 1);
}
