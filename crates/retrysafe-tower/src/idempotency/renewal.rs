//! Lease renewal on a timer of its own, so that a handler that blocks its thread (or is
//! simply never polled) still has its lease renewed.
//!
//! Every claim of a [`StoreBackend`](super::StoreBackend) is registered here while its
//! handler runs (a lock and a map insertion, removed again when the record is
//! settled). One *driver* task per backend sleeps until the first renewal of the
//! oldest registered claim is due — a third of a lease after its claim — and only then
//! spawns that claim's renewal task: a request answered sooner costs no task and no
//! timer. The driver lives outside every handler's task, so nothing a handler does can
//! delay it, and it stops once no claim waits for a first renewal.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use retrysafe_core::idempotency::{IdempotencyContext, RecordId, Token};
use retrysafe_core::store::{BoxStore, IdempotencyStore, StoreError};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::guard::GuardConfig;
use super::observe::StoreOp;

/// The claims of one backend whose leases are renewed, shared by its clones.
#[derive(Clone, Default)]
pub(crate) struct Renewals {
    shared: Arc<Mutex<State>>,
}

impl fmt::Debug for Renewals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Renewals")
    }
}

#[derive(Default)]
struct State {
    /// The number of the next registration.
    next: u64,
    /// Claims not renewed yet, by when their first renewal is due.
    waiting: BTreeMap<(Instant, u64), Renewable>,
    /// Claims whose renewal task runs.
    renewing: HashMap<u64, (Renewal, Arc<Lease>)>,
    /// The longest the driver sleeps: the shortest third of a lease registered.
    tick: Option<Duration>,
    /// The number of the driver that runs, if one does.
    driver: Option<u64>,
}

/// A claim to renew: what its renewal task needs.
pub(crate) struct Renewable {
    /// The store the claim was made in.
    pub(crate) store: BoxStore,
    /// The full lease, renewed every third of it.
    pub(crate) lease: Duration,
    /// The timeout of one renewal.
    pub(crate) timeout: Duration,
    /// When the claim was made.
    pub(crate) claimed_at: Instant,
    /// When renewals stop (`max_execution`).
    pub(crate) cap: Instant,
    /// The claim itself.
    pub(crate) held: Held,
}

/// The claim a renewal task renews: its record and token, and the handler's view of it
/// (told when the lease is lost).
pub(crate) struct Held {
    pub(crate) id: RecordId,
    pub(crate) token: Token,
    pub(crate) context: Option<IdempotencyContext>,
    /// The layer's settings (its metrics, for the renewals' round trips).
    pub(crate) config: Arc<GuardConfig>,
}

impl Renewals {
    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.shared)
    }

    /// Registers a claim whose lease is to be renewed until its registration is
    /// dropped. Also says whether a driver was started for it: then the caller yields
    /// once before running the handler, so that the driver arms its timer before a
    /// handler can block this thread (a task spawned from a worker waits in that
    /// worker's own queue until the worker is free).
    pub(crate) fn register(&self, claim: Renewable) -> (Registration, bool) {
        let third = claim.lease / 3;
        let due = claim.claimed_at + third;
        let fallback = claim.claimed_at + claim.lease;
        let mut state = self.lock();
        let number = state.next;
        state.next += 1;
        state.tick = Some(state.tick.map_or(third, |t| t.min(third)));
        state.waiting.insert((due, number), claim);
        let started = state.driver.is_none();
        if started {
            state.driver = Some(number);
            tokio::spawn(drive(Arc::downgrade(&self.shared), number));
        }
        drop(state);
        let registration = Registration {
            renewals: self.clone(),
            key: (due, number),
            fallback,
        };
        (registration, started)
    }
}

/// Runs the renewals of one backend: sleeps until the first renewal of the oldest
/// waiting claim is due, starts the renewal tasks of the claims due, and stops when no
/// claim waits.
async fn drive(shared: Weak<Mutex<State>>, number: u64) {
    let _stopped = Stopped {
        shared: shared.clone(),
        number,
    };
    loop {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let next = start_due(&mut lock(&shared), Instant::now(), number);
        drop(shared);
        match next {
            Some(next) => tokio::time::sleep_until(next).await,
            None => return,
        }
    }
}

