//! [`MemoryStore`]: the store, its settings and its [`IdempotencyStore`] implementation.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use moka::notification::RemovalCause;
use moka::policy::{EvictionPolicy, Expiry};
use moka::sync::Cache;
use retrysafe_core::__private::Validate;
use retrysafe_core::ConfigError;
use retrysafe_core::idempotency::{
    CommitPoint, Completed, Fingerprint, InProgress, OutcomeUnknown, Record, RecordId, Token,
};
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, RESEND_WINDOW, StoreError};
use tokio::sync::{Notify, futures::OwnedNotified};
use tokio::time::Instant;

/// The number of in-flight shards (selected by the first byte of the record id, which
/// is a SHA-256 and so uniform).
const SHARDS: usize = 16;

/// Durations longer than this (a century) are clamped, so that instant arithmetic
/// cannot overflow.
const MAX_SPAN: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// How long after a record's own expiry moka may keep it before collecting it. moka
/// measures real time; the record's expiry (tokio time) is what counts.
const GC_MARGIN: Duration = Duration::from_secs(60);

/// The size of a cache key: a [`RecordId`].
const KEY_BYTES: u64 = 32;

/// The record bytes of a cache entry. An `Arc<[u8]>`, not `Bytes`: moka clones the
/// value on insert and on every read, and cloning a `Bytes` made from a `Vec` allocates
/// a shared header for good, on top of a handle twice the size (see
/// [`MemoryStore::ENTRY_OVERHEAD`]).
type Blob = Arc<[u8]>;

type HookFn = dyn Fn(&RecordId) + Send + Sync + 'static;
type Shard = Mutex<HashMap<RecordId, InFlight>>;

/// The embedded default [`IdempotencyStore`]: in memory, for one process.
///
/// - In-flight claims live in a bounded map that is never evicted: at
///   [`max_in_flight`](Self::max_in_flight) live claims a new claim gets
///   [`StoreError::Full`] (the layer answers 503). Before refusing, the store sweeps
///   claims whose lease has expired: one whose holder had not reached its commit point
///   is dropped, any other becomes `outcome_unknown` for the retention of its claim.
/// - Completed and `outcome_unknown` records live in a moka cache with LRU eviction,
///   bounded by [`max_bytes`](Self::max_bytes). A record weighs its
///   encoded length ([`Record::encoded_len`]) plus the 32-byte key plus
///   [`ENTRY_OVERHEAD`](Self::ENTRY_OVERHEAD), the measured cost of the cache's own
///   structures, so that the bound holds the store's real memory (plus a fixed part of
///   well under a megabyte). A record evicted before its retention ends is reported to
///   the [`on_evicted`](Self::on_evicted) hook.
/// - Each record keeps its own expiry in tokio time, checked on every read; moka's
///   expiry (real time, retention plus a minute) only collects garbage. Leases are tokio
///   time too, and [`InProgress::lease_until_ms`] counts milliseconds since the store
///   was created.
/// - Repeated calls are recognised as the store trait describes: a completion that
///   finds the same completed record succeeds, and the token of each release or
///   `mark_unknown` is kept for
///   [`RESEND_WINDOW`](retrysafe_core::store::RESEND_WINDOW) (about 60 bytes per release
///   in that window) so that the same call sent again succeeds.
/// - Every change to one record happens under that record's shard lock, so a claim sees
///   the in-flight map and the cache in one step. Waiters are woken by a notifier per
///   in-flight record (or when its lease expires).
///
/// Cloning is cheap and shares the store.
///
/// # Settings
///
/// [`new`](Self::new) (or `default`) gives a store with the documented defaults. The
/// setters ([`max_in_flight`](Self::max_in_flight), [`max_bytes`](Self::max_bytes),
/// [`on_evicted`](Self::on_evicted)) take and return the store and never fail;
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
/// use retrysafe_core::wire::IdempotencyKey;
/// use retrysafe_memory::MemoryStore;
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
    inner: Arc<Inner>,
}

