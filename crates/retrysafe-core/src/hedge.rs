//! What a hedging client decides with: when to send a hedge ([`HedgeDelay`], from a
//! [`LatencyTracker`] of recent latencies), and the mark a hedge carries through a
//! retrying layer below.
//!
//! A hedge is a second copy of a request, sent when the first has taken longer than
//! most answers do: the latency tail of one slow server is cut at the price of a few
//! extra calls. The tracker keeps a log-linear histogram (16 steps per power of two, so
//! a percentile is within about 6 %) of the latencies of the last window, in two
//! generations that take turns, and recomputes the percentile every few samples.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::time::Duration;
//! use retrysafe_core::__private::{HedgeDelay, LatencyTracker};
//!
//! let tracker = LatencyTracker::new(0.9, Duration::from_secs(30));
//! let delay = HedgeDelay::Percentile(tracker.clone());
//! assert_eq!(delay.delay(), None, "no hedge before enough samples");
//! for ms in 1..=100u64 {
//!     tracker.record(Duration::from_millis(ms));
//! }
//! let p90 = tracker.percentile().unwrap();
//! assert!(p90 >= Duration::from_millis(90) && p90 <= Duration::from_millis(96));
//! // A floor of 10 ms by default, and a fixed delay as it is.
//! assert_eq!(delay.delay(), Some(p90));
//! assert_eq!(HedgeDelay::Fixed(Duration::from_millis(5)).delay(), Some(Duration::from_millis(5)));
//! # }
//! ```

use std::fmt;
use std::num::NonZeroU64;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::time::Duration;

use crate::budget::BudgetId;
use crate::stripe::{EpochClock, nanos};
use crate::sync::{Arc, AtomicU64};

/// Steps per power of two.
const SUB: u64 = 16;
/// [`SUB`] as a `usize`.
const SUB_USIZE: usize = 16;
/// log2 of [`SUB`].
const SUB_BITS: u32 = 4;
/// Histogram buckets: exact below [`SUB`] µs, then [`SUB`] per power of two up to 2^36 µs.
#[cfg(not(loom))]
const HIST_BUCKETS: usize = SUB_USIZE * 34;
/// Under loom, the first four exact buckets (latencies below 4 µs): a model's
/// recomputation reads few atomics.
#[cfg(loom)]
const HIST_BUCKETS: usize = 4;
/// Samples between two recomputations of the percentile.
#[cfg(not(loom))]
const RECOMPUTE_EVERY: u64 = 16;
/// Under loom, every second sample recomputes.
#[cfg(loom)]
const RECOMPUTE_EVERY: u64 = 2;
/// Samples the window must hold before a percentile is given.
#[cfg(not(loom))]
pub(crate) const MIN_SAMPLES: u64 = 20;
/// Samples the window must hold before a percentile is given (2 under loom, so a
/// model's few samples give one).
#[cfg(loom)]
pub(crate) const MIN_SAMPLES: u64 = 2;
/// A generation's epoch while one thread clears it for a new one: never live.
const CLEARING: u64 = u64::MAX;
/// The shortest delay a percentile gives: hedging faster than this mostly adds load.
pub(crate) const MIN_PERCENTILE_DELAY: Duration = Duration::from_millis(10);

/// Marks a copy of a request sent by a hedging layer, for a `RetryLayer` below it: the
/// copy is made once and passed through (the hedging layer decides what it is worth),
/// and it makes no deposit into a budget (the request it copies made the one deposit;
/// the hedge was withdrawn from `budget` already).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct HedgeCopy {
    /// The budget the hedge was withdrawn from.
    pub budget: Option<BudgetId>,
}

impl HedgeCopy {
    /// The mark of a hedge withdrawn from `budget`.
    pub fn new(budget: Option<BudgetId>) -> Self {
        HedgeCopy { budget }
    }
}

/// Shared by the copies of one hedged request: settled once an answer won, so that a
/// copy dropped after that is known to be cancelled by the hedge (neutral to breakers),
/// not abandoned by its caller; and marked once the request's deposit into the retry
/// budget is made, so that it is made once, by a retrying layer below or else by the
/// hedging layer.
#[doc(hidden)]
#[derive(Debug, Clone, Default)]
pub struct HedgeRace(std::sync::Arc<std::sync::atomic::AtomicU8>);

/// [`HedgeRace`]: an answer won.
const SETTLED: u8 = 1;
/// [`HedgeRace`]: the request's deposit is made.
const DEPOSITED: u8 = 2;

