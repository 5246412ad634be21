//! The store trait every idempotency backend implements.
//!
//! A store holds one [`Record`] per [`RecordId`] and makes each transition atomic:
//!
//! - [`claim`](IdempotencyStore::claim) creates an `in_progress` record with a lease, or
//!   returns the existing record. An existing `in_progress` record whose lease has
//!   expired is resolved in the same step: if its holder had not reached its commit
//!   point ([`CommitPoint::Before`]) and the fingerprint matches, the new claim takes it
//!   over; otherwise it becomes `outcome_unknown`.
//! - [`complete`](IdempotencyStore::complete), [`release`](IdempotencyStore::release),
//!   [`renew`](IdempotencyStore::renew), [`commit_point`](IdempotencyStore::commit_point)
//!   and [`mark_unknown`](IdempotencyStore::mark_unknown) carry the claim's [`Token`];
//!   a store refuses a token that is not the current holder's with
//!   [`StoreError::StaleToken`] (also after the lease expired and another copy
//!   re-claimed).
//! - Every call is idempotent per token, because a client library may send a call
//!   again after its connection dropped once the store had applied it ("reply lost"):
//!   a claim finding the `in_progress` record of its own token (and fingerprint) is
//!   [`ClaimOutcome::Claimed`] again; a completion finding the record already
//!   completed with exactly the same content (fingerprint and response) succeeds; a
//!   release finding the record absent, and a `mark_unknown` finding it
//!   `outcome_unknown`, succeed when that very token released or marked it, for at
//!   least [`RESEND_WINDOW`]; `renew` and `commit_point` repeated by the holder simply
//!   apply again. Any other token is refused as before: a stale holder's write never
//!   lands.
//! - Leases and retention are measured by the store's own clock where it has one.
//!
//! Every implementation passes the conformance suite in `conformance` (feature
//! `test-util`).

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::idempotency::{
    CommitPoint, Completed, Fingerprint, Record, RecordId, RequestInfo, Token, UnknownReason,
};

#[cfg(feature = "test-util")]
pub mod conformance;
#[cfg(feature = "test-util")]
mod faulty;
#[cfg(feature = "test-util")]
pub mod reconcile_conformance;
#[cfg(feature = "test-util")]
pub use faulty::FaultyStore;

/// How long a store remembers the token that released a record or marked it
/// `outcome_unknown`, so that the same call sent again (its reply was lost) succeeds
/// rather than being refused as stale: one minute, far longer than any store call
/// timeout.
pub const RESEND_WINDOW: Duration = Duration::from_secs(60);

/// The longest resolution note a handler may attach to its commit point
/// ([`IdempotencyStore::commit_point_with`]): 1 KiB. Longer notes are cut.
pub const MAX_NOTE: usize = 1024;

use crate::error::BoxError;

/// A failed store call.
#[derive(Debug)]
#[non_exhaustive]
pub enum StoreError {
    /// The token is not the current holder's: the claim was lost (expired and taken
    /// over, released, or completed).
    StaleToken,
    /// The store cannot take another in-flight claim.
    Full,
    /// The call did not finish in time.
    Timeout,
    /// A stored record could not be decoded.
    Corrupt(crate::idempotency::DecodeError),
    /// The backend failed or could not be reached.
    Unavailable(BoxError),
}

impl StoreError {
    /// Wraps a backend error.
    pub fn unavailable(e: impl Into<BoxError>) -> Self {
        StoreError::Unavailable(e.into())
    }

    /// Whether retrying the same call may succeed (not for a stale token).
    #[doc(hidden)]
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            StoreError::Timeout | StoreError::Unavailable(_) | StoreError::Full
        )
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::StaleToken => f.write_str("idempotency claim token is stale"),
            StoreError::Full => f.write_str("idempotency store cannot take more in-flight claims"),
            StoreError::Timeout => f.write_str("idempotency store call timed out"),
            StoreError::Corrupt(e) => write!(f, "idempotency record is corrupt: {e}"),
            StoreError::Unavailable(e) => write!(f, "idempotency store unavailable: {e}"),
        }
    }
}

impl StdError for StoreError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            StoreError::Corrupt(e) => Some(e),
            StoreError::Unavailable(e) => Some(&**e),
            _ => None,
        }
    }
}

/// The arguments of a claim.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim<'a> {
    /// The new holder's token.
    pub token: Token,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// How long the lease lasts unless renewed.
    pub lease: Duration,
    /// How long an `outcome_unknown` record made by this claim (from an expired lease)
    /// is kept.
    pub retention: Duration,
    /// The initial commit-point state: [`CommitPoint::Before`] when the handler declares
    /// its commit point, [`CommitPoint::Undeclared`] otherwise.
    pub commit_point: CommitPoint,
    /// What is known of the request, kept beside the record for recovery (a store that
    /// reconciles keeps it while the record is pending).
    pub request: Option<&'a RequestInfo>,
}

