//! Lease renewal on a timer of its own, so that a handler that blocks its thread (or is
//! simply never polled) still has its lease renewed.
//!
//! Every claim of a [`StoreBackend`](super::StoreBackend) is registered here while its
//! handler runs, and removed again when the record is settled. A registration goes to
//! the shard of the thread that makes it (a slot of a slab under that shard's lock,
//! which the driver takes at most once per third of a lease, and another worker only
//! when it settles a claim registered on this one): a request writes nothing that
//! every worker writes. One *driver* task per backend sleeps until the
//! first renewal of the oldest registered claim is due — a third of a lease after its
//! claim — and only then spawns that claim's renewal task: a request answered sooner
//! costs no task and no timer. The driver lives outside every handler's task, so nothing
//! a handler does can delay it, and it stops once no claim waits for a first renewal.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use retrysafe_core::__private::{CachePadded, DriverSlot, stripe_count, thread_stripe};
use retrysafe_core::idempotency::{IdempotencyContext, RecordId, Token};
use retrysafe_core::store::{BoxStore, IdempotencyStore, StoreError};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::shared::Config;
use super::telemetry::StoreOp;

/// The claims of one backend whose leases are renewed, shared by its clones.
#[derive(Clone, Default)]
pub(crate) struct Renewals {
    shared: Arc<Shared>,
}

impl fmt::Debug for Renewals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Renewals")
    }
}

struct Shared {
    /// The registered claims, one shard per thread stripe, each on cache lines of its
    /// own.
    shards: Box<[CachePadded<Mutex<Shard>>]>,
    /// The driver that runs, if one does (the protocol of `DriverSlot`, checked by its
    /// loom model in retrysafe-core).
    driver: DriverSlot,
    /// The longest the driver sleeps, in nanoseconds: the shortest third of a lease
    /// registered (`u64::MAX` before the first).
    tick: AtomicU64,
}

impl Default for Shared {
    fn default() -> Self {
        Shared {
            shards: (0..stripe_count())
                .map(|_| CachePadded::default())
                .collect(),
            driver: DriverSlot::new(),
            tick: AtomicU64::new(u64::MAX),
        }
    }
}

/// The shard of the calling thread among `shards` (the stripe count, a power of two):
/// its stripe, as the striped counters of the budgets and breakers pick theirs.
fn shard_of_thread(shards: usize) -> usize {
    thread_stripe() & (shards - 1)
}

/// The claims registered in one shard: a slab, its free slots chained.
#[derive(Default)]
struct Shard {
    slots: Vec<Slot>,
    /// The first free slot, if any.
    free: Option<usize>,
    /// The slots in use.
    live: usize,
}

/// The most slots an empty shard keeps allocated.
const KEPT_SLOTS: usize = 64;

enum Slot {
    /// Free, with the next free slot.
    Free(Option<usize>),
    /// A claim not renewed yet, and when its first renewal is due.
    Waiting(Instant, Renewable),
    /// A claim whose renewal task runs (aborted when the slot is dropped), and its
    /// lease as last renewed.
    Renewing { _task: Renewal, lease: Arc<Lease> },
}

impl Shard {
    fn insert(&mut self, slot: Slot) -> usize {
        self.live += 1;
        if let Some(at) = self.free
            && let Some(place) = self.slots.get_mut(at)
            && let Slot::Free(next) = *place
        {
            self.free = next;
            *place = slot;
            return at;
        }
        // No free slot (the chain only ever holds free slots of the slab).
        self.free = None;
        self.slots.push(slot);
        self.slots.len() - 1
    }

    fn remove(&mut self, at: usize) -> Option<Slot> {
        let place = self.slots.get_mut(at)?;
        if let Slot::Free(_) = place {
            return None;
        }
        let slot = std::mem::replace(place, Slot::Free(self.free));
        self.free = Some(at);
        self.live = self.live.saturating_sub(1);
        if self.live == 0 {
            // Nothing registered: the slab starts over, and gives back what a burst
            // made it grow to.
            self.free = None;
            self.slots.clear();
            self.slots.shrink_to(KEPT_SLOTS);
        }
        Some(slot)
    }

    /// Starts the renewal tasks of the claims due at `now`; when the next one waiting
    /// is due, if one waits.
    fn start_due(&mut self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        for slot in &mut self.slots {
            let Slot::Waiting(due, _) = slot else {
                continue;
            };
            if *due > now {
                next = Some(next.map_or(*due, |n| n.min(*due)));
                continue;
            }
            let Slot::Waiting(_, claim) = std::mem::replace(slot, Slot::Free(None)) else {
                continue;
            };
            let lease = Arc::new(Lease::new(claim.claimed_at, claim.lease));
            let task = tokio::spawn(renew_lease(
                claim.store,
                (claim.lease, claim.timeout),
                claim.held,
                claim.cap,
                Arc::clone(&lease),
            ));
            *slot = Slot::Renewing {
                _task: Renewal(task),
                lease,
            };
        }
        next
    }
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
    pub(crate) config: Arc<Config>,
}

