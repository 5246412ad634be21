//! Hashing for maps keyed by a SHA-256 (a record id, a scope, a prefix of one).
//!
//! Their bytes are already uniform, so SipHash (the std default) spends its rounds on
//! nothing: one folded multiply per 16 bytes mixes them into a bucket index. The
//! multiply is keyed with a random seed per map, so a client that grinds keys until
//! their hashes share leading bits still cannot aim them at one bucket.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

/// A [`BuildHasher`] for keys that are hashes: a random seed, drawn once per map.
#[derive(Debug, Clone, Copy)]
pub struct DigestHash {
    seed: [u64; 2],
}

impl Default for DigestHash {
    fn default() -> Self {
        let random = RandomState::new();
        DigestHash {
            seed: [random.hash_one(1u8), random.hash_one(2u8)],
        }
    }
}

impl BuildHasher for DigestHash {
    type Hasher = DigestHasher;

    fn build_hasher(&self) -> DigestHasher {
        DigestHasher {
            seed: self.seed,
            state: self.seed[0],
        }
    }
}

/// The [`Hasher`] of [`DigestHash`].
#[derive(Debug, Clone, Copy)]
pub struct DigestHasher {
    seed: [u64; 2],
    state: u64,
}

/// The low and high halves of `x`.
#[allow(clippy::cast_possible_truncation, reason = "splitting into halves")]
fn halves(x: u128) -> (u64, u64) {
    (x as u64, (x >> 64) as u64)
}

/// The high and low halves of the 128-bit product, folded together.
fn fold(a: u64, b: u64) -> u64 {
    let (lo, hi) = halves(u128::from(a) * u128::from(b));
    lo ^ hi
}

impl Hasher for DigestHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(16) {
            let mut block = [0u8; 16];
            for (to, from) in block.iter_mut().zip(chunk) {
                *to = *from;
            }
            let (a, b) = halves(u128::from_le_bytes(block));
            self.state = fold(self.state ^ a ^ self.seed[0], b ^ self.seed[1]);
        }
    }

    fn write_usize(&mut self, n: usize) {
        // The length prefix of a slice: mixed in by the next block.
        self.state ^= n as u64;
    }

    fn finish(&self) -> u64 {
        self.state
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::hash::BuildHasher;

    use super::*;

    #[test]
    fn different_ids_hash_apart_and_the_same_id_alike() {
        let h = DigestHash::default();
        let ids: Vec<[u8; 32]> = (0u8..=255).map(|i| [i; 32]).collect();
        let hashes: HashSet<u64> = ids.iter().map(|id| h.hash_one(id)).collect();
        assert_eq!(hashes.len(), ids.len());
        assert_eq!(h.hash_one([7u8; 32]), h.hash_one([7u8; 32]));
        // Ids that differ only past the first 16 bytes still differ.
        let mut a = [0u8; 32];
        let b = a;
        a[31] = 1;
        assert_ne!(h.hash_one(a), h.hash_one(b));
    }
}
