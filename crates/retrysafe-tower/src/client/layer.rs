//! The builder: [`ClientLayers`].

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use retrysafe_core::__private::{ExpiryObserver, Validate};
use retrysafe_core::ConfigError;
use retrysafe_core::breaker::BreakerConfig;
use retrysafe_core::budget::RetryBudget;
use retrysafe_core::observe::Name;
use tower_layer::Layer;

use super::service::{ClientService, Front};
use crate::breaker::CircuitBreakerLayer;
use crate::hedge::HedgeLayer;
use crate::retry::RetryLayer;
use crate::throttle::AdaptiveThrottleLayer;

/// The standard client order — deadline → (throttle → hedge →) retry → budget →
/// breaker → transport — as one layer making one service, its retry, budget and
/// breaker part fused; see the [module docs](super).
#[must_use]
#[derive(Clone)]
pub struct ClientLayers {
    deadline: Option<Duration>,
    /// The retry layer as given, kept to re-apply the budget when either changes.
    retry: RetryLayer,
    budget: RetryBudget,
    breaker: CircuitBreakerLayer,
    /// Whether the budget and the breaker are the stack's own (not given): then
    /// [`name`](Self::name) names them too.
    own_budget: bool,
    own_breaker: bool,
    /// Reports the calls that ran out of time (the stack's name).
    expiry: ExpiryObserver,
    /// `retry` with `budget` given to it: what the services share.
    fused: RetryLayer,
    throttle: Option<AdaptiveThrottleLayer>,
    hedge: Option<HedgeLayer>,
}

impl ClientLayers {
    /// The standard order with the defaults of each piece: no deadline of its own (the
    /// request's or the inherited one, else the strategy's default timeouts),
    /// [`RetryLayer::new`], a [`RetryBudget::ratio`] of its own, and
    /// [`CircuitBreakerLayer::default`] (a breaker of its own).
    pub fn new() -> Self {
        let budget = RetryBudget::ratio();
        let expiry = ExpiryObserver::new(Name::default());
        ClientLayers {
            deadline: None,
            retry: RetryLayer::new(),
            fused: RetryLayer::new().fused(budget.clone(), expiry.clone()),
            budget,
            breaker: CircuitBreakerLayer::default(),
            own_budget: true,
            own_breaker: true,
            expiry,
            throttle: None,
            hedge: None,
        }
    }

    /// Makes the fused retry layer again from its parts.
    fn refused(mut self) -> Self {
        self.fused = self
            .retry
            .clone()
            .fused(self.budget.clone(), self.expiry.clone());
        self
    }

    /// The stack's name (default `default`): the `name` of its deadline expiries
    /// (`retrysafe_deadline_exceeded_total`), and by default of its parts — the retry
    /// layer unless it was named, the budget and the breaker unless they were given.
    /// Metric handles are resolved when the stack makes its service (`Layer::layer`).
    ///
    /// ```
    /// use retrysafe::ClientLayers;
    ///
    /// let layers = ClientLayers::new().name("payments-api");
    /// # let _ = layers;
    /// ```
    pub fn name(mut self, name: impl Into<Name>) -> Self {
        let name = name.into();
        if self.own_budget {
            self.budget = self.budget.with_name(name.clone());
        }
        if self.own_breaker {
            self.breaker =
                CircuitBreakerLayer::with_config(BreakerConfig::default().with_name(name.clone()));
        }
        if self.retry.name_of() == &Name::default() {
            self.retry = self.retry.name(name.clone());
        }
        self.expiry = self.expiry.renamed(name);
        self.refused()
    }

    /// Calls `f` on every call that ends with a
    /// [`DeadlineExceeded`](retrysafe_core::error::DeadlineExceeded) error.
    pub fn on_expiry(
        mut self,
        f: impl Fn(&retrysafe_core::DeadlineExpiry) + Send + Sync + 'static,
    ) -> Self {
        self.expiry = self.expiry.with_hook(f);
        self.refused()
    }

    /// Bounds each whole call by `timeout`, as a [`DeadlineLayer`](crate::deadline::DeadlineLayer)
    /// outermost would (greater than zero, at most 30 days, checked by
    /// [`build`](Self::build); a longer one is used as 30 days).
    pub fn deadline(mut self, timeout: Duration) -> Self {
        self.deadline = Some(timeout);
        self
    }

