//! Backoff and jitter: how long to wait before the next attempt.
//!
//! The formulas are those of "Exponential Backoff and Jitter" (AWS Architecture Blog),
//! with `n` the number of retries already made (0 before the first retry):
//!
//! | [`Jitter`] | delay |
//! |---|---|
//! | `None` | `min(cap, base·2ⁿ)` |
//! | `Full` | `random(0, min(cap, base·2ⁿ))` |
//! | `Equal` | `e/2 + random(0, e/2)` with `e = min(cap, base·2ⁿ)` |
//! | `Decorrelated` | `min(cap, random(base, previous·3))`, `previous` starting at `base` |
//!
//! After a throttle (429, `RESOURCE_EXHAUSTED`, 503 with `retry-after`) the base is the
//! separate throttle base. Randomness comes from a [`RetryRng`], which tests seed so
//! every delay is exact.
//!
//! ```
//! use std::time::Duration;
//! use retrysafe::retry::{Backoff, Jitter, RetryRng};
//!
//! let backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(20), Jitter::Full).build()?;
//! let mut rng = RetryRng::seeded(7);
//! let d = backoff.delay(2, Duration::ZERO, false, &mut rng);
//! assert!(d <= Duration::from_millis(200));
//! // The same seed gives the same delays.
//! assert_eq!(d, backoff.delay(2, Duration::ZERO, false, &mut RetryRng::seeded(7)));
//!
//! let exact = Backoff::new(Duration::from_millis(50), Duration::from_secs(20), Jitter::None);
//! assert_eq!(exact.delay(3, Duration::ZERO, false, &mut rng), Duration::from_millis(400));
//! # Ok::<(), retrysafe::ConfigError>(())
//! ```

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::ConfigError;
use crate::config::Validate;
use crate::wire::MAX_TIMEOUT;

/// How a delay is randomised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Jitter {
    /// Exponential without jitter: every client waits the same.
    None,
    /// Uniform in `[0, exponential]`; the default.
    #[default]
    Full,
    /// Half the exponential, plus a uniform share of the other half.
    Equal,
    /// Uniform in `[base, 3·previous]`, capped.
    Decorrelated,
}

/// An exponential backoff with a cap, a separate base after throttling, and jitter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    throttle_base: Duration,
    cap: Duration,
    jitter: Jitter,
}

impl Default for Backoff {
    /// Base 50 ms, 1 s after a throttle, cap 20 s, full jitter.
    fn default() -> Self {
        Backoff {
            base: Duration::from_millis(50),
            throttle_base: Duration::from_secs(1),
            cap: Duration::from_secs(20),
            jitter: Jitter::Full,
        }
    }
}

impl Backoff {
    /// A backoff from `base`, capped at `cap`; the throttle base is `max(base, 1 s)`
    /// capped at `cap`. [`build`](Self::build) refuses a zero cap, a base over the cap,
    /// or more than 30 days; delays never exceed the cap in any case.
    pub fn new(base: Duration, cap: Duration, jitter: Jitter) -> Self {
        Backoff {
            base,
            throttle_base: base.max(Duration::from_secs(1)).min(cap),
            cap,
            jitter,
        }
    }

    /// The base used after a throttle (at most the cap, checked by
    /// [`build`](Self::build)).
    #[doc(hidden)]
    #[must_use]
    pub fn with_throttle_base(mut self, base: Duration) -> Self {
        self.throttle_base = base;
        self
    }

