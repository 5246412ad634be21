//! A reqwest client with retrysafe's middleware in the standard order (deadline →
//! retry, charging a shared budget → breaker per host), from `ClientMiddlewares`.
//! The program starts a local server on 127.0.0.1:0 that is busy (503) on its first
//! call, POSTs once, prints what the server saw, and exits.
//! Run it with `cargo run --example reqwest_client`.
#![allow(clippy::print_stdout)]

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use retrysafe::RetryBudget;
use retrysafe::breaker::BreakerConfig;
use retrysafe::reqwest::{ClientMiddlewares, RetryMiddleware};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // The server: 503 on the first call, then 201; it notes the headers it got.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let orders = move |headers: HeaderMap| async move {
        let mut log = log.lock().unwrap_or_else(PoisonError::into_inner);
        log.push(headers);
        if log.len() == 1 {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::CREATED
        }
    };
    let app = axum::Router::new().route("/orders", axum::routing::post(orders));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/orders", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });

    // The client. A POST is retried only with an Idempotency-Key: generate one (the
    // same on every attempt) because this downstream honours keys.
    let budget = RetryBudget::ratio(); // share it between every client of this downstream
    let client = ClientMiddlewares::new()
        .deadline(Duration::from_secs(5))
        .retry(RetryMiddleware::new().generate_idempotency_keys())
        .budget(budget)
        .per_authority(BreakerConfig::default())
        .build()?
        .client(reqwest::Client::new());

    let response = client.post(&url).body(r#"{"sku":"b-7"}"#).send().await?;
    println!("status: {}", response.status().as_u16());
    let get = |h: &HeaderMap, name| {
        h.get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_owned()
    };
    let seen = seen.lock().unwrap_or_else(PoisonError::into_inner);
    for (n, h) in seen.iter().enumerate() {
        let (key, attempt) = (get(h, "idempotency-key"), get(h, "retry-attempt"));
        println!(
            "attempt {}: idempotency-key={key} retry-attempt={attempt}",
            n + 1
        );
    }
    Ok(())
}
