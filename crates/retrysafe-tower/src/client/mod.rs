//! Middleware that assembles the standard client order — deadline → retry → budget →
//! breaker → transport — into one fused service, with the budget given once.
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
//! Three differences, all in what only layers in between, or a key function, could see:
//! the call's deadline goes to the retry planner directly, so the transport gets it as
//! the timeout header of each attempt but not as a
//! [`Deadline`](retrysafe_core::Deadline) extension; a
//! [`RetryBudget`](retrysafe_core::budget::RetryBudget) extension on a request
//! replaces the stack's budget for that request's retries (with the separate layers it
//! would also be charged to the budget layer's); and a
//! [`KeyedBreakers`](crate::breaker::KeyedBreakers) key function sees the call's head
//! once, without the per-attempt `retry-attempt` and timeout headers.
//!
//! For a tonic generated client, `ClientLayers::grpc` (feature `tonic`) gives a stack
//! the generated client takes directly (`HealthClient::new(stack)`).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::time::Duration;
//! use http::{Request, Response, StatusCode};
//! use retrysafe_core::breaker::{CircuitBreaker, State};
//! use retrysafe_core::budget::RetryBudget;
//! use retrysafe_core::strategy::StandardRetryStrategy;
//! use retrysafe_tower::breaker::CircuitBreakerLayer;
//! use retrysafe_tower::client::ClientLayers;
//! use retrysafe_tower::retry::{ReplayBody, RetryLayer};
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
