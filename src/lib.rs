//! retrysafe: tower middleware that makes retries safe end to end.
//!
//! - **Servers** make non-idempotent endpoints (POST, PATCH) safe to retry with an
//!   [`IdempotencyLayer`](idempotency::IdempotencyLayer): a request repeated with the
//!   same `Idempotency-Key` gets a semantically equivalent response, and its side effect
//!   happens once — however many copies arrive, concurrently or late.
//! - **Clients** retry what is safe to retry, and nothing else, within a budget and a
//!   deadline: [`DeadlineLayer`], [`RetryLayer`], [`RetryBudgetLayer`],
//!   [`CircuitBreakerLayer`].
//! - **Both sides** speak one small header convention ([`wire`]): `idempotency-key`,
//!   `idempotent-replayed`, `do-not-retry`, `retry-attempt`, `retry-point`,
//!   `request-timeout-ms`, `grpc-timeout`, `retry-after`, `grpc-retry-pushback-ms`.
//!
//! # Server
//!
//! Recommended order, outermost first: `TraceLayer` → `EdgeLayer` (public edge only) →
//! authentication (inserts a [`Principal`](idempotency::Principal)) → `PropagateLayer` /
//! server `DeadlineLayer` → compression → [`IdempotencyLayer`](idempotency::IdempotencyLayer)
//! → concurrency limit → handler. [`server::ServerLayers`] assembles the part of it that
//! this release ships. Nothing that cancels the handler or answers 408/5xx on its behalf
//! (a timeout layer) may sit inside the `IdempotencyLayer`.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use axum::{Router, routing::post, http::{Request, StatusCode}, body::Body, Extension};
//! use retrysafe::idempotency::{IdempotencyContext, IdempotencyLayer, Principal};
//! use retrysafe::server::ServerLayers;
//! use tower::ServiceExt;
//!
//! async fn pay(Extension(ctx): Extension<IdempotencyContext>) -> StatusCode {
//!     ctx.commit_point().await.expect("still our claim"); // just before the effect
//!     // ... charge the card ...
//!     StatusCode::CREATED
//! }
//!
//! let auth = axum::middleware::map_request(|mut req: Request<Body>| async move {
//!     req.extensions_mut().insert(Principal::new("alice")); // your authentication
//!     req
//! });
//! let app = Router::new().route("/payments", post(pay)).layer(
//!     ServerLayers::new(IdempotencyLayer::in_memory().handlers_declare_commit_point())
//!         .authentication(auth),
//! );
//!
//! let req = |body: &'static str| {
//!     Request::post("/payments").header("idempotency-key", "pay-42").body(Body::from(body)).unwrap()
//! };
//! assert_eq!(app.clone().oneshot(req("10 EUR")).await.unwrap().status(), StatusCode::CREATED);
//! let retry = app.clone().oneshot(req("10 EUR")).await.unwrap();
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! let reused = app.oneshot(req("99 EUR")).await.unwrap();
//! assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY); // same key, other request
//! # }
//! ```
//!
//! # Client
//!
//! Recommended order, outermost first: [`DeadlineLayer`] → [`RetryLayer`] →
//! [`RetryBudgetLayer`] → [`CircuitBreakerLayer`] → transport. The deadline covers the
//! whole call; each attempt passes the budget and the breaker; a [`RetryLayer`] retries safe
//! requests only, replays the body through a [`ReplayBody`], honours `retry-after` and
//! `grpc-retry-pushback-ms`, and — when it gives up on a retryable failure — returns
//! the last response marked `do-not-retry: 1`, so no layer above retries again. On
//! servers, a [`PropagateLayer`] gives the handler's outbound calls the inbound deadline
//! and retry point through a [`CallContext`], and marks the server's own failure
//! `do-not-retry: 1` when one of them gave up.
//!
//! With every option on (features `throttle` and `hedge`), the order is: deadline →
//! `AdaptiveThrottleLayer` → `HedgeLayer` → retry → budget → breaker → transport. The
//! throttle rejects calls locally while the callee refuses many of them; the hedge
//! sends another copy of a slow safe request, paid for by the retry budget.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use http::{Request, Response, StatusCode};
//! use retrysafe::{ReplayBody, RetryBudget, RetryBudgetLayer, RetryLayer, StandardRetryStrategy};
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! // A transport that fails twice, then answers (in real code: hyper's client over
//! // `ReplayBody<_>`, or a tonic `Channel`).
//! let calls = Arc::new(AtomicU32::new(0));
//! let seen = calls.clone();
//! let transport = tower::service_fn(move |req: Request<ReplayBody<String>>| {
//!     let n = seen.fetch_add(1, Ordering::SeqCst);
//!     async move {
//!         assert!(req.headers().contains_key("idempotency-key")); // generated, same on every attempt
//!         let status = if n < 2 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::CREATED };
//!         Ok::<_, std::convert::Infallible>(Response::builder().status(status).body(()).unwrap())
//!     }
//! });
//!
//! let budget = RetryBudget::ratio(); // retries ≤ 20 % of requests + 10/s, shared by clones
//! let client = ServiceBuilder::new()
//!     .layer(
//!         RetryLayer::new()
//!             .strategy(StandardRetryStrategy::new().budget(budget.clone()))
//!             .generate_idempotency_keys(), // the downstream honours Idempotency-Key
//!     )
//!     .layer(RetryBudgetLayer::new(budget)) // also bounds retries made by other code
//!     .service(transport);
//!
//! let order = Request::post("http://orders.internal/orders").body("{}".to_owned()).unwrap();
//! let response = client.oneshot(order).await.unwrap();
//! assert_eq!(response.status(), StatusCode::CREATED);
//! assert_eq!(calls.load(Ordering::SeqCst), 3);
//! # }
//! ```
//!
//! The whole recommended stack, assembled with `ServiceBuilder`: the deadline covers the call, the
//! retry layer and the budget layer share one budget, and every attempt passes the
//! breaker.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::time::Duration;
//! use http::{Request, Response, StatusCode};
//! use retrysafe::breaker::{BreakerConfig, CircuitBreaker, SlidingWindow, State};
//! use retrysafe::error::{CircuitOpen, find};
//! use retrysafe::{
//!     CircuitBreakerLayer, Deadline, DeadlineLayer, ReplayBody, RetryBudget, RetryBudgetLayer,
//!     RetryLayer, StandardRetryStrategy,
//! };
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! // A downstream that is down (in real code: hyper's client over `ReplayBody<_>`).
//! let calls = Arc::new(AtomicU32::new(0));
//! let seen = calls.clone();
//! let transport = tower::service_fn(move |req: Request<ReplayBody<String>>| {
//!     seen.fetch_add(1, Ordering::SeqCst);
//!     async move {
//!         // Every attempt carries the call's deadline and the time left on the wire.
//!         assert!(req.extensions().get::<Deadline>().is_some());
//!         assert!(req.headers().contains_key("request-timeout-ms"));
//!         let status = StatusCode::SERVICE_UNAVAILABLE;
//!         Ok::<_, std::convert::Infallible>(Response::builder().status(status).body(()).unwrap())
//!     }
//! });
//!
//! let config = BreakerConfig::default()
//!     .with_window(SlidingWindow::count(10, 10))
//!     .with_minimum_calls(4); // opens at 50 % failures of at least 4 attempts
//! let breaker = CircuitBreaker::new(config);
//! let budget = RetryBudget::ratio();
//! let client = ServiceBuilder::new()
//!     .layer(DeadlineLayer::new(Duration::from_secs(2)))
//!     .layer(RetryLayer::new().strategy(StandardRetryStrategy::new().budget(budget.clone())))
//!     .layer(RetryBudgetLayer::new(budget))
//!     .layer(CircuitBreakerLayer::new(breaker.clone()))
//!     .service(transport);
//!
//! let get = || Request::get("http://inventory.internal/items").body(String::new()).unwrap();
//! // Three attempts, then the last answer, marked so that no layer above retries it.
//! let response = client.clone().oneshot(get()).await.unwrap();
//! assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
//! assert_eq!(response.headers()["do-not-retry"], "1");
//! assert_eq!(calls.load(Ordering::SeqCst), 3);
//!
//! // The fourth failed attempt opens the breaker, which refuses the retry after it.
//! let response = client.clone().oneshot(get()).await.unwrap();
//! assert_eq!(response.headers()["do-not-retry"], "1");
//! assert_eq!(calls.load(Ordering::SeqCst), 4);
//! assert_eq!(breaker.state(), State::Open);
//!
//! // Open: the call fails fast, without reaching the downstream.
//! let error = client.oneshot(get()).await.unwrap_err();
//! assert!(find::<CircuitOpen>(&*error).is_some());
//! assert_eq!(calls.load(Ordering::SeqCst), 4);
//! # }
//! ```
//!
//! # gRPC (tonic)
//!
//! The same stack wraps a tonic `Channel` and a generated client: one
//! [`GrpcStatusLayer`](answer::GrpcStatusLayer) on top answers the layers' own failures
//! as synthesised Trailers-Only statuses, and
//! one adapter line maps the `ReplayBody` into `tonic::body::Body` (the only body a
//! `Channel` takes). Map the error to `tonic::Status` at the top when the stack is boxed,
//! so a generated client's call stays `Send`. Here nothing listens on the port: the
//! refused connection is retried (nothing was sent) and the caller gets `UNAVAILABLE`.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use std::time::Duration;
//! use http::Request;
//! use retrysafe::answer::GrpcStatusLayer;
//! use retrysafe::{
//!     CircuitBreakerLayer, DeadlineLayer, ReplayBody, RetryBudget, RetryBudgetLayer, RetryLayer,
//! };
//! use tonic::body::Body;
//! use tonic::transport::Channel;
//! use tonic::{Code, Status};
//! use tonic_health::pb::HealthCheckRequest;
//! use tonic_health::pb::health_client::HealthClient;
//! use tower::ServiceBuilder;
//! use tower::util::{BoxCloneSyncService, MapRequestLayer};
//!
//! let channel = Channel::from_static("http://127.0.0.1:1").connect_lazy();
//! let stack = ServiceBuilder::new()
//!     .map_err(Status::from_error)
//!     .layer(GrpcStatusLayer::new())
//!     .layer(DeadlineLayer::new(Duration::from_secs(5)))
//!     .layer(RetryLayer::new().idempotent_if(|head| head.uri.path().starts_with("/grpc.health.v1.")))
//!     .layer(RetryBudgetLayer::new(RetryBudget::ratio()))
//!     .layer(CircuitBreakerLayer::default())
//!     .layer(MapRequestLayer::new(|r: Request<ReplayBody<Body>>| r.map(Body::new)))
//!     .service(channel);
//! let mut client = HealthClient::new(BoxCloneSyncService::new(stack));
//!
//! let status = client.check(HealthCheckRequest::default()).await.unwrap_err();
//! assert_eq!(status.code(), Code::Unavailable);
//! # }
//! ```
//!
//! # reqwest
//!
//! With the `reqwest` feature, `retrysafe::reqwest` holds the same client logic as
//! `reqwest_middleware::Middleware`s (`DeadlineMiddleware`, `RetryMiddleware`,
//! `CircuitBreakerMiddleware`), driving the same core.
//!
//! # Features
//!
//! - `idempotency` (default): [`idempotency`], [`server`] and the `retrysafe-memory` crate
//!   (`MemoryStore`, the default store) as [`memory`].
//! - `retry` (default): [`RetryLayer`] and [`ReplayBody`].
//! - `budget` (default): [`RetryBudgetLayer`].
//! - `breaker` (default): [`CircuitBreakerLayer`].
//! - `deadline` (default): [`DeadlineLayer`].
//! - `redis`: the `retrysafe-redis` crate (`RedisStore`) as `retrysafe::redis`.
//! - `postgres`: the `retrysafe-postgres` crate (`PostgresStore`, the transactional
//!   `TxIdempotencyLayer`, the outbox and its `OutboxRelay`, the idempotent `Consumer`)
//!   as `retrysafe::postgres`.
//! - `amqp`: with `postgres`, the outbox's RabbitMQ publisher and AMQP messages for the
//!   consumer (`retrysafe::postgres::outbox::amqp`, lapin).
//! - `reqwest`: the `retrysafe-reqwest` crate (reqwest-middleware implementations) as
//!   `retrysafe::reqwest`.
//! - `propagate` (default): [`PropagateLayer`].
//! - `edge` (default): [`EdgeLayer`].
//! - `metrics` (default): metrics through the `metrics` facade, for any recorder; names,
//!   labels and the attempt-number extension in [`observe`].
//! - `chaos` (not in `default`): [`FaultLayer`] in [`chaos`], which injects seeded
//!   latency, error answers, connection resets and replies lost after the effect, for
//!   tests and staging.
//! - `full`: everything.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use retrysafe_core::budget::RetryBudget;
pub use retrysafe_core::error::{self, BoxError};
pub use retrysafe_core::strategy::StandardRetryStrategy;
pub use retrysafe_core::{CallContext, ConfigError, Deadline, classify, observe, wire};
pub use retrysafe_tower::answer;

