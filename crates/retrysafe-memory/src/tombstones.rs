//! Tombstones: what is left of a completed record whose response was dropped for space.

use std::collections::{BTreeMap, HashMap};

use retrysafe_core::__private::DigestHash;
use retrysafe_core::idempotency::RecordId;

/// The width of an expiry bucket, in milliseconds.
const BUCKET_MS: u64 = 1_000;

/// A time-bucketed table of tombstones: a 16-byte truncated record id with its expiry
/// bucket (and the bucket it was made in, for the effective-retention gauge), found by
/// one hash lookup; and, per expiry bucket, the ids in it, so that expired buckets go
/// at once and the oldest tombstones are dropped first. The lists keep the whole id,
/// which the eviction hook is given.
#[derive(Debug, Default)]
pub(crate) struct Tombstones {
    index: HashMap<[u8; 16], Buckets, DigestHash>,
    by_expiry: BTreeMap<u32, Vec<RecordId>>,
}

#[derive(Debug, Clone, Copy)]
struct Buckets {
    expires: u32,
    made: u32,
}

/// A tombstone dropped before its expiry.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dropped {
    pub(crate) id: RecordId,
    /// When its record was shrunk (rounded up to a bucket), in ms of the store's clock.
    pub(crate) made_ms: u64,
    /// When it would have expired (rounded up), in ms.
    pub(crate) expires_ms: u64,
}

fn short(id: &RecordId) -> [u8; 16] {
    let mut s = [0u8; 16];
    s.copy_from_slice(&id.as_bytes()[..16]);
    s
}

/// The bucket holding `ms`, rounded up: a tombstone never ends before its record would.
fn bucket(ms: u64) -> u32 {
    u32::try_from(ms.div_ceil(BUCKET_MS)).unwrap_or(u32::MAX)
}

fn bucket_ms(b: u32) -> u64 {
    u64::from(b).saturating_mul(BUCKET_MS)
}

impl Tombstones {
    /// The number of tombstones.
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    /// Adds the tombstone of `id`, made at `now_ms`, until `expires_ms`.
    pub(crate) fn insert(&mut self, id: RecordId, now_ms: u64, expires_ms: u64) {
        let b = Buckets {
            expires: bucket(expires_ms),
            made: bucket(now_ms),
        };
        self.index.insert(short(&id), b);
        self.by_expiry.entry(b.expires).or_default().push(id);
    }

    /// Whether `id` has a live tombstone.
    pub(crate) fn contains(&self, id: &RecordId, now_ms: u64) -> bool {
        self.index
            .get(&short(id))
            .is_some_and(|b| bucket_ms(b.expires) > now_ms)
    }

    /// Removes the tombstone of `id`, if any.
    pub(crate) fn remove(&mut self, id: &RecordId) {
        // Its entry in the expiry list stays until that bucket goes; it then finds no
        // index entry of that bucket and is skipped.
        self.index.remove(&short(id));
    }

    /// Drops every tombstone whose bucket has expired.
    pub(crate) fn expire(&mut self, now_ms: u64) {
        while let Some(entry) = self.by_expiry.first_entry() {
            if bucket_ms(*entry.key()) > now_ms {
                return;
            }
            let (b, ids) = entry.remove_entry();
            for id in ids {
                self.unindex(&id, b);
            }
        }
    }

    /// Drops the tombstone that expires first (and any stale list entries before it).
    pub(crate) fn drop_oldest(&mut self) -> Option<Dropped> {
        loop {
            let mut entry = self.by_expiry.first_entry()?;
            let b = *entry.key();
            let Some(id) = entry.get_mut().pop() else {
                entry.remove();
                continue;
            };
            if entry.get().is_empty() {
                entry.remove();
            }
            if let Some(made) = self.unindex(&id, b) {
                return Some(Dropped {
                    id,
                    made_ms: bucket_ms(made),
                    expires_ms: bucket_ms(b),
                });
            }
        }
    }

    /// Removes the index entry of `id` if it is the one of expiry bucket `b`; returns
    /// the bucket it was made in.
    fn unindex(&mut self, id: &RecordId, b: u32) -> Option<u32> {
        let key = short(id);
        match self.index.get(&key) {
            Some(found) if found.expires == b => {
                let made = found.made;
                self.index.remove(&key);
                Some(made)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> RecordId {
        RecordId::from_bytes([n; 32])
    }

    #[test]
    fn oldest_expiry_goes_first_and_expired_buckets_go_at_once() {
        let mut t = Tombstones::default();
        t.insert(id(1), 0, 5_000);
        t.insert(id(2), 0, 2_000);
        t.insert(id(3), 0, 9_000);
        assert!(t.contains(&id(1), 4_999));
        let first = t.drop_oldest().expect("one");
        assert_eq!(first.id, id(2));
        assert_eq!(t.len(), 2);
        t.expire(5_000);
        assert!(!t.contains(&id(1), 0));
        assert!(t.contains(&id(3), 5_000));
        assert_eq!(t.len(), 1);
        t.remove(&id(3));
        assert!(t.drop_oldest().is_none());
    }
}
