//! Shared state that scales across threads: [`Striped`], a shared value whose
//! per-call references are counted per thread stripe.
//!
//! The crate also keeps here, privately, the cache padding, the per-thread stripe index
//! and the bucket clock of the striped counters of the ratio budget and of the breaker's
//! time window.

use std::cell::Cell;
use std::fmt;
use std::num::NonZeroU64;
use std::ops::Deref;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::time::Instant;

use crate::sync::{Arc, AtomicU64, AtomicUsize, now};

/// Aligns (and so pads) its content to 128 bytes: two 64-byte cache lines, because
/// adjacent-line prefetchers on x86 pull lines in pairs. Two values in different
/// `CachePadded`s never share a line, so writes to one do not slow down the other.
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct CachePadded<T>(pub T);

/// The next stripe index to hand out to a thread that touches a striped counter for
/// the first time.
#[cfg(not(loom))]
static NEXT_STRIPE: AtomicUsize = AtomicUsize::new(0);

#[cfg(loom)]
loom::lazy_static! {
    /// The next stripe index to hand out (a loom object: each execution starts from 0,
    /// and the order in which threads take their indices is part of the model).
    static ref NEXT_STRIPE: AtomicUsize = AtomicUsize::new(0);
}

/// Marks a thread that has no stripe index yet.
const UNASSIGNED: usize = usize::MAX;

#[cfg(not(loom))]
std::thread_local! {
    /// This thread's stripe index, assigned round-robin on first use. Const-initialised
    /// and without a destructor, so reading it is one thread-local load.
    static STRIPE: Cell<usize> = const { Cell::new(UNASSIGNED) };
}

// Loom's `thread_local!` (one per model thread, fresh in every execution) takes no
// `const` initialiser.
#[cfg(loom)]
loom::thread_local! {
    /// This thread's stripe index, assigned round-robin on first use.
    static STRIPE: Cell<usize> = Cell::new(UNASSIGNED);
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
#[cfg(not(loom))]
pub(crate) fn stripe_count() -> usize {
    use std::sync::OnceLock;
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        cores.saturating_mul(4).next_power_of_two().clamp(8, 64)
    })
}

/// Under loom: [`LOOM_STRIPES`](crate::sync::LOOM_STRIPES).
#[cfg(loom)]
pub(crate) fn stripe_count() -> usize {
    crate::sync::LOOM_STRIPES
}

/// A shared, immutable value whose per-call references do not contend.
///
/// An `Arc<T>` clone taken for every call (a breaker permit, a layer's configuration
/// held by a response future) increments and decrements one reference count that every
/// thread writes: two threads making calls at the same time bounce its cache line
/// between their cores, and the shared state stops scaling. A `Striped<T>` holds the
/// value behind one anchor per stripe (per thread, modulo the stripe count), each
/// anchor on cache lines of its own with its own reference count; [`local`](Self::local)
/// hands out a reference counted on the calling thread's anchor. The value lives until
/// every `Striped` handle and every [`Local`] reference is gone.
///
/// Cloning a `Striped` itself is one shared count (as an `Arc`): clone handles when
/// building services, take [`Local`]s per call.
///
/// Memory: one allocation of 256 bytes per anchor (its counts and the 128-byte aligned
/// anchor), [`MAX_ANCHORS`] anchors at most — 2 KiB with the 8 stripes of a 2-core
/// machine, 4 KiB at most — made once, in [`new`](Self::new).
///
/// ```
/// use retrysafe_core::__private::Striped;
///
/// let shared = Striped::new(String::from("config"));
/// let handle = shared.clone();
/// let per_call = handle.local();
/// drop((shared, handle));
/// assert_eq!(&*per_call, "config", "a local reference keeps the value alive");
/// ```
pub struct Striped<T> {
    anchors: Arc<Anchors<T>>,
}

/// The anchors of a [`Striped`], and the value for reads through the handle.
struct Anchors<T> {
    value: Arc<T>,
    /// One per stripe; the length is a power of two.
    slots: Box<[Arc<Anchor<T>>]>,
}

