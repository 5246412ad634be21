//! The ratio budget: retries ≤ `retry_ratio` × deposits plus `min_per_sec` × `ttl`, over
//! a sliding window of `ttl`.
//!
//! # Layout
//!
//! The window is a ring of [`BUCKETS`] time buckets of `ttl / BUCKETS` each. A bucket
//! is one `AtomicU64` that packs the bucket's *lap* (its epoch divided by
//! [`BUCKETS`], where the epoch is the time since the budget's creation divided by the
//! bucket width) in the high bits and its count in the low bits, so an increment and
//! the rotation of the bucket to a new lap are one compare-and-swap: a rotation cannot
//! lose or misplace a concurrent increment.
//!
//! Deposits go to one ring per stripe (one stripe per thread, chosen by a thread-local
//! index; each ring is cache-padded), so depositing threads do not write to a shared
//! cache line. Withdrawals, which are rare, go to one ring of their own, and read every
//! deposit ring to know how many retries the window allows. The check and the increment
//! of a withdrawal are one compare-and-swap on the current bucket, so concurrent
//! withdrawals within one bucket never overdraw; two withdrawals that race across a
//! bucket boundary (one still in the old bucket, one already in the new) may each miss
//! the other, so the bound can be exceeded by one retry per racing thread at that
//! instant.
//!
//! Laps are kept modulo 2^28: a bucket left untouched for exactly a multiple of 2^28
//! laps (at least 2^28 × 1 s ≈ 8.5 years, since `ttl` ≥ 1 s) would be taken for a
//! current one. Counts saturate at 2^36 − 1 per bucket and stripe (≈ 6.9 × 10^10;
//! saturating only ever refuses retries).

use std::fmt;
use std::num::NonZeroU64;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed};

use tokio::time::Instant;

use super::{BudgetSnapshot, RatioConfig};
use crate::stripe::{CachePadded, EpochClock, nanos, stripe_count, thread_stripe};
use crate::sync::AtomicU64;

/// Buckets per window.
const BUCKETS: usize = 10;
/// [`BUCKETS`] as a `u64`, for epoch arithmetic.
const BUCKETS_U64: u64 = 10;
/// [`BUCKETS`], for the clock.
const BUCKETS_NONZERO: NonZeroU64 = match NonZeroU64::new(BUCKETS_U64) {
    Some(n) => n,
    None => NonZeroU64::MIN,
};
/// Low bits of a bucket word that hold its count.
const COUNT_BITS: u32 = 36;
/// The largest count (and the mask of the count bits).
const COUNT_MAX: u64 = (1 << COUNT_BITS) - 1;
/// The mask of a lap (the high `64 - COUNT_BITS` bits, shifted down).
const LAP_MASK: u64 = (1 << (64 - COUNT_BITS)) - 1;
/// Fixed-point scale of the retry ratio.
const RATIO_SCALE: u128 = 1_000_000;

/// One window: a ring of packed (lap, count) buckets.
type Ring = [AtomicU64; BUCKETS];

/// The lap each bucket must carry to belong to the window that ends with a given
/// epoch; `None` for a bucket whose epoch in that window precedes the budget.
type WindowLaps = [Option<u64>; BUCKETS];

/// A ratio budget's state.
pub(super) struct Ratio {
    config: RatioConfig,
    /// Epochs of one bucket width each (read-mostly: its hint is written once per
    /// bucket width, on lines of its own).
    clock: CachePadded<EpochClock>,
    /// Retries always allowed per window: `min_per_sec` × `ttl`.
    reserve: u64,
    /// `retry_ratio` × [`RATIO_SCALE`].
    ratio_scaled: u64,
    /// `deposits.len() - 1`; the length is a power of two.
    stripe_mask: usize,
    /// One ring of deposit counts per stripe.
    deposits: Box<[CachePadded<Ring>]>,
    /// Withdrawal counts.
    withdrawals: CachePadded<Ring>,
}

