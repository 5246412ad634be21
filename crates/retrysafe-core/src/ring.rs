//! The rolling bucket ring that the ratio budget, the adaptive throttle and the
//! breaker's sliding windows count in.
//!
//! A ring is a fixed number of buckets, one `AtomicU64` each. An *epoch* (bucket widths
//! elapsed since a clock's start, or, in a breaker's count window, buckets of calls)
//! falls in bucket `epoch % buckets`, on *lap* `epoch / buckets`. A bucket's word packs
//! its lap in the high bits and its counts below ([`Layout`] says where the lap
//! starts), so an increment and the rotation of the bucket to a new lap are one
//! compare-and-swap: a rotation cannot lose or misplace a concurrent increment. Laps are
//! kept modulo the lap bits. Reading a ring sums the buckets whose lap is the one their
//! slot has in the window that ends with the current epoch ([`Window`]).
//!
//! A ring has no clock and no stripes of its own: its user keeps the clock of the
//! epochs ([`EpochClock`]) and, where threads count apart, one ring per stripe.

use std::marker::PhantomData;
use std::num::NonZeroU64;
use std::sync::atomic::Ordering::{self, Relaxed};

use crate::stripe::EpochClock;
use crate::sync::AtomicU64;

/// Marks a slot whose epoch in a window precedes epoch zero: no bucket word has this lap.
pub(crate) const NO_LAP: u64 = u64::MAX;

/// How a ring's bucket words are laid out.
pub(crate) trait Layout {
    /// Where the lap starts: the bits below it hold the counts.
    const LAP_SHIFT: u32;
    /// Whether a word that counts nothing is free for any lap. True where words are
    /// cleared to zero (a breaker's windows, on a reset and a sweep): such a word holds
    /// nothing that a newer lap could lose, so it is taken without a second look at the
    /// clock. False where a zero word is one never written, which is then taken as any
    /// bucket of another lap is.
    const ZERO_IS_FREE: bool;
    /// The mask of a lap, shifted down.
    const LAP_MASK: u64 = (1 << (64 - Self::LAP_SHIFT)) - 1;
    /// The mask of the counts.
    const COUNTS_MASK: u64 = (1 << Self::LAP_SHIFT) - 1;
    /// Half the laps: a lap behind another by less than this is older.
    const HALF_LAPS: u64 = 1 << (64 - Self::LAP_SHIFT - 1);

    /// A bucket word.
    #[inline]
    fn pack(lap: u64, counts: u64) -> u64 {
        (lap << Self::LAP_SHIFT) | counts
    }

    /// The lap of a bucket word.
    #[inline]
    fn lap_of(word: u64) -> u64 {
        word >> Self::LAP_SHIFT
    }

    /// The counts of a bucket word.
    #[inline]
    fn counts_of(word: u64) -> u64 {
        word & Self::COUNTS_MASK
    }

    /// Whether lap `a` is older than lap `b` (modulo the laps: by less than half of them).
    #[inline]
    fn is_older(a: u64, b: u64) -> bool {
        let behind = b.wrapping_sub(a) & Self::LAP_MASK;
        behind != 0 && behind < Self::HALF_LAPS
    }
}

/// One count of 36 bits under a lap of 28: the ratio budget's and the throttle's
/// rings. A count saturates at 2^36 − 1 (≈ 6.9 × 10^10) per bucket; a bucket left
/// untouched for exactly a multiple of 2^28 laps would be taken for a current one.
#[derive(Debug)]
pub(crate) enum Count {}

impl Layout for Count {
    const LAP_SHIFT: u32 = 36;
    const ZERO_IS_FREE: bool = false;
}

/// A ring of bucket words held in `C` (an array of its own, or a ring's part of a block
/// that holds every stripe's ring), laid out as `L` says.
pub(crate) struct Ring<C, L> {
    cells: C,
    layout: PhantomData<fn() -> L>,
}

impl<C: Default, L> Default for Ring<C, L> {
    fn default() -> Self {
        Ring::new(C::default())
    }
}

impl<C, L> Ring<C, L> {
    /// A ring of the words `cells`, one per bucket.
    pub(crate) fn new(cells: C) -> Self {
        Ring {
            cells,
            layout: PhantomData,
        }
    }
}

impl<C: AsRef<[AtomicU64]>, L: Layout> Ring<C, L> {
    /// The bucket words.
    #[inline]
    pub(crate) fn cells(&self) -> &[AtomicU64] {
        self.cells.as_ref()
    }

    /// The number of buckets (an empty ring counts as one bucket that is never there).
    #[inline]
    pub(crate) fn buckets(&self) -> NonZeroU64 {
        u64::try_from(self.cells().len())
            .ok()
            .and_then(NonZeroU64::new)
            .unwrap_or(NonZeroU64::MIN)
    }

