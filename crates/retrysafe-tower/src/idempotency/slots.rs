//! The bound of guarded requests in flight, with a fair share of it per scope: one
//! scope (a tenant, a principal) holding slots — with slow handlers, or with bodies it
//! trickles in — cannot take the slots every other scope needs.
//!
//! A scope's count lives in one of a few shards, each a small map under its own lock,
//! so requests of different scopes rarely meet on a lock. An entry exists only while
//! its scope holds a slot, so the maps never hold more entries than there are slots,
//! however many scopes come and go.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use retrysafe_core::__private::DigestHash;
use retrysafe_core::idempotency::Scope;

/// Shards of the per-scope counts: enough that two busy scopes rarely share a lock.
const SHARDS: usize = 16;

/// The default share of the bound one scope may hold: 3/4 (768 of 1024), never less
/// than one slot.
pub(crate) fn default_share(bound: usize) -> usize {
    (bound.saturating_mul(3) / 4).max(1)
}

/// The slots of a layer: the bound, and what each scope holds of it.
#[derive(Debug)]
pub(crate) struct Slots {
    /// Slots taken. Nobody waits for a slot (a request finding none is answered 503),
    /// so a count is enough: a semaphore would lock its waiter list on every release.
    taken: Arc<AtomicUsize>,
    bound: usize,
    scopes: Arc<ScopeCounts>,
}

impl Slots {
    pub(crate) fn new(bound: usize) -> Self {
        Slots {
            taken: Arc::new(AtomicUsize::new(0)),
            bound,
            scopes: Arc::new(ScopeCounts::new()),
        }
    }

    /// The bound of guarded requests in flight.
    pub(crate) fn bound(&self) -> usize {
        self.bound
    }

    /// A slot for a request of `scope` (none for a request without a key), if the
    /// bound has one free and the scope holds fewer than `share` (clamped to the
    /// bound); `None` otherwise.
    pub(crate) fn acquire(&self, scope: Option<&Scope>, share: usize) -> Option<Slot> {
        let scope = match scope {
            Some(s) => Some(ScopeHold::take(
                &self.scopes,
                s,
                share.clamp(1, self.bound),
            )?),
            None => None,
        };
        // On failure `scope` is dropped here, and gives its count back.
        self.taken
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.bound).then_some(n + 1)
            })
            .ok()?;
        Some(Slot {
            taken: Arc::clone(&self.taken),
            _scope: scope,
        })
    }
}

/// One slot of the bound, held by a guarded request until its work is done.
#[derive(Debug)]
pub(crate) struct Slot {
    taken: Arc<AtomicUsize>,
    _scope: Option<ScopeHold>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.taken.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How many slots each scope holds, in shards.
#[derive(Debug)]
struct ScopeCounts {
    shards: Vec<Mutex<HashMap<Scope, usize, DigestHash>>>,
}

impl ScopeCounts {
    fn new() -> Self {
        ScopeCounts {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(HashMap::default()))
                .collect(),
        }
    }

    fn shard(&self, scope: &Scope) -> Option<MutexGuard<'_, HashMap<Scope, usize, DigestHash>>> {
        let i = usize::from(scope.as_bytes()[0]) % SHARDS;
        // A panic while a shard was locked cannot leave a count half-written.
        let shard = self.shards.get(i)?;
        Some(shard.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// One slot counted against a scope; given back when dropped, and the scope's entry
/// removed when it holds none.
#[derive(Debug)]
struct ScopeHold {
    counts: Arc<ScopeCounts>,
    scope: Scope,
}

impl ScopeHold {
    fn take(counts: &Arc<ScopeCounts>, scope: &Scope, share: usize) -> Option<Self> {
        let mut shard = counts.shard(scope)?;
        let held = shard.entry(*scope).or_insert(0);
        if *held >= share {
            return None;
        }
        *held += 1;
        Some(ScopeHold {
            counts: Arc::clone(counts),
            scope: *scope,
        })
    }
}

impl Drop for ScopeHold {
    fn drop(&mut self) {
        let Some(mut shard) = self.counts.shard(&self.scope) else {
            return;
        };
        if let Some(held) = shard.get_mut(&self.scope) {
            *held = held.saturating_sub(1);
            if *held == 0 {
                shard.remove(&self.scope);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn len(slots: &Slots) -> usize {
        slots
            .scopes
            .shards
            .iter()
            .map(|s| s.lock().unwrap().len())
            .sum()
    }

    #[test]
    fn the_default_share_is_three_quarters_and_at_least_one() {
        assert_eq!(default_share(1024), 768);
        assert_eq!(default_share(4), 3);
        assert_eq!(default_share(1), 1);
    }

    #[test]
    fn a_scope_over_its_share_is_refused_and_others_are_served() {
        let slots = Slots::new(4);
        let (a, b) = (Scope::new("a"), Scope::new("b"));
        let held: Vec<_> = (0..3)
            .map(|_| slots.acquire(Some(&a), 3).unwrap())
            .collect();
        assert!(slots.acquire(Some(&a), 3).is_none(), "a is at its share");
        let other = slots.acquire(Some(&b), 3).unwrap();
        assert!(slots.acquire(Some(&b), 3).is_none(), "the bound is full");
        assert!(slots.acquire(None, 3).is_none(), "the bound is full");
        drop(other);
        assert!(slots.acquire(None, 3).is_some());
        drop(held);
        assert_eq!(len(&slots), 0, "no entry for a scope that holds nothing");
        assert_eq!(slots.taken.load(Ordering::Acquire), 0);
    }

    #[test]
    fn scope_entries_do_not_grow_with_the_number_of_scopes() {
        let slots = Slots::new(8);
        for i in 0..10_000 {
            let slot = slots.acquire(Some(&Scope::new(format!("s{i}"))), 6);
            assert!(slot.is_some());
        }
        assert_eq!(len(&slots), 0);
        // A scope refused by the bound gives its count back.
        let full: Vec<_> = (0..8)
            .map(|i| {
                slots
                    .acquire(Some(&Scope::new(format!("f{i}"))), 6)
                    .unwrap()
            })
            .collect();
        assert!(slots.acquire(Some(&Scope::new("late")), 6).is_none());
        assert_eq!(len(&slots), 8);
        drop(full);
        assert_eq!(len(&slots), 0);
    }
}
