//! What the store reports when memory runs short: records shrunk to tombstones, and
//! tombstones dropped before their retention.

use retrysafe_core::idempotency::RecordId;
use retrysafe_core::observe::Name;

/// What an eviction did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EvictionKind {
    /// A completed (or `outcome_unknown`) record was pushed out of the byte bound and
    /// shrunk to a tombstone: a copy of its request now gets 409 `response-evicted`,
    /// never a second run.
    Tombstoned,
    /// A tombstone was dropped before its retention ended because tombstones no longer
    /// fit: the key is forgotten, and a copy of its request may run again.
    Forgotten,
}

impl EvictionKind {
    /// The name in events, e.g. `tombstoned`.
    pub fn as_str(self) -> &'static str {
        match self {
            EvictionKind::Tombstoned => "tombstoned",
            EvictionKind::Forgotten => "forgotten",
        }
    }
}

/// One eviction of a [`MemoryStore`](crate::MemoryStore), for its
/// [`on_eviction`](crate::MemoryStore::on_eviction) hook.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Eviction {
    /// What happened.
    pub kind: EvictionKind,
    /// To which record.
    pub record: RecordId,
    /// The store's [`name`](crate::MemoryStore::name).
    pub name: Name,
}

impl Eviction {
    pub(crate) fn new(kind: EvictionKind, record: RecordId, name: Name) -> Self {
        Eviction { kind, record, name }
    }
}
