//! What happens to records: the events the idempotency layers report, and why a record
//! became `outcome_unknown`.

use std::fmt;

use super::RecordId;
use http::StatusCode;

/// What happened to a record (reported through the layer's `on_event` hook and as a
/// `tracing` event on target `retrysafe::idempotency`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EventKind {
    /// A first copy claimed the key and runs the handler.
    Claimed,
    /// A stored response was replayed.
    Replayed,
    /// A copy arrived while the first was in flight (409, or it waited).
    Conflict,
    /// A copy with a different fingerprint (422).
    Mismatch,
    /// An expired lease before its commit point was taken over.
    Takeover,
    /// A record became `outcome_unknown` (the reconcile hook is called too).
    OutcomeUnknown,
    /// The completion (or release) could not be written; the handler's real response
    /// was returned anyway.
    CompletionLost,
    /// A completed record was evicted before its retention. Reported by the store that
    /// evicted it (for the `MemoryStore`: its eviction hook and a
    /// `tracing` event), since only the store sees it.
    Evicted,
}

impl EventKind {
    /// The name used in `tracing` events, e.g. `outcome_unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Claimed => "claimed",
            EventKind::Replayed => "replayed",
            EventKind::Conflict => "conflict",
            EventKind::Mismatch => "mismatch",
            EventKind::Takeover => "takeover",
            EventKind::OutcomeUnknown => "outcome_unknown",
            EventKind::CompletionLost => "completion_lost",
            EventKind::Evicted => "evicted",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One event of the `IdempotencyLayer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct IdempotencyEvent {
    /// What happened.
    pub kind: EventKind,
    /// To which record.
    pub record: RecordId,
}

/// Why a record became `outcome_unknown`: what the reconcile hook is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum UnknownReason {
    /// The handler answered this 5xx or 408 without `NoEffect`.
    Status(StatusCode),
    /// The handler panicked.
    Panicked,
    /// The inner service returned an error instead of a response.
    ServiceError,
    /// The handler's response body failed while it was being stored.
    BodyError,
    /// A holder's lease expired after its commit point (or without a declared one).
    LeaseExpired,
    /// The layer cancelled the handler — it ran past `max_execution`, or its lease was
    /// lost — after its commit point (or without a declared one).
    Cancelled,
}

impl UnknownReason {
    /// The reason as a number, for stores: 1 to 5 for the named reasons, the status
    /// code for [`UnknownReason::Status`].
    pub fn to_code(self) -> u16 {
        match self {
            UnknownReason::Status(s) => s.as_u16(),
            UnknownReason::Panicked => 1,
            UnknownReason::ServiceError => 2,
            UnknownReason::BodyError => 3,
            UnknownReason::LeaseExpired => 4,
            UnknownReason::Cancelled => 5,
        }
    }

    /// The reason of a code written by [`UnknownReason::to_code`]; `None` for any other
    /// number.
    pub fn from_code(code: u16) -> Option<Self> {
        Some(match code {
            1 => UnknownReason::Panicked,
            2 => UnknownReason::ServiceError,
            3 => UnknownReason::BodyError,
            4 => UnknownReason::LeaseExpired,
            5 => UnknownReason::Cancelled,
            c => UnknownReason::Status(StatusCode::from_u16(c).ok()?),
        })
    }

    /// A short name, e.g. `status_503` or `lease_expired`.
    pub fn as_str(self) -> std::borrow::Cow<'static, str> {
        match self {
            UnknownReason::Status(s) => format!("status_{}", s.as_u16()).into(),
            UnknownReason::Panicked => "panicked".into(),
            UnknownReason::ServiceError => "service_error".into(),
            UnknownReason::BodyError => "body_error".into(),
            UnknownReason::LeaseExpired => "lease_expired".into(),
            UnknownReason::Cancelled => "cancelled".into(),
        }
    }
}

/// A record that became `outcome_unknown`, for the reconcile hook: the application
/// finds out what happened (for example from its own ledger) and repairs.
///
/// The hook is told of every unknown outcome at least once, whoever made it (the layer,
/// a store's sweep, a reconciler): hooks must be idempotent on [`record`](Self::record).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct UnknownOutcome {
    /// The record.
    pub record: RecordId,
    /// Why.
    pub reason: UnknownReason,
    /// What the store keeps of the request (scope, label, method, path, and the key
    /// when the layer stores keys for resolution), when known.
    pub request: Option<std::sync::Arc<super::RequestInfo>>,
    /// The note the handler attached to its commit point, if any.
    pub note: Option<bytes::Bytes>,
}

impl IdempotencyEvent {
    /// `kind` happened to `record`.
    pub fn new(kind: EventKind, record: RecordId) -> Self {
        IdempotencyEvent { kind, record }
    }
}

impl UnknownOutcome {
    /// `record` became `outcome_unknown` for `reason`.
    pub fn new(record: RecordId, reason: UnknownReason) -> Self {
        UnknownOutcome {
            record,
            reason,
            request: None,
            note: None,
        }
    }

    /// The same, with what is known of the request and the handler's note.
    #[must_use]
    pub fn with_request(
        mut self,
        request: Option<std::sync::Arc<super::RequestInfo>>,
        note: Option<bytes::Bytes>,
    ) -> Self {
        self.request = request;
        self.note = note;
        self
    }
}
