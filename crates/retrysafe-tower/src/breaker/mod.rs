//! Middleware that stops calling a downstream that keeps failing: a circuit breaker
//! answers at once while the downstream recovers, instead of queueing more calls on it.
//!
//! The [`CircuitBreakerLayer`] drives the sans-IO state machine of
//! [`retrysafe_core::breaker`] (closed, open, half-open; forced open and disabled):
//!
//! - [`poll_ready`](tower_service::Service::poll_ready) is always ready and never polls
//!   the inner service; [`call`](tower_service::Service::call) decides. A refused call
//!   is answered at once with the error [`CircuitOpen`], carrying the time until the
//!   next probe (a [`GrpcStatusLayer`](crate::answer::GrpcStatusLayer) above the stack
//!   turns it into a synthesised Trailers-Only `UNAVAILABLE` for gRPC requests). Either
//!   way it is never retried: the error is a local failure to a `RetryLayer`, the status
//!   carries `do-not-retry: 1`. An admitted call is made on a *clone* of the inner
//!   service — at once when that is ready, else by a future that drives its readiness
//!   and then calls it — so a full `Buffer` (such as a tonic `Channel`) behind an open
//!   breaker still fails fast.
//! - The closed path is lock-free (one atomic load to admit, one compare-and-swap to
//!   record). In half-open, exactly `half_open_probes` calls go through however many
//!   race; a probe whose future is dropped before its response counts as a failure,
//!   and a half-open state whose probes never report times out, so permits never leak.
//! - Only the callee's own faults count (see [`retrysafe_core::classify`]): a response
//!   marked `do-not-retry` because a *dependency* failed, a 504 / `DEADLINE_EXCEEDED`
//!   that comes as the deadline the caller sent runs out (an early one is the callee's
//!   own timeout, a failure), and refusals of layers below (another breaker, a budget)
//!   are neutral; 4xx are successes.
//! - A gRPC status that arrives in the trailers, after the response headers, is
//!   classified at the end of the stream. That is why the response body is always
//!   wrapped in [`ResponseBody`], which passes every frame, `size_hint` and
//!   `is_end_stream` through unchanged (see its docs for a body dropped early).
//! - [`KeyedBreakers`] keeps one breaker per authority (or per route, or any key) in a
//!   bounded map. A [`CircuitBreaker`] in a
//!   request's extensions overrides the layer's choice for that request.
//! - State changes call [`BreakerConfig::on_state_change`](retrysafe_core::breaker::BreakerConfig::on_state_change)
//!   (and [`KeyedBreakers::on_state_change`], with the key) and emit `tracing` events
//!   (`warn` on opening); a refusal emits a `debug` event.
//!
//! In the recommended client order it sits below the retry budget, just above the
//! transport: `DeadlineLayer` → `RetryLayer` → `RetryBudgetLayer` →
//! `CircuitBreakerLayer` → transport, so every attempt passes the breaker.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::time::Duration;
//! use http::{Request, Response, StatusCode};
//! use retrysafe::breaker::{BreakerConfig, CircuitBreaker, State};
//! use retrysafe::error::{CircuitOpen, find};
//! use retrysafe::CircuitBreakerLayer;
//! use tower::{Service, ServiceBuilder, ServiceExt};
//!
//! // Opens at 50 % failures of at least 4 calls.
//! let config = BreakerConfig::default().with_minimum_calls(4).build().unwrap();
//! let breaker = CircuitBreaker::new(config);
//! let mut svc = ServiceBuilder::new()
//!     .layer(CircuitBreakerLayer::new(breaker.clone()))
//!     .service(tower::service_fn(|_req: Request<()>| async {
//!         let mut response = Response::new(());
//!         *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
//!         Ok::<_, std::convert::Infallible>(response)
//!     }));
//!
//! for _ in 0..4 {
//!     let response = svc.ready().await.unwrap().call(Request::new(())).await.unwrap();
//!     assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
//! }
//! assert_eq!(breaker.state(), State::Open);
//!
//! // Open: refused at once, without calling the service.
//! let error = svc.ready().await.unwrap().call(Request::new(())).await.unwrap_err();
//! let open = find::<CircuitOpen>(&*error).unwrap();
//! assert_eq!(open.retry_in(), Duration::from_secs(5));
//! # }
//! ```
//!
//! [`CircuitOpen`]: retrysafe_core::error::CircuitOpen

mod body;
mod future;
#[cfg(feature = "client")]
mod guarded;
mod keyed;
mod layer;
mod service;

pub use self::body::ResponseBody;
pub use self::future::ResponseFuture;
#[cfg(feature = "client")]
pub(crate) use self::guarded::{Guarded, StackBudget, Transport};
pub use self::keyed::KeyedBreakers;
pub use self::layer::CircuitBreakerLayer;
#[cfg(feature = "client")]
pub(crate) use self::layer::Config;
pub use self::service::CircuitBreakerService;
pub use retrysafe_core::breaker::{
    BreakerConfig, CircuitBreaker, SlidingWindow, State, StateChange,
};
pub use retrysafe_core::error::CircuitOpen;
