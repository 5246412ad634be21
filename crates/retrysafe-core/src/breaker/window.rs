//! The sliding windows a closed breaker counts its calls in.
//!
//! # Layout
//!
//! A window is a ring of buckets (see [`ring`](crate::ring)); each bucket is one
//! `AtomicU64` that packs the bucket's *lap* (its epoch divided by the number of
//! buckets, modulo 2^22) in the high 22 bits and three 14-bit counts below — successes,
//! failures and slow calls (slow calls are also successes or failures) — so recording a
//! call and rotating the bucket to a new lap are one compare-and-swap: a rotation cannot
//! lose or misplace a concurrent increment. Reading the window sums the buckets whose
//! lap is the one their slot has in the current window.
//!
//! A **time window**'s epoch is the time since the window was created divided by the
//! bucket width. It keeps one ring per stripe (one stripe per thread, chosen by a
//! thread-local index; rings are 128 bytes apart), so recording threads do not write
//! to a shared cache line; a read sums every ring. A bucket that would overflow one of
//! its counts (16383 calls of one thread in one bucket) halves all three first: rates
//! are kept, but the calls of a very busy bucket weigh less against other buckets.
//! Once per lap, the thread that rotates a bucket into the new lap clears the buckets
//! of every ring that are older than the window, so a ring left alone (a thread that
//! exited) cannot come back into the window when its lap wraps; only a window that no
//! call at all touched for 2^21 laps (24 days for the shortest, 1 s, window) may, when
//! calls resume, take one of its old buckets (a chance of one in 2^22 per bucket) for
//! a current one.
//!
//! A **count window**'s epoch is the number of calls recorded before this one divided
//! by the bucket size, from one shared counter; it has one ring. Buckets hold at most
//! 10 000 calls, so they never overflow.

use std::fmt;
use std::num::NonZeroU64;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use super::config::SlidingWindow;
use crate::ring::{Layout, Ring, Window as Laps};
use crate::stripe::{EpochClock, stripe_count, thread_stripe};
use crate::sync::AtomicU64;

/// Bits of each count.
const COUNT_BITS: u32 = 14;
/// The largest count (and the mask of one count).
const COUNT_MAX: u64 = (1 << COUNT_BITS) - 1;
/// Where the successes are.
const SUCCESS_SHIFT: u32 = 2 * COUNT_BITS;
/// Where the failures are.
const FAILURE_SHIFT: u32 = COUNT_BITS;
/// Padding, in words, before the first ring and after each ring of a time window: 128
/// bytes, so two rings never share a pair of cache lines.
const PAD_WORDS: usize = 16;

/// A window's bucket word: the lap in the high 22 bits, then the successes, the
/// failures and the slow calls, 14 bits each.
#[derive(Debug)]
enum Calls {}

impl Layout for Calls {
    const LAP_SHIFT: u32 = 3 * COUNT_BITS;
    // Buckets are cleared to zero by a reset and by the sweep of stale laps.
    const ZERO_IS_FREE: bool = true;
}

/// The calls a window holds: what the breaker's rates are computed from.
///
/// ```
/// use retrysafe::breaker::CircuitBreaker;
/// use retrysafe::classify::BreakerOutcome;
/// use std::time::Duration;
///
/// let breaker = CircuitBreaker::default();
/// breaker.try_acquire().unwrap().record(BreakerOutcome::Failure, Duration::ZERO);
/// breaker.try_acquire().unwrap().record(BreakerOutcome::Success, Duration::ZERO);
/// let counts = breaker.window();
/// assert_eq!((counts.successes, counts.failures, counts.slow_calls), (1, 1, 0));
/// assert_eq!(counts.calls(), 2);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub struct WindowCounts {
    /// Calls that succeeded (slow ones included).
    pub successes: u64,
    /// Calls that failed (slow ones included).
    pub failures: u64,
    /// Calls that took at least the slow-call duration, successes and failures alike.
    pub slow_calls: u64,
}

impl WindowCounts {
    /// All counted calls: successes and failures (neutral outcomes are never counted).
    pub fn calls(&self) -> u64 {
        self.successes.saturating_add(self.failures)
    }

    /// Adds another window's counts.
    fn add(&mut self, other: WindowCounts) {
        self.successes = self.successes.saturating_add(other.successes);
        self.failures = self.failures.saturating_add(other.failures);
        self.slow_calls = self.slow_calls.saturating_add(other.slow_calls);
    }
}

