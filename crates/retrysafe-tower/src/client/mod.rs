//! Middleware that assembles the standard client order — deadline → retry → budget →
//! breaker → transport, and with every option on deadline → adaptive throttle → hedge
//! → retry → budget → breaker → transport — into one service, with the budget given
//! once and the retry, budget and breaker part fused.
//!
//! [`ClientLayers`] is the client twin of the server's
//! [`ServerLayers`](crate::server::ServerLayers). Its [`ClientService`] behaves as
//! [`DeadlineLayer`](crate::deadline::DeadlineLayer) →
//! [`RetryLayer`](crate::retry::RetryLayer) →
//! [`RetryBudgetLayer`](crate::budget::RetryBudgetLayer) →
//! [`CircuitBreakerLayer`](crate::breaker::CircuitBreakerLayer) stacked by hand, with
//! one budget shared by the retry and budget layers — the same attempts, headers
//! (`retry-attempt`, `request-timeout-ms` / `grpc-timeout`, `do-not-retry`), budget
//! deposits and withdrawals, breaker records and errors — but as one service with one
//! response future: one clock read settles the deadline and the first attempt's timeout
//! header, and no attempt carries the mark a separate budget layer would need (there is
//! none to read it). Use the separate layers for any other order.
//!
//! Each attempt goes through the breaker on a fused path: the breaker is chosen once per
//! call, and it is handed what the retry planner knows already — gRPC or not, the
//! timeout the attempt's header carries, the clock reading that was computed from — so
//! it neither parses the header back nor reads the clock again to time the attempt.
//!
//! A [`RetryBudget`](retrysafe_core::budget::RetryBudget) extension on a request is
//! the budget the retry planner charges for that request, and each of its attempts is
//! charged to the stack's budget too — a deposit for the first, a withdrawal for each
//! retry, a refused retry ending the call with the last real response — as a budget
//! layer below the retry layer charges attempts counted in another budget.
//!
//! Two differences, both in what only layers in between, or a key function, could see:
//! the call's deadline goes to the retry planner directly, so the transport gets it as
//! the timeout header of each attempt but not as a
//! [`Deadline`](retrysafe_core::Deadline) extension; and a
//! [`KeyedBreakers`](crate::breaker::KeyedBreakers) key function sees the call's head
//! once, without the per-attempt `retry-attempt` and timeout headers.
//!
//! For a tonic generated client, `ClientLayers::grpc` (feature `tonic`) gives a stack
//! the generated client takes directly (`HealthClient::new(stack)`).
//!
//! # Throttle and hedge
//!
//! [`ClientLayers::throttle`] and [`ClientLayers::hedge`] put an
//! [`AdaptiveThrottleLayer`](crate::throttle::AdaptiveThrottleLayer) and a
//! [`HedgeLayer`](crate::hedge::HedgeLayer) between the deadline and the fused part,
//! in that order; the fused part stays one future, which they wrap.
//!
//! - The deadline is outermost: for a request it may hedge, the stack puts the call's
//!   deadline in the request's extensions (where the transport sees it too), so the
//!   hedge sends no copy the deadline cannot cover and every copy's attempts are
//!   bounded by it: no copy outlives the call.
//! - The throttle counts one request per logical call, whatever the copies and
//!   attempts below; its rejection, the error [`Throttled`](crate::throttle::Throttled),
//!   reaches no other part: nothing retries it, and no budget or breaker counts it.
//! - Each hedge is a call of the fused part that makes one attempt and no deposit,
//!   carrying `retry-attempt` (and, for gRPC, `grpc-previous-rpc-attempts`); it is
//!   withdrawn from the stack's one budget, which replaces the hedge layer's own. The
//!   request's one deposit is made by its first copy, and each copy passes the breaker
//!   (a copy cancelled because another won counts as nothing).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::time::Duration;
//! use http::{Request, Response};
//! use retrysafe::budget::{BudgetSnapshot, RatioConfig};
//! use retrysafe::RetryBudget;
//! use retrysafe::ClientLayers;
//! use retrysafe::HedgeLayer;
//! use retrysafe::ReplayBody;
//! use retrysafe::AdaptiveThrottleLayer;
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! // The first copy is slow; the hedge, marked `retry-attempt: 2`, is not.
//! let transport = tower::service_fn(|req: Request<ReplayBody<String>>| async move {
//!     let attempt = req.headers().get("retry-attempt").cloned();
//!     let wait = if attempt.is_some() { 5 } else { 1_000 };
//!     tokio::time::sleep(Duration::from_millis(wait)).await;
//!     let body = if attempt.is_some() { "hedge" } else { "first" };
//!     Ok::<_, std::convert::Infallible>(Response::new(body.to_owned()))
//! });
//! // No floor: only the requests' deposits pay for hedges and retries.
//! let budget = RetryBudget::ratio_with(RatioConfig::default().with_min_per_sec(0).with_retry_ratio(1.0));
//! let hedge = HedgeLayer::new().delay(Duration::from_millis(20));
//! let layers = ClientLayers::new()
//!     .deadline(Duration::from_secs(2))
//!     .budget(budget.clone())
//!     .throttle(AdaptiveThrottleLayer::new().seed(7))
//!     .hedge(hedge.clone())
//!     .build()
//!     .unwrap();
//! let client = ServiceBuilder::new().layer(layers).service(transport);
//!
//! let started = tokio::time::Instant::now();
//! let request = Request::get("http://api/items").body(String::new()).unwrap();
//! let response = client.oneshot(request).await.unwrap();
//! assert_eq!(started.elapsed(), Duration::from_millis(25));
//! assert_eq!(hedge.stats().won, 1);
//! // One deposit for the request, one withdrawal for its hedge, in the stack's budget.
//! let BudgetSnapshot::Ratio { deposits, withdrawals, .. } = budget.snapshot() else { panic!() };
//! assert_eq!((deposits, withdrawals), (1, 1));
//! # let _ = response;
//! # }
//! ```
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::time::Duration;
//! use http::{Request, Response, StatusCode};
//! use retrysafe::breaker::{CircuitBreaker, State};
//! use retrysafe::RetryBudget;
//! use retrysafe::StandardRetryStrategy;
//! use retrysafe::CircuitBreakerLayer;
//! use retrysafe::ClientLayers;
//! use retrysafe::{ReplayBody, RetryLayer};
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! let calls = Arc::new(AtomicU32::new(0));
//! let seen = calls.clone();
//! // Fails twice with 503, then succeeds; every attempt carries the time left.
//! let transport = tower::service_fn(move |req: Request<ReplayBody<String>>| {
//!     assert!(req.headers().contains_key("request-timeout-ms"));
//!     let n = seen.fetch_add(1, Ordering::SeqCst);
//!     async move {
//!         let status = if n < 2 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
//!         Ok::<_, std::convert::Infallible>(Response::builder().status(status).body(()).unwrap())
//!     }
//! });
//! let budget = RetryBudget::ratio();
//! let breaker = CircuitBreaker::default();
//! let layers = ClientLayers::new()
//!     .deadline(Duration::from_secs(2))
//!     .retry(RetryLayer::new().strategy(StandardRetryStrategy::new().seed(7)))
//!     .budget(budget.clone())
//!     .breaker(CircuitBreakerLayer::new(breaker.clone()))
//!     .build()
//!     .unwrap();
//! let client = ServiceBuilder::new().layer(layers).service(transport);
//!
//! let response = client.oneshot(Request::get("http://api/items").body(String::new()).unwrap()).await.unwrap();
//! assert_eq!(response.status(), StatusCode::OK);
//! assert_eq!(calls.load(Ordering::SeqCst), 3);
//! assert_eq!(breaker.state(), State::Closed);
//!
//! // Every bad setting is named.
//! let error = ClientLayers::new().deadline(Duration::ZERO).build().unwrap_err();
//! assert_eq!(error.fields().collect::<Vec<_>>(), ["deadline"]);
//! # }
//! ```

#[cfg(feature = "tonic")]
mod grpc;
mod layer;
mod service;

#[cfg(feature = "tonic")]
pub use grpc::{GrpcClientLayers, GrpcClientService, GrpcResponseFuture, IntoGrpcBody};
pub use layer::ClientLayers;
pub use service::{ClientService, ResponseFuture};