impl MemoryStore {
    /// The default bound of the in-flight map: 10 000 claims.
    pub const DEFAULT_MAX_IN_FLIGHT: usize = 10_000;

    /// The default byte bound of the completed-record cache: 64 MiB.
    pub const DEFAULT_MAX_BYTES: u64 = 64 * 1024 * 1024;

    /// The bytes a cached record costs beyond its encoded length and its 32-byte key,
    /// measured with a counting allocator (`benches/memory.rs`; glibc malloc, 64-bit):
    /// moka's per-entry structures (the key's `Arc`, the hash-table bucket and its share
    /// of the bucket arrays, the entry and its policy information, the LRU and
    /// timer-wheel nodes: seven allocations), the store's 32-byte value inside moka's
    /// entry, the reference counts in front of the record's own allocation, and
    /// malloc's chunk headers and rounding.
    ///
    /// From 10 000 to 1 000 000 records, with bodies of 1 B to 16 KiB, that is 391 to
    /// 424 bytes per record, the most at 10 000 records for record sizes that round up
    /// worst; this constant is above all of them, so that the weight
    /// [`max_bytes`](Self::max_bytes) bounds is not less than the memory
    /// the records hold. A store also holds a fixed 0.1 to 0.3 MB of its own (the cache's
    /// tables and buffers) that no record's weight carries.
    pub const ENTRY_OVERHEAD: u64 = 440;

    /// A store with the default bounds and no eviction hook.
    ///
    /// ```
    /// use retrysafe_memory::MemoryStore;
    /// let store = MemoryStore::new()
    ///     .max_in_flight(2_048)
    ///     .max_bytes(256 << 20)
    ///     .on_evicted(|id| eprintln!("record {id:?} evicted before its retention"))
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

    /// The byte bound of the completed-record cache (default 64 MiB), weighed as
    /// described on [`MemoryStore`]. The least recently used records are evicted past
    /// it; a record heavier than the whole bound cannot be kept at all. Must be greater
    /// than zero.
    pub fn max_bytes(self, max: u64) -> Self {
        self.configure(|s| s.max_bytes = max)
    }

    /// A hook called with the id of each completed or `outcome_unknown` record evicted
    /// for size before its retention ended (not on expiry, replacement or removal).
    ///
    /// It is called after the store call during which the cache evicted the record,
    /// outside the store's locks; it should be quick and must not panic.
    pub fn on_evicted(self, hook: impl Fn(&RecordId) + Send + Sync + 'static) -> Self {
        self.configure(|s| s.on_evicted = Some(Arc::new(hook)))
    }

    /// Validates the settings: refuses a zero [`max_in_flight`](Self::max_in_flight) and
    /// a zero [`max_bytes`](Self::max_bytes), naming every refused one.
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
        v.finish(self)
    }

    /// The number of in-flight claims held (live or with an expired lease not yet
    /// resolved).
    pub fn in_flight_len(&self) -> usize {
        self.inner.in_flight.load(Ordering::Acquire)
    }

    /// The weighted size of the completed-record cache in bytes (see
    /// [`ENTRY_OVERHEAD`](Self::ENTRY_OVERHEAD)), after running the cache's pending
    /// maintenance so that it is accurate. Records past their retention that were not
    /// read since still count until collected.
    pub fn cached_bytes(&self) -> u64 {
        self.inner.sync_cache();
        self.inner.cache.weighted_size()
    }

    /// The number of records in the completed-record cache, after running its pending
    /// maintenance (as for [`cached_bytes`](Self::cached_bytes)).
    pub fn cached_len(&self) -> u64 {
        self.inner.sync_cache();
        self.inner.cache.entry_count()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

/// The settings of a store, as given (validated by [`MemoryStore::build`]).
#[derive(Clone)]
struct Settings {
    max_in_flight: usize,
    max_bytes: u64,
    on_evicted: Option<Arc<HookFn>>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            max_in_flight: MemoryStore::DEFAULT_MAX_IN_FLIGHT,
            max_bytes: MemoryStore::DEFAULT_MAX_BYTES,
            on_evicted: None,
        }
    }
}

