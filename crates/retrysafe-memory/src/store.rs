//! [`MemoryStore`]: the store, its settings and its [`IdempotencyStore`] implementation.

use std::sync::Arc;
use std::time::Duration;

use retrysafe_core::__private::Validate;
use retrysafe_core::ConfigError;
use retrysafe_core::idempotency::{Completed, Record, RecordId, Token, UnknownReason};
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, StoreError};

use retrysafe_core::__private::handles::Gauge;
use retrysafe_core::observe::{Name, names};

use crate::inner::{EvictionFn, HookFn, Inner, Settings};
use crate::retained::Gauges;

/// The embedded default [`IdempotencyStore`]: in memory, for one process.
///
/// - In-flight claims live in a bounded map that is never evicted: at
///   [`max_in_flight`](Self::max_in_flight) live claims a new claim gets
///   [`StoreError::Full`] (the layer answers 503). Before refusing, the store sweeps
///   claims whose lease has expired: one whose holder had not reached its commit point
///   is dropped, any other becomes `outcome_unknown` (reason `LeaseExpired`, not yet
///   notified) for the retention of its claim.
/// - Completed and `outcome_unknown` records live in the store's own LRU, bounded by
///   three quarters of [`max_bytes`](Self::max_bytes) and changed only under the lock
///   that every claim takes: no claim can land between a record's eviction and what
///   replaces it. A record weighs its encoded length ([`Record::encoded_len`]) plus the
///   32-byte key plus [`ENTRY_OVERHEAD`](Self::ENTRY_OVERHEAD), the cost of the store's
///   own structures, so that the bound holds the store's real memory.
/// - **Under pressure, records shrink; keys are not forgotten.** A record pushed out
///   of the LRU leaves a *tombstone* ([`TOMBSTONE_BYTES`](Self::TOMBSTONE_BYTES): a
///   16-byte truncated record id and an expiry bucket) until its retention ends: a copy
///   of its request gets [`Record::Evicted`] (the layer answers 409
///   `response-evicted` with `do-not-retry: 1`), never a second run. Tombstones have
///   their own quarter of `max_bytes`. When they no longer fit, the oldest are dropped:
///   each is reported to the [`on_evicted`](Self::on_evicted) hook and as a tracing
///   event, and [`effective_retention`](Self::effective_retention) tells how far back
///   the store still remembers every key. With
///   [`fail_closed_when_full`](Self::fail_closed_when_full), tombstones are kept and new
///   claims get [`StoreError::Full`] (503 `overloaded`) instead. Only completed records
///   shrink: an `outcome_unknown` record stays whole until it is resolved or its
///   retention ends (a tombstone would never be reconciled, nor its hook told); when such
///   records alone fill the record bound, new claims get [`StoreError::Full`].
///   [`sustained_key_rate`](Self::sustained_key_rate) (reported by
///   [`build`](Self::build)) is the rate of new keys a configuration remembers for
///   their whole retention.
/// - **Fairness between scopes.** The store learns each record's scope from the claim's
///   request information ([`Claim::request`]; a claim without one counts as one
///   anonymous scope) and tracks the scopes holding the most bytes in a bounded
///   heavy-hitters sketch (Space-Saving, 32 counters). Under pressure, the records of
///   the heaviest scope shrink first, as long as it holds more than its share of the
///   bound; its tombstones are also the first dropped. A scope under its share keeps
///   its records while another floods. Fairness holds per principal: a client that can
///   mint principals (new credentials at will) is many light scopes, and only the byte
///   bound and the LRU protect the others from it.
/// - Each record keeps its own expiry in tokio time, checked on every read; expired
///   records are collected when read or when they reach the end of the LRU. Leases are
///   tokio time too, and [`InProgress::lease_until_ms`](retrysafe_core::idempotency::InProgress::lease_until_ms)
///   counts milliseconds since the store was created.
/// - Repeated calls are recognised as the store trait describes: a completion that
///   finds the same completed record succeeds, and the token of each release,
///   `mark_unknown` or settlement is kept for
///   [`RESEND_WINDOW`](retrysafe_core::store::RESEND_WINDOW) (about 60 bytes per release
///   in that window) so that the same call sent again succeeds.
/// - It is a [`ReconcilableStore`](retrysafe_core::recovery::ReconcilableStore): a
///   reconciler finds expired claims and `outcome_unknown` records by scanning the
///   in-flight map and an index of the unknown records, and adopts them (copies then
///   see [`Record::Resolving`]).
/// - Every change to one record happens under that record's shard lock, so a claim sees
///   the in-flight map, the records and the tombstones in one step. Waiters are woken
///   by a notifier per in-flight record (or when its lease expires).
///
/// Cloning is cheap and shares the store.
///
/// # Settings
///
/// [`new`](Self::new) (or `default`) gives a store with the documented defaults. The
/// setters ([`max_in_flight`](Self::max_in_flight), [`max_bytes`](Self::max_bytes),
/// [`on_evicted`](Self::on_evicted), [`fail_closed_when_full`](Self::fail_closed_when_full))
/// take and return the store and never fail;
/// [`build`](Self::build) validates them once and names every refused setting. They
/// are meant to follow `new` directly: each returns a fresh, empty store with the
/// changed setting (the bounds are fixed in the store's structures), so a store already
/// in use, and its clones, keep their records and settings. A store whose settings
/// were never validated still works: a zero bound refuses every claim, or keeps no
/// completed record.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use retrysafe_core::idempotency::{
///     CommitPoint, Completed, Fingerprint, Record, RecordId, Scope, Token,
/// };
/// use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore};
/// use retrysafe::wire::IdempotencyKey;
/// use retrysafe::memory::MemoryStore;
///
/// let store = MemoryStore::new().max_in_flight(1_000).max_bytes(16 << 20).build()?;
/// let id = RecordId::new(&Scope::new("tenant-1"), &IdempotencyKey::new("order-42")?);
/// let claim = Claim::new(
///     Token::random(),
///     Fingerprint::from_bytes([7; 32]),
///     Duration::from_secs(10),
///     Duration::from_secs(24 * 60 * 60),
///     CommitPoint::Undeclared,
/// );
/// assert_eq!(store.claim(&id, &claim).await?, ClaimOutcome::Claimed { takeover: false });
///
/// // A copy of the request finds the claim in progress: it does not run.
/// let mut copy = claim;
/// copy.token = Token::random();
/// assert!(matches!(
///     store.claim(&id, &copy).await?,
///     ClaimOutcome::Existing { record: Record::InProgress(_), became_unknown: false }
/// ));
///
/// // The holder completes; later copies find the completed record.
/// let done = Completed::new(claim.fingerprint, None);
/// store.complete(&id, claim.token, &done, claim.retention).await?;
/// assert_eq!(
///     store.claim(&id, &copy).await?,
///     ClaimOutcome::Existing { record: Record::Completed(done), became_unknown: false }
/// );
/// // The copy's token never held the record.
/// assert!(store.release(&id, copy.token).await.is_err());
/// assert_eq!((store.in_flight_len(), store.cached_len()), (0, 1));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct MemoryStore {
    pub(crate) inner: Arc<Inner>,
}

