//! The completed and `outcome_unknown` records of a store: an LRU bounded by bytes,
//! whose completed records shrink to tombstones, the heaviest scopes' first. Pending
//! (`outcome_unknown`) records never shrink: a tombstone would never be reconciled, nor
//! its hook told. When they alone fill the bound, new claims are refused.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use retrysafe_core::__private::DigestHash;
use retrysafe_core::idempotency::{Fingerprint, RecordId, RequestInfo, Token, UnknownReason};
use retrysafe_core::observe::handles::Gauge;

use crate::order::{NIL, Order, Slot};
use crate::sketch::Sketch;
use crate::tombstones::Tombstones;

/// The encoded bytes of a record.
pub(crate) type Blob = Arc<[u8]>;

/// The size of a record's key: a [`RecordId`].
pub(crate) const KEY_BYTES: u64 = 32;

/// The bytes an `outcome_unknown` record keeps beyond its encoded form, its request
/// information and its note: the reconcile state and its allocation.
const PENDING_BYTES: u64 = 160;

/// A completed or `outcome_unknown` record.
#[derive(Debug)]
pub(crate) struct Entry {
    /// The encoded record ([`retrysafe_core::idempotency::Record::encode`]).
    pub(crate) bytes: Blob,
    /// The end of its retention, in ms of the store's clock.
    pub(crate) expires_ms: u64,
    /// What a reconciler needs, for an `outcome_unknown` record.
    pub(crate) pending: Option<Box<Pending>>,
    pub(crate) scope: u64,
    seq: u64,
    /// Its place in the LRU ([`NIL`] for an `outcome_unknown` record, never listed).
    slot: Slot,
    weight: u64,
}

/// The reconcile state of a pending record (an in-flight claim or an `outcome_unknown`
/// record).
#[derive(Debug, Clone)]
pub(crate) struct Pending {
    pub(crate) fingerprint: Fingerprint,
    pub(crate) reason: Option<UnknownReason>,
    pub(crate) notified: bool,
    /// When a reconciler should look at it next, in ms.
    pub(crate) due_ms: u64,
    /// When it was claimed, in ms.
    pub(crate) claimed_ms: u64,
    /// For a claim found with its lease ended (by a copy, a sweep or an operator): when
    /// the lease ended, in ms. A reconciler considers the record only once its `stale`
    /// time has passed since, as it would the claim: its holder may still run until
    /// then.
    pub(crate) lease_ended_ms: Option<u64>,
    pub(crate) request: Option<Arc<RequestInfo>>,
    pub(crate) note: Option<Bytes>,
    pub(crate) adoption: Option<Adoption>,
}

/// A reconciler's adoption of a record: until `until_ms`, only `token` acts on it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Adoption {
    pub(crate) token: Token,
    pub(crate) until_ms: u64,
}

impl Adoption {
    pub(crate) fn live(self, now_ms: u64) -> bool {
        self.until_ms > now_ms
    }
}

impl Pending {
    /// The live adoption, if any.
    pub(crate) fn adopted(&self, now_ms: u64) -> Option<Adoption> {
        self.adoption.filter(|a| a.live(now_ms))
    }

    /// Whether `stale` has passed since the lease of the claim it was made from ended
    /// (always, when it was not made from an ended lease).
    pub(crate) fn stale_for(&self, stale: Duration, now_ms: u64) -> bool {
        self.lease_ended_ms
            .is_none_or(|ended| ended.saturating_add(crate::inner::millis(stale)) <= now_ms)
    }
}

/// What a lookup found.
#[derive(Debug)]
pub(crate) enum Found<'a> {
    Entry(&'a mut Entry),
    Tombstone,
    Absent,
}

/// The byte bounds of the records and of the tombstones.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    pub(crate) records: u64,
    pub(crate) tombstones: u64,
    /// Refuse new claims when the tombstones are full, rather than dropping them.
    pub(crate) fail_closed: bool,
}

impl Bounds {
    /// One shard's share of these bounds, when the records are split into `shards`.
    pub(crate) fn share(self, shards: usize) -> Bounds {
        let n = shards.max(1) as u64;
        Bounds {
            records: self.records / n,
            tombstones: self.tombstones / n,
            fail_closed: self.fail_closed,
        }
    }
}

/// The least share of the record bound a shard is given: a store whose record bound is
/// under two of these keeps its records under one lock, in exactly one LRU.
pub(crate) const MIN_SHARD_RECORDS: u64 = 4 << 20;

/// The most shards the records of a store are split into.
pub(crate) const MAX_SHARDS: usize = 8;