/// Starts the renewal tasks of the claims due at `now`; when the driver should look
/// again, or `None` (and the driver is gone) when no claim waits.
fn start_due(state: &mut State, now: Instant, driver: u64) -> Option<Instant> {
    while let Some(entry) = state.waiting.first_entry() {
        if entry.key().0 > now {
            break;
        }
        let ((_, number), claim) = entry.remove_entry();
        let lease = Arc::new(Lease::new(claim.claimed_at, claim.lease));
        let task = tokio::spawn(renew_lease(
            claim.store,
            (claim.lease, claim.timeout),
            claim.held,
            claim.cap,
            Arc::clone(&lease),
        ));
        state.renewing.insert(number, (Renewal(task), lease));
    }
    let Some(((first, _), _)) = state.waiting.first_key_value() else {
        if state.driver == Some(driver) {
            state.driver = None;
        }
        return None;
    };
    // A claim registered while the driver sleeps is due at least a tick after it fell
    // asleep: it is never found late.
    let tick = state.tick.unwrap_or(Duration::ZERO);
    Some((*first).min(now + tick))
}

/// Marks the driver gone however its task ends (a runtime that shuts down drops it),
/// so that the next registration starts another.
struct Stopped {
    shared: Weak<Mutex<State>>,
    number: u64,
}

impl Drop for Stopped {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.upgrade() {
            let mut state = lock(&shared);
            if state.driver == Some(self.number) {
                state.driver = None;
            }
        }
    }
}

/// A claim's place among the renewed ones; dropping it (the record is settled) stops
/// its renewals.
pub(crate) struct Registration {
    renewals: Renewals,
    key: (Instant, u64),
    /// The end of the lease if it was never renewed.
    fallback: Instant,
}

impl Registration {
    /// The end of the claim's lease, as last renewed.
    pub(crate) fn lease_until(&self) -> Instant {
        let state = self.renewals.lock();
        state
            .renewing
            .get(&self.key.1)
            .map_or(self.fallback, |(_, lease)| lease.until())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut state = self.renewals.lock();
        let waiting = state.waiting.remove(&self.key);
        let renewing = state.renewing.remove(&self.key.1);
        drop(state);
        // Dropped outside the lock: a renewal task is aborted.
        drop((waiting, renewing));
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // The state stays consistent at every step: a panic elsewhere leaves it usable.
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The task that renews a claim's lease; aborted when dropped.
struct Renewal(JoinHandle<()>);

impl Drop for Renewal {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Renews now, then every third of `full` until `cap` or until the lease is lost (a
/// renewal refused with a stale token, which the handler's context is told of).
/// Updates `state` on every renewal.
async fn renew_lease(
    store: BoxStore,
    (full, timeout): (Duration, Duration),
    claim: Held,
    cap: Instant,
    state: Arc<Lease>,
) {
    let id = claim.id;
    let metrics = claim.config.metrics();
    loop {
        let now = Instant::now();
        let lease = full.min(cap.saturating_duration_since(now));
        if lease.is_zero() {
            return; // past max_execution: the handler is cancelled
        }
        let renewed = tokio::time::timeout(timeout, store.renew(&id, claim.token, lease)).await;
        if metrics.store_enabled() {
            metrics.store(StoreOp::Renew, now.elapsed());
        }
        match renewed {
            Ok(Ok(())) => state.renewed(now, lease),
            Ok(Err(StoreError::StaleToken)) => {
                tracing::warn!(target: "retrysafe::idempotency", record = ?id, "lease lost");
                if let Some(context) = &claim.context {
                    context.mark_lease_lost();
                }
                return;
            }
            Ok(Err(e)) => {
                tracing::warn!(target: "retrysafe::idempotency", record = ?id, error = %e, "lease renewal failed");
            }
            Err(_) => {
                tracing::warn!(target: "retrysafe::idempotency", record = ?id, "lease renewal timed out");
            }
        }
        if lease < full {
            return; // the last renewal, capped by max_execution
        }
        tokio::time::sleep(full / 3).await;
    }
}

/// The end of a claim's lease, as the holder last renewed it. Shared between the
/// renewal task and the writes that must finish while the lease lasts.
struct Lease {
    claimed_at: Instant,
    /// Nanoseconds from `claimed_at` to the end of the lease.
    until_nanos: AtomicU64,
}

impl Lease {
    fn new(claimed_at: Instant, lease: Duration) -> Self {
        Lease {
            claimed_at,
            until_nanos: AtomicU64::new(nanos(lease)),
        }
    }

    fn renewed(&self, at: Instant, lease: Duration) {
        let since = at.saturating_duration_since(self.claimed_at);
        self.until_nanos
            .store(nanos(since.saturating_add(lease)), Ordering::Relaxed);
    }

    fn until(&self) -> Instant {
        self.claimed_at + Duration::from_nanos(self.until_nanos.load(Ordering::Relaxed))
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