/// One call to count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Call {
    /// It failed.
    pub(super) failure: bool,
    /// It was slow.
    pub(super) slow: bool,
}

/// A sliding window of either kind.
#[derive(Debug)]
pub(super) enum Window {
    /// Calls of the last stretch of time.
    Time(TimeWindow),
    /// The last calls.
    Count(CountWindow),
}

impl Window {
    /// An empty window (of a validated configuration).
    pub(super) fn new(config: SlidingWindow) -> Self {
        match config {
            SlidingWindow::Time { length, buckets } => {
                Window::Time(TimeWindow::new(length, buckets))
            }
            SlidingWindow::Count { calls, buckets } => {
                Window::Count(CountWindow::new(calls, buckets))
            }
        }
    }

    /// Counts one call.
    pub(super) fn record(&self, call: Call) {
        match self {
            Window::Time(w) => w.record(call),
            Window::Count(w) => w.record(call),
        }
    }

    /// The calls in the window now.
    pub(super) fn counts(&self) -> WindowCounts {
        match self {
            Window::Time(w) => w.counts(),
            Window::Count(w) => w.counts(),
        }
    }

    /// Empties the window.
    pub(super) fn reset(&self) {
        let words = match self {
            Window::Time(w) => &w.words[..],
            Window::Count(w) => w.ring.cells(),
        };
        for word in words.iter() {
            word.store(0, Relaxed);
        }
    }
}

/// A time window: one ring of buckets per stripe.
pub(super) struct TimeWindow {
    /// Epochs of one bucket width each.
    clock: EpochClock,
    /// Buckets per ring (1 to [`MAX_TIME_BUCKETS`]).
    buckets: NonZeroU64,
    /// Words from the start of one ring to the start of the next.
    stride: usize,
    /// The number of rings less one (a power of two less one).
    stripe_mask: usize,
    /// The latest lap whose stale buckets were cleared.
    swept_lap: AtomicU64,
    /// [`PAD_WORDS`], then each ring followed by [`PAD_WORDS`].
    words: Box<[AtomicU64]>,
}

impl TimeWindow {
    /// An empty window of `length` in `buckets` buckets (validated).
    fn new(length: Duration, buckets: u32) -> Self {
        let buckets = NonZeroU64::new(u64::from(buckets)).unwrap_or(NonZeroU64::MIN);
        let ring = usize::try_from(buckets.get()).unwrap_or(1);
        let stride = ring + PAD_WORDS;
        let stripes = stripe_count();
        TimeWindow {
            clock: EpochClock::new(length, buckets),
            buckets,
            stride,
            stripe_mask: stripes - 1,
            swept_lap: AtomicU64::new(0),
            words: (0..PAD_WORDS + stripes * stride)
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }

    /// The ring of stripe `stripe`.
    #[inline]
    fn ring(&self, stripe: usize) -> Ring<&[AtomicU64], Calls> {
        let start = PAD_WORDS + stripe * self.stride;
        let end = start + self.stride - PAD_WORDS;
        Ring::new(self.words.get(start..end).unwrap_or_default())
    }

    /// Counts one call in this thread's ring.
    fn record(&self, call: Call) {
        let ring = self.ring(thread_stripe() & self.stripe_mask);
        let rotated = ring.add(&self.clock, self.clock.epoch(), |counts| {
            Some(bits_of(add(counts_of(counts), call)))
        });
        if let Some(epoch) = rotated {
            self.sweep(epoch);
        }
    }

    /// Once per lap: clears the buckets of every ring that are older than the window
    /// ending at `epoch`.
    fn sweep(&self, epoch: u64) {
        let full_lap = epoch / self.buckets;
        if self.swept_lap.fetch_max(full_lap, Relaxed) >= full_lap {
            return;
        }
        let laps = Laps::new::<Calls>(epoch, self.buckets);
        for stripe in 0..=self.stripe_mask {
            self.ring(stripe).clear_older(&laps);
        }
    }

    /// The calls in the window now, over every ring.
    fn counts(&self) -> WindowCounts {
        let laps = Laps::new::<Calls>(self.clock.epoch(), self.buckets);
        (0..=self.stripe_mask).fold(WindowCounts::default(), |total, stripe| {
            self.ring(stripe)
                .fold(&laps, Relaxed, None, total, add_word)
        })
    }
}

impl fmt::Debug for TimeWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TimeWindow")
            .field("bucket_width", &self.clock.width())
            .field("buckets", &self.buckets)
            .field("stripes", &(self.stripe_mask + 1))
            .field("now", &self.counts())
            .finish()
    }
}

