//! The breaker handle, its permits and its state machine.

use std::fmt;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, SeqCst};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::classify::BreakerOutcome;
use crate::error::CircuitOpen;
use crate::hedge::HedgeRace;
use crate::observe::handles::{Counter, Gauge, Lazy};
use crate::observe::{Name, names};

use super::config::BreakerConfig;
use super::state::{BreakerRejection, State, StateChange, Word};
use super::window::{Call, Window, WindowCounts};
use crate::stripe::{CachePadded, Local, Striped, nanos};
use crate::sync::{AtomicBool, AtomicU64, Mutex, fence, now};

/// How many times one evaluation reads the window at most (see `Shared::evaluate`).
const MAX_EVALUATIONS: usize = 4;

/// Fixed-point scale of the rate thresholds: percent × 10 000, so 100 % is one million.
const RATE_SCALE: u128 = 1_000_000;

/// A circuit breaker: a cheap `Clone` handle (one `Arc`) on state shared by every
/// clone. Its permits count their references to that state per thread
/// (a striped count), so threads sharing one breaker do not contend on a reference count.
///
/// Ask for a [`Permit`] before every call with [`try_acquire`](Self::try_acquire) and
/// [`record`](Permit::record) the call's outcome on it; see the
/// [module documentation](super) for the states and what moves the breaker between
/// them.
///
/// ```
/// use std::time::Duration;
/// use retrysafe::breaker::{CircuitBreaker, State};
/// use retrysafe::classify::BreakerOutcome;
///
/// let breaker = CircuitBreaker::default();
/// let clone = breaker.clone();
/// assert!(breaker.same_breaker(&clone));
/// for _ in 0..20 {
///     let permit = clone.try_acquire().unwrap();
///     permit.record(BreakerOutcome::Failure, Duration::from_millis(3));
/// }
/// assert_eq!(breaker.state(), State::Open);
/// ```
#[derive(Clone)]
pub struct CircuitBreaker {
    shared: Striped<Shared>,
}

/// What the hot paths read: the state word and the "suspect" flag, kept on cache lines
/// of their own by [`CachePadded`].
#[derive(Debug)]
struct Hot {
    /// The current [`Word`].
    state: AtomicU64,
    /// The last evaluation found a rate at or above its threshold with fewer than
    /// `minimum_calls` calls: successes must then evaluate too, since one may bring the
    /// window to `minimum_calls`.
    suspect: AtomicBool,
}

/// The state shared by the clones of a breaker.
struct Shared {
    hot: CachePadded<Hot>,
    /// Epoch zero of the times below.
    start: Instant,
    /// When an open breaker lets a probe through, in nanoseconds since `start`.
    open_until: AtomicU64,
    /// When the last probe of the half-open phase was handed out (or the phase began),
    /// in nanoseconds since `start`.
    last_probe_at: AtomicU64,
    /// Serialises changes of state; holds the number of consecutive openings since
    /// the breaker last closed.
    transitions: Mutex<u32>,
    window: Window,
    /// The failure-rate threshold × [`RATE_SCALE`] / 100.
    failure_threshold: u128,
    /// The slow-call-rate threshold × [`RATE_SCALE`] / 100.
    slow_threshold: u128,
    minimum_calls: u64,
    probes: u64,
    open_nanos: u64,
    max_open_nanos: u64,
    half_open_timeout_nanos: u64,
    config: BreakerConfig,
    metrics: Metrics,
}

/// The metric handles of a breaker: its own, or those of its map of keyed breakers.
enum Metrics {
    Own(Lazy<BreakerMetrics>),
    Shared(Arc<BreakerMetrics>),
}

/// The metric handles of a breaker (or of a map of keyed breakers), resolved once.
#[doc(hidden)]
#[derive(Debug, Default, Clone)]
pub struct BreakerMetrics {
    /// `retrysafe_breaker_state{name}`; empty for keyed breakers.
    state: Gauge,
    /// `retrysafe_breaker_rejections_total{name}`.
    rejections: Counter,
}

impl BreakerMetrics {
    /// The handles of the breaker `name`; `gauge`: whether it reports its state (a map
    /// of keyed breakers does not: one gauge cannot say the state of every key).
    pub fn new(name: &Name, gauge: bool) -> Self {
        BreakerMetrics {
            state: if gauge {
                Gauge::new(names::BREAKER_STATE, name)
            } else {
                Gauge::default()
            },
            rejections: Counter::new(names::BREAKER_REJECTIONS_TOTAL, name, None),
        }
    }
}