/// One in-flight claim.
struct InFlight {
    token: Token,
    fingerprint: Fingerprint,
    commit_point: CommitPoint,
    lease_until: Instant,
    /// The retention of an `outcome_unknown` record made from this claim when a sweep
    /// finds its lease expired.
    retention: Duration,
    /// Created by the first waiter.
    notify: Option<Arc<Notify>>,
}

impl InFlight {
    fn new(claim: &Claim, now: Instant) -> Self {
        InFlight {
            token: claim.token,
            fingerprint: claim.fingerprint,
            commit_point: claim.commit_point,
            lease_until: after(now, claim.lease),
            retention: claim.retention,
            notify: None,
        }
    }

    fn record(&self, epoch: Instant) -> Record {
        Record::InProgress(InProgress::new(
            millis_since(epoch, self.lease_until),
            self.token,
            self.fingerprint,
            self.commit_point,
        ))
    }

    fn wake(&self) {
        if let Some(n) = &self.notify {
            n.notify_waiters();
        }
    }
}

/// The cache weight of an encoded record: its bytes, its key and the per-entry overhead.
fn weight_of(encoded: &[u8]) -> u64 {
    u64::try_from(encoded.len())
        .unwrap_or(u64::MAX)
        .saturating_add(KEY_BYTES)
        .saturating_add(MemoryStore::ENTRY_OVERHEAD)
}

/// A completed or `outcome_unknown` record in the cache: 32 bytes inside moka's entry,
/// so that the entry stays in a small allocation (the times are nanoseconds rather
/// than an `Instant` and a `Duration` of 16 bytes each).
#[derive(Clone)]
struct Cached {
    /// The encoded record ([`Record::encode`]).
    bytes: Blob,
    /// The end of its retention, in nanoseconds of tokio time since the store's epoch:
    /// absent from then on.
    expires_at: u64,
    /// When moka may collect it, in nanoseconds (its retention plus a margin, real
    /// time).
    gc_after: u64,
}

impl Cached {
    fn weight(&self) -> u32 {
        u32::try_from(weight_of(&self.bytes)).unwrap_or(u32::MAX)
    }
}

/// moka's per-entry expiry: garbage collection only.
struct GcAfter;

// moka's signature names `std::time::Instant`; it is not read here.
impl Expiry<RecordId, Cached> for GcAfter {
    fn expire_after_create(
        &self,
        _id: &RecordId,
        value: &Cached,
        _created_at: std::time::Instant,
    ) -> Option<Duration> {
        Some(Duration::from_nanos(value.gc_after))
    }

    fn expire_after_update(
        &self,
        _id: &RecordId,
        value: &Cached,
        _updated_at: std::time::Instant,
        _duration_until_expiry: Option<Duration>,
    ) -> Option<Duration> {
        Some(Duration::from_nanos(value.gc_after))
    }
}

/// The tokens that released a record or marked it `outcome_unknown`, each kept for
/// [`RESEND_WINDOW`], so that the same call sent again is recognised. Expired entries
/// are dropped whenever the map has doubled since the last pruning, so it holds about
/// the releases and marks of the last window.
#[derive(Default)]
struct Recent {
    tokens: HashMap<RecordId, (Token, Instant)>,
    prune_at: usize,
}

impl Recent {
    fn remember(&mut self, id: RecordId, token: Token, now: Instant) {
        if self.tokens.len() >= self.prune_at {
            self.tokens.retain(|_, (_, until)| *until > now);
            self.prune_at = (self.tokens.len() * 2).max(64);
        }
        self.tokens.insert(id, (token, after(now, RESEND_WINDOW)));
    }

    fn recalls(&self, id: &RecordId, token: Token, now: Instant) -> bool {
        matches!(self.tokens.get(id), Some((t, until)) if *t == token && *until > now)
    }
}

/// Ids of records the cache evicted early, waiting for the hook.
#[derive(Default)]
struct Evictions {
    pending: AtomicBool,
    ids: Mutex<Vec<RecordId>>,
}

