//! The layer and its configuration.

use std::fmt;
use std::sync::Arc;

use retrysafe_core::__private::Striped;
use retrysafe_core::breaker::{BreakerConfig, CircuitBreaker};
use retrysafe_core::classify::{Classifier, DefaultClassifier};
use retrysafe_core::wire::Convention;
use tower_layer::Layer;

use super::keyed::{KeyedBreakers, Select};
use super::service::CircuitBreakerService;

/// Which breaker guards a request.
#[derive(Clone)]
pub(crate) enum Breakers {
    /// One breaker for every request.
    One(CircuitBreaker),
    /// One breaker per key of the request.
    Keyed(Arc<dyn Select>),
}

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) breakers: Breakers,
    pub(crate) classifier: Arc<dyn Classifier>,
    pub(crate) convention: Convention,
}

/// Guards calls with a circuit breaker; see the [module docs](super).
///
/// A refusal is the error [`CircuitOpen`](retrysafe_core::error::CircuitOpen) (for
/// gRPC, a [`GrpcStatusLayer`](crate::answer::GrpcStatusLayer) above the stack turns it
/// into a status).
///
/// The layer reports under its breaker's name ([`BreakerConfig::with_name`]; a keyed
/// map's configuration names the whole map): `retrysafe_breaker_state`,
/// `retrysafe_breaker_rejections_total`, the state-change and
/// [rejection](BreakerConfig::with_on_rejection) hooks, and the `breaker` field of the
/// `retrysafe.call` span above it. The breaker's handles are resolved when the layer
/// makes its service.
#[must_use]
pub struct CircuitBreakerLayer {
    // Striped: every call's future holds a reference to it (see `Striped`).
    config: Striped<Config>,
}

impl CircuitBreakerLayer {
    /// A layer guarding every request with `breaker`, a shared handle: clone it into
    /// every client of the same downstream so they open and close together.
    pub fn new(breaker: CircuitBreaker) -> Self {
        Self::from_breakers(Breakers::One(breaker))
    }

    /// A layer with a breaker of its own, configured by `config` (checked by
    /// [`BreakerConfig::build`]). Clones of the layer share the breaker.
    pub fn with_config(config: BreakerConfig) -> Self {
        Self::new(CircuitBreaker::new(config))
    }

    /// A layer keeping one breaker per key of the request (per authority with
    /// [`KeyedBreakers::per_authority`]), in the bounded map `breakers`.
    pub fn keyed<K>(breakers: KeyedBreakers<K>) -> Self
    where
        K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    {
        Self::from_breakers(Breakers::Keyed(Arc::new(breakers)))
    }

    fn from_breakers(breakers: Breakers) -> Self {
        let convention = Convention::default();
        CircuitBreakerLayer {
            config: Striped::new(Config {
                breakers,
                classifier: Arc::new(DefaultClassifier::new(convention.clone())),
                convention,
            }),
        }
    }
}

impl Default for CircuitBreakerLayer {
    /// A layer with a breaker of its own with the default configuration
    /// ([`BreakerConfig::default`]).
    fn default() -> Self {
        Self::new(CircuitBreaker::default())
    }
}

impl CircuitBreakerLayer {
    /// Resolves the breaker's metric handles (a keyed map's are, when it is made).
    pub(crate) fn resolve_metrics(&self) {
        if let Breakers::One(breaker) = &self.config.breakers {
            breaker.resolve_metrics();
        }
    }

    fn map(mut self, f: impl FnOnce(&mut Config)) -> Self {
        let mut config = Config::clone(&self.config);
        f(&mut config);
        self.config = Striped::new(config);
        self
    }

    /// The classifier deciding what counts as the callee's failure (default:
    /// [`DefaultClassifier`] over this layer's convention).
    pub fn classifier(self, classifier: impl Classifier) -> Self {
        self.map(|c| c.classifier = Arc::new(classifier))
    }

    /// The header names (also used by the default classifier).
    pub fn convention(self, convention: Convention) -> Self {
        self.map(|c| {
            c.classifier = Arc::new(DefaultClassifier::new(convention.clone()));
            c.convention = convention;
        })
    }
}

#[cfg(feature = "client")]
impl CircuitBreakerLayer {
    /// The configuration every service of this layer shares.
    pub(crate) fn config(&self) -> &Striped<Config> {
        &self.config
    }
}

impl Clone for CircuitBreakerLayer {
    fn clone(&self) -> Self {
        CircuitBreakerLayer {
            config: self.config.clone(),
        }
    }
}

impl<S> Layer<S> for CircuitBreakerLayer {
    type Service = CircuitBreakerService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        self.resolve_metrics();
        CircuitBreakerService::from_config(inner, self.config.clone())
    }
}

impl fmt::Debug for CircuitBreakerLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreakerLayer")
            .field("config", &self.config)
            .finish()
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("breakers", &self.breakers)
            .field("classifier", &self.classifier)
            .field("convention", &self.convention)
            .finish()
    }
}

impl fmt::Debug for Breakers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Breakers::One(breaker) => f.debug_tuple("One").field(breaker).finish(),
            Breakers::Keyed(keyed) => f.debug_tuple("Keyed").field(keyed).finish(),
        }
    }
}
