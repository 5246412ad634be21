//! The answers layers give by themselves, instead of the inner service's: how the
//! failures client layers generate (a deadline, an open breaker, an exhausted budget)
//! are answered, and the body of a response that is either a layer's own answer or the
//! inner service's ([`LocalBody`]).
//!
//! The client layers always fail with their typed errors, boxed: [`DeadlineExceeded`],
//! [`CircuitOpen`], [`BudgetExhausted`] (and a `RetryLayer` recognises a refusal from
//! below by its type). For gRPC, one adapter placed outermost, [`GrpcStatusLayer`],
//! turns them into synthesised Trailers-Only responses, so tonic's generated clients
//! report the right code instead of `Unknown`:
//!
//! | local failure | gRPC status (with [`GrpcStatusLayer`]) | HTTP |
//! |---|---|---|
//! | [`DeadlineExceeded`] | 4 `DEADLINE_EXCEEDED` | the error |
//! | [`BudgetExhausted`], [`CircuitOpen`], [`Throttled`] | 14 `UNAVAILABLE` | the error |
//!
//! Every synthesised status carries `do-not-retry: 1`. Only a response body that can be
//! empty (`Default`, like `tonic::body::Body`) can carry one.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use http::{Request, Response};
//! use retrysafe::error::DeadlineExceeded;
//! use retrysafe::BoxError;
//! use retrysafe::answer::GrpcStatusLayer;
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! let svc = ServiceBuilder::new()
//!     .layer(GrpcStatusLayer::new())
//!     .service(tower::service_fn(|_req: Request<()>| async {
//!         Err::<Response<String>, BoxError>(Box::new(DeadlineExceeded::new()))
//!     }));
//!
//! let call = Request::post("/grpc.health.v1.Health/Check")
//!     .header("content-type", "application/grpc")
//!     .body(())
//!     .unwrap();
//! let response = svc.oneshot(call).await.unwrap();
//! assert_eq!(response.headers()["grpc-status"], "4");
//! assert_eq!(response.headers()["do-not-retry"], "1");
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::{HeaderValue, Request, Response, StatusCode};
use retrysafe_core::__private::is_grpc;
use retrysafe_core::error::{BudgetExhausted, CircuitOpen, DeadlineExceeded, Throttled, find};
use retrysafe_core::wire::{Convention, DO_NOT_RETRY_VALUE};
use tower_layer::Layer;
use tower_service::Service;

use crate::BoxError;

/// Answers the local failures of the client layers below it, for gRPC requests, with
/// synthesised Trailers-Only statuses (see the [module docs](self)). Put it outermost
/// in a gRPC client stack, once; other requests and other errors pass through.
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct GrpcStatusLayer {
    convention: Arc<Convention>,
}

impl GrpcStatusLayer {
    /// The adapter with the default [`Convention`].
    pub fn new() -> Self {
        Self::default()
    }

    /// The header names (`do-not-retry` on synthesised statuses).
    pub fn convention(self, convention: Convention) -> Self {
        GrpcStatusLayer {
            convention: Arc::new(convention),
        }
    }
}

impl<S> Layer<S> for GrpcStatusLayer {
    type Service = GrpcStatusService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcStatusService {
            inner,
            convention: self.convention.clone(),
        }
    }
}

/// The service of a [`GrpcStatusLayer`].
#[derive(Debug, Clone)]
pub struct GrpcStatusService<S> {
    inner: S,
    convention: Arc<Convention>,
}

impl<S> GrpcStatusService<S> {
    define_inner_service_accessors!();
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for GrpcStatusService<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
    ResB: Default,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        // Only gRPC requests get a status: the convention is needed for them alone.
        let convention = is_grpc(request.headers()).then(|| self.convention.clone());
        ResponseFuture {
            inner: self.inner.call(request),
            convention,
        }
    }
}

pin_project_lite::pin_project! {
    /// The response future of [`GrpcStatusService`].
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        // `Some` for a gRPC request.
        convention: Option<Arc<Convention>>,
    }
}

impl<F, ResB, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<ResB>, E>>,
    E: Into<BoxError>,
    ResB: Default,
{
    type Output = Result<Response<ResB>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let error = match ready!(this.inner.poll(cx)) {
            Ok(response) => return Poll::Ready(Ok(response)),
            Err(error) => error.into(),
        };
        Poll::Ready(match this.convention.as_deref() {
            Some(convention) => grpc_answer(error, convention),
            None => Err(error),
        })
    }
}

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("grpc", &self.convention.is_some())
            .finish_non_exhaustive()
    }
}