/// A count window: one ring, epochs from a shared call counter.
pub(super) struct CountWindow {
    /// Calls recorded so far.
    seq: AtomicU64,
    /// Calls per bucket.
    per_bucket: NonZeroU64,
    /// The ring.
    ring: Ring<Box<[AtomicU64]>, Calls>,
}

impl CountWindow {
    /// An empty window of `calls` calls in `buckets` buckets (validated).
    fn new(calls: u32, buckets: u32) -> Self {
        let buckets = NonZeroU64::new(u64::from(buckets)).unwrap_or(NonZeroU64::MIN);
        CountWindow {
            seq: AtomicU64::new(0),
            per_bucket: NonZeroU64::new(u64::from(calls) / buckets).unwrap_or(NonZeroU64::MIN),
            ring: Ring::new((0..buckets.get()).map(|_| AtomicU64::new(0)).collect()),
        }
    }

    /// Counts one call.
    fn record(&self, call: Call) {
        let epoch = self.seq.fetch_add(1, Relaxed) / self.per_bucket;
        let (slot, lap) = self.ring.position(epoch);
        let Some(cell) = self.ring.bucket(slot) else {
            return;
        };
        let mut word = cell.load(Relaxed);
        loop {
            let counts = if lap_of(word) == lap || is_empty(word) {
                counts_of(word)
            } else if Calls::is_older(lap_of(word), lap) {
                WindowCounts::default()
            } else {
                // The bucket already moved on past this call's: too late to count.
                return;
            };
            let next = pack(lap, add(counts, call));
            match cell.compare_exchange_weak(word, next, Relaxed, Relaxed) {
                Ok(_) => return,
                Err(actual) => word = actual,
            }
        }
    }

    /// The calls in the window now.
    fn counts(&self) -> WindowCounts {
        let Some(last) = self.seq.load(Relaxed).checked_sub(1) else {
            return WindowCounts::default();
        };
        let laps = self.ring.window(last / self.per_bucket);
        self.ring
            .fold(&laps, Relaxed, None, WindowCounts::default(), add_word)
    }
}

impl fmt::Debug for CountWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountWindow")
            .field("calls_per_bucket", &self.per_bucket)
            .field("buckets", &self.ring.buckets())
            .field("now", &self.counts())
            .finish()
    }
}

/// `counts` with one more call, halving all three counts first if one would overflow.
fn add(mut counts: WindowCounts, call: Call) -> WindowCounts {
    let full = if call.failure {
        counts.failures
    } else {
        counts.successes
    } >= COUNT_MAX
        || (call.slow && counts.slow_calls >= COUNT_MAX);
    if full {
        counts.successes /= 2;
        counts.failures /= 2;
        counts.slow_calls = (counts.slow_calls / 2).min(counts.calls());
    }
    if call.failure {
        counts.failures += 1;
    } else {
        counts.successes += 1;
    }
    if call.slow {
        counts.slow_calls += 1;
    }
    counts
}

/// A bucket word.
fn pack(lap: u64, counts: WindowCounts) -> u64 {
    Calls::pack(lap, bits_of(counts))
}

/// The counts' bits of a bucket word.
fn bits_of(counts: WindowCounts) -> u64 {
    ((counts.successes & COUNT_MAX) << SUCCESS_SHIFT)
        | ((counts.failures & COUNT_MAX) << FAILURE_SHIFT)
        | (counts.slow_calls & COUNT_MAX)
}

/// The lap of a bucket word.
fn lap_of(word: u64) -> u64 {
    Calls::lap_of(word)
}

/// The counts of a bucket word (or of its counts alone).
fn counts_of(word: u64) -> WindowCounts {
    WindowCounts {
        successes: (word >> SUCCESS_SHIFT) & COUNT_MAX,
        failures: (word >> FAILURE_SHIFT) & COUNT_MAX,
        slow_calls: word & COUNT_MAX,
    }
}

