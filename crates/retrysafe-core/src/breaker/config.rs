//! The breaker's configuration and its validation.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::ConfigError;

use super::StateChange;

/// A function called after every change of a breaker's state (see
/// [`BreakerConfig::on_state_change`]).
pub type StateChangeHook = Arc<dyn Fn(StateChange) + Send + Sync>;

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
/// use retrysafe_core::breaker::SlidingWindow;
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

    /// Checks the window's own fields.
    fn validate(&self) -> Result<(), ConfigError> {
        match *self {
            SlidingWindow::Time { length, buckets } => {
                number(
                    "window.buckets",
                    buckets,
                    MAX_TIME_BUCKETS,
                    "must be at most 100 for a time window",
                )?;
                if length < MIN_TIME_WINDOW {
                    return Err(ConfigError::new("window.length", "must be at least 1 s"));
                }
                if length > MAX_DURATION {
                    return Err(ConfigError::new("window.length", "must be at most 30 days"));
                }
                if length / buckets < MIN_BUCKET_WIDTH {
                    return Err(ConfigError::new(
                        "window.length",
                        "must be at least 10 ms per bucket",
                    ));
                }
                Ok(())
            }
            SlidingWindow::Count { calls, buckets } => {
                number(
                    "window.calls",
                    calls,
                    MAX_COUNT_CALLS,
                    "must be at most 10000",
                )?;
                number(
                    "window.buckets",
                    buckets,
                    MAX_COUNT_BUCKETS,
                    "must be at most 1000 for a count window",
                )?;
                if calls % buckets != 0 {
                    return Err(ConfigError::new(
                        "window.calls",
                        "must be a multiple of window.buckets",
                    ));
                }
                Ok(())
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
/// Start from [`BreakerConfig::default`] and change fields;
/// [`CircuitBreaker::new`](super::CircuitBreaker::new) checks every one.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use retrysafe_core::breaker::{BreakerConfig, CircuitBreaker, SlidingWindow};
///
/// let mut config = BreakerConfig::default();
/// config.window = SlidingWindow::count(50, 5);
/// config.minimum_calls = 10;
/// config.slow_call_duration = Some(Duration::from_secs(2));
/// config.slow_call_rate_threshold = 80.0;
/// config.on_state_change = Some(Arc::new(|change| assert_ne!(change.from, change.to)));
/// assert!(CircuitBreaker::new(config.clone()).is_ok());
///
/// config.failure_rate_threshold = 0.0;
/// let error = CircuitBreaker::new(config).unwrap_err();
/// assert_eq!(error.field(), "failure_rate_threshold");
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct BreakerConfig {
    /// The window the rates are computed over (default: 30 s in 10 buckets).
    pub window: SlidingWindow,
    /// The failure rate, in percent, at or above which a closed breaker opens: greater
    /// than 0, at most 100 (default 50).
    pub failure_rate_threshold: f64,
    /// The fewest non-neutral calls the window must hold before a rate can open the
    /// breaker: from 1 to 8000, and at most the calls of a count window (default 20).
    pub minimum_calls: u32,
    /// A call that takes at least this long is slow (`None`, the default: slow calls are
    /// not tracked). From 1 ns to 30 days.
    pub slow_call_duration: Option<Duration>,
    /// The slow-call rate, in percent, at or above which a closed breaker opens, when
    /// `slow_call_duration` is set: greater than 0, at most 100 (default 100).
    pub slow_call_rate_threshold: f64,
    /// How long the breaker stays open the first time (default 5 s); each consecutive
    /// re-opening (a failed half-open trial) doubles it, up to `max_open_duration`.
    /// From 1 ns to 30 days.
    pub open_duration: Duration,
    /// The longest open duration: at least `open_duration`, at most 30 days (default
    /// 60 s).
    pub max_open_duration: Duration,
    /// How many trial calls a half-open breaker lets through; all must succeed for it
    /// to close. From 1 to 1000 (default 3).
    pub half_open_probes: u32,
    /// How long a half-open breaker waits for its probes' results, counted from the last
    /// probe let through: once every probe is out and this has passed without a
    /// decision, the next caller reopens the breaker (as if a probe had failed), so a
    /// probe that never reports cannot keep it half-open. From 1 ns to 30 days
    /// (default 10 s, the default per-attempt timeout of the retry layer).
    pub half_open_timeout: Duration,
    /// Called after every change of state, on the thread that made it, outside any lock
    /// (default `None`). Changes made at nearly the same time on different threads may
    /// be reported concurrently; [`StateChange::at`] orders them.
    pub on_state_change: Option<StateChangeHook>,
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
        }
    }
}

impl fmt::Debug for BreakerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BreakerConfig")
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
    /// Checks every field.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        self.window.validate()?;
        rate("failure_rate_threshold", self.failure_rate_threshold)?;
        number(
            "minimum_calls",
            self.minimum_calls,
            MAX_MINIMUM_CALLS,
            "must be at most 8000",
        )?;
        if let SlidingWindow::Count { calls, .. } = self.window
            && self.minimum_calls > calls
        {
            return Err(ConfigError::new(
                "minimum_calls",
                "must not exceed the calls of a count window",
            ));
        }
        if let Some(slow) = self.slow_call_duration {
            duration("slow_call_duration", slow)?;
        }
        rate("slow_call_rate_threshold", self.slow_call_rate_threshold)?;
        duration("open_duration", self.open_duration)?;
        duration("max_open_duration", self.max_open_duration)?;
        if self.max_open_duration < self.open_duration {
            return Err(ConfigError::new(
                "max_open_duration",
                "must be at least open_duration",
            ));
        }
        number(
            "half_open_probes",
            self.half_open_probes,
            MAX_PROBES,
            "must be at most 1000",
        )?;
        duration("half_open_timeout", self.half_open_timeout)?;
        Ok(())
    }
}

/// Checks a rate in percent: in (0, 100], not NaN.
fn rate(field: &'static str, value: f64) -> Result<(), ConfigError> {
    if value > 0.0 && value <= 100.0 {
        Ok(())
    } else {
        Err(ConfigError::new(
            field,
            "must be a percentage greater than 0 and at most 100",
        ))
    }
}

/// Checks a number: greater than zero, at most `max` (refused with `too_large`).
fn number(
    field: &'static str,
    value: u32,
    max: u32,
    too_large: &'static str,
) -> Result<(), ConfigError> {
    if value == 0 {
        Err(ConfigError::new(field, "must be greater than zero"))
    } else if value > max {
        Err(ConfigError::new(field, too_large))
    } else {
        Ok(())
    }
}

/// Checks a duration: greater than zero, at most 30 days.
fn duration(field: &'static str, value: Duration) -> Result<(), ConfigError> {
    if value.is_zero() {
        Err(ConfigError::new(field, "must be greater than zero"))
    } else if value > MAX_DURATION {
        Err(ConfigError::new(field, "must be at most 30 days"))
    } else {
        Ok(())
    }
}
