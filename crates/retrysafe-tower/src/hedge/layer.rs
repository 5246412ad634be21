use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use retrysafe_core::__private::Validate;
use retrysafe_core::__private::handles::{Counter, Lazy};
use retrysafe_core::__private::{HedgeDelay, LatencyTracker};
use retrysafe_core::ConfigError;
use retrysafe_core::budget::RetryBudget;
use retrysafe_core::classify::{Classifier, DefaultClassifier};
use retrysafe_core::observe::{Name, names};
use retrysafe_core::wire::Convention;
use tower_layer::Layer;

use super::HedgeService;
use crate::retry::DEFAULT_REPLAY_CAP;

/// The most hedges per request.
const MAX_HEDGES: u32 = 10;
/// The window of the latency percentile.
const PERCENTILE_WINDOW: Duration = Duration::from_secs(30);

/// Sends more copies of a slow safe request and keeps the first acceptable answer,
/// within a retry budget; see the [module docs](super).
///
/// Clones of a layer (and every service it makes) share its latency window, budget and
/// counts.
#[must_use]
#[derive(Clone)]
pub struct HedgeLayer {
    pub(super) config: Arc<Config>,
}

pub(crate) struct Config {
    pub(super) name: Name,
    pub(super) delay: HedgeDelay,
    /// The quantile of a percentile delay, as set (checked by `build`).
    pub(super) quantile: f64,
    pub(super) max_hedges: u32,
    pub(super) keyed: bool,
    pub(super) budget: RetryBudget,
    pub(super) classifier: Arc<dyn Classifier>,
    pub(super) convention: Convention,
    pub(crate) replay_cap: usize,
    pub(super) counts: Arc<Counts>,
    /// `retrysafe_hedges_total{name, outcome}`, resolved when the layer makes its
    /// service.
    pub(super) metrics: Lazy<HedgeMetrics>,
    pub(super) on_hedge: Option<HedgeHook>,
}

type HedgeHook = Arc<dyn Fn(&HedgeEvent) + Send + Sync>;

/// What became of a hedge ([`HedgeEvent::outcome`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HedgeOutcome {
    /// The hedge's answer won the race.
    Won,
    /// The hedge was sent and another copy's answer ended the call.
    Lost,
    /// The retry budget refused the hedge: it was not sent.
    Refused,
}

impl HedgeOutcome {
    /// The outcome as the `outcome` label of `retrysafe_hedges_total`: `won`, `lost`,
    /// `refused`.
    pub fn as_str(self) -> &'static str {
        match self {
            HedgeOutcome::Won => "won",
            HedgeOutcome::Lost => "lost",
            HedgeOutcome::Refused => "refused",
        }
    }
}

/// A hedge that won, lost or was refused, as the [`on_hedge`](HedgeLayer::on_hedge)
/// hook sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HedgeEvent {
    /// The layer's name.
    pub name: Name,
    /// What became of the hedge.
    pub outcome: HedgeOutcome,
}

impl Config {
    fn metrics(&self) -> &HedgeMetrics {
        self.metrics.get(|| metrics(&self.name))
    }

    /// Counts `n` hedges of `outcome` and calls the hook for each.
    pub(super) fn hedges(&self, outcome: HedgeOutcome, n: u32) {
        for _ in 0..n {
            self.metrics().of(outcome).increment();
            if let Some(hook) = &self.on_hedge {
                hook(&HedgeEvent {
                    name: self.name.clone(),
                    outcome,
                });
            }
        }
    }
}

/// The counters of `retrysafe_hedges_total`, one per outcome.
#[derive(Clone, Default)]
pub(super) struct HedgeMetrics {
    won: Counter,
    lost: Counter,
    refused: Counter,
}

impl HedgeMetrics {
    fn of(&self, outcome: HedgeOutcome) -> &Counter {
        match outcome {
            HedgeOutcome::Won => &self.won,
            HedgeOutcome::Lost => &self.lost,
            HedgeOutcome::Refused => &self.refused,
        }
    }
}

