//! Middleware that carries the wire convention from an inbound request to the outbound
//! calls its handler makes (the server side of the convention).
//!
//! [`PropagateLayer`] reads the inbound deadline (`request-timeout-ms`, or `grpc-timeout`
//! for gRPC requests; clamped to a maximum, less a margin of 10 ms by default) and
//! `retry-point: caller` into a [`CallContext`], which it makes current for the inner
//! service — as a tokio task-local around both `call` and the response future, and as a
//! request extension for code that spawns tasks. Outbound client layers (a
//! [`RetryLayer`](crate::retry::RetryLayer)) pick it up without plumbing: their deadline
//! shrinks, a caller that is the retry point gets one attempt per outbound call, and
//! when they give up they record `downstream_gave_up`. Then this layer marks the
//! server's own failure response `do-not-retry: 1`, so a chain of services retries at
//! one layer only:
//!
//! - a 5xx, or a gRPC error status in the head (a Trailers-Only response, which is how
//!   tonic answers a unary call that failed): the marker goes into the head;
//! - a gRPC response whose status comes in the trailers, after its headers and messages
//!   (a streaming call): the body is watched through [`ResponseBody`], and an error
//!   status in the trailers gets the marker in the trailers, where gRPC clients read the
//!   status and its metadata. An outbound call that gives up while the stream is being
//!   produced counts too: the context stays current while such a body is polled, so
//!   the outbound client layers of a streaming handler inherit it as well.
//!
//! A malformed inbound timeout is ignored here (the server form of the `DeadlineLayer`
//! answers 400 instead). Put an [`EdgeLayer`](crate::edge::EdgeLayer) before this layer at
//! a public edge: inbound convention headers are only honoured from trusted peers.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::time::Duration;
//! use http::{Request, Response, StatusCode};
//! use retrysafe::CallContext;
//! use retrysafe::PropagateLayer;
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! let svc = ServiceBuilder::new()
//!     .layer(PropagateLayer::new())
//!     .service(tower::service_fn(|_req: Request<()>| async {
//!         // Deep in the handler: the inherited context.
//!         let ctx = CallContext::current().unwrap();
//!         assert_eq!(ctx.deadline().unwrap().remaining(), Duration::from_millis(490));
//!         assert!(ctx.caller_is_retry_point());
//!         // An outbound call gave up after retrying:
//!         ctx.mark_downstream_gave_up();
//!         Ok::<_, std::convert::Infallible>(
//!             Response::builder().status(StatusCode::BAD_GATEWAY).body(()).unwrap(),
//!         )
//!     }));
//!
//! let request = Request::post("/orders")
//!     .header("request-timeout-ms", "500")
//!     .header("retry-point", "caller")
//!     .body(())
//!     .unwrap();
//! let response = svc.oneshot(request).await.unwrap();
//! assert_eq!(response.headers()["do-not-retry"], "1");
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::{HeaderMap, Request, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use retrysafe_core::__private::Validate;
use retrysafe_core::__private::is_grpc;
use retrysafe_core::wire::{
    Convention, DO_NOT_RETRY_VALUE, MAX_TIMEOUT, RetryPoint, TimeoutError, parse_grpc_timeout,
    parse_request_timeout_ms, parse_retry_point,
};
use retrysafe_core::{CallContext, ConfigError, Deadline, Scoped};
use tower_layer::Layer;
use tower_service::Service;

/// The default margin taken off an inbound deadline for outbound calls: 10 ms.
pub(crate) const DEFAULT_MARGIN: Duration = Duration::from_millis(10);

#[derive(Debug, Clone)]
pub(crate) struct Inbound {
    pub(crate) convention: Convention,
    pub(crate) margin: Duration,
    pub(crate) max_timeout: Duration,
}

impl Default for Inbound {
    fn default() -> Self {
        Inbound {
            convention: Convention::default(),
            margin: DEFAULT_MARGIN,
            max_timeout: MAX_TIMEOUT,
        }
    }
}

impl Inbound {
    /// Checks the margin and the maximum.
    pub(crate) fn validate(&self, v: &mut Validate) {
        v.timeout(self.max_timeout, "max timeout");
        v.check(
            self.margin <= Duration::from_secs(60),
            "margin",
            "must be at most 1 minute",
        );
    }

    /// The inbound timeout header, clamped to the maximum: `Ok(None)` when absent.
    pub(crate) fn timeout(&self, headers: &HeaderMap) -> Result<Option<Duration>, TimeoutError> {
        let parsed = if is_grpc(headers) {
            headers
                .get(self.convention.grpc_timeout())
                .map(|v| parse_grpc_timeout(v.as_bytes()))
        } else {
            headers
                .get(self.convention.request_timeout_ms())
                .map(|v| parse_request_timeout_ms(v.as_bytes()))
        };
        parsed
            .transpose()
            .map(|t| t.map(|t| t.min(self.max_timeout)))
    }

    /// The context of an inbound request: what is left of `timeout` less the margin,
    /// and the retry point.
    pub(crate) fn context(
        &self,
        extensions: &http::Extensions,
        headers: &HeaderMap,
        timeout: Option<Duration>,
    ) -> CallContext {
        let mut ctx = CallContext::inherited(extensions).unwrap_or_default();
        if let Some(t) = timeout {
            ctx = ctx.with_deadline(Deadline::after(t.saturating_sub(self.margin)));
        }
        let retry_point = headers
            .get(self.convention.retry_point())
            .and_then(|v| parse_retry_point(v.as_bytes()));
        if retry_point == Some(RetryPoint::Caller) {
            ctx = ctx.with_caller_is_retry_point(true);
        }
        ctx
    }

    /// The [`context`](Inbound::context) of `request`, also put in its extensions (with
    /// its deadline) for handlers and for code that spawns tasks and carries it by hand.
    pub(crate) fn attach<B>(
        &self,
        request: &mut Request<B>,
        timeout: Option<Duration>,
    ) -> CallContext {
        let ctx = self.context(request.extensions(), request.headers(), timeout);
        if let Some(d) = ctx.deadline() {
            request.extensions_mut().insert(d);
        }
        request.extensions_mut().insert(ctx.clone());
        ctx
    }
}

/// Carries the inbound deadline and retry point to outbound calls; see the [module
/// docs](self).
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct PropagateLayer {
    inbound: Arc<Inbound>,
}

impl PropagateLayer {
    /// The defaults: margin 10 ms, inbound timeouts clamped to 30 days.
    pub fn new() -> Self {
        Self::default()
    }

    /// The header names.
    pub fn convention(mut self, convention: Convention) -> Self {
        Arc::make_mut(&mut self.inbound).convention = convention;
        self
    }

    /// What outbound calls leave for the way back: they get the inbound time less this
    /// (default 10 ms; at most 1 minute).
    pub fn margin(mut self, margin: Duration) -> Self {
        Arc::make_mut(&mut self.inbound).margin = margin;
        self
    }

    /// Clamps an inbound timeout to `max` (greater than zero, at most 30 days).
    pub fn max_timeout(mut self, max: Duration) -> Self {
        Arc::make_mut(&mut self.inbound).max_timeout = max;
        self
    }

    /// Checks the settings: the error names every one out of range.
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        self.inbound.validate(&mut v);
        v.finish(self)
    }
}

