//! The breaker's configuration and its validation.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::ConfigError;
use crate::config::Validate;

use super::{BreakerRejection, StateChange};
use crate::observe::Name;

/// A function called after every change of a breaker's state (see
/// [`BreakerConfig::on_state_change`]).
pub type StateChangeHook = Arc<dyn Fn(StateChange) + Send + Sync>;

/// A hook called on every call a breaker refuses
/// ([`BreakerConfig::with_on_rejection`]).
pub type RejectionHook = Arc<dyn Fn(&BreakerRejection) + Send + Sync>;

/// The longest duration any setting accepts.
pub(super) const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 60 * 60);
/// The shortest time window.
const MIN_TIME_WINDOW: Duration = Duration::from_secs(1);
/// The shortest bucket of a time window.
const MIN_BUCKET_WIDTH: Duration = Duration::from_millis(10);
/// The most buckets a time window may have (a full read touches every bucket of every
/// stripe).
pub(super) const MAX_TIME_BUCKETS: u32 = 100;
/// The most calls a count window may hold.
const MAX_COUNT_CALLS: u32 = 10_000;
/// The most buckets a count window may have.
const MAX_COUNT_BUCKETS: u32 = 1_000;
/// The largest `minimum_calls`: a busy bucket halves its counts rather than overflow,
/// and never holds fewer than 8191 calls after halving, so a busy window always
/// reaches this minimum.
const MAX_MINIMUM_CALLS: u32 = 8_000;
/// The most half-open probes.
pub(super) const MAX_PROBES: u32 = 1_000;

/// The sliding window over which a closed breaker computes its failure and slow-call
/// rates.
///
/// ```
/// use std::time::Duration;
/// use retrysafe::breaker::SlidingWindow;
///
/// assert_eq!(SlidingWindow::default(), SlidingWindow::time(Duration::from_secs(30), 10));
/// let last_100_calls = SlidingWindow::count(100, 10);
/// assert!(matches!(last_100_calls, SlidingWindow::Count { calls: 100, buckets: 10 }));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SlidingWindow {
    /// The calls of the last `length`, in `buckets` buckets of `length / buckets`; a call
    /// counts for between `(buckets - 1) / buckets` of `length` and all of it (exactly
    /// until the end of the `buckets`-th bucket after its own). `length` from 1 s to 30
    /// days, `buckets` from 1 to 100, each bucket at least 10 ms. The default: 30 s in
    /// 10 buckets.
    Time {
        /// The length of the window.
        length: Duration,
        /// How many buckets it is made of.
        buckets: u32,
    },
    /// The last `calls` calls, in `buckets` buckets of `calls / buckets` calls; the window
    /// holds the current bucket and the `buckets - 1` full ones before it, so between
    /// `calls - calls / buckets + 1` and `calls` calls (exactly the last `calls` when
    /// `buckets == calls`). `calls` from 1 to 10 000, a multiple of `buckets`; `buckets`
    /// from 1 to 1000.
    ///
    /// Every call increments one shared counter, so this window does not scale across
    /// cores like the time window, whose counters are striped per thread.
    Count {
        /// The number of calls.
        calls: u32,
        /// How many buckets they are grouped in.
        buckets: u32,
    },
}

impl SlidingWindow {
    /// A time window of `length` in `buckets` buckets.
    pub const fn time(length: Duration, buckets: u32) -> Self {
        SlidingWindow::Time { length, buckets }
    }

    /// A count window of the last `calls` calls in `buckets` buckets.
    pub const fn count(calls: u32, buckets: u32) -> Self {
        SlidingWindow::Count { calls, buckets }
    }

    /// Checks the window's own fields into `v`.
    fn validate(&self, v: &mut Validate) {
        match *self {
            SlidingWindow::Time { length, buckets } => {
                number(
                    v,
                    "window.buckets",
                    buckets,
                    MAX_TIME_BUCKETS,
                    "must be at most 100 for a time window",
                );
                if length < MIN_TIME_WINDOW {
                    v.refuse(ConfigError::new("window.length", "must be at least 1 s"));
                } else if length > MAX_DURATION {
                    v.refuse(ConfigError::new("window.length", "must be at most 30 days"));
                } else if buckets > 0 && length / buckets < MIN_BUCKET_WIDTH {
                    v.refuse(ConfigError::new(
                        "window.length",
                        "must be at least 10 ms per bucket",
                    ));
                }
            }
            SlidingWindow::Count { calls, buckets } => {
                number(
                    v,
                    "window.calls",
                    calls,
                    MAX_COUNT_CALLS,
                    "must be at most 10000",
                );
                number(
                    v,
                    "window.buckets",
                    buckets,
                    MAX_COUNT_BUCKETS,
                    "must be at most 1000 for a count window",
                );
                if buckets > 0 && calls % buckets != 0 {
                    v.refuse(ConfigError::new(
                        "window.calls",
                        "must be a multiple of window.buckets",
                    ));
                }
            }
        }
    }

