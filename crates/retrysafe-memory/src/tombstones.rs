//! Tombstones: what is left of a completed record whose response was dropped for space.

use std::collections::{BTreeMap, HashMap};

use retrysafe_core::__private::DigestHash;
use retrysafe_core::idempotency::RecordId;

/// The width of an expiry bucket, in milliseconds.
const BUCKET_MS: u64 = 1_000;

/// A time-bucketed table of tombstones in two classes, *heavy* (of the scopes that
/// held more than their share: dropped first) and *light*: a 16-byte truncated record
/// id with its class and expiry bucket (and the bucket it was made in, for the
/// effective-retention gauge), found by one hash lookup whatever its class; and, per
/// class and expiry bucket, the ids in it, so that expired buckets go at once and the
/// oldest tombstones of a class are dropped first. The lists keep the whole id, which
/// the eviction hook is given.
#[derive(Debug, Default)]
pub(crate) struct Tombstones {
    index: HashMap<[u8; 16], Buckets, DigestHash>,
    /// Light, then heavy.
    by_expiry: [BTreeMap<u32, Vec<RecordId>>; 2],
}

#[derive(Debug, Clone, Copy)]
struct Buckets {
    expires: u32,
    made: u32,
    heavy: bool,
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

    /// Adds the tombstone of `id`, of the heavy class or not, made at `now_ms`, until
    /// `expires_ms`.
    pub(crate) fn insert(&mut self, id: RecordId, heavy: bool, now_ms: u64, expires_ms: u64) {
        let b = Buckets {
            expires: bucket(expires_ms),
            made: bucket(now_ms),
            heavy,
        };
        self.index.insert(short(&id), b);
        self.lists(heavy).entry(b.expires).or_default().push(id);
    }

    fn lists(&mut self, heavy: bool) -> &mut BTreeMap<u32, Vec<RecordId>> {
        let [light, heavy_lists] = &mut self.by_expiry;
        if heavy { heavy_lists } else { light }
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
        for heavy in [false, true] {
            while let Some(entry) = self.lists(heavy).first_entry() {
                if bucket_ms(*entry.key()) > now_ms {
                    break;
                }
                let (b, ids) = entry.remove_entry();
                for id in ids {
                    self.unindex(&id, b, heavy);
                }
            }
        }
    }

    /// Drops the tombstone that expires first, of the heavy class while it has one
    /// (and any stale list entries before it).
    pub(crate) fn drop_oldest(&mut self) -> Option<Dropped> {
        self.drop_oldest_of(true)
            .or_else(|| self.drop_oldest_of(false))
    }

    fn drop_oldest_of(&mut self, heavy: bool) -> Option<Dropped> {
        loop {
            let mut entry = self.lists(heavy).first_entry()?;
            let b = *entry.key();
            let Some(id) = entry.get_mut().pop() else {
                entry.remove();
                continue;
            };
            if entry.get().is_empty() {
                entry.remove();
            }
            if let Some(made) = self.unindex(&id, b, heavy) {
                return Some(Dropped {
                    id,
                    made_ms: bucket_ms(made),
                    expires_ms: bucket_ms(b),
                });
            }
        }
    }

    /// Removes the index entry of `id` if it is the one of expiry bucket `b` in the
    /// class `heavy`; returns the bucket it was made in.
    fn unindex(&mut self, id: &RecordId, b: u32, heavy: bool) -> Option<u32> {
        // One lookup: a stale list entry (its tombstone removed or made again since)
        // is rare, and is put back.
        let key = short(id);
        let found = self.index.remove(&key)?;
        if found.expires == b && found.heavy == heavy {
            Some(found.made)
        } else {
            self.index.insert(key, found);
            None
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
        t.insert(id(1), false, 0, 5_000);
        t.insert(id(2), false, 0, 2_000);
        t.insert(id(3), false, 0, 9_000);
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

    #[test]
    fn heavy_tombstones_go_first_and_one_lookup_finds_either_class() {
        let mut t = Tombstones::default();
        t.insert(id(1), false, 0, 2_000);
        t.insert(id(2), true, 0, 9_000);
        t.insert(id(3), true, 0, 5_000);
        assert!(t.contains(&id(1), 0) && t.contains(&id(2), 0));
        assert_eq!(t.drop_oldest().map(|d| d.id), Some(id(3)));
        assert_eq!(t.drop_oldest().map(|d| d.id), Some(id(2)));
        // Made again in the other class: its old list entry is stale, and skipped.
        t.insert(id(2), false, 0, 9_000);
        t.insert(id(1), true, 0, 3_000);
        assert_eq!(t.drop_oldest().map(|d| d.id), Some(id(1)));
        assert_eq!(t.len(), 1);
        assert_eq!(t.drop_oldest().map(|d| d.id), Some(id(2)));
        assert!(t.drop_oldest().is_none());
        assert_eq!(t.len(), 0);
    }
}
