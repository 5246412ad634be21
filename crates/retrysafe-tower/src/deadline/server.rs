//! The server form: [`ServerDeadlineLayer`], [`ServerDeadlineService`] and its
//! [`ServerResponseFuture`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use pin_project_lite::pin_project;
use retrysafe_core::__private::Validate;
use retrysafe_core::__private::is_grpc;
use retrysafe_core::ConfigError;
use retrysafe_core::error::DeadlineExceeded;
use retrysafe_core::problem::{Problem, ProblemKind};
use retrysafe_core::wire::{Convention, TimeoutError};
use tokio::time::Sleep;
use tower_layer::Layer;
use tower_service::Service;

use crate::answer::{LocalBody, grpc_status_response, problem};
use crate::propagate::{self, Inbound};

/// The server form of the [`DeadlineLayer`](super::DeadlineLayer), made by
/// [`DeadlineLayer::server`](super::DeadlineLayer::server); see the [module docs](super).
///
/// Everything a [`PropagateLayer`](crate::propagate::PropagateLayer) does, plus: a
/// malformed inbound timeout answers 400 (gRPC: `INVALID_ARGUMENT`), and a handler that
/// outlives the inbound deadline (less the margin) is dropped and answered 504 (gRPC:
/// `DEADLINE_EXCEEDED`).
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct ServerDeadlineLayer {
    inbound: Arc<Inbound>,
}

impl ServerDeadlineLayer {
    /// Clamps an inbound timeout to `max` (greater than zero, at most 30 days; the
    /// default is 30 days).
    pub fn max_timeout(mut self, max: Duration) -> Self {
        Arc::make_mut(&mut self.inbound).max_timeout = max;
        self
    }

    /// What is kept for the way back (default 10 ms; at most 1 minute): the handler, and
    /// its outbound calls, get the inbound time less this.
    pub fn margin(mut self, margin: Duration) -> Self {
        Arc::make_mut(&mut self.inbound).margin = margin;
        self
    }

    /// Checks the settings: the error names every one out of range.
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        self.inbound.validate(&mut v);
        v.finish(self)
    }

    /// The header names.
    pub fn convention(mut self, convention: Convention) -> Self {
        Arc::make_mut(&mut self.inbound).convention = convention;
        self
    }
}

impl<S> Layer<S> for ServerDeadlineLayer {
    type Service = ServerDeadlineService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ServerDeadlineService {
            inner,
            inbound: self.inbound.clone(),
        }
    }
}

/// The service of a [`ServerDeadlineLayer`].
#[derive(Debug, Clone)]
pub struct ServerDeadlineService<S> {
    inner: S,
    inbound: Arc<Inbound>,
}

impl<S> ServerDeadlineService<S> {
    define_inner_service_accessors!();
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for ServerDeadlineService<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
{
    type Response = Response<LocalBody<propagate::ResponseBody<ResB>>>;
    type Error = S::Error;
    type Future = ServerResponseFuture<S::Future, ResB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqB>) -> Self::Future {
        let grpc = is_grpc(request.headers());
        let timeout = match self.inbound.timeout(request.headers()) {
            Ok(timeout) => timeout,
            Err(error) => {
                tracing::debug!(%error, "refusing a malformed inbound timeout");
                return ServerResponseFuture {
                    kind: Kind::Invalid {
                        grpc,
                        error,
                        inbound: self.inbound.clone(),
                        _body: std::marker::PhantomData,
                    },
                };
            }
        };
        // The same context as the `PropagateLayer`'s: the handler and its outbound
        // calls get the deadline less the margin, and the layer enforces that.
        let ctx = self.inbound.attach(&mut request, timeout);
        if ctx.deadline().is_some_and(|d| d.remaining().is_zero()) {
            // Nothing is left (`0`, or no more than the margin): answered before the
            // handler starts, so a caller that gave up starts no work here.
            tracing::debug!("refusing a request whose inbound deadline has passed");
            return ServerResponseFuture {
                kind: Kind::Expired {
                    grpc,
                    inbound: self.inbound.clone(),
                    _body: std::marker::PhantomData,
                },
            };
        }
        let sleep = ctx
            .deadline()
            .map(|d| tokio::time::sleep_until(d.instant()));
        let future = ctx.clone().sync_scope(|| self.inner.call(request));
        ServerResponseFuture {
            kind: Kind::Inner {
                future: propagate::ResponseFuture::marking(future, ctx, &self.inbound.convention),
                sleep,
                grpc,
                inbound: self.inbound.clone(),
            },
        }
    }
}