#[cfg(feature = "chaos")]
pub use chaos::FaultLayer;
#[cfg(feature = "idempotency")]
pub use retrysafe_memory as memory;
#[cfg(feature = "postgres")]
pub use retrysafe_postgres as postgres;
#[cfg(feature = "redis")]
pub use retrysafe_redis as redis;
#[cfg(feature = "reqwest")]
pub use retrysafe_reqwest as reqwest;
#[cfg(feature = "breaker")]
pub use retrysafe_tower::breaker::{self, CircuitBreakerLayer};
#[cfg(feature = "budget")]
pub use retrysafe_tower::budget::{self, RetryBudgetLayer};
#[cfg(feature = "client")]
pub use retrysafe_tower::client::{self, ClientLayers};
#[cfg(feature = "deadline")]
pub use retrysafe_tower::deadline::{self, DeadlineLayer};
#[cfg(feature = "edge")]
pub use retrysafe_tower::edge::{self, EdgeLayer};
#[cfg(feature = "hedge")]
pub use retrysafe_tower::hedge::{self, HedgeLayer};
#[cfg(feature = "propagate")]
pub use retrysafe_tower::propagate::{self, PropagateLayer};
#[cfg(feature = "retry")]
pub use retrysafe_tower::retry::{self, ReplayBody, RetryLayer};
#[cfg(feature = "throttle")]
pub use retrysafe_tower::throttle::{self, AdaptiveThrottleLayer};

