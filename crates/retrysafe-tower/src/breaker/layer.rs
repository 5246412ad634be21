//! The layer and its configuration.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use retrysafe_core::ConfigError;
use retrysafe_core::breaker::{BreakerConfig, CircuitBreaker};
use retrysafe_core::classify::{Classifier, DefaultClassifier};
use retrysafe_core::stripe::Striped;
use retrysafe_core::wire::Convention;
use tower_layer::Layer;

use super::keyed::{KeyedBreakers, Select};
use super::service::CircuitBreakerService;
use crate::local::{AsError, AsGrpcStatus};

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
/// `M` chooses how a refusal is answered: [`AsError`] (the default: the error
/// [`CircuitOpen`](retrysafe_core::error::CircuitOpen)) or [`AsGrpcStatus`]
/// ([`grpc_statuses`](CircuitBreakerLayer::grpc_statuses)).
#[must_use]
pub struct CircuitBreakerLayer<M = AsError> {
    // Striped: every call's future holds a reference to it (see `Striped`).
    config: Striped<Config>,
    _local: PhantomData<fn() -> M>,
}

impl CircuitBreakerLayer {
    /// A layer guarding every request with `breaker`, a shared handle: clone it into
    /// every client of the same downstream so they open and close together.
    pub fn new(breaker: CircuitBreaker) -> Self {
        Self::from_breakers(Breakers::One(breaker))
    }

    /// A layer with a breaker of its own, configured by `config` (refused, naming the
    /// field, when a field is out of range). Clones of the layer share the breaker.
    pub fn with_config(config: BreakerConfig) -> Result<Self, ConfigError> {
        Ok(Self::new(CircuitBreaker::new(config)?))
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
            _local: PhantomData,
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

impl<M> CircuitBreakerLayer<M> {
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

    /// Refusals of gRPC requests become synthesised Trailers-Only `UNAVAILABLE` (14)
    /// responses with `do-not-retry: 1`, so tonic's generated clients report the right
    /// code. Needs a response body with `Default`, such as `tonic::body::Body`.
    pub fn grpc_statuses(self) -> CircuitBreakerLayer<AsGrpcStatus> {
        CircuitBreakerLayer {
            config: self.config,
            _local: PhantomData,
        }
    }
}

impl<M> Clone for CircuitBreakerLayer<M> {
    fn clone(&self) -> Self {
        CircuitBreakerLayer {
            config: self.config.clone(),
            _local: PhantomData,
        }
    }
}

impl<S, M> Layer<S> for CircuitBreakerLayer<M> {
    type Service = CircuitBreakerService<S, M>;

    fn layer(&self, inner: S) -> Self::Service {
        CircuitBreakerService::from_config(inner, self.config.clone())
    }
}

impl<M> fmt::Debug for CircuitBreakerLayer<M> {
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