    /// The window as used: every field brought into its range (a count window's calls
    /// rounded down to a multiple of its buckets).
    fn clamped(self) -> Self {
        match self {
            // At least 1 s in at most 100 buckets: every bucket is at least 10 ms.
            SlidingWindow::Time { length, buckets } => SlidingWindow::Time {
                length: length.clamp(MIN_TIME_WINDOW, MAX_DURATION),
                buckets: buckets.clamp(1, MAX_TIME_BUCKETS),
            },
            SlidingWindow::Count { calls, buckets } => {
                let calls = calls.clamp(1, MAX_COUNT_CALLS);
                let buckets = buckets.clamp(1, MAX_COUNT_BUCKETS).min(calls);
                SlidingWindow::Count {
                    calls: calls - calls % buckets,
                    buckets,
                }
            }
        }
    }
}

impl Default for SlidingWindow {
    /// 30 s in 10 buckets of 3 s.
    fn default() -> Self {
        SlidingWindow::time(Duration::from_secs(30), 10)
    }
}

/// Configuration of a [`CircuitBreaker`](super::CircuitBreaker).
///
/// Start from [`BreakerConfig::default`] and change what you need with the `with_*`
/// setters; [`build`](BreakerConfig::build) checks every field and names each one out of
/// range. A configuration that was never built still works: a breaker uses each field
/// brought into its range.
///
/// ```
/// use std::time::Duration;
/// use retrysafe::breaker::{BreakerConfig, CircuitBreaker, SlidingWindow};
///
/// let config = BreakerConfig::default()
///     .with_window(SlidingWindow::count(50, 5))
///     .with_minimum_calls(10)
///     .with_slow_call_duration(Duration::from_secs(2))
///     .with_slow_call_rate_threshold(80.0)
///     .with_on_state_change(|change| assert_ne!(change.from, change.to));
/// assert!(config.clone().build().is_ok());
/// let breaker = CircuitBreaker::new(config.clone());
///
/// let error = config
///     .with_failure_rate_threshold(0.0)
///     .with_half_open_probes(0)
///     .build()
///     .unwrap_err();
/// assert_eq!(
///     error.fields().collect::<Vec<_>>(),
///     ["failure_rate_threshold", "half_open_probes"]
/// );
/// ```
#[derive(Clone)]
pub struct BreakerConfig {
    window: SlidingWindow,
    failure_rate_threshold: f64,
    minimum_calls: u32,
    slow_call_duration: Option<Duration>,
    slow_call_rate_threshold: f64,
    open_duration: Duration,
    max_open_duration: Duration,
    half_open_probes: u32,
    half_open_timeout: Duration,
    on_state_change: Option<StateChangeHook>,
    on_rejection: Option<RejectionHook>,
    name: Name,
}

impl Default for BreakerConfig {
    /// A 30 s window in 10 buckets, 50 % failures over at least 20 calls, no slow-call
    /// tracking, open for 5 s doubling up to 60 s, 3 probes with a 10 s timeout.
    fn default() -> Self {
        BreakerConfig {
            window: SlidingWindow::default(),
            failure_rate_threshold: 50.0,
            minimum_calls: 20,
            slow_call_duration: None,
            slow_call_rate_threshold: 100.0,
            open_duration: Duration::from_secs(5),
            max_open_duration: Duration::from_secs(60),
            half_open_probes: 3,
            half_open_timeout: Duration::from_secs(10),
            on_state_change: None,
            on_rejection: None,
            name: Name::default(),
        }
    }
}

impl fmt::Debug for BreakerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BreakerConfig")
            .field("name", &self.name)
            .field("window", &self.window)
            .field("failure_rate_threshold", &self.failure_rate_threshold)
            .field("minimum_calls", &self.minimum_calls)
            .field("slow_call_duration", &self.slow_call_duration)
            .field("slow_call_rate_threshold", &self.slow_call_rate_threshold)
            .field("open_duration", &self.open_duration)
            .field("max_open_duration", &self.max_open_duration)
            .field("half_open_probes", &self.half_open_probes)
            .field("half_open_timeout", &self.half_open_timeout)
            .field(
                "on_state_change",
                &self.on_state_change.as_ref().map(|_| ".."),
            )
            .finish()
    }
}

impl BreakerConfig {
    /// The window the rates are computed over (default: 30 s in 10 buckets).
    #[must_use]
    pub fn with_window(mut self, window: SlidingWindow) -> Self {
        self.window = window;
        self
    }