    /// The bucket index and the (truncated) lap of an epoch.
    #[inline]
    pub(crate) fn position(&self, epoch: u64) -> (usize, u64) {
        let buckets = self.buckets();
        let slot = usize::try_from(epoch % buckets).unwrap_or(0);
        (slot, (epoch / buckets) & L::LAP_MASK)
    }

    /// The window made of `epoch` and the epochs before it, one per bucket.
    #[inline]
    pub(crate) fn window(&self, epoch: u64) -> Window {
        Window::new::<L>(epoch, self.buckets())
    }

    /// The word of bucket `slot`.
    #[inline]
    pub(crate) fn bucket(&self, slot: usize) -> Option<&AtomicU64> {
        self.cells().get(slot)
    }

    /// What `word`, read from the bucket of `epoch` (whose lap is `lap`), counts for that
    /// epoch: its counts if it is of that lap (or is free: [`Layout::ZERO_IS_FREE`]);
    /// nothing if it is of another lap, which the bucket then starts over from; `Err`
    /// with the clock's epoch when the clock, read again in that case, moved on (another
    /// thread may have rotated the bucket to a later lap than ours).
    #[inline]
    pub(crate) fn counts_for(
        &self,
        word: u64,
        lap: u64,
        clock: &EpochClock,
        epoch: u64,
    ) -> Result<u64, u64> {
        if L::lap_of(word) == lap || (L::ZERO_IS_FREE && L::counts_of(word) == 0) {
            return Ok(L::counts_of(word));
        }
        let now = clock.epoch();
        if now == epoch { Ok(0) } else { Err(now) }
    }

    /// Adds to the bucket of `epoch` (read from `clock`): `step` is given the counts the
    /// bucket holds for it ([`counts_for`](Self::counts_for); when the clock has moved
    /// on, the bucket of the clock's epoch is added to instead) and returns them with the
    /// addition, or `None` to leave the bucket as it is.
    ///
    /// The epoch added to, when the addition rotated the bucket into that epoch's lap;
    /// `None` when it did not, or `step` declined.
    #[inline]
    pub(crate) fn add(
        &self,
        clock: &EpochClock,
        mut epoch: u64,
        step: impl Fn(u64) -> Option<u64>,
    ) -> Option<u64> {
        'rotate: loop {
            let (slot, lap) = self.position(epoch);
            let cell = self.bucket(slot)?;
            let mut word = cell.load(Relaxed);
            loop {
                let counts = match self.counts_for(word, lap, clock, epoch) {
                    Ok(counts) => counts,
                    Err(now) => {
                        epoch = now;
                        continue 'rotate;
                    }
                };
                let next = L::pack(lap, step(counts)?);
                // Relaxed: the counts publish no other data; the CAS alone makes the
                // rotation and the increment one step.
                match cell.compare_exchange_weak(word, next, Relaxed, Relaxed) {
                    Ok(_) => return (L::lap_of(word) != lap).then_some(epoch),
                    Err(actual) => word = actual,
                }
            }
        }
    }

    /// Folds with `f` the counts of the buckets in `window`, each word read with
    /// `order`; the bucket of slot `skip` is not read.
    #[inline]
    pub(crate) fn fold<T>(
        &self,
        window: &Window,
        order: Ordering,
        skip: Option<usize>,
        init: T,
        mut f: impl FnMut(T, u64) -> T,
    ) -> T {
        let mut folded = init;
        for (slot, cell) in self.cells().iter().enumerate() {
            if Some(slot) == skip {
                continue;
            }
            let word = cell.load(order);
            if L::lap_of(word) == window.lap(slot) {
                folded = f(folded, L::counts_of(word));
            }
        }
        folded
    }

    /// Clears the buckets that count something of a lap older than `window`'s.
    pub(crate) fn clear_older(&self, window: &Window) {
        for (slot, cell) in self.cells().iter().enumerate() {
            let expected = window.lap(slot);
            let word = cell.load(Relaxed);
            if expected != NO_LAP
                && L::counts_of(word) != 0
                && L::is_older(L::lap_of(word), expected)
            {
                // A failed CAS means a writer got there first: that word is current.
                let _ = cell.compare_exchange(word, 0, Relaxed, Relaxed);
            }
        }
    }
}

impl<C: AsRef<[AtomicU64]>> Ring<C, Count> {
    /// The counts of the buckets in `window` (but slot `skip`'s), each word read with
    /// `order`: their saturating sum.
    #[inline]
    pub(crate) fn sum(&self, window: &Window, order: Ordering, skip: Option<usize>) -> u64 {
        self.fold(window, order, skip, 0, u64::saturating_add)
    }
}

/// The window that ends with an epoch, as a ring sees it: the lap each of its slots must
/// carry to be in the window (made by [`Ring::window`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Window {
    /// The slot of the last epoch.
    slot: usize,
    /// The lap of the slots up to `slot`.
    current: u64,
    /// The lap of the slots after `slot` ([`NO_LAP`] on the first lap).
    previous: u64,
}

