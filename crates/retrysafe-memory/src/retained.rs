//! The completed and `outcome_unknown` records of a store: an LRU bounded by bytes,
//! whose completed records shrink to tombstones, the heaviest scopes' first. Pending
//! (`outcome_unknown`) records never shrink: a tombstone would never be reconciled, nor
//! its hook told. When they alone fill the bound, new claims are refused.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use retrysafe_core::__private::DigestHash;
use retrysafe_core::__private::handles::Gauge;
use retrysafe_core::idempotency::{Fingerprint, RecordId, RequestInfo, Token, UnknownReason};

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

/// The records, the tombstones and the sketch of who holds them.
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
    /// Of the tombstones dropped before their expiry: the latest made, and the latest
    /// expiry (ms).
    forgotten_made_ms: u64,
    forgotten_until_ms: u64,
    ever_forgot: bool,
    gauges: Gauges,
    /// Whether the records shrunk to tombstones are reported (an eviction hook is set).
    report_shrunk: bool,
}

impl Retained {
    pub(crate) fn new(bounds: Bounds, gauges: Gauges, report_shrunk: bool) -> Self {
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
            forgotten_made_ms: 0,
            forgotten_until_ms: 0,
            ever_forgot: false,
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
        let report = self.fit(id, now_ms);
        self.gauges.bytes.set(self.bytes as f64);
        report
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
        self.gauges.bytes.set(self.bytes as f64);
        Some(entry)
    }

    /// The ids of the `outcome_unknown` records.
    pub(crate) fn unknown_ids(&self) -> impl Iterator<Item = &RecordId> {
        self.unknown.iter()
    }

    pub(crate) fn get(&self, id: &RecordId) -> Option<&Entry> {
        self.entries.get(id)
    }

    /// How far back every key is still remembered: `None` while no tombstone was
    /// dropped before its expiry (or all such would have expired by now).
    pub(crate) fn effective_retention_ms(&self, now_ms: u64) -> Option<u64> {
        (self.ever_forgot && self.forgotten_until_ms > now_ms)
            .then(|| now_ms.saturating_sub(self.forgotten_made_ms))
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
        while self.tombstone_bytes() > self.bounds.tombstones {
            let Some(dropped) = self.tombstones.drop_oldest() else {
                break;
            };
            self.forgotten_made_ms = self.forgotten_made_ms.max(dropped.made_ms);
            self.forgotten_until_ms = self.forgotten_until_ms.max(dropped.expires_ms);
            self.ever_forgot = true;
            report.dropped.push(dropped.id);
        }
        if !report.dropped.is_empty() {
            let remembered_ms = now_ms.saturating_sub(self.forgotten_made_ms);
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
