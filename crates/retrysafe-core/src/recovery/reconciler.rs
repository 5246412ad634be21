//! The [`Reconciler`]: a background task that resolves a store's pending records.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::{PendingRecord, PendingState, ReconcilableStore, Resolution, Resolver, Settlement};
use crate::ConfigError;
use crate::config::Validate;
use crate::idempotency::{RecordId, Token, UnknownOutcome, UnknownReason, defaults};
use crate::observe::Name;
use crate::observe::handles::{Counter, Gauge};
use crate::observe::names;

type Hook = Arc<dyn Fn(&UnknownOutcome) + Send + Sync + 'static>;
type ResolutionHook = Arc<dyn Fn(&Resolved) + Send + Sync + 'static>;

/// The longest wait between two looks at one unknown record.
const MAX_BACKOFF: Duration = Duration::from_secs(60 * 60);

/// A background task that resolves the pending records of one store. See the
/// [module docs](super).
///
/// It considers a claim only once its lease ended more than `max_execution + grace`
/// ago (the layer cancels a handler past its `max_execution`, so no holder outlives
/// that), and every `outcome_unknown` record whose next pass is due — one that a copy or
/// a sweep made from a claim whose lease ended, also only `max_execution + grace` after
/// that lease ended. Each is adopted
/// with a fresh token for the resolver's timeout plus a margin, resolved, and settled.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use retrysafe_core::recovery::{PendingRecord, ReconcilableStore, Resolution, Resolver};
/// # use retrysafe::recovery::Reconciler;
///
/// struct Ledger;
/// impl Resolver for Ledger {
///     async fn resolve(&self, _record: &PendingRecord) -> Resolution {
///         Resolution::Unknown // look the payment up by (scope, key) here
///     }
/// }
///
/// # fn run<S: ReconcilableStore>(store: S) -> Result<(), retrysafe::ConfigError> {
/// let handle = store
///     .reconciler(Ledger)
///     .interval(Duration::from_secs(5))
///     .max_execution(Duration::from_secs(30))
///     .on_outcome_unknown(|unknown| eprintln!("unknown outcome: {:?}", unknown.record))
///     .spawn()?;
/// // ... serve; dropping the handle stops the reconciler.
/// drop(handle);
/// # Ok(()) }
/// # Ok(()) }
/// ```
pub struct Reconciler<S, R> {
    store: S,
    resolver: Arc<R>,
    settings: Settings,
    hook: Option<Hook>,
    name: Name,
    on_resolution: Option<ResolutionHook>,
    /// Resolved by [`build`](Reconciler::build) (or `spawn`).
    metrics: Option<Arc<Metrics>>,
}

/// How a reconciler left a record it looked at: the `resolution` label of
/// `retrysafe_reconciler_resolutions_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ResolvedKind {
    /// Completed with the response the resolver gave (`happened`).
    Happened,
    /// Released: the resolver said the effect did not happen (`did_not_happen`).
    DidNotHappen,
    /// Released: the claim had not reached its commit point (`released`).
    Released,
    /// Still unknown, left for a later pass (`unknown`).
    Unknown,
    /// A store call failed: the record could not be adopted or settled (`error`).
    Error,
}

impl ResolvedKind {
    const ALL: [ResolvedKind; 5] = [
        ResolvedKind::Happened,
        ResolvedKind::DidNotHappen,
        ResolvedKind::Released,
        ResolvedKind::Unknown,
        ResolvedKind::Error,
    ];

    /// The label value, e.g. `did_not_happen`.
    pub fn as_str(self) -> &'static str {
        match self {
            ResolvedKind::Happened => "happened",
            ResolvedKind::DidNotHappen => "did_not_happen",
            ResolvedKind::Released => "released",
            ResolvedKind::Unknown => "unknown",
            ResolvedKind::Error => "error",
        }
    }
}

/// What a reconciler did with one record, for its
/// [`on_resolution`](Reconciler::on_resolution) hook.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Resolved {
    /// How the record was left.
    pub resolution: ResolvedKind,
    /// The record.
    pub record: RecordId,
    /// The reconciler's [`name`](Reconciler::name).
    pub name: Name,
}