/// How many shards (a power of two, at most [`MAX_SHARDS`]) the completed and
/// `outcome_unknown` records of a store with `bounds` are split into, by record id, so
/// that concurrent requests for different keys seldom wait for each other's lock: as
/// many as give each at least [`MIN_SHARD_RECORDS`]. Each shard has its share of both
/// bounds, and its own LRU and fairness sketch (the ids are SHA-256, so every shard
/// sees about the same mix of scopes and keys).
pub(crate) fn shards(bounds: &Bounds) -> usize {
    let fit = usize::try_from(bounds.records / MIN_SHARD_RECORDS).unwrap_or(usize::MAX);
    let n = fit.clamp(1, MAX_SHARDS);
    // The largest power of two not above `n`.
    1 << n.ilog2()
}

/// What a change dropped, reported outside the locks.
#[derive(Debug, Default)]
pub(crate) struct Report {
    /// Tombstones dropped before their expiry (keys forgotten).
    pub(crate) dropped: Vec<RecordId>,
    /// Records shrunk to tombstones (only when someone listens: see
    /// [`Retained::report_shrunk`]).
    pub(crate) shrunk: Vec<RecordId>,
}

/// The gauges of a store (empty until `build`, and without the feature `metrics`).
#[derive(Debug, Clone, Default)]
pub(crate) struct Gauges {
    pub(crate) bytes: Gauge,
    pub(crate) effective_retention: Gauge,
}

/// What the shards of a store's records share: the totals its gauges and
/// [`MemoryStore::effective_retention`](crate::MemoryStore::effective_retention)
/// report.
#[derive(Debug, Default)]
pub(crate) struct Totals {
    /// The bytes of every shard (kept only while the bytes gauge is enabled).
    bytes: AtomicU64,
    /// Of the tombstones dropped before their expiry, in any shard: the latest made,
    /// and the latest expiry (ms).
    forgotten_made_ms: AtomicU64,
    forgotten_until_ms: AtomicU64,
    ever_forgot: AtomicBool,
}

impl Totals {
    /// How far back every key is still remembered: `None` while no tombstone was
    /// dropped before its expiry (or all such would have expired by now).
    pub(crate) fn effective_retention_ms(&self, now_ms: u64) -> Option<u64> {
        (self.ever_forgot.load(Ordering::Acquire)
            && self.forgotten_until_ms.load(Ordering::Acquire) > now_ms)
            .then(|| now_ms.saturating_sub(self.forgotten_made_ms.load(Ordering::Acquire)))
    }

    /// Notes a tombstone dropped before its expiry; the latest made of all.
    fn forgot(&self, made_ms: u64, expires_ms: u64) -> u64 {
        // Both are bucketed (to the second): most drops change neither.
        if self.forgotten_until_ms.load(Ordering::Relaxed) < expires_ms {
            self.forgotten_until_ms
                .fetch_max(expires_ms, Ordering::AcqRel);
        }
        let latest = self.forgotten_made_ms.load(Ordering::Relaxed);
        let latest = if latest < made_ms {
            self.forgotten_made_ms
                .fetch_max(made_ms, Ordering::AcqRel)
                .max(made_ms)
        } else {
            latest
        };
        if !self.ever_forgot.load(Ordering::Relaxed) {
            self.ever_forgot.store(true, Ordering::Release);
        }
        latest
    }
}

/// The records, the tombstones and the sketch of who holds them: the whole store's,
/// or one shard's share of them (see [`shards`]).
#[derive(Debug)]
pub(crate) struct Retained {
    bounds: Bounds,
    entries: HashMap<RecordId, Entry, DigestHash>,
    /// The completed records, least recently used first, overall and per scope
    /// (`outcome_unknown` ones are never shrunk, so never listed).
    lru: Order,
    /// The ids of the `outcome_unknown` records, for `due`.
    unknown: HashSet<RecordId, DigestHash>,
    bytes: u64,
    /// The part of `bytes` the `outcome_unknown` records weigh.
    pending_bytes: u64,
    next_seq: u64,
    /// Who holds the completed records' bytes.
    sketch: Sketch,
    /// The tombstones; those of the scopes that held more than their share are dropped
    /// first.
    tombstones: Tombstones,
    totals: Arc<Totals>,
    gauges: Gauges,
    /// Whether the records shrunk to tombstones are reported (an eviction hook is set).
    report_shrunk: bool,
}

