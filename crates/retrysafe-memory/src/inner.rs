//! The state shared by the clones of a store, and every atomic step on it.

use std::collections::HashMap;

use retrysafe_core::__private::{DigestHash, encode_completed};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use retrysafe_core::__private::Reconcilers;
use retrysafe_core::idempotency::{
    CommitPoint, Completed, Fingerprint, InProgress, OutcomeUnknown, Record, RecordId, RequestInfo,
    Resolving, Token, UnknownReason,
};
use retrysafe_core::store::{Claim, ClaimOutcome, MAX_NOTE, RESEND_WINDOW, StoreError};
use tokio::sync::{Notify, futures::OwnedNotified};
use tokio::time::Instant;

use crate::MemoryStore;
use crate::eviction::{Eviction, EvictionKind};
use crate::retained::{Adoption, Blob, Bounds, Found as Kept, Gauges, Pending, Report, Retained};
use retrysafe_core::observe::Name;

/// The number of in-flight shards (selected by the first byte of the record id, which
/// is a SHA-256 and so uniform).
const SHARDS: usize = 16;

/// Durations longer than this (a century) are clamped, so that instant arithmetic
/// cannot overflow.
const MAX_SPAN: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// The share of `max_bytes` given to tombstones: one part in this many.
const TOMBSTONE_SHARE: u64 = 4;

pub(crate) type HookFn = dyn Fn(&RecordId) + Send + Sync + 'static;
pub(crate) type EvictionFn = dyn Fn(&Eviction) + Send + Sync + 'static;
/// The in-flight claims of one shard, by record id.
pub(crate) type Claims = HashMap<RecordId, InFlight, DigestHash>;
type Shard = Mutex<Claims>;

/// The settings of a store, as given (validated by [`MemoryStore::build`]).
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) max_in_flight: usize,
    pub(crate) max_bytes: u64,
    pub(crate) on_evicted: Option<Arc<HookFn>>,
    pub(crate) on_eviction: Option<Arc<EvictionFn>>,
    pub(crate) fail_closed: bool,
    pub(crate) name: Name,
    /// Resolved by `build`.
    pub(crate) gauges: Gauges,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            max_in_flight: MemoryStore::DEFAULT_MAX_IN_FLIGHT,
            max_bytes: MemoryStore::DEFAULT_MAX_BYTES,
            on_evicted: None,
            on_eviction: None,
            fail_closed: false,
            name: Name::default(),
            gauges: Gauges::default(),
        }
    }
}

/// One in-flight claim.
pub(crate) struct InFlight {
    pub(crate) token: Token,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) commit_point: CommitPoint,
    pub(crate) lease_until: Instant,
    /// The retention of an `outcome_unknown` record made from this claim when its lease
    /// is found expired.
    pub(crate) retention: Duration,
    /// Created by the first waiter.
    notify: Option<Arc<Notify>>,
    pub(crate) scope: u64,
    pub(crate) claimed_ms: u64,
    pub(crate) request: Option<Arc<RequestInfo>>,
    pub(crate) note: Option<Bytes>,
    pub(crate) adoption: Option<Adoption>,
}

impl InFlight {
    fn new(claim: &Claim<'_>, now: Instant, now_ms: u64) -> Self {
        InFlight {
            token: claim.token,
            fingerprint: claim.fingerprint,
            commit_point: claim.commit_point,
            lease_until: after(now, claim.lease),
            retention: claim.retention,
            notify: None,
            scope: scope_of(claim.request),
            claimed_ms: now_ms,
            request: claim.request.map(|r| Arc::new(r.clone())),
            note: None,
            adoption: None,
        }
    }

    fn record(&self, epoch: Instant, now_ms: u64) -> Record {
        if let Some(a) = self.adopted(now_ms) {
            return Record::Resolving(Resolving::new(self.fingerprint, a.until_ms));
        }
        Record::InProgress(InProgress::new(
            millis_since(epoch, self.lease_until),
            self.token,
            self.fingerprint,
            self.commit_point,
        ))
    }

    /// The live adoption, if a reconciler holds this claim.
    pub(crate) fn adopted(&self, now_ms: u64) -> Option<Adoption> {
        self.adoption.filter(|a| a.live(now_ms))
    }

    pub(crate) fn wake(&self) {
        if let Some(n) = &self.notify {
            n.notify_waiters();
        }
    }