    /// The retry layer: strategy, classifier, keys, hooks. Its strategy's own budget is
    /// not used: every call charges the [`budget`](Self::budget) of the stack (and a
    /// [`RetryBudget`] extension of its request, if any, for its retries: see the
    /// [module docs](super)).
    pub fn retry(mut self, retry: RetryLayer) -> Self {
        // An unnamed retry layer takes the stack's name.
        let name = self.expiry.name();
        self.retry = if retry.name_of() == &Name::default() && name != &Name::default() {
            retry.name(name.clone())
        } else {
            retry
        };
        self.refused()
    }

    /// The retry budget, given once: the retry layer charges it and no separate budget
    /// layer is needed (default: a [`RetryBudget::ratio`] of its own). Share one handle
    /// between every client of the same downstream.
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.budget = budget;
        self.own_budget = false;
        self.refused()
    }

    /// The breaker layer, plain or keyed per authority
    /// ([`CircuitBreakerLayer::keyed`] with
    /// [`KeyedBreakers::per_authority`](crate::breaker::KeyedBreakers::per_authority)).
    pub fn breaker(mut self, breaker: CircuitBreakerLayer) -> Self {
        self.breaker = breaker;
        self.own_breaker = false;
        self
    }

    /// An adaptive throttle in front of the stack, below the deadline and above the
    /// hedge: it sees one call per logical request, and its local rejections — the
    /// error [`Throttled`](crate::throttle::Throttled) — reach no other part (nothing
    /// retries them; breakers and budgets do not count them).
    pub fn throttle(mut self, throttle: AdaptiveThrottleLayer) -> Self {
        self.throttle = Some(throttle);
        self
    }

    /// Hedging, below the deadline and the throttle and above the retry: a slow safe
    /// request gets more copies, each one a call of the retry, budget and breaker part
    /// (sent once: the hedge decides what a copy is worth). Every hedge is withdrawn
    /// from the stack's [`budget`](Self::budget), which replaces the hedge layer's own;
    /// the request's one deposit is the retry's. One copy of the request body serves
    /// the hedges and the retries, capped at the larger of the two layers' caps. The
    /// layer's [`stats`](HedgeLayer::stats) count what the stack does.
    pub fn hedge(mut self, hedge: HedgeLayer) -> Self {
        self.hedge = Some(hedge);
        self
    }

    /// Checks the settings: the error names every one out of range (`deadline`, and the
    /// retry, throttle and hedge layers').
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        if let Some(timeout) = self.deadline {
            v.timeout(timeout, "deadline");
        }
        v.take(self.retry.clone().build());
        if let Some(throttle) = &self.throttle {
            v.take(throttle.clone().build());
        }
        if let Some(hedge) = &self.hedge {
            v.take(hedge.clone().build());
        }
        v.finish(self)
    }
}

impl ClientLayers {
    /// The header names of the retry layer (for the gRPC status answers).
    #[cfg(feature = "tonic")]
    pub(crate) fn retry_convention(&self) -> &retrysafe_core::wire::Convention {
        self.fused.config().policy.convention()
    }
}

impl Default for ClientLayers {
    fn default() -> Self {
        Self::new()
    }
}

impl<S: Clone> Layer<S> for ClientLayers {
    type Service = ClientService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        self.fused.config().policy.resolve_metrics();
        self.breaker.resolve_metrics();
        let front = Front {
            throttle: self.throttle.as_ref().map(AdaptiveThrottleLayer::resolved),
            hedge: (self.hedge.as_ref()).map(|h| h.resolved_with_budget(&self.budget)),
        };
        ClientService::new(
            inner,
            Arc::clone(self.fused.config()),
            self.breaker.config().clone(),
            self.deadline,
            front,
        )
    }
}

impl fmt::Debug for ClientLayers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientLayers")
            .field("name", self.expiry.name())
            .field("deadline", &self.deadline)
            .field("retry", &self.fused)
            .field("budget", &self.budget)
            .field("breaker", &self.breaker)
            .field("throttle", &self.throttle)
            .field("hedge", &self.hedge)
            .finish()
    }
}
