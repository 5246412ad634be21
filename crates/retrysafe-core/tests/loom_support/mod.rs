//! Shared by the loom models (`tests/loom_*.rs`).

/// Runs `model` under loom (with `LOOM_MAX_PREEMPTIONS` / `LOOM_MAX_BRANCHES` from the
/// environment, else `preemptions` as the bound, `None` for none) and prints the number of
/// executions explored.
pub(crate) fn check(
    name: &str,
    preemptions: Option<usize>,
    model: impl Fn() + Sync + Send + 'static,
) {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = preemptions;
    }
    let counter = std::sync::Arc::new(AtomicUsize::new(0));
    let executions = std::sync::Arc::clone(&counter);
    let start = std::time::Instant::now();
    builder.check(move || {
        executions.fetch_add(1, Relaxed);
        model();
    });
    eprintln!(
        "loom model {name}: {} executions in {:.2?} (preemption bound {:?})",
        counter.load(Relaxed),
        start.elapsed(),
        builder.preemption_bound,
    );
}