impl<S> Layer<S> for PropagateLayer {
    type Service = PropagateService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        PropagateService {
            inner,
            inbound: self.inbound.clone(),
        }
    }
}

/// The service of a [`PropagateLayer`].
#[derive(Debug, Clone)]
pub struct PropagateService<S> {
    inner: S,
    inbound: Arc<Inbound>,
}

impl<S> PropagateService<S> {
    define_inner_service_accessors!();
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for PropagateService<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqB>) -> Self::Future {
        let timeout = self.inbound.timeout(request.headers()).unwrap_or_else(|e| {
            tracing::debug!(error = %e, "ignoring a malformed inbound timeout");
            None
        });
        let ctx = self.inbound.attach(&mut request, timeout);
        let future = ctx.clone().sync_scope(|| self.inner.call(request));
        ResponseFuture::marking(future, ctx, &self.inbound.convention)
    }
}

pin_project! {
    /// The response future of [`PropagateService`]: the inner future with the context current,
    /// marking a failure `do-not-retry: 1` when downstream gave up — in the head, and in
    /// the trailers of a gRPC stream (see [`ResponseBody`]).
    pub struct ResponseFuture<F> {
        #[pin]
        inner: Scoped<F>,
        ctx: CallContext,
        do_not_retry: http::HeaderName,
        // Ready once: a poll after completion is `Pending`, not a re-poll of the
        // task-local scope (which panics).
        done: bool,
    }
}