impl Window {
    /// The window of a ring of `buckets` buckets laid out as `L` says that is made of
    /// `epoch` and the epochs before it, one per bucket.
    #[inline]
    pub(crate) fn new<L: Layout>(epoch: u64, buckets: NonZeroU64) -> Self {
        let lap = epoch / buckets;
        Window {
            slot: usize::try_from(epoch % buckets).unwrap_or(0),
            current: lap & L::LAP_MASK,
            previous: lap.checked_sub(1).map_or(NO_LAP, |lap| lap & L::LAP_MASK),
        }
    }

    /// The lap bucket `slot` must carry to be in the window; [`NO_LAP`] when the slot's
    /// epoch in the window precedes epoch zero.
    #[inline]
    pub(crate) fn lap(&self, slot: usize) -> u64 {
        if slot <= self.slot {
            self.current
        } else {
            self.previous
        }
    }
}

// The unit tests read the std clock through a tokio runtime, which loom refuses.
#[cfg(all(test, not(loom)))]
mod tests {
    use std::time::Duration;

    use super::*;

    const BUCKETS: usize = 10;
    const BUCKETS_U64: u64 = 10;
    const COUNT_MAX: u64 = Count::COUNTS_MASK;
    const LAP_MASK: u64 = Count::LAP_MASK;

    type Ten = Ring<[AtomicU64; BUCKETS], Count>;

    /// The laps of a window of ten buckets, slot by slot.
    fn window_laps(epoch: u64) -> [u64; BUCKETS] {
        let window = Ten::default().window(epoch);
        std::array::from_fn(|slot| window.lap(slot))
    }

    fn position(epoch: u64) -> (usize, u64) {
        Ten::default().position(epoch)
    }

    #[test]
    fn packing_round_trips() {
        let word = Count::pack(LAP_MASK, COUNT_MAX);
        assert_eq!(word, u64::MAX);
        assert_eq!(Count::lap_of(word), LAP_MASK);
        assert_eq!(Count::counts_of(word), COUNT_MAX);
        assert_eq!(Count::lap_of(Count::pack(3, 7)), 3);
        assert_eq!(Count::counts_of(Count::pack(3, 7)), 7);
        assert_eq!(
            (
                Count::lap_of(Count::pack(3, 7)),
                Count::counts_of(Count::pack(3, 7))
            ),
            (3, 7)
        );
        assert_eq!(position(23), (3, 2));
    }

    #[test]
    fn window_covers_the_last_ten_epochs() {
        assert_eq!(
            window_laps(0),
            [
                0, NO_LAP, NO_LAP, NO_LAP, NO_LAP, NO_LAP, NO_LAP, NO_LAP, NO_LAP, NO_LAP
            ]
        );
        // Epoch 23 is slot 3 of lap 2; the window is epochs 14..=23.
        let laps = window_laps(23);
        assert_eq!(laps, [2, 2, 2, 2, 1, 1, 1, 1, 1, 1]);
        assert_eq!(position(23), (3, 2));
        // Laps wrap modulo 2^28.
        assert_eq!(position((LAP_MASK + 1) * BUCKETS_U64 + 4), (4, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn adding_rotates_a_bucket_of_an_older_lap_and_sums_the_window() {
        let ten = NonZeroU64::new(BUCKETS_U64).unwrap_or(NonZeroU64::MIN);
        let clock = EpochClock::new(Duration::from_secs(1), ten);
        let ring = Ten::default();
        let increment = |count: u64| (count < COUNT_MAX).then_some(count + 1);
        assert_eq!(ring.add(&clock, 0, increment), None, "lap 0 from the start");
        assert_eq!(ring.add(&clock, 0, increment), None);
        assert_eq!(ring.sum(&ring.window(0), Relaxed, None), 2);
        assert_eq!(ring.sum(&ring.window(0), Relaxed, Some(0)), 0);
        tokio::time::advance(Duration::from_millis(1_000)).await;
        assert_eq!(ring.add(&clock, 10, increment), Some(10), "into lap 1");
        assert_eq!(ring.sum(&ring.window(10), Relaxed, None), 1);
        // A stale epoch whose bucket is of another lap goes to the clock's epoch.
        tokio::time::advance(Duration::from_millis(100)).await;
        assert_eq!(ring.add(&clock, 0, increment), Some(11));
        assert_eq!(ring.sum(&ring.window(11), Relaxed, None), 2);
        // A full bucket declines.
        let full = Ring::<[AtomicU64; 1], Count>::new([AtomicU64::new(COUNT_MAX)]);
        assert_eq!(full.add(&clock, 0, increment), None);
        assert_eq!(
            full.cells().first().map(|c| c.load(Relaxed)),
            Some(COUNT_MAX)
        );
    }

    #[test]
    fn older_laps_wrap() {
        assert!(Count::is_older(1, 2));
        assert!(!Count::is_older(2, 2));
        assert!(!Count::is_older(3, 2));
        assert!(Count::is_older(LAP_MASK, 0));
    }
}
