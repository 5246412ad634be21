//! Recovery: every key reaches a definite state.
//!
//! A claim whose holder crashed after its commit point, and a record that became
//! `outcome_unknown`, stay pending until someone finds out whether the effect happened.
//! A [`Reconciler`] does that in the background for a [`ReconcilableStore`]: it adopts
//! each pending record with a fresh token (so that no other reconciler, app server or
//! late holder acts on it at the same time), asks the application's [`Resolver`] —
//! which looks the effect up in the downstream by (scope, key), never by re-running it —
//! and applies the [`Resolution`]:
//!
//! - [`Resolution::Happened`] completes the record with the response: copies replay it;
//! - [`Resolution::DidNotHappen`] releases the key: the next copy runs. It is a promise
//!   that the effect can no longer happen for this record (the downstream refuses a
//!   second use of its key, or the effect is unique on (scope, key));
//! - [`Resolution::Unknown`] (and any error or timeout) leaves the record for a later
//!   pass, with backoff, until its retention ends. **When in doubt the answer is
//!   "unknown", never "run it again".**
//!
//! A claim still before its declared commit point needs no resolver: nothing happened
//! (its commit point is fenced by the store), so the reconciler releases it.
//!
//! The [`Operator`] gives the same operations by hand: look a record up, list what is
//! pending, release a claim before its commit point, resolve a record.

mod operator;
mod reconciler;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::idempotency::{
    CommitPoint, Fingerprint, RecordId, RequestInfo, Scope, StoredResponse, Token, UnknownReason,
};
use crate::store::{IdempotencyStore, StoreError};
use crate::wire::IdempotencyKey;

pub use operator::{Lookup, Operator, OperatorError};
pub use reconciler::{Pass, Reconciler, ReconcilerHandle, Resolved, ResolvedKind};

/// Which kind of pending record a [`PendingRecord`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PendingState {
    /// A claim whose lease ended (and stayed ended past the reconciler's grace): its
    /// holder is gone. `commit_point` says how far it said it got.
    Claim {
        /// The claim's commit-point state.
        commit_point: CommitPoint,
    },
    /// An `outcome_unknown` record.
    Unknown {
        /// Why it became unknown, when the store knows.
        reason: Option<UnknownReason>,
    },
}

/// A pending record, as a [`Resolver`] sees it.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PendingRecord {
    /// The record id (a hash of scope and key).
    pub record: RecordId,
    /// A claim, or an unknown outcome.
    pub state: PendingState,
    /// The fingerprint of the request that claimed.
    pub fingerprint: Fingerprint,
    /// What the store kept of the request: scope, label, method, path, and the key when
    /// the layer stores keys for resolution. `None` for a record written by an older
    /// release.
    pub request: Option<Arc<RequestInfo>>,
    /// The note the handler attached to its commit point
    /// ([`IdempotencyContext::commit_point_with`](crate::idempotency::IdempotencyContext::commit_point_with)).
    pub note: Option<Bytes>,
    /// How long ago the record was claimed (by the store's clock).
    pub age: Duration,
    /// Whether the reconcile hook was already told of it.
    pub notified: bool,
}

impl PendingRecord {
    /// A pending record (as a store reads it back), with no request information, note,
    /// or age.
    pub fn new(record: RecordId, state: PendingState, fingerprint: Fingerprint) -> Self {
        PendingRecord {
            record,
            state,
            fingerprint,
            request: None,
            note: None,
            age: Duration::ZERO,
            notified: false,
        }
    }

    /// The same with the request information, note, age and notified flag.
    #[must_use]
    pub fn with_details(
        mut self,
        request: Option<Arc<RequestInfo>>,
        note: Option<Bytes>,
        age: Duration,
        notified: bool,
    ) -> Self {
        self.request = request;
        self.note = note;
        self.age = age;
        self.notified = notified;
        self
    }

    /// The record's scope, when the store kept the request information.
    pub fn scope(&self) -> Option<&Scope> {
        self.request.as_deref().map(|r| &r.scope)
    }

    /// The raw idempotency key, when the layer stores keys for resolution.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.request.as_deref().and_then(|r| r.key.as_ref())
    }

    /// Whether no resolver is needed: a claim before its declared commit point, whose
    /// effect cannot have happened.
    pub fn is_before_commit_point(&self) -> bool {
        matches!(
            self.state,
            PendingState::Claim {
                commit_point: CommitPoint::Before
            }
        )
    }
}

impl fmt::Debug for PendingRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingRecord")
            .field("record", &self.record)
            .field("state", &self.state)
            .field("request", &self.request)
            .field("note_len", &self.note.as_ref().map(Bytes::len))
            .field("age", &self.age)
            .field("notified", &self.notified)
            .finish_non_exhaustive()
    }
}

/// What a [`Resolver`] found out about a pending record.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Resolution {
    /// The effect happened; this is the response the first request would have had.
    /// The record is completed with it, and copies replay it.
    Happened(StoredResponse),
    /// The effect did not happen **and can no longer happen for this record**: the key
    /// is released and the next copy runs.
    DidNotHappen,
    /// Not known yet: the record is left for a later pass.
    Unknown,
}