impl HedgeRace {
    /// A race not settled yet, its request's deposit not made.
    pub fn new() -> Self {
        Self::default()
    }

    /// An answer won: the other copies are being cancelled.
    pub fn settle(&self) {
        self.0
            .fetch_or(SETTLED, std::sync::atomic::Ordering::Release);
    }

    /// Whether an answer won.
    pub fn is_settled(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire) & SETTLED != 0
    }

    /// Marks the request's deposit made; `true` when no one had marked it before.
    pub fn claim_deposit(&self) -> bool {
        self.0
            .fetch_or(DEPOSITED, std::sync::atomic::Ordering::AcqRel)
            & DEPOSITED
            == 0
    }
}

/// When to send a hedge.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum HedgeDelay {
    /// After a fixed delay.
    Fixed(Duration),
    /// After the tracker's percentile of recent latencies (at least
    /// `MIN_PERCENTILE_DELAY`, 10 ms); no hedge until it has `MIN_SAMPLES` (20).
    Percentile(LatencyTracker),
}

impl HedgeDelay {
    /// The delay now, or `None` when no hedge should be sent (too few samples yet).
    pub fn delay(&self) -> Option<Duration> {
        match self {
            HedgeDelay::Fixed(d) => Some(*d),
            HedgeDelay::Percentile(t) => t.percentile().map(|p| p.max(MIN_PERCENTILE_DELAY)),
        }
    }

    /// Records the latency of a completed call (a fixed delay ignores it).
    pub fn record(&self, latency: Duration) {
        if let HedgeDelay::Percentile(t) = self {
            t.record(latency);
        }
    }
}

/// One generation of the histogram.
struct Generation {
    /// The epoch this generation counts for.
    epoch: AtomicU64,
    counts: Box<[AtomicU64]>,
}

struct Tracker {
    /// The percentile, from 0 to 1.
    quantile: f64,
    clock: EpochClock,
    generations: [Generation; 2],
    /// Samples recorded since the tracker was made.
    samples: AtomicU64,
    /// The last percentile computed, in nanoseconds plus one (0: none yet).
    cached: AtomicU64,
}

/// A rolling percentile of latencies: a cheap `Clone` handle on shared, lock-free
/// state. See the module documentation (`hedge.rs`).
#[derive(Clone)]
pub struct LatencyTracker {
    inner: Arc<Tracker>,
}

impl LatencyTracker {
    /// A tracker of the `quantile` (from 0 to 1; 0.95 for p95; clamped, NaN is 0.95) of
    /// the latencies of the last `window` (at least 1 ms).
    pub fn new(quantile: f64, window: Duration) -> Self {
        let quantile = if quantile.is_nan() {
            0.95
        } else {
            quantile.clamp(0.0, 1.0)
        };
        let generation = || Generation {
            epoch: AtomicU64::new(0),
            counts: (0..HIST_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
        };
        LatencyTracker {
            inner: Arc::new(Tracker {
                quantile,
                clock: EpochClock::new(window.max(Duration::from_millis(1)), NonZeroU64::MIN),
                generations: [generation(), generation()],
                samples: AtomicU64::new(0),
                cached: AtomicU64::new(0),
            }),
        }
    }

    /// Records one latency.
    pub fn record(&self, latency: Duration) {
        let t = &*self.inner;
        let epoch = t.clock.epoch();
        let generation = t.current(epoch);
        if let Some(c) = generation.counts.get(bucket_of(latency)) {
            c.fetch_add(1, Relaxed);
        }
        let n = t.samples.fetch_add(1, Relaxed) + 1;
        if n.is_multiple_of(RECOMPUTE_EVERY) || n == MIN_SAMPLES {
            t.recompute(epoch);
        }
    }

    /// The percentile of the window, as last computed; `None` before `MIN_SAMPLES` (20).
    pub fn percentile(&self) -> Option<Duration> {
        self.inner
            .cached
            .load(Relaxed)
            .checked_sub(1)
            .map(Duration::from_nanos)
    }
}

impl Tracker {
    /// The generation of `epoch`, cleared first if it still holds an older epoch's.
    ///
    /// The thread that moves a generation on marks it [`CLEARING`], clears it, and
    /// only then publishes the new epoch (release): a recomputation that reads the new
    /// epoch (acquire) reads no count of the old one. A generation never moves back to
    /// an older epoch (a thread still in the old epoch counts into the new one).
    fn current(&self, epoch: u64) -> &Generation {
        let [even, odd] = &self.generations;
        let generation = if epoch.is_multiple_of(2) { even } else { odd };
        let seen = generation.epoch.load(Acquire);
        if seen < epoch
            && generation
                .epoch
                .compare_exchange(seen, CLEARING, Acquire, Relaxed)
                .is_ok()
        {
            // A sample another thread adds while this clears may be lost: an estimate
            // of a percentile can afford it.
            for c in &*generation.counts {
                c.store(0, Relaxed);
            }
            generation.epoch.store(epoch, Release);
        }
        generation
    }