impl<'a> Claim<'a> {
    /// A claim by `token` for a request with `fingerprint`: a lease of `lease`, an
    /// unknown outcome (from an expired lease) kept for `retention`, and the initial
    /// commit-point state.
    pub fn new(
        token: Token,
        fingerprint: Fingerprint,
        lease: Duration,
        retention: Duration,
        commit_point: CommitPoint,
    ) -> Self {
        Claim {
            token,
            fingerprint,
            lease,
            retention,
            commit_point,
            request: None,
        }
    }

    /// The same claim, with what is known of the request.
    #[must_use]
    pub fn with_request(mut self, request: &'a RequestInfo) -> Self {
        self.request = Some(request);
        self
    }
}

impl Claim<'_> {
    /// Whether `record` is this claim's own `in_progress` record (same token and
    /// fingerprint): the claim was applied before, and a store answers the repeated
    /// claim with [`ClaimOutcome::Claimed`].
    pub fn holds(&self, record: &Record) -> bool {
        matches!(record, Record::InProgress(r)
            if r.token == self.token && r.fingerprint == self.fingerprint)
    }
}

/// The result of a claim.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The caller holds the record now and runs the handler.
    Claimed {
        /// Whether it took over an expired lease of a holder that had not reached its
        /// commit point.
        takeover: bool,
    },
    /// A record exists: the caller answers from it (a replay, or a problem).
    Existing {
        /// The record.
        record: Record,
        /// Whether this claim turned an expired lease into `outcome_unknown` (the
        /// caller reports it to the reconcile hook once).
        became_unknown: bool,
    },
}

/// A future returned by a store, boxed (the object-safe form).
#[doc(hidden)]
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// An idempotency store. Futures are `Send`; [`BoxStore`] is the object-safe form.
pub trait IdempotencyStore: fmt::Debug + Send + Sync + 'static {
    /// Claims `id`, or returns its record (see the module docs for expired leases).
    fn claim(
        &self,
        id: &RecordId,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<ClaimOutcome, StoreError>> + Send;

    /// Stores the completed record (kept for `retention`) if `token` still holds it.
    fn complete(
        &self,
        id: &RecordId,
        token: Token,
        record: &Completed,
        retention: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Deletes the record if `token` still holds it: the next copy runs again.
    fn release(
        &self,
        id: &RecordId,
        token: Token,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Extends the lease to `lease` from now if `token` still holds it.
    fn renew(
        &self,
        id: &RecordId,
        token: Token,
        lease: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Records that the holder passed its commit point, if `token` still holds it.
    fn commit_point(
        &self,
        id: &RecordId,
        token: Token,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Records that the holder passed its commit point, with a resolution `note` (at
    /// most [`MAX_NOTE`] bytes) kept for a resolver, if `token` still holds it. The
    /// default ignores the note (a store that does not reconcile has no use for it).
    fn commit_point_with(
        &self,
        id: &RecordId,
        token: Token,
        note: &[u8],
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = note;
        self.commit_point(id, token)
    }

    /// Turns the record into `outcome_unknown` (kept for `retention`) for `reason` if
    /// `token` still holds it. The record is not yet *notified*: see
    /// [`mark_notified`](IdempotencyStore::mark_notified).
    fn mark_unknown(
        &self,
        id: &RecordId,
        token: Token,
        retention: Duration,
        reason: UnknownReason,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Records that the reconcile hook was told of this `outcome_unknown` record, so
    /// that a reconciler does not tell it again. The default does nothing (a store that
    /// does not reconcile keeps no flag).
    fn mark_notified(&self, id: &RecordId) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = id;
        async { Ok(()) }
    }

    /// Whether a reconciler is running for this store: copies of pending records are
    /// then told to come back (503 `outcome-pending`) instead of 500 `outcome-unknown`.
    /// The default is `false`.
    fn reconciled(&self) -> bool {
        false
    }

    /// The current record, `None` if absent (never claimed, released, or expired).
    /// An `in_progress` record is returned as stored, even when its lease has expired.
    fn get(&self, id: &RecordId)
    -> impl Future<Output = Result<Option<Record>, StoreError>> + Send;

    /// Waits until the record may have left `in_progress` (completed, released, marked,
    /// or its lease expired), or `max` passed. Returns nothing: the caller looks again.
    ///
    /// The default polls [`get`](IdempotencyStore::get) with backoff from 5 ms to 100 ms;
    /// a store with a notifier overrides it.
    fn wait(
        &self,
        id: &RecordId,
        max: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        async move {
            let until = tokio::time::Instant::now() + max.min(crate::wire::MAX_TIMEOUT);
            let mut delay = Duration::from_millis(5);
            loop {
                match self.get(id).await? {
                    Some(Record::InProgress(_)) => {}
                    _ => return Ok(()),
                }
                let now = tokio::time::Instant::now();
                if now >= until {
                    return Ok(());
                }
                tokio::time::sleep_until(until.min(now + delay)).await;
                delay = (delay * 2).min(Duration::from_millis(100));
            }
        }
    }
}

/// A shared store is a store: `Arc<S>` forwards every call to `S`, so one store can be
/// wrapped (in the `FaultyStore` of the `test-util` feature, say) and still be used
/// directly.
impl<S: IdempotencyStore> IdempotencyStore for Arc<S> {
    fn claim(
        &self,
        id: &RecordId,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<ClaimOutcome, StoreError>> + Send {
        (**self).claim(id, claim)
    }
    fn complete(
        &self,
        id: &RecordId,
        token: Token,
        record: &Completed,
        retention: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).complete(id, token, record, retention)
    }
    fn release(
        &self,
        id: &RecordId,
        token: Token,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).release(id, token)
    }
    fn renew(
        &self,
        id: &RecordId,
        token: Token,
        lease: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).renew(id, token, lease)
    }
    fn commit_point(
        &self,
        id: &RecordId,
        token: Token,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).commit_point(id, token)
    }
    fn commit_point_with(
        &self,
        id: &RecordId,
        token: Token,
        note: &[u8],
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).commit_point_with(id, token, note)
    }
    fn mark_unknown(
        &self,
        id: &RecordId,
        token: Token,
        retention: Duration,
        reason: UnknownReason,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).mark_unknown(id, token, retention, reason)
    }
    fn mark_notified(&self, id: &RecordId) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).mark_notified(id)
    }
    fn reconciled(&self) -> bool {
        (**self).reconciled()
    }
    fn get(
        &self,
        id: &RecordId,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        (**self).get(id)
    }
    fn wait(
        &self,
        id: &RecordId,
        max: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).wait(id, max)
    }
}

