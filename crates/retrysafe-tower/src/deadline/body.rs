//! The response body bound by the deadline ([`DeadlineLayer::bound_body`](super::DeadlineLayer::bound_body)).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use retrysafe_core::Deadline;
use retrysafe_core::error::DeadlineExceeded;
use tokio::time::Sleep;

use crate::BoxError;

/// What a [`DeadlineLayer`](super::DeadlineLayer) does with the response body: leave it
/// ([`Unbounded`], the default) or bound it by the deadline ([`BoundBody`]).
pub trait WrapBody<B>: Send + Sync + 'static {
    /// The body the layer answers with.
    type Body;

    /// Wraps `body`, which arrived before `deadline`.
    #[doc(hidden)]
    fn wrap(body: B, deadline: Deadline) -> Self::Body;
}

/// The deadline bounds the call up to the response head; the body is passed through
/// unchanged (the default).
#[derive(Debug, Clone, Copy, Default)]
pub struct Unbounded;

/// The deadline also bounds the response body: see [`DeadlineBody`].
#[derive(Debug, Clone, Copy, Default)]
pub struct BoundBody;

impl<B> WrapBody<B> for Unbounded {
    type Body = B;

    fn wrap(body: B, _: Deadline) -> B {
        body
    }
}

impl<B: Body> WrapBody<B> for BoundBody {
    type Body = DeadlineBody<B>;

    fn wrap(body: B, deadline: Deadline) -> DeadlineBody<B> {
        DeadlineBody::new(body, deadline)
    }
}

pin_project! {
    /// A response body that ends with a [`DeadlineExceeded`] error when it is still
    /// streaming at the deadline. A frame that is ready is always delivered first; size
    /// hints and the end of the stream are forwarded.
    pub struct DeadlineBody<B> {
        #[pin]
        inner: B,
        // `None` for a body that had ended already, or a default one.
        #[pin]
        sleep: Option<Sleep>,
        expired: bool,
    }
}

impl<B: Body> DeadlineBody<B> {
    /// `inner`, bounded by `deadline` (for adapters that wrap bodies themselves, such
    /// as the reqwest middleware of `retrysafe-reqwest`).
    #[doc(hidden)]
    pub fn new(inner: B, deadline: Deadline) -> Self {
        let sleep = if inner.is_end_stream() {
            None
        } else {
            Some(tokio::time::sleep_until(deadline.instant()))
        };
        DeadlineBody {
            inner,
            sleep,
            expired: false,
        }
    }
}

/// An empty body with no deadline (for synthesised gRPC statuses).
impl<B: Default> Default for DeadlineBody<B> {
    fn default() -> Self {
        DeadlineBody {
            inner: B::default(),
            sleep: None,
            expired: false,
        }
    }
}

impl<B> Body for DeadlineBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        if *this.expired {
            return Poll::Ready(None);
        }
        // The body first: a frame that is ready is never dropped for the timer.
        if let Poll::Ready(frame) = this.inner.poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        if let Some(sleep) = this.sleep.as_pin_mut() {
            ready!(sleep.poll(cx));
            *this.expired = true;
            tracing::debug!("response body still streaming at the deadline");
            return Poll::Ready(Some(Err(Box::new(DeadlineExceeded::new()))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.expired || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.expired {
            SizeHint::with_exact(0)
        } else {
            self.inner.size_hint()
        }
    }
}

impl<B> fmt::Debug for DeadlineBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeadlineBody")
            .field("expired", &self.expired)
            .finish_non_exhaustive()
    }
}
