//! What happens to records: the events the idempotency layers report, and why a record
//! became `outcome_unknown`.

use std::fmt;

use super::RecordId;
use crate::observe::Name;
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
    /// A copy found only the trace of its completed record, whose response the store
    /// evicted before its retention (409 `response-evicted`): the key ran, and will not
    /// run again. (The eviction itself is reported by the store that evicted it — for
    /// the `MemoryStore`, its `on_eviction` hook — since only the store sees it.)
    Evicted,
    /// A copy found its record `outcome_unknown` (500 `outcome-unknown`).
    Unknown,
    /// A copy found its record pending resolution by a reconciler (503
    /// `outcome-pending`).
    Pending,
    /// A copy found its record completed with a response too large to store (409
    /// `response-not-stored`).
    NotStored,
    /// A request refused before any claim: a bad or missing key, no scope, a body over
    /// the limit or too slow (400, 413, 408, 500 `scope-missing`). `record` is `None`
    /// when the key or the scope was not known.
    Invalid,
    /// A request refused because the store failed or a bound was reached (503
    /// `store-unavailable` or `overloaded`).
    Unavailable,
    /// The store failed and the layer fails open: the handler ran unguarded.
    Unguarded,
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
            EventKind::Unknown => "unknown",
            EventKind::Pending => "pending",
            EventKind::NotStored => "not_stored",
            EventKind::Invalid => "invalid",
            EventKind::Unavailable => "unavailable",
            EventKind::Unguarded => "unguarded",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a guarded request was decided: the `decision` of its `retrysafe.idempotency`
/// span and of the metric `retrysafe_idempotency_requests_total`. Each guarded request
/// with a key (or refused for its key, scope or body) has exactly one, its last: a copy
/// that waited for the holder and got its replay is a `replay`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Decision {
    /// It claimed the key and ran the handler.
    First,
    /// It took over an expired lease before its commit point and ran the handler.
    Takeover,
    /// It got the stored response.
    Replay,
    /// A copy was in flight (409 `request-in-flight`).
    InFlight,
    /// Same key, different request (422 `key-mismatch`).
    Mismatch,
    /// The record was `outcome_unknown` (500 `outcome-unknown`).
    Unknown,
    /// The record was pending resolution (503 `outcome-pending`).
    Pending,
    /// The record's response was evicted (409 `response-evicted`).
    Evicted,
    /// The record's response was too large to store (409 `response-not-stored`).
    NotStored,
    /// Refused before any claim: key, scope or body (400, 408, 413, 500).
    Invalid,
    /// The store failed or a bound was reached (503).
    Unavailable,
    /// The store failed and the layer fails open: the handler ran unguarded.
    Unguarded,
}

impl Decision {
    /// Every decision, in the order of [`index`](Self::index).
    #[doc(hidden)]
    pub const ALL: [Decision; 12] = [
        Decision::First,
        Decision::Takeover,
        Decision::Replay,
        Decision::InFlight,
        Decision::Mismatch,
        Decision::Unknown,
        Decision::Pending,
        Decision::Evicted,
        Decision::NotStored,
        Decision::Invalid,
        Decision::Unavailable,
        Decision::Unguarded,
    ];

    /// The label value, e.g. `in_flight`.
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::First => "first",
            Decision::Takeover => "takeover",
            Decision::Replay => "replay",
            Decision::InFlight => "in_flight",
            Decision::Mismatch => "mismatch",
            Decision::Unknown => "unknown",
            Decision::Pending => "pending",
            Decision::Evicted => "evicted",
            Decision::NotStored => "not_stored",
            Decision::Invalid => "invalid",
            Decision::Unavailable => "unavailable",
            Decision::Unguarded => "unguarded",
        }
    }

    /// Its position in [`ALL`](Self::ALL).
    #[doc(hidden)]
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One event of the `IdempotencyLayer`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct IdempotencyEvent {
    /// What happened.
    pub kind: EventKind,
    /// To which record; `None` for a request refused before its key and scope were
    /// known ([`EventKind::Invalid`], or [`EventKind::Unavailable`] for the layer's own
    /// bound).
    pub record: Option<RecordId>,
    /// The name of the layer that reports it.
    pub name: Name,
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
    /// `kind` happened to `record`, reported by the layer named `name`.
    #[doc(hidden)]
    pub fn new(kind: EventKind, record: Option<RecordId>, name: Name) -> Self {
        IdempotencyEvent { kind, record, name }
    }
}

impl UnknownOutcome {
    /// `record` became `outcome_unknown` for `reason`.
    #[doc(hidden)]
    pub fn new(record: RecordId, reason: UnknownReason) -> Self {
        UnknownOutcome {
            record,
            reason,
            request: None,
            note: None,
        }
    }

    /// The same, with what is known of the request and the handler's note.
    #[doc(hidden)]
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
