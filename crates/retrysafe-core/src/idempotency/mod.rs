//! The idempotency model: who a request belongs to, which record it maps to, what it
//! must match, and what a record may hold.
//!
//! The pieces are public building blocks so that every store and layer — including the
//! PostgreSQL transactional layer — composes them rather than copying them:
//!
//! - [`Principal`] and [`Scope`]: the identity a record belongs to; records never cross
//!   scopes;
//! - [`RecordId`]: the record key, a hash of (scope, idempotency key);
//! - [`Fingerprint`] and [`Fingerprinter`]: what a repeated request must match;
//! - [`Token`]: the random 128-bit token of one claim;
//! - [`Record`] and its states, with one versioned byte encoding ([`Record::encode`],
//!   [`Record::decode`], which is total);
//! - [`StoredResponse`] and [`HeaderFilter`]: response capture;
//! - the claim → wait → run → complete protocol of one guarded request, a state
//!   machine that every idempotency engine drives (engine plumbing, not public API);
//! - [`RequestInfo`]: what a store keeps of a claim's request, for recovery;
//! - [`EventKind`] and [`UnknownReason`]: what the layers report;
//! - [`IdempotencyContext`]: what a guarded handler sees;
//! - [`defaults`]: the timing defaults of a guarded request and of its recovery, and
//!   why they compose with the default client.

mod context;
pub(crate) mod decision;
pub mod defaults;
mod event;
mod ids;
mod info;
pub(crate) mod protocol;
mod record;

pub use context::IdempotencyContext;
pub use decision::NoEffect;
pub use event::{Decision, EventKind, IdempotencyEvent, UnknownOutcome, UnknownReason};
pub use ids::{Fingerprint, Fingerprinter, Principal, RecordId, Scope, Token};
pub use info::RequestInfo;
pub use record::{
    CommitPoint, Completed, DecodeError, Evicted, HeaderFilter, InProgress, OutcomeUnknown,
    RECORD_VERSION, Record, Resolving, StoredResponse,
};
