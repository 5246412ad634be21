//! The ratio budget: retries ≤ `retry_ratio` × deposits plus `min_per_sec` × `ttl`, over
//! a sliding window of `ttl`.
//!
//! # Layout
//!
//! The window is a ring of [`BUCKETS`] time buckets of `ttl / BUCKETS` each (see
//! [`ring`](crate::ring): one atomic word per bucket packs its lap and its count, so a
//! rotation cannot lose or misplace a concurrent increment).
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
use std::sync::atomic::Ordering::{AcqRel, Acquire};

use tokio::time::Instant;

use super::{BudgetSnapshot, RatioConfig};
use crate::ring::{self, Count, Layout, Window};
use crate::stripe::{CachePadded, EpochClock, nanos, stripe_count, thread_stripe};
use crate::sync::AtomicU64;

/// Buckets per window.
const BUCKETS: usize = 10;
/// [`BUCKETS`], for the clock.
const BUCKETS_NONZERO: NonZeroU64 = match NonZeroU64::new(10) {
    Some(n) => n,
    None => NonZeroU64::MIN,
};
/// The largest count of a bucket.
const COUNT_MAX: u64 = Count::COUNTS_MASK;
/// Fixed-point scale of the retry ratio.
const RATIO_SCALE: u128 = 1_000_000;

/// One window: a ring of packed (lap, count) buckets.
type Ring = ring::Ring<[AtomicU64; BUCKETS], Count>;

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
        let clock = &self.clock.0;
        stripe.0.add(clock, clock.epoch_at(now), |count| {
            (count < COUNT_MAX).then_some(count + 1)
        });
    }

    /// Takes one retry if the window allows it.
    pub(super) fn withdraw(&self) -> bool {
        let ring = &self.withdrawals.0;
        let clock = &self.clock.0;
        let mut epoch = clock.epoch();
        'rotate: loop {
            let window = ring.window(epoch);
            let (slot, lap) = ring.position(epoch);
            let Some(cell) = ring.bucket(slot) else {
                return false;
            };
            // The withdrawal count before the deposits: a refusal must compare withdrawals
            // with deposits at least as recent. A thread descheduled (or losing CAS races)
            // between reading the deposits and its CAS would otherwise hold the other
            // threads' later withdrawals against its earlier, smaller allowance, and
            // refuse a retry the window has room for. Acquire: the deposits a withdrawing
            // thread made before its withdrawal (its CAS releases them) are then seen too.
            let mut word = cell.load(Acquire);
            let mut allowed = self.allowed(self.deposits_in(&window));
            // Whether `allowed` was read after `word`.
            let mut rechecked = true;
            loop {
                let current = match ring.counts_for(word, lap, clock, epoch) {
                    Ok(current) => current,
                    Err(now) => {
                        epoch = now;
                        continue 'rotate;
                    }
                };
                // Acquire: see the deposits made before (above).
                let earlier = ring.sum(&window, Acquire, Some(slot));
                if current == COUNT_MAX {
                    return false;
                }
                if earlier.saturating_add(current) >= allowed {
                    if rechecked {
                        return false;
                    }
                    allowed = self.allowed(self.deposits_in(&window));
                    rechecked = true;
                    continue;
                }
                let next = Count::pack(lap, current + 1);
                match cell.compare_exchange_weak(word, next, AcqRel, Acquire) {
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
        let window = self.window();
        let deposits = self.deposits_in(&window);
        BudgetSnapshot::Ratio {
            deposits,
            withdrawals: self.withdrawals.0.sum(&window, Acquire, None),
            allowed: self.allowed(deposits),
        }
    }

    /// Retries the current window still allows.
    pub(super) fn available(&self) -> u64 {
        let window = self.window();
        let allowed = self.allowed(self.deposits_in(&window));
        allowed.saturating_sub(self.withdrawals.0.sum(&window, Acquire, None))
    }

    /// The current window.
    fn window(&self) -> Window {
        self.withdrawals.0.window(self.clock.0.epoch())
    }

    /// Deposits in `window`, over all stripes.
    fn deposits_in(&self, window: &Window) -> u64 {
        self.deposits
            .iter()
            // Acquire: for a withdrawal, see the deposits made before (see `withdraw`);
            // free on x86.
            .map(|stripe| stripe.0.sum(window, Acquire, None))
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
