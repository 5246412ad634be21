//! Adaptive throttling on the client (Google SRE, "Handling Overload"): when a callee
//! has been refusing much of what it was sent, reject a share of new calls locally,
//! before they cost the callee anything.
//!
//! An [`AdaptiveThrottle`] counts, over a rolling window (default 2 minutes), the
//! *requests* its client made — locally rejected ones included — and the *accepts*: the
//! answers the callee did not refuse as throttled or overloaded. It rejects a new call
//! with probability
//!
//! ```text
//! max(0, (requests − K × accepts) / (requests + 1))
//! ```
//!
//! With the default `K = 2`, a callee that accepts everything is never throttled; one
//! that accepts half of what it gets sees no rejection either; below that, the client
//! sends about `K` times what the callee accepts and keeps the rest home. Because
//! rejections count as requests, the probability keeps rising while the callee keeps
//! refusing, and falls back as soon as it accepts again.
//!
//! ```
//! use retrysafe::throttle::{AdaptiveThrottle, ThrottleConfig};
//!
//! let throttle = AdaptiveThrottle::new(ThrottleConfig::default());
//! // 100 calls, 20 accepted: (100 − 2 × 20) / 101 of the next calls are rejected.
//! for i in 0..100 {
//!     assert!(throttle.admit(1.0), "a draw of 1.0 is never rejected");
//!     if i % 5 == 0 {
//!         throttle.record_accept();
//!     }
//! }
//! assert_eq!(throttle.counts(), (100, 20));
//! let p = throttle.rejection_probability();
//! assert!((p - 60.0 / 101.0).abs() < 1e-9);
//! assert!(!throttle.admit(0.5), "a draw below the probability is rejected");
//! assert_eq!(throttle.counts(), (101, 20), "a rejection counts as a request");
//! ```
//!
//! # Concurrency
//!
//! Lock-free, like the ratio budget: each thread counts in a cache-padded stripe of its
//! own (a thread-local index), a ring of time buckets in which one atomic word holds a
//! bucket's lap and count, so a bucket's rotation cannot race an increment. A decision
//! reads every stripe. Time comes from [`tokio::time::Instant`], so the window follows a
//! paused test clock.

use std::fmt;
use std::num::NonZeroU64;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use crate::ConfigError;
use crate::config::Validate;
use crate::ring::{self, Count, Layout, Window};
use crate::stripe::{CachePadded, EpochClock, stripe_count, thread_stripe};
use crate::sync::{Arc, AtomicU64};

/// Buckets per window.
const BUCKETS: usize = 10;
/// [`BUCKETS`], for the clock.
const BUCKETS_NONZERO: NonZeroU64 = match NonZeroU64::new(10) {
    Some(n) => n,
    None => NonZeroU64::MIN,
};
/// The largest count of a bucket.
const COUNT_MAX: u64 = Count::COUNTS_MASK;

/// The shortest window.
const MIN_WINDOW: Duration = Duration::from_secs(1);
/// The longest window.
const MAX_WINDOW: Duration = Duration::from_secs(24 * 60 * 60);
/// The largest `K`.
const MAX_K: f64 = 1000.0;

/// Configuration of an [`AdaptiveThrottle`].
///
/// ```
/// use std::time::Duration;
/// use retrysafe::throttle::ThrottleConfig;
///
/// let config = ThrottleConfig::default()
///     .with_window(Duration::from_secs(5))
///     .with_k(1.5)
///     .build()
///     .unwrap();
/// assert_eq!(config.window(), Duration::from_secs(5));
///
/// let bad = ThrottleConfig::default().with_window(Duration::ZERO).with_k(0.5);
/// assert_eq!(bad.build().unwrap_err().fields().collect::<Vec<_>>(), ["window", "k"]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ThrottleConfig {
    window: Duration,
    k: f64,
}

