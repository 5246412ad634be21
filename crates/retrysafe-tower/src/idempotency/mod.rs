//! Middleware that makes non-idempotent requests safe to retry by `Idempotency-Key`.
//!
//! A request repeated with the same key gets a semantically equivalent response, and
//! its side effect happens once. Wrap the routes that have effects (POST, PATCH) in an
//! [`IdempotencyLayer`], inside the authentication layer that inserts the caller's
//! [`Principal`]:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use axum::{Router, routing::post, http::{Request, StatusCode}, body::Body};
//! use retrysafe::idempotency::Principal;
//! use retrysafe::idempotency::IdempotencyLayer;
//! use std::sync::{Arc, atomic::{AtomicUsize, Ordering}};
//! use tower::ServiceExt;
//!
//! let effects = Arc::new(AtomicUsize::new(0));
//! let counter = effects.clone();
//! let app = Router::new()
//!     .route("/payments", post(move || async move {
//!         counter.fetch_add(1, Ordering::SeqCst);
//!         (StatusCode::CREATED, "paid")
//!     }))
//!     .layer(IdempotencyLayer::in_memory())
//!     // authentication, outside: inserts the Principal
//!     .layer(axum::middleware::map_request(|mut req: Request<Body>| async move {
//!         req.extensions_mut().insert(Principal::new("alice"));
//!         req
//!     }));
//!
//! let send = || Request::post("/payments").header("idempotency-key", "k-1").body(Body::empty()).unwrap();
//! let first = app.clone().oneshot(send()).await.unwrap();
//! let again = app.clone().oneshot(send()).await.unwrap();
//! assert_eq!(first.status(), StatusCode::CREATED);
//! assert_eq!(again.status(), StatusCode::CREATED);
//! assert_eq!(again.headers()["idempotent-replayed"], "true");
//! assert_eq!(effects.load(Ordering::SeqCst), 1);
//! # }
//! ```
//!
//! # What each request gets
//!
//! | situation | answer | record |
//! |---|---|---|
//! | no key (and not [`require_key`](IdempotencyLayer::require_key)) | passes through, not guarded | none |
//! | no key with `require_key` | 400 `key-missing` | none |
//! | key empty, over 255 characters, not printable ASCII, or sent twice | 400 `key-invalid` | none |
//! | body over the limit (1 MiB) | 413 `body-too-large`, before any claim | none |
//! | body not arrived within [`request_body_timeout`](IdempotencyLayer::request_body_timeout) (30 s) | 408 `body-timeout`, before any claim | none |
//! | first request | claimed, handler runs, response stored | in progress → completed |
//! | same key and request, completed | the stored response, `idempotent-replayed: true` | — |
//! | same key and request, in flight | 409 `request-in-flight` with `retry-after`, or (with [`wait_for_in_flight`](IdempotencyLayer::wait_for_in_flight)) the replay | — |
//! | same key, different request | 422 `key-mismatch`, `do-not-retry: 1` | — |
//! | same key, other scope | an independent record | — |
//! | handler answers 2xx, 3xx, 4xx but 401/403/408/429 | stored for the retention (24 h) | completed |
//! | handler answers 401, 403, 429, or marks [`NoEffect`] | released: a retry runs again | none |
//! | handler answers 5xx or 408, or panics | as the handler did, `do-not-retry: 1`; later copies get 500 `outcome-unknown`; the reconcile hook runs | outcome unknown |
//! | client disconnects | the handler still runs to completion and its response is stored | completed |
//! | holder died or stalled (lease expired) | before its commit point: the next copy takes over; otherwise `outcome-unknown` | — |
//! | response body over 1 MiB | recorded as not stored before the rest streams; later copies get 409 `response-not-stored`, `do-not-retry: 1` | completed (marker) |
//! | store unavailable or slow | 503 `store-unavailable` with `retry-after` (or unguarded with [`fail_open`](IdempotencyLayer::fail_open)) | none |
//! | more than 1024 guarded requests in flight, or the store's own bound of claims reached ([`MemoryStore`]'s `max_in_flight`) | 503 `overloaded` with `retry-after`, never unguarded | none |
//!
//! Problem answers are RFC 9457 `application/problem+json` with a stable `type`
//! (`urn:retrysafe:problem:<slug>`, see [`ProblemKind`]) and carry the [`Problem`] as a
//! response extension; [`problem_responder`](IdempotencyLayer::problem_responder)
//! replaces them.
//!
//! # Execution model
//!
//! After the body is buffered and fingerprinted, one task claims, runs the handler,
//! collects the response body (up to the storable limit) and completes the record. The
//! response future polls it in place (no spawn and no hand-off between worker threads
//! per request); if the response future is dropped before the task finished (the
//! client went away, an outer timeout fired), the task is spawned as it stands and runs
//! to completion, so dropping it cancels nothing. This work is bounded
//! (`max_in_flight`) and tracked: [`IdempotencyLayer::shutdown_handle`] drains it on
//! graceful shutdown.
//!
//! Nothing that cancels the handler or answers 408/5xx on its behalf (a timeout layer)
//! may sit *inside* this layer.
//!
//! # Observability
//!
//! Each guarded request with a key runs in a `retrysafe.idempotency` span (level INFO,
//! target `retrysafe::idempotency`) whose fields are the layer's
//! [`name`](IdempotencyLayer::name), its `decision` (as
//! [`Decision::as_str`](retrysafe_core::idempotency::Decision::as_str): `first`,
//! `replay`, `in_flight`, `mismatch`, `unknown`, `takeover`, …), `scope` and `key` —
//! the first 8 hex digits of the scope's hash and of the record id (a hash of scope and
//! key), never the key itself — and `store_round_trips` with their total
//! `store_seconds`. A disabled span costs a check: no hashing, no clock read. The same
//! decisions reach the [`on_event`](IdempotencyLayer::on_event) hook, and, with the
//! feature `metrics`, the layer's metrics (see [`retrysafe_core::observe`]).
//!
//! # Backends
//!
//! What runs a guarded request is the layer's [`backend`]: by default the
//! claim–run–complete protocol above over any
//! [`IdempotencyStore`](retrysafe_core::store::IdempotencyStore), whose own settings
//! ([`lease`](IdempotencyLayer::lease), [`fail_open`](IdempotencyLayer::fail_open), …)
//! are methods of `IdempotencyLayer`. The transactional layer of `retrysafe-postgres`
//! (`TxIdempotencyLayer`) is the same layer over a backend that runs the handler in a
//! PostgreSQL transaction that also writes its key.
//!
//! A guarded request takes one path: the service ([`IdempotencyService`]) decides
//! whether to guard it and reads its body; its detachable task hands it to the
//! backend, whose engine the protocol drives (claim, run, capture, settle); the answer
//! is written by the layer's rules for responses (problems, replays).

