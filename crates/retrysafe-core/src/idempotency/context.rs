use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use super::ids::child_key;
use super::{RecordId, Scope, Token};
use crate::store::{BoxStore, IdempotencyStore, StoreError};
use crate::wire::IdempotencyKey;

/// What a guarded handler knows about its idempotency record: a request extension
/// (`axum::Extension<IdempotencyContext>`) and a field of the inherited call context.
///
/// A handler that can say when its effect begins calls [`commit_point`] just before it;
/// until then a stalled or crashed holder can be taken over by the next copy.
/// [`child_key`] derives deterministic keys for the handler's own outbound calls, so a
/// re-run of the handler collects replays downstream instead of repeating effects.
/// [`lease_lost`] tells it that its claim was taken from it (the layer then cancels it).
///
/// [`commit_point`]: IdempotencyContext::commit_point
/// [`child_key`]: IdempotencyContext::child_key
/// [`lease_lost`]: IdempotencyContext::lease_lost
#[derive(Clone)]
pub struct IdempotencyContext {
    inner: Arc<Inner>,
}

struct Inner {
    scope: Scope,
    key: IdempotencyKey,
    id: RecordId,
    token: Token,
    store: Option<BoxStore>,
    store_timeout: Duration,
    /// Set once the commit point was written; concurrent callers share one write.
    committed: tokio::sync::OnceCell<()>,
    /// The resolution note given with the commit point, if any.
    note: std::sync::OnceLock<bytes::Bytes>,
    sequence: AtomicU64,
    /// Set once a renewal of the lease was refused with a stale token.
    lease_lost: AtomicBool,
    lost: tokio::sync::Notify,
}

impl IdempotencyContext {
    /// The context of a claim held with `token` on `store`.
    #[doc(hidden)]
    pub fn new(
        scope: Scope,
        key: IdempotencyKey,
        token: Token,
        store: BoxStore,
        store_timeout: Duration,
    ) -> Self {
        Self::build(scope, key, token, Some(store), store_timeout)
    }

    /// A context with no store behind it (for a transactional layer, where the commit
    /// point is the transaction itself, or for tests): [`commit_point`] is a no-op.
    ///
    /// [`commit_point`]: IdempotencyContext::commit_point
    pub fn detached(scope: Scope, key: IdempotencyKey, token: Token) -> Self {
        Self::build(scope, key, token, None, Duration::ZERO)
    }

    fn build(
        scope: Scope,
        key: IdempotencyKey,
        token: Token,
        store: Option<BoxStore>,
        store_timeout: Duration,
    ) -> Self {
        let id = RecordId::new(&scope, &key);
        Self::of_record(id, scope, key, token, store, store_timeout)
    }

    /// The context of the record `id`, which the caller has already derived from
    /// `scope` and `key` (a layer that holds it need not hash it again).
    pub(crate) fn of_record(
        id: RecordId,
        scope: Scope,
        key: IdempotencyKey,
        token: Token,
        store: Option<BoxStore>,
        store_timeout: Duration,
    ) -> Self {
        IdempotencyContext {
            inner: Arc::new(Inner {
                id,
                scope,
                key,
                token,
                store,
                store_timeout,
                committed: tokio::sync::OnceCell::new(),
                note: std::sync::OnceLock::new(),
                sequence: AtomicU64::new(0),
                lease_lost: AtomicBool::new(false),
                lost: tokio::sync::Notify::new(),
            }),
        }
    }

    /// The record's scope.
    pub fn scope(&self) -> &Scope {
        &self.inner.scope
    }