/// Finds out whether the effect of a pending record happened, by asking the downstream
/// — by (scope, key), never by key alone, and never by re-running the effect.
///
/// Called by a [`Reconciler`] with a per-call timeout and a concurrency bound; a call
/// that times out counts as [`Resolution::Unknown`].
///
/// ```
/// use retrysafe_core::recovery::{PendingRecord, Resolution, Resolver};
///
/// /// Nothing can be found out: every pending record waits for its retention to end.
/// struct NeverKnows;
///
/// impl Resolver for NeverKnows {
///     async fn resolve(&self, _record: &PendingRecord) -> Resolution {
///         Resolution::Unknown
///     }
/// }
/// ```
pub trait Resolver: Send + Sync + 'static {
    /// What became of `record`'s effect.
    fn resolve(&self, record: &PendingRecord) -> impl Future<Output = Resolution> + Send;
}

impl<R: Resolver> Resolver for Arc<R> {
    fn resolve(&self, record: &PendingRecord) -> impl Future<Output = Resolution> + Send {
        (**self).resolve(record)
    }
}

/// How a store settles a record it let a reconciler adopt.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settlement {
    /// Complete the record with this response, kept for `retention`.
    Complete {
        /// The response copies replay.
        response: StoredResponse,
        /// How long it is kept.
        retention: Duration,
    },
    /// Delete the record: the next copy runs.
    Release,
    /// Leave it (a claim becomes `outcome_unknown`, kept until the claim's own
    /// retention ends), due again `after` from now.
    Later {
        /// When to look again.
        after: Duration,
    },
}

/// A store whose pending records a [`Reconciler`] can find and adopt.
///
/// Adoption is an atomic store operation: a record adopted with a token is in the
/// `resolving` state until the adoption ends (`hold`); meanwhile no claim, token call of
/// a late holder, or other reconciler acts on it, and copies see
/// [`Record::Resolving`](crate::idempotency::Record::Resolving). If the adoption lapses
/// (the reconciler died), the record is what it was before, never absent.
///
/// The conformance suite has a case for each rule
/// (`conformance::reconcilable_store_tests!`, feature `test-util`).
pub trait ReconcilableStore: IdempotencyStore + Clone {
    /// At most `limit` ids of records that may be due: claims whose lease ended at
    /// least `stale` ago, and `outcome_unknown` records whose next pass is due — one
    /// made from a claim whose lease ended (by a copy, a sweep, or a settlement of the
    /// claim) only once `stale` has passed since that lease ended, as for the claim: its
    /// holder may still run until then. A cheap scan of an index;
    /// [`adopt`](ReconcilableStore::adopt) checks again.
    fn due(
        &self,
        stale: Duration,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<RecordId>, StoreError>> + Send;

    /// At most `limit` ids of every pending record, due or not: claims whose lease
    /// ended (however recently), and `outcome_unknown` records whatever their next pass,
    /// adopted ones included. What an [`Operator`] lists; a reconciler uses
    /// [`due`](ReconcilableStore::due).
    fn list_pending(
        &self,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<RecordId>, StoreError>> + Send;

    /// Adopts `id` with `token` for `hold`, if it is pending: a claim whose lease ended
    /// at least `stale` ago (any claim, live ones included, when `stale` is `None`), or an
    /// `outcome_unknown` record (one made from a claim whose lease ended, `stale` after
    /// it ended); and not adopted by another token. Returns what a resolver sees, or
    /// `None` when there is nothing to adopt.
    fn adopt(
        &self,
        id: &RecordId,
        token: Token,
        hold: Duration,
        stale: Option<Duration>,
    ) -> impl Future<Output = Result<Option<PendingRecord>, StoreError>> + Send;

    /// What a resolver would see of `id`, without adopting it (`None` if it is not a
    /// claim or an unknown outcome).
    fn peek(
        &self,
        id: &RecordId,
    ) -> impl Future<Output = Result<Option<PendingRecord>, StoreError>> + Send;

    /// Settles the record adopted with `token` (refused with
    /// [`StoreError::StaleToken`] once the adoption lapsed and another took it), and
    /// sets its notified flag to `notified` when it stays `outcome_unknown`.
    fn settle(
        &self,
        id: &RecordId,
        token: Token,
        settlement: Settlement,
        notified: bool,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Counts a reconciler that starts (`true`) or stops (`false`) for this store:
    /// while one runs, [`reconciled`](IdempotencyStore::reconciled) is `true`.
    fn set_reconciled(&self, running: bool);

    /// A reconciler for this store with `resolver` and the default settings.
    fn reconciler<R: Resolver>(&self, resolver: R) -> Reconciler<Self, R>
    where
        Self: Sized,
    {
        Reconciler::new(self.clone(), resolver)
    }
}

/// Counts the reconcilers running for a store: what a store's
/// [`set_reconciled`](ReconcilableStore::set_reconciled) and
/// [`reconciled`](IdempotencyStore::reconciled) keep.
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct Reconcilers(std::sync::atomic::AtomicUsize);

impl Reconcilers {
    /// Counts one more (`true`) or one fewer (`false`).
    pub fn set(&self, running: bool) {
        use std::sync::atomic::Ordering;
        if running {
            self.0.fetch_add(1, Ordering::AcqRel);
        } else {
            let _ = self
                .0
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
    }

    /// Whether any runs.
    pub fn any(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire) > 0
    }
}