impl Evictions {
    fn push(&self, id: RecordId) {
        lock(&self.ids).push(id);
        self.pending.store(true, Ordering::Release);
    }
}

struct Inner {
    shards: [Shard; SHARDS],
    /// Entries across all shards; changed only under the entry's shard lock.
    in_flight: AtomicUsize,
    /// A lower bound on the earliest lease end (milliseconds since `epoch`) among the
    /// in-flight entries: a full map is not swept before then, so refusing a claim stays
    /// cheap while every claim is live.
    sweep_after_ms: AtomicU64,
    cache: Cache<RecordId, Cached>,
    /// The tokens that recently released a record or marked it unknown. Locked after
    /// a shard lock, never before.
    recent: Mutex<Recent>,
    evictions: Arc<Evictions>,
    /// The bounds and the hook, as given.
    settings: Settings,
    epoch: Instant,
}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inner")
            .field("in_flight", &self.in_flight.load(Ordering::Relaxed))
            .field("max_in_flight", &self.settings.max_in_flight)
            .field("cached", &self.cache.entry_count())
            .field("max_bytes", &self.settings.max_bytes)
            .field("on_evicted", &self.settings.on_evicted.is_some())
            .finish_non_exhaustive()
    }
}

impl Inner {
    fn new(settings: Settings) -> Self {
        let evictions = Arc::new(Evictions::default());
        let epoch = Instant::now();
        let mut builder = Cache::builder()
            .max_capacity(settings.max_bytes)
            .eviction_policy(EvictionPolicy::lru())
            .weigher(|_id: &RecordId, value: &Cached| value.weight())
            .expire_after(GcAfter);
        {
            let evictions = Arc::clone(&evictions);
            builder = builder.eviction_listener(
                move |id: Arc<RecordId>, value: Cached, cause: RemovalCause| {
                    // Early means: for size, while the record was still current.
                    if cause == RemovalCause::Size
                        && value.expires_at > nanos_since(epoch, Instant::now())
                    {
                        evictions.push(*id);
                    }
                },
            );
        }
        Inner {
            shards: std::array::from_fn(|_| Mutex::new(HashMap::new())),
            in_flight: AtomicUsize::new(0),
            sweep_after_ms: AtomicU64::new(u64::MAX),
            cache: builder.build(),
            recent: Mutex::default(),
            evictions,
            settings,
            epoch,
        }
    }

