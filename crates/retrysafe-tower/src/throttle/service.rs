use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::{HeaderMap, Request, Response, StatusCode};
use pin_project_lite::pin_project;
use retrysafe_core::classify::RequestFacts;
use retrysafe_core::error::Throttled;
use tower_service::Service;

use super::layer::Config;
use crate::BoxError;

/// The service of an [`AdaptiveThrottleLayer`](super::AdaptiveThrottleLayer).
#[derive(Clone, Debug)]
pub struct AdaptiveThrottleService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> AdaptiveThrottleService<S> {
    pub(super) fn new(inner: S, config: Arc<Config>) -> Self {
        AdaptiveThrottleService { inner, config }
    }

    define_inner_service_accessors!();
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for AdaptiveThrottleService<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        let kind = match admit(&self.config, request.headers()) {
            Some(admitted) => Kind::Called {
                future: self.inner.call(request),
                admitted,
            },
            None => Kind::Rejected,
        };
        ResponseFuture { kind }
    }
}

/// A call the throttle let through: its answer is counted as an accept, or not.
pub(crate) struct Admitted {
    config: Arc<Config>,
    facts: RequestFacts,
}

impl Admitted {
    /// Counts `response` as an accept unless it is a throttle or an overload.
    pub(crate) fn answered<B>(&self, response: &Response<B>) {
        if accepted(&self.config, response, &self.facts) {
            self.config.throttle.record_accept();
        }
    }
}

/// Draws for a call with these request `headers`: what counts its answer, or `None`
/// when the throttle rejects it locally (counted and reported).
pub(crate) fn admit(config: &Arc<Config>, headers: &HeaderMap) -> Option<Admitted> {
    if !config.throttle.admit(config.draws.next()) {
        tracing::debug!(name = %config.name, "call throttled locally");
        config.rejected();
        return None;
    }
    let facts = if retrysafe_core::__private::is_grpc(headers) {
        RequestFacts::SAFE.grpc()
    } else {
        RequestFacts::SAFE
    };
    Some(Admitted {
        config: Arc::clone(config),
        facts,
    })
}

pin_project! {
    /// The response future of [`AdaptiveThrottleService`].
    pub struct ResponseFuture<F> {
        #[pin]
        kind: Kind<F>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F> {
        Rejected,
        Called {
            #[pin]
            future: F,
            admitted: Admitted,
        },
    }
}

impl<F, ResB, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<ResB>, E>>,
    E: Into<BoxError>,
{
    type Output = Result<Response<ResB>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Rejected => Poll::Ready(Err(Box::new(Throttled::new()))),
            KindProj::Called { future, admitted } => {
                let result = ready!(future.poll(cx));
                if let Ok(response) = &result {
                    admitted.answered(response);
                }
                Poll::Ready(result.map_err(Into::into))
            }
        }
    }
}

/// Whether the callee accepted the call: neither a throttle nor an overload.
fn accepted<B>(config: &Config, response: &Response<B>, facts: &RequestFacts) -> bool {
    let headers = response.headers();
    let c = config
        .classifier
        .classify_response(response.status(), headers, facts);
    let overloaded = response.status() == StatusCode::SERVICE_UNAVAILABLE
        || (facts.grpc
            && headers
                .get("grpc-status")
                .is_some_and(|v| v.as_bytes() == b"14" || v.as_bytes() == b"8"));
    !c.throttle && !overloaded
}

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