/// The most anchors a [`Striped`] has (a power of two): more threads than that share
/// anchors, which bounds the memory of every breaker (keyed breakers make one per key).
pub const MAX_ANCHORS: usize = 16;

/// One stripe's reference to the value: its `Arc`'s counts are the stripe's count, and
/// the alignment keeps them off every other stripe's cache lines.
#[repr(align(128))]
struct Anchor<T>(Arc<T>);

/// A reference to the value of a [`Striped`], counted on one stripe; see there.
pub struct Local<T> {
    anchor: Arc<Anchor<T>>,
}

impl<T> Striped<T> {
    /// `value`, shared.
    pub fn new(value: T) -> Self {
        Self::from_arc(&Arc::new(value))
    }

    /// The value of `value`, shared (its other clones keep sharing it).
    pub fn from_arc(value: &Arc<T>) -> Self {
        let slots = (0..stripe_count().min(MAX_ANCHORS))
            .map(|_| Arc::new(Anchor(Arc::clone(value))))
            .collect();
        Striped {
            anchors: Arc::new(Anchors {
                value: Arc::clone(value),
                slots,
            }),
        }
    }

    /// A reference to the value counted on the calling thread's stripe.
    pub fn local(&self) -> Local<T> {
        let slots = &self.anchors.slots;
        #[allow(
            clippy::indexing_slicing,
            reason = "masked to below the length, a power of two (`stripe_count`, capped)"
        )]
        // A mask, not a division (the stripe index is any `usize`).
        let anchor = &slots[thread_stripe() & (slots.len() - 1)];
        Local {
            anchor: Arc::clone(anchor),
        }
    }

    /// Whether `self` and `other` are the same handle (one is a clone of the other).
    /// Two `Striped` made by [`from_arc`](Self::from_arc) of one `Arc` share its value
    /// but are not the same handle.
    pub fn ptr_eq(&self, other: &Striped<T>) -> bool {
        Arc::ptr_eq(&self.anchors, &other.anchors)
    }
}

impl<T> Deref for Striped<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.anchors.value
    }
}

impl<T> Clone for Striped<T> {
    fn clone(&self) -> Self {
        Striped {
            anchors: Arc::clone(&self.anchors),
        }
    }
}

impl<T: fmt::Debug> fmt::Debug for Striped<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

impl<T> Deref for Local<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.anchor.0
    }
}

impl<T> Clone for Local<T> {
    fn clone(&self) -> Self {
        Local {
            anchor: Arc::clone(&self.anchor),
        }
    }
}

impl<T: fmt::Debug> fmt::Debug for Local<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
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
            start: now(),
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
        self.epoch_at(now())
    }

    /// The epoch of the clock reading `now`.
    pub(crate) fn epoch_at(&self, now: Instant) -> u64 {
        let elapsed = nanos(now.saturating_duration_since(self.start));
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

// The unit tests use std threads and a tokio runtime, which loom atomics refuse.
#[cfg(all(test, not(loom)))]
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
    fn striped_references_keep_the_value_alive_and_count_per_stripe() {
        let value = Arc::new(7_u32);
        let striped = Striped::from_arc(&value);
        // The caller's, the handle's and one per anchor.
        assert_eq!(
            Arc::strong_count(&value),
            2 + stripe_count().min(MAX_ANCHORS)
        );
        let local = striped.local();
        assert_eq!(
            Arc::strong_count(&value),
            2 + stripe_count().min(MAX_ANCHORS),
            "not the value's count"
        );
        let other = std::thread::spawn({
            let striped = striped.clone();
            move || striped.local()
        })
        .join()
        .unwrap_or_else(|_| unreachable!("the thread does not panic"));
        assert!(striped.ptr_eq(&striped.clone()));
        assert!(!striped.ptr_eq(&Striped::new(7)));
        drop(striped);
        assert_eq!((*local, *other), (7, 7));
        drop(local);
        drop(other);
        assert_eq!(Arc::strong_count(&value), 1, "every anchor is gone");
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