/// Idempotency keys on servers: the [`IdempotencyLayer`](idempotency::IdempotencyLayer),
/// the [`MemoryStore`](idempotency::MemoryStore) (also [`memory::MemoryStore`]), and the
/// model they share with every store.
#[cfg(feature = "idempotency")]
pub mod idempotency {
    pub use retrysafe_core::idempotency::{
        Fingerprint, Fingerprinter, HeaderFilter, RecordId, Scope, StoredResponse, Token,
    };
    pub use retrysafe_core::store::{BoxStore, IdempotencyStore, StoreError};
    pub use retrysafe_memory::MemoryStore;
    pub use retrysafe_tower::idempotency::*;
}

/// Faults for tests and staging: the [`FaultLayer`] injects seeded
/// latency, error answers, connection resets and **replies lost after the effect** —
/// the inner service runs, its answer is dropped, and the caller gets a
/// [`ReplyLost`](chaos::ReplyLost) error that retry layers treat as a connection closed
/// before the response. Put it just above the transport of a client stack, so that
/// every attempt draws its own faults. Feature `chaos`, not in `default`.
///
/// A keyed client stack through lost replies, against a service guarded by an
/// [`IdempotencyLayer`](idempotency::IdempotencyLayer):
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// use std::collections::HashMap;
/// use std::sync::{Arc, Mutex};
/// use axum::{Extension, Router, routing::post, http::{Request, StatusCode}};
/// use retrysafe::chaos::FaultLayer;
/// use retrysafe::idempotency::{IdempotencyContext, IdempotencyLayer};
/// use retrysafe::{ClientLayers, RetryLayer};
/// use tower::{ServiceBuilder, ServiceExt};
///
/// // The service: records a payment per call, by idempotency key.
/// let paid: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
/// let ledger = paid.clone();
/// let pay = move |Extension(ctx): Extension<IdempotencyContext>| async move {
///     *ledger.lock().unwrap().entry(ctx.key().as_str().to_owned()).or_default() += 1;
///     StatusCode::CREATED
/// };
/// let guard = IdempotencyLayer::in_memory().global_scope().build().unwrap();
/// let service = Router::new().route("/payments", post(pay)).layer(guard);
///
/// // A third of all replies lost after the payment; the client retries with its key.
/// let faults = FaultLayer::new().lost_replies(0.3).seed(7).build().unwrap();
/// let retry = RetryLayer::new().generate_idempotency_keys(); // the service honours keys
/// let client = ServiceBuilder::new()
///     .layer(ClientLayers::new().retry(retry).build().unwrap())
///     .layer(faults.clone())
///     .service(service);
///
/// for _ in 0..10 {
///     let payment = Request::post("/payments").body(String::new()).unwrap();
///     // A retry after a lost reply gets the replay of the payment made.
///     let answer = client.clone().oneshot(payment).await.unwrap();
///     assert_eq!(answer.status(), StatusCode::CREATED);
/// }
/// assert!(faults.stats().lost_replies > 0);
/// assert_eq!(paid.lock().unwrap().len(), 10);
/// assert!(paid.lock().unwrap().values().all(|n| *n == 1), "no payment made twice");
/// # }
/// ```
#[cfg(feature = "chaos")]
pub mod chaos {
    pub use retrysafe_tower::chaos::*;
}

