//! The synchronisation primitives of the lock-free budget, breaker and stripes, and
//! the clock they read: std's and tokio's in every normal build, loom's (and a
//! model-controlled clock) under `--cfg loom`.
//!
//! Under loom the `Arc` of [`Striped::from_arc`](crate::stripe::Striped::from_arc) is
//! loom's too; nothing outside retrysafe-core's loom models builds with `--cfg loom`.
//!
//! In a normal build this module is plain re-exports and one `#[inline]` call to
//! [`tokio::time::Instant::now`], so the code compiles exactly as it would name std and
//! tokio directly. Under `--cfg loom` (scripts/loom) the atomics, mutexes and `Arc`s
//! are loom's (and `stripe.rs` takes loom's `thread_local!`), so the models in
//! `tests/loom_*.rs` explore every interleaving (and every value a relaxed load may
//! return) of the budget's, breaker's and stripes' shared memory; time is a loom atomic
//! that only the model moves (`loom_clock`), so an execution is reproducible and a
//! model can race a clock step against the code that reads the clock.

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, fence};
#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Mutex};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, fence};
#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Mutex};

use tokio::time::Instant;

/// The current time, for the budget's and breaker's clocks.
#[cfg(not(loom))]
#[inline]
pub(crate) fn now() -> Instant {
    Instant::now()
}

/// The current time of the model: a fixed base plus what the model advanced
/// ([`loom_clock::advance`]).
#[cfg(loom)]
pub(crate) fn now() -> Instant {
    loom_clock::base() + std::time::Duration::from_nanos(loom_clock::offset())
}

/// The stripe count under loom: two, so models with two or three threads cover both
/// threads on one stripe and threads on different stripes, and reading every stripe
/// stays small.
#[cfg(loom)]
pub(crate) const LOOM_STRIPES: usize = 2;

/// The clock of the loom models (only under `--cfg loom`).
///
/// Time starts, in every execution, at a base instant fixed for the process, and moves
/// only when the model calls [`advance`]. The offset is a loom atomic, so a step of the
/// clock is one more operation for loom to order against the threads that read it: a
/// read scheduled before the step sees the old time, one after it the new.
#[cfg(loom)]
pub mod loom_clock {
    use std::sync::OnceLock;
    use std::time::Duration;

    use loom::sync::atomic::AtomicU64;
    use loom::sync::atomic::Ordering::Relaxed;
    use tokio::time::Instant;

    loom::lazy_static! {
        /// Nanoseconds the model advanced the clock in this execution.
        static ref OFFSET: AtomicU64 = AtomicU64::new(0);
    }

    /// The instant every execution starts at (fixed for the process, so executions are
    /// reproducible).
    pub(crate) fn base() -> Instant {
        static BASE: OnceLock<Instant> = OnceLock::new();
        *BASE.get_or_init(Instant::now)
    }

    /// Nanoseconds advanced so far.
    ///
    /// A read-modify-write, not a load: an RMW reads the latest value in the atomic's
    /// modification order, so every read of the clock sees every step made before it
    /// in the execution's schedule, as a physical clock does. (A relaxed load could
    /// return an older step to a thread that has already seen, through relaxed data, the
    /// effects of code that read the newer time: weaker than any real clock.)
    pub(crate) fn offset() -> u64 {
        OFFSET.fetch_add(0, Relaxed)
    }

    /// Moves the model's clock forward by `by`.
    pub fn advance(by: Duration) {
        let nanos = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        OFFSET.fetch_add(nanos, Relaxed);
    }
}