impl Ratio {
    /// A budget for a configuration in range ([`RatioConfig::clamped`]).
    pub(super) fn new(config: RatioConfig) -> Self {
        let ttl_nanos = nanos(config.ttl);
        let clock = CachePadded(EpochClock::new(config.ttl, BUCKETS_NONZERO));
        let reserve = u128::from(config.min_per_sec) * u128::from(ttl_nanos) / 1_000_000_000;
        #[allow(
            clippy::cast_possible_truncation,
            reason = "validated to 0..=1000, so the product is at most 1e9; `as` saturates"
        )]
        let ratio_scaled = (config.retry_ratio * 1e6).round() as u64;
        let stripes = stripe_count();
        Ratio {
            config,
            clock,
            reserve: u64::try_from(reserve).unwrap_or(u64::MAX),
            ratio_scaled,
            stripe_mask: stripes - 1,
            deposits: (0..stripes).map(|_| CachePadded::default()).collect(),
            withdrawals: CachePadded::default(),
        }
    }

    /// The configuration.
    pub(super) fn config(&self) -> &RatioConfig {
        &self.config
    }

    /// Counts one request at the clock reading `now`.
    pub(super) fn deposit_at(&self, now: Instant) {
        let Some(stripe) = self.deposits.get(thread_stripe() & self.stripe_mask) else {
            return;
        };
        let mut epoch = self.clock.0.epoch_at(now);
        'rotate: loop {
            let (slot, lap) = position(epoch);
            let Some(cell) = stripe.0.get(slot) else {
                return;
            };
            let mut word = cell.load(Relaxed);
            loop {
                let next = if lap_of(word) == lap {
                    if count_of(word) == COUNT_MAX {
                        return;
                    }
                    word + 1
                } else {
                    // An older lap: this bucket starts over. A newer one means another
                    // thread saw a later time than ours; then read the clock again.
                    let now = self.clock.0.epoch();
                    if now != epoch {
                        epoch = now;
                        continue 'rotate;
                    }
                    pack(lap, 1)
                };
                // Relaxed: the counters publish no other data; the CAS alone makes the
                // rotation and the increment one step.
                match cell.compare_exchange_weak(word, next, Relaxed, Relaxed) {
                    Ok(_) => return,
                    Err(actual) => word = actual,
                }
            }
        }
    }

    /// Takes one retry if the window allows it.
    pub(super) fn withdraw(&self) -> bool {
        let mut epoch = self.clock.0.epoch();
        'rotate: loop {
            let laps = window_laps(epoch);
            let (slot, lap) = position(epoch);
            let Some(cell) = self.withdrawals.0.get(slot) else {
                return false;
            };
            // The withdrawal count before the deposits: a refusal must compare withdrawals
            // with deposits at least as recent. A thread descheduled (or losing CAS races)
            // between reading the deposits and its CAS would otherwise hold the other
            // threads' later withdrawals against its earlier, smaller allowance, and
            // refuse a retry the window has room for. Acquire: the deposits a withdrawing
            // thread made before its withdrawal (its CAS releases them) are then seen too.
            let mut word = cell.load(Acquire);
            let mut allowed = self.allowed(self.deposits_in(&laps));
            // Whether `allowed` was read after `word`.
            let mut rechecked = true;
            loop {
                let current = if lap_of(word) == lap {
                    count_of(word)
                } else {
                    let now = self.clock.0.epoch();
                    if now != epoch {
                        epoch = now;
                        continue 'rotate;
                    }
                    0
                };
                let earlier = ring_sum(&self.withdrawals.0, &laps, Some(slot));
                if current == COUNT_MAX {
                    return false;
                }
                if earlier.saturating_add(current) >= allowed {
                    if rechecked {
                        return false;
                    }
                    allowed = self.allowed(self.deposits_in(&laps));
                    rechecked = true;
                    continue;
                }
                match cell.compare_exchange_weak(word, pack(lap, current + 1), AcqRel, Acquire) {
                    Ok(_) => return true,
                    Err(actual) => {
                        word = actual;
                        rechecked = false;
                    }
                }
            }
        }
    }

    /// Deposits, withdrawals and the retries allowed in the current window.
    pub(super) fn snapshot(&self) -> BudgetSnapshot {
        let laps = window_laps(self.clock.0.epoch());
        let deposits = self.deposits_in(&laps);
        BudgetSnapshot::Ratio {
            deposits,
            withdrawals: ring_sum(&self.withdrawals.0, &laps, None),
            allowed: self.allowed(deposits),
        }
    }

    /// Retries the current window still allows.
    pub(super) fn available(&self) -> u64 {
        let laps = window_laps(self.clock.0.epoch());
        let allowed = self.allowed(self.deposits_in(&laps));
        allowed.saturating_sub(ring_sum(&self.withdrawals.0, &laps, None))
    }

    /// Deposits in the window described by `laps`, over all stripes.
    fn deposits_in(&self, laps: &WindowLaps) -> u64 {
        self.deposits
            .iter()
            .map(|stripe| ring_sum(&stripe.0, laps, None))
            .fold(0, u64::saturating_add)
    }

    /// Retries a window with `deposits` allows: the reserve plus the ratio's share,
    /// rounded down.
    fn allowed(&self, deposits: u64) -> u64 {
        let share = u128::from(deposits) * u128::from(self.ratio_scaled) / RATIO_SCALE;
        self.reserve
            .saturating_add(u64::try_from(share).unwrap_or(u64::MAX))
    }
}

