//! Middleware that sends another copy of a slow safe request and keeps the first
//! acceptable answer, within the retry budget: hedged requests ("The Tail at Scale";
//! gRPC A6's hedging policy).
//!
//! [`HedgeLayer`]:
//!
//! - hedges **safe requests only**: RFC 9110 idempotent methods (GET, HEAD, OPTIONS,
//!   PUT, DELETE, TRACE) and requests declared [`Idempotent`]; a POST or PATCH with an
//!   `Idempotency-Key` only after
//!   [`hedge_keyed_requests`](HedgeLayer::hedge_keyed_requests) (against an
//!   `IdempotencyLayer`, such a hedge mostly meets a 409 or a wait);
//! - never for a request carrying [`NoRetry`], nor when the inherited
//!   [`CallContext`](retrysafe_core::CallContext) says the caller is the retry point: a
//!   hop that is not the retry point adds no attempts;
//! - after the hedge delay — fixed ([`delay`](HedgeLayer::delay)) or a percentile of
//!   the latencies of the last 30 s ([`percentile`](HedgeLayer::percentile); default
//!   p95, at least 10 ms, none before 20 samples) — sends up to
//!   [`max_hedges`](HedgeLayer::max_hedges) (default 1) more copies, one delay apart,
//!   each only once the request body is wholly held by the [`ReplayBody`] and enough
//!   of the deadline is left;
//! - pays for every hedge with a withdrawal from the **retry budget** (the request's
//!   `RetryBudget` extension, or the layer's [`budget`](HedgeLayer::budget), which it
//!   puts on every request so the `RetryLayer` below charges the request's deposit and
//!   its retries to the same budget): a refused withdrawal sends nothing, and is
//!   counted ([`HedgeLayer::stats`]). A hedge is withdrawn only once the service below
//!   is ready to take it, so one that waited while another copy answered costs
//!   nothing. The request's one deposit is the `RetryLayer`'s below; with no retrying
//!   layer below to make it, the hedging layer makes it itself for every request it
//!   may hedge. In an overload, when every request is slow, the budget bounds what
//!   hedging adds;
//! - marks each copy with `retry-attempt: N` (and `grpc-previous-rpc-attempts`), and
//!   with request extensions telling a `RetryLayer` below to send it once without a
//!   new deposit, and a `RetryBudgetLayer` below that it was paid for;
//! - returns the first *acceptable* answer — one the classifier says a retry layer
//!   would not retry: a success, a 4xx, an answer marked `do-not-retry` — and drops
//!   the other copies; when no copy answers acceptably, the first copy's answer.
//!
//! It sits above the `RetryLayer` and shares its budget: deadline → adaptive throttle →
//! **hedge** → retry → budget → breaker → transport.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::time::Duration;
//! use http::{Request, Response};
//! use retrysafe::HedgeLayer;
//! use retrysafe::ReplayBody;
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! let layer = HedgeLayer::new().delay(Duration::from_millis(20)).build().unwrap();
//! let client = ServiceBuilder::new().layer(layer.clone()).service(tower::service_fn(
//!     |req: Request<ReplayBody<String>>| async move {
//!         // The first copy is slow; the hedge, marked `retry-attempt: 2`, is not.
//!         let slow = !req.headers().contains_key("retry-attempt");
//!         let wait = if slow { 1_000 } else { 5 };
//!         tokio::time::sleep(Duration::from_millis(wait)).await;
//!         Ok::<_, std::convert::Infallible>(Response::new(if slow { "first" } else { "hedge" }))
//!     },
//! ));
//!
//! let started = tokio::time::Instant::now();
//! let request = Request::get("http://api/items").body(String::new()).unwrap();
//! let response = client.oneshot(request).await.unwrap();
//! assert_eq!(*response.body(), "hedge");
//! assert_eq!(started.elapsed(), Duration::from_millis(25));
//! assert_eq!(layer.stats().sent, 1);
//! assert_eq!(layer.stats().won, 1);
//! # }
//! ```

mod future;
mod layer;
mod service;

pub use future::ResponseFuture;
#[cfg(feature = "client")]
pub(crate) use layer::Config;
pub use layer::{HedgeEvent, HedgeLayer, HedgeOutcome, HedgeStats};
pub use retrysafe_core::budget::RetryBudget;
pub use retrysafe_core::strategy::{Idempotent, NoRetry};
pub use service::HedgeService;
#[cfg(feature = "client")]
pub(crate) use service::{hedgeable, race};

#[allow(unused_imports, reason = "the docs link it")]
use crate::retry::ReplayBody;
