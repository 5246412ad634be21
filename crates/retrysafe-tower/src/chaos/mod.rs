//! Middleware that injects seeded faults into calls — latency, error answers,
//! connection resets, and **a reply lost after the effect** — for tests and staging.
//!
//! The chaos strategies of other resilience libraries replace a call's outcome: the
//! call does not happen, and an error or a fallback answer comes back instead. That
//! covers a refused connection or an overloaded server, but not the failure an
//! `Idempotency-Key` exists for: the server **did** the work, and its answer was lost
//! on the way back. A client that retries then must not do the work twice. A
//! [`FaultLayer`] injects exactly that: the inner service runs to its answer, the
//! answer is dropped, and the caller gets a [`ReplyLost`] error, which client layers
//! classify as a connection that closed before the response (retried only for a safe
//! request: an idempotent method, or one with an `Idempotency-Key`).
//!
//! Each call draws, from a seeded generator ([`FaultLayer::seed`]), in this order:
//!
//! - a **latency** ([`FaultLayer::latency`]): a delay on tokio's clock before the call,
//!   so tests run on the paused clock and are exact;
//! - at most one **fault**, whose probabilities add up to at most 1:
//!   - a **connection reset** ([`FaultLayer::connection_resets`]): the error
//!     [`ConnectionReset`], without calling the inner service;
//!   - an **error answer** ([`FaultLayer::error_answers`]): a status such as 503 with
//!     an empty body, without calling the inner service;
//!   - a **lost reply** ([`FaultLayer::lost_replies`]): the call runs, its answer is
//!     dropped, the error is [`ReplyLost`].
//!
//! On a client, put it just above the transport (below `ClientLayers`, or below the
//! `RetryLayer` and the breaker), so that every attempt draws its own faults:
//! `ClientLayers` → **`FaultLayer`** → hyper's client. On a server, put it outermost
//! and serve with hyper's connection API: an error from the service makes hyper close
//! the connection without an answer, which is what a client of a lost reply sees.
//!
//! Its answers have a [`LocalBody`](crate::answer::LocalBody) around the inner service's
//! body (an error answer's body is empty), and its errors are boxed. With the feature
//! `chaos` off nothing of it is compiled.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::convert::Infallible;
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::time::Duration;
//! use http::{Request, Response, StatusCode};
//! use retrysafe::error::find;
//! use retrysafe::FaultLayer;
//! use retrysafe::chaos::ReplyLost;
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! // A server whose every call has an effect.
//! let effects = Arc::new(AtomicU32::new(0));
//! let counted = effects.clone();
//! let server = tower::service_fn(move |_req: Request<String>| {
//!     counted.fetch_add(1, Ordering::SeqCst);
//!     async { Ok::<_, Infallible>(Response::new("created".to_owned())) }
//! });
//!
//! // Every reply lost, after a delay of exactly 40 ms.
//! let every = Duration::from_millis(40);
//! let layer = FaultLayer::new().lost_replies(1.0).latency(1.0, every, every).seed(7).build().unwrap();
//! let client = ServiceBuilder::new().layer(layer.clone()).service(server.clone());
//! let started = tokio::time::Instant::now();
//! let error = client.oneshot(Request::post("/payments").body(String::new()).unwrap()).await.unwrap_err();
//! assert!(find::<ReplyLost>(&*error).is_some());
//! assert_eq!(effects.load(Ordering::SeqCst), 1, "the call ran: only its answer was lost");
//! assert_eq!(started.elapsed(), every);
//!
//! // A seeded mix: the same seed and the same calls give the same faults.
//! let mix = || FaultLayer::new().error_answers(0.05, StatusCode::SERVICE_UNAVAILABLE).lost_replies(0.3).seed(42);
//! let layer = mix().build().unwrap();
//! let client = ServiceBuilder::new().layer(layer.clone()).service(server.clone());
//! let mut unavailable = 0;
//! for _ in 0..1_000 {
//!     let request = Request::post("/payments").body(String::new()).unwrap();
//!     match client.clone().oneshot(request).await {
//!         Ok(response) if response.status() == StatusCode::SERVICE_UNAVAILABLE => unavailable += 1,
//!         Ok(response) => assert_eq!(response.status(), StatusCode::OK),
//!         Err(error) => assert!(find::<ReplyLost>(&*error).is_some()),
//!     }
//! }
//! let stats = layer.stats();
//! assert_eq!((stats.calls, stats.errors), (1_000, unavailable));
//! assert!((250..350).contains(&stats.lost_replies), "about 30 %: {stats:?}");
//!
//! let again = mix().build().unwrap();
//! let client = ServiceBuilder::new().layer(again.clone()).service(server);
//! for _ in 0..1_000 {
//!     let _ = client.clone().oneshot(Request::post("/payments").body(String::new()).unwrap()).await;
//! }
//! assert_eq!(again.stats(), stats);
//!
//! // Settings are checked once, naming every bad one.
//! let error = FaultLayer::new().lost_replies(0.8).error_answers(0.4, StatusCode::OK).build().unwrap_err();
//! assert_eq!(error.fields().collect::<Vec<_>>(), ["error_status", "faults"]);
//! # }
//! ```

mod error;
mod future;
mod layer;
mod service;

pub use error::{ConnectionReset, ReplyLost};
pub use future::ResponseFuture;
pub use layer::{FaultLayer, FaultStats};
pub use service::FaultService;