impl fmt::Debug for Ratio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ratio")
            .field("config", &self.config)
            .field("stripes", &self.deposits.len())
            .field("now", &self.snapshot())
            .finish()
    }
}

/// The bucket index and the (truncated) lap of an epoch.
fn position(epoch: u64) -> (usize, u64) {
    let slot = usize::try_from(epoch % BUCKETS_U64).unwrap_or(0);
    (slot, (epoch / BUCKETS_U64) & LAP_MASK)
}

/// A bucket word.
fn pack(lap: u64, count: u64) -> u64 {
    (lap << COUNT_BITS) | count
}

/// The lap of a bucket word.
fn lap_of(word: u64) -> u64 {
    word >> COUNT_BITS
}

/// The count of a bucket word.
fn count_of(word: u64) -> u64 {
    word & COUNT_MAX
}

/// The laps of the window made of `epoch` and the `BUCKETS - 1` epochs before it.
fn window_laps(epoch: u64) -> WindowLaps {
    let mut laps = [None; BUCKETS];
    for back in 0..BUCKETS_U64 {
        if let Some(e) = epoch.checked_sub(back) {
            let (slot, lap) = position(e);
            if let Some(l) = laps.get_mut(slot) {
                *l = Some(lap);
            }
        }
    }
    laps
}

/// The counts of the buckets of `ring` that belong to the window `laps`, except `skip`.
fn ring_sum(ring: &Ring, laps: &WindowLaps, skip: Option<usize>) -> u64 {
    ring.iter()
        .zip(laps)
        .enumerate()
        .filter(|&(slot, _)| Some(slot) != skip)
        .filter_map(|(_, (cell, lap))| {
            // Acquire: for the withdrawal ring, see the deposits made before (see
            // `withdraw`); free on x86.
            let word = cell.load(Acquire);
            (Some(lap_of(word)) == *lap).then_some(count_of(word))
        })
        .fold(0, u64::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_round_trips() {
        let word = pack(LAP_MASK, COUNT_MAX);
        assert_eq!(word, u64::MAX);
        assert_eq!(lap_of(word), LAP_MASK);
        assert_eq!(count_of(word), COUNT_MAX);
        assert_eq!(lap_of(pack(3, 7)), 3);
        assert_eq!(count_of(pack(3, 7)), 7);
    }

    #[test]
    fn window_covers_the_last_ten_epochs() {
        assert_eq!(
            window_laps(0),
            [
                Some(0),
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                None
            ]
        );
        // Epoch 23 is slot 3 of lap 2; the window is epochs 14..=23.
        let laps = window_laps(23);
        assert_eq!(
            laps,
            [
                Some(2),
                Some(2),
                Some(2),
                Some(2),
                Some(1),
                Some(1),
                Some(1),
                Some(1),
                Some(1),
                Some(1)
            ]
        );
        assert_eq!(position(23), (3, 2));
        // Laps wrap modulo 2^28.
        assert_eq!(position((LAP_MASK + 1) * BUCKETS_U64 + 4), (4, 0));
    }
}
