//! Middleware that bounds a whole call by a deadline (client side), and enforces the
//! inbound deadline while passing what is left of it to outbound calls (server side).
//!
//! # Client: [`DeadlineLayer::new`]
//!
//! Put it outermost in a client stack (`DeadlineLayer` → `RetryLayer` →
//! `RetryBudgetLayer` → `CircuitBreakerLayer` → transport). For each call it sets the
//! [`Deadline`] request extension to the soonest of: now plus
//! its timeout, the request's own `Deadline` extension, and the deadline inherited from
//! the inbound request being served ([`CallContext::inherited`]); deadlines only shrink.
//! The layers below read it (a `RetryLayer` never starts an attempt it cannot cover, and
//! sends the time left as `request-timeout-ms` / `grpc-timeout` on every attempt).
//!
//! - The whole call counts: its `poll_ready` is always ready and the inner service's
//!   readiness is awaited inside the response future, so time spent waiting for a
//!   connection, a concurrency permit or a breaker counts against the deadline.
//! - When the deadline passes before the response head, the inner future is dropped and
//!   the call fails with [`DeadlineExceeded`] (a
//!   [`GrpcStatusLayer`](crate::answer::GrpcStatusLayer) above turns it into a synthesised
//!   Trailers-Only `DEADLINE_EXCEEDED`, code 4, marked `do-not-retry: 1`). A response that is ready is
//!   never dropped for the timer: the inner future is polled first.
//! - With [`bound_body`](DeadlineLayer::bound_body), the deadline also bounds the
//!   response body: a stream still running at the deadline ends with a
//!   [`DeadlineExceeded`] body error ([`DeadlineBody`]). Without it, the body is the
//!   caller's to bound.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::time::Duration;
//! use http::{Request, Response};
//! use retrysafe::Deadline;
//! use retrysafe::error::{find, DeadlineExceeded};
//! use retrysafe::DeadlineLayer;
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! let svc = ServiceBuilder::new()
//!     .layer(DeadlineLayer::new(Duration::from_millis(100)))
//!     .service(tower::service_fn(|req: Request<()>| async move {
//!         // The layers below (and the transport) see the deadline.
//!         let deadline = *req.extensions().get::<Deadline>().unwrap();
//!         assert_eq!(deadline.remaining(), Duration::from_millis(100));
//!         tokio::time::sleep(Duration::from_secs(1)).await; // too slow
//!         Ok::<_, std::convert::Infallible>(Response::new(()))
//!     }));
//!
//! let err = svc.oneshot(Request::new(())).await.unwrap_err();
//! assert!(find::<DeadlineExceeded>(&*err).is_some());
//! # }
//! ```
//!
//! # Server: [`DeadlineLayer::server`]
//!
//! The server form does what a [`PropagateLayer`](crate::propagate::PropagateLayer)
//! does — the same parsing of `request-timeout-ms` (or `grpc-timeout` for gRPC
//! requests), clamped to a maximum ([`max_timeout`](ServerDeadlineLayer::max_timeout), default 30 days),
//! and the same inherited [`CallContext`] whose deadline is the inbound one less a
//! [`margin`](ServerDeadlineLayer::margin) (default 10 ms), current for the handler so
//! that its outbound calls inherit it, with failures marked `do-not-retry: 1` when an
//! outbound call gave up — and also:
//!
//! - a malformed inbound timeout (`abc`, `-5`, an empty value, a bad `grpc-timeout`
//!   unit, non-UTF-8 bytes) is answered at once with a 400 problem+json of type
//!   `urn:retrysafe:problem:timeout-invalid` (gRPC: a Trailers-Only `INVALID_ARGUMENT`,
//!   code 3); an overflowing value is not malformed, it is clamped;
//! - a request with no time left (`request-timeout-ms: 0`, or a timeout no longer than
//!   the margin) is answered 504 at once, as below, before the handler starts;
//! - the deadline is enforced: a handler still running when the context's deadline (the
//!   inbound time less the margin) passes is dropped, and the request answered 504
//!   problem+json `urn:retrysafe:problem:deadline-exceeded` (gRPC: a Trailers-Only
//!   `DEADLINE_EXCEEDED`, code 4), with `do-not-retry: 1`. The margin is what the answer
//!   has to reach the caller before it gives up.
//!
//! Enforcing drops the handler's future: place this layer, like the `PropagateLayer`,
//! outside the `IdempotencyLayer` (which runs guarded handlers in their own task, so
//! nothing is cancelled halfway through an effect). Put an
//! [`EdgeLayer`](crate::edge::EdgeLayer) before it at a public edge.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::time::Duration;
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use retrysafe::CallContext;
//! use retrysafe::DeadlineLayer;
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! let svc = ServiceBuilder::new()
//!     .layer(DeadlineLayer::server().max_timeout(Duration::from_secs(5)))
//!     .service(tower::service_fn(|_req: Request<()>| async {
//!         // What outbound calls inherit: the inbound 300 ms less the 10 ms margin.
//!         let left = CallContext::current().unwrap().deadline().unwrap().remaining();
//!         assert_eq!(left, Duration::from_millis(290));
//!         Ok::<_, std::convert::Infallible>(Response::new(Bytes::new()))
//!     }));
//!
//! let ok = Request::get("/").header("request-timeout-ms", "300").body(()).unwrap();
//! assert_eq!(svc.clone().oneshot(ok).await.unwrap().status(), StatusCode::OK);
//!
//! let bad = Request::get("/").header("request-timeout-ms", "soon").body(()).unwrap();
//! let response = svc.oneshot(bad).await.unwrap();
//! assert_eq!(response.status(), StatusCode::BAD_REQUEST);
//! assert_eq!(response.headers()["content-type"], "application/problem+json");
//! # }
//! ```
//!
//! # With tonic's own `grpc-timeout` handling
//!
//! A tonic `transport::Server` wraps every connection's service — outside all the layers
//! added with `Server::layer` — in its own `GrpcTimeout`, which sleeps for the sooner of
//! the `grpc-timeout` header and `Server::timeout`, polling the service first. When its
//! timer fires it drops the service's future and fails the call with its
//! `TimeoutExpired` error, which tonic turns into the status **`CANCELLED`** ("Timeout
//! expired"), not `DEADLINE_EXCEEDED`, and unmarked. A `grpc-timeout` it cannot parse
//! (more than 8 digits, an unknown unit, an empty or non-ASCII value) it ignores, so such
//! requests reach this layer, which answers `INVALID_ARGUMENT`.
//!
//! The two timers start together (tonic's a moment earlier). This layer's fires at the
//! inbound timeout *less the margin*, so with a positive margin (the default 10 ms) it
//! answers first, with `DEADLINE_EXCEEDED` and `do-not-retry: 1`, and tonic's timer is
//! only a backstop (for `Server::timeout` shorter than the caller's deadline, or a
//! handler that blocks its thread). With a zero margin the two race and the caller may
//! see `CANCELLED`. This layer clamps with [`max_timeout`](ServerDeadlineLayer::max_timeout) as well;
//! `Server::timeout` bounds calls that carry no `grpc-timeout` at all, which this layer
//! leaves unbounded. The server form wraps the response body in a
//! [`LocalBody`](crate::answer::LocalBody) (its own answers are bytes), so it fits
//! `Server::layer` with `tonic::body::Body` as it is, and marks `do-not-retry` in the
//! trailers of a stream whose outbound call gave up, like the `PropagateLayer`.
//!
//! On the client, a tonic `Channel` likewise times every request from the
//! `grpc-timeout` it carries (and `Endpoint::timeout`): its `TimeoutExpired` error can
//! come at the very instant of the client deadline. An error that comes once the
//! deadline has passed is the deadline's: the client layer answers it as
//! [`DeadlineExceeded`] (a synthesised `DEADLINE_EXCEEDED` under a `GrpcStatusLayer`), and a
//! breaker counts it as neutral.
//!
//! [`CallContext`]: retrysafe_core::CallContext
//! [`CallContext::inherited`]: retrysafe_core::CallContext::inherited
//! [`DeadlineExceeded`]: retrysafe_core::error::DeadlineExceeded

mod body;
mod client;
mod server;

pub use body::{BoundBody, DeadlineBody, Unbounded, WrapBody};
#[cfg(feature = "client")]
pub(crate) use client::deadline_and_left;
pub use client::{DeadlineLayer, DeadlineService, ResponseFuture};
pub use retrysafe_core::error::DeadlineExceeded;
pub use retrysafe_core::{Deadline, DeadlineExpiry};
pub use server::{ServerDeadlineLayer, ServerDeadlineService, ServerResponseFuture};
