//! The typed errors of the client layers.
//!
//! Client layers return `BoxError`s holding one of these; [`find`] looks for one in an
//! error's `source()` chain. Each error implies that the request must not be retried
//! by any layer above.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

/// A boxed error: what the client layers, the stores and the reqwest adapters return.
pub type BoxError = Box<dyn StdError + Send + Sync>;

/// A retry budget refused a retry.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BudgetExhausted {}

impl BudgetExhausted {
    /// The error (for layers and adapters).
    #[doc(hidden)]
    pub fn new() -> Self {
        BudgetExhausted {}
    }
}

impl Default for BudgetExhausted {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for BudgetExhausted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("retry budget exhausted")
    }
}

impl StdError for BudgetExhausted {}

/// The call's deadline passed, or too little of it was left to start an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadlineExceeded {}

impl DeadlineExceeded {
    /// The error (for layers and adapters).
    #[doc(hidden)]
    pub fn new() -> Self {
        DeadlineExceeded {}
    }
}

impl Default for DeadlineExceeded {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for DeadlineExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("deadline exceeded")
    }
}

impl StdError for DeadlineExceeded {}

/// A circuit breaker is open: the call was refused without reaching the callee.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CircuitOpen {
    retry_in: Duration,
}

impl CircuitOpen {
    /// The error; the breaker lets a probe through after `retry_in`.
    #[doc(hidden)]
    pub fn new(retry_in: Duration) -> Self {
        CircuitOpen { retry_in }
    }

    /// How long until the breaker lets a probe through.
    pub fn retry_in(&self) -> Duration {
        self.retry_in
    }
}

impl fmt::Display for CircuitOpen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "circuit open (retry in {} ms)",
            self.retry_in.as_millis()
        )
    }
}

impl StdError for CircuitOpen {}

/// An adaptive throttle rejected the call locally, without sending it: the callee has
/// been refusing much of what it was sent lately. Never retried by any layer above, and
/// neutral to breakers and budgets.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Throttled {}

impl Throttled {
    /// The error (for layers and adapters).
    #[doc(hidden)]
    pub fn new() -> Self {
        Throttled {}
    }
}

impl Default for Throttled {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for Throttled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("throttled locally: the callee is refusing requests")
    }
}

impl StdError for Throttled {}

/// The first error of type `E` in `error`'s `source()` chain, `error` included.
///
/// ```
/// use retrysafe::error::{find, BudgetExhausted};
/// let e: Box<dyn std::error::Error + Send + Sync> = Box::new(BudgetExhausted::new());
/// assert!(find::<BudgetExhausted>(&*e).is_some());
/// ```
pub fn find<'a, E: StdError + 'static>(error: &'a (dyn StdError + 'static)) -> Option<&'a E> {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(found) = e.downcast_ref::<E>() {
            return Some(found);
        }
        current = e.source();
    }
    None
}