/// The value of `retrysafe_breaker_state` for `state`: 0 closed (or disabled), 1
/// half-open, 2 open (or forced open).
fn gauge_value(state: State) -> f64 {
    match state {
        State::Closed | State::Disabled => 0.0,
        State::HalfOpen => 1.0,
        State::Open | State::ForcedOpen => 2.0,
    }
}

/// Permission to make one call, from [`CircuitBreaker::try_acquire`].
///
/// [`record`](Self::record) the call's outcome on it. A permit dropped without a
/// result counts as a **failure** when it is a half-open probe (so a probe whose call
/// was cancelled cannot keep the breaker half-open), and as **nothing** when the breaker
/// was closed (a call cancelled by its caller says nothing about the callee). Results
/// that arrive after the breaker changed state (a call that was in flight when it
/// opened) are ignored.
#[must_use = "record the call's outcome on the permit"]
pub struct Permit {
    shared: Local<Shared>,
    /// The phase (state and generation) the permit was handed out in.
    phase: Word,
    /// Recorded: the drop guard has nothing left to do.
    done: bool,
    /// The hedge race of the call, if it is one copy of a hedged request.
    race: Option<HedgeRace>,
}

impl CircuitBreaker {
    /// A breaker with `config`, closed. [`BreakerConfig::build`] checks a configuration;
    /// one that was never built is used with each field brought into its range.
    pub fn new(config: BreakerConfig) -> Self {
        let metrics = Metrics::Own(Lazy::default());
        CircuitBreaker {
            shared: Striped::new(Shared::new(config.clamped(), metrics)),
        }
    }

    /// A breaker counting into `metrics` (resolved once for a map of keyed breakers,
    /// which report no state gauge).
    #[doc(hidden)]
    pub fn with_metrics(config: BreakerConfig, metrics: Arc<BreakerMetrics>) -> Self {
        CircuitBreaker {
            shared: Striped::new(Shared::new(config.clamped(), Metrics::Shared(metrics))),
        }
    }

    /// Resolves the breaker's metric handles now, against the recorder installed now
    /// (else at its first change of state or refusal), and sets its state gauge: for a
    /// layer or stack using the breaker, when it is built.
    #[doc(hidden)]
    pub fn resolve_metrics(&self) {
        let _ = self.shared.metrics();
    }

    /// Counts a refusal and calls the hook: the breaker was in `state`, a call may be
    /// allowed after `retry_after`.
    #[cold]
    fn refused(&self, state: State, retry_after: Duration) -> CircuitOpen {
        let shared = &self.shared;
        shared.metrics().rejections.increment();
        tracing::Span::current().record("breaker", "rejected");
        if let Some(hook) = shared.config.on_rejection() {
            hook(&BreakerRejection {
                name: shared.config.name().clone(),
                state,
                retry_after,
            });
        }
        CircuitOpen::new(retry_after)
    }

    /// Asks to make one call.
    ///
    /// - **Closed**: a permit, lock-free (one atomic load).
    /// - **Open**: [`CircuitOpen`] with the time left until a probe is allowed; once it
    ///   has passed, this call moves the breaker to half-open and takes the first probe.
    /// - **Half-open**: one of the `half_open_probes` permits, however many callers race
    ///   for them; every other caller gets [`CircuitOpen`], with the time left until
    ///   the half-open timeout would reopen the breaker. Once every probe is out and the
    ///   timeout has passed, this call reopens the breaker.
    /// - **Forced open**: always [`CircuitOpen`], with `max_open_duration` as a hint.
    /// - **Disabled**: always a permit, whose result is not counted.
    pub fn try_acquire(&self) -> Result<Permit, CircuitOpen> {
        let shared = &self.shared;
        loop {
            let word = Word(shared.hot.0.state.load(Acquire));
            match word.state() {
                State::Closed | State::Disabled => return Ok(self.permit(word)),
                State::ForcedOpen => {
                    let hint = shared.config.max_open_duration();
                    return Err(self.refused(State::ForcedOpen, hint));
                }
                State::Open => {
                    let now = shared.now();
                    let until = shared.open_until.load(Relaxed);
                    if now < until {
                        let left = Duration::from_nanos(until - now);
                        return Err(self.refused(State::Open, left));
                    }
                    shared.transition(Some(word), State::HalfOpen);
                }
                State::HalfOpen => {
                    let now = shared.now();
                    let issued = word.issued();
                    if issued < shared.probes {
                        // Before the CAS, so a caller that sees every probe out also
                        // sees when the last one left (a failed CAS only delays the
                        // timeout).
                        shared.last_probe_at.fetch_max(now, Relaxed);
                        let next = word.with_issued(issued + 1);
                        if shared
                            .hot
                            .0
                            .state
                            .compare_exchange(word.0, next.0, AcqRel, Acquire)
                            .is_ok()
                        {
                            return Ok(self.permit(word));
                        }
                        continue;
                    }
                    let deadline = shared
                        .last_probe_at
                        .load(Relaxed)
                        .saturating_add(shared.half_open_timeout_nanos);
                    if now < deadline {
                        let left = Duration::from_nanos(deadline - now);
                        return Err(self.refused(State::HalfOpen, left));
                    }
                    tracing::debug!("circuit breaker probes timed out");
                    shared.transition(Some(word), State::Open);
                }
            }
        }
    }