/// The gRPC status of a local failure: 4 for a deadline, 14 for a breaker, budget or
/// throttle.
fn grpc_code(error: &(dyn std::error::Error + 'static)) -> Option<u8> {
    if find::<DeadlineExceeded>(error).is_some() {
        Some(4)
    } else if find::<BudgetExhausted>(error).is_some()
        || find::<CircuitOpen>(error).is_some()
        || find::<Throttled>(error).is_some()
    {
        Some(14)
    } else {
        None
    }
}

/// A local failure of a gRPC request as a synthesised status; any other error as it is.
fn grpc_answer<B: Default>(
    error: BoxError,
    convention: &Convention,
) -> Result<Response<B>, BoxError> {
    match grpc_code(&*error) {
        Some(code) => Ok(grpc_status_response(code, &error.to_string(), convention)),
        None => Err(error),
    }
}

/// A Trailers-Only gRPC response with `code`, `message` (percent-encoded as gRPC
/// requires) and `do-not-retry: 1`.
pub(crate) fn grpc_status_response<B: Default>(
    code: u8,
    message: &str,
    convention: &Convention,
) -> Response<B> {
    let mut response = Response::new(B::default());
    *response.status_mut() = StatusCode::OK;
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert("grpc-status", HeaderValue::from(u16::from(code)));
    if let Ok(v) = HeaderValue::from_str(&percent_encode(message)) {
        headers.insert("grpc-message", v);
    }
    headers.insert(convention.do_not_retry().clone(), DO_NOT_RETRY_VALUE);
    response
}

fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push_str(&format!("{b:02X}"));
        }
    }
    out
}

/// A local failure on a server's inbound path: gRPC requests get a synthesised status,
/// others an RFC 9457 `application/problem+json` 503 with `do-not-retry: 1` (type
/// `urn:retrysafe:problem:<slug>`: `retry-budget-exhausted`, `deadline-exceeded` (504),
/// `circuit-open`). `None` for an error that is not a local failure.
#[cfg(any(feature = "budget", feature = "deadline"))]
pub(crate) fn problem<B: Default + From<bytes::Bytes>>(
    grpc: bool,
    error: &(dyn std::error::Error + 'static),
    convention: &Convention,
) -> Option<Response<B>> {
    use retrysafe_core::problem::{Problem, ProblemKind};
    if grpc {
        let code = grpc_code(error)?;
        return Some(grpc_status_response(code, &error.to_string(), convention));
    }
    let kind = if find::<DeadlineExceeded>(error).is_some() {
        ProblemKind::DeadlineExceeded
    } else if find::<BudgetExhausted>(error).is_some() {
        ProblemKind::BudgetExhausted
    } else if find::<CircuitOpen>(error).is_some() {
        ProblemKind::CircuitOpen
    } else {
        return None;
    };
    let problem = Problem::new(kind, error.to_string());
    let (mut parts, body) = problem.to_response().into_parts();
    if problem.do_not_retry() {
        parts
            .headers
            .insert(convention.do_not_retry().clone(), DO_NOT_RETRY_VALUE);
    }
    parts.extensions.insert(problem);
    Some(Response::from_parts(parts, B::from(body)))
}

pin_project_lite::pin_project! {
    /// The response body of a server layer that may answer by itself (the server
    /// [`DeadlineLayer`](crate::deadline::DeadlineLayer::server), the server
    /// [`RetryBudgetLayer`](crate::budget::RetryBudgetLayer::server)): the inner
    /// service's body, passed through with every frame, `size_hint` and `is_end_stream`,
    /// or the bytes of the layer's own answer (a problem+json document, or nothing for a
    /// Trailers-Only gRPC status).
    ///
    /// With it the layers need nothing of the inner body but [`http_body::Body`], so they
    /// fit axum routers and tonic servers alike (`tonic::body::Body` cannot be made from
    /// bytes).
    pub struct LocalBody<B> {
        #[pin]
        kind: LocalKind<B>,
    }
}

pin_project_lite::pin_project! {
    #[project = LocalKindProj]
    enum LocalKind<B> {
        Inner { #[pin] body: B },
        Local { data: Option<bytes::Bytes> },
    }
}

impl<B> LocalBody<B> {
    /// The inner service's body.
    #[allow(
        dead_code,
        reason = "used by the layers that answer by themselves, behind their features"
    )]
    pub(crate) fn inner(body: B) -> Self {
        LocalBody {
            kind: LocalKind::Inner { body },
        }
    }

    /// The inner service's body, or `None` for a layer's own answer.
    pub fn get_ref(&self) -> Option<&B> {
        match &self.kind {
            LocalKind::Inner { body } => Some(body),
            LocalKind::Local { .. } => None,
        }
    }
}

impl<B> Default for LocalBody<B> {
    /// An empty local answer.
    fn default() -> Self {
        LocalBody {
            kind: LocalKind::Local { data: None },
        }
    }
}

impl<B> From<bytes::Bytes> for LocalBody<B> {
    /// A local answer of these bytes.
    fn from(data: bytes::Bytes) -> Self {
        LocalBody {
            kind: LocalKind::Local {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }
}

impl<B> http_body::Body for LocalBody<B>
where
    B: http_body::Body<Data = bytes::Bytes>,
{
    type Data = bytes::Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        match self.project().kind.project() {
            LocalKindProj::Inner { body } => body.poll_frame(cx),
            LocalKindProj::Local { data } => {
                std::task::Poll::Ready(data.take().map(|d| Ok(http_body::Frame::data(d))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            LocalKind::Inner { body } => body.is_end_stream(),
            LocalKind::Local { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match &self.kind {
            LocalKind::Inner { body } => body.size_hint(),
            LocalKind::Local { data } => {
                http_body::SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

impl<B: fmt::Debug> fmt::Debug for LocalBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            LocalKind::Inner { body } => f.debug_tuple("LocalBody::Inner").field(body).finish(),
            LocalKind::Local { data } => f.debug_tuple("LocalBody::Local").field(data).finish(),
        }
    }
}
