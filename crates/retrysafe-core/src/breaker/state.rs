//! The breaker's states, their changes, and the atomic word that holds the current one.

use std::fmt;

use tokio::time::Instant;

use crate::observe::Name;

/// The state of a [`CircuitBreaker`](super::CircuitBreaker).
///
/// ```
/// use retrysafe::breaker::{CircuitBreaker, State};
///
/// let breaker = CircuitBreaker::default();
/// assert_eq!(breaker.state(), State::Closed);
/// breaker.force_open();
/// assert_eq!(breaker.state(), State::ForcedOpen);
/// assert_eq!(State::HalfOpen.to_string(), "half-open");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum State {
    /// Calls go through and are counted.
    Closed,
    /// Calls are refused until the open duration has passed.
    Open,
    /// A few trial calls (probes) go through; the others are refused.
    HalfOpen,
    /// Every call is refused until [`reset`](super::CircuitBreaker::reset).
    ForcedOpen,
    /// Every call goes through and nothing is counted, until
    /// [`reset`](super::CircuitBreaker::reset).
    Disabled,
}

impl State {
    /// The state's name: `closed`, `open`, `half-open`, `forced-open` or `disabled`.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half-open",
            State::ForcedOpen => "forced-open",
            State::Disabled => "disabled",
        }
    }

    /// The state's code in a state word.
    fn code(self) -> u64 {
        match self {
            State::Closed => 0,
            State::Open => 1,
            State::HalfOpen => 2,
            State::ForcedOpen => 3,
            State::Disabled => 4,
        }
    }

    /// The state of a code (an unknown code, which is never written, reads as closed).
    fn from_code(code: u64) -> Self {
        match code {
            1 => State::Open,
            2 => State::HalfOpen,
            3 => State::ForcedOpen,
            4 => State::Disabled,
            _ => State::Closed,
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A change of a breaker's state, passed to the
/// [`on_state_change`](super::BreakerConfig::on_state_change) hook.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use retrysafe::breaker::{BreakerConfig, CircuitBreaker, State, StateChange};
///
/// let seen: Arc<Mutex<Vec<StateChange>>> = Arc::default();
/// let log = Arc::clone(&seen);
/// let config =
///     BreakerConfig::default().with_on_state_change(move |change| log.lock().unwrap().push(change));
/// let breaker = CircuitBreaker::new(config);
/// breaker.disable();
/// let seen = seen.lock().unwrap();
/// assert_eq!((seen[0].from, seen[0].to), (State::Closed, State::Disabled));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct StateChange {
    /// The breaker's name ([`BreakerConfig::with_name`](super::BreakerConfig::with_name)).
    pub name: Name,
    /// The state before.
    pub from: State,
    /// The state after.
    pub to: State,
    /// When the change happened.
    pub at: Instant,
}

/// A call a breaker refused, as the
/// [`on_rejection`](super::BreakerConfig::with_on_rejection) hook sees it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct BreakerRejection {
    /// The breaker's name.
    pub name: Name,
    /// The breaker's state: open, half-open (every probe out) or forced open.
    pub state: State,
    /// When a call may be allowed again (a hint).
    pub retry_after: std::time::Duration,
}

// The state word: the state (3 bits), the half-open probes handed out (10 bits) and
// those that succeeded (10 bits), and a generation (41 bits, wrapping) that every
// change of state increments, so a result recorded by a permit of an earlier
// generation is recognised and ignored.

/// Bits of the state code.
const STATE_MASK: u64 = 0b111;
/// Where the probes handed out are.
const ISSUED_SHIFT: u32 = 3;
/// Where the probes that succeeded are.
const SUCCEEDED_SHIFT: u32 = 13;
/// The mask of a probe count (at least [`MAX_PROBES`](super::config::MAX_PROBES)).
const PROBE_MASK: u64 = (1 << 10) - 1;
/// Where the generation is.
const GENERATION_SHIFT: u32 = 23;
/// The bits that identify one phase: the state and the generation.
const PHASE_MASK: u64 = !(((1 << GENERATION_SHIFT) - 1) & !STATE_MASK);

/// A decoded state word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Word(pub(super) u64);

impl Word {
    /// The first word of a breaker: closed, generation 0.
    pub(super) const INITIAL: Word = Word(0);

    /// The word of the next phase: `state`, the next generation, no probes.
    pub(super) fn next(self, state: State) -> Word {
        let generation = (self.0 >> GENERATION_SHIFT).wrapping_add(1);
        Word((generation << GENERATION_SHIFT) | state.code())
    }

    /// The state.
    pub(super) fn state(self) -> State {
        State::from_code(self.0 & STATE_MASK)
    }

    /// The state and generation, which identify a phase.
    pub(super) fn phase(self) -> u64 {
        self.0 & PHASE_MASK
    }

    /// The probes handed out in this (half-open) phase.
    pub(super) fn issued(self) -> u64 {
        (self.0 >> ISSUED_SHIFT) & PROBE_MASK
    }

    /// The probes of this (half-open) phase that succeeded.
    pub(super) fn succeeded(self) -> u64 {
        (self.0 >> SUCCEEDED_SHIFT) & PROBE_MASK
    }

    /// This word with `issued` probes handed out (at most [`PROBE_MASK`]).
    pub(super) fn with_issued(self, issued: u64) -> Word {
        Word((self.0 & !(PROBE_MASK << ISSUED_SHIFT)) | ((issued & PROBE_MASK) << ISSUED_SHIFT))
    }

    /// This word with `succeeded` probes that succeeded (at most [`PROBE_MASK`]).
    pub(super) fn with_succeeded(self, succeeded: u64) -> Word {
        Word(
            (self.0 & !(PROBE_MASK << SUCCEEDED_SHIFT))
                | ((succeeded & PROBE_MASK) << SUCCEEDED_SHIFT),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip() {
        for state in [
            State::Closed,
            State::Open,
            State::HalfOpen,
            State::ForcedOpen,
            State::Disabled,
        ] {
            assert_eq!(State::from_code(state.code()), state);
        }
        let w = Word::INITIAL.next(State::HalfOpen);
        assert_eq!(w.state(), State::HalfOpen);
        let probing = w.with_issued(3).with_succeeded(2);
        assert_eq!((probing.issued(), probing.succeeded()), (3, 2));
        assert_eq!(probing.phase(), w.phase());
        assert_eq!(probing.state(), State::HalfOpen);
        assert_ne!(w.next(State::HalfOpen).phase(), w.phase());
        let last = Word(!STATE_MASK).next(State::Open);
        assert_eq!(last.state(), State::Open); // the generation wraps
        assert_eq!(last.0 >> GENERATION_SHIFT, 0);
    }
}
