//! The gRPC form: [`GrpcClientLayers`], a stack a tonic generated client takes as it is.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tonic::Status;
use tonic::body::Body as GrpcBody;
use tower_layer::Layer;
use tower_service::Service;

use super::layer::ClientLayers;
use super::service::{self, ClientService, Fused};
use crate::BoxError;
use crate::answer::{self, GrpcStatusLayer, GrpcStatusService};
use crate::breaker::{Guarded, ResponseBody};
use crate::retry::{Attempts, ReplayBody};

/// [`ClientLayers`] for a tonic generated client, made by [`ClientLayers::grpc`]: over
/// a `Channel` (any service of `Request<tonic::body::Body>`), it makes a service that
/// `HealthClient::new` (or any generated client) takes directly. Inside are the body
/// adapter (`ReplayBody` into `tonic::body::Body`), the answers to local failures as
/// synthesised Trailers-Only statuses (a [`GrpcStatusLayer`]: `DEADLINE_EXCEEDED` for
/// the deadline, `UNAVAILABLE` for an open breaker or an exhausted budget, each marked
/// `do-not-retry: 1`), and every other error as a [`tonic::Status`] (transport
/// failures: what `Status::from_error` makes of them, as the generated client would).
#[derive(Clone, Debug)]
#[must_use]
pub struct GrpcClientLayers {
    layers: ClientLayers,
    status: GrpcStatusLayer,
}

impl ClientLayers {
    /// The gRPC form of this stack; see [`GrpcClientLayers`].
    pub fn grpc(self) -> GrpcClientLayers {
        GrpcClientLayers {
            status: GrpcStatusLayer::new().convention(self.retry_convention().clone()),
            layers: self,
        }
    }
}

impl<S: Clone> Layer<S> for GrpcClientLayers {
    type Service = GrpcClientService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcClientService {
            inner: self.status.layer(self.layers.layer(IntoGrpcBody { inner })),
        }
    }
}

/// The service of [`GrpcClientLayers`]: takes and gives what a tonic generated client
/// does; its errors are [`Status`]es.
#[derive(Clone, Debug)]
pub struct GrpcClientService<S> {
    inner: GrpcStatusService<ClientService<IntoGrpcBody<S>>>,
}

// Not `define_inner_service_accessors!`: the transport is three services down.
impl<S> GrpcClientService<S> {
    /// The transport (a tonic `Channel`, say).
    pub fn get_ref(&self) -> &S {
        &self.inner.get_ref().get_ref().inner
    }

    /// The transport, mutably: see [`ClientService::get_mut`].
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner.get_mut().get_mut().inner
    }

    /// The transport, `self` consumed.
    pub fn into_inner(self) -> S {
        self.inner.into_inner().into_inner().inner
    }
}

impl<S, ResB> Service<Request<GrpcBody>> for GrpcClientService<S>
where
    S: Service<Request<GrpcBody>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
    ResB: Default,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = Status;
    type Future = GrpcResponseFuture<S>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Status::from_error)
    }

    fn call(&mut self, request: Request<GrpcBody>) -> Self::Future {
        GrpcResponseFuture {
            inner: self.inner.call(request),
        }
    }
}

pin_project! {
    /// The response future of [`GrpcClientService`].
    #[allow(private_bounds, reason = "the attempts' maker is an implementation detail")]
    pub struct GrpcResponseFuture<S>
    where
        Guarded<IntoGrpcBody<S>>: Attempts<GrpcBody>,
        Fused<IntoGrpcBody<S>>: Service<Request<ReplayBody<GrpcBody>>>,
    {
        #[pin]
        inner: answer::ResponseFuture<service::ResponseFuture<IntoGrpcBody<S>, GrpcBody>>,
    }
}

impl<S, ResB> Future for GrpcResponseFuture<S>
where
    S: Service<Request<GrpcBody>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
    ResB: Default,
{
    type Output = Result<Response<ResponseBody<ResB>>, Status>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Poll::Ready(ready!(self.project().inner.poll(cx)).map_err(Status::from_error))
    }
}

impl<S> fmt::Debug for GrpcResponseFuture<S>
where
    Guarded<IntoGrpcBody<S>>: Attempts<GrpcBody>,
    Fused<IntoGrpcBody<S>>: Service<Request<ReplayBody<GrpcBody>>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrpcResponseFuture").finish_non_exhaustive()
    }
}

/// The body adapter: a `Channel` takes only `tonic::body::Body`.
#[derive(Clone, Debug)]
#[doc(hidden)]
pub struct IntoGrpcBody<S> {
    inner: S,
}

impl<S> Service<Request<ReplayBody<GrpcBody>>> for IntoGrpcBody<S>
where
    S: Service<Request<GrpcBody>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReplayBody<GrpcBody>>) -> Self::Future {
        self.inner.call(request.map(GrpcBody::new))
    }
}