/// Recovery: the [`Reconciler`](recovery::Reconciler) that brings every pending
/// idempotency record to a definite state through the application's
/// [`Resolver`](recovery::Resolver), and the [`Operator`](recovery::Operator)'s API.
#[cfg(feature = "idempotency")]
pub mod recovery {
    pub use retrysafe_core::recovery::*;
}

#[cfg(feature = "idempotency")]
pub use retrysafe_tower::server;

/// The README's Rust code blocks, compiled and run as doc-tests
/// (`cargo test --doc -p retrysafe`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The guides' Rust code blocks (`docs/*.md`), one item each, compiled and run as
/// doc-tests like the README's; blocks that need a live Redis or PostgreSQL are
/// `no_run` (still compiled).
macro_rules! guide_doctests {
    ($($name:ident = $path:literal,)*) => {$(
        #[cfg(doctest)]
        #[doc = include_str!($path)]
        pub struct $name;
    )*};
}

guide_doctests! {
    ServerAndStoresDoctests = "../docs/server-and-stores.md",
    ChoosingAStoreDoctests = "../docs/choosing-a-store.md",
    RecoveryDoctests = "../docs/recovery.md",
    ClientAndGrpcDoctests = "../docs/client-and-grpc.md",
    FailoverDoctests = "../docs/failover.md",
    ObservabilityDoctests = "../docs/observability.md",
    TestingDoctests = "../docs/testing.md",
    GuaranteesDoctests = "../docs/guarantees.md",
    WireConventionDoctests = "../docs/wire-convention.md",
    ArchitectureDoctests = "../docs/architecture.md",
}