/// The metric handles of a reconciler.
#[derive(Debug)]
struct Metrics {
    resolutions: [Counter; 5],
    pending: Gauge,
}

impl Metrics {
    fn resolve(name: &Name) -> Self {
        Metrics {
            resolutions: ResolvedKind::ALL.map(|r| {
                Counter::new(
                    names::RECONCILER_RESOLUTIONS_TOTAL,
                    name,
                    Some(("resolution", r.as_str())),
                )
            }),
            pending: Gauge::new(names::RECONCILER_PENDING, name),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Settings {
    interval: Duration,
    batch: usize,
    grace: Duration,
    max_execution: Duration,
    concurrency: usize,
    resolve_timeout: Duration,
    retention: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            interval: defaults::RECONCILE_INTERVAL,
            batch: 100,
            grace: defaults::RECONCILE_GRACE,
            max_execution: defaults::MAX_EXECUTION,
            concurrency: 8,
            resolve_timeout: Duration::from_secs(10),
            retention: Duration::from_secs(24 * 60 * 60),
        }
    }
}

/// What one pass of a [`Reconciler`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Pass {
    /// Records adopted.
    pub adopted: usize,
    /// Completed with the response the resolver gave.
    pub happened: usize,
    /// Released after the resolver said the effect did not happen.
    pub did_not_happen: usize,
    /// Released because the claim had not reached its commit point.
    pub released_before_commit_point: usize,
    /// Left for a later pass.
    pub unknown: usize,
    /// Reconcile-hook calls.
    pub notified: usize,
    /// Store calls that failed.
    pub failed: usize,
}

impl<S: ReconcilableStore, R: Resolver> Reconciler<S, R> {
    /// A reconciler for `store` with `resolver` and the defaults: a pass every 2 s of
    /// at most 100 records, 8 resolver calls at once with a 10 s timeout each, claims
    /// considered 10 s (`max_execution`) + 2 s (`grace`) after their lease ended, and
    /// resolved records kept 24 h. With the layer's defaults, a crashed holder's key
    /// is resolved within 19 s ([`defaults`]).
    pub fn new(store: S, resolver: R) -> Self {
        Reconciler {
            store,
            resolver: Arc::new(resolver),
            settings: Settings::default(),
            hook: None,
            name: Name::default(),
            on_resolution: None,
            metrics: None,
        }
    }

    /// The reconciler's name (default `default`): the `name` of its resolutions and
    /// of its metrics (`retrysafe_reconciler_resolutions_total`,
    /// `retrysafe_reconciler_pending`), which [`build`](Self::build) resolves.
    #[must_use]
    pub fn name(mut self, name: impl Into<Name>) -> Self {
        self.name = name.into();
        self
    }

    /// A hook told of every record a pass looked at and how it left it ([`Resolved`]):
    /// the events `retrysafe_reconciler_resolutions_total` counts.
    #[must_use]
    pub fn on_resolution<F>(mut self, f: F) -> Self
    where
        F: Fn(&Resolved) + Send + Sync + 'static,
    {
        self.on_resolution = Some(Arc::new(f));
        self
    }

    /// Validates the settings, naming every refused one, and resolves the metric
    /// handles (feature `metrics`) in the recorder installed now. [`spawn`](Self::spawn)
    /// does it too; call it to run passes with [`run_once`](Self::run_once) that
    /// record metrics.
    pub fn build(mut self) -> Result<Self, ConfigError> {
        self.validate()?;
        self.metrics = Some(Arc::new(Metrics::resolve(&self.name)));
        Ok(self)
    }

    /// The time between passes (default 2 s). Must be at least 1 ms.
    #[must_use]
    pub fn interval(mut self, interval: Duration) -> Self {
        self.settings.interval = interval;
        self
    }

    /// The most records a pass looks at (default 100). Must be greater than zero.
    #[must_use]
    pub fn batch(mut self, n: usize) -> Self {
        self.settings.batch = n;
        self
    }

    /// How long after `max_execution` a claim's holder is given (default 2 s).
    #[must_use]
    pub fn grace(mut self, grace: Duration) -> Self {
        self.settings.grace = grace;
        self
    }

