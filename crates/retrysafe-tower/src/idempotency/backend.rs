//! What runs a guarded request for an [`IdempotencyLayer`](super::IdempotencyLayer):
//! its backend.
//!
//! An `IdempotencyLayer<X>` guards requests with the same rules whatever its backend
//! `X` — the methods, the key, the scope, the body limit and the fingerprint, the bound
//! of requests in flight, the answers and the telemetry — and hands each guarded request
//! to `X`, in a task that outlives the caller (polled in place, spawned if the response
//! future is dropped first, so that dropping it cancels nothing). Two backends exist:
//!
//! - [`StoreBackend`], the default: the claim, the handler (its lease renewed) and the
//!   completion over an [`IdempotencyStore`](retrysafe_core::store::IdempotencyStore) —
//!   a [`MemoryStore`](super::MemoryStore), a `RedisStore`, a `PostgresStore`. Its
//!   settings are methods of `IdempotencyLayer` ([`lease`](super::IdempotencyLayer::lease),
//!   [`fail_open`](super::IdempotencyLayer::fail_open), …);
//! - `TxBackend` of `retrysafe-postgres`, the transactional mode: the request runs in a
//!   PostgreSQL transaction that also writes its key (`TxIdempotencyLayer`).
//!
//! Both drive one protocol, a state machine in `retrysafe-core`. [`Backend`]'s items
//! are plumbing between this crate and `retrysafe-postgres`: the trait is implemented
//! by these two backends only.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use retrysafe_core::ConfigError;
use tower_service::Service;

use super::body::{RequestBody, ResponseBody};
use super::request::Admitted;
use super::shared::Shared;

pub use super::store::StoreBackend;

/// What runs the guarded requests of an [`IdempotencyLayer`](super::IdempotencyLayer):
/// [`StoreBackend`] (the default, over any store) or the transactional `TxBackend` of
/// `retrysafe-postgres`. See the [module docs](self).
pub trait Backend: fmt::Debug + Send + Sync + 'static {
    /// Whether a request on a guarded method without a key is run by the backend
    /// (in the same detachable task, bounded like the others) instead of passing to
    /// the service untouched.
    #[doc(hidden)]
    const GUARDS_UNKEYED: bool = false;

    /// Whether the backend undoes a failed handler's effects (its transaction rolls
    /// back): nothing is then ever `outcome_unknown`.
    #[doc(hidden)]
    const ROLLS_BACK: bool = false;

    /// The settings of the backend that its setters refused, reported by the layer's
    /// `build`.
    #[doc(hidden)]
    fn refused(&self) -> Option<&ConfigError> {
        None
    }

    /// The settings of the backend that are refused together (each is fine alone),
    /// reported by the layer's `build`.
    #[doc(hidden)]
    fn conflicts(&self) -> Option<ConfigError> {
        None
    }

    /// Runs a guarded request: makes its engine and protocol and drives them
    /// (`engine::drive`).
    #[doc(hidden)]
    fn run<H: Handler>(
        &self,
        shared: &Shared,
        handler: H,
        request: Admitted<H::ReqBody>,
    ) -> impl Future<Output = Served<H>> + Send;
}

/// The inner service of a guarded request, as a backend gets it: called once, with the
/// request it is to run. (The layer's service passes its inner service wrapped in one;
/// backends only call it.)
#[doc(hidden)]
pub trait Handler: Send + 'static {
    /// The body of the requests the layer receives (the service gets it as a
    /// [`RequestBody`]).
    type ReqBody: Body<Data = Bytes> + Send + 'static;
    /// The body of the service's responses.
    type ResBody: Body<Data = Bytes> + Send + 'static;
    /// The service's error.
    type Error: Send + 'static;

    /// Calls the service with `request`.
    fn call(
        self,
        request: Request<RequestBody<Self::ReqBody>>,
    ) -> impl Future<Output = Result<Response<Self::ResBody>, Self::Error>> + Send + 'static;
}

/// What a guarded request of handler `H` is served with: the layer's response, or the
/// service's error.
#[doc(hidden)]
pub type Served<H> = Result<Response<ResponseBody<<H as Handler>::ResBody>>, <H as Handler>::Error>;

/// A service `S` taking requests with bodies `B`, as a [`Handler`].
pub(crate) struct Inner<S, B> {
    service: S,
    body: PhantomData<fn(B)>,
}

impl<S, B> Inner<S, B> {
    pub(crate) fn new(service: S) -> Self {
        Inner {
            service,
            body: PhantomData,
        }
    }
}

impl<S, B, ResB> Handler for Inner<S, B>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
{
    type ReqBody = B;
    type ResBody = ResB;
    type Error = S::Error;

    fn call(
        mut self,
        request: Request<RequestBody<B>>,
    ) -> impl Future<Output = Result<Response<ResB>, S::Error>> + Send + 'static {
        self.service.call(request)
    }
}