impl Retained {
    pub(crate) fn new(
        bounds: Bounds,
        totals: Arc<Totals>,
        gauges: Gauges,
        report_shrunk: bool,
    ) -> Self {
        Retained {
            bounds,
            entries: HashMap::default(),
            lru: Order::default(),
            unknown: HashSet::default(),
            bytes: 0,
            pending_bytes: 0,
            next_seq: 0,
            sketch: Sketch::default(),
            tombstones: Tombstones::default(),
            totals,
            gauges,
            report_shrunk,
        }
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn tombstones(&self) -> usize {
        self.tombstones.len()
    }

    pub(crate) fn tombstone_bytes(&self) -> u64 {
        (self.tombstones() as u64).saturating_mul(crate::MemoryStore::TOMBSTONE_BYTES)
    }

    /// Whether new claims are refused: the `outcome_unknown` records, which never
    /// shrink, fill the record bound; or a fail-closed store's tombstones are full.
    pub(crate) fn refuses_new(&self) -> bool {
        let tombstones_full = self
            .tombstone_bytes()
            .saturating_add(crate::MemoryStore::TOMBSTONE_BYTES)
            > self.bounds.tombstones;
        self.pending_bytes >= self.bounds.records || (self.bounds.fail_closed && tombstones_full)
    }

    /// The record of `id`, its tombstone, or nothing. An expired record is removed; a
    /// record found counts as used.
    pub(crate) fn find(&mut self, id: &RecordId, now_ms: u64) -> Found<'_> {
        self.tombstones.expire(now_ms);
        match self.entries.get(id).map(|e| e.expires_ms <= now_ms) {
            Some(true) => {
                self.remove(id);
            }
            Some(false) => return self.touch(id).map_or(Found::Absent, Found::Entry),
            None => {}
        }
        if self.tombstones.contains(id, now_ms) {
            Found::Tombstone
        } else {
            Found::Absent
        }
    }

    /// The unexpired record of `id`, without counting it as used.
    pub(crate) fn peek_mut(&mut self, id: &RecordId, now_ms: u64) -> Option<&mut Entry> {
        self.entries.get_mut(id).filter(|e| e.expires_ms > now_ms)
    }

    /// Stores a record for `id` (replacing any record or tombstone), then shrinks the
    /// least deserving records to tombstones until the records fit, and drops the
    /// oldest tombstones until those fit.
    pub(crate) fn insert(
        &mut self,
        id: RecordId,
        bytes: Blob,
        expires_ms: u64,
        scope: u64,
        pending: Option<Box<Pending>>,
        now_ms: u64,
    ) -> Report {
        self.remove(&id);
        self.tombstones.remove(&id);
        let weight = weight(&bytes, pending.as_deref());
        let seq = self.next_seq;
        self.next_seq += 1;
        let slot = if pending.is_some() {
            self.unknown.insert(id);
            self.pending_bytes = self.pending_bytes.saturating_add(weight);
            NIL
        } else {
            self.sketch.add(scope, weight);
            self.lru.push(id, scope)
        };
        self.entries.insert(
            id,
            Entry {
                bytes,
                expires_ms,
                pending,
                scope,
                seq,
                slot,
                weight,
            },
        );
        self.bytes = self.bytes.saturating_add(weight);
        self.count_bytes(weight, true);
        self.fit(id, now_ms)
    }

    /// Removes the record of `id` (not its tombstone); returns it.
    pub(crate) fn remove(&mut self, id: &RecordId) -> Option<Entry> {
        let entry = self.entries.remove(id)?;
        if entry.pending.is_some() {
            self.unknown.remove(id);
            self.pending_bytes = self.pending_bytes.saturating_sub(entry.weight);
        } else {
            self.lru.remove(entry.slot);
            self.sketch.sub(entry.scope, entry.weight);
        }
        self.bytes = self.bytes.saturating_sub(entry.weight);
        self.count_bytes(entry.weight, false);
        Some(entry)
    }

    /// Tells the bytes gauge of `weight` added (or removed): the total of every shard.
    fn count_bytes(&self, weight: u64, added: bool) {
        if !self.gauges.bytes.enabled() {
            return;
        }
        let total = if added {
            self.totals.bytes.fetch_add(weight, Ordering::AcqRel) + weight
        } else {
            self.totals.bytes.fetch_sub(weight, Ordering::AcqRel) - weight
        };
        self.gauges.bytes.set(total as f64);
    }

    /// The ids of the `outcome_unknown` records.
    pub(crate) fn unknown_ids(&self) -> impl Iterator<Item = &RecordId> {
        self.unknown.iter()
    }

    pub(crate) fn get(&self, id: &RecordId) -> Option<&Entry> {
        self.entries.get(id)
    }

    /// Counts the record of `id` as used; returns it.
    ///
    /// A record already among the most recently used quarter is left where it is: at
    /// most a quarter of the records are newer than it, so it is far from being shrunk,
    /// and moving it would write to three other records' nodes (cache misses in a
    /// large store) on every replay of a busy key.
    fn touch(&mut self, id: &RecordId) -> Option<&mut Entry> {
        let seq = self.next_seq;
        let recent = self.entries.len() as u64 / 4;
        let entry = self.entries.get_mut(id)?;
        // A pending record is never shrunk: it has no place in the LRU.
        if seq - entry.seq <= recent || entry.pending.is_some() {
            return Some(entry);
        }
        self.next_seq += 1;
        entry.seq = seq;
        self.lru.touch(entry.slot);
        Some(entry)
    }