impl MemoryStore {
    /// The default bound of the in-flight map: 10 000 claims.
    #[doc(hidden)]
    pub const DEFAULT_MAX_IN_FLIGHT: usize = 10_000;

    /// The default byte bound of the records and tombstones: 64 MiB.
    #[doc(hidden)]
    pub const DEFAULT_MAX_BYTES: u64 = 64 * 1024 * 1024;

    /// The bytes a kept record costs beyond its encoded length and its 32-byte key: its
    /// slot in the record map (the key, the record's handle, expiry, scope and LRU
    /// position, at a load factor down to 7/16 just after the table grew), its node in
    /// the LRU's slab (its id, scope and the links of the two lists, by age and by
    /// scope and age: 72 bytes, the slab as large as the most records it held), and the
    /// reference counts and malloc rounding in front of the record's own allocation
    /// (glibc malloc, 64-bit).
    ///
    /// Measured with a counting allocator (`tests/heap.rs`, 14 300 and 14 400 records,
    /// on both sides of a growth of the record map): the store's structures take 220 to
    /// 320 bytes per record beyond the record's own allocation (keys included), plus
    /// malloc's chunk header and rounding of that allocation (8 to 23 bytes). This
    /// constant, with the 32 bytes counted for the key, is above all of them, so that
    /// the weight [`max_bytes`](Self::max_bytes) bounds is not less than the memory the
    /// records hold. A store also holds a fixed few kilobytes of its own that no
    /// record's weight carries.
    pub const ENTRY_OVERHEAD: u64 = 400;

