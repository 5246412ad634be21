//! Cache padding and the per-thread stripe index shared by the budgets' counters.

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Aligns (and so pads) its content to 128 bytes: two 64-byte cache lines, because
/// adjacent-line prefetchers on x86 pull lines in pairs. Two values in different
/// `CachePadded`s never share a line, so writes to one do not slow down the other.
#[derive(Debug, Default)]
#[repr(align(128))]
pub(super) struct CachePadded<T>(pub(super) T);

/// The next stripe index to hand out to a thread that touches a budget for the first
/// time.
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
pub(super) fn thread_stripe() -> usize {
    STRIPE
        .try_with(|stripe| {
            let index = stripe.get();
            if index != UNASSIGNED {
                return index;
            }
            let index = NEXT_STRIPE.fetch_add(1, Ordering::Relaxed) & (usize::MAX >> 1);
            stripe.set(index);
            index
        })
        .unwrap_or(0)
}

/// How many deposit stripes a ratio budget has: four per available core rounded up to
/// a power of two, at least 8 and at most 64. More stripes than cores make two busy
/// threads unlikely to share one even though indices are handed out to every thread
/// (runtime workers, blocking threads) that touches a budget; the cap bounds what a
/// withdrawal reads (64 stripes × 10 words) and the memory of a budget (64 × 128 bytes).
pub(super) fn stripe_count() -> usize {
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        cores.saturating_mul(4).next_power_of_two().clamp(8, 64)
    })
}
