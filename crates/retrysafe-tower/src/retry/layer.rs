use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use retrysafe_core::ConfigError;
use retrysafe_core::classify::{Classification, Classifier, DefaultClassifier};
use retrysafe_core::strategy::{GiveUp, RetryStrategy, StandardRetryStrategy};
use retrysafe_core::wire::Convention;
use tower_layer::Layer;

use super::Retry;
use crate::local::{AsError, AsGrpcStatus};

/// The default cap of the request-body copy kept for replay: 64 KiB.
pub const DEFAULT_REPLAY_CAP: usize = 64 * 1024;
const MAX_REPLAY_CAP: usize = 1 << 30;

/// A retry about to happen, as the [`on_retry`](RetryLayer::on_retry) hook sees it.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct RetryEvent {
    /// The 1-based number of the attempt about to be made (2 for the first retry).
    pub attempt: u32,
    /// The delay before it.
    pub delay: Duration,
    /// The failed attempt's status, if it got a response.
    pub status: Option<StatusCode>,
    /// The classification of the failed attempt.
    pub classification: Classification,
}

/// The layer giving up on a retryable failure, as the
/// [`on_give_up`](RetryLayer::on_give_up) hook sees it.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct GiveUpEvent {
    /// The attempts made.
    pub attempts: u32,
    /// Why it gave up.
    pub reason: GiveUp,
    /// The last attempt's status, if it got a response.
    pub status: Option<StatusCode>,
}

type Hook<E> = Arc<dyn Fn(&E) + Send + Sync>;
type Predicate = Arc<dyn Fn(&http::request::Parts) -> bool + Send + Sync>;

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) strategy: Arc<dyn RetryStrategy>,
    pub(crate) classifier: Arc<dyn Classifier>,
    pub(crate) convention: Convention,
    pub(crate) replay_cap: usize,
    pub(crate) generate_keys: bool,
    pub(crate) retry_point: bool,
    pub(crate) idempotent_if: Option<Predicate>,
    pub(crate) on_retry: Option<Hook<RetryEvent>>,
    pub(crate) on_give_up: Option<Hook<GiveUpEvent>>,
}

/// Retries failed requests that are safe to retry; see the [module docs](super).
///
/// `M` chooses how failures generated locally are answered: [`AsError`] (the default)
/// or [`AsGrpcStatus`] ([`grpc_statuses`](RetryLayer::grpc_statuses)).
#[must_use]
pub struct RetryLayer<M = AsError> {
    config: Arc<Config>,
    _local: PhantomData<fn() -> M>,
}

impl RetryLayer {
    /// A layer with the [`StandardRetryStrategy`] (3 attempts, full jitter, a ratio
    /// budget of its own, 10 s per attempt and 30 s overall without a deadline), the
    /// [`DefaultClassifier`] and the default [`Convention`].
    pub fn new() -> Self {
        RetryLayer {
            config: Arc::new(Config {
                strategy: Arc::new(StandardRetryStrategy::new()),
                classifier: Arc::new(DefaultClassifier::default()),
                convention: Convention::default(),
                replay_cap: DEFAULT_REPLAY_CAP,
                generate_keys: false,
                retry_point: false,
                idempotent_if: None,
                on_retry: None,
                on_give_up: None,
            }),
            _local: PhantomData,
        }
    }
}

impl Default for RetryLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<M> RetryLayer<M> {
    fn map(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// The retry strategy (attempts, backoff, budget, default timeouts).
    pub fn strategy(self, strategy: impl RetryStrategy) -> Self {
        self.map(|c| c.strategy = Arc::new(strategy))
    }

    /// The classifier (default: [`DefaultClassifier`] over this layer's convention).
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

    /// The cap of the request-body copy kept for replay (default 64 KiB; at most
    /// 1 GiB). A larger body is sent once and not retried.
    pub fn max_replay_body(self, bytes: usize) -> Result<Self, ConfigError> {
        if bytes > MAX_REPLAY_CAP {
            return Err(ConfigError::new("max replay body", "must be at most 1 GiB"));
        }
        Ok(self.map(|c| c.replay_cap = bytes))
    }

    /// Adds an `Idempotency-Key` to POST and PATCH requests that have none, the same
    /// on every attempt, which makes them safe to retry. Declare it only for a
    /// downstream that honours keys (an `IdempotencyLayer`). The key is random (128
    /// bits), or — inside a handler guarded by an `IdempotencyLayer` — the
    /// deterministic child key of the inbound record, labelled by method, authority
    /// and path, so a re-run of the handler repeats the same keys.
    pub fn generate_idempotency_keys(self) -> Self {
        self.map(|c| c.generate_keys = true)
    }

    /// Makes this layer the one retry point of the call chain: every attempt carries
    /// `retry-point: caller`, so the callee does not retry its own outbound calls.
    pub fn retry_point(self) -> Self {
        self.map(|c| c.retry_point = true)
    }

    /// Declares requests safe to repeat when `f` says so, whatever their method (for
    /// example the methods of a read-only gRPC service).
    pub fn idempotent_if(
        self,
        f: impl Fn(&http::request::Parts) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.map(|c| c.idempotent_if = Some(Arc::new(f)))
    }

    /// Called before each retry.
    pub fn on_retry(self, f: impl Fn(&RetryEvent) + Send + Sync + 'static) -> Self {
        self.map(|c| c.on_retry = Some(Arc::new(f)))
    }

    /// Called when the layer gives up on a retryable failure.
    pub fn on_give_up(self, f: impl Fn(&GiveUpEvent) + Send + Sync + 'static) -> Self {
        self.map(|c| c.on_give_up = Some(Arc::new(f)))
    }

    /// Answers local failures of gRPC requests (the deadline running out, a budget or
    /// breaker refusal below this layer) with synthesised Trailers-Only statuses
    /// instead of errors. Needs a response body with `Default`, such as
    /// `tonic::body::Body`.
    pub fn grpc_statuses(self) -> RetryLayer<AsGrpcStatus> {
        RetryLayer {
            config: self.config,
            _local: PhantomData,
        }
    }
}

impl<M> Clone for RetryLayer<M> {
    fn clone(&self) -> Self {
        RetryLayer {
            config: self.config.clone(),
            _local: PhantomData,
        }
    }
}

impl<S, M> Layer<S> for RetryLayer<M> {
    type Service = Retry<S, M>;

    fn layer(&self, inner: S) -> Self::Service {
        Retry::from_config(inner, self.config.clone())
    }
}

impl<M> fmt::Debug for RetryLayer<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLayer")
            .field("config", &self.config)
            .finish()
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("strategy", &self.strategy)
            .field("classifier", &self.classifier)
            .field("replay_cap", &self.replay_cap)
            .field("generate_keys", &self.generate_keys)
            .field("retry_point", &self.retry_point)
            .finish_non_exhaustive()
    }
}