impl Default for ThrottleConfig {
    /// A 2-minute window and `K = 2`, the SRE book's figures.
    fn default() -> Self {
        ThrottleConfig {
            window: Duration::from_secs(120),
            k: 2.0,
        }
    }
}

impl ThrottleConfig {
    /// The length of the rolling window, from 1 s to 24 h (default 2 min). A call counts
    /// for between 9/10 of it and all of it.
    #[must_use]
    pub fn with_window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// `K`, the multiple of the accepts the client may send, from 1 to 1000 (default
    /// 2.0). Lower is more aggressive; at 1, every refusal is felt at once.
    #[must_use]
    pub fn with_k(mut self, k: f64) -> Self {
        self.k = k;
        self
    }

    /// The window length.
    #[doc(hidden)]
    pub fn window(&self) -> Duration {
        self.window
    }

    /// `K`.
    #[doc(hidden)]
    pub fn k(&self) -> f64 {
        self.k
    }

    /// Checks every field: the error names each one out of range.
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        v.check(
            (MIN_WINDOW..=MAX_WINDOW).contains(&self.window),
            "window",
            "must be from 1 s to 24 h",
        );
        v.check(
            (1.0..=MAX_K).contains(&self.k),
            "k",
            "must be a number from 1 to 1000",
        );
        v.finish(self)
    }

    /// The configuration as used: every field brought into its range (a NaN `K` is 2).
    fn clamped(self) -> Self {
        let k = if self.k.is_nan() {
            2.0
        } else {
            self.k.clamp(1.0, MAX_K)
        };
        ThrottleConfig {
            window: self.window.clamp(MIN_WINDOW, MAX_WINDOW),
            k,
        }
    }
}

/// One window of counts: a ring of packed (lap, count) buckets.
type Ring = ring::Ring<[AtomicU64; BUCKETS], Count>;

/// One stripe's counts.
#[derive(Default)]
struct Counts {
    requests: Ring,
    accepts: Ring,
}

/// The shared state.
struct Inner {
    config: ThrottleConfig,
    clock: CachePadded<EpochClock>,
    /// `stripes.len() - 1`; the length is a power of two.
    stripe_mask: usize,
    stripes: Box<[CachePadded<Counts>]>,
}

/// An adaptive client-side throttle: a cheap `Clone` handle (one `Arc`) on counts
/// shared by every clone. See the [module documentation](self).
#[derive(Clone)]
pub struct AdaptiveThrottle {
    inner: Arc<Inner>,
}

impl Default for AdaptiveThrottle {
    fn default() -> Self {
        Self::new(ThrottleConfig::default())
    }
}

impl AdaptiveThrottle {
    /// A throttle configured by `config` ([`ThrottleConfig::build`] checks it; a field
    /// out of range is used as the nearest valid value).
    pub fn new(config: ThrottleConfig) -> Self {
        let config = config.clamped();
        let stripes = stripe_count();
        AdaptiveThrottle {
            inner: Arc::new(Inner {
                config,
                clock: CachePadded(EpochClock::new(config.window, BUCKETS_NONZERO)),
                stripe_mask: stripes - 1,
                stripes: (0..stripes).map(|_| CachePadded::default()).collect(),
            }),
        }
    }

    /// The configuration in use.
    #[doc(hidden)]
    pub fn config(&self) -> &ThrottleConfig {
        &self.inner.config
    }

    /// Decides on one call and counts it as a request: `false` rejects it. `draw` is a
    /// uniform random number in `[0, 1)`; the call is rejected when it is below the
    /// [rejection probability](Self::rejection_probability) (so a draw of 1.0 always
    /// passes, and a fixed sequence of draws makes decisions reproducible).
    #[doc(hidden)]
    #[must_use = "`false` means the call is rejected"]
    pub fn admit(&self, draw: f64) -> bool {
        let reject = draw < self.rejection_probability();
        self.count(|c| &c.requests);
        !reject
    }