/// The object-safe form of [`IdempotencyStore`], implemented for every store.
#[doc(hidden)]
pub trait DynIdempotencyStore: fmt::Debug + Send + Sync + 'static {
    /// See [`IdempotencyStore::claim`].
    fn claim<'a>(&'a self, id: &'a RecordId, claim: &'a Claim<'a>)
    -> StoreFuture<'a, ClaimOutcome>;
    /// See [`IdempotencyStore::complete`].
    fn complete<'a>(
        &'a self,
        id: &'a RecordId,
        token: Token,
        record: &'a Completed,
        retention: Duration,
    ) -> StoreFuture<'a, ()>;
    /// See [`IdempotencyStore::release`].
    fn release<'a>(&'a self, id: &'a RecordId, token: Token) -> StoreFuture<'a, ()>;
    /// See [`IdempotencyStore::renew`].
    fn renew<'a>(&'a self, id: &'a RecordId, token: Token, lease: Duration) -> StoreFuture<'a, ()>;
    /// See [`IdempotencyStore::commit_point`].
    fn commit_point<'a>(&'a self, id: &'a RecordId, token: Token) -> StoreFuture<'a, ()>;
    /// See [`IdempotencyStore::commit_point_with`].
    fn commit_point_with<'a>(
        &'a self,
        id: &'a RecordId,
        token: Token,
        note: &'a [u8],
    ) -> StoreFuture<'a, ()>;
    /// See [`IdempotencyStore::mark_unknown`].
    fn mark_unknown<'a>(
        &'a self,
        id: &'a RecordId,
        token: Token,
        retention: Duration,
        reason: UnknownReason,
    ) -> StoreFuture<'a, ()>;
    /// See [`IdempotencyStore::mark_notified`].
    fn mark_notified<'a>(&'a self, id: &'a RecordId) -> StoreFuture<'a, ()>;
    /// See [`IdempotencyStore::reconciled`].
    fn reconciled(&self) -> bool;
    /// See [`IdempotencyStore::get`].
    fn get<'a>(&'a self, id: &'a RecordId) -> StoreFuture<'a, Option<Record>>;
    /// See [`IdempotencyStore::wait`].
    fn wait<'a>(&'a self, id: &'a RecordId, max: Duration) -> StoreFuture<'a, ()>;
}

