//! Loom models of [`Striped`] and its per-stripe [`Local`] references (run by
//! `scripts/loom`; empty unless `--cfg loom`).
//!
//! Under loom, every `Arc` of a `Striped` (the handle's, the anchors', the value's) is a
//! loom `Arc`, the stripe index is a loom thread-local and the stripe counter a loom
//! atomic, so the models explore every interleaving of clones and drops of handles and
//! locals across threads, on the same stripe and on different ones, and loom checks at
//! the end of every execution that no `Arc` leaked. The models assert that the value is
//! never dropped while a handle or a local can still reach it, and is dropped exactly
//! once when the last one goes, whichever thread that is.
#![cfg(loom)]
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::disallowed_methods,
    reason = "test code; std::time::Instant only times the model run, and panics are the \
              models' assertions"
)]

mod loom_support;
use loom_support::check;

use loom::sync::Arc;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;
use retrysafe_core::__private::{Local, Striped};

/// A value that counts its drops.
#[derive(Debug)]
struct Tracked {
    value: u32,
    drops: Arc<AtomicUsize>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::AcqRel);
    }
}

/// Reads the value through `local` and checks it was not dropped.
fn alive(local: &Local<Tracked>) {
    assert_eq!(local.value, 7);
    assert_eq!(
        local.drops.load(Ordering::Acquire),
        0,
        "dropped while a local holds it"
    );
}

/// Two threads each take a local from their own clone of the handle, drop the handle,
/// use the local and drop it, while the model drops the original handle: the value
/// outlives every local, and is dropped exactly once, by whichever thread goes last.
#[test]
fn handles_and_locals_dropped_across_threads() {
    check("striped_handles_and_locals", None, || {
        let drops = Arc::new(AtomicUsize::new(0));
        let striped = Striped::new(Tracked {
            value: 7,
            drops: Arc::clone(&drops),
        });
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let handle = striped.clone();
                thread::spawn(move || {
                    let local = handle.local();
                    drop(handle);
                    alive(&local);
                    let again = local.clone();
                    drop(local);
                    alive(&again);
                })
            })
            .collect();
        drop(striped);
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(drops.load(Ordering::Acquire), 1, "dropped other than once");
    });
}

/// A local taken on one thread (its stripe) moves to another thread, which clones and
/// drops it there, while a third thread takes and drops a local of its own and the
/// model drops the handle: the anchor a local counts on need not be its thread's, and
/// the value still lives until the last reference and is dropped once.
#[test]
fn locals_moved_to_other_threads() {
    check("striped_locals_moved", None, || {
        let drops = Arc::new(AtomicUsize::new(0));
        let striped = Striped::new(Tracked {
            value: 7,
            drops: Arc::clone(&drops),
        });
        let moved = striped.local();
        let receiver = thread::spawn(move || {
            let copy = moved.clone();
            drop(moved);
            alive(&copy);
        });
        let other = {
            let handle = striped.clone();
            thread::spawn(move || {
                let local = handle.local();
                alive(&local);
                assert_eq!(handle.value, 7);
            })
        };
        drop(striped);
        receiver.join().unwrap();
        other.join().unwrap();
        assert_eq!(drops.load(Ordering::Acquire), 1, "dropped other than once");
    });
}