    /// A permit for the phase of `word`.
    fn permit(&self, word: Word) -> Permit {
        Permit {
            shared: self.shared.local(),
            phase: word,
            done: false,
            race: None,
        }
    }

    /// The current state.
    ///
    /// Reading it changes nothing: an open breaker whose open duration has passed
    /// stays [`State::Open`] until the next [`try_acquire`](Self::try_acquire).
    pub fn state(&self) -> State {
        Word(self.shared.hot.0.state.load(Acquire)).state()
    }

    /// The calls in the window now. The window is emptied when the breaker closes again
    /// (or is [`reset`](Self::reset)), and counts nothing while it is not closed. This
    /// reads every bucket (of every stripe): meant for tests, metrics and debugging.
    pub fn window(&self) -> WindowCounts {
        self.shared.window.counts()
    }

    /// Forces the breaker open: every call is refused until [`reset`](Self::reset).
    pub fn force_open(&self) {
        self.shared.transition(None, State::ForcedOpen);
    }

    /// Disables the breaker: every call goes through and nothing is counted, until
    /// [`reset`](Self::reset).
    pub fn disable(&self) {
        self.shared.transition(None, State::Disabled);
    }

    /// Closes the breaker, from any state, with an empty window and the open duration
    /// back to `open_duration`. Results of permits handed out before are ignored.
    pub fn reset(&self) {
        self.shared.transition(None, State::Closed);
    }

    /// The configuration, as used (each field in its range).
    #[doc(hidden)]
    pub fn config(&self) -> &BreakerConfig {
        &self.shared.config
    }

    /// Whether `self` and `other` are handles on the same breaker (one is a clone of
    /// the other).
    #[doc(hidden)]
    pub fn same_breaker(&self, other: &CircuitBreaker) -> bool {
        self.shared.ptr_eq(&other.shared)
    }
}

impl Default for CircuitBreaker {
    /// A breaker with the default configuration ([`BreakerConfig::default`]).
    fn default() -> Self {
        Self::new(BreakerConfig::default())
    }
}

impl fmt::Debug for CircuitBreaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let word = Word(self.shared.hot.0.state.load(Acquire));
        f.debug_struct("CircuitBreaker")
            .field("state", &word.state())
            .field("window", &self.shared.window)
            .field("config", &self.shared.config)
            .finish()
    }
}

impl Permit {
    /// Records the call's outcome ([`Classification::breaker_outcome`]) and how long it
    /// took (compared with `slow_call_duration`).
    ///
    /// [`Classification::breaker_outcome`]: crate::classify::Classification::breaker_outcome
    ///
    /// In a closed breaker, a success or a failure is counted in the window (a neutral
    /// outcome is not), and a failure or a slow call (or a success while the window
    /// holds too few calls but too many failures) checks the rates. On a half-open
    /// probe, a failure (or, with slow-call tracking, a slow call) reopens the breaker
    /// at once, a success counts towards closing it, and a neutral outcome — which says
    /// nothing about the callee — gives the probe back for another caller to take.
    pub fn record(mut self, outcome: BreakerOutcome, elapsed: Duration) {
        self.done = true;
        match self.phase.state() {
            State::Closed => self.shared.record_closed(self.phase, outcome, elapsed),
            State::HalfOpen => self.shared.record_probe(self.phase, outcome, elapsed),
            State::Open | State::ForcedOpen | State::Disabled => {}
        }
    }

    /// Makes the permit's call one copy of a hedged request: dropped unrecorded after
    /// `race` was settled (another copy won), it was cancelled by the hedge, which says
    /// nothing about the callee — a probe is given back, not counted as a failure.
    #[doc(hidden)]
    pub fn in_race(&mut self, race: HedgeRace) {
        self.race = Some(race);
    }

