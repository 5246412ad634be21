//! The fused service: [`ClientService`] and its [`ResponseFuture`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower_service::Service;

use retrysafe_core::__private::Striped;

use crate::breaker::{self, Guarded, ResponseBody};
use crate::local::BoxError;
use crate::retry::{self, Attempts, ReplayBody};

/// The service of [`ClientLayers`](super::ClientLayers): deadline, retry, budget and
/// breaker in one.
///
/// Its `poll_ready` is always ready: the transport's readiness is awaited inside the
/// response future, where it counts against the deadline (and, for the breaker, after
/// the permit is taken), as in the separate layers. Hence `S: Clone` (wrap a service
/// that is not in a `tower::buffer::Buffer`).
pub struct ClientService<S> {
    inner: S,
    retry: Arc<retry::Config>,
    breaker: Striped<breaker::Config>,
    /// The breaker takes the planner's word for the timeout headers it writes.
    same_names: bool,
    deadline: Option<Duration>,
}

impl<S> ClientService<S> {
    pub(crate) fn new(
        inner: S,
        retry: Arc<retry::Config>,
        breaker: Striped<breaker::Config>,
        deadline: Option<Duration>,
    ) -> Self {
        ClientService {
            same_names: Guarded::<S>::same_names(&breaker, retry.policy.convention()),
            inner,
            retry,
            breaker,
            deadline,
        }
    }

    /// The transport.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone> Clone for ClientService<S> {
    fn clone(&self) -> Self {
        ClientService {
            inner: self.inner.clone(),
            retry: self.retry.clone(),
            breaker: self.breaker.clone(),
            same_names: self.same_names,
            deadline: self.deadline,
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for ClientService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientService")
            .field("inner", &self.inner)
            .field("retry", &self.retry)
            .field("breaker", &self.breaker)
            .field("deadline", &self.deadline)
            .finish()
    }
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for ClientService<S>
where
    S: Service<Request<ReplayBody<ReqB>>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
    ReqB: Body,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = BoxError;
    type Future = ResponseFuture<S, ReqB>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The breaker decides in `call`, and readiness is awaited in the future.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        let clone = self.inner.clone();
        let service = std::mem::replace(&mut self.inner, clone);
        let (parts, body) = request.into_parts();
        // One clock read for the deadline and the first attempt's timeout header. The
        // deadline goes to the retry planner directly, not through the request's
        // extensions: nothing between needs it there.
        let within = self.deadline.map(|timeout| {
            let now = Instant::now();
            (crate::deadline::deadline_after(timeout, now), now)
        });
        // One breaker lookup per call, on the head as the planner leaves it.
        let (breaker, same_names) = (&self.breaker, self.same_names);
        ResponseFuture {
            inner: retry::begin(&self.retry, parts, body, within, |parts| {
                Guarded::new(service, breaker, parts, same_names)
            }),
        }
    }
}

pin_project! {
    /// The response future of [`ClientService`]: the retry loop, each attempt through
    /// the breaker, bounded by the deadline.
    #[allow(private_bounds, reason = "the attempts' maker is an implementation detail")]
    pub struct ResponseFuture<S, B>
    where
        Guarded<S>: Attempts<B>,
    {
        #[pin]
        inner: retry::Driver<Guarded<S>, B>,
    }
}

impl<S, B, R> Future for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>> + Clone,
    S::Error: Into<BoxError>,
    B: Body,
{
    type Output = Result<Response<ResponseBody<R>>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().inner.poll(cx)
    }
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    Guarded<S>: Attempts<B> + fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("inner", &self.inner)
            .finish()
    }
}