    /// Counts one answer the callee accepted (not throttled, not overloaded).
    #[doc(hidden)]
    pub fn record_accept(&self) {
        self.count(|c| &c.accepts);
    }

    /// The probability that the next call is rejected:
    /// `max(0, (requests − K × accepts) / (requests + 1))` over the window.
    pub fn rejection_probability(&self) -> f64 {
        let (requests, accepts) = self.counts();
        #[allow(
            clippy::cast_precision_loss,
            reason = "counts far below 2^52 in any real window; a probability needs no more"
        )]
        let (requests, accepts) = (requests as f64, accepts as f64);
        ((requests - self.inner.config.k * accepts) / (requests + 1.0)).max(0.0)
    }

    /// `(requests, accepts)` in the current window, over every stripe.
    #[doc(hidden)]
    pub fn counts(&self) -> (u64, u64) {
        let window = Window::new::<Count>(self.inner.clock.0.epoch(), BUCKETS_NONZERO);
        self.inner
            .stripes
            .iter()
            .map(|s| {
                (
                    s.0.requests.sum(&window, Relaxed, None),
                    s.0.accepts.sum(&window, Relaxed, None),
                )
            })
            .fold((0, 0), |(r, a), (sr, sa)| {
                (r.saturating_add(sr), a.saturating_add(sa))
            })
    }

    /// Whether `self` and `other` are handles on the same throttle.
    #[doc(hidden)]
    pub fn same_throttle(&self, other: &AdaptiveThrottle) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Adds one to the current bucket of the calling thread's stripe, in the ring
    /// `ring` picks.
    fn count(&self, ring: impl Fn(&Counts) -> &Ring) {
        let Some(stripe) = self
            .inner
            .stripes
            .get(thread_stripe() & self.inner.stripe_mask)
        else {
            return;
        };
        let clock = &self.inner.clock.0;
        ring(&stripe.0).add(clock, clock.epoch(), |count| {
            (count < COUNT_MAX).then_some(count + 1)
        });
    }
}

impl fmt::Debug for AdaptiveThrottle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (requests, accepts) = self.counts();
        f.debug_struct("AdaptiveThrottle")
            .field("config", &self.inner.config)
            .field("requests", &requests)
            .field("accepts", &accepts)
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn config(window_secs: u64, k: f64) -> ThrottleConfig {
        ThrottleConfig::default()
            .with_window(Duration::from_secs(window_secs))
            .with_k(k)
    }

    #[tokio::test(start_paused = true)]
    async fn a_healthy_callee_is_never_throttled() {
        let t = AdaptiveThrottle::new(ThrottleConfig::default());
        for _ in 0..1000 {
            assert!(t.admit(0.0));
            t.record_accept();
        }
        assert_eq!(t.rejection_probability(), 0.0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_probability_follows_the_formula_and_the_window() {
        let t = AdaptiveThrottle::new(config(10, 2.0));
        for _ in 0..99 {
            assert!(t.admit(1.0));
        }
        // No accepts: 99 / 100.
        assert!((t.rejection_probability() - 0.99).abs() < 1e-12);
        tokio::time::advance(Duration::from_secs(5)).await;
        for _ in 0..10 {
            t.record_accept();
        }
        assert_eq!(t.counts(), (99, 10));
        assert!((t.rejection_probability() - 79.0 / 100.0).abs() < 1e-12);
        // The requests leave the window 10 s after their bucket; the accepts 5 s later.
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(t.counts(), (0, 10));
        assert_eq!(t.rejection_probability(), 0.0);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(t.counts(), (0, 0));
    }

    #[test]
    fn out_of_range_settings_are_clamped() {
        let c = config(0, f64::NAN).clamped();
        assert_eq!((c.window(), c.k()), (MIN_WINDOW, 2.0));
        let c = config(u64::MAX, 1e9).clamped();
        assert_eq!((c.window(), c.k()), (MAX_WINDOW, MAX_K));
        assert!(config(1, 1.0).build().is_ok());
    }
}