fn metrics(name: &Name) -> HedgeMetrics {
    let counter = |outcome: HedgeOutcome| {
        Counter::new(
            names::HEDGES_TOTAL,
            name,
            Some(("outcome", outcome.as_str())),
        )
    };
    HedgeMetrics {
        won: counter(HedgeOutcome::Won),
        lost: counter(HedgeOutcome::Lost),
        refused: counter(HedgeOutcome::Refused),
    }
}

/// The shared counts behind [`HedgeStats`].
#[derive(Default)]
pub(super) struct Counts {
    pub(super) sent: AtomicU64,
    pub(super) won: AtomicU64,
    pub(super) refused: AtomicU64,
}

impl Counts {
    pub(super) fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// What a [`HedgeLayer`] did so far (every clone and service of it together).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct HedgeStats {
    /// Hedges sent.
    pub sent: u64,
    /// Calls a hedge answered first.
    pub won: u64,
    /// Hedges the budget refused.
    pub budget_refusals: u64,
}

impl HedgeLayer {
    /// A layer named `default`: one hedge after the p95 of the last 30 s of latencies
    /// (at least 10 ms; none before 20 samples), safe requests only (not keyed POSTs),
    /// a ratio budget of its own ([`RetryBudget::ratio`]), the [`DefaultClassifier`],
    /// and a body copy of up to 64 KiB.
    pub fn new() -> Self {
        HedgeLayer {
            config: Arc::new(Config {
                name: Name::default(),
                delay: HedgeDelay::Percentile(LatencyTracker::new(0.95, PERCENTILE_WINDOW)),
                quantile: 0.95,
                max_hedges: 1,
                keyed: false,
                budget: RetryBudget::ratio(),
                classifier: Arc::new(DefaultClassifier::default()),
                convention: Convention::default(),
                replay_cap: DEFAULT_REPLAY_CAP,
                counts: Arc::default(),
                metrics: Lazy::default(),
                on_hedge: None,
            }),
        }
    }

    fn map(self, f: impl FnOnce(&mut Config)) -> Self {
        let old = &self.config;
        let mut config = Config {
            name: old.name.clone(),
            delay: old.delay.clone(),
            quantile: old.quantile,
            max_hedges: old.max_hedges,
            keyed: old.keyed,
            budget: old.budget.clone(),
            classifier: Arc::clone(&old.classifier),
            convention: old.convention.clone(),
            replay_cap: old.replay_cap,
            counts: Arc::default(),
            metrics: old.metrics.clone(),
            on_hedge: old.on_hedge.clone(),
        };
        let name = config.name.clone();
        f(&mut config);
        if config.name != name {
            config.metrics = Lazy::default();
        }
        HedgeLayer {
            config: Arc::new(config),
        }
    }

    /// Calls `f` on every hedge that won, lost or was refused by the budget.
    pub fn on_hedge(self, f: impl Fn(&HedgeEvent) + Send + Sync + 'static) -> Self {
        self.map(|c| c.on_hedge = Some(Arc::new(f)))
    }

    /// The name in events, hooks and metrics (`retrysafe_hedges_total`, whose handles
    /// are resolved when the layer makes its service; default `default`).
    pub fn name(self, name: impl Into<Name>) -> Self {
        let name = name.into();
        self.map(|c| c.name = name)
    }

    /// Hedges after a fixed `delay`.
    pub fn delay(self, delay: Duration) -> Self {
        self.map(|c| c.delay = HedgeDelay::Fixed(delay))
    }

    /// Hedges after the `quantile` (from 0 to 1, exclusive of 0; 0.95 for p95) of the
    /// latencies of the last 30 s, at least 10 ms; no hedge before 20 samples.
    pub fn percentile(self, quantile: f64) -> Self {
        self.map(|c| {
            c.quantile = quantile;
            c.delay = HedgeDelay::Percentile(LatencyTracker::new(quantile, PERCENTILE_WINDOW));
        })
    }

    /// Copies sent at most per request besides the first, from 1 to 10 (default 1),
    /// each one a delay after the one before.
    pub fn max_hedges(self, max: u32) -> Self {
        self.map(|c| c.max_hedges = max)
    }

