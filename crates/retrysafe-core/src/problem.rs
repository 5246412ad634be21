//! The answers retrysafe's server layers give on their own: RFC 9457
//! `application/problem+json` documents with a stable `type`
//! (`urn:retrysafe:problem:<slug>`), written in this one place.
//!
//! ```
//! use retrysafe::idempotency::{Problem, ProblemKind};
//!
//! let p = Problem::new(ProblemKind::KeyMismatch, "this key was used with another request");
//! assert_eq!(p.kind().status(), http::StatusCode::UNPROCESSABLE_ENTITY);
//! assert!(p.do_not_retry());
//! let json = String::from_utf8(p.to_json().to_vec()).unwrap();
//! assert!(json.starts_with(r#"{"type":"urn:retrysafe:problem:key-mismatch","#));
//! ```

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Response, StatusCode};

/// The stable cases in which a retrysafe server layer answers for the handler.
///
/// Each has a stable problem `type` URI ([`ProblemKind::type_uri`]), a status and a
/// default rule for `do-not-retry`.
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
    /// 408: the request body did not arrive within the layer's `request_body_timeout`
    /// (before any claim): nothing happened, a retry is safe.
    BodyTimeout,
    /// 400: the request body could not be read.
    BodyUnreadable,
    /// 409 with `retry-after`: a copy with this key is still being processed.
    InFlight,
    /// 422 with `do-not-retry`: the key was used with a different request.
    KeyMismatch,
    /// 500 with `do-not-retry`: the outcome of the first call with this key is unknown.
    OutcomeUnknown,
    /// 503 with `retry-after`: the outcome of the first call with this key is being
    /// found out by a reconciler; come back later to see it.
    OutcomePending,
    /// 409 with `do-not-retry`: the request with this key completed, but the store had
    /// to drop its response before its retention ended (it remembers only that it ran).
    ResponseEvicted,
    /// 409 with `do-not-retry`: the first response was too large to store.
    ResponseNotStored,
    /// 503 with `retry-after`: the idempotency store is unavailable or too slow.
    StoreUnavailable,
    /// 503 with `retry-after`: too many guarded requests in flight.
    Overloaded,
    /// 500: no scope could be derived (no `Principal`): a configuration error.
    ScopeMissing,
    /// 500 with `do-not-retry`: the handler panicked. (A transactional layer rolls the
    /// call back and answers without `do-not-retry`.)
    HandlerPanicked,
    /// 500 (transactional layer): the handler still held its transaction guard after
    /// it answered; the transaction is rolled back.
    TransactionLeaked,
    /// 500 (transactional layer): a handler asked for the request's transaction, and
    /// there is none: the route is not behind the layer, the request is not guarded, or
    /// the transaction is already taken.
    TransactionMissing,
    /// 503 with `do-not-retry`: a server's retry budget refused a retried request.
    BudgetExhausted,
    /// 504 with `do-not-retry`: the request's deadline passed.
    DeadlineExceeded,
    /// 503 with `do-not-retry`: a circuit breaker is open.
    CircuitOpen,
    /// 400: an inbound deadline header (`request-timeout-ms`, `grpc-timeout`) is
    /// malformed.
    TimeoutInvalid,
}

impl ProblemKind {
    /// The HTTP status.
    pub fn status(self) -> StatusCode {
        use ProblemKind as K;
        match self {
            K::KeyMissing | K::KeyInvalid | K::BodyUnreadable | K::TimeoutInvalid => {
                StatusCode::BAD_REQUEST
            }
            K::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            K::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            K::InFlight | K::ResponseNotStored | K::ResponseEvicted => StatusCode::CONFLICT,
            K::KeyMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            K::OutcomeUnknown
            | K::ScopeMissing
            | K::HandlerPanicked
            | K::TransactionLeaked
            | K::TransactionMissing => StatusCode::INTERNAL_SERVER_ERROR,
            K::StoreUnavailable
            | K::Overloaded
            | K::OutcomePending
            | K::BudgetExhausted
            | K::CircuitOpen => StatusCode::SERVICE_UNAVAILABLE,
            K::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The short stable name, e.g. `key-mismatch`.
    pub fn slug(self) -> &'static str {
        use ProblemKind as K;
        match self {
            K::KeyMissing => "key-missing",
            K::KeyInvalid => "key-invalid",
            K::BodyTooLarge => "body-too-large",
            K::BodyTimeout => "body-timeout",
            K::BodyUnreadable => "body-unreadable",
            K::InFlight => "request-in-flight",
            K::KeyMismatch => "key-mismatch",
            K::OutcomeUnknown => "outcome-unknown",
            K::OutcomePending => "outcome-pending",
            K::ResponseEvicted => "response-evicted",
            K::ResponseNotStored => "response-not-stored",
            K::StoreUnavailable => "store-unavailable",
            K::Overloaded => "overloaded",
            K::ScopeMissing => "scope-missing",
            K::HandlerPanicked => "handler-panicked",
            K::TransactionLeaked => "transaction-leaked",
            K::TransactionMissing => "transaction-missing",
            K::BudgetExhausted => "retry-budget-exhausted",
            K::DeadlineExceeded => "deadline-exceeded",
            K::CircuitOpen => "circuit-open",
            K::TimeoutInvalid => "timeout-invalid",
        }
    }

    /// The RFC 9457 `type`: `urn:retrysafe:problem:` followed by the slug.
    pub fn type_uri(self) -> String {
        format!("urn:retrysafe:problem:{}", self.slug())
    }

    /// A short human title.
    pub fn title(self) -> &'static str {
        use ProblemKind as K;
        match self {
            K::KeyMissing => "Idempotency-Key header is required",
            K::KeyInvalid => "Idempotency-Key header is invalid",
            K::BodyTooLarge => "Request body is too large",
            K::BodyTimeout => "Request body did not arrive in time",
            K::BodyUnreadable => "Request body could not be read",
            K::InFlight => "A request with this Idempotency-Key is in progress",
            K::KeyMismatch => "Idempotency-Key was used with a different request",
            K::OutcomeUnknown => "The outcome of the request with this Idempotency-Key is unknown",
            K::OutcomePending => {
                "The outcome of the request with this Idempotency-Key is being resolved"
            }
            K::ResponseEvicted => "The response to this Idempotency-Key is no longer stored",
            K::ResponseNotStored => "The response to this Idempotency-Key was too large to store",
            K::StoreUnavailable => "Idempotency store is unavailable",
            K::Overloaded => "Too many requests in progress",
            K::ScopeMissing => "Idempotency scope is missing",
            K::HandlerPanicked => "The request handler failed",
            K::TransactionLeaked => "The request handler kept its transaction",
            K::TransactionMissing => "The request has no transaction",
            K::BudgetExhausted => "Retry budget exhausted",
            K::DeadlineExceeded => "Deadline exceeded",
            K::CircuitOpen => "Circuit open",
            K::TimeoutInvalid => "Invalid timeout",
        }
    }

