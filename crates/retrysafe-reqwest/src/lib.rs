//! retrysafe for [reqwest](https://docs.rs/reqwest): safe retries, a circuit breaker and
//! a deadline as [`reqwest_middleware::Middleware`], driven by `retrysafe-core` exactly
//! like the tower layers of `retrysafe-tower` — the same retry strategy, budgets,
//! classification, safe-request rule, idempotency-key generation, breaker state machine
//! and deadline arithmetic, and the same header convention on the wire.
//!
//! - [`DeadlineMiddleware`] ([`deadline`]): bounds a whole call by a deadline — its own
//!   timeout, or the one inherited from the inbound request being served — and hands
//!   it to the middleware below.
//! - [`RetryMiddleware`] ([`retry`]): retries what is safe to retry (idempotent
//!   methods, requests with an `Idempotency-Key`), within a retry budget and the
//!   deadline; sends `retry-attempt` and the time left as `request-timeout-ms` on
//!   every attempt.
//! - [`CircuitBreakerMiddleware`] ([`breaker`]): fails fast while the downstream keeps
//!   failing; counts only the callee's own faults.
//! - [`ClientMiddlewares`] ([`client`]): the three in the standard order, with the
//!   budget given once, in one call.
//! - [`error`]: finds the typed errors ([`DeadlineExceeded`], [`CircuitOpen`],
//!   [`BudgetExhausted`]) inside a `reqwest_middleware::Error`, whose `source()` skips
//!   the middleware's payload.
//!
//! # Order
//!
//! Outermost first: `DeadlineMiddleware` → `RetryMiddleware` →
//! `CircuitBreakerMiddleware` → reqwest. reqwest-middleware runs middleware in the
//! order they are added with [`ClientBuilder::with`](reqwest_middleware::ClientBuilder::with),
//! so add them in that order. The deadline then covers the whole call — every attempt
//! and every backoff sleep — and every attempt passes the breaker, so an open breaker
//! stops the retries at once (its [`CircuitOpen`] is a local failure, never retried).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use std::time::Duration;
//! use axum::http::{HeaderMap, StatusCode};
//! use retrysafe::breaker::CircuitBreaker;
//! use retrysafe::reqwest::{CircuitBreakerMiddleware, DeadlineMiddleware, RetryMiddleware};
//!
//! // A server that is busy on the first request, and tells what it was sent.
//! let hits = Arc::new(AtomicUsize::new(0));
//! let seen = hits.clone();
//! let app = axum::Router::new().route(
//!     "/items",
//!     axum::routing::get(move |headers: HeaderMap| async move {
//!         let attempt = headers.get("retry-attempt").map(|v| v.to_str().unwrap().to_owned());
//!         let left_ms: u64 = headers["request-timeout-ms"].to_str().unwrap().parse().unwrap();
//!         assert!(left_ms <= 2_000);
//!         match seen.fetch_add(1, Ordering::SeqCst) {
//!             0 => (StatusCode::SERVICE_UNAVAILABLE, "busy".to_owned()),
//!             _ => (StatusCode::OK, format!("items (attempt {})", attempt.unwrap())),
//!         }
//!     }),
//! );
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
//! let url = format!("http://{}/items", listener.local_addr().unwrap());
//! tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
//!
//! // One breaker per downstream, shared by every client of it.
//! let breaker = CircuitBreaker::default();
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(DeadlineMiddleware::new(Duration::from_secs(2)))
//!     .with(RetryMiddleware::new())
//!     .with(CircuitBreakerMiddleware::new(breaker.clone()))
//!     .build();
//!
//! let response = client.get(&url).send().await.unwrap();
//! assert_eq!(response.status(), 200);
//! assert_eq!(response.text().await.unwrap(), "items (attempt 2)");
//! assert_eq!(hits.load(Ordering::SeqCst), 2);
//! assert_eq!(breaker.window().calls(), 2); // both attempts passed the breaker
//! # }
//! ```
//!
//! # Below the middleware: reqwest's own retries
//!
//! reqwest (and the hyper-util client inside it) retries a few failures on its own,
//! below every middleware: by default, requests refused at the protocol level before
//! any processing (an HTTP/2 `REFUSED_STREAM` or graceful `GOAWAY`, up to two extra sends), and
//! requests whose pooled connection turned out to be closed before they were written.
//! Those resends are invisible to the middleware: they are not attempts of
//! `RetryMiddleware`, they pass its breaker as one call, and no retry budget counts
//! them. They are safe (nothing was processed) and cheap, so they are left on.
//! `reqwest::ClientBuilder::retry(reqwest::retry::never())` turns reqwest's off; do
//! not configure a status-based `reqwest::retry` policy together with
//! `RetryMiddleware`, which would multiply the attempts of every retry.
//!
//! # No hedging or throttling middleware
//!
//! There is no reqwest twin of the tower `HedgeLayer`: with reqwest-middleware 0.5 it
//! would not be as correct, for three reasons.
//!
//! - **Bodies.** [`reqwest::Request::try_clone`] gives `None` for a streaming body
//!   (`Body::wrap_stream`, `Body::wrap`), and a [`reqwest::Body`] does not tell how
//!   much of it has been read, so a middleware can hedge only bodies that are bytes
//!   already. The tower form wraps the body in a `ReplayBody` and hedges a streamed
//!   body once it has been read in full (and never one over its cap).
//! - **One `Extensions` per call.** [`Next::run`](reqwest_middleware::Next::run) takes
//!   `&'a mut Extensions` for as long as the copy runs, so the first copy borrows the
//!   caller's extensions until it ends and a hedge has to run on a clone of them:
//!   what a middleware below records there for the call comes back from the first
//!   copy only, even when the hedge's answer wins.
//! - **Cancelled copies.** When the hedge wins, the first copy is dropped. The
//!   [`CircuitBreakerMiddleware`] counts a dropped half-open probe as a failure (it
//!   cannot tell a cancelled copy from an abandoned call), so a cancelled copy could
//!   open a recovering breaker again. In the tower form, the copies share a mark that
//!   makes a cancelled copy count as neither a success nor a failure.
//!
//! For hedging, or the `AdaptiveThrottleLayer`, use the tower form over a hyper client
//! instead: `retrysafe_tower::client::ClientLayers` with `.throttle(…)` and `.hedge(…)`
//! over `hyper_util::client::legacy::Client`, which takes `ReplayBody<B>` bodies.
//!
//! # Errors
//!
//! The middleware fail with `reqwest_middleware::Error::Middleware(anyhow::Error)`
//! holding one of the typed errors of [`retrysafe_core::error`]; reqwest's own failures
//! stay `reqwest_middleware::Error::Reqwest`. See [`error`] for the helpers that find
//! them.
//!
//! [`DeadlineExceeded`]: retrysafe_core::error::DeadlineExceeded
//! [`CircuitOpen`]: retrysafe_core::error::CircuitOpen
//! [`BudgetExhausted`]: retrysafe_core::error::BudgetExhausted
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod breaker;
pub mod client;
pub mod deadline;
pub mod error;
pub mod retry;

pub use breaker::CircuitBreakerMiddleware;
pub use client::ClientMiddlewares;
pub use deadline::DeadlineMiddleware;
pub use retry::RetryMiddleware;

/// The future a `reqwest_middleware::Middleware` returns (what `async_trait` makes of
/// its `async fn handle`).
type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// The README's Rust code blocks, compiled and run as doc-tests
/// (`cargo test --doc -p retrysafe-reqwest`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
