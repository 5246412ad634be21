//! Cache padding, the per-thread stripe index and the bucket clock shared by the
//! striped counters of the ratio budget and of the breaker's time window.

use std::cell::Cell;
use std::num::NonZeroU64;
use std::sync::OnceLock;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::time::Duration;

use tokio::time::Instant;

/// Aligns (and so pads) its content to 128 bytes: two 64-byte cache lines, because
/// adjacent-line prefetchers on x86 pull lines in pairs. Two values in different
/// `CachePadded`s never share a line, so writes to one do not slow down the other.
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct CachePadded<T>(pub(crate) T);

/// The next stripe index to hand out to a thread that touches a striped counter for
/// the first time.
static NEXT_STRIPE: AtomicUsize = AtomicUsize::new(0);

/// Marks a thread that has no stripe index yet.
const UNASSIGNED: usize = usize::MAX;

thread_local! {
    /// This thread's stripe index, assigned round-robin on first use. Const-initialised
    /// and without a destructor, so reading it is one thread-local load.
    static STRIPE: Cell<usize> = const { Cell::new(UNASSIGNED) };
}

/// This thread's stripe index (any `usize`; callers reduce it modulo their stripe
/// count).
pub(crate) fn thread_stripe() -> usize {
    STRIPE
        .try_with(|stripe| {
            let index = stripe.get();
            if index != UNASSIGNED {
                return index;
            }
            let index = NEXT_STRIPE.fetch_add(1, Relaxed) & (usize::MAX >> 1);
            stripe.set(index);
            index
        })
        .unwrap_or(0)
}

/// How many stripes a striped counter has (the deposit rings of a ratio budget, the
/// rings of a breaker's time window): four per available core rounded up to a power of
/// two, at least 8 and at most 64. More stripes than cores make two busy threads
/// unlikely to share one even though indices are handed out to every thread (runtime
/// workers, blocking threads) that touches a counter; the cap bounds what a read of
/// every stripe costs and the memory of a counter (64 × 128 bytes for a budget).
pub(crate) fn stripe_count() -> usize {
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        cores.saturating_mul(4).next_power_of_two().clamp(8, 64)
    })
}

/// A duration in nanoseconds, saturating (at about 584 years).
pub(crate) fn nanos(d: Duration) -> u64 {
    d.as_secs()
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::from(d.subsec_nanos()))
}

/// Time cut into buckets of equal width: the *epoch* is the number of bucket widths
/// elapsed since the clock was created. Time comes from [`tokio::time::Instant`], so the
/// clock follows a paused test clock.
#[derive(Debug)]
pub(crate) struct EpochClock {
    /// Epoch zero.
    start: Instant,
    /// The width of one bucket.
    width_nanos: NonZeroU64,
    /// The latest epoch computed (read-mostly: written once per bucket width).
    hint: AtomicU64,
}

impl EpochClock {
    /// A clock starting now whose buckets cut `span` into `buckets` parts (rounded down
    /// to the nanosecond, and at least 1 ns wide).
    pub(crate) fn new(span: Duration, buckets: NonZeroU64) -> Self {
        EpochClock {
            start: Instant::now(),
            width_nanos: NonZeroU64::new(nanos(span) / buckets).unwrap_or(NonZeroU64::MIN),
            hint: AtomicU64::new(0),
        }
    }

    /// The width of one bucket.
    pub(crate) fn width(&self) -> Duration {
        Duration::from_nanos(self.width_nanos.get())
    }

    /// The current epoch: bucket widths elapsed since the clock was created.
    pub(crate) fn epoch(&self) -> u64 {
        let elapsed = nanos(Instant::now().saturating_duration_since(self.start));
        // Usually the clock is still in the bucket of the last epoch computed: checking
        // that takes a multiplication, where computing the epoch takes a division.
        let hint = self.hint.load(Relaxed);
        let width = self.width_nanos.get();
        match elapsed.checked_sub(hint.saturating_mul(width)) {
            Some(into_bucket) if into_bucket < width => hint,
            _ => {
                let epoch = elapsed / self.width_nanos;
                if epoch > hint {
                    self.hint.fetch_max(epoch, Relaxed);
                }
                epoch
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripes_are_a_bounded_power_of_two() {
        let count = stripe_count();
        assert!(count.is_power_of_two());
        assert!((8..=64).contains(&count));
        assert_eq!(thread_stripe(), thread_stripe(), "a thread keeps its index");
    }

    #[test]
    fn nanos_saturates() {
        assert_eq!(nanos(Duration::new(2, 5)), 2_000_000_005);
        assert_eq!(nanos(Duration::MAX), u64::MAX);
    }

    #[tokio::test(start_paused = true)]
    async fn epochs_count_bucket_widths() {
        let ten = NonZeroU64::new(10).unwrap_or(NonZeroU64::MIN);
        let clock = EpochClock::new(Duration::from_secs(1), ten);
        assert_eq!(clock.width(), Duration::from_millis(100));
        assert_eq!(clock.epoch(), 0);
        tokio::time::advance(Duration::from_millis(250)).await;
        assert_eq!(clock.epoch(), 2);
        assert_eq!(clock.epoch(), 2, "from the hint");
        tokio::time::advance(Duration::from_millis(1_000)).await;
        assert_eq!(clock.epoch(), 12);
        // A span shorter than its bucket count still gets 1 ns buckets.
        let tiny = EpochClock::new(Duration::from_nanos(3), ten);
        assert_eq!(tiny.width(), Duration::from_nanos(1));
    }
}