    /// Brings records and tombstones within their bounds, never touching `keep` (the
    /// record just stored, which fits alone).
    fn fit(&mut self, keep: RecordId, now_ms: u64) -> Report {
        let mut report = Report::default();
        while self.bytes > self.bounds.records {
            let Some((victim, heavy)) = self.victim(&keep) else {
                break;
            };
            if self.shrink(victim, heavy, now_ms) && self.report_shrunk {
                report.shrunk.push(victim);
            }
        }
        if self.bounds.fail_closed {
            return report;
        }
        let mut latest_made = None;
        while self.tombstone_bytes() > self.bounds.tombstones {
            let Some(dropped) = self.tombstones.drop_oldest() else {
                break;
            };
            latest_made = Some(self.totals.forgot(dropped.made_ms, dropped.expires_ms));
            report.dropped.push(dropped.id);
        }
        if let Some(made_ms) = latest_made {
            let remembered_ms = now_ms.saturating_sub(made_ms);
            self.gauges
                .effective_retention
                .set(Duration::from_millis(remembered_ms).as_secs_f64());
        }
        report
    }

    /// The record to shrink next, and whether its scope holds more than its share: the
    /// least recently used record of the heaviest scope while that scope holds more
    /// than its share of the bound, otherwise the least recently used record.
    fn victim(&mut self, keep: &RecordId) -> Option<(RecordId, bool)> {
        while let Some((scope, held)) = self.sketch.heaviest() {
            let share = self.bounds.records / self.sketch.active().max(1);
            if held <= share {
                break;
            }
            match self.pick(self.lru.of_scope(scope), keep) {
                Some(id) => return Some((id, true)),
                // The sketch overestimated a scope that holds nothing else.
                None => self.sketch.forget(scope),
            }
        }
        self.pick(self.lru.iter(), keep).map(|id| (id, false))
    }

    /// The first of `candidates` (least recently used first) that is not `keep`. Only
    /// completed records are candidates: an `outcome_unknown` record is never in the
    /// LRU, so never shrunk.
    fn pick(
        &self,
        mut candidates: impl Iterator<Item = RecordId>,
        keep: &RecordId,
    ) -> Option<RecordId> {
        candidates.find(|id| id != keep)
    }

    /// Replaces the record of `id` by a tombstone (an expired record simply goes);
    /// whether it left a tombstone.
    fn shrink(&mut self, id: RecordId, heavy: bool, now_ms: u64) -> bool {
        let Some(entry) = self.remove(&id) else {
            return false;
        };
        if entry.expires_ms <= now_ms {
            return false;
        }
        self.tombstones.insert(id, heavy, now_ms, entry.expires_ms);
        true
    }
}

/// The weight of a record: its encoded bytes, its key, the per-entry overhead, and for
/// an `outcome_unknown` record its reconcile state.
pub(crate) fn weight(bytes: &[u8], pending: Option<&Pending>) -> u64 {
    let extra = pending.map_or(0, |p| {
        PENDING_BYTES
            + p.request.as_deref().map_or(0, |r| {
                (r.path.len() + r.key.as_ref().map_or(0, |k| k.as_str().len())) as u64
            })
            + p.note.as_ref().map_or(0, |n| n.len() as u64)
    });
    (bytes.len() as u64)
        .saturating_add(KEY_BYTES)
        .saturating_add(crate::MemoryStore::ENTRY_OVERHEAD)
        .saturating_add(extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds(max_bytes: u64) -> Bounds {
        let tombstones = max_bytes / 4;
        Bounds {
            records: max_bytes - tombstones,
            tombstones,
            fail_closed: false,
        }
    }

    #[test]
    fn small_stores_keep_one_shard_large_ones_up_to_eight() {
        for (max_bytes, shards) in [
            (0, 1),
            (32 * 1024, 1),
            (10 << 20, 1),
            (11 << 20, 2),
            (12 << 20, 2),
            (32 << 20, 4),
            (64 << 20, 8),
            (1 << 40, 8),
        ] {
            let b = bounds(max_bytes);
            assert_eq!(super::shards(&b), shards, "{max_bytes}");
            // Every shard gets at least its least share, and the shares fit the bound.
            let share = b.share(shards);
            assert!(shards == 1 || share.records >= MIN_SHARD_RECORDS);
            assert!(share.records * shards as u64 <= b.records);
            assert!(share.tombstones * shards as u64 <= b.tombstones);
        }
    }
}
