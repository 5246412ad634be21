//! How a client layer answers a failure it generated itself (a deadline, an open
//! breaker, an exhausted budget): as an error, or — for gRPC requests — as a
//! synthesised Trailers-Only response, so tonic's generated clients report the right
//! code instead of `Unknown`.
//!
//! The choice is a type parameter of the layer, because only a response body that can
//! be empty (`Default`, like `tonic::body::Body`) can carry a synthesised status:
//! [`AsError`] (the default) works with any body, [`AsGrpcStatus`] with such bodies.
//!
//! | local failure | gRPC status | HTTP (and [`AsError`]) |
//! |---|---|---|
//! | [`DeadlineExceeded`] | 4 `DEADLINE_EXCEEDED` | the error |
//! | [`BudgetExhausted`], [`CircuitOpen`] | 14 `UNAVAILABLE` | the error |
//!
//! Every synthesised status carries `do-not-retry: 1`.
//!
//! ```
//! use retrysafe_core::error::DeadlineExceeded;
//! use retrysafe_core::wire::Convention;
//! use retrysafe_tower::local::{AsGrpcStatus, LocalFailure};
//!
//! let answer = <AsGrpcStatus as LocalFailure<String>>::answer(
//!     true,
//!     Box::new(DeadlineExceeded::new()),
//!     &Convention::default(),
//! );
//! let response = answer.unwrap();
//! assert_eq!(response.headers()["grpc-status"], "4");
//! assert_eq!(response.headers()["do-not-retry"], "1");
//! ```

use std::fmt;

use http::{HeaderValue, Response, StatusCode};
use retrysafe_core::error::{BudgetExhausted, CircuitOpen, DeadlineExceeded, find};
use retrysafe_core::wire::{Convention, DO_NOT_RETRY_VALUE};

/// A boxed error, as the client layers return.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How a layer answers a failure it generated locally.
pub trait LocalFailure<B>: Send + Sync + 'static {
    /// The answer to `error` for a request that is gRPC (`grpc`) or not.
    fn answer(
        grpc: bool,
        error: BoxError,
        convention: &Convention,
    ) -> Result<Response<B>, BoxError>;
}

/// Local failures are errors (works with any response body).
#[derive(Debug, Clone, Copy, Default)]
pub struct AsError;

/// Local failures of gRPC requests are synthesised Trailers-Only responses; other
/// requests get the error.
#[derive(Debug, Clone, Copy, Default)]
pub struct AsGrpcStatus;

impl<B> LocalFailure<B> for AsError {
    fn answer(_: bool, error: BoxError, _: &Convention) -> Result<Response<B>, BoxError> {
        Err(error)
    }
}

impl<B: Default> LocalFailure<B> for AsGrpcStatus {
    fn answer(
        grpc: bool,
        error: BoxError,
        convention: &Convention,
    ) -> Result<Response<B>, BoxError> {
        if !grpc {
            return Err(error);
        }
        let code = if find::<DeadlineExceeded>(&*error).is_some() {
            4
        } else if find::<BudgetExhausted>(&*error).is_some()
            || find::<CircuitOpen>(&*error).is_some()
        {
            14
        } else {
            return Err(error);
        };
        let mut response = grpc_status_response(code, &error.to_string(), convention);
        response.extensions_mut().insert(LocalAnswer);
        Ok(response)
    }
}

/// Marks a response a client layer synthesised for its own failure
/// ([`AsGrpcStatus`]), so that a `RetryLayer` above tells it from a real response: a
/// refusal by a budget or breaker below after a real response gives up with that real
/// response, as the error form does.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalAnswer;

/// A Trailers-Only gRPC response with `code`, `message` (percent-encoded as gRPC
/// requires) and `do-not-retry: 1`.
pub fn grpc_status_response<B: Default>(
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

/// Local failures on a server's inbound path: gRPC requests get a synthesised status,
/// others an RFC 9457 `application/problem+json` 503 with `do-not-retry: 1` (type
/// `urn:retrysafe:problem:<slug>`: `retry-budget-exhausted`, `deadline-exceeded` (504),
/// `circuit-open`).
#[derive(Debug, Clone, Copy, Default)]
pub struct AsProblem;

impl<B: Default + From<bytes::Bytes>> LocalFailure<B> for AsProblem {
    fn answer(
        grpc: bool,
        error: BoxError,
        convention: &Convention,
    ) -> Result<Response<B>, BoxError> {
        if grpc {
            return AsGrpcStatus::answer(grpc, error, convention);
        }
        let (status, slug, title) = if find::<DeadlineExceeded>(&*error).is_some() {
            (
                StatusCode::GATEWAY_TIMEOUT,
                "deadline-exceeded",
                "Deadline exceeded",
            )
        } else if find::<BudgetExhausted>(&*error).is_some() {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "retry-budget-exhausted",
                "Retry budget exhausted",
            )
        } else if find::<CircuitOpen>(&*error).is_some() {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "circuit-open",
                "Circuit open",
            )
        } else {
            return Err(error);
        };
        let body = serde_json_free_problem(status, slug, title, &error.to_string());
        let mut response = Response::new(B::from(bytes::Bytes::from(body)));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        headers.insert(convention.do_not_retry().clone(), DO_NOT_RETRY_VALUE);
        Ok(response)
    }
}

/// A problem+json document; `detail` is escaped as a JSON string.
fn serde_json_free_problem(status: StatusCode, slug: &str, title: &str, detail: &str) -> String {
    let mut escaped = String::with_capacity(detail.len());
    for c in detail.chars() {
        match c {
            '"' => escaped.push_str("\\\""),
            '\\' => escaped.push_str("\\\\"),
            c if u32::from(c) < 0x20 => escaped.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => escaped.push(c),
        }
    }
    format!(
        r#"{{"type":"urn:retrysafe:problem:{slug}","title":"{title}","status":{},"detail":"{escaped}"}}"#,
        status.as_u16()
    )
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
    pub fn inner(body: B) -> Self {
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
