//! retrysafe in one command: `cargo run --example quickstart`.
//!
//! An axum server records payments behind an `IdempotencyLayer` (in-memory store). Its
//! handler fails the first copy of one request in ten transiently (a 503 marked
//! `NoEffect`: nothing recorded), and for another one in ten it records the payment
//! and then loses the response (the connection is closed unanswered). A client sends
//! POSTs *without* keys through `ClientLayers`, whose `RetryLayer` generates one
//! idempotency key per logical request and resends it on every attempt: the failures
//! are retried, and each payment is recorded once. The program prints logical
//! requests, attempts, effects and `duplicates: N`, and fails unless N is 0.
#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Router, routing::post};
use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use http_body_util::Full;
use hyper_util::rt::{TokioExecutor, TokioIo};
use retrysafe::idempotency::{IdempotencyContext, IdempotencyLayer, NoEffect};
use retrysafe::{ClientLayers, ReplayBody, RetryLayer};
use tower::{ServiceBuilder, ServiceExt};

/// Logical requests sent through the client stack.
const REQUESTS: u64 = 200;

/// The server's side: payments recorded per key it saw, and the faults it played.
#[derive(Default)]
struct Server {
    effects: Mutex<HashMap<String, u64>>,
    failed: AtomicU64,
    lost: AtomicU64,
}

impl Server {
    fn effects(&self) -> MutexGuard<'_, HashMap<String, u64>> {
        self.effects.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Marks a response the connection loses instead of sending.
#[derive(Clone)]
struct Lose;

/// `POST /pay`: the first copy of one key in ten fails before its effect; the first
/// copy of another one in ten records its effect and loses its answer.
async fn pay(
    Extension(server): Extension<Arc<Server>>,
    Extension(ctx): Extension<IdempotencyContext>,
    headers: HeaderMap,
) -> Response {
    let key = headers.get("idempotency-key").and_then(|k| k.to_str().ok());
    let key = key.unwrap_or_default().to_owned();
    let first = {
        let mut effects = server.effects();
        let known = effects.len();
        effects.entry(key.clone()).or_default();
        (effects.len() > known).then_some(effects.len() % 10)
    };
    if first == Some(3) {
        server.failed.fetch_add(1, Ordering::Relaxed);
        return (StatusCode::SERVICE_UNAVAILABLE, Extension(NoEffect)).into_response();
    }
    if ctx.commit_point().await.is_err() {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    *server.effects().entry(key).or_default() += 1; // the payment
    if first == Some(7) {
        server.lost.fetch_add(1, Ordering::Relaxed);
        return (StatusCode::CREATED, Extension(Lose)).into_response();
    }
    StatusCode::CREATED.into_response()
}

/// Serves `app` on `listener` with hyper's connection API, so that an answer marked
/// [`Lose`] can close its connection unanswered (a service error does that).
async fn serve(listener: tokio::net::TcpListener, app: Router) {
    while let Ok((tcp, _)) = listener.accept().await {
        let app = app.clone();
        let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
            let app = app.clone();
            async move {
                let Ok(res) = app.oneshot(req.map(Body::new)).await;
                match res.extensions().get::<Lose>() {
                    Some(Lose) => Err(std::io::Error::other("the response is lost")),
                    None => Ok(res),
                }
            }
        });
        tokio::spawn(async move {
            let conn = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            let _ = conn.serve_connection(TokioIo::new(tcp), service).await;
        });
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    let server = Arc::new(Server::default());
    // One trusted caller here: a service with several scopes each caller's keys by its
    // `Principal` (see the `axum_server` example).
    let idempotency = IdempotencyLayer::in_memory()
        .require_key()
        .global_scope()
        .handlers_declare_commit_point();
    let app = Router::new().route("/pay", post(pay)).layer(idempotency);
    let app = app.layer(Extension(server.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/pay", listener.local_addr()?);
    tokio::spawn(serve(listener, app));
    println!("payments server on {url} (in-memory store)");

    // The client stack: one generated key per logical request, the same on every retry.
    let attempts = Arc::new(AtomicU64::new(0));
    let counted = attempts.clone();
    let stack = ServiceBuilder::new()
        .layer(
            ClientLayers::new()
                .deadline(Duration::from_secs(10))
                .retry(RetryLayer::new().generate_idempotency_keys())
                .build()?,
        )
        .map_request(move |req: Request<ReplayBody<Full<Bytes>>>| {
            counted.fetch_add(1, Ordering::Relaxed);
            req
        })
        .service(hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http());
    let sends = futures_util::stream::iter(0..REQUESTS).map(|i| {
        let (stack, url) = (stack.clone(), url.clone());
        async move {
            let request = Request::post(url).body(Full::from(format!("payment {i}")))?;
            let res = stack
                .oneshot(request)
                .await
                .map_err(anyhow::Error::from_boxed)?;
            anyhow::ensure!(res.status() == StatusCode::CREATED, "{i}: {}", res.status());
            Ok(())
        }
    });
    sends.buffer_unordered(32).try_collect::<Vec<()>>().await?;

    let effects = server.effects().clone();
    let recorded: u64 = effects.values().sum();
    let duplicates: u64 = effects.values().map(|n| n.saturating_sub(1)).sum();
    println!("logical requests: {REQUESTS}\nattempts: {attempts:?}\neffects: {recorded}");
    let (failed, lost) = (&server.failed, &server.lost);
    println!("transient failures: {failed:?}\nlost responses: {lost:?}");
    println!("duplicates: {duplicates}");
    let once = duplicates == 0 && recorded == REQUESTS;
    Ok(ExitCode::from(u8::from(!once)))
}
