use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use retrysafe_core::__private::Validate;
use retrysafe_core::__private::handles::{Counter, Lazy};
use retrysafe_core::ConfigError;
use retrysafe_core::classify::{Classifier, DefaultClassifier};
use retrysafe_core::observe::{Name, names};
use retrysafe_core::throttle::{AdaptiveThrottle, ThrottleConfig};
use retrysafe_core::wire::Convention;
use tower_layer::Layer;

use super::AdaptiveThrottleService;

/// Rejects calls locally while the callee refuses many of them; see the
/// [module docs](super).
///
/// Clones of a layer (and every service it makes) share one [`AdaptiveThrottle`]: use
/// one layer per callee (per name). A setter of the window or `K` starts new counts.
#[must_use]
#[derive(Clone)]
pub struct AdaptiveThrottleLayer {
    pub(super) config: Arc<Config>,
}

pub(crate) struct Config {
    pub(super) name: Name,
    pub(super) settings: ThrottleConfig,
    pub(super) throttle: AdaptiveThrottle,
    pub(super) classifier: Arc<dyn Classifier>,
    pub(super) draws: Draws,
    /// `retrysafe_throttle_rejections_total{name}`, resolved when the layer makes its
    /// service.
    pub(super) rejections: Lazy<Counter>,
    pub(super) on_rejection: Option<RejectionHook>,
}

type RejectionHook = Arc<dyn Fn(&ThrottleRejection) + Send + Sync>;

/// A call the throttle refused locally, as the
/// [`on_rejection`](AdaptiveThrottleLayer::on_rejection) hook sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ThrottleRejection {
    /// The layer's name.
    pub name: Name,
    /// The probability of a local rejection when this one was drawn.
    pub probability: f64,
}

impl Config {
    fn rejections(&self) -> &Counter {
        self.rejections
            .get(|| Counter::new(names::THROTTLE_REJECTIONS_TOTAL, &self.name, None))
    }

    /// Counts a local rejection and calls the hook.
    #[cold]
    pub(super) fn rejected(&self) {
        self.rejections().increment();
        if let Some(hook) = &self.on_rejection {
            hook(&ThrottleRejection {
                name: self.name.clone(),
                probability: self.throttle.rejection_probability(),
            });
        }
    }
}

/// Uniform draws in `[0, 1)` from a seeded counter (SplitMix64), lock-free: the same
/// seed and the same order of calls give the same decisions.
pub(super) struct Draws {
    seed: u64,
    next: AtomicU64,
}

impl Draws {
    fn new(seed: u64) -> Self {
        Draws {
            seed,
            next: AtomicU64::new(0),
        }
    }

    /// The next draw.
    pub(super) fn next(&self) -> f64 {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let mut z = self
            .seed
            .wrapping_add(n.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        #[allow(clippy::cast_precision_loss, reason = "53 bits, exactly representable")]
        let draw = (z >> 11) as f64 / (1u64 << 53) as f64;
        draw
    }
}

impl AdaptiveThrottleLayer {
    /// A layer named `default` with a 2-minute window, `K = 2.0`, a random seed, the
    /// [`DefaultClassifier`] and the default [`Convention`].
    pub fn new() -> Self {
        let settings = ThrottleConfig::default();
        AdaptiveThrottleLayer {
            config: Arc::new(Config {
                name: Name::default(),
                rejections: Lazy::default(),
                on_rejection: None,
                settings,
                throttle: AdaptiveThrottle::new(settings),
                classifier: Arc::new(DefaultClassifier::default()),
                draws: Draws::new(rand::random()),
            }),
        }
    }

    fn map(self, f: impl FnOnce(&mut Config)) -> Self {
        let old = &self.config;
        let mut config = Config {
            name: old.name.clone(),
            settings: old.settings,
            throttle: old.throttle.clone(),
            classifier: Arc::clone(&old.classifier),
            draws: Draws::new(old.draws.seed),
            rejections: old.rejections.clone(),
            on_rejection: old.on_rejection.clone(),
        };
        let name = config.name.clone();
        f(&mut config);
        if config.name != name {
            config.rejections = Lazy::default();
        }
        AdaptiveThrottleLayer {
            config: Arc::new(config),
        }
    }

    /// Calls `f` on every call the throttle refuses locally.
    pub fn on_rejection(self, f: impl Fn(&ThrottleRejection) + Send + Sync + 'static) -> Self {
        self.map(|c| c.on_rejection = Some(Arc::new(f)))
    }

    /// The name in events, hooks and metrics (`retrysafe_throttle_rejections_total`,
    /// whose handle is resolved when the layer makes its service; default `default`).
    pub fn name(self, name: impl Into<Name>) -> Self {
        let name = name.into();
        self.map(|c| c.name = name)
    }

    /// The rolling window, from 1 s to 24 h (default 2 min); starts new counts.
    pub fn window(self, window: Duration) -> Self {
        self.map(|c| {
            c.settings = c.settings.with_window(window);
            c.throttle = AdaptiveThrottle::new(c.settings);
        })
    }

    /// `K`, from 1 to 1000 (default 2.0); starts new counts.
    pub fn k(self, k: f64) -> Self {
        self.map(|c| {
            c.settings = c.settings.with_k(k);
            c.throttle = AdaptiveThrottle::new(c.settings);
        })
    }

    /// Shares `throttle` (its window and `K` replace this layer's).
    pub fn throttle_with(self, throttle: AdaptiveThrottle) -> Self {
        self.map(|c| {
            c.settings = *throttle.config();
            c.throttle = throttle;
        })
    }

    /// Seeds the random draws, for reproducible decisions (default: a random seed).
    pub fn seed(self, seed: u64) -> Self {
        self.map(|c| c.draws = Draws::new(seed))
    }

    /// The classifier that tells throttles from accepts (default:
    /// [`DefaultClassifier`]).
    pub fn classifier(self, classifier: impl Classifier) -> Self {
        self.map(|c| c.classifier = Arc::new(classifier))
    }

    /// The header names, read by the default classifier.
    pub fn convention(self, convention: Convention) -> Self {
        self.classifier(DefaultClassifier::new(convention))
    }

    /// Checks the settings: the error names every one out of range (`window`, `k`).
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        if let Err(e) = self.config.settings.build() {
            v.refuse(e);
        }
        v.finish(self)
    }

    /// The shared counts, for observability and tests.
    pub fn throttle(&self) -> &AdaptiveThrottle {
        &self.config.throttle
    }
}

impl Default for AdaptiveThrottleLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Layer<S> for AdaptiveThrottleLayer {
    type Service = AdaptiveThrottleService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        let _ = self.config.rejections();
        AdaptiveThrottleService::new(inner, Arc::clone(&self.config))
    }
}

impl AdaptiveThrottleLayer {
    /// The shared configuration, its metric handle resolved (for a stack that makes
    /// the throttle part of its own service).
    #[cfg(feature = "client")]
    pub(crate) fn resolved(&self) -> Arc<Config> {
        let _ = self.config.rejections();
        Arc::clone(&self.config)
    }
}

impl fmt::Debug for AdaptiveThrottleLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.config, f)
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveThrottleLayer")
            .field("name", &self.name)
            .field("throttle", &self.throttle)
            .field("classifier", &self.classifier)
            .field("seed", &self.draws.seed)
            .finish()
    }
}
