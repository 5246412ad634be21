//! Loom model of the driver protocol of `DriverSlot` (run by `scripts/loom`; empty
//! unless `--cfg loom`): the protocol the tower `IdempotencyLayer`'s lease renewals run
//! by (`retrysafe-tower/src/idempotency/renewal.rs`).
//!
//! A registration puts its claim where the driver looks (here a list under a mutex, as
//! the renewals' shards are), then calls `ensure` and, when told to, runs a driver
//! itself. A driver takes what waits; finding nothing, it calls `idle` with a second
//! look, and ends when `idle` says so, calling `gone` as its task's guard does. Every
//! interleaving of three registrations (one of which starts the first driver) must end
//! with every claim taken: no claim is left waiting with no driver.
#![cfg(loom)]
#![allow(
    clippy::unwrap_used,
    clippy::disallowed_methods,
    reason = "test code: a poisoned lock or a failed thread is the model's failure, and \
              std::time::Instant (in loom_support) only times the model run"
)]

mod loom_support;
use loom_support::check;

use loom::sync::{Arc, Mutex};
use loom::thread;
use retrysafe_core::__private::DriverSlot;

/// The claims waiting for the driver, and those it took (in order).
#[derive(Default)]
struct Claims {
    waiting: Vec<u32>,
    taken: Vec<u32>,
}

struct Shared {
    slot: DriverSlot,
    claims: Mutex<Claims>,
}

/// The driver's look: takes every waiting claim; `None` when none waited.
fn look(shared: &Shared) -> Option<usize> {
    let mut claims = shared.claims.lock().unwrap();
    if claims.waiting.is_empty() {
        return None;
    }
    let waiting = std::mem::take(&mut claims.waiting);
    let n = waiting.len();
    claims.taken.extend(waiting);
    Some(n)
}

/// A driver's task: look until nothing waits and `idle` says to end.
fn drive(shared: &Shared, number: u64) {
    loop {
        if look(shared).is_some() {
            continue;
        }
        if shared.slot.idle(number, || look(shared)).is_none() {
            break;
        }
    }
    shared.slot.gone(number);
}

/// Registers `claim`, then runs a driver if told to.
fn register(shared: &Shared, claim: u32) {
    shared.claims.lock().unwrap().waiting.push(claim);
    if let Some(number) = shared.slot.ensure() {
        drive(shared, number);
    }
}

/// Two registrations race a third, whose driver may be stopping as they register:
/// every claim is taken exactly once, and no driver is left named once all have ended.
#[test]
fn no_claim_waits_with_no_driver() {
    check("driver_registrations", Some(3), || {
        let shared = Arc::new(Shared {
            slot: DriverSlot::new(),
            claims: Mutex::new(Claims::default()),
        });
        let others: Vec<_> = (2..4)
            .map(|claim| {
                let shared = Arc::clone(&shared);
                thread::spawn(move || register(&shared, claim))
            })
            .collect();
        register(&shared, 1);
        for other in others {
            other.join().unwrap();
        }
        let claims = shared.claims.lock().unwrap();
        assert!(
            claims.waiting.is_empty(),
            "left waiting: {:?}",
            claims.waiting
        );
        let mut taken = claims.taken.clone();
        taken.sort_unstable();
        assert_eq!(taken, [1, 2, 3], "each claim taken once");
        assert_eq!(
            shared.slot.current(),
            None,
            "a driver is named after all ended"
        );
    });
}
