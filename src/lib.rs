//! retrysafe: tower middleware that makes retries safe end to end.
//!
//! - **Servers** make non-idempotent endpoints (POST, PATCH) safe to retry with an
//!   [`IdempotencyLayer`](idempotency::IdempotencyLayer): a request repeated with the
//!   same `Idempotency-Key` gets a semantically equivalent response, and its side effect
//!   happens once — however many copies arrive, concurrently or late.
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
//! The client layers (`DeadlineLayer` → `RetryLayer` → `RetryBudgetLayer` →
//! `CircuitBreakerLayer` → transport) build on the same core; they are not part of this
//! release yet.
//!
//! # Features
//!
//! - `idempotency` (default): [`idempotency`] and [`server`].
//! - `retry` (default): [`RetryLayer`] and [`ReplayBody`].
//! - `budget` (default): [`RetryBudgetLayer`].
//! - `propagate` (default): [`PropagateLayer`].
//! - `edge` (default): [`EdgeLayer`].
//! - `full`: everything.
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

pub use retrysafe_core as core;
pub use retrysafe_core::budget::RetryBudget;
pub use retrysafe_core::strategy::StandardRetryStrategy;
pub use retrysafe_core::{CallContext, ConfigError, Deadline, wire};
pub use retrysafe_tower::local;

#[cfg(feature = "budget")]
pub use retrysafe_tower::budget::{self, RetryBudgetLayer};
#[cfg(feature = "edge")]
pub use retrysafe_tower::edge::{self, EdgeLayer};
#[cfg(feature = "propagate")]
pub use retrysafe_tower::propagate::{self, PropagateLayer};
#[cfg(feature = "retry")]
pub use retrysafe_tower::retry::{self, ReplayBody, RetryLayer};

/// Idempotency keys on servers: the [`IdempotencyLayer`](idempotency::IdempotencyLayer),
/// the [`MemoryStore`](idempotency::MemoryStore), and the model they share with every
/// store.
#[cfg(feature = "idempotency")]
pub mod idempotency {
    pub use retrysafe_core::idempotency::{
        Fingerprint, Fingerprinter, HeaderFilter, RecordId, Scope, StoredResponse,
    };
    pub use retrysafe_core::store::{BoxStore, IdempotencyStore, StoreError};
    pub use retrysafe_tower::idempotency::*;
}

#[cfg(feature = "idempotency")]
pub use retrysafe_tower::server;