    /// The inbound idempotency key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.inner.key
    }

    /// The record key.
    pub fn record_id(&self) -> &RecordId {
        &self.inner.id
    }

    /// The token of this claim.
    pub fn token(&self) -> Token {
        self.inner.token
    }

    /// Declares that the effect is about to happen. Call it just before the effect:
    /// until then, a holder that dies or stalls past its lease is taken over by the next
    /// copy; after it, such a record becomes `outcome_unknown`.
    ///
    /// Writes to the store once (later calls return at once). If it fails, do not
    /// perform the effect: the claim may already belong to another copy. After the
    /// [lease was lost](IdempotencyContext::lease_lost) it fails without asking the
    /// store ([`StoreError::StaleToken`]), as the store would.
    pub async fn commit_point(&self) -> Result<(), StoreError> {
        self.commit(None).await
    }

    /// [`commit_point`](IdempotencyContext::commit_point) with a resolution `note` (at
    /// most [`MAX_NOTE`](crate::store::MAX_NOTE) bytes; longer notes are cut) that the
    /// store keeps for a resolver, should this holder crash past this point: the
    /// downstream's own key or id of the effect about to happen, say.
    pub async fn commit_point_with(&self, note: impl AsRef<[u8]>) -> Result<(), StoreError> {
        let note = note.as_ref();
        let note = note.get(..crate::store::MAX_NOTE).unwrap_or(note);
        self.commit(Some(note)).await?;
        let _ = self.inner.note.set(bytes::Bytes::copy_from_slice(note));
        Ok(())
    }

    /// The note written with the commit point, if any (what the reconcile hook is
    /// told).
    #[doc(hidden)]
    pub fn resolution_note(&self) -> Option<bytes::Bytes> {
        self.inner.note.get().cloned()
    }

    async fn commit(&self, note: Option<&[u8]>) -> Result<(), StoreError> {
        // Every caller, concurrent ones included, waits for the one write and sees its
        // result: nobody passes the commit point on the strength of a write that then
        // fails. A failed write is tried again by the next call.
        self.inner
            .committed
            .get_or_try_init(|| async {
                if self.lease_lost() {
                    return Err(StoreError::StaleToken);
                }
                let Some(store) = &self.inner.store else {
                    return Ok(());
                };
                let (id, token) = (&self.inner.id, self.inner.token);
                let write = async {
                    match note {
                        Some(note) => store.commit_point_with(id, token, note).await,
                        None => store.commit_point(id, token).await,
                    }
                };
                match tokio::time::timeout(self.inner.store_timeout, write).await {
                    Ok(r) => r,
                    Err(_) => Err(StoreError::Timeout),
                }
            })
            .await
            .map(|_| ())
    }

    /// Whether [`commit_point`](IdempotencyContext::commit_point) succeeded.
    pub fn is_committed(&self) -> bool {
        self.inner.committed.initialized()
    }

    /// Whether this claim's lease was lost: a renewal was refused because the record no
    /// longer carries this claim's token (the lease had expired, and another copy may
    /// have taken over and be running the same request). A handler that sees it should
    /// not start its effect; the layer cancels it soon after.
    ///
    /// ```
    /// use retrysafe::idempotency::{IdempotencyContext, Principal, Scope, Token};
    /// use retrysafe::wire::IdempotencyKey;
    /// let scope = Scope::from(&Principal::new("alice"));
    /// let key = IdempotencyKey::new("order-7").unwrap();
    /// let ctx = IdempotencyContext::detached(scope, key, Token::random());
    /// assert!(!ctx.lease_lost());
    /// ```
    pub fn lease_lost(&self) -> bool {
        self.inner.lease_lost.load(Ordering::Acquire)
    }

    /// Resolves once the lease is [lost](IdempotencyContext::lease_lost) (at once if it
    /// already is), to stop work early, for example in a `tokio::select!`.
    pub async fn until_lease_lost(&self) {
        loop {
            let notified = self.inner.lost.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the check, so a loss in between still wakes it.
            notified.as_mut().enable();
            if self.lease_lost() {
                return;
            }
            notified.await;
        }
    }

    /// Marks the lease lost (the layer's renewal was refused with a stale token) and
    /// wakes [`until_lease_lost`](IdempotencyContext::until_lease_lost).
    #[doc(hidden)]
    pub fn mark_lease_lost(&self) {
        self.inner.lease_lost.store(true, Ordering::Release);
        self.inner.lost.notify_waiters();
    }

    /// A deterministic key for an outbound call labelled `label`: `H(scope, key,
    /// label)`. The same label always gives the same key, so a re-run of this handler
    /// repeats the same keys downstream.
    ///
    /// ```
    /// use retrysafe::idempotency::{IdempotencyContext, Principal, Scope, Token};
    /// use retrysafe::wire::IdempotencyKey;
    /// let scope = Scope::from(&Principal::new("alice"));
    /// let key = IdempotencyKey::new("order-7").unwrap();
    /// let a = IdempotencyContext::detached(scope, key.clone(), Token::random());
    /// let b = IdempotencyContext::detached(scope, key, Token::random());
    /// assert_eq!(a.child_key("POST ledger/entries"), b.child_key("POST ledger/entries"));
    /// assert_ne!(a.child_key("POST ledger/entries"), a.child_key("POST mail/send"));
    /// ```
    pub fn child_key(&self, label: &str) -> IdempotencyKey {
        child_key(&self.inner.scope, &self.inner.key, label, 0)
    }

    /// The key of the next outbound call in sequence: `H(scope, key, label, n)` where
    /// `n` counts the calls made through this context. Deterministic only for calls
    /// made one after another; concurrent calls should each use their own
    /// [`child_key`](IdempotencyContext::child_key) label.
    pub fn next_child_key(&self, label: &str) -> IdempotencyKey {
        let n = self.inner.sequence.fetch_add(1, Ordering::Relaxed);
        child_key(
            &self.inner.scope,
            &self.inner.key,
            label,
            n.saturating_add(1),
        )
    }
}

impl fmt::Debug for IdempotencyContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyContext")
            .field("scope", &self.inner.scope)
            .field("key", &self.inner.key)
            .field("token", &self.inner.token)
            .field("committed", &self.is_committed())
            .field("lease_lost", &self.lease_lost())
            .finish()
    }
}
