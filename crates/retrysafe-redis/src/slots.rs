//! Redis Cluster hash slots, for keys an application keeps beside a record.
//!
//! On a Redis Cluster a record lives on the node that holds the hash slot of its key's
//! hash tag, the record id in hex ([`RedisStore::key`](crate::RedisStore::key)). An
//! effect written to another node can be lost in a failover of that node alone while
//! the record that says it happened survives (or the reverse); written to the same
//! slot, both are copied to a replica in the order they were made. Name the effect's
//! keys with the record's hash tag, `{<record id in hex>}`, or, to group several
//! records' effects per slot, with the short tag of its slot:
//!
//! ```
//! use retrysafe::idempotency::RecordId;
//! use retrysafe::redis::slots::{slot_of_record, slot_of_tag, tag_of_slot};
//!
//! let id = RecordId::from_bytes([7; 32]);
//! let slot = slot_of_record(&id);
//! assert_eq!(slot_of_tag(&id.to_hex()), slot);
//! // `ledger:{<tag>}:account:acme` is in the record's slot, on the record's node.
//! let tag = tag_of_slot(slot);
//! assert_eq!(slot_of_tag(&tag), slot);
//! assert!(tag.len() <= 6);
//! ```

use std::sync::LazyLock;

use retrysafe_core::idempotency::RecordId;

/// The number of hash slots of a Redis Cluster.
pub const SLOTS: u16 = 16_384;

/// CRC16-CCITT (XMODEM: polynomial 0x1021, initial value 0), the checksum Redis
/// Cluster maps keys to slots with.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The slot of a hash tag (the text between the first `{` and the next `}` of a key).
pub fn slot_of_tag(tag: &str) -> u16 {
    crc16(tag.as_bytes()) % SLOTS
}

/// For each slot, the smallest number whose decimal text maps to it.
static TAGS: LazyLock<Vec<u32>> = LazyLock::new(|| {
    let mut tags = vec![u32::MAX; usize::from(SLOTS)];
    let mut left = usize::from(SLOTS);
    let mut n: u32 = 0;
    while left > 0 {
        let slot = usize::from(slot_of_tag(&n.to_string()));
        if let Some(t) = tags.get_mut(slot).filter(|t| **t == u32::MAX) {
            *t = n;
            left -= 1;
        }
        n += 1;
    }
    tags
});

/// The slot of the record of `id`: its key's hash tag is the id in hex.
pub fn slot_of_record(id: &RecordId) -> u16 {
    slot_of_tag(&id.to_hex())
}

/// A short hash tag (decimal digits, the smallest number whose text maps to `slot`,
/// taken modulo [`SLOTS`]): a key named `…{tag}…` lives in `slot`.
pub fn tag_of_slot(slot: u16) -> String {
    let n = TAGS
        .get(usize::from(slot % SLOTS))
        .copied()
        .unwrap_or_default();
    n.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_is_redis_cluster_crc16() {
        // The check value of CRC16/XMODEM, and two slots Redis's own docs give.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(slot_of_tag("foo"), 12_182);
        assert_eq!(slot_of_tag("user1000"), 3_443);
    }

    #[test]
    fn every_slot_has_a_tag_that_maps_to_it() {
        for slot in 0..SLOTS {
            assert_eq!(slot_of_tag(&tag_of_slot(slot)), slot);
        }
        assert!(TAGS.iter().all(|&n| n < 1_000_000), "short tags");
    }
}
