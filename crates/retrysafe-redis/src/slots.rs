//! Redis Cluster hash slots: which slot a key maps to, and for each slot a short hash
//! tag that maps to it, so that the in-flight index can be split into one key per slot
//! without renaming any record key.

use std::sync::LazyLock;

/// The number of hash slots of a Redis Cluster.
pub(crate) const SLOTS: u16 = 16_384;

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
pub(crate) fn slot_of_tag(tag: &str) -> u16 {
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

/// A hash tag (decimal digits) that maps to `slot` (taken modulo [`SLOTS`]).
pub(crate) fn tag_of_slot(slot: u16) -> String {
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