    fn lock(&self, id: &RecordId) -> MutexGuard<'_, HashMap<RecordId, InFlight>> {
        let [first, ..] = &self.shards;
        let index = usize::from(id.as_bytes()[0]) % SHARDS;
        lock(self.shards.get(index).unwrap_or(first))
    }

    fn millis(&self, t: Instant) -> u64 {
        millis_since(self.epoch, t)
    }

    fn nanos(&self, t: Instant) -> u64 {
        nanos_since(self.epoch, t)
    }

    /// Takes one slot of the in-flight bound, if one is free.
    fn reserve_slot(&self) -> bool {
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.settings.max_in_flight).then_some(n + 1)
            })
            .is_ok()
    }

    fn free_slot(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    /// Records a new lease end for the sweep gate.
    fn lease_set(&self, lease_until: Instant) {
        self.sweep_after_ms
            .fetch_min(self.millis(lease_until), Ordering::Relaxed);
    }

    /// The unexpired cached record of `id`, encoded; an expired one is invalidated.
    /// Called under the id's shard lock (the caller decodes after releasing it).
    fn cached(&self, id: &RecordId, now: Instant) -> Option<Blob> {
        let cached = self.cache.get(id)?;
        if cached.expires_at <= self.nanos(now) {
            self.cache.invalidate(id);
            return None;
        }
        Some(cached.bytes)
    }

    /// What the cache keeps of an encoded record: a record heavier than the whole cache
    /// would be evicted at once and a retry would run again, so it keeps the small "not
    /// stored" marker instead.
    fn stored_form(&self, bytes: Blob) -> Blob {
        if weight_of(&bytes) <= self.settings.max_bytes {
            return bytes;
        }
        match Record::decode(Bytes::copy_from_slice(&bytes)) {
            Ok(Record::Completed(c)) => {
                blob(&Record::Completed(Completed::new(c.fingerprint, None)))
            }
            _ => bytes,
        }
    }

    /// Puts an encoded record (in its [stored form](Self::stored_form)) in the cache for
    /// `retention`. Called under the id's shard lock.
    fn put(&self, id: RecordId, bytes: Blob, now: Instant, retention: Duration) {
        let retention = retention.min(MAX_SPAN);
        self.cache.insert(
            id,
            Cached {
                bytes,
                expires_at: self.nanos(after(now, retention)),
                gc_after: saturating_nanos(retention + GC_MARGIN),
            },
        );
    }

    /// Removes the in-flight entry of `id` if `token` holds it, freeing its slot and
    /// waking its waiters.
    fn take_holder(
        &self,
        map: &mut HashMap<RecordId, InFlight>,
        id: &RecordId,
        token: Token,
    ) -> Result<InFlight, StoreError> {
        match map.get(id) {
            Some(entry) if entry.token == token => {}
            _ => return Err(StoreError::StaleToken),
        }
        let entry = map.remove(id).ok_or(StoreError::StaleToken)?;
        self.free_slot();
        entry.wake();
        Ok(entry)
    }

    fn claim(&self, id: &RecordId, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        let mut swept = false;
        loop {
            match self.try_claim(id, claim) {
                Found::Outcome(outcome) => return Ok(outcome),
                Found::Cached(bytes) => return decode(bytes).map(|r| existing(r, false)),
                Found::Full(now) => {
                    // Sweep expired leases (outside this shard's lock), then look again.
                    if swept || self.millis(now) < self.sweep_after_ms.load(Ordering::Relaxed) {
                        return Err(StoreError::Full);
                    }
                    self.sweep();
                    swept = true;
                }
            }
        }
    }

    /// One atomic step of a claim, under the id's shard lock.
    fn try_claim(&self, id: &RecordId, claim: &Claim) -> Found {
        let mut map = self.lock(id);
        let now = Instant::now();
        let Some(entry) = map.get_mut(id) else {
            if let Some(bytes) = self.cached(id, now) {
                return Found::Cached(bytes);
            }
            if !self.reserve_slot() {
                return Found::Full(now);
            }
            let entry = InFlight::new(claim, now);
            self.lease_set(entry.lease_until);
            map.insert(*id, entry);
            return Found::Outcome(ClaimOutcome::Claimed { takeover: false });
        };
        if now < entry.lease_until {
            let record = entry.record(self.epoch);
            if claim.holds(&record) {
                // The same claim again (its reply was lost): the caller holds it.
                return Found::Outcome(ClaimOutcome::Claimed { takeover: false });
            }
            return Found::Outcome(existing(record, false));
        }
        if entry.commit_point.allows_takeover() && entry.fingerprint == claim.fingerprint {
            // The holder stopped before its effect: this copy takes over and runs.
            let notify = entry.notify.take();
            *entry = InFlight {
                notify,
                ..InFlight::new(claim, now)
            };
            entry.wake();
            self.lease_set(entry.lease_until);
            return Found::Outcome(ClaimOutcome::Claimed { takeover: true });
        }
        if entry.fingerprint != claim.fingerprint {
            // Not this request's record: left for the rightful copy (or a sweep).
            return Found::Outcome(existing(entry.record(self.epoch), false));
        }
        // Past (or without) a commit point: the outcome cannot be known.
        let fingerprint = entry.fingerprint;
        if let Some(gone) = map.remove(id) {
            self.free_slot();
            gone.wake();
        }
        let record = unknown(fingerprint);
        self.put(*id, blob(&record), now, claim.retention);
        Found::Outcome(existing(record, true))
    }

    /// Resolves every in-flight entry whose lease has expired, one shard at a time:
    /// before the commit point it is dropped, otherwise it becomes `outcome_unknown` for
    /// its claim's retention.
    fn sweep(&self) {
        self.sweep_after_ms.store(u64::MAX, Ordering::Relaxed);
        let mut earliest = u64::MAX;
        let mut resolved = 0usize;
        for shard in &self.shards {
            let mut map = lock(shard);
            let now = Instant::now();
            let mut expired = Vec::new();
            map.retain(|id, entry| {
                if entry.lease_until <= now {
                    expired.push((*id, entry.fingerprint, entry.commit_point, entry.retention));
                    entry.wake();
                    false
                } else {
                    earliest = earliest.min(self.millis(entry.lease_until));
                    true
                }
            });
            for (id, fingerprint, commit_point, retention) in expired {
                self.free_slot();
                resolved += 1;
                if !commit_point.allows_takeover() {
                    tracing::warn!(
                        record = ?id,
                        "in-flight claim expired past its commit point: outcome_unknown"
                    );
                    self.put(id, blob(&unknown(fingerprint)), now, retention);
                }
            }
        }
        self.sweep_after_ms.fetch_min(earliest, Ordering::Relaxed);
        tracing::debug!(resolved, "swept expired in-flight claims");
    }

    fn complete(
        &self,
        id: &RecordId,
        token: Token,
        record: &Completed,
        retention: Duration,
    ) -> Result<(), StoreError> {
        // Encoded outside the lock: it copies the body.
        let bytes = self.stored_form(blob(&Record::Completed(record.clone())));
        let mut map = self.lock(id);
        let now = Instant::now();
        match self.take_holder(&mut map, id, token) {
            Ok(_) => {
                self.put(*id, bytes, now, retention);
                Ok(())
            }
            // The same completion again (its reply was lost): already done.
            Err(_) if self.cached(id, now).is_some_and(|c| c[..] == bytes[..]) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn release(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        let mut map = self.lock(id);
        let now = Instant::now();
        match self.take_holder(&mut map, id, token) {
            Ok(_) => {
                lock(&self.recent).remember(*id, token, now);
                Ok(())
            }
            // The same release again (its reply was lost): the record is still absent.
            Err(_)
                if !map.contains_key(id)
                    && self.cached(id, now).is_none()
                    && lock(&self.recent).recalls(id, token, now) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    fn renew(&self, id: &RecordId, token: Token, lease: Duration) -> Result<(), StoreError> {
        let mut map = self.lock(id);
        let entry = holder(&mut map, id, token)?;
        entry.lease_until = after(Instant::now(), lease);
        self.lease_set(entry.lease_until);
        Ok(())
    }

    fn commit_point(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        let mut map = self.lock(id);
        holder(&mut map, id, token)?.commit_point = CommitPoint::Passed;
        Ok(())
    }

    fn mark_unknown(
        &self,
        id: &RecordId,
        token: Token,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let mut map = self.lock(id);
        let now = Instant::now();
        let gone = match self.take_holder(&mut map, id, token) {
            Ok(gone) => gone,
            // The same mark again (its reply was lost): the record is still unknown.
            Err(_)
                if self.cached(id, now).is_some_and(|c| is_unknown(&c))
                    && lock(&self.recent).recalls(id, token, now) =>
            {
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        lock(&self.recent).remember(*id, token, now);
        self.put(*id, blob(&unknown(gone.fingerprint)), now, retention);
        Ok(())
    }

    fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let bytes = {
            let map = self.lock(id);
            if let Some(entry) = map.get(id) {
                return Ok(Some(entry.record(self.epoch)));
            }
            self.cached(id, Instant::now())
        };
        bytes.map(decode).transpose()
    }

    /// A notification of the in-flight record of `id` and when to stop waiting for it
    /// (its lease end, or `max` from now); `None` when there is nothing to wait for.
    fn waiter(&self, id: &RecordId, max: Duration) -> Option<(OwnedNotified, Instant)> {
        let mut map = self.lock(id);
        let entry = map.get_mut(id)?;
        let now = Instant::now();
        if entry.lease_until <= now {
            return None;
        }
        let until = entry.lease_until.min(after(now, max));
        let notify = Arc::clone(entry.notify.get_or_insert_with(Arc::default));
        // A `Notified` receives every `notify_waiters` from its creation on, even before
        // it is polled; it is created under the lock, under which every wake-up happens,
        // so none is missed.
        Some((notify.notified_owned(), until))
    }

    /// Runs the cache's pending maintenance (evictions included).
    fn sync_cache(&self) {
        self.cache.run_pending_tasks();
        // One run applies what is queued; repeat a little if it left the cache over.
        for _ in 0..4 {
            if self.cache.weighted_size() <= self.settings.max_bytes {
                break;
            }
            self.cache.run_pending_tasks();
        }
        self.flush_evicted();
    }

    /// Calls the hook for records the cache evicted early (outside every store lock).
    fn flush_evicted(&self) {
        if !self.evictions.pending.load(Ordering::Acquire)
            || !self.evictions.pending.swap(false, Ordering::AcqRel)
        {
            return;
        }
        let ids = std::mem::take(&mut *lock(&self.evictions.ids));
        for id in &ids {
            tracing::warn!(
                target: "retrysafe::idempotency",
                event = "evicted",
                record = ?id,
                "completed idempotency record evicted before its retention (MemoryStore max_bytes)"
            );
            if let Some(hook) = &self.settings.on_evicted {
                hook(id);
            }
        }
    }
}

impl IdempotencyStore for MemoryStore {
    async fn claim(&self, id: &RecordId, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
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
        self.inner.commit_point(id, token)
    }

    async fn mark_unknown(
        &self,
        id: &RecordId,
        token: Token,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let done = self.inner.mark_unknown(id, token, retention);
        self.inner.flush_evicted();
        done
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let record = self.inner.get(id);
        self.inner.flush_evicted();
        record
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

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The critical sections do not panic; should one ever, its data is still whole.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The entry of `id` if `token` holds it.
fn holder<'m>(
    map: &'m mut HashMap<RecordId, InFlight>,
    id: &RecordId,
    token: Token,
) -> Result<&'m mut InFlight, StoreError> {
    map.get_mut(id)
        .filter(|entry| entry.token == token)
        .ok_or(StoreError::StaleToken)
}

/// What one step of a claim found.
enum Found {
    /// The answer.
    Outcome(ClaimOutcome),
    /// A cached record, still to be decoded (outside the lock).
    Cached(Blob),
    /// No free slot (at this instant).
    Full(Instant),
}

/// Encodes a record into one allocation for the cache.
fn blob(record: &Record) -> Blob {
    // `Record::encode` writes a `Bytes` of exactly the encoded length; the copy into the
    // `Arc` (its counts in front) is one `memcpy` of the record per store.
    Blob::from(&record.encode()[..])
}

/// Decodes a cached record. Its body shares the cache's allocation (no copy).
fn decode(bytes: Blob) -> Result<Record, StoreError> {
    Record::decode(Bytes::from_owner(bytes)).map_err(StoreError::Corrupt)
}

fn existing(record: Record, became_unknown: bool) -> ClaimOutcome {
    ClaimOutcome::Existing {
        record,
        became_unknown,
    }
}

/// Whether an encoded record is `outcome_unknown`.
fn is_unknown(bytes: &Blob) -> bool {
    matches!(
        Record::decode(Bytes::copy_from_slice(bytes)),
        Ok(Record::OutcomeUnknown(_))
    )
}

fn unknown(fingerprint: Fingerprint) -> Record {
    Record::OutcomeUnknown(OutcomeUnknown::new(fingerprint))
}

fn after(now: Instant, d: Duration) -> Instant {
    now + d.min(MAX_SPAN)
}

fn millis_since(epoch: Instant, t: Instant) -> u64 {
    u64::try_from(t.saturating_duration_since(epoch).as_millis()).unwrap_or(u64::MAX)
}

/// Nanoseconds from `epoch` to `t`: enough for 584 years, and durations are clamped
/// to a century.
fn nanos_since(epoch: Instant, t: Instant) -> u64 {
    saturating_nanos(t.saturating_duration_since(epoch))
}

fn saturating_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