    /// Whether the answer carries `do-not-retry: 1` by default.
    pub fn do_not_retry(self) -> bool {
        use ProblemKind as K;
        matches!(
            self,
            K::KeyMismatch
                | K::OutcomeUnknown
                | K::ResponseNotStored
                | K::ResponseEvicted
                | K::HandlerPanicked
                | K::BudgetExhausted
                | K::DeadlineExceeded
                | K::CircuitOpen
        )
    }
}

impl fmt::Display for ProblemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.slug())
    }
}

/// One answer of a server layer: a kind, a detail, whether it is marked
/// `do-not-retry` and, where it applies, a `retry-after`.
///
/// Every problem response carries its `Problem` as a response extension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    kind: ProblemKind,
    detail: Cow<'static, str>,
    retry_after: Option<Duration>,
    do_not_retry: bool,
}

impl Problem {
    /// A problem of `kind` with a human-readable `detail`, marked `do-not-retry` as the
    /// kind says.
    pub fn new(kind: ProblemKind, detail: impl Into<Cow<'static, str>>) -> Self {
        Problem {
            kind,
            detail: detail.into(),
            retry_after: None,
            do_not_retry: kind.do_not_retry(),
        }
    }

    /// Adds a `retry-after` hint (for 409 in-flight and 503 answers).
    #[must_use]
    pub fn retry_after(mut self, d: Duration) -> Self {
        self.retry_after = Some(d);
        self
    }

    /// Drops the `do-not-retry` mark: nothing happened, so a retry is safe (a
    /// transactional layer that rolled a failed handler back).
    #[must_use]
    pub fn retryable(mut self) -> Self {
        self.do_not_retry = false;
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

    /// Whether the answer is marked `do-not-retry: 1`.
    pub fn do_not_retry(&self) -> bool {
        self.do_not_retry
    }

    /// The RFC 9457 `application/problem+json` body.
    pub fn to_json(&self) -> Bytes {
        let kind = self.kind;
        let mut out = String::with_capacity(120 + self.detail.len());
        out.push_str(r#"{"type":"urn:retrysafe:problem:"#);
        out.push_str(kind.slug());
        out.push_str(r#"","title":"#);
        push_json_string(&mut out, kind.title());
        out.push_str(r#","status":"#);
        out.push_str(kind.status().as_str());
        out.push_str(r#","detail":"#);
        push_json_string(&mut out, &self.detail);
        out.push('}');
        Bytes::from(out)
    }

    /// The default response: the kind's status and the `application/problem+json`
    /// body. (A layer adds `do-not-retry`, `retry-after` and the `Problem` extension.)
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

/// Appends `s` as a JSON string literal.
fn push_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                out.push_str(&format!("\\u{:04x}", u32::from(c)));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_document_is_json_whatever_the_detail() {
        for detail in ["plain", "quote \" and \\ and \n\t\u{1}", "ünïcödé"] {
            let p = Problem::new(ProblemKind::StoreUnavailable, detail);
            let json = String::from_utf8(p.to_json().to_vec()).unwrap();
            let expected = format!(
                r#"{{"type":"urn:retrysafe:problem:store-unavailable","title":"Idempotency store is unavailable","status":503,"detail":{}}}"#,
                {
                    let mut s = String::new();
                    push_json_string(&mut s, detail);
                    s
                }
            );
            assert_eq!(json, expected);
        }
    }

    #[test]
    fn retryable_drops_the_mark() {
        let p = Problem::new(ProblemKind::HandlerPanicked, "x");
        assert!(p.do_not_retry());
        assert!(!p.retryable().do_not_retry());
    }
}
