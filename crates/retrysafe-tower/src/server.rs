//! A helper that assembles the recommended server order.
//!
//! Outermost first: `TraceLayer` → `EdgeLayer` (public edge only) → authentication
//! (inserts the [`Principal`](retrysafe_core::idempotency::Principal)) →
//! `PropagateLayer` / server `DeadlineLayer` → compression → [`IdempotencyLayer`] →
//! concurrency limit → handler. [`ServerLayers`] builds the part of that order inside
//! tracing: authentication, the inbound deadline, idempotency and the concurrency limit.
//! Nothing that cancels the handler or answers 408/5xx for it (a timeout layer) may sit
//! inside the `IdempotencyLayer`; put tracing, compression and timeouts outside.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use axum::{Router, routing::post, http::{Request, StatusCode}, body::Body};
//! use retrysafe::idempotency::Principal;
//! use retrysafe::idempotency::IdempotencyLayer;
//! use retrysafe::server::ServerLayers;
//! use tower::ServiceExt;
//!
//! let auth = axum::middleware::map_request(|mut req: Request<Body>| async move {
//!     req.extensions_mut().insert(Principal::new("alice"));
//!     req
//! });
//! let layers = ServerLayers::new(IdempotencyLayer::in_memory())
//!     .authentication(auth)
//!     .concurrency_limit(64);
//! let app = Router::new()
//!     .route("/orders", post(|| async { StatusCode::CREATED }))
//!     .layer(layers);
//! let req = || Request::post("/orders").header("idempotency-key", "o-1").body(Body::empty()).unwrap();
//! assert_eq!(app.clone().oneshot(req()).await.unwrap().status(), StatusCode::CREATED);
//! let again = app.oneshot(req()).await.unwrap();
//! assert_eq!(again.headers()["idempotent-replayed"], "true");
//! # }
//! ```

use retrysafe_core::__private::Validate;
use retrysafe_core::ConfigError;
use tower::limit::{ConcurrencyLimit, ConcurrencyLimitLayer};
use tower::util::Either;
use tower_layer::{Identity, Layer};

use crate::idempotency::{IdempotencyLayer, IdempotencyService, StoreBackend};

/// The server-side layers in the recommended order, as one layer: authentication
/// (outermost) → the inbound deadline → [`IdempotencyLayer`] (store-backed, or the
/// transactional layer of `retrysafe-postgres`) → concurrency limit (innermost).
///
/// [`build`](Self::build) refuses a stack that can never find a scope: no
/// authentication layer to insert the `Principal`, and an idempotency layer that reads
/// its scope from it (neither `scope_by`, `global_scope` nor
/// `scope_by_authorization_hash`). Every keyed request of such a stack would be answered
/// 500 `scope-missing`.
#[derive(Clone, Debug)]
#[must_use]
pub struct ServerLayers<A, D = Identity, X = StoreBackend> {
    authentication: A,
    authenticated: bool,
    deadline: D,
    idempotency: IdempotencyLayer<X>,
    concurrency_limit: Option<usize>,
}

impl<X> ServerLayers<Identity, Identity, X> {
    /// The order around `idempotency`, with no authentication layer yet (add one:
    /// the default scope comes from the `Principal` it inserts) and no inbound
    /// deadline.
    pub fn new(idempotency: IdempotencyLayer<X>) -> Self {
        ServerLayers {
            authentication: Identity::new(),
            authenticated: false,
            deadline: Identity::new(),
            idempotency,
            concurrency_limit: None,
        }
    }
}

impl<A, D, X> ServerLayers<A, D, X> {
    /// The authentication layer, which must insert a
    /// [`Principal`](retrysafe_core::idempotency::Principal) (or whatever the
    /// idempotency scope rule reads).
    pub fn authentication<A2>(self, layer: A2) -> ServerLayers<A2, D, X> {
        ServerLayers {
            authentication: layer,
            authenticated: true,
            deadline: self.deadline,
            idempotency: self.idempotency,
            concurrency_limit: self.concurrency_limit,
        }
    }

    /// The layer that reads the inbound deadline (`request-timeout-ms`,
    /// `grpc-timeout`) inside authentication and outside the idempotency layer: the
    /// server `DeadlineLayer` (`DeadlineLayer::server()`, which also refuses a
    /// malformed timeout with 400 `timeout-invalid` and answers 504
    /// `deadline-exceeded` once the deadline has passed), or a `PropagateLayer`.
    pub fn deadline<D2>(self, layer: D2) -> ServerLayers<A, D2, X> {
        ServerLayers {
            authentication: self.authentication,
            authenticated: self.authenticated,
            deadline: layer,
            idempotency: self.idempotency,
            concurrency_limit: self.concurrency_limit,
        }
    }

    /// Limits concurrent handler executions, inside the idempotency layer (so replays
    /// and conflicts are answered without taking a slot). Greater than zero, checked by
    /// [`build`](Self::build) (zero is used as one).
    pub fn concurrency_limit(mut self, max: usize) -> Self {
        self.concurrency_limit = Some(max);
        self
    }

    /// Checks the settings: the error names every one that is refused.
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        v.check(
            self.authenticated || !self.idempotency.shared.rules().scoped_by_principal(),
            "authentication",
            "is missing: the idempotency layer scopes keys by the Principal that an \
             authentication layer inserts, so every keyed request would be refused with \
             500 scope-missing; add one with `authentication`, or choose a scope with \
             `scope_by` or `global_scope`",
        );
        v.check(
            self.concurrency_limit != Some(0),
            "concurrency_limit",
            "must be greater than zero",
        );
        v.finish(self)
    }
}

impl<S, A, D, X> Layer<S> for ServerLayers<A, D, X>
where
    D: Layer<IdempotencyService<Either<ConcurrencyLimit<S>, S>, X>>,
    A: Layer<D::Service>,
{
    type Service = A::Service;

    fn layer(&self, inner: S) -> Self::Service {
        let limited = match self.concurrency_limit {
            Some(n) => Either::Left(ConcurrencyLimitLayer::new(n.max(1)).layer(inner)),
            None => Either::Right(inner),
        };
        let guarded = self.idempotency.layer(limited);
        self.authentication.layer(self.deadline.layer(guarded))
    }
}
