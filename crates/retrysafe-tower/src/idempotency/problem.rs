use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Response, StatusCode};

/// The stable cases in which the `IdempotencyLayer` (or the transactional layer of
/// `retrysafe-postgres`, which answers with the same problems) answers for the handler.
///
/// Each has a stable problem `type` URI ([`ProblemKind::type_uri`]), a status and a
/// rule for `do-not-retry` and `retry-after`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// 400: the route requires an `Idempotency-Key` and the request has none.
    KeyMissing,
    /// 400: the key is empty, longer than 255 characters, not printable ASCII, or sent
    /// more than once.
    KeyInvalid,
    /// 413: the request body is over the limit (before any claim).
    BodyTooLarge,
    /// 408: the request body did not arrive within the layer's
    /// `request_body_timeout` (before any claim): nothing happened, a retry is safe.
    BodyTimeout,
    /// 400: the request body could not be read.
    BodyUnreadable,
    /// 409 with `retry-after`: a copy with this key is still being processed.
    InFlight,
    /// 422 with `do-not-retry`: the key was used with a different request.
    KeyMismatch,
    /// 500 with `do-not-retry`: the outcome of the first call with this key is unknown.
    OutcomeUnknown,
    /// 409 with `do-not-retry`: the first response was too large to store.
    ResponseNotStored,
    /// 503 with `retry-after`: the idempotency store is unavailable or too slow.
    StoreUnavailable,
    /// 503 with `retry-after`: too many guarded requests in flight.
    Overloaded,
    /// 500: no scope could be derived (no `Principal`): a configuration error.
    ScopeMissing,
    /// 500 with `do-not-retry`: the handler panicked. (The transactional layer of
    /// `retrysafe-postgres` rolls the call back and answers without `do-not-retry`.)
    HandlerPanicked,
    /// 500 (transactional layer of `retrysafe-postgres`): the handler still held its
    /// transaction guard after it answered; the transaction is rolled back.
    TransactionLeaked,
    /// 500 (transactional layer of `retrysafe-postgres`): a handler asked for the
    /// request's transaction, and there is none: the route is not behind the layer, the
    /// request is not guarded, or the transaction is already taken.
    TransactionMissing,
}

impl ProblemKind {
    /// The HTTP status.
    pub fn status(self) -> StatusCode {
        match self {
            ProblemKind::KeyMissing | ProblemKind::KeyInvalid | ProblemKind::BodyUnreadable => {
                StatusCode::BAD_REQUEST
            }
            ProblemKind::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProblemKind::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            ProblemKind::InFlight | ProblemKind::ResponseNotStored => StatusCode::CONFLICT,
            ProblemKind::KeyMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemKind::OutcomeUnknown
            | ProblemKind::ScopeMissing
            | ProblemKind::HandlerPanicked
            | ProblemKind::TransactionLeaked
            | ProblemKind::TransactionMissing => StatusCode::INTERNAL_SERVER_ERROR,
            ProblemKind::StoreUnavailable | ProblemKind::Overloaded => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    /// The short stable name, e.g. `key-mismatch`.
    pub fn slug(self) -> &'static str {
        match self {
            ProblemKind::KeyMissing => "key-missing",
            ProblemKind::KeyInvalid => "key-invalid",
            ProblemKind::BodyTooLarge => "body-too-large",
            ProblemKind::BodyTimeout => "body-timeout",
            ProblemKind::BodyUnreadable => "body-unreadable",
            ProblemKind::InFlight => "request-in-flight",
            ProblemKind::KeyMismatch => "key-mismatch",
            ProblemKind::OutcomeUnknown => "outcome-unknown",
            ProblemKind::ResponseNotStored => "response-not-stored",
            ProblemKind::StoreUnavailable => "store-unavailable",
            ProblemKind::Overloaded => "overloaded",
            ProblemKind::ScopeMissing => "scope-missing",
            ProblemKind::HandlerPanicked => "handler-panicked",
            ProblemKind::TransactionLeaked => "transaction-leaked",
            ProblemKind::TransactionMissing => "transaction-missing",
        }
    }

    /// The RFC 9457 `type`: `urn:retrysafe:problem:` followed by the slug.
    pub fn type_uri(self) -> String {
        format!("urn:retrysafe:problem:{}", self.slug())
    }

    /// A short human title.
    pub fn title(self) -> &'static str {
        match self {
            ProblemKind::KeyMissing => "Idempotency-Key header is required",
            ProblemKind::KeyInvalid => "Idempotency-Key header is invalid",
            ProblemKind::BodyTooLarge => "Request body is too large",
            ProblemKind::BodyTimeout => "Request body did not arrive in time",
            ProblemKind::BodyUnreadable => "Request body could not be read",
            ProblemKind::InFlight => "A request with this Idempotency-Key is in progress",
            ProblemKind::KeyMismatch => "Idempotency-Key was used with a different request",
            ProblemKind::OutcomeUnknown => {
                "The outcome of the request with this Idempotency-Key is unknown"
            }
            ProblemKind::ResponseNotStored => {
                "The response to this Idempotency-Key was too large to store"
            }
            ProblemKind::StoreUnavailable => "Idempotency store is unavailable",
            ProblemKind::Overloaded => "Too many requests in progress",
            ProblemKind::ScopeMissing => "Idempotency scope is missing",
            ProblemKind::HandlerPanicked => "The request handler failed",
            ProblemKind::TransactionLeaked => "The request handler kept its transaction",
            ProblemKind::TransactionMissing => "The request has no transaction",
        }
    }

