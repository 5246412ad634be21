use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::{Claim, ClaimOutcome, IdempotencyStore, StoreError};
use crate::idempotency::{Completed, Record, RecordId, Token, UnknownReason};

/// A fault-injecting store wrapper for tests: makes calls fail or slow down on demand.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// # #[derive(Debug)] struct Dummy;
/// # impl retrysafe::idempotency::IdempotencyStore for Dummy {
/// #   async fn claim(&self, _: &RecordId, _: &Claim<'_>) -> Result<retrysafe_core::store::ClaimOutcome, StoreError> { Ok(retrysafe_core::store::ClaimOutcome::Claimed { takeover: false }) }
/// #   async fn complete(&self, _: &RecordId, _: Token, _: &retrysafe_core::idempotency::Completed, _: std::time::Duration) -> Result<(), StoreError> { Ok(()) }
/// #   async fn release(&self, _: &RecordId, _: Token) -> Result<(), StoreError> { Ok(()) }
/// #   async fn renew(&self, _: &RecordId, _: Token, _: std::time::Duration) -> Result<(), StoreError> { Ok(()) }
/// #   async fn commit_point(&self, _: &RecordId, _: Token) -> Result<(), StoreError> { Ok(()) }
/// #   async fn mark_unknown(&self, _: &RecordId, _: Token, _: std::time::Duration, _: retrysafe::idempotency::UnknownReason) -> Result<(), StoreError> { Ok(()) }
/// #   async fn get(&self, _: &RecordId) -> Result<Option<retrysafe_core::idempotency::Record>, StoreError> { Ok(None) }
/// # }
/// use retrysafe::idempotency::{RecordId, Token};
/// use retrysafe_core::store::{Claim, FaultyStore, IdempotencyStore, StoreError};
///
/// let store = FaultyStore::new(Dummy);
/// store.fail_all(true);
/// let id = RecordId::from_bytes([0; 32]);
/// assert!(matches!(store.get(&id).await, Err(StoreError::Unavailable(_))));
/// store.fail_all(false);
/// store.fail_next_completions(1);
/// let done = retrysafe_core::idempotency::Completed::new(
///     retrysafe::idempotency::Fingerprint::from_bytes([0; 32]),
///     None,
/// );
/// let retention = std::time::Duration::from_secs(1);
/// assert!(store.complete(&id, Token::random(), &done, retention).await.is_err());
/// assert_eq!(store.calls(), 2);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct FaultyStore<S> {
    inner: S,
    faults: Arc<Faults>,
}

#[derive(Debug, Default)]
struct Faults {
    fail_all: AtomicBool,
    fail_completions: AtomicU32,
    lose_replies: AtomicU32,
    stale_renewals: AtomicBool,
    delay_ms: AtomicU64,
    calls: AtomicU64,
}

#[derive(Debug)]
struct InjectedFault;

impl std::fmt::Display for InjectedFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("injected fault")
    }
}

impl std::error::Error for InjectedFault {}

impl<S: IdempotencyStore> FaultyStore<S> {
    /// Wraps `inner`; no faults until asked.
    pub fn new(inner: S) -> Self {
        FaultyStore {
            inner,
            faults: Arc::default(),
        }
    }

    /// Makes every call fail with [`StoreError::Unavailable`] (or stop failing).
    pub fn fail_all(&self, on: bool) {
        self.faults.fail_all.store(on, Ordering::SeqCst);
    }

    /// Makes the next `n` calls of `complete` fail.
    pub fn fail_next_completions(&self, n: u32) {
        self.faults.fail_completions.store(n, Ordering::SeqCst);
    }

    /// The next `n` calls (of any kind) are applied to the inner store and then report
    /// a failure, as when a connection drops after the store ran the call but before
    /// its reply arrived ("applied, reply lost").
    pub fn lose_next_replies(&self, n: u32) {
        self.faults.lose_replies.store(n, Ordering::SeqCst);
    }

    /// While on, every renewal is refused with [`StoreError::StaleToken`] without
    /// reaching the inner store, as after another copy took the claim over.
    pub fn refuse_renewals(&self, on: bool) {
        self.faults.stale_renewals.store(on, Ordering::SeqCst);
    }

    /// Delays every call by `delay` (tokio time) before it runs.
    pub fn delay(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.faults.delay_ms.store(ms, Ordering::SeqCst);
    }

    /// How many calls were made.
    pub fn calls(&self) -> u64 {
        self.faults.calls.load(Ordering::SeqCst)
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Runs one call of the inner store behind the gate, losing its reply when asked.
    async fn run<T>(
        &self,
        completion: bool,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        self.gate(completion).await?;
        let out = call.await;
        let lose = self
            .faults
            .lose_replies
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if lose {
            return Err(StoreError::unavailable(InjectedFault));
        }
        out
    }

    async fn gate(&self, completion: bool) -> Result<(), StoreError> {
        self.faults.calls.fetch_add(1, Ordering::SeqCst);
        let ms = self.faults.delay_ms.load(Ordering::SeqCst);
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        if self.faults.fail_all.load(Ordering::SeqCst) {
            return Err(StoreError::unavailable(InjectedFault));
        }
        if completion
            && self
                .faults
                .fail_completions
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            return Err(StoreError::unavailable(InjectedFault));
        }
        Ok(())
    }
}

impl<S: IdempotencyStore> IdempotencyStore for FaultyStore<S> {
    async fn claim(&self, id: &RecordId, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        self.run(false, self.inner.claim(id, claim)).await
    }
    async fn complete(
        &self,
        id: &RecordId,
        token: Token,
        record: &Completed,
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.run(true, self.inner.complete(id, token, record, retention))
            .await
    }
    async fn release(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        self.run(false, self.inner.release(id, token)).await
    }
    async fn renew(&self, id: &RecordId, token: Token, lease: Duration) -> Result<(), StoreError> {
        if self.faults.stale_renewals.load(Ordering::SeqCst) {
            return Err(StoreError::StaleToken);
        }
        self.run(false, self.inner.renew(id, token, lease)).await
    }
    async fn commit_point(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        self.run(false, self.inner.commit_point(id, token)).await
    }
    async fn commit_point_with(
        &self,
        id: &RecordId,
        token: Token,
        note: &[u8],
    ) -> Result<(), StoreError> {
        self.run(false, self.inner.commit_point_with(id, token, note))
            .await
    }
    async fn mark_unknown(
        &self,
        id: &RecordId,
        token: Token,
        retention: Duration,
        reason: UnknownReason,
    ) -> Result<(), StoreError> {
        self.run(false, self.inner.mark_unknown(id, token, retention, reason))
            .await
    }
    async fn mark_notified(&self, id: &RecordId) -> Result<(), StoreError> {
        self.run(false, self.inner.mark_notified(id)).await
    }
    fn reconciled(&self) -> bool {
        self.inner.reconciled()
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.run(false, self.inner.get(id)).await
    }
    async fn wait(&self, id: &RecordId, max: Duration) -> Result<(), StoreError> {
        self.run(false, self.inner.wait(id, max)).await
    }
}