    /// What an `outcome_unknown` record made from this claim keeps for a reconciler;
    /// `lease_ended_ms` when it is made because the claim's lease ended.
    pub(crate) fn pending(
        &self,
        reason: UnknownReason,
        notified: bool,
        due_ms: u64,
        lease_ended_ms: Option<u64>,
    ) -> Box<Pending> {
        Box::new(Pending {
            fingerprint: self.fingerprint,
            reason: Some(reason),
            notified,
            due_ms,
            claimed_ms: self.claimed_ms,
            lease_ended_ms,
            request: self.request.clone(),
            note: self.note.clone(),
            adoption: None,
        })
    }
}

/// The scope of a claim, as the fairness sketch counts it: 0 without request
/// information (one anonymous scope).
fn scope_of(request: Option<&RequestInfo>) -> u64 {
    request.map_or(0, |r| {
        let mut head = [0u8; 8];
        head.copy_from_slice(&r.scope.as_bytes()[..8]);
        u64::from_le_bytes(head).max(1)
    })
}

/// The tokens that released a record, marked it `outcome_unknown` or settled it, each
/// kept for [`RESEND_WINDOW`], so that the same call sent again is recognised. Expired
/// entries are dropped whenever the map has doubled since the last pruning, so it holds
/// about the calls of the last window.
#[derive(Default)]
pub(crate) struct Recent {
    tokens: HashMap<RecordId, (Token, Instant), DigestHash>,
    prune_at: usize,
}

impl Recent {
    pub(crate) fn remember(&mut self, id: RecordId, token: Token, now: Instant) {
        if self.tokens.len() >= self.prune_at {
            self.tokens.retain(|_, (_, until)| *until > now);
            self.prune_at = (self.tokens.len() * 2).max(64);
        }
        self.tokens.insert(id, (token, after(now, RESEND_WINDOW)));
    }

    pub(crate) fn recalls(&self, id: &RecordId, token: Token, now: Instant) -> bool {
        matches!(self.tokens.get(id), Some((t, until)) if *t == token && *until > now)
    }
}

/// Ids of records shrunk to tombstones or forgotten early, waiting for the hooks.
#[derive(Default)]
struct Evictions {
    pending: AtomicBool,
    ids: Mutex<Vec<(RecordId, EvictionKind)>>,
}

/// What a claim found among the kept records.
pub(crate) enum Found {
    /// The answer.
    Outcome(ClaimOutcome),
    /// A kept record, still to be decoded (outside the lock).
    Kept(Blob),
    /// No free slot (at this instant).
    Full(Instant),
    /// A fail-closed store whose tombstones are full.
    Refused,
}

pub(crate) struct Inner {
    shards: [Shard; SHARDS],
    /// Entries across all shards; changed only under the entry's shard lock.
    in_flight: AtomicUsize,
    /// A lower bound on the earliest lease end (milliseconds since `epoch`) among the
    /// in-flight entries: a full map is not swept before then, so refusing a claim stays
    /// cheap while every claim is live.
    sweep_after_ms: AtomicU64,
    /// The completed and `outcome_unknown` records and the tombstones. Locked after a
    /// shard lock, never before.
    retained: Mutex<Retained>,
    /// The tokens that recently released, marked or settled a record. Locked after a
    /// shard lock, never before.
    recent: Mutex<Recent>,
    evictions: Evictions,
    pub(crate) reconcilers: Reconcilers,
    /// The bounds and the hook, as given.
    pub(crate) settings: Settings,
    epoch: Instant,
}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inner")
            .field("in_flight", &self.in_flight.load(Ordering::Relaxed))
            .field("max_in_flight", &self.settings.max_in_flight)
            .field("max_bytes", &self.settings.max_bytes)
            .field("fail_closed", &self.settings.fail_closed)
            .field("on_evicted", &self.settings.on_evicted.is_some())
            .finish_non_exhaustive()
    }
}

impl Inner {
    pub(crate) fn new(settings: Settings) -> Self {
        let bounds = bounds(&settings);
        Inner {
            shards: std::array::from_fn(|_| Mutex::new(Claims::default())),
            in_flight: AtomicUsize::new(0),
            sweep_after_ms: AtomicU64::new(u64::MAX),
            retained: Mutex::new(Retained::new(
                bounds,
                settings.gauges.clone(),
                settings.on_eviction.is_some(),
            )),
            recent: Mutex::default(),
            evictions: Evictions::default(),
            reconcilers: Reconcilers::default(),
            settings,
            epoch: Instant::now(),
        }
    }

