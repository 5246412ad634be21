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

/// A record that became `outcome_unknown`, for the reconcile hook: the application
/// finds out what happened (for example from its own ledger) and repairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct UnknownOutcome {
    /// The record.
    pub record: RecordId,
    /// Why.
    pub reason: UnknownReason,
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
        UnknownOutcome { record, reason }
    }
}