    /// The layer's `max_execution` (default 10 s, the layer's default): set it to the
    /// layer's, so that no claim is adopted while its handler may still run.
    #[must_use]
    pub fn max_execution(mut self, max: Duration) -> Self {
        self.settings.max_execution = max;
        self
    }

    /// The most resolver calls at once (default 8). Must be greater than zero.
    #[must_use]
    pub fn concurrency(mut self, n: usize) -> Self {
        self.settings.concurrency = n;
        self
    }

    /// The timeout of one resolver call (default 10 s); a call that times out is
    /// [`Resolution::Unknown`]. Must be at least 1 ms.
    #[must_use]
    pub fn resolve_timeout(mut self, timeout: Duration) -> Self {
        self.settings.resolve_timeout = timeout;
        self
    }

    /// How long a record completed by [`Resolution::Happened`] is kept (default 24 h,
    /// the layer's default retention).
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.settings.retention = retention;
        self
    }

    /// The reconcile hook, told of every record that is (or stays) `outcome_unknown`
    /// and was not told of before — by the layer, which tells it when it marks a record
    /// — at least once: hooks are idempotent on the record id.
    #[must_use]
    pub fn on_outcome_unknown<F>(mut self, f: F) -> Self
    where
        F: Fn(&UnknownOutcome) + Send + Sync + 'static,
    {
        self.hook = Some(Arc::new(f));
        self
    }

    /// Validates the settings, naming every refused one.
    fn validate(&self) -> Result<(), ConfigError> {
        let s = &self.settings;
        let mut v = Validate::new();
        v.check(
            s.interval >= Duration::from_millis(1),
            "interval",
            "must be at least 1 ms",
        );
        v.check(s.batch > 0, "batch", "must be greater than zero");
        v.check(
            s.concurrency > 0,
            "concurrency",
            "must be greater than zero",
        );
        v.check(
            s.resolve_timeout >= Duration::from_millis(1),
            "resolve_timeout",
            "must be at least 1 ms",
        );
        v.timeout(s.grace, "grace");
        v.timeout(s.max_execution, "max_execution");
        v.check(
            !s.retention.is_zero() && s.retention <= Duration::from_secs(366 * 24 * 60 * 60),
            "retention",
            "must be greater than zero and at most 366 days",
        );
        v.finish(())
    }

    /// How long a claim stays untouched before it is considered.
    fn stale(&self) -> Duration {
        self.settings
            .max_execution
            .saturating_add(self.settings.grace)
    }

    /// How long an adoption holds: the resolver's timeout plus a margin for the store
    /// calls around it.
    fn hold(&self) -> Duration {
        self.settings
            .resolve_timeout
            .saturating_add(Duration::from_secs(30))
    }

    /// Starts the reconciler on the current tokio runtime, after validating its
    /// settings. It runs a pass at once, then every `interval`, until the handle is
    /// dropped or [shut down](ReconcilerHandle::shutdown).
    pub fn spawn(self) -> Result<ReconcilerHandle, ConfigError> {
        // Built already: its handles stay bound to the recorder of its `build`.
        let this = if self.metrics.is_some() {
            self.validate()?;
            self
        } else {
            self.build()?
        };
        this.store.set_reconciled(true);
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let store = this.store.clone();
        let task = tokio::spawn(async move {
            let _running = Running(store);
            loop {
                let pass = this.run_once().await;
                tracing::debug!(target: "retrysafe::reconciler", name = this.name.as_str(), ?pass, "reconcile pass");
                tokio::select! {
                    () = tokio::time::sleep(this.settings.interval) => {}
                    _ = stopped.changed() => return,
                }
            }
        });
        Ok(ReconcilerHandle {
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Runs one pass: looks at the due records and resolves what it can. (What the
    /// spawned task does every `interval`; public for tests and for running passes by
    /// other means.)
    pub async fn run_once(&self) -> Pass {
        let mut pass = Pass::default();
        let ids = match self.store.due(self.stale(), self.settings.batch).await {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!(target: "retrysafe::reconciler", name = self.name.as_str(), error = %e, "could not list due records");
                pass.failed += 1;
                return pass;
            }
        };
        if let Some(m) = &self.metrics {
            m.pending.set(ids.len() as f64);
        }
        let permits = Arc::new(tokio::sync::Semaphore::new(self.settings.concurrency));
        let mut tasks = tokio::task::JoinSet::new();
        for id in ids {
            let Ok(permit) = permits.clone().acquire_owned().await else {
                break;
            };
            let one = One {
                store: self.store.clone(),
                resolver: self.resolver.clone(),
                hook: self.hook.clone(),
                settings: self.settings,
                stale: self.stale(),
                hold: self.hold(),
            };
            tasks.spawn(async move {
                let outcome = one.reconcile(id).await;
                drop(permit);
                (id, outcome)
            });
        }
        while let Some(done) = tasks.join_next().await {
            match done {
                Ok((id, one)) => {
                    pass.add(one);
                    self.report(id, one);
                }
                Err(e) => {
                    tracing::error!(target: "retrysafe::reconciler", error = %e, "a reconcile task failed");
                    pass.failed += 1;
                }
            }
        }
        pass
    }

    /// Counts what became of record `id` and tells the resolution hook.
    fn report(&self, id: RecordId, outcome: Outcome) {
        let resolution = match (outcome.failed, outcome.settled) {
            (true, _) => ResolvedKind::Error,
            (false, Some(Settled::Happened)) => ResolvedKind::Happened,
            (false, Some(Settled::DidNotHappen)) => ResolvedKind::DidNotHappen,
            (false, Some(Settled::BeforeCommitPoint)) => ResolvedKind::Released,
            (false, Some(Settled::Unknown)) => ResolvedKind::Unknown,
            // Resolved meanwhile, or adopted by another reconciler: nothing to report.
            (false, None) => return,
        };
        if let Some(m) = &self.metrics {
            let counter = ResolvedKind::ALL
                .iter()
                .position(|r| *r == resolution)
                .and_then(|i| m.resolutions.get(i));
            if let Some(c) = counter {
                c.increment();
            }
        }
        if let Some(hook) = &self.on_resolution {
            hook(&Resolved {
                resolution,
                record: id,
                name: self.name.clone(),
            });
        }
    }
}

impl<S, R> fmt::Debug for Reconciler<S, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reconciler")
            .field("name", &self.name)
            .field("settings", &self.settings)
            .field("hook", &self.hook.is_some())
            .finish_non_exhaustive()
    }
}

