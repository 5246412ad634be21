//! An axum service whose POST is safe to retry: `ServerLayers` puts an authentication
//! layer (which inserts the `Principal`, the key's scope) around an `IdempotencyLayer`
//! on the embedded `MemoryStore`. The program serves on 127.0.0.1:0, sends the same
//! request twice and a changed one once, prints what came back, and exits.
//! Run it with `cargo run --example axum_server`.
#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::{Extension, Router, routing::post};
use retrysafe::idempotency::{IdempotencyContext, IdempotencyLayer, Principal};
use retrysafe::server::ServerLayers;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let charges = Arc::new(AtomicU32::new(0));
    let counter = charges.clone();
    let pay = move |Extension(ctx): Extension<IdempotencyContext>, body: String| async move {
        // Before this point a crashed holder's claim can be taken over by a retry.
        if ctx.commit_point().await.is_err() {
            return (StatusCode::SERVICE_UNAVAILABLE, String::new());
        }
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1; // the effect: charge once
        (StatusCode::CREATED, format!("charge {n}: {body}"))
    };
    // Your authentication: whoever the caller is becomes the scope of its keys.
    let auth = axum::middleware::map_request(|mut req: Request<Body>| async move {
        req.extensions_mut().insert(Principal::new("alice"));
        req
    });
    let layers = ServerLayers::new(
        IdempotencyLayer::in_memory()
            .require_key()
            .handlers_declare_commit_point(),
    )
    .authentication(auth)
    .concurrency_limit(64)
    .build()?;
    let app = Router::new().route("/payments", post(pay)).layer(layers);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/payments", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });

    let client = reqwest::Client::new();
    for body in ["10 EUR", "10 EUR", "99 EUR"] {
        let request = client.post(&url).header("idempotency-key", "pay-42");
        let response = request.body(body).send().await?;
        let status = response.status().as_u16();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let text = response.text().await?;
        println!("POST {body}: {status} replayed={replayed} {text}");
    }
    println!("charges: {}", charges.load(Ordering::SeqCst));
    Ok(())
}