    /// The failure rate, in percent, at or above which a closed breaker opens: greater
    /// than 0, at most 100 (default 50).
    #[must_use]
    pub fn with_failure_rate_threshold(mut self, percent: f64) -> Self {
        self.failure_rate_threshold = percent;
        self
    }

    /// The fewest non-neutral calls the window must hold before a rate can open the
    /// breaker: from 1 to 8000, and at most the calls of a count window (default 20).
    #[must_use]
    pub fn with_minimum_calls(mut self, calls: u32) -> Self {
        self.minimum_calls = calls;
        self
    }

    /// A call that takes at least this long is slow (by default slow calls are not
    /// tracked). From 1 ns to 30 days.
    #[must_use]
    pub fn with_slow_call_duration(mut self, duration: Duration) -> Self {
        self.slow_call_duration = Some(duration);
        self
    }

    /// The slow-call rate, in percent, at or above which a closed breaker opens, when a
    /// slow-call duration is set: greater than 0, at most 100 (default 100).
    #[must_use]
    pub fn with_slow_call_rate_threshold(mut self, percent: f64) -> Self {
        self.slow_call_rate_threshold = percent;
        self
    }

    /// How long the breaker stays open the first time (default 5 s); each consecutive
    /// re-opening (a failed half-open trial) doubles it, up to the maximum open
    /// duration. From 1 ns to 30 days.
    #[must_use]
    pub fn with_open_duration(mut self, duration: Duration) -> Self {
        self.open_duration = duration;
        self
    }

    /// The longest open duration: at least the open duration, at most 30 days (default
    /// 60 s).
    #[must_use]
    pub fn with_max_open_duration(mut self, duration: Duration) -> Self {
        self.max_open_duration = duration;
        self
    }

    /// How many trial calls a half-open breaker lets through; all must succeed for it
    /// to close. From 1 to 1000 (default 3).
    #[must_use]
    pub fn with_half_open_probes(mut self, probes: u32) -> Self {
        self.half_open_probes = probes;
        self
    }

    /// How long a half-open breaker waits for its probes' results, counted from the last
    /// probe let through: once every probe is out and this has passed without a
    /// decision, the next caller reopens the breaker (as if a probe had failed), so a
    /// probe that never reports cannot keep it half-open. From 1 ns to 30 days
    /// (default 10 s, the default per-attempt timeout of the retry layer).
    #[must_use]
    pub fn with_half_open_timeout(mut self, timeout: Duration) -> Self {
        self.half_open_timeout = timeout;
        self
    }

    /// Called after every change of state, on the thread that made it, outside any lock
    /// (default: none). Changes made at nearly the same time on different threads may
    /// be reported concurrently; [`StateChange::at`] orders them.
    #[must_use]
    pub fn with_on_state_change(
        mut self,
        hook: impl Fn(StateChange) + Send + Sync + 'static,
    ) -> Self {
        self.on_state_change = Some(Arc::new(hook));
        self
    }

    /// The sliding window.
    #[doc(hidden)]
    pub fn window(&self) -> SlidingWindow {
        self.window
    }

    /// The failure-rate threshold, in percent.
    #[doc(hidden)]
    pub fn failure_rate_threshold(&self) -> f64 {
        self.failure_rate_threshold
    }

    /// The fewest counted calls before a rate can open the breaker.
    #[doc(hidden)]
    pub fn minimum_calls(&self) -> u32 {
        self.minimum_calls
    }

    /// The duration from which a call is slow, if slow calls are tracked.
    #[doc(hidden)]
    pub fn slow_call_duration(&self) -> Option<Duration> {
        self.slow_call_duration
    }

    /// The slow-call-rate threshold, in percent.
    #[doc(hidden)]
    pub fn slow_call_rate_threshold(&self) -> f64 {
        self.slow_call_rate_threshold
    }

    /// The first open duration.
    #[doc(hidden)]
    pub fn open_duration(&self) -> Duration {
        self.open_duration
    }

    /// The longest open duration.
    #[doc(hidden)]
    pub fn max_open_duration(&self) -> Duration {
        self.max_open_duration
    }

    /// The half-open probes.
    #[doc(hidden)]
    pub fn half_open_probes(&self) -> u32 {
        self.half_open_probes
    }

    /// The half-open timeout.
    #[doc(hidden)]
    pub fn half_open_timeout(&self) -> Duration {
        self.half_open_timeout
    }

    /// The breaker's name (default `default`): the `name` of its events, hooks and
    /// metrics (`retrysafe_breaker_state`, `retrysafe_breaker_rejections_total`, whose
    /// handles are resolved when a layer using the breaker is built, or at its first
    /// change of state or refusal).
    #[must_use]
    pub fn with_name(mut self, name: impl Into<Name>) -> Self {
        self.name = name.into();
        self
    }