    /// The bytes a tombstone costs: a 16-byte truncated record id, two 4-byte time
    /// buckets and its class (of a heavy scope or not) in a hash table (at a load factor
    /// down to 7/16), and the whole 32-byte id in its expiry bucket's list (given to the
    /// eviction hook), with room to grow: about 100 bytes at the lowest load factor of
    /// the table (`tests/heap.rs` checks a store of mostly tombstones against its
    /// weight).
    pub const TOMBSTONE_BYTES: u64 = 128;

    /// A store with the default bounds and no eviction hook.
    ///
    /// ```
    /// use retrysafe::memory::MemoryStore;
    /// let store = MemoryStore::new()
    ///     .max_in_flight(2_048)
    ///     .max_bytes(256 << 20)
    ///     .on_evicted(|id| eprintln!("record {id:?} forgotten before its retention"))
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(store.in_flight_len(), 0);
    ///
    /// let refused = MemoryStore::new().max_in_flight(0).max_bytes(0).build().unwrap_err();
    /// assert_eq!(refused.fields().collect::<Vec<_>>(), ["max_in_flight", "max_bytes"]);
    /// ```
    pub fn new() -> Self {
        MemoryStore::with(Settings::default())
    }

    fn with(settings: Settings) -> Self {
        MemoryStore {
            inner: Arc::new(Inner::new(settings)),
        }
    }

    /// A fresh store with `set` applied to this one's settings.
    fn configure(self, set: impl FnOnce(&mut Settings)) -> Self {
        let mut settings = self.inner.settings.clone();
        set(&mut settings);
        MemoryStore::with(settings)
    }

    /// The most in-flight claims held at once (default 10 000). In-flight claims are
    /// never evicted; at the bound a new claim gets [`StoreError::Full`]. Must be
    /// greater than zero.
    pub fn max_in_flight(self, max: usize) -> Self {
        self.configure(|s| s.max_in_flight = max)
    }

    /// The byte bound of the completed and `outcome_unknown` records (three quarters)
    /// and of their tombstones (one quarter), default 64 MiB, weighed as described on
    /// [`MemoryStore`]. Past it, completed records shrink to tombstones, and then the
    /// oldest tombstones are dropped (`outcome_unknown` records never shrink). A response heavier than the whole record bound is not
    /// kept at all (copies get `response-not-stored`). Must be greater than zero.
    pub fn max_bytes(self, max: u64) -> Self {
        self.configure(|s| s.max_bytes = max)
    }

    /// A hook called with the id of each record the store forgot before its retention
    /// ended: a tombstone dropped because tombstones no longer fit (not on expiry,
    /// replacement or removal). A copy of that record's request may run again.
    ///
    /// It is called after the store call that dropped the tombstone, outside the
    /// store's locks; it should be quick and must not panic.
    pub fn on_evicted(self, hook: impl Fn(&RecordId) + Send + Sync + 'static) -> Self {
        let hook: Arc<HookFn> = Arc::new(hook);
        self.configure(|s| s.on_evicted = Some(hook))
    }