    /// Recomputes the percentile over this epoch's and the previous one's samples.
    fn recompute(&self, epoch: u64) {
        let live = |g: &Generation| {
            let e = g.epoch.load(Acquire);
            e == epoch || Some(e) == epoch.checked_sub(1)
        };
        let mut merged = [0u64; HIST_BUCKETS];
        for g in self.generations.iter().filter(|g| live(g)) {
            for (m, c) in merged.iter_mut().zip(&*g.counts) {
                *m = m.saturating_add(c.load(Relaxed));
            }
        }
        let total = merged.iter().fold(0u64, |a, &c| a.saturating_add(c));
        if total < MIN_SAMPLES {
            self.cached.store(0, Relaxed);
            return;
        }
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss,
            reason = "a rank between 1 and `total`; `as` saturates"
        )]
        let rank = ((self.quantile * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0u64;
        for (index, &count) in merged.iter().enumerate() {
            seen = seen.saturating_add(count);
            if seen >= rank {
                let nanos = upper_bound_micros(index).saturating_mul(1000);
                self.cached.store(nanos.saturating_add(1), Relaxed);
                return;
            }
        }
    }
}

/// The histogram bucket of a latency (in whole microseconds).
fn bucket_of(latency: Duration) -> usize {
    let micros = nanos(latency) / 1000;
    let index = if micros < SUB {
        micros
    } else {
        let exponent = u64::from(63 - micros.leading_zeros());
        let mantissa = (micros >> (exponent - u64::from(SUB_BITS))) & (SUB - 1);
        (exponent - u64::from(SUB_BITS) + 1) * SUB + mantissa
    };
    usize::try_from(index)
        .unwrap_or(usize::MAX)
        .min(HIST_BUCKETS - 1)
}

/// The largest latency (in microseconds) in histogram bucket `index`.
fn upper_bound_micros(index: usize) -> u64 {
    let index = index as u64;
    if index < SUB {
        return index;
    }
    let exponent = index / SUB + u64::from(SUB_BITS) - 1;
    let mantissa = index % SUB;
    let step = 1u64 << (exponent - u64::from(SUB_BITS));
    ((SUB + mantissa) * step).saturating_add(step - 1)
}

impl fmt::Debug for LatencyTracker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LatencyTracker")
            .field("quantile", &self.inner.quantile)
            .field("percentile", &self.percentile())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn buckets_bound_their_latencies() {
        for micros in [
            0u64, 1, 15, 16, 17, 100, 1_000, 12_345, 1_000_000, 99_999_999,
        ] {
            let index = bucket_of(Duration::from_micros(micros));
            let upper = upper_bound_micros(index);
            assert!(upper >= micros, "{micros} in bucket {index} up to {upper}");
            assert!(
                upper <= micros + micros / 16 + 1,
                "{micros}: {upper} too coarse"
            );
            if index > 0 {
                assert!(upper_bound_micros(index - 1) < micros);
            }
        }
        assert_eq!(bucket_of(Duration::MAX), HIST_BUCKETS - 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_window_rolls() {
        let t = LatencyTracker::new(0.5, Duration::from_secs(10));
        for _ in 0..32 {
            t.record(Duration::from_millis(100));
        }
        let p = t.percentile().unwrap_or_default();
        assert!(p >= Duration::from_millis(100) && p < Duration::from_millis(107));
        // Next window: the old samples still count, then they are gone.
        tokio::time::advance(Duration::from_secs(10)).await;
        for _ in 0..48 {
            t.record(Duration::from_millis(1));
        }
        assert!(t.percentile().unwrap_or_default() < Duration::from_millis(2));
        tokio::time::advance(Duration::from_secs(20)).await;
        for _ in 0..16 {
            t.record(Duration::from_millis(1));
        }
        assert_eq!(t.percentile(), None, "16 samples in the window");
    }
}
