//! Middleware that retries failed requests that are safe to retry, within a budget and
//! a deadline.
//!
//! [`RetryLayer`] is driven by a [`RetryStrategy`]
//! from core (default: the [`StandardRetryStrategy`])
//! and classifies each attempt with a [`Classifier`](retrysafe_core::classify::Classifier).
//! Its per-call decisions are those of the sans-IO planner in
//! [`retrysafe_core::retry`], which the reqwest `RetryMiddleware` drives too; this
//! layer adds the tower parts: readiness, timers, [`ReplayBody`], and the answers to
//! local failures. It:
//!
//! - retries **safe requests only**: RFC 9110 idempotent methods, requests with an
//!   `Idempotency-Key`, and requests declared idempotent (the
//!   [`Idempotent`] extension or
//!   [`RetryLayer::idempotent_if`]); a POST without a key is sent once, unless nothing
//!   was sent at all (a failed connect, h2 `REFUSED_STREAM`).
//!   [`generate_idempotency_keys`](RetryLayer::generate_idempotency_keys) adds a key to
//!   POST and PATCH, the same on every attempt — the child key of the inbound record
//!   inside a guarded handler;
//! - replays request bodies lazily through [`ReplayBody`]: the first attempt streams while
//!   a copy is kept up to a cap (64 KiB); a larger body is sent once;
//! - honours `retry-after` as a minimum delay and `grpc-retry-pushback-ms` as the delay;
//! - is **deadline-aware**: the deadline is the soonest of the request's
//!   [`Deadline`](retrysafe_core::Deadline) extension, the inherited
//!   [`CallContext`](retrysafe_core::CallContext), and a timeout header already on the
//!   request; `request-timeout-ms` (or `grpc-timeout`) is rewritten on every attempt
//!   from the time left; no attempt starts, and no delay is waited, that the deadline
//!   cannot cover. Without a deadline the strategy's default timeouts apply (10 s per
//!   attempt, 30 s overall); an explicitly set
//!   [`attempt_timeout`](retrysafe_core::strategy::StandardRetryStrategy::attempt_timeout)
//!   also bounds each attempt of a retryable request under a deadline (and its header);
//! - awaits the inner service's readiness after the backoff sleep, bounded by the
//!   deadline;
//! - sends `retry-attempt: N` (and `grpc-previous-rpc-attempts`) on attempts 2 and
//!   later, and tags every attempt of a budgeted request with a request extension so a
//!   `RetryBudgetLayer` below — even behind a `Buffer` — does not charge it twice;
//! - makes one attempt when the caller is the retry point (`retry-point: caller`
//!   inherited; the header is passed on, so no hop below retries either), or for a
//!   request carrying [`NoRetry`];
//! - when it **gives up on a retryable failure** (attempts exhausted, budget refused, not
//!   enough time), returns the last real response marked `do-not-retry: 1` and records
//!   `downstream_gave_up` in the inherited context, so the layers above do not retry
//!   again;
//! - fails with the typed errors of local failures (its deadline, and a budget or
//!   breaker below that refused before any real response); a
//!   [`GrpcStatusLayer`](crate::answer::GrpcStatusLayer) above the stack answers them
//!   for gRPC requests as synthesised Trailers-Only statuses;
//! - calls [`on_retry`](RetryLayer::on_retry) / [`on_give_up`](RetryLayer::on_give_up),
//!   emits `tracing` events, runs each call in one `retrysafe.call` span and puts an
//!   [`AttemptNumber`] on every resent attempt (see [Tracing each attempt](#tracing-each-attempt)).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use http::{Request, Response, StatusCode};
//! use retrysafe::StandardRetryStrategy;
//! use retrysafe::{ReplayBody, RetryLayer};
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! let calls = Arc::new(AtomicU32::new(0));
//! let seen = calls.clone();
//! // Fails twice with 503, then succeeds.
//! let inner = tower::service_fn(move |_req: Request<ReplayBody<String>>| {
//!     let n = seen.fetch_add(1, Ordering::SeqCst);
//!     async move {
//!         let status = if n < 2 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
//!         Ok::<_, std::convert::Infallible>(Response::builder().status(status).body(()).unwrap())
//!     }
//! });
//! let client = ServiceBuilder::new()
//!     .layer(RetryLayer::new().strategy(StandardRetryStrategy::new().seed(7)))
//!     .service(inner);
//!
//! let response = client.oneshot(Request::get("http://api/items").body(String::new()).unwrap()).await.unwrap();
//! assert_eq!(response.status(), StatusCode::OK);
//! assert_eq!(calls.load(Ordering::SeqCst), 3);
//! # }
//! ```
//!
//! # Tracing each attempt
//!
//! Every call runs in one `retrysafe.call` span (level INFO) with the fields `name`
//! (the layer's [`name`](RetryLayer::name)), `attempts`, `give_up` (the reason, when it
//! gave up), `budget` (`granted`, `refused`) and `breaker` (`rejected`), recorded as
//! they happen. The attempts themselves are the transport's to trace: every resent
//! attempt carries its [`AttemptNumber`] in its extensions (hedges included; none
//! means the first), so a span made
//! *below* the retry layer records OpenTelemetry's `http.request.resend_count` — set,
//! as the HTTP conventions ask, on resent requests only. With tower-http's
//! `TraceLayer` (the same goes below [`ClientLayers`](crate::client::ClientLayers)):
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use http::{Request, Response, StatusCode};
//! use retrysafe::observe::AttemptNumber;
//! use retrysafe::{ReplayBody, RetryLayer};
//! use tower::{ServiceBuilder, ServiceExt};
//! use tower_http::trace::TraceLayer;
//!
//! /// The transport's span of one attempt.
//! fn attempt_span<B>(request: &Request<B>) -> tracing::Span {
//!     let span = tracing::info_span!(
//!         "HTTP",
//!         http.request.method = %request.method(),
//!         http.request.resend_count = tracing::field::Empty,
//!     );
//!     if let Some(attempt) = AttemptNumber::of(request.extensions()).filter(|a| a.resend_count() > 0) {
//!         span.record("http.request.resend_count", attempt.resend_count());
//!     }
//!     span
//! }
//!
//! let client = ServiceBuilder::new()
//!     .layer(RetryLayer::new().name("inventory"))
//!     // Below the retry layer: one span per attempt.
//!     .layer(TraceLayer::new_for_http().make_span_with(attempt_span::<ReplayBody<String>>))
//!     // The transport (here, one that answers 503 to the first attempt).
//!     .service(tower::service_fn(|request: Request<ReplayBody<String>>| async move {
//!         let attempt = AttemptNumber::of(request.extensions()).map(AttemptNumber::get);
//!         let status = if attempt == Some(1) { 503 } else { 200 };
//!         let response = Response::builder().status(status).body(String::new());
//!         Ok::<_, std::convert::Infallible>(response.unwrap())
//!     }));
//!
//! let request = Request::get("http://inventory/items").body(String::new()).unwrap();
//! let response = client.oneshot(request).await.unwrap();
//! assert_eq!(response.status(), StatusCode::OK);
//! # }
//! ```

// The attempt driver's hooks for the breaker (`Attempts`, `Sent`) serve the fused stack
// of the `client` feature; without it the plain retry path leaves some of them unused.
#![cfg_attr(not(feature = "client"), allow(dead_code, unused_imports))]

mod attempts;
mod body;
mod future;
mod layer;
mod service;
mod transport;

pub(crate) use attempts::{Attempts, Sent};
pub use body::ReplayBody;
pub(crate) use future::Driver;
pub use future::ResponseFuture;
#[cfg(feature = "client")]
pub(crate) use layer::Config;
pub(crate) use layer::DEFAULT_REPLAY_CAP;
#[cfg(feature = "client")]
pub(crate) use layer::MAX_REPLAY_CAP;
pub use layer::RetryLayer;
pub use retrysafe_core::backoff::{Backoff, Jitter, RetryRng};
pub use retrysafe_core::observe::AttemptNumber;
pub use retrysafe_core::retry::{GiveUpEvent, RetryEvent};
pub use retrysafe_core::strategy::{
    GiveUp, Idempotent, NoRetry, RetryStrategy, StandardRetryStrategy,
};
pub use service::RetryService;
#[cfg(feature = "client")]
pub(crate) use service::{Within, begin, begin_replay};
pub use transport::failure_of;
