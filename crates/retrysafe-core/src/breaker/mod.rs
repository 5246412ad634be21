//! Circuit breakers: a breaker stops calls to a downstream that keeps failing, so
//! callers fail at once instead of waiting on it and the downstream gets room to
//! recover.
//!
//! This is the sans-IO state machine that the `CircuitBreakerLayer` and the reqwest
//! middleware both drive: ask a [`CircuitBreaker`] for a [`Permit`] before every
//! attempt, make the call, and [`record`](Permit::record) the
//! [breaker outcome](crate::classify::Classification::breaker_outcome) of its
//! classification on the permit.
//!
//! # States
//!
//! - **Closed**: calls go through and their outcomes are counted in a sliding
//!   [window](SlidingWindow) (default: the last 30 s, in 10 buckets). When the window
//!   holds at least `minimum_calls` (20) counted calls and the failure rate is at or
//!   above `failure_rate_threshold` (50 %) — or, with `slow_call_duration` set, the
//!   share of calls at least that slow is at or above `slow_call_rate_threshold` — the
//!   breaker opens.
//! - **Open**: calls are refused with [`CircuitOpen`](crate::error::CircuitOpen),
//!   which carries the time left. The first opening lasts `open_duration` (5 s); each
//!   consecutive re-opening doubles it, up to `max_open_duration` (60 s): 5, 10, 20,
//!   40, 60, 60 s… Once it has passed, the next caller moves the breaker to half-open.
//! - **Half-open**: `half_open_probes` (3) calls go through as probes, the others are
//!   refused. When every probe succeeds the breaker closes, with an empty window and
//!   the open duration back to 5 s; the first probe that fails reopens it. A probe
//!   dropped without a result counts as a failure, and once every probe is out, a
//!   breaker still half-open `half_open_timeout` (10 s) after the last one left is
//!   reopened by the next caller, so a lost probe cannot keep it half-open.
//! - **Forced open** and **disabled**, set by [`CircuitBreaker::force_open`] and
//!   [`CircuitBreaker::disable`] until [`CircuitBreaker::reset`]: every call refused,
//!   or every call let through and nothing counted.
//!
//! # What counts
//!
//! Only the callee's own faults are failures. A failure of one of *its* dependencies
//! (an answer marked `do-not-retry` by a server that gave up downstream) and a timeout
//! caused by the deadline the caller propagated are **neutral**: neither counted nor
//! a success. Were they failures, one leaf outage would open every breaker up the
//! chain — each tier's breaker would see its callee fail and cut off a service that is
//! healthy itself. Client errors (4xx) count as successes: the callee answered.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::time::Duration;
//! use retrysafe::breaker::{CircuitBreaker, State};
//! use retrysafe::classify::{BreakerOutcome, Classification, FaultSide, RetrySafety};
//!
//! let breaker = CircuitBreaker::default(); // 50 % of at least 20 calls in 30 s
//! let took = Duration::from_millis(20);
//!
//! // A dependency of the callee is down: its answers are neutral.
//! let leaf_down = Classification::failure(RetrySafety::No, FaultSide::Dependency);
//! for _ in 0..100 {
//!     breaker.try_acquire().unwrap().record(leaf_down.breaker_outcome(), took);
//! }
//! assert_eq!(breaker.state(), State::Closed);
//! assert_eq!(breaker.window().calls(), 0);
//!
//! // The callee itself fails: 20 failures open the breaker for 5 s.
//! for _ in 0..20 {
//!     breaker.try_acquire().unwrap().record(BreakerOutcome::Failure, took);
//! }
//! assert_eq!(breaker.state(), State::Open);
//! assert_eq!(breaker.try_acquire().unwrap_err().retry_in(), Duration::from_secs(5));
//!
//! // 5 s later, three probes go through; a fourth caller is refused.
//! tokio::time::advance(Duration::from_secs(5)).await;
//! let probes: Vec<_> = (0..3).map(|_| breaker.try_acquire().unwrap()).collect();
//! assert_eq!(breaker.state(), State::HalfOpen);
//! assert!(breaker.try_acquire().is_err());
//! for probe in probes {
//!     probe.record(BreakerOutcome::Success, took);
//! }
//! assert_eq!(breaker.state(), State::Closed);
//! # }
//! ```
//!
//! # Concurrency
//!
//! A breaker is a cheap `Clone` handle, shared by every client of one downstream. The
//! closed path is lock-free: [`try_acquire`](CircuitBreaker::try_acquire) loads one
//! atomic state word, and recording a call is one compare-and-swap on a bucket of
//! the calling thread's own stripe of the window (see [`SlidingWindow`]); only a
//! failure or a slow call (rarely, a success) reads the whole window to check the
//! rates. Half-open probes are handed out by compare-and-swap on the state word, so
//! exactly `half_open_probes` callers get one however many race. Changes of state are
//! serialised by a mutex that no call takes otherwise; the
//! [`on_state_change`](BreakerConfig::on_state_change) hook and `tracing` events
//! (`warn` on opening, `info` otherwise) follow each change. A state word carries a
//! generation, so a result recorded after the breaker moved on (a call in flight when
//! it opened) is ignored. Time comes from [`tokio::time::Instant`], so breakers follow
//! a paused test clock.

mod circuit;
mod config;
mod state;
mod window;

pub use self::circuit::{BreakerMetrics, CircuitBreaker, Permit};
pub use self::config::{BreakerConfig, RejectionHook, SlidingWindow, StateChangeHook};
pub use self::state::{BreakerRejection, State, StateChange};
pub use self::window::WindowCounts;