    pub(crate) fn bounds(&self) -> Bounds {
        bounds(&self.settings)
    }

    pub(crate) fn lock(&self, id: &RecordId) -> MutexGuard<'_, Claims> {
        let [first, ..] = &self.shards;
        let index = usize::from(id.as_bytes()[0]) % SHARDS;
        lock(self.shards.get(index).unwrap_or(first))
    }

    pub(crate) fn shards(&self) -> impl Iterator<Item = &Shard> {
        self.shards.iter()
    }

    pub(crate) fn retained(&self) -> MutexGuard<'_, Retained> {
        lock(&self.retained)
    }

    pub(crate) fn recent(&self) -> MutexGuard<'_, Recent> {
        lock(&self.recent)
    }

    pub(crate) fn millis(&self, t: Instant) -> u64 {
        millis_since(self.epoch, t)
    }

    pub(crate) fn in_flight_len(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Bytes, records and tombstones kept.
    pub(crate) fn retained_stats(&self) -> (u64, u64, u64) {
        let r = self.retained();
        (r.bytes(), r.len() as u64, r.tombstones() as u64)
    }

    pub(crate) fn effective_retention(&self) -> Option<Duration> {
        let now_ms = self.millis(Instant::now());
        self.retained()
            .effective_retention_ms(now_ms)
            .map(Duration::from_millis)
    }

    /// Takes one slot of the in-flight bound, if one is free.
    fn reserve_slot(&self) -> bool {
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.settings.max_in_flight).then_some(n + 1)
            })
            .is_ok()
    }

    pub(crate) fn free_slot(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    /// Records a new lease end for the sweep gate.
    fn lease_set(&self, lease_until: Instant) {
        let ms = self.millis(lease_until);
        // A new lease seldom ends first: reading first leaves the line shared between
        // the threads that claim, where an update would take it from them every time.
        if ms < self.sweep_after_ms.load(Ordering::Relaxed) {
            self.sweep_after_ms.fetch_min(ms, Ordering::Relaxed);
        }
    }

    /// The kept record of `id` (a record being resolved, a completed or unknown record,
    /// or the trace of an evicted one), encoded. Called under the id's shard lock (the
    /// caller decodes after releasing it).
    pub(crate) fn kept(&self, id: &RecordId, now_ms: u64) -> Option<Blob> {
        kept_in(&mut self.retained(), id, now_ms)
    }

    /// Whether `id` is kept as an `outcome_unknown` record.
    pub(crate) fn is_unknown(&self, id: &RecordId, now_ms: u64) -> bool {
        self.retained()
            .peek_mut(id, now_ms)
            .is_some_and(|e| e.pending.is_some())
    }

    /// What is kept of an encoded completed record: a response heavier than the whole
    /// record bound would be shrunk at once, so only the "not stored" marker is kept.
    fn stored_form(&self, bytes: Blob) -> Blob {
        if crate::retained::weight(&bytes, None) <= self.bounds().records {
            return bytes;
        }
        match Record::decode(Bytes::copy_from_slice(&bytes)) {
            Ok(Record::Completed(c)) => {
                blob(&Record::Completed(Completed::new(c.fingerprint, None)))
            }
            _ => bytes,
        }
    }

    /// Keeps an encoded record for `retention`. Called under the id's shard lock.
    pub(crate) fn put(
        &self,
        id: RecordId,
        bytes: Blob,
        now: Instant,
        retention: Duration,
        scope: u64,
        pending: Option<Box<Pending>>,
    ) {
        let now_ms = self.millis(now);
        let expires_ms = self.millis(after(now, retention));
        let report = self
            .retained()
            .insert(id, bytes, expires_ms, scope, pending, now_ms);
        self.queue_evicted(report);
    }

    fn queue_evicted(&self, report: Report) {
        if report.dropped.is_empty() && report.shrunk.is_empty() {
            return;
        }
        // Forgotten keys with no hook to tell and no subscriber for their warning: no
        // queue to fill (under a sustained overflow, that is every new key).
        if report.shrunk.is_empty()
            && self.settings.on_evicted.is_none()
            && self.settings.on_eviction.is_none()
            && !tracing::enabled!(target: "retrysafe::idempotency", tracing::Level::WARN)
        {
            return;
        }
        let shrunk = report
            .shrunk
            .into_iter()
            .map(|id| (id, EvictionKind::Tombstoned));
        let dropped = report
            .dropped
            .into_iter()
            .map(|id| (id, EvictionKind::Forgotten));
        lock(&self.evictions.ids).extend(shrunk.chain(dropped));
        self.evictions.pending.store(true, Ordering::Release);
    }

    /// Removes the in-flight entry of `id` if `token` holds it (and no reconciler does),
    /// freeing its slot and waking its waiters.
    fn take_holder(
        &self,
        map: &mut Claims,
        id: &RecordId,
        token: Token,
        now_ms: u64,
    ) -> Result<InFlight, StoreError> {
        holder(map, id, token, now_ms)?;
        let entry = map.remove(id).ok_or(StoreError::StaleToken)?;
        self.free_slot();
        entry.wake();
        Ok(entry)
    }

    /// Removes the in-flight entry of `id` whatever holds it.
    pub(crate) fn take(&self, map: &mut Claims, id: &RecordId) -> Option<InFlight> {
        let entry = map.remove(id)?;
        self.free_slot();
        entry.wake();
        Some(entry)
    }

    pub(crate) fn claim(
        &self,
        id: &RecordId,
        claim: &Claim<'_>,
    ) -> Result<ClaimOutcome, StoreError> {
        let mut swept = false;
        loop {
            match self.try_claim(id, claim) {
                Found::Outcome(outcome) => return Ok(outcome),
                Found::Kept(bytes) => return decode(bytes).map(|r| existing(r, false)),
                Found::Refused => return Err(StoreError::Full),
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
    fn try_claim(&self, id: &RecordId, claim: &Claim<'_>) -> Found {
        let mut map = self.lock(id);
        let now = Instant::now();
        let now_ms = self.millis(now);
        let Some(entry) = map.get_mut(id) else {
            {
                // One acquisition of the records' lock for both questions.
                let mut r = self.retained();
                if let Some(bytes) = kept_in(&mut r, id, now_ms) {
                    return Found::Kept(bytes);
                }
                if r.refuses_new() {
                    return Found::Refused;
                }
            }
            if !self.reserve_slot() {
                return Found::Full(now);
            }
            let entry = InFlight::new(claim, now, now_ms);
            self.lease_set(entry.lease_until);
            map.insert(*id, entry);
            return Found::Outcome(ClaimOutcome::Claimed { takeover: false });
        };
        if now < entry.lease_until || entry.adopted(now_ms).is_some() {
            let record = entry.record(self.epoch, now_ms);
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
                ..InFlight::new(claim, now, now_ms)
            };
            entry.wake();
            self.lease_set(entry.lease_until);
            return Found::Outcome(ClaimOutcome::Claimed { takeover: true });
        }
        if entry.fingerprint != claim.fingerprint {
            // Not this request's record: left for the rightful copy (or a sweep).
            return Found::Outcome(existing(entry.record(self.epoch, now_ms), false));
        }
        // Past (or without) a commit point: the outcome cannot be known.
        let Some(gone) = self.take(&mut map, id) else {
            return Found::Outcome(existing(unknown(claim.fingerprint), true));
        };
        let record = unknown(gone.fingerprint);
        let ended = Some(self.millis(gone.lease_until));
        let pending = gone.pending(UnknownReason::LeaseExpired, false, now_ms, ended);
        self.put(
            *id,
            blob(&record),
            now,
            gone.retention,
            gone.scope,
            Some(pending),
        );
        Found::Outcome(existing(record, true))
    }

    /// Resolves every in-flight entry whose lease has expired (and that no reconciler
    /// holds), one shard at a time: before the commit point it is dropped, otherwise it
    /// becomes `outcome_unknown` for its claim's retention, not yet notified.
    fn sweep(&self) {
        self.sweep_after_ms.store(u64::MAX, Ordering::Relaxed);
        let mut earliest = u64::MAX;
        let mut resolved = 0usize;
        for shard in &self.shards {
            let mut map = lock(shard);
            let now = Instant::now();
            let now_ms = self.millis(now);
            let mut expired = Vec::new();
            map.retain(|id, entry| {
                if entry.lease_until <= now && entry.adopted(now_ms).is_none() {
                    entry.wake();
                    expired.push((
                        *id,
                        entry.pending(
                            UnknownReason::LeaseExpired,
                            false,
                            now_ms,
                            Some(self.millis(entry.lease_until)),
                        ),
                        entry.commit_point,
                        entry.retention,
                        entry.scope,
                    ));
                    false
                } else {
                    let next = entry
                        .adopted(now_ms)
                        .map_or(self.millis(entry.lease_until), |a| a.until_ms);
                    earliest = earliest.min(next);
                    true
                }
            });
            for (id, pending, commit_point, retention, scope) in expired {
                self.free_slot();
                resolved += 1;
                if !commit_point.allows_takeover() {
                    tracing::warn!(
                        target: "retrysafe::idempotency",
                        name = self.settings.name.as_str(),
                        record = ?id,
                        "in-flight claim expired past its commit point: outcome_unknown"
                    );
                    let record = blob(&unknown(pending.fingerprint));
                    self.put(id, record, now, retention, scope, Some(pending));
                }
            }
        }
        self.sweep_after_ms.fetch_min(earliest, Ordering::Relaxed);
        tracing::debug!(
            target: "retrysafe::idempotency",
            name = self.settings.name.as_str(),
            resolved,
            "swept expired in-flight claims"
        );
    }

    pub(crate) fn complete(
        &self,
        id: &RecordId,
        token: Token,
        record: &Completed,
        retention: Duration,
    ) -> Result<(), StoreError> {
        // Encoded outside the lock: it copies the body.
        let bytes = self.stored_form(Blob::from(&encode_completed(record)[..]));
        let mut map = self.lock(id);
        let now = Instant::now();
        let now_ms = self.millis(now);
        match self.take_holder(&mut map, id, token, now_ms) {
            Ok(gone) => {
                self.put(*id, bytes, now, retention, gone.scope, None);
                Ok(())
            }
            // The same completion again (its reply was lost): already done.
            Err(_) if self.kept(id, now_ms).is_some_and(|c| c[..] == bytes[..]) => Ok(()),
            Err(e) => Err(e),
        }
    }

    pub(crate) fn release(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        let mut map = self.lock(id);
        let now = Instant::now();
        let now_ms = self.millis(now);
        match self.take_holder(&mut map, id, token, now_ms) {
            Ok(_) => {
                self.recent().remember(*id, token, now);
                Ok(())
            }
            // The same release again (its reply was lost): the record is still absent.
            Err(_)
                if !map.contains_key(id)
                    && self.kept(id, now_ms).is_none()
                    && self.recent().recalls(id, token, now) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    pub(crate) fn renew(
        &self,
        id: &RecordId,
        token: Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let mut map = self.lock(id);
        let now = Instant::now();
        let entry = holder(&mut map, id, token, self.millis(now))?;
        entry.lease_until = after(now, lease);
        self.lease_set(entry.lease_until);
        Ok(())
    }

    pub(crate) fn commit_point(
        &self,
        id: &RecordId,
        token: Token,
        note: Option<&[u8]>,
    ) -> Result<(), StoreError> {
        let mut map = self.lock(id);
        let entry = holder(&mut map, id, token, self.millis(Instant::now()))?;
        entry.commit_point = CommitPoint::Passed;
        if let Some(note) = note {
            entry.note = Some(Bytes::copy_from_slice(note.get(..MAX_NOTE).unwrap_or(note)));
        }
        Ok(())
    }

    pub(crate) fn mark_unknown(
        &self,
        id: &RecordId,
        token: Token,
        retention: Duration,
        reason: UnknownReason,
    ) -> Result<(), StoreError> {
        let mut map = self.lock(id);
        let now = Instant::now();
        let now_ms = self.millis(now);
        let gone = match self.take_holder(&mut map, id, token, now_ms) {
            Ok(gone) => gone,
            // The same mark again (its reply was lost): the record is still unknown.
            Err(_) if self.is_unknown(id, now_ms) && self.recent().recalls(id, token, now) => {
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        self.recent().remember(*id, token, now);
        let pending = gone.pending(reason, false, now_ms, None);
        self.put(
            *id,
            blob(&unknown(gone.fingerprint)),
            now,
            retention,
            gone.scope,
            Some(pending),
        );
        Ok(())
    }

    pub(crate) fn mark_notified(&self, id: &RecordId) {
        let _map = self.lock(id);
        let now_ms = self.millis(Instant::now());
        if let Some(p) = self
            .retained()
            .peek_mut(id, now_ms)
            .and_then(|e| e.pending.as_mut())
        {
            p.notified = true;
        }
    }

    pub(crate) fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let bytes = {
            let map = self.lock(id);
            let now_ms = self.millis(Instant::now());
            if let Some(entry) = map.get(id) {
                return Ok(Some(entry.record(self.epoch, now_ms)));
            }
            self.kept(id, now_ms)
        };
        bytes.map(decode).transpose()
    }

    /// A notification of the in-flight record of `id` and when to stop waiting for it
    /// (its lease end, or `max` from now); `None` when there is nothing to wait for.
    pub(crate) fn waiter(&self, id: &RecordId, max: Duration) -> Option<(OwnedNotified, Instant)> {
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

    /// Calls the hook for records forgotten early (outside every store lock).
    pub(crate) fn flush_evicted(&self) {
        if !self.evictions.pending.load(Ordering::Acquire)
            || !self.evictions.pending.swap(false, Ordering::AcqRel)
        {
            return;
        }
        let ids = std::mem::take(&mut *lock(&self.evictions.ids));
        let settings = &self.settings;
        for (id, kind) in &ids {
            if *kind == EvictionKind::Forgotten {
                tracing::warn!(
                    target: "retrysafe::idempotency",
                    name = settings.name.as_str(),
                    event = "evicted",
                    record = ?id,
                    "idempotency record forgotten before its retention: its tombstone was \
                     dropped (MemoryStore max_bytes)"
                );
                if let Some(hook) = &settings.on_evicted {
                    hook(id);
                }
            }
            if let Some(hook) = &settings.on_eviction {
                hook(&Eviction::new(*kind, *id, settings.name.clone()));
            }
        }
    }
}

/// [`Inner::kept`] with the records already locked.
fn kept_in(r: &mut Retained, id: &RecordId, now_ms: u64) -> Option<Blob> {
    match r.find(id, now_ms) {
        Kept::Entry(e) => match e
            .pending
            .as_ref()
            .and_then(|p| p.adopted(now_ms).map(|a| (p.fingerprint, a)))
        {
            Some((fingerprint, a)) => Some(blob(&Record::Resolving(Resolving::new(
                fingerprint,
                a.until_ms,
            )))),
            None => Some(Arc::clone(&e.bytes)),
        },
        Kept::Tombstone => Some(blob(&Record::Evicted(
            retrysafe_core::idempotency::Evicted::new(),
        ))),
        Kept::Absent => None,
    }
}

fn bounds(settings: &Settings) -> Bounds {
    let tombstones = settings.max_bytes / TOMBSTONE_SHARE;
    Bounds {
        records: settings.max_bytes - tombstones,
        tombstones,
        fail_closed: settings.fail_closed,
    }
}

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The critical sections do not panic; should one ever, its data is still whole.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The entry of `id` if `token` holds it and no reconciler has adopted it.
fn holder<'m>(
    map: &'m mut Claims,
    id: &RecordId,
    token: Token,
    now_ms: u64,
) -> Result<&'m mut InFlight, StoreError> {
    map.get_mut(id)
        .filter(|entry| entry.token == token && entry.adopted(now_ms).is_none())
        .ok_or(StoreError::StaleToken)
}

/// Encodes a record into one allocation.
pub(crate) fn blob(record: &Record) -> Blob {
    // `Record::encode` writes a `Bytes` of exactly the encoded length; the copy into the
    // `Arc` (its counts in front) is one `memcpy` of the record per store.
    Blob::from(&record.encode()[..])
}

/// Decodes a kept record. Its body shares the store's allocation (no copy).
pub(crate) fn decode(bytes: Blob) -> Result<Record, StoreError> {
    Record::decode(Bytes::from_owner(bytes)).map_err(StoreError::Corrupt)
}

fn existing(record: Record, became_unknown: bool) -> ClaimOutcome {
    ClaimOutcome::Existing {
        record,
        became_unknown,
    }
}

pub(crate) fn unknown(fingerprint: Fingerprint) -> Record {
    Record::OutcomeUnknown(OutcomeUnknown::new(fingerprint))
}

pub(crate) fn after(now: Instant, d: Duration) -> Instant {
    now + d.min(MAX_SPAN)
}

fn millis_since(epoch: Instant, t: Instant) -> u64 {
    u64::try_from(t.saturating_duration_since(epoch).as_millis()).unwrap_or(u64::MAX)
}

pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.min(MAX_SPAN).as_millis()).unwrap_or(u64::MAX)
}