    /// Calls `hook` on every call the breaker refuses.
    #[must_use]
    pub fn with_on_rejection(
        mut self,
        hook: impl Fn(&BreakerRejection) + Send + Sync + 'static,
    ) -> Self {
        self.on_rejection = Some(Arc::new(hook));
        self
    }

    /// The breaker's name.
    #[doc(hidden)]
    pub fn name(&self) -> &Name {
        &self.name
    }

    /// The rejection hook, if any.
    #[doc(hidden)]
    pub fn on_rejection(&self) -> Option<&RejectionHook> {
        self.on_rejection.as_ref()
    }

    /// The state-change hook, if any.
    #[doc(hidden)]
    pub fn on_state_change(&self) -> Option<&StateChangeHook> {
        self.on_state_change.as_ref()
    }

    /// Checks every field: the error names each one out of its documented range.
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        self.window.validate(&mut v);
        rate(
            &mut v,
            "failure_rate_threshold",
            self.failure_rate_threshold,
        );
        let minimum_ok = number(
            &mut v,
            "minimum_calls",
            self.minimum_calls,
            MAX_MINIMUM_CALLS,
            "must be at most 8000",
        );
        if let SlidingWindow::Count { calls, .. } = self.window
            && minimum_ok
            && self.minimum_calls > calls
        {
            v.refuse(ConfigError::new(
                "minimum_calls",
                "must not exceed the calls of a count window",
            ));
        }
        if let Some(slow) = self.slow_call_duration {
            duration(&mut v, "slow_call_duration", slow);
        }
        rate(
            &mut v,
            "slow_call_rate_threshold",
            self.slow_call_rate_threshold,
        );
        duration(&mut v, "open_duration", self.open_duration);
        if duration(&mut v, "max_open_duration", self.max_open_duration)
            && self.max_open_duration < self.open_duration
        {
            v.refuse(ConfigError::new(
                "max_open_duration",
                "must be at least open_duration",
            ));
        }
        number(
            &mut v,
            "half_open_probes",
            self.half_open_probes,
            MAX_PROBES,
            "must be at most 1000",
        );
        duration(&mut v, "half_open_timeout", self.half_open_timeout);
        v.finish(self)
    }

    /// The configuration as a breaker uses it: every field brought into its range (a
    /// NaN threshold is 100 %).
    pub(super) fn clamped(mut self) -> Self {
        let percent = |p: f64| {
            if p.is_nan() {
                100.0
            } else {
                p.clamp(0.0001, 100.0)
            }
        };
        let one_ns = Duration::from_nanos(1);
        self.window = self.window.clamped();
        self.failure_rate_threshold = percent(self.failure_rate_threshold);
        let most_calls = match self.window {
            SlidingWindow::Count { calls, .. } => calls.min(MAX_MINIMUM_CALLS),
            SlidingWindow::Time { .. } => MAX_MINIMUM_CALLS,
        };
        self.minimum_calls = self.minimum_calls.clamp(1, most_calls);
        self.slow_call_duration = self
            .slow_call_duration
            .map(|d| d.clamp(one_ns, MAX_DURATION));
        self.slow_call_rate_threshold = percent(self.slow_call_rate_threshold);
        self.open_duration = self.open_duration.clamp(one_ns, MAX_DURATION);
        self.max_open_duration = self
            .max_open_duration
            .clamp(self.open_duration, MAX_DURATION);
        self.half_open_probes = self.half_open_probes.clamp(1, MAX_PROBES);
        self.half_open_timeout = self.half_open_timeout.clamp(one_ns, MAX_DURATION);
        self
    }
}

/// Checks a rate in percent: in (0, 100], not NaN.
fn rate(v: &mut Validate, field: &'static str, value: f64) {
    v.check(
        value > 0.0 && value <= 100.0,
        field,
        "must be a percentage greater than 0 and at most 100",
    );
}

/// Checks a number: greater than zero, at most `max` (refused with `too_large`).
/// Whether it was accepted.
fn number(
    v: &mut Validate,
    field: &'static str,
    value: u32,
    max: u32,
    too_large: &'static str,
) -> bool {
    if value == 0 {
        v.refuse(ConfigError::new(field, "must be greater than zero"));
        false
    } else if value > max {
        v.refuse(ConfigError::new(field, too_large));
        false
    } else {
        true
    }
}

/// Checks a duration: greater than zero, at most 30 days. Whether it was accepted.
fn duration(v: &mut Validate, field: &'static str, value: Duration) -> bool {
    if value.is_zero() {
        v.refuse(ConfigError::new(field, "must be greater than zero"));
        false
    } else if value > MAX_DURATION {
        v.refuse(ConfigError::new(field, "must be at most 30 days"));
        false
    } else {
        true
    }
}
