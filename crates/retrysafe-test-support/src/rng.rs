//! A small seeded RNG, and seeds that a failing run prints so that it can be repeated.

use std::time::{SystemTime, UNIX_EPOCH};

/// SplitMix64: no dependency, good enough to pick faults, crash points and workloads.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// The stream of `seed`.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`, from the top 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        #[allow(clippy::cast_precision_loss, reason = "53 bits fit an f64 exactly")]
        let (bits, scale) = ((self.next_u64() >> 11) as f64, (1u64 << 53) as f64);
        bits / scale
    }

    /// Uniform in `0..n` (`n > 0`; the modulo bias is irrelevant here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Uniform in `lo..hi` (`lo` when the range is empty).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            lo
        } else {
            lo + self.next_u64() % (hi - lo)
        }
    }

    /// True with probability `per_mille / 1000`.
    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }

    /// True with probability `1 / n`.
    pub fn one_in(&mut self, n: u64) -> bool {
        self.range(0, n.max(1)) == 0
    }

    /// Uniform in `0..=max`, to the microsecond.
    pub fn duration_up_to(&mut self, max: std::time::Duration) -> std::time::Duration {
        let micros = u64::try_from(max.as_micros()).unwrap_or(u64::MAX);
        std::time::Duration::from_micros(self.below(micros.saturating_add(1)))
    }
}

/// A seed from the environment variable `var` when set (decimal or `0x` hex), else a
/// fresh one from the wall clock; printed either way, with what it seeds, so that a run
/// can be repeated.
pub fn seed_from_env(var: &str, what: &str) -> u64 {
    let seed = std::env::var(var)
        .ok()
        .and_then(|v| {
            let v = v.trim();
            match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).ok(),
                None => v.parse().ok(),
            }
        })
        .unwrap_or_else(|| {
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            #[allow(
                clippy::cast_possible_truncation,
                reason = "the low bits are the random ones"
            )]
            let nanos = nanos as u64;
            SplitMix64::new(nanos ^ u64::from(std::process::id())).next_u64()
        });
    eprintln!("{what}: {var}={seed} (set {var} to repeat this run)");
    seed
}

/// A whole number from the environment variable `var`, or `default`.
pub fn env_number(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(default)
}