    /// Checks the settings: the error names every one out of range.
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        self.validate(&mut v);
        v.finish(self)
    }

    /// Checks every field into `v`.
    pub(crate) fn validate(&self, v: &mut Validate) {
        v.check(
            !self.cap.is_zero(),
            "backoff cap",
            "must be greater than zero",
        );
        v.check(
            self.cap <= MAX_TIMEOUT,
            "backoff cap",
            "must be at most 30 days",
        );
        v.check(
            self.base <= self.cap,
            "backoff base",
            "must not exceed the cap",
        );
        v.check(
            self.throttle_base <= self.cap,
            "throttle base",
            "must not exceed the cap",
        );
    }

    /// The base.
    #[doc(hidden)]
    pub fn base(&self) -> Duration {
        self.base
    }

    /// The base after a throttle.
    #[doc(hidden)]
    pub fn throttle_base(&self) -> Duration {
        self.throttle_base
    }

    /// The cap.
    #[doc(hidden)]
    pub fn cap(&self) -> Duration {
        self.cap
    }

    /// The jitter.
    #[doc(hidden)]
    pub fn jitter(&self) -> Jitter {
        self.jitter
    }

    /// The exponential part: `min(cap, base·2ⁿ)` (saturating).
    pub fn exponential(&self, retries_so_far: u32, throttled: bool) -> Duration {
        let base = if throttled {
            self.throttle_base
        } else {
            self.base
        };
        let factor = 1u32.checked_shl(retries_so_far.min(31)).unwrap_or(u32::MAX);
        base.checked_mul(factor).unwrap_or(self.cap).min(self.cap)
    }

    /// The delay before the next retry, `retries_so_far` retries having been made;
    /// `previous` is the last delay (for decorrelated jitter; zero at first).
    pub fn delay(
        &self,
        retries_so_far: u32,
        previous: Duration,
        throttled: bool,
        rng: &mut RetryRng,
    ) -> Duration {
        let exp = self.exponential(retries_so_far, throttled);
        match self.jitter {
            Jitter::None => exp,
            Jitter::Full => rng.between(Duration::ZERO, exp),
            Jitter::Equal => {
                let half = exp / 2;
                half + rng.between(Duration::ZERO, exp - half)
            }
            Jitter::Decorrelated => {
                let base = if throttled {
                    self.throttle_base
                } else {
                    self.base
                };
                let previous = previous.max(base);
                let upper = previous.checked_mul(3).unwrap_or(self.cap).min(self.cap);
                rng.between(base.min(upper), upper)
            }
        }
    }
}

/// The random source of retry delays: a small fast generator, seeded.
///
/// Each logical request that retries takes its own `RetryRng` from a [`RngSource`], so
/// concurrent requests never contend on one generator, and a seeded source makes
/// every delay of a test exact.
pub struct RetryRng(SmallRng);

impl RetryRng {
    /// A generator from `seed`: the same seed gives the same delays.
    pub fn seeded(seed: u64) -> Self {
        RetryRng(SmallRng::seed_from_u64(seed))
    }

    /// A generator seeded from the operating system.
    #[doc(hidden)]
    pub fn from_os() -> Self {
        RetryRng(SmallRng::from_os_rng())
    }

    /// A uniform duration in `[low, high]` (nanosecond resolution; `low` if `high <
    /// low`).
    #[doc(hidden)]
    pub fn between(&mut self, low: Duration, high: Duration) -> Duration {
        if high <= low {
            return low;
        }
        let span = u64::try_from((high - low).as_nanos()).unwrap_or(u64::MAX);
        low + Duration::from_nanos(self.0.random_range(0..=span))
    }

    /// A uniform `f64` in `[0, 1)`.
    #[doc(hidden)]
    pub fn unit(&mut self) -> f64 {
        self.0.random::<f64>()
    }
}

impl fmt::Debug for RetryRng {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RetryRng")
    }
}

/// Where a strategy takes each request's [`RetryRng`]: request `n` (counting the
/// requests that retried) gets a generator seeded with `splitmix(splitmix(seed) + n)`.
/// The seed is mixed first, so that two nearby seeds (7 and 8) give unrelated
/// sequences, not one shifted by a request. The seed comes from the OS by default, or
/// is fixed, so tests are deterministic.
#[doc(hidden)]
#[derive(Debug)]
pub struct RngSource {
    seed: u64,
    counter: AtomicU64,
}

impl RngSource {
    /// A source seeded once from the OS.
    pub fn os() -> Self {
        Self::seeded(rand::random())
    }

    /// A deterministic source.
    pub fn seeded(seed: u64) -> Self {
        RngSource {
            seed: splitmix64(seed),
            counter: AtomicU64::new(0),
        }
    }

    /// The generator for the next request.
    pub fn next_rng(&self) -> RetryRng {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        RetryRng::seeded(splitmix64(self.seed.wrapping_add(n)))
    }
}

impl Default for RngSource {
    fn default() -> Self {
        Self::os()
    }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Backoff, RngSource};

    /// The delays of the next `n` requests of `source`.
    fn delays(source: &RngSource, n: usize) -> Vec<Duration> {
        let backoff = Backoff::default();
        (0..n)
            .map(|_| backoff.delay(5, Duration::ZERO, false, &mut source.next_rng()))
            .collect()
    }

    // Nearby seeds give unrelated sequences, not one sequence shifted by a request.
    #[test]
    fn nearby_seeds_are_not_shifted_copies_of_one_sequence() {
        let seven = delays(&RngSource::seeded(7), 9);
        let eight = delays(&RngSource::seeded(8), 8);
        assert_ne!(seven.get(1..), eight.get(..8));
        assert_eq!(seven, delays(&RngSource::seeded(7), 9), "a seed repeats");
    }
}
