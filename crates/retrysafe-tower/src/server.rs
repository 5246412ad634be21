//! A helper that assembles the recommended server order.
//!
//! Outermost first: `TraceLayer` → `EdgeLayer` (public edge only) → authentication
//! (inserts the [`Principal`](retrysafe_core::idempotency::Principal)) →
//! `PropagateLayer` / server `DeadlineLayer` → compression → [`IdempotencyLayer`] →
//! concurrency limit → handler. [`ServerLayers`] builds the part of that order whose
//! layers exist in this release: authentication, idempotency and the concurrency limit.
//! Nothing that cancels the handler or answers 408/5xx for it (a timeout layer) may sit
//! inside the `IdempotencyLayer`; put tracing, compression and timeouts outside.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use axum::{Router, routing::post, http::{Request, StatusCode}, body::Body};
//! use retrysafe_core::idempotency::Principal;
//! use retrysafe_tower::idempotency::IdempotencyLayer;
//! use retrysafe_tower::server::ServerLayers;
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

use crate::idempotency::{IdempotencyLayer, IdempotencyService};

/// The server-side layers in the recommended order, as one layer: authentication
/// (outermost) → [`IdempotencyLayer`] → concurrency limit (innermost).
#[derive(Clone, Debug)]
#[must_use]
pub struct ServerLayers<A> {
    authentication: A,
    idempotency: IdempotencyLayer,
    concurrency_limit: Option<usize>,
}

impl ServerLayers<Identity> {
    /// The order around `idempotency`, with no authentication layer yet (add one:
    /// the default scope comes from the `Principal` it inserts).
    pub fn new(idempotency: IdempotencyLayer) -> Self {
        ServerLayers {
            authentication: Identity::new(),
            idempotency,
            concurrency_limit: None,
        }
    }
}

impl<A> ServerLayers<A> {
    /// The authentication layer, which must insert a
    /// [`Principal`](retrysafe_core::idempotency::Principal) (or whatever the
    /// idempotency scope rule reads).
    pub fn authentication<A2>(self, layer: A2) -> ServerLayers<A2> {
        ServerLayers {
            authentication: layer,
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

    /// Checks the settings: the error names every one out of range.
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        v.check(
            self.concurrency_limit != Some(0),
            "concurrency_limit",
            "must be greater than zero",
        );
        v.finish(self)
    }
}

impl<S, A> Layer<S> for ServerLayers<A>
where
    A: Layer<IdempotencyService<Either<ConcurrencyLimit<S>, S>>>,
{
    type Service = A::Service;

    fn layer(&self, inner: S) -> Self::Service {
        let limited = match self.concurrency_limit {
            Some(n) => Either::Left(ConcurrencyLimitLayer::new(n.max(1)).layer(inner)),
            None => Either::Right(inner),
        };
        self.authentication.layer(self.idempotency.layer(limited))
    }
}