    /// Whether this permit is a half-open probe (its result decides whether the breaker
    /// closes).
    #[doc(hidden)]
    pub fn is_probe(&self) -> bool {
        self.phase.state() == State::HalfOpen
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.done && self.phase.state() == State::HalfOpen {
            if self.race.as_ref().is_some_and(HedgeRace::is_settled) {
                tracing::debug!("circuit breaker probe cancelled by a hedge: given back");
                self.shared
                    .record_probe(self.phase, BreakerOutcome::Neutral, Duration::ZERO);
                return;
            }
            tracing::debug!("circuit breaker probe dropped without a result");
            self.shared.transition(Some(self.phase), State::Open);
        }
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("state", &self.phase.state())
            .field("probe", &self.is_probe())
            .finish()
    }
}

impl Shared {
    /// The state of a breaker with `config`, every field in range ([`BreakerConfig::clamped`]).
    fn new(config: BreakerConfig, metrics: Metrics) -> Self {
        let rate = |percent: f64| {
            #[allow(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                reason = "clamped to (0, 100], so the product is at most one million"
            )]
            let scaled = (percent * 10_000.0).round() as u64;
            u128::from(scaled.max(1))
        };
        Shared {
            hot: CachePadded(Hot {
                state: AtomicU64::new(Word::INITIAL.0),
                suspect: AtomicBool::new(false),
            }),
            start: now(),
            open_until: AtomicU64::new(0),
            last_probe_at: AtomicU64::new(0),
            transitions: Mutex::new(0),
            window: Window::new(config.window()),
            failure_threshold: rate(config.failure_rate_threshold()),
            slow_threshold: rate(config.slow_call_rate_threshold()),
            minimum_calls: u64::from(config.minimum_calls()),
            probes: u64::from(config.half_open_probes()),
            open_nanos: nanos(config.open_duration()),
            max_open_nanos: nanos(config.max_open_duration()),
            half_open_timeout_nanos: nanos(config.half_open_timeout()),
            config,
            metrics,
        }
    }

    /// The metric handles, made on first need with the gauge set to the state then.
    fn metrics(&self) -> &BreakerMetrics {
        match &self.metrics {
            Metrics::Shared(metrics) => metrics,
            Metrics::Own(lazy) => lazy.get(|| {
                let metrics = BreakerMetrics::new(self.config.name(), true);
                metrics
                    .state
                    .set(gauge_value(Word(self.hot.0.state.load(Acquire)).state()));
                metrics
            }),
        }
    }

    /// Nanoseconds since `start`.
    fn now(&self) -> u64 {
        nanos(now().saturating_duration_since(self.start))
    }

    /// Whether a call that took `elapsed` is slow.
    fn is_slow(&self, elapsed: Duration) -> bool {
        self.config
            .slow_call_duration()
            .is_some_and(|slow| elapsed >= slow)
    }

    /// A result in the closed phase `phase`.
    fn record_closed(&self, phase: Word, outcome: BreakerOutcome, elapsed: Duration) {
        let failure = match outcome {
            BreakerOutcome::Success => false,
            BreakerOutcome::Failure => true,
            BreakerOutcome::Neutral => return,
        };
        let word = Word(self.hot.0.state.load(Acquire));
        if word.phase() != phase.phase() {
            return;
        }
        let call = Call {
            failure,
            slow: self.is_slow(elapsed),
        };
        self.window.record(call);
        // Orders the record before the reads that follow (the window's other stripes,
        // the suspect flag) against the other recording threads': of two calls recorded
        // at once, the second to read sees the first (otherwise, on weakly ordered CPUs,
        // each may read the window without the other's call).
        fence(SeqCst);
        if call.failure || call.slow || self.hot.0.suspect.load(Relaxed) {
            self.evaluate(word);
        }
    }

    /// Checks the window's rates in the closed phase of `word`; opens the breaker when
    /// one is at or above its threshold over at least `minimum_calls` calls, and
    /// otherwise keeps the "suspect" flag (the window is failing, but over too few
    /// calls: successes must evaluate too) equal to what it read.
    ///
    /// A change of the flag is followed by a fence and one more reading of the window:
    /// a call recorded since this reading may have checked the flag before the store
    /// (a success that then skipped its own evaluation), or another evaluation may have
    /// raised the flag that this one, working from an older reading, just lowered.
    /// Repeated until the flag agrees with a reading made after the last change, at
    /// most [`MAX_EVALUATIONS`] times (each repetition needs another thread's change in
    /// between).
    fn evaluate(&self, word: Word) {
        for _ in 0..MAX_EVALUATIONS {
            let counts = self.window.counts();
            let calls = u128::from(counts.calls());
            let over = |count: u64, threshold: u128| {
                calls > 0 && u128::from(count) * RATE_SCALE >= threshold * calls
            };
            let failing = over(counts.failures, self.failure_threshold)
                || (self.config.slow_call_duration().is_some()
                    && over(counts.slow_calls, self.slow_threshold));
            if failing && counts.calls() >= self.minimum_calls {
                self.transition(Some(word), State::Open);
                return;
            }
            if self.hot.0.suspect.load(Relaxed) == failing {
                return;
            }
            self.hot.0.suspect.store(failing, Relaxed);
            fence(SeqCst);
        }
    }

    /// A result of a probe of the half-open phase `phase`.
    fn record_probe(&self, phase: Word, outcome: BreakerOutcome, elapsed: Duration) {
        let failed = match outcome {
            BreakerOutcome::Success => self.is_slow(elapsed),
            BreakerOutcome::Failure => true,
            BreakerOutcome::Neutral => {
                self.release_probe(phase);
                return;
            }
        };
        if failed {
            self.transition(Some(phase), State::Open);
            return;
        }
        let mut word = Word(self.hot.0.state.load(Acquire));
        loop {
            if word.phase() != phase.phase() {
                return;
            }
            let succeeded = word.succeeded() + 1;
            let next = word.with_succeeded(succeeded);
            match self
                .hot
                .0
                .state
                .compare_exchange_weak(word.0, next.0, AcqRel, Acquire)
            {
                Ok(_) => {
                    if succeeded >= self.probes {
                        self.transition(Some(next), State::Closed);
                    }
                    return;
                }
                Err(actual) => word = Word(actual),
            }
        }
    }

    /// Gives a probe of the half-open phase `phase` back.
    fn release_probe(&self, phase: Word) {
        let mut word = Word(self.hot.0.state.load(Acquire));
        while word.phase() == phase.phase() && word.issued() > 0 {
            let next = word.with_issued(word.issued() - 1);
            match self
                .hot
                .0
                .state
                .compare_exchange_weak(word.0, next.0, AcqRel, Acquire)
            {
                Ok(_) => return,
                Err(actual) => word = Word(actual),
            }
        }
    }

    /// Moves the breaker to `to`, if it is still in the phase of `from` (`None`: from
    /// any phase); reports the change after the lock is released.
    fn transition(&self, from: Option<Word>, to: State) {
        let change = {
            let mut opens = self
                .transitions
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let current = Word(self.hot.0.state.load(Acquire));
            if from.is_some_and(|from| from.phase() != current.phase()) {
                return; // another caller made this change (or another) first
            }
            let at = now();
            let now = nanos(at.saturating_duration_since(self.start));
            match to {
                State::Open => {
                    let factor = 1u64.checked_shl(*opens).unwrap_or(u64::MAX);
                    let duration = self
                        .open_nanos
                        .saturating_mul(factor)
                        .min(self.max_open_nanos);
                    *opens = opens.saturating_add(1);
                    self.open_until.store(now.saturating_add(duration), Relaxed);
                }
                State::HalfOpen => self.last_probe_at.store(now, Relaxed),
                State::Closed => {
                    *opens = 0;
                    self.window.reset();
                    self.hot.0.suspect.store(false, Relaxed);
                }
                State::ForcedOpen | State::Disabled => {}
            }
            // Under the lock only probe counts change concurrently, never the phase:
            // swapping replaces them with the new phase's.
            self.hot.0.state.swap(current.next(to).0, AcqRel);
            (current.state(), at)
        };
        let (from, at) = change;
        if from == to {
            return;
        }
        self.metrics().state.set(gauge_value(to));
        let change = StateChange {
            name: self.config.name().clone(),
            from,
            to,
            at,
        };
        match to {
            State::Open | State::ForcedOpen => tracing::warn!(
                name = %change.name,
                from = change.from.as_str(),
                to = change.to.as_str(),
                "circuit breaker opened"
            ),
            State::Closed | State::HalfOpen | State::Disabled => tracing::info!(
                name = %change.name,
                from = change.from.as_str(),
                to = change.to.as_str(),
                "circuit breaker state changed"
            ),
        }
        if let Some(hook) = self.config.on_state_change() {
            hook(change);
        }
    }
}
