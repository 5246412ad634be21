//! The completed and `outcome_unknown` records of a store: an LRU bounded by bytes,
//! whose victims shrink to tombstones, the heaviest scopes' first.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use retrysafe_core::__private::DigestHash;
use retrysafe_core::idempotency::{Fingerprint, RecordId, RequestInfo, Token, UnknownReason};
use retrysafe_core::observe::Name;
use retrysafe_core::observe::handles::Gauge;

use crate::sketch::Sketch;
use crate::tombstones::Tombstones;

/// The encoded bytes of a record.
pub(crate) type Blob = Arc<[u8]>;

/// The size of a record's key: a [`RecordId`].
pub(crate) const KEY_BYTES: u64 = 32;

/// The bytes an `outcome_unknown` record keeps beyond its encoded form, its request
/// information and its note: the reconcile state and its allocation.
const PENDING_BYTES: u64 = 160;

/// How many of the least recently used records are looked at for a completed one to
/// shrink before an `outcome_unknown` one.
const PREFER_COMPLETED: usize = 64;

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
    /// Least recently used first.
    lru: BTreeMap<u64, RecordId>,
    /// The same, per scope: (scope, seq).
    by_scope: BTreeSet<(u64, u64)>,
    /// The ids of the `outcome_unknown` records, for `due`.
    unknown: HashSet<RecordId, DigestHash>,
    bytes: u64,
    next_seq: u64,
    sketch: Sketch,
    /// Tombstones of the scopes that held more than their share: dropped first.
    heavy: Tombstones,
    light: Tombstones,
    /// Of the tombstones dropped before their expiry: the latest made, and the latest
    /// expiry (ms).
    forgotten_made_ms: u64,
    forgotten_until_ms: u64,
    ever_forgot: bool,
    gauges: Gauges,
    /// Whether the records shrunk to tombstones are reported (an eviction hook is set).
    report_shrunk: bool,
    /// The store's name, in its warnings.
    name: Name,
}

impl Retained {
    pub(crate) fn new(bounds: Bounds, gauges: Gauges, report_shrunk: bool, name: Name) -> Self {
        Retained {
            bounds,
            entries: HashMap::default(),
            lru: BTreeMap::new(),
            by_scope: BTreeSet::new(),
            unknown: HashSet::default(),
            bytes: 0,
            next_seq: 0,
            sketch: Sketch::default(),
            heavy: Tombstones::default(),
            light: Tombstones::default(),
            forgotten_made_ms: 0,
            forgotten_until_ms: 0,
            ever_forgot: false,
            gauges,
            report_shrunk,
            name,
        }
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn tombstones(&self) -> usize {
        self.heavy.len() + self.light.len()
    }

    pub(crate) fn tombstone_bytes(&self) -> u64 {
        (self.tombstones() as u64).saturating_mul(crate::MemoryStore::TOMBSTONE_BYTES)
    }

    /// Whether a fail-closed store refuses new claims: its tombstones are full.
    pub(crate) fn refuses_new(&self) -> bool {
        self.bounds.fail_closed
            && self
                .tombstone_bytes()
                .saturating_add(crate::MemoryStore::TOMBSTONE_BYTES)
                > self.bounds.tombstones
    }

    /// The record of `id`, its tombstone, or nothing. An expired record is removed; a
    /// record found counts as used.
    pub(crate) fn find(&mut self, id: &RecordId, now_ms: u64) -> Found<'_> {
        self.heavy.expire(now_ms);
        self.light.expire(now_ms);
        match self.entries.get(id).map(|e| e.expires_ms <= now_ms) {
            Some(true) => {
                self.remove(id);
            }
            Some(false) => return self.touch(id).map_or(Found::Absent, Found::Entry),
            None => {}
        }
        if self.heavy.contains(id, now_ms) || self.light.contains(id, now_ms) {
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
        self.heavy.remove(&id);
        self.light.remove(&id);
        let weight = weight(&bytes, pending.as_deref());
        let seq = self.next_seq;
        self.next_seq += 1;
        if pending.is_some() {
            self.unknown.insert(id);
        }
        self.entries.insert(
            id,
            Entry {
                bytes,
                expires_ms,
                pending,
                scope,
                seq,
                weight,
            },
        );
        self.lru.insert(seq, id);
        self.by_scope.insert((scope, seq));
        self.bytes = self.bytes.saturating_add(weight);
        self.sketch.add(scope, weight);
        let report = self.fit(id, now_ms);
        self.gauges.bytes.set(self.bytes as f64);
        report
    }

    /// Removes the record of `id` (not its tombstone); returns it.
    pub(crate) fn remove(&mut self, id: &RecordId) -> Option<Entry> {
        let entry = self.entries.remove(id)?;
        self.lru.remove(&entry.seq);
        self.by_scope.remove(&(entry.scope, entry.seq));
        if entry.pending.is_some() {
            self.unknown.remove(id);
        }
        self.bytes = self.bytes.saturating_sub(entry.weight);
        self.sketch.sub(entry.scope, entry.weight);
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
    /// and moving it would cost four B-tree operations on every replay of a busy key.
    fn touch(&mut self, id: &RecordId) -> Option<&mut Entry> {
        let seq = self.next_seq;
        let recent = self.entries.len() as u64 / 4;
        let entry = self.entries.get_mut(id)?;
        if seq - entry.seq <= recent {
            return Some(entry);
        }
        self.next_seq += 1;
        self.lru.remove(&entry.seq);
        self.by_scope.remove(&(entry.scope, entry.seq));
        entry.seq = seq;
        self.lru.insert(seq, *id);
        self.by_scope.insert((entry.scope, seq));
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
            let Some(dropped) = self
                .heavy
                .drop_oldest()
                .or_else(|| self.light.drop_oldest())
            else {
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
            let of_scope = self
                .by_scope
                .range((scope, 0)..=(scope, u64::MAX))
                .filter_map(|(_, seq)| self.lru.get(seq).copied());
            match self.pick(of_scope, keep) {
                Some(id) => return Some((id, true)),
                // The sketch overestimated a scope that holds nothing else.
                None => self.sketch.forget(scope),
            }
        }
        self.pick(self.lru.values().copied(), keep)
            .map(|id| (id, false))
    }

    /// The first of `candidates` (least recently used first) that is not `keep`,
    /// preferring a completed record among the first few: an `outcome_unknown` record
    /// shrunk to a tombstone is no longer reconciled.
    fn pick(
        &self,
        candidates: impl Iterator<Item = RecordId>,
        keep: &RecordId,
    ) -> Option<RecordId> {
        let mut first = None;
        for id in candidates.filter(|id| id != keep).take(PREFER_COMPLETED) {
            if self.entries.get(&id).is_some_and(|e| e.pending.is_none()) {
                return Some(id);
            }
            first.get_or_insert(id);
        }
        first
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
        if entry.pending.is_some() {
            tracing::warn!(
                target: "retrysafe::idempotency",
                name = self.name.as_str(),
                record = ?id,
                "outcome_unknown record shrunk to a tombstone (MemoryStore max_bytes): \
                 copies are refused, but it is no longer reconciled"
            );
        }
        let table = if heavy {
            &mut self.heavy
        } else {
            &mut self.light
        };
        table.insert(id, now_ms, entry.expires_ms);
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