pin_project! {
    /// The response future of [`ServerDeadlineService`].
    pub struct ServerResponseFuture<F, B> {
        #[pin]
        kind: Kind<F, B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B> {
        Invalid {
            grpc: bool,
            error: TimeoutError,
            inbound: Arc<Inbound>,
            _body: std::marker::PhantomData<fn() -> B>,
        },
        Expired {
            grpc: bool,
            inbound: Arc<Inbound>,
            _body: std::marker::PhantomData<fn() -> B>,
        },
        Inner {
            #[pin]
            future: propagate::ResponseFuture<F>,
            #[pin]
            sleep: Option<Sleep>,
            grpc: bool,
            inbound: Arc<Inbound>,
        },
        Done,
    }
}

impl<F, B, E> Future for ServerResponseFuture<F, B>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<LocalBody<propagate::ResponseBody<B>>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut kind = self.project().kind;
        let output = match kind.as_mut().project() {
            KindProj::Invalid {
                grpc,
                error,
                inbound,
                ..
            } => Ok(invalid_timeout(*grpc, *error, &inbound.convention)),
            KindProj::Expired { grpc, inbound, .. } => {
                Ok(deadline_exceeded(*grpc, &inbound.convention))
            }
            KindProj::Inner {
                future,
                sleep,
                grpc,
                inbound,
            } => {
                // The handler before the timer: a response that is ready is never dropped.
                if let Poll::Ready(result) = future.poll(cx) {
                    result.map(|response| response.map(LocalBody::inner))
                } else {
                    let Some(sleep) = sleep.as_pin_mut() else {
                        return Poll::Pending;
                    };
                    ready!(sleep.poll(cx));
                    tracing::debug!("the handler outlived the inbound deadline");
                    Ok(deadline_exceeded(*grpc, &inbound.convention))
                }
            }
            KindProj::Done => return Poll::Pending,
        };
        // Done: the handler's future (and its task-local scope) is dropped now, and a
        // poll after completion is harmless.
        kind.set(Kind::Done);
        Poll::Ready(output)
    }
}

impl<F, B> fmt::Debug for ServerResponseFuture<F, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerResponseFuture")
            .finish_non_exhaustive()
    }
}

/// 504 problem+json `deadline-exceeded` (gRPC: `DEADLINE_EXCEEDED`), `do-not-retry: 1`,
/// with the [`DeadlineExceeded`] error in the extensions.
fn deadline_exceeded<B: Default + From<Bytes>>(grpc: bool, convention: &Convention) -> Response<B> {
    let mut response = problem(grpc, &DeadlineExceeded::new(), convention).unwrap_or_else(|| {
        let mut r = Response::new(B::default());
        *r.status_mut() = StatusCode::GATEWAY_TIMEOUT;
        r
    });
    response.extensions_mut().insert(DeadlineExceeded::new());
    response
}

/// 400 problem+json `timeout-invalid` (gRPC: `INVALID_ARGUMENT`), with the
/// [`TimeoutError`] in the extensions.
fn invalid_timeout<B: Default + From<Bytes>>(
    grpc: bool,
    error: TimeoutError,
    convention: &Convention,
) -> Response<B> {
    let header = if grpc {
        convention.grpc_timeout()
    } else {
        convention.request_timeout_ms()
    };
    let detail = format!("{header}: {error}");
    let mut response = if grpc {
        grpc_status_response(3, &detail, convention)
    } else {
        let problem = Problem::new(ProblemKind::TimeoutInvalid, detail);
        let mut response = problem.to_response().map(B::from);
        response.extensions_mut().insert(problem);
        response
    };
    response.extensions_mut().insert(error);
    response
}