impl<F: Future> ResponseFuture<F> {
    /// Marks the head, and the trailers through a [`ResponseBody`].
    pub(crate) fn marking(future: F, ctx: CallContext, convention: &Convention) -> Self {
        ResponseFuture {
            inner: ctx.clone().scope(future),
            ctx,
            do_not_retry: convention.do_not_retry().clone(),
            done: false,
        }
    }
}

impl<F, ResB, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<ResB>, E>>,
{
    type Output = Result<Response<ResponseBody<ResB>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if *this.done {
            return Poll::Pending;
        }
        let result = ready!(this.inner.poll(cx));
        *this.done = true;
        let mut response = result?;
        mark_head(&mut response, this.ctx, this.do_not_retry);
        // A gRPC response without a status in its head: the status comes in the
        // trailers, which the body watches.
        let watch = is_grpc(response.headers()) && !response.headers().contains_key(GRPC_STATUS);
        Poll::Ready(Ok(if watch {
            let watch = Watch {
                ctx: this.ctx.clone(),
                do_not_retry: this.do_not_retry.clone(),
            };
            response.map(|body| ResponseBody {
                inner: body,
                watch: Some(watch),
            })
        } else {
            response.map(ResponseBody::plain)
        }))
    }
}

/// Marks a failure `do-not-retry: 1` in the head when downstream gave up.
fn mark_head<B>(response: &mut Response<B>, ctx: &CallContext, do_not_retry: &http::HeaderName) {
    if ctx.downstream_gave_up() && is_failure(response) {
        response
            .headers_mut()
            .insert(do_not_retry.clone(), DO_NOT_RETRY_VALUE);
    }
}

const GRPC_STATUS: &str = "grpc-status";

/// A 5xx, or a gRPC error status in the head (a Trailers-Only response).
pub(crate) fn is_failure<B>(response: &Response<B>) -> bool {
    if response.status().is_server_error() {
        return true;
    }
    is_grpc_error(response.headers())
}

/// A `grpc-status` other than `0` (OK).
fn is_grpc_error(headers: &HeaderMap) -> bool {
    headers
        .get(GRPC_STATUS)
        .is_some_and(|v| v.as_bytes() != b"0")
}

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("ctx", &self.ctx)
            .finish_non_exhaustive()
    }
}

/// What a watched body needs: the context and the marker's name.
struct Watch {
    ctx: CallContext,
    do_not_retry: http::HeaderName,
}

pin_project! {
    /// The response body of [`PropagateService`]: the inner body, with every frame, `size_hint`
    /// and `is_end_stream` passed through.
    ///
    /// For a gRPC response whose head carries no status (a streaming call: headers
    /// first, the status in the trailers), the body is *watched*: while it is polled the
    /// request's [`CallContext`] is current (so the outbound client layers of the code
    /// producing the stream inherit it), and when the trailers carry an error status and
    /// an outbound call made for this request gave up, they get `do-not-retry: 1`. Every
    /// other body is passed through as it is.
    pub struct ResponseBody<B> {
        #[pin]
        inner: B,
        watch: Option<Watch>,
    }
}

impl<B> ResponseBody<B> {
    /// A body passed through as it is.
    pub(crate) fn plain(inner: B) -> Self {
        ResponseBody { inner, watch: None }
    }

    /// The inner body.
    pub fn get_ref(&self) -> &B {
        &self.inner
    }

    /// Whether the trailers are still watched (a gRPC stream not yet at its end).
    #[doc(hidden)]
    pub fn is_watched(&self) -> bool {
        self.watch.is_some()
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
        let Some(watch) = this.watch.as_ref() else {
            return this.inner.poll_frame(cx);
        };
        let inner = this.inner;
        let frame = ready!(watch.ctx.clone().sync_scope(|| inner.poll_frame(cx)));
        match frame {
            Some(Ok(frame)) if frame.is_trailers() => {
                let Some(watch) = this.watch.take() else {
                    return Poll::Ready(Some(Ok(frame)));
                };
                Poll::Ready(Some(Ok(match frame.into_trailers() {
                    Ok(mut trailers) => {
                        if watch.ctx.downstream_gave_up() && is_grpc_error(&trailers) {
                            trailers.insert(watch.do_not_retry, DO_NOT_RETRY_VALUE);
                        }
                        Frame::trailers(trailers)
                    }
                    Err(frame) => frame,
                })))
            }
            Some(Ok(frame)) => Poll::Ready(Some(Ok(frame))),
            other => {
                // The end, or an error: no trailers to mark.
                *this.watch = None;
                Poll::Ready(other)
            }
        }
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
            .field("watched", &self.is_watched())
            .finish()
    }
}
