//! Middleware that rejects calls locally while the callee is refusing many of them:
//! the adaptive client-side throttle of Google SRE's "Handling Overload".
//!
//! [`AdaptiveThrottleLayer`] counts, over a rolling window (default 2 minutes), the
//! calls it passed or rejected (*requests*) and the answers the callee did not refuse
//! (*accepts*: anything but a throttle — 429, 503 with `retry-after`,
//! `RESOURCE_EXHAUSTED` — or an overload — any 503, gRPC `UNAVAILABLE` — or a
//! transport failure), and rejects a new call with probability
//! `max(0, (requests − K × accepts) / (requests + 1))` (`K` default 2.0). A rejection
//! never reaches the callee: it is the error [`Throttled`], which no retrysafe layer
//! above retries and which breakers and budgets do not count; for gRPC, a
//! [`GrpcStatusLayer`](crate::answer::GrpcStatusLayer) above the stack turns it into a
//! synthesised `UNAVAILABLE` marked `do-not-retry`.
//!
//! The answer is judged by its head: a gRPC status there (a Trailers-Only answer, as
//! tonic sends a failed unary call) counts, `UNAVAILABLE` and `RESOURCE_EXHAUSTED` as
//! refusals. A status that comes in the trailers of a streamed answer is not seen: the
//! call counts as accepted (the callee did take it on and answer).
//!
//! It sits outermost after the deadline, so it sees one call per logical request:
//! deadline → **adaptive throttle** → hedge → retry → budget → breaker → transport.
//! The counts are lock-free and striped per thread (see
//! [`retrysafe_core::throttle`]); the random draws come from a seeded generator
//! ([`AdaptiveThrottleLayer::seed`]) so tests are exact.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use http::{Request, Response, StatusCode};
//! use retrysafe::AdaptiveThrottleLayer;
//! use retrysafe::throttle::Throttled;
//! use tower::{Service, ServiceBuilder, ServiceExt};
//!
//! // A callee that refuses everything with 429.
//! let layer = AdaptiveThrottleLayer::new().seed(7).build().unwrap();
//! let throttle = layer.throttle().clone();
//! let mut client = ServiceBuilder::new().layer(layer).service(tower::service_fn(
//!     |_req: Request<()>| async {
//!         let refused = Response::builder().status(StatusCode::TOO_MANY_REQUESTS).body(()).unwrap();
//!         Ok::<_, std::convert::Infallible>(refused)
//!     },
//! ));
//! let (mut sent, mut rejected) = (0, 0);
//! for _ in 0..1000 {
//!     let request = Request::get("http://api/items").body(()).unwrap();
//!     match client.ready().await.unwrap().call(request).await {
//!         Ok(_) => sent += 1,
//!         Err(e) if e.is::<Throttled>() => rejected += 1,
//!         Err(e) => panic!("{e}"),
//!     }
//! }
//! assert_eq!(sent + rejected, 1000);
//! assert!(rejected > 950, "only the first calls reach a callee that accepts nothing");
//! assert_eq!(throttle.counts(), (1000, 0));
//! # }
//! ```

mod layer;
mod service;

#[cfg(feature = "client")]
pub(crate) use layer::Config;
pub use layer::{AdaptiveThrottleLayer, ThrottleRejection};
pub use retrysafe_core::error::Throttled;
pub use retrysafe_core::throttle::{AdaptiveThrottle, ThrottleConfig};
pub use service::{AdaptiveThrottleService, ResponseFuture};
#[cfg(feature = "client")]
pub(crate) use service::{Admitted, admit};