    /// A hook called for each eviction: a record shrunk to a tombstone
    /// ([`EvictionKind::Tombstoned`](crate::EvictionKind::Tombstoned)) and a tombstone
    /// dropped before its retention ([`EvictionKind::Forgotten`](crate::EvictionKind::Forgotten),
    /// also told to [`on_evicted`](Self::on_evicted)), with the store's
    /// [`name`](Self::name). Called like `on_evicted`: after the store call, outside
    /// the store's locks; it should be quick and must not panic. Records shrunk are
    /// only collected while this hook is set.
    pub fn on_eviction(self, hook: impl Fn(&crate::Eviction) + Send + Sync + 'static) -> Self {
        let hook: Arc<EvictionFn> = Arc::new(hook);
        self.configure(|s| s.on_eviction = Some(hook))
    }

    /// The store's name (default `default`): the `name` of its evictions, its tracing
    /// events and its metrics (`retrysafe_memory_store_bytes`,
    /// `retrysafe_memory_store_effective_retention_seconds`; see
    /// [`retrysafe_core::observe`]), which [`build`](Self::build) resolves.
    pub fn name(self, name: impl Into<Name>) -> Self {
        let name = name.into();
        self.configure(|s| s.name = name)
    }

    /// Never forgets a key before its retention ends: when the tombstones fill their
    /// share of [`max_bytes`](Self::max_bytes), new claims get [`StoreError::Full`] (the
    /// layer answers 503 `overloaded`) until records expire, instead of dropping the
    /// oldest tombstones. Claims already in flight still complete (their tombstones may
    /// go over the share by at most [`max_in_flight`](Self::max_in_flight) of them).
    pub fn fail_closed_when_full(self) -> Self {
        self.configure(|s| s.fail_closed = true)
    }