/// Uncounts the reconciler when its task ends, however it ends.
struct Running<S: ReconcilableStore>(S);

impl<S: ReconcilableStore> Drop for Running<S> {
    fn drop(&mut self) {
        self.0.set_reconciled(false);
    }
}

/// A running [`Reconciler`]: dropping it stops the reconciler (an adoption in progress
/// lapses and its record returns to its prior state).
#[derive(Debug)]
pub struct ReconcilerHandle {
    stop: Option<tokio::sync::watch::Sender<bool>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl ReconcilerHandle {
    /// Stops the reconciler after its current pass, and waits for it.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for ReconcilerHandle {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// What became of one record.
#[derive(Debug, Clone, Copy, Default)]
struct Outcome {
    adopted: bool,
    settled: Option<Settled>,
    notified: bool,
    failed: bool,
}

#[derive(Debug, Clone, Copy)]
enum Settled {
    Happened,
    DidNotHappen,
    BeforeCommitPoint,
    Unknown,
}

impl Pass {
    fn add(&mut self, o: Outcome) {
        self.adopted += usize::from(o.adopted);
        self.notified += usize::from(o.notified);
        self.failed += usize::from(o.failed);
        match o.settled {
            Some(Settled::Happened) => self.happened += 1,
            Some(Settled::DidNotHappen) => self.did_not_happen += 1,
            Some(Settled::BeforeCommitPoint) => self.released_before_commit_point += 1,
            Some(Settled::Unknown) => self.unknown += 1,
            None => {}
        }
    }
}

/// Everything one record's task needs.
struct One<S, R> {
    store: S,
    resolver: Arc<R>,
    hook: Option<Hook>,
    settings: Settings,
    stale: Duration,
    hold: Duration,
}

impl<S: ReconcilableStore, R: Resolver> One<S, R> {
    async fn reconcile(self, id: RecordId) -> Outcome {
        let mut out = Outcome::default();
        let token = Token::random();
        let pending = match self
            .store
            .adopt(&id, token, self.hold, Some(self.stale))
            .await
        {
            Ok(Some(p)) => p,
            Ok(None) => return out, // resolved meanwhile, or adopted by another
            Err(e) => {
                tracing::warn!(target: "retrysafe::reconciler", record = ?id, error = %e, "could not adopt a pending record");
                out.failed = true;
                return out;
            }
        };
        out.adopted = true;
        let (settled, settlement) = self.decide(&pending).await;
        // The hook hears of every record that is, or stays, unknown.
        let unknown = matches!(pending.state, PendingState::Unknown { .. })
            || matches!(settled, Settled::Unknown);
        let mut notified = pending.notified;
        if unknown && !notified {
            if let Some(hook) = &self.hook {
                hook(&unknown_outcome(&pending));
                out.notified = true;
            }
            notified = true;
        }
        match self.store.settle(&id, token, settlement, notified).await {
            Ok(()) => out.settled = Some(settled),
            Err(e) => {
                // The adoption lapses and the record returns to its prior state.
                tracing::warn!(target: "retrysafe::reconciler", record = ?id, error = %e, "could not settle a pending record");
                out.failed = true;
            }
        }
        out
    }

    /// Asks the resolver (unless nothing can have happened) and turns its answer into a
    /// settlement.
    async fn decide(&self, pending: &PendingRecord) -> (Settled, Settlement) {
        if pending.is_before_commit_point() {
            // Its commit point is fenced: the effect cannot have started.
            return (Settled::BeforeCommitPoint, Settlement::Release);
        }
        let resolution = tokio::time::timeout(
            self.settings.resolve_timeout,
            self.resolver.resolve(pending),
        )
        .await
        .unwrap_or(Resolution::Unknown);
        match resolution {
            Resolution::Happened(response) => (
                Settled::Happened,
                Settlement::Complete {
                    response,
                    retention: self.settings.retention,
                },
            ),
            Resolution::DidNotHappen => (Settled::DidNotHappen, Settlement::Release),
            Resolution::Unknown => (
                Settled::Unknown,
                Settlement::Later {
                    after: backoff(pending.age, self.settings.interval),
                },
            ),
        }
    }
}

/// The wait before an unknown record is looked at again: a quarter of its age, at
/// least the interval, at most an hour.
fn backoff(age: Duration, interval: Duration) -> Duration {
    (age / 4).clamp(interval, MAX_BACKOFF.max(interval))
}

fn unknown_outcome(p: &PendingRecord) -> UnknownOutcome {
    let reason = match p.state {
        PendingState::Unknown {
            reason: Some(reason),
        } => reason,
        _ => UnknownReason::LeaseExpired,
    };
    UnknownOutcome::new(p.record, reason).with_request(p.request.clone(), p.note.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_with_age_within_bounds() {
        let i = Duration::from_secs(5);
        assert_eq!(backoff(Duration::ZERO, i), i);
        assert_eq!(
            backoff(Duration::from_secs(400), i),
            Duration::from_secs(100)
        );
        assert_eq!(backoff(Duration::from_secs(1_000_000), i), MAX_BACKOFF);
    }

    #[allow(clippy::unwrap_used)]
    #[test]
    fn unknown_outcome_carries_reason_and_request() {
        use crate::idempotency::{Fingerprint, RecordId};
        let p = PendingRecord::new(
            RecordId::from_bytes([1; 32]),
            PendingState::Unknown {
                reason: Some(UnknownReason::Panicked),
            },
            Fingerprint::from_bytes([2; 32]),
        );
        let u = unknown_outcome(&p);
        assert_eq!(u.reason, UnknownReason::Panicked);
        assert!(u.request.is_none());
    }
}
