//! The response body: records a gRPC status that arrives in the trailers.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use retrysafe_core::classify::BreakerOutcome;

use super::future::Call;

pin_project! {
    /// The response body of [`CircuitBreakerService`](super::CircuitBreakerService): the inner body, unchanged.
    ///
    /// For a gRPC response whose head carries no status (headers first), the call's
    /// outcome is recorded when the stream ends: from the `grpc-status` of its
    /// trailers, as a failure when the stream breaks (an error frame), and as
    /// **neutral** when the body is dropped before its end — the callee answered, and
    /// the caller chose to stop reading (a half-open probe is then given back for
    /// another caller to take). Every other response is recorded at its head, and its
    /// body is passed through.
    pub struct ResponseBody<B> {
        #[pin]
        inner: B,
        pending: Pending,
    }
}

/// The call whose outcome waits for the end of the stream (boxed: every response of the
/// breaker carries this field, and only a gRPC response with its status in the trailers
/// fills it; a response kept small is moved inline, not by a `memcpy` call).
struct Pending(Option<Box<Call>>);

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(call) = self.0.take() {
            call.record(BreakerOutcome::Neutral);
        }
    }
}

impl<B> ResponseBody<B> {
    /// A body whose call is already recorded.
    pub(crate) fn plain(inner: B) -> Self {
        ResponseBody {
            inner,
            pending: Pending(None),
        }
    }

    /// A body that records `call` at the end of the stream.
    pub(crate) fn pending(inner: B, call: Call) -> Self {
        ResponseBody {
            inner,
            pending: Pending(Some(Box::new(call))),
        }
    }

    /// The inner body.
    pub fn get_ref(&self) -> &B {
        &self.inner
    }

    /// Whether the call's outcome still waits for the end of the stream.
    #[doc(hidden)]
    pub fn is_pending(&self) -> bool {
        self.pending.0.is_some()
    }
}

impl<B: Body> Body for ResponseBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = ready!(this.inner.poll_frame(cx));
        if this.pending.0.is_some() {
            match &frame {
                Some(Ok(frame)) => {
                    if let Some(trailers) = frame.trailers_ref()
                        && let Some(call) = this.pending.0.take()
                    {
                        call.trailers(trailers);
                    }
                }
                Some(Err(_)) => {
                    if let Some(call) = this.pending.0.take() {
                        call.stream_failed();
                    }
                }
                None => {
                    if let Some(call) = this.pending.0.take() {
                        call.trailers(&HeaderMap::new());
                    }
                }
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B: Default> Default for ResponseBody<B> {
    fn default() -> Self {
        ResponseBody::plain(B::default())
    }
}

impl<B: fmt::Debug> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseBody")
            .field("inner", &self.inner)
            .field("pending", &self.is_pending())
            .finish()
    }
}