impl Renewals {
    /// Registers a claim whose lease is to be renewed until its registration is
    /// dropped. Also says whether a driver was started for it: then the caller yields
    /// once before running the handler, so that the driver arms its timer before a
    /// handler can block this thread (a task spawned from a worker waits in that
    /// worker's own queue until the worker is free).
    pub(crate) fn register(&self, claim: Renewable) -> (Registration<'_>, bool) {
        let shared = &*self.shared;
        let third = claim.lease / 3;
        let due = claim.claimed_at + third;
        let fallback = claim.claimed_at + claim.lease;
        // Read first: the shortest third is nearly always set already, and a read
        // leaves the line shared between the workers.
        let nanos = nanos(third);
        if nanos < shared.tick.load(Ordering::Relaxed) {
            shared.tick.fetch_min(nanos, Ordering::Relaxed);
        }
        let shard = shard_of_thread(shared.shards.len());
        let slot = match shared.shards.get(shard) {
            Some(s) => lock(&s.0).insert(Slot::Waiting(due, claim)),
            None => unreachable_shard(),
        };
        let registration = Registration {
            renewals: self,
            shard,
            slot,
            fallback,
        };
        (registration, self.ensure_driver())
    }

    /// Whether `self` and `other` are the same registry.
    #[cfg(test)]
    pub(crate) fn is(&self, other: &Renewals) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// Starts a driver unless one runs; whether this call started it.
    fn ensure_driver(&self) -> bool {
        let shared = &self.shared;
        let Some(number) = shared.driver.ensure() else {
            return false;
        };
        // Marks the driver gone however its task ends, even unpolled (a runtime that
        // shuts down first drops it as it is).
        let stopped = Stopped {
            shared: Arc::downgrade(shared),
            number,
        };
        tokio::spawn(drive(stopped));
        true
    }
}

#[cold]
fn unreachable_shard() -> ! {
    // A shard index is taken modulo the number of shards.
    unreachable!("renewal shard out of range")
}

impl Shared {
    /// Starts the renewal tasks of the claims due at `now`, in every shard; when the
    /// driver should look again, or `None` when no claim waits.
    fn start_due(&self, now: Instant) -> Option<Instant> {
        let first = self
            .shards
            .iter()
            .filter_map(|shard| lock(&shard.0).start_due(now))
            .min()?;
        // A claim registered while the driver sleeps is due at least a tick after it
        // fell asleep: it is never found late.
        let tick = Duration::from_nanos(self.tick.load(Ordering::Relaxed));
        Some(first.min(now.checked_add(tick).unwrap_or(first)))
    }
}

/// Runs the renewals of one backend: sleeps until the first renewal of the oldest
/// waiting claim is due, starts the renewal tasks of the claims due, and stops when no
/// claim waits.
async fn drive(stopped: Stopped) {
    let (shared, number) = (&stopped.shared, stopped.number);
    loop {
        let Some(s) = shared.upgrade() else {
            return;
        };
        let now = Instant::now();
        let next = match s.start_due(now) {
            Some(next) => next,
            None => {
                // Nothing waits: stop. A claim registered after the look above either
                // is seen by the second look, or finds no driver and starts one.
                match s.driver.idle(number, || s.start_due(now)) {
                    Some(next) => next,
                    None => return,
                }
            }
        };
        drop(s);
        tokio::time::sleep_until(next).await;
    }
}

/// Marks the driver gone however its task ends (a runtime that shuts down drops it),
/// so that the next registration starts another.
struct Stopped {
    shared: Weak<Shared>,
    number: u64,
}

impl Drop for Stopped {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.upgrade() {
            shared.driver.gone(self.number);
        }
    }
}

/// A claim's place among the renewed ones; dropping it (the record is settled) stops
/// its renewals.
pub(crate) struct Registration<'a> {
    renewals: &'a Renewals,
    shard: usize,
    slot: usize,
    /// The end of the lease if it was never renewed.
    fallback: Instant,
}

impl Registration<'_> {
    fn shard(&self) -> Option<MutexGuard<'_, Shard>> {
        self.renewals
            .shared
            .shards
            .get(self.shard)
            .map(|s| lock(&s.0))
    }

    /// The end of the claim's lease, as last renewed.
    pub(crate) fn lease_until(&self) -> Instant {
        let Some(shard) = self.shard() else {
            return self.fallback;
        };
        match shard.slots.get(self.slot) {
            Some(Slot::Renewing { lease, .. }) => lease.until(),
            _ => self.fallback,
        }
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        let removed = self.shard().and_then(|mut shard| shard.remove(self.slot));
        // Dropped outside the lock: a renewal task is aborted.
        drop(removed);
    }
}

