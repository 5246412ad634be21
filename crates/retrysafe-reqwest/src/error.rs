//! Finding retrysafe's typed errors in a [`reqwest_middleware::Error`].
//!
//! The middleware of this crate fail with small typed errors of
//! [`retrysafe_core::error`] — [`DeadlineExceeded`], [`CircuitOpen`],
//! [`BudgetExhausted`] — carried as `reqwest_middleware::Error::Middleware(anyhow::Error)`.
//! That variant's `source()` skips the `anyhow` payload (it is `#[error(transparent)]`,
//! so it forwards to the payload's own source), and the `Reqwest` variant's skips the
//! `reqwest::Error` itself: walking `source()` alone never finds them.
//! [`find`] walks the right chain: the `anyhow` payload and its sources, or the
//! `reqwest::Error` and its sources, stepping into any `reqwest_middleware::Error`
//! nested in the chain (a middleware that wrapped another's error).
//!
//! ```
//! use std::time::Duration;
//! use retrysafe::error::{CircuitOpen, DeadlineExceeded};
//! use retrysafe::reqwest::error::{find, is_circuit_open, is_deadline_exceeded};
//!
//! let error = reqwest_middleware::Error::Middleware(anyhow::Error::new(CircuitOpen::new(
//!     Duration::from_secs(5),
//! )));
//! // `source()` skips the payload…
//! assert!(std::error::Error::source(&error).is_none());
//! // …these helpers do not.
//! assert!(is_circuit_open(&error));
//! assert!(!is_deadline_exceeded(&error));
//! assert_eq!(find::<CircuitOpen>(&error).unwrap().retry_in(), Duration::from_secs(5));
//!
//! // Context added with anyhow is looked through.
//! let error = reqwest_middleware::Error::Middleware(
//!     anyhow::Error::new(DeadlineExceeded::new()).context("fetching the invoice"),
//! );
//! assert!(is_deadline_exceeded(&error));
//! ```

use std::error::Error as StdError;

use retrysafe_core::error::{BudgetExhausted, CircuitOpen, DeadlineExceeded};

/// How many errors of a chain [`find`] looks at before giving up (a guard against a
/// cyclic `source()`).
const MAX_CHAIN: usize = 64;

/// The first error of type `E` in `error`: the `anyhow` payload of
/// `Error::Middleware` and its `source()` chain, or the `reqwest::Error` of
/// `Error::Reqwest` and its chain (so `E = reqwest::Error` is found too). A
/// `reqwest_middleware::Error` met in the chain is stepped into the same way.
///
/// ```
/// use retrysafe::error::BudgetExhausted;
/// use retrysafe::reqwest::error::find;
///
/// let error = reqwest_middleware::Error::middleware(BudgetExhausted::new());
/// assert_eq!(find::<BudgetExhausted>(&error), Some(&BudgetExhausted::new()));
/// assert!(find::<std::io::Error>(&error).is_none());
/// ```
pub fn find<E: StdError + 'static>(error: &reqwest_middleware::Error) -> Option<&E> {
    find_in(root(error))
}

/// The first error of type `E` in any error's `source()` chain, `error` included,
/// stepping into every `reqwest_middleware::Error` of the chain like [`find`]: for a
/// `reqwest::Error` from reading a response body, or an error that wraps one of ours.
///
/// ```
/// use retrysafe::error::DeadlineExceeded;
/// use retrysafe::reqwest::error::find_in;
///
/// /// An application error that keeps the client's error as its source.
/// #[derive(Debug)]
/// struct Fetch(reqwest_middleware::Error);
/// impl std::fmt::Display for Fetch {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         f.write_str("fetch failed")
///     }
/// }
/// impl std::error::Error for Fetch {
///     fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
///         Some(&self.0)
///     }
/// }
///
/// let error = Fetch(reqwest_middleware::Error::middleware(DeadlineExceeded::new()));
/// assert!(find_in::<DeadlineExceeded>(&error).is_some());
/// ```
#[doc(hidden)]
pub fn find_in<'a, E: StdError + 'static>(error: &'a (dyn StdError + 'static)) -> Option<&'a E> {
    let mut current = Some(error);
    let mut seen = 0;
    while let Some(e) = current {
        if let Some(found) = e.downcast_ref::<E>() {
            return Some(found);
        }
        seen += 1;
        if seen >= MAX_CHAIN {
            return None;
        }
        current = match e.downcast_ref::<reqwest_middleware::Error>() {
            // Its own `source()` would skip the payload.
            Some(nested) => Some(root(nested)),
            None => e.source(),
        };
    }
    None
}

/// Whether `error` holds a [`DeadlineExceeded`]: the call's deadline passed, or too
/// little of it was left to start an attempt.
///
/// ```
/// use retrysafe::error::DeadlineExceeded;
/// use retrysafe::reqwest::error::is_deadline_exceeded;
///
/// let error = reqwest_middleware::Error::middleware(DeadlineExceeded::new());
/// assert!(is_deadline_exceeded(&error));
/// let other = reqwest_middleware::Error::Middleware(anyhow::anyhow!("something else"));
/// assert!(!is_deadline_exceeded(&other));
/// ```
pub fn is_deadline_exceeded(error: &reqwest_middleware::Error) -> bool {
    find::<DeadlineExceeded>(error).is_some()
}

/// Whether `error` holds a [`CircuitOpen`]: a circuit breaker refused the call without
/// sending it. [`find`]`::<CircuitOpen>` also gives the time until the next probe.
///
/// ```
/// use std::time::Duration;
/// use retrysafe::error::CircuitOpen;
/// use retrysafe::reqwest::error::is_circuit_open;
///
/// let error = reqwest_middleware::Error::middleware(CircuitOpen::new(Duration::from_secs(1)));
/// assert!(is_circuit_open(&error));
/// ```
pub fn is_circuit_open(error: &reqwest_middleware::Error) -> bool {
    find::<CircuitOpen>(error).is_some()
}

/// Whether `error` holds a [`BudgetExhausted`]: a retry budget refused a retry.
///
/// ```
/// use retrysafe::error::BudgetExhausted;
/// use retrysafe::reqwest::error::is_budget_exhausted;
///
/// let error = reqwest_middleware::Error::middleware(BudgetExhausted::new());
/// assert!(is_budget_exhausted(&error));
/// ```
pub fn is_budget_exhausted(error: &reqwest_middleware::Error) -> bool {
    find::<BudgetExhausted>(error).is_some()
}

/// The error a `reqwest_middleware::Error` stands for: its `anyhow` payload, or its
/// `reqwest::Error`.
pub(crate) fn root(error: &reqwest_middleware::Error) -> &(dyn StdError + 'static) {
    match error {
        reqwest_middleware::Error::Middleware(payload) => &**payload,
        reqwest_middleware::Error::Reqwest(reqwest) => reqwest,
    }
}

/// A failure generated by a middleware of this crate, as `reqwest_middleware` carries
/// it.
pub(crate) fn local<E: StdError + Send + Sync + 'static>(error: E) -> reqwest_middleware::Error {
    reqwest_middleware::Error::Middleware(anyhow::Error::new(error))
}
