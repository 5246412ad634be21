use std::fmt;
use std::sync::Arc;

use retrysafe_core::__private::Validate;
use retrysafe_core::__private::{RetryPolicy, Striped};
use retrysafe_core::ConfigError;
use retrysafe_core::classify::Classifier;
use retrysafe_core::retry::{GiveUpEvent, RetryEvent};
use retrysafe_core::strategy::RetryStrategy;
use retrysafe_core::wire::Convention;
use tower_layer::Layer;

use super::RetryService;

/// The default cap of the request-body copy kept for replay: 64 KiB.
pub(crate) const DEFAULT_REPLAY_CAP: usize = 64 * 1024;
pub(crate) const MAX_REPLAY_CAP: usize = 1 << 30;

#[derive(Clone)]
pub(crate) struct Config {
    /// The planner's configuration (retrysafe-core), shared with every call.
    pub(crate) policy: Striped<RetryPolicy>,
    pub(crate) replay_cap: usize,
}

/// Retries failed requests that are safe to retry; see the [module docs](super).
#[must_use]
pub struct RetryLayer {
    config: Arc<Config>,
}

impl RetryLayer {
    /// A layer with the [`StandardRetryStrategy`](retrysafe_core::strategy::StandardRetryStrategy)
    /// (3 attempts, full jitter, a ratio budget of its own, 10 s per attempt and 30 s
    /// overall without a deadline), the
    /// [`DefaultClassifier`](retrysafe_core::classify::DefaultClassifier) and the
    /// default [`Convention`].
    pub fn new() -> Self {
        RetryLayer {
            config: Arc::new(Config {
                policy: Striped::new(RetryPolicy::new()),
                replay_cap: DEFAULT_REPLAY_CAP,
            }),
        }
    }
}

impl Default for RetryLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl RetryLayer {
    /// Changes the policy (the builder methods of `RetryPolicy` hold the semantics,
    /// shared with the reqwest middleware).
    fn map(mut self, f: impl FnOnce(RetryPolicy) -> RetryPolicy) -> Self {
        let config = Arc::make_mut(&mut self.config);
        config.policy = Striped::new(f(RetryPolicy::clone(&config.policy)));
        self
    }

    /// The layer's name (default `default`): the `name` of its `retrysafe.call` spans,
    /// its hook events and its metrics (`retrysafe_client_attempts_total`,
    /// `retrysafe_client_retries_total`), whose handles are resolved when the layer
    /// makes its service.
    pub fn name(self, name: impl Into<retrysafe_core::observe::Name>) -> Self {
        self.map(|p| p.with_name(name))
    }

    /// The name given with [`name`](Self::name).
    #[cfg(feature = "client")]
    pub(crate) fn name_of(&self) -> &retrysafe_core::observe::Name {
        self.config.policy.name()
    }

    /// The retry strategy (attempts, backoff, budget, default timeouts).
    pub fn strategy(self, strategy: impl RetryStrategy) -> Self {
        self.map(|p| p.with_strategy(strategy))
    }

    /// The classifier (default:
    /// [`DefaultClassifier`](retrysafe_core::classify::DefaultClassifier) over this
    /// layer's convention).
    pub fn classifier(self, classifier: impl Classifier) -> Self {
        self.map(|p| p.with_classifier(classifier))
    }

    /// The header names (also used by the default classifier).
    pub fn convention(self, convention: Convention) -> Self {
        self.map(|p| p.with_convention(convention))
    }

    /// The cap of the request-body copy kept for replay (default 64 KiB; at most
    /// 1 GiB, checked by [`build`](Self::build); a larger cap is used as 1 GiB). A larger
    /// body is sent once and not retried.
    pub fn max_replay_body(self, bytes: usize) -> Self {
        let mut layer = self;
        Arc::make_mut(&mut layer.config).replay_cap = bytes;
        layer
    }

    /// Checks the settings: the error names every one out of range.
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        v.check(
            self.config.replay_cap <= MAX_REPLAY_CAP,
            "max replay body",
            "must be at most 1 GiB",
        );
        v.finish(self)
    }

    /// Adds an `Idempotency-Key` to POST and PATCH requests that have none, the same
    /// on every attempt, which makes them safe to retry. Declare it only for a
    /// downstream that honours keys (an `IdempotencyLayer`). The key is random (128
    /// bits), or — inside a handler guarded by an `IdempotencyLayer` — the
    /// deterministic child key of the inbound record, labelled by method, authority
    /// and path, so a re-run of the handler repeats the same keys.
    pub fn generate_idempotency_keys(self) -> Self {
        self.map(RetryPolicy::with_generated_keys)
    }

    /// Makes this layer the one retry point of the call chain: every attempt carries
    /// `retry-point: caller`, so the callee does not retry its own outbound calls.
    pub fn retry_point(self) -> Self {
        self.map(RetryPolicy::with_retry_point)
    }

    /// Declares requests safe to repeat when `f` says so, whatever their method (for
    /// example the methods of a read-only gRPC service).
    pub fn idempotent_if(
        self,
        f: impl Fn(&http::request::Parts) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.map(|p| p.with_idempotent_if(f))
    }

    /// Called before each retry.
    pub fn on_retry(self, f: impl Fn(&RetryEvent) + Send + Sync + 'static) -> Self {
        self.map(|p| p.with_on_retry(f))
    }

    /// Called when the layer gives up on a retryable failure.
    pub fn on_give_up(self, f: impl Fn(&GiveUpEvent) + Send + Sync + 'static) -> Self {
        self.map(|p| p.with_on_give_up(f))
    }
}

#[cfg(feature = "client")]
impl RetryLayer {
    /// The layer as part of a fused client stack: `budget` is the budget of every call
    /// whose request carries none, and attempts carry no mark for a budget layer below
    /// (there is none).
    pub(crate) fn fused(
        self,
        budget: retrysafe_core::budget::RetryBudget,
        expiry: retrysafe_core::__private::ExpiryObserver,
    ) -> Self {
        self.map(|p| {
            p.with_budget(budget)
                .without_charge_mark()
                .with_expiry_observer(expiry)
        })
    }

    /// The configuration every service of this layer shares.
    pub(crate) fn config(&self) -> &Arc<Config> {
        &self.config
    }
}

impl Clone for RetryLayer {
    fn clone(&self) -> Self {
        RetryLayer {
            config: self.config.clone(),
        }
    }
}

impl<S> Layer<S> for RetryLayer {
    type Service = RetryService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        self.config.policy.resolve_metrics();
        RetryService::from_config(inner, self.config.clone())
    }
}

impl fmt::Debug for RetryLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLayer")
            .field("config", &self.config)
            .finish()
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("policy", &self.policy)
            .field("replay_cap", &self.replay_cap)
            .finish()
    }
}
