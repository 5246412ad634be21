use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::Response;
use pin_project_lite::pin_project;

use super::body::ResponseBody;

pub(crate) type GuardedFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

pin_project! {
    /// Response future of [`IdempotencyService`](super::IdempotencyService).
    ///
    /// Requests the layer does not guard are polled in place; guarded ones poll the task
    /// that runs them, which is spawned to finish on its own if this future is dropped
    /// first, so dropping this future cancels nothing (with the
    /// transactional layer of `retrysafe-postgres`, the transaction still commits or
    /// rolls back as the handler's answer says).
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        Passthrough { #[pin] future: F },
        Ready { response: Option<Response<ResponseBody<B>>> },
        Guarded { future: GuardedFuture<B, E> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn passthrough(future: F) -> Self {
        ResponseFuture {
            kind: Kind::Passthrough { future },
        }
    }

    pub(crate) fn ready(response: Response<ResponseBody<B>>) -> Self {
        ResponseFuture {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }

    pub(crate) fn guarded(future: GuardedFuture<B, E>) -> Self {
        ResponseFuture {
            kind: Kind::Guarded { future },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { future } => {
                let res = ready!(future.poll(cx))?;
                Poll::Ready(Ok(res.map(ResponseBody::stream)))
            }
            KindProj::Ready { response } => match response.take() {
                Some(r) => Poll::Ready(Ok(r)),
                None => Poll::Pending,
            },
            KindProj::Guarded { future } => future.as_mut().poll(cx),
        }
    }
}

impl<F, B, E> fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Passthrough { .. } => "Passthrough",
            Kind::Ready { .. } => "Ready",
            Kind::Guarded { .. } => "Guarded",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish()
    }
}
