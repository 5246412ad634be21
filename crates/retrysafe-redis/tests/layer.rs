//! The IdempotencyLayer over RedisStore: two app servers sharing one Redis (at
//! `REDIS_URL`) run a request's handler once, whichever of them the copies reach.
#![allow(clippy::unwrap_used, clippy::panic, missing_docs)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes, to_bytes};
use axum::extract::Request;
use axum::http::StatusCode;
use axum::routing::post;
use common::{fresh_prefix, manager};
use retrysafe_core::idempotency::Token;
use retrysafe_redis::RedisStore;
use retrysafe_tower::idempotency::{IdempotencyLayer, Principal};
use tower::ServiceExt;

/// One app server: its own connection to the shared Redis, its own layer.
async fn app_server(prefix: &str, effects: &Arc<AtomicUsize>) -> Router {
    let store = RedisStore::options()
        .key_prefix(prefix)
        .build(manager().await)
        .await
        .unwrap();
    let layer = IdempotencyLayer::new(store)
        .wait_for_in_flight(Duration::from_secs(10))
        .build()
        .unwrap();
    let effects = Arc::clone(effects);
    Router::new()
        .route(
            "/pay",
            post(move |body: Bytes| async move {
                // Slow enough that the copies arrive while it runs.
                tokio::time::sleep(Duration::from_millis(200)).await;
                let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
                (
                    StatusCode::CREATED,
                    format!("charge {n}: {}", String::from_utf8_lossy(&body)),
                )
            }),
        )
        .layer(layer)
        .layer(axum::middleware::map_request(
            |mut req: Request| async move {
                req.extensions_mut().insert(Principal::new("tenant-1"));
                req
            },
        ))
}

fn pay(key: &str, body: &'static str) -> Request {
    Request::post("/pay")
        .header("idempotency-key", key)
        .header("content-type", "text/plain")
        .body(Body::from(body))
        .unwrap()
}

async fn send(app: &Router, req: Request) -> (StatusCode, Option<String>, String) {
    let res = app.clone().oneshot(req).await.unwrap();
    let status = res.status();
    let replayed = res
        .headers()
        .get("idempotent-replayed")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = to_bytes(res.into_body(), usize::MAX).await.unwrap();
    (
        status,
        replayed,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_across_two_app_servers_run_the_handler_once() {
    let prefix = fresh_prefix();
    let effects = Arc::new(AtomicUsize::new(0));
    let servers = [
        app_server(&prefix, &effects).await,
        app_server(&prefix, &effects).await,
    ];
    let key = Token::random().to_hex();

    let mut copies = Vec::new();
    for app in servers.iter().cycle().take(8) {
        let app = app.clone();
        let key = key.clone();
        copies.push(tokio::spawn(async move {
            send(&app, pay(&key, "10 EUR")).await
        }));
    }
    let mut answers = Vec::new();
    for c in copies {
        answers.push(c.await.unwrap());
    }
    assert_eq!(effects.load(Ordering::SeqCst), 1, "the handler ran once");
    for (status, _, body) in &answers {
        assert_eq!(*status, StatusCode::CREATED, "{body}");
        assert_eq!(body, "charge 1: 10 EUR");
    }
    let replays = answers
        .iter()
        .filter(|(_, replayed, _)| replayed.as_deref() == Some("true"))
        .count();
    assert_eq!(replays, 7, "every copy but the first is a replay");

    // A late copy, on either server, is a replay too; another body is refused.
    for app in &servers {
        let (status, replayed, body) = send(app, pay(&key, "10 EUR")).await;
        assert_eq!(
            (status, replayed.as_deref(), body.as_str()),
            (StatusCode::CREATED, Some("true"), "charge 1: 10 EUR")
        );
        let (status, _, _) = send(app, pay(&key, "99 EUR")).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    }
    assert_eq!(effects.load(Ordering::SeqCst), 1);
}