mod answers;
pub mod backend;
mod body;
pub(crate) mod engine;
mod event;
mod future;
mod layer;
mod problem;
mod renewal;
pub(crate) mod request;
mod rules;
mod service;
pub(crate) mod shared;
mod slots;
mod store;
mod task;
pub(crate) mod telemetry;
mod timer;

pub use backend::StoreBackend;
pub use body::{RequestBody, ResponseBody};
pub use event::{Decision, EventKind, IdempotencyEvent, UnknownOutcome, UnknownReason};
pub use future::ResponseFuture;
pub use layer::{IdempotencyLayer, Shutdown};
pub use problem::{Problem, ProblemKind};
pub use retrysafe_core::idempotency::{IdempotencyContext, NoEffect, Principal};
use retrysafe_memory::MemoryStore;
pub use service::IdempotencyService;

/// What the transactional layer of `retrysafe-postgres` builds on.
pub(crate) mod plumbing {
    pub use super::answers::{Answers, CapturedResponse};
    pub use super::backend::{Handler, Served};
    pub use super::engine::{Engine, HandlerResult, Ran, drive};
    pub use super::layer::duration_setting;
    pub use super::request::{Admitted, KeyedRequest};
    pub use super::shared::Shared;
    pub use super::telemetry::{RoundTrips, StoreOp, Telemetry};
}
