//! The timing defaults of a guarded request and of its recovery, chosen together so
//! that they compose with the default client.
//!
//! A holder that crashes past its commit point leaves its claim until the lease it
//! last renewed ends ([`LEASE`] at most). A reconciler considers the claim once
//! [`MAX_EXECUTION`] and [`RECONCILE_GRACE`] more have passed — no holder, however
//! partitioned from the store, runs its handler past `max_execution` — and looks at
//! most [`RECONCILE_INTERVAL`] later. So with every default the key reaches a definite
//! state (a replay of the effect the resolver found, or a fresh run) within
//!
//! ```text
//! LEASE + MAX_EXECUTION + RECONCILE_GRACE + RECONCILE_INTERVAL = 5 + 10 + 2 + 2 = 19 s
//! ```
//!
//! of the crash ([`RESOLVED_WITHIN`]). Until then copies get 409 `request-in-flight`
//! (while the lease lasts) and 503 `outcome-pending` (after it), both with a
//! `retry-after` of 1 s; the default client gives up after 30 s, so a caller that
//! follows those answers sees the definite one in time. A `max_execution` of 10 s is
//! also the default client's per-attempt timeout: a handler that runs longer has lost
//! its caller anyway. Raise `max_execution` (on the layer *and* the reconciler) for
//! longer handlers, and the time to resolution grows with it.
//!
//! ```
//! use std::time::Duration;
//! use retrysafe_core::idempotency::defaults::*;
//!
//! assert_eq!(
//!     LEASE + MAX_EXECUTION + RECONCILE_GRACE + RECONCILE_INTERVAL,
//!     RESOLVED_WITHIN
//! );
//! assert!(RESOLVED_WITHIN < Duration::from_secs(30)); // the default client's time
//! ```

use std::time::Duration;

/// The lease of a claim (5 s), renewed every third of it while the handler runs; it
/// must exceed three store call timeouts (1 s by default).
pub const LEASE: Duration = Duration::from_secs(5);

/// The longest a handler runs (10 s): its lease is not renewed past it, and a handler
/// still running is cancelled.
pub const MAX_EXECUTION: Duration = Duration::from_secs(10);

/// How often a reconciler looks for pending records (2 s).
pub const RECONCILE_INTERVAL: Duration = Duration::from_secs(2);

/// How long past `max_execution` a reconciler gives a claim's holder (2 s), for clock
/// drift between app servers and the store.
pub const RECONCILE_GRACE: Duration = Duration::from_secs(2);

/// The longest a key whose holder crashed stays pending with every default (19 s).
pub const RESOLVED_WITHIN: Duration = Duration::from_secs(19);