    /// Also hedges requests of other methods (POST, PATCH) that carry an
    /// `Idempotency-Key`. Off by default: against an `IdempotencyLayer`, a hedge of a
    /// keyed request mostly meets a 409 or a wait — load without gain.
    pub fn hedge_keyed_requests(self) -> Self {
        self.map(|c| c.keyed = true)
    }

    /// The budget every hedge is withdrawn from. Share the one of the `RetryLayer`
    /// below: the layer puts it on every request it passes (as the `RetryBudget`
    /// extension, unless the request has one), so the retry layer charges the request
    /// and its retries to it too, and hedges and retries together stay within it.
    pub fn budget(self, budget: RetryBudget) -> Self {
        self.map(|c| c.budget = budget)
    }

    /// The classifier that tells an acceptable answer (one a retry layer would not
    /// retry) from a retryable failure (default: [`DefaultClassifier`]).
    pub fn classifier(self, classifier: impl Classifier) -> Self {
        self.map(|c| c.classifier = Arc::new(classifier))
    }

    /// The header names (`retry-attempt`, `idempotency-key`), also given to the default
    /// classifier.
    pub fn convention(self, convention: Convention) -> Self {
        self.map(|c| {
            c.classifier = Arc::new(DefaultClassifier::new(convention.clone()));
            c.convention = convention;
        })
    }

    /// The cap of the request-body copy (default 64 KiB): a larger body is not hedged.
    pub fn max_replay_body(self, bytes: usize) -> Self {
        self.map(|c| c.replay_cap = bytes)
    }

    /// Checks the settings: the error names every one out of range (`max_hedges`,
    /// `percentile`, `delay`, `max_replay_body`).
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        let c = &self.config;
        v.check(
            (1..=MAX_HEDGES).contains(&c.max_hedges),
            "max_hedges",
            "must be from 1 to 10",
        );
        match &c.delay {
            HedgeDelay::Fixed(d) => v.timeout(*d, "delay"),
            _ => v.check(
                c.quantile > 0.0 && c.quantile <= 1.0,
                "percentile",
                "must be greater than 0 and at most 1",
            ),
        }
        v.check(
            c.replay_cap <= 1 << 30,
            "max_replay_body",
            "must be at most 1 GiB",
        );
        v.finish(self)
    }

    /// What the layer did so far.
    pub fn stats(&self) -> HedgeStats {
        let c = &self.config.counts;
        HedgeStats {
            sent: c.sent.load(Ordering::Relaxed),
            won: c.won.load(Ordering::Relaxed),
            budget_refusals: c.refused.load(Ordering::Relaxed),
        }
    }

    /// The budget hedges are withdrawn from.
    #[doc(hidden)]
    pub fn retry_budget(&self) -> &RetryBudget {
        &self.config.budget
    }

    /// The configuration with `budget` in place of the layer's, sharing everything
    /// else — its counts too, so [`stats`](Self::stats) still tells — with its metric
    /// handles resolved: for a stack that gives the budget once.
    #[cfg(feature = "client")]
    pub(crate) fn resolved_with_budget(&self, budget: &RetryBudget) -> Arc<Config> {
        let _ = self.config.metrics();
        let old = &self.config;
        Arc::new(Config {
            name: old.name.clone(),
            delay: old.delay.clone(),
            quantile: old.quantile,
            max_hedges: old.max_hedges,
            keyed: old.keyed,
            budget: budget.clone(),
            classifier: Arc::clone(&old.classifier),
            convention: old.convention.clone(),
            replay_cap: old.replay_cap,
            counts: Arc::clone(&old.counts),
            metrics: old.metrics.clone(),
            on_hedge: old.on_hedge.clone(),
        })
    }
}

impl Default for HedgeLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Layer<S> for HedgeLayer {
    type Service = HedgeService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        let _ = self.config.metrics();
        self.config.budget.resolve_metrics();
        HedgeService::new(inner, Arc::clone(&self.config))
    }
}

impl fmt::Debug for HedgeLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.config, f)
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HedgeLayer")
            .field("name", &self.name)
            .field("delay", &self.delay)
            .field("max_hedges", &self.max_hedges)
            .field("keyed", &self.keyed)
            .field("budget", &self.budget)
            .field("replay_cap", &self.replay_cap)
            .finish_non_exhaustive()
    }
}
