//! Who drives a background loop that registrations wake: [`DriverSlot`].
//!
//! The lease renewals of the tower `IdempotencyLayer` are driven this way. A request
//! registers its claim where the driver looks, then makes sure a driver runs. The
//! driver looks at the registrations and sleeps until the first is due. When it finds
//! none waiting, it stops, so an idle layer holds no task.
//!
//! The protocol guarantees that no registration is left waiting with no driver. A
//! registration made while the driver is stopping is either seen by the driver's
//! second look, or finds the slot empty and starts a driver itself. The loom model
//! `tests/loom_driver.rs` explores the interleavings of registrations with a driver
//! that stops.

use std::sync::atomic::Ordering::{Relaxed, SeqCst};

use crate::sync::AtomicU64;

/// The number of the driver that runs, if one does (the protocol is in the docs of
/// this module, `driver.rs`).
///
/// Registrations call [`ensure`](Self::ensure) after registering. The driver calls
/// [`idle`](Self::idle) when its look finds nothing waiting, and [`gone`](Self::gone)
/// when its task ends however it ends.
#[derive(Debug)]
pub struct DriverSlot {
    /// The running driver's number; 0 when none runs.
    current: AtomicU64,
    /// The last number handed out.
    numbers: AtomicU64,
}

impl DriverSlot {
    /// A slot with no driver.
    pub fn new() -> Self {
        DriverSlot {
            current: AtomicU64::new(0),
            numbers: AtomicU64::new(0),
        }
    }

    /// Called after a registration: `Some(number)` when no driver ran and the caller
    /// must start one with this number, `None` when one runs.
    pub fn ensure(&self) -> Option<u64> {
        // Read first: a driver nearly always runs, and a read leaves the line shared.
        if self.current.load(SeqCst) != 0 {
            return None;
        }
        let number = self.numbers.fetch_add(1, Relaxed).wrapping_add(1).max(1);
        self.current
            .compare_exchange(0, number, SeqCst, SeqCst)
            .ok()
            .map(|_| number)
    }

    /// Called by driver `number` when its look found nothing waiting.
    ///
    /// It stops, then looks once more with `look`. A registration made before the stop
    /// that the first look missed is found there, and the driver goes on with what
    /// `look` found: `Some`, when no other driver was started meanwhile. `None` means
    /// the driver must end: nothing waits, or another driver took over.
    pub fn idle<T>(&self, number: u64, look: impl FnOnce() -> Option<T>) -> Option<T> {
        self.current
            .compare_exchange(number, 0, SeqCst, SeqCst)
            .ok()?;
        let found = look()?;
        self.current
            .compare_exchange(0, number, SeqCst, SeqCst)
            .ok()?;
        Some(found)
    }

    /// Driver `number` is gone, however its task ended (a runtime that shuts down drops
    /// it unpolled): the slot is cleared if it still names it, so the next
    /// registration starts another.
    pub fn gone(&self, number: u64) {
        let _ = self.current.compare_exchange(number, 0, SeqCst, SeqCst);
    }

    /// The running driver's number, if one runs.
    pub fn current(&self) -> Option<u64> {
        match self.current.load(SeqCst) {
            0 => None,
            number => Some(number),
        }
    }
}

impl Default for DriverSlot {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::DriverSlot;

    #[test]
    fn one_driver_at_a_time_and_a_stopped_one_resumes_only_when_it_finds_work() {
        let slot = DriverSlot::new();
        let first = slot.ensure().expect("no driver ran: the caller starts one");
        assert_eq!(slot.ensure(), None, "a driver runs");
        assert_eq!(slot.current(), Some(first));

        // Nothing waits at the second look either: the driver ends, the slot is empty.
        assert_eq!(slot.idle(first, || None::<()>), None);
        assert_eq!(slot.current(), None);
        slot.gone(first);
        assert_eq!(slot.current(), None);

        // A new driver; its second look finds work: it goes on, still the driver.
        let second = slot.ensure().expect("the slot was empty");
        assert_ne!(second, first);
        assert_eq!(slot.idle(second, || Some(7)), Some(7));
        assert_eq!(slot.current(), Some(second));

        // It stops; a registration starts a third before its second look finds work:
        // the second ends, and its end does not clear the third.
        let mut third = None;
        let resumed = slot.idle(second, || {
            third = slot.ensure();
            Some(())
        });
        assert_eq!(resumed, None, "another driver took over");
        let third = third.expect("the slot was empty while the second stopped");
        slot.gone(second);
        assert_eq!(slot.current(), Some(third));
        slot.gone(third);
        assert_eq!(slot.current(), None);
    }
}