/// `total` with the counts of a bucket word added.
fn add_word(mut total: WindowCounts, counts: u64) -> WindowCounts {
    total.add(counts_of(counts));
    total
}

/// Whether a bucket word counts nothing (it may then be taken over by any lap).
fn is_empty(word: u64) -> bool {
    Calls::counts_of(word) == 0
}

// The unit tests use std threads and a tokio runtime, which loom atomics refuse.
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::ring::NO_LAP;

    const LAP_MASK: u64 = Calls::LAP_MASK;

    fn counts(successes: u64, failures: u64, slow_calls: u64) -> WindowCounts {
        WindowCounts {
            successes,
            failures,
            slow_calls,
        }
    }

    #[test]
    fn packing_round_trips() {
        let c = counts(COUNT_MAX, 7, 3);
        let word = pack(LAP_MASK, c);
        assert_eq!(lap_of(word), LAP_MASK);
        assert_eq!(counts_of(word), c);
        assert_eq!(
            pack(LAP_MASK, counts(COUNT_MAX, COUNT_MAX, COUNT_MAX)),
            u64::MAX
        );
        assert!(is_empty(pack(5, WindowCounts::default())));
        assert!(!is_empty(pack(0, counts(0, 0, 1))));
    }

    #[test]
    fn a_full_count_halves_the_bucket() {
        let failure = Call {
            failure: true,
            slow: false,
        };
        let c = add(counts(100, COUNT_MAX, 3), failure);
        assert_eq!(c, counts(50, COUNT_MAX / 2 + 1, 1));
        let slow = Call {
            failure: false,
            slow: true,
        };
        assert_eq!(add(counts(1, 1, COUNT_MAX), slow), counts(1, 0, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_lap_clears_the_stale_buckets_of_every_ring() {
        let nonempty = |w: &TimeWindow| {
            w.words
                .iter()
                .filter(|c| !is_empty(c.load(Relaxed)))
                .count()
        };
        let failure = Call {
            failure: true,
            slow: false,
        };
        // 1 s in 10 buckets of 100 ms: a lap is 1 s.
        let window = TimeWindow::new(Duration::from_secs(1), 10);
        let handle = tokio::runtime::Handle::current();
        std::thread::scope(|s| {
            s.spawn(|| {
                let _runtime = handle.enter();
                window.record(failure); // epoch 0, on that thread's ring
            });
        });
        assert_eq!(nonempty(&window), 1);
        tokio::time::advance(Duration::from_millis(1_500)).await;
        assert_eq!(window.counts(), WindowCounts::default());
        window.record(failure); // epoch 15: the first rotation of lap 1 sweeps
        assert_eq!(
            nonempty(&window),
            1,
            "the exited thread's bucket was cleared"
        );
        assert_eq!(window.counts().failures, 1);
    }

    /// The laps of the window of `buckets` buckets ending at `epoch`, slot by slot.
    fn window_laps(epoch: u64, buckets: NonZeroU64) -> Vec<u64> {
        let laps = Laps::new::<Calls>(epoch, buckets);
        (0..usize::try_from(buckets.get()).unwrap_or(0))
            .map(|slot| laps.lap(slot))
            .collect()
    }

    fn position(epoch: u64, buckets: NonZeroU64) -> (usize, u64) {
        let ring = Ring::<Vec<AtomicU64>, Calls>::new(
            (0..buckets.get()).map(|_| AtomicU64::new(0)).collect(),
        );
        ring.position(epoch)
    }

    fn is_older(a: u64, b: u64) -> bool {
        Calls::is_older(a, b)
    }

    #[test]
    fn laps_of_the_window() {
        let ten = NonZeroU64::new(10).unwrap_or(NonZeroU64::MIN);
        let laps = window_laps(0, ten);
        assert_eq!(laps.get(..3), Some(&[0, NO_LAP, NO_LAP][..]));
        // Epoch 23 is slot 3 of lap 2; the window is epochs 14..=23.
        let laps = window_laps(23, ten);
        assert_eq!(laps.get(..10), Some(&[2, 2, 2, 2, 1, 1, 1, 1, 1, 1][..]));
        assert_eq!(position(23, ten), (3, 2));
        assert!(is_older(1, 2));
        assert!(!is_older(2, 2));
        assert!(!is_older(3, 2));
        assert!(is_older(LAP_MASK, 0)); // wrapped
    }
}