    /// Whether the answer carries `do-not-retry: 1`.
    pub fn do_not_retry(self) -> bool {
        matches!(
            self,
            ProblemKind::KeyMismatch
                | ProblemKind::OutcomeUnknown
                | ProblemKind::ResponseNotStored
                | ProblemKind::HandlerPanicked
        )
    }
}

impl fmt::Display for ProblemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.slug())
    }
}

/// One answer of the layer: a kind, a detail and, where it applies, a `retry-after`.
///
/// Every problem response carries its `Problem` as a response extension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    kind: ProblemKind,
    detail: Cow<'static, str>,
    retry_after: Option<Duration>,
}

impl Problem {
    /// A problem of `kind` with a human-readable `detail`, for layers of other crates
    /// that answer with the same problems (the transactional layer of
    /// `retrysafe-postgres`).
    pub fn new(kind: ProblemKind, detail: impl Into<Cow<'static, str>>) -> Self {
        Problem {
            kind,
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// Adds a `retry-after` hint (for 409 in-flight and 503 answers).
    #[must_use]
    pub fn retry_after(mut self, d: Duration) -> Self {
        self.retry_after = Some(d);
        self
    }

    /// The case.
    pub fn kind(&self) -> ProblemKind {
        self.kind
    }

    /// The human-readable detail.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The `retry-after` hint, for 409 in-flight and 503 answers.
    pub fn retry_after_hint(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The RFC 9457 `application/problem+json` body.
    pub fn to_json(&self) -> Bytes {
        let v = serde_json::json!({
            "type": self.kind.type_uri(),
            "title": self.kind.title(),
            "status": self.kind.status().as_u16(),
            "detail": self.detail,
        });
        Bytes::from(v.to_string())
    }

    /// The default response: status, `application/problem+json` body.
    pub fn to_response(&self) -> Response<Bytes> {
        let mut res = Response::new(self.to_json());
        *res.status_mut() = self.kind.status();
        res.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        res
    }
}

/// Replaces the layer's problem responses. The layer still adds `do-not-retry` and
/// `retry-after` where a case requires them, and the [`Problem`] extension.
pub(crate) type Responder = Arc<dyn Fn(&Problem) -> Response<Bytes> + Send + Sync>;