impl<S: IdempotencyStore> DynIdempotencyStore for S {
    fn claim<'a>(
        &'a self,
        id: &'a RecordId,
        claim: &'a Claim<'a>,
    ) -> StoreFuture<'a, ClaimOutcome> {
        Box::pin(IdempotencyStore::claim(self, id, claim))
    }
    fn complete<'a>(
        &'a self,
        id: &'a RecordId,
        token: Token,
        record: &'a Completed,
        retention: Duration,
    ) -> StoreFuture<'a, ()> {
        Box::pin(IdempotencyStore::complete(
            self, id, token, record, retention,
        ))
    }
    fn release<'a>(&'a self, id: &'a RecordId, token: Token) -> StoreFuture<'a, ()> {
        Box::pin(IdempotencyStore::release(self, id, token))
    }
    fn renew<'a>(&'a self, id: &'a RecordId, token: Token, lease: Duration) -> StoreFuture<'a, ()> {
        Box::pin(IdempotencyStore::renew(self, id, token, lease))
    }
    fn commit_point<'a>(&'a self, id: &'a RecordId, token: Token) -> StoreFuture<'a, ()> {
        Box::pin(IdempotencyStore::commit_point(self, id, token))
    }
    fn commit_point_with<'a>(
        &'a self,
        id: &'a RecordId,
        token: Token,
        note: &'a [u8],
    ) -> StoreFuture<'a, ()> {
        Box::pin(IdempotencyStore::commit_point_with(self, id, token, note))
    }
    fn mark_unknown<'a>(
        &'a self,
        id: &'a RecordId,
        token: Token,
        retention: Duration,
        reason: UnknownReason,
    ) -> StoreFuture<'a, ()> {
        Box::pin(IdempotencyStore::mark_unknown(
            self, id, token, retention, reason,
        ))
    }
    fn mark_notified<'a>(&'a self, id: &'a RecordId) -> StoreFuture<'a, ()> {
        Box::pin(IdempotencyStore::mark_notified(self, id))
    }
    fn reconciled(&self) -> bool {
        IdempotencyStore::reconciled(self)
    }
    fn get<'a>(&'a self, id: &'a RecordId) -> StoreFuture<'a, Option<Record>> {
        Box::pin(IdempotencyStore::get(self, id))
    }
    fn wait<'a>(&'a self, id: &'a RecordId, max: Duration) -> StoreFuture<'a, ()> {
        Box::pin(IdempotencyStore::wait(self, id, max))
    }
}

/// A shared, type-erased store: what layers hold. Cheap to clone.
///
/// ```
/// # fn f<S: retrysafe::idempotency::IdempotencyStore>(store: S) {
/// use retrysafe::idempotency::BoxStore;
/// let shared = BoxStore::new(store);
/// let again = shared.clone();
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct BoxStore(Arc<dyn DynIdempotencyStore>);

impl BoxStore {
    /// Boxes a store.
    pub fn new(store: impl IdempotencyStore) -> Self {
        BoxStore(Arc::new(store))
    }

    /// Wraps an already shared store.
    #[doc(hidden)]
    pub fn from_arc(store: Arc<dyn DynIdempotencyStore>) -> Self {
        BoxStore(store)
    }
}

impl IdempotencyStore for BoxStore {
    async fn claim(&self, id: &RecordId, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        self.0.claim(id, claim).await
    }
    async fn complete(
        &self,
        id: &RecordId,
        token: Token,
        record: &Completed,
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.0.complete(id, token, record, retention).await
    }
    async fn release(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        self.0.release(id, token).await
    }
    async fn renew(&self, id: &RecordId, token: Token, lease: Duration) -> Result<(), StoreError> {
        self.0.renew(id, token, lease).await
    }
    async fn commit_point(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        self.0.commit_point(id, token).await
    }
    async fn commit_point_with(
        &self,
        id: &RecordId,
        token: Token,
        note: &[u8],
    ) -> Result<(), StoreError> {
        self.0.commit_point_with(id, token, note).await
    }
    async fn mark_unknown(
        &self,
        id: &RecordId,
        token: Token,
        retention: Duration,
        reason: UnknownReason,
    ) -> Result<(), StoreError> {
        self.0.mark_unknown(id, token, retention, reason).await
    }
    async fn mark_notified(&self, id: &RecordId) -> Result<(), StoreError> {
        self.0.mark_notified(id).await
    }
    fn reconciled(&self) -> bool {
        self.0.reconciled()
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.0.get(id).await
    }
    async fn wait(&self, id: &RecordId, max: Duration) -> Result<(), StoreError> {
        self.0.wait(id, max).await
    }
}