fn lock<T>(state: &Mutex<T>) -> MutexGuard<'_, T> {
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
    let metrics = claim.config.telemetry.metrics();
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use retrysafe_core::idempotency::{RecordId, Token};
    use retrysafe_core::store::{BoxStore, FaultyStore};
    use retrysafe_memory::MemoryStore;
    use tokio::time::Instant;

    use super::{Held, Renewable, Renewals, lock};
    use crate::idempotency::shared::{Config, Shared};

    const LEASE: Duration = Duration::from_secs(3);

    fn claim(store: &BoxStore, config: &Arc<Config>, n: u8) -> Renewable {
        let now = Instant::now();
        Renewable {
            store: store.clone(),
            lease: LEASE,
            timeout: Duration::from_millis(100),
            claimed_at: now,
            cap: now + Duration::from_secs(60),
            held: Held {
                id: RecordId::from_bytes([n; 32]),
                token: Token::from_bytes([n; 16]),
                context: None,
                config: Arc::clone(config),
            },
        }
    }

    /// Lets the driver and the renewal tasks run at the current (paused) instant.
    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    // Claims registered from several threads (so in several shards) are each renewed
    // once a third of their lease has passed, and not before; a claim settled before
    // that is never renewed; once nothing waits the driver stops, and the next
    // registration starts another. The store answers every renewal `stale` (it holds no
    // claim), which ends each renewal task after its first renewal.
    #[tokio::test(start_paused = true)]
    async fn claims_of_every_thread_are_renewed_at_a_third_and_the_driver_stops() {
        let faulty = Arc::new(FaultyStore::new(MemoryStore::new()));
        let store = BoxStore::from_arc(faulty.clone());
        let config = Shared::new(false).config;
        let renewals = Renewals::default();

        let (first, started) = renewals.register(claim(&store, &config, 1));
        assert!(started, "the first registration starts the driver");
        let (settled_early, started) = renewals.register(claim(&store, &config, 2));
        assert!(!started, "one driver per backend");
        // Two claims registered on other threads, in the runtime's context (their
        // threads' shards), held here.
        let handle = tokio::runtime::Handle::current();
        let (third, fourth) = std::thread::scope(|s| {
            let register = |n| {
                let (handle, renewals, store, config) = (&handle, &renewals, &store, &config);
                s.spawn(move || {
                    let _entered = handle.enter();
                    let (registration, started) = renewals.register(claim(store, config, n));
                    assert!(!started);
                    registration
                })
            };
            let (third, fourth) = (register(3), register(4));
            (
                third.join().expect("registered"),
                fourth.join().expect("registered"),
            )
        });
        assert_ne!(
            (third.shard, third.slot),
            (fourth.shard, fourth.slot),
            "two registrations, two slots"
        );
        settle().await;
        assert_eq!(
            faulty.calls(),
            0,
            "nothing renewed before a third of the lease"
        );
        drop(settled_early);
        tokio::time::advance(LEASE / 3 + Duration::from_millis(1)).await;
        settle().await;
        assert_eq!(faulty.calls(), 3, "each claim still held renewed once");
        assert!(first.lease_until() >= first.fallback);

        drop((first, third, fourth));
        tokio::time::advance(LEASE).await;
        settle().await;
        assert_eq!(faulty.calls(), 3);
        assert_eq!(
            renewals.shared.driver.current(),
            None,
            "the driver stopped once no claim waited"
        );
        let (again, started) = renewals.register(claim(&store, &config, 5));
        assert!(
            started,
            "a registration after the driver stopped starts another"
        );
        tokio::time::advance(LEASE / 3 + Duration::from_millis(1)).await;
        settle().await;
        assert_eq!(faulty.calls(), 4);
        drop(again);
        assert!(
            renewals
                .shared
                .shards
                .iter()
                .all(|s| lock(&s.0).slots.is_empty()),
            "a shard with nothing registered keeps no slots"
        );
    }

    // A runtime shut down before its driver was first polled drops the driver as it
    // is: the next registration (on another runtime) starts one, and its claims are
    // renewed.
    #[test]
    fn a_driver_dropped_unpolled_does_not_block_the_next() {
        let faulty = Arc::new(FaultyStore::new(MemoryStore::new()));
        let store = BoxStore::from_arc(faulty.clone());
        let config = Shared::new(false).config;
        let renewals = Renewals::default();
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .expect("runtime")
        };
        let first = runtime();
        let held = {
            let _entered = first.enter();
            let (registration, started) = renewals.register(claim(&store, &config, 1));
            assert!(started);
            registration
        };
        drop(first);
        drop(held);
        runtime().block_on(async {
            let (held, started) = renewals.register(claim(&store, &config, 2));
            assert!(started, "the dropped driver no longer counts as running");
            tokio::time::sleep(LEASE / 3 + Duration::from_millis(1)).await;
            settle().await;
            assert_eq!(faulty.calls(), 1, "the claim is renewed");
            drop(held);
        });
    }
}