    /// Validates the settings: refuses a zero [`max_in_flight`](Self::max_in_flight) and
    /// a zero [`max_bytes`](Self::max_bytes), naming every refused one. Reports (tracing
    /// info) the [sustained key rate](Self::sustained_key_rate) of 1 KiB records kept
    /// for 24 hours.
    ///
    /// With the feature `metrics`, it resolves the store's gauges in the recorder
    /// installed then (only a built store reports them): `retrysafe_memory_store_bytes`
    /// (the weighted bytes of the records, set on every change) and
    /// `retrysafe_memory_store_effective_retention_seconds` (how far back every key is
    /// remembered, set each time tombstones are dropped early; 0 until then). Like
    /// every setter, it returns a fresh, empty store.
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        let settings = &self.inner.settings;
        v.check(
            settings.max_in_flight > 0,
            "max_in_flight",
            "must be greater than zero",
        );
        v.check(
            settings.max_bytes > 0,
            "max_bytes",
            "must be greater than zero",
        );
        let store = v.finish(self)?.configure(|s| {
            s.gauges = Gauges {
                bytes: Gauge::new(names::MEMORY_STORE_BYTES, &s.name),
                effective_retention: Gauge::new(
                    names::MEMORY_STORE_EFFECTIVE_RETENTION_SECONDS,
                    &s.name,
                ),
            };
        });
        let day = Duration::from_secs(24 * 60 * 60);
        tracing::info!(
            target: "retrysafe::idempotency",
            name = store.inner.settings.name.as_str(),
            max_bytes = store.inner.settings.max_bytes,
            fail_closed = store.inner.settings.fail_closed,
            keys_per_second = store.sustained_key_rate(1024, day),
            "MemoryStore remembers every key for 24 h at up to this rate of new keys \
             (1 KiB records)"
        );
        Ok(store)
    }

    /// The sustained rate of new keys (per second) that this configuration remembers
    /// for their whole `retention`, for records of `record_bytes` encoded bytes (about
    /// the response body and headers plus 60): as many records as the record bound
    /// holds, then as many tombstones as their share holds, spread over the retention.
    /// Above it, tombstones are dropped before their retention ends (or, with
    /// [`fail_closed_when_full`](Self::fail_closed_when_full), claims are refused).
    ///
    /// ```
    /// use std::time::Duration;
    /// use retrysafe::memory::MemoryStore;
    /// let store = MemoryStore::new().max_bytes(64 << 20).build().unwrap();
    /// let per_second = store.sustained_key_rate(1024, Duration::from_secs(24 * 3600));
    /// assert!(per_second > 1.0 && per_second < 10.0, "{per_second}");
    /// ```
    pub fn sustained_key_rate(&self, record_bytes: u64, retention: Duration) -> f64 {
        let bounds = self.inner.bounds();
        let weight = record_bytes
            .saturating_add(crate::retained::KEY_BYTES)
            .saturating_add(Self::ENTRY_OVERHEAD);
        let keys = bounds.records / weight + bounds.tombstones / Self::TOMBSTONE_BYTES;
        keys as f64 / retention.as_secs_f64().max(f64::MIN_POSITIVE)
    }

    /// How far back the store still remembers every key: `None` while no tombstone has
    /// been dropped before its retention ended (or every key so forgotten would have
    /// expired by now); otherwise the time since the newest record whose tombstone was
    /// dropped. A key completed longer ago than this may run again.
    pub fn effective_retention(&self) -> Option<Duration> {
        self.inner.effective_retention()
    }

    /// The number of in-flight claims held (live or with an expired lease not yet
    /// resolved).
    pub fn in_flight_len(&self) -> usize {
        self.inner.in_flight_len()
    }

    /// The weighted size of the completed and `outcome_unknown` records in bytes (see
    /// [`ENTRY_OVERHEAD`](Self::ENTRY_OVERHEAD)). Records past their retention that were
    /// not read since still count until collected.
    pub fn cached_bytes(&self) -> u64 {
        self.inner.retained_stats().0
    }

    /// The number of completed and `outcome_unknown` records kept (tombstones not
    /// counted).
    #[doc(hidden)]
    pub fn cached_len(&self) -> u64 {
        self.inner.retained_stats().1
    }

    /// The number of tombstones kept.
    #[doc(hidden)]
    pub fn tombstones_len(&self) -> u64 {
        self.inner.retained_stats().2
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl IdempotencyStore for MemoryStore {
    async fn claim(&self, id: &RecordId, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        let outcome = self.inner.claim(id, claim);
        self.inner.flush_evicted();
        outcome
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: Token,
        record: &Completed,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let done = self.inner.complete(id, token, record, retention);
        self.inner.flush_evicted();
        done
    }

    async fn release(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        self.inner.release(id, token)
    }

    async fn renew(&self, id: &RecordId, token: Token, lease: Duration) -> Result<(), StoreError> {
        self.inner.renew(id, token, lease)
    }

    async fn commit_point(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        self.inner.commit_point(id, token, None)
    }

    async fn commit_point_with(
        &self,
        id: &RecordId,
        token: Token,
        note: &[u8],
    ) -> Result<(), StoreError> {
        self.inner.commit_point(id, token, Some(note))
    }

    async fn mark_unknown(
        &self,
        id: &RecordId,
        token: Token,
        retention: Duration,
        reason: UnknownReason,
    ) -> Result<(), StoreError> {
        let done = self.inner.mark_unknown(id, token, retention, reason);
        self.inner.flush_evicted();
        done
    }

    async fn mark_notified(&self, id: &RecordId) -> Result<(), StoreError> {
        self.inner.mark_notified(id);
        Ok(())
    }

    fn reconciled(&self) -> bool {
        self.inner.reconcilers.any()
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.inner.get(id)
    }

    /// Waits on the record's notifier until it is completed, released, marked unknown
    /// or taken over, its lease expires, or `max` passes, whichever comes first.
    async fn wait(&self, id: &RecordId, max: Duration) -> Result<(), StoreError> {
        if let Some((notified, until)) = self.inner.waiter(id, max) {
            // Woken or timed out: either way the caller looks again.
            let _ = tokio::time::timeout_at(until, notified).await;
        }
        Ok(())
    }
}
