//! One breaker per key (authority, route…) in a bounded map.

use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

use http::request::Parts;
use http::uri::Authority;
use moka::policy::EvictionPolicy;
use moka::sync::Cache;
use retrysafe_core::__private::Validate;
use retrysafe_core::ConfigError;
use retrysafe_core::breaker::{
    BreakerConfig, BreakerMetrics, BreakerRejection, CircuitBreaker, StateChange,
};

/// The default bound of a [`KeyedBreakers`] map.
pub(crate) const DEFAULT_MAX_KEYS: u64 = 1024;
/// The largest bound a [`KeyedBreakers`] map accepts.
const MAX_MAX_KEYS: u64 = 1 << 20;

type KeyFn<K> = Arc<dyn Fn(&Parts) -> K + Send + Sync>;
type KeyedHook<K> = Arc<dyn Fn(&K, StateChange) + Send + Sync>;
type KeyedRejectionHook<K> = Arc<dyn Fn(&K, &BreakerRejection) + Send + Sync>;

/// Picks the breaker of a request (type-erased, so the layer has no key parameter).
pub(crate) trait Select: fmt::Debug + Send + Sync + 'static {
    /// The breaker guarding the request with head `parts`.
    fn select(&self, parts: &Parts) -> CircuitBreaker;
}

/// One [`CircuitBreaker`] per key of a request, in a map bounded to
/// [`max_keys`](Self::max_keys) keys (default 1024), all with one configuration; for
/// [`CircuitBreakerLayer::keyed`](super::CircuitBreakerLayer::keyed).
///
/// A cheap `Clone` handle: clones share the map. The least recently used key is
/// evicted when the map is full (LRU, not moka's frequency-based admission, which
/// could refuse a new key again and again and so never let its breaker count); a key
/// seen again later gets a new, closed breaker. Bound the map above the number of
/// downstreams you expect.
///
/// ```
/// use http::Request;
/// use retrysafe::breaker::{BreakerConfig, State};
/// use retrysafe::breaker::KeyedBreakers;
///
/// let breakers = KeyedBreakers::per_authority(BreakerConfig::default());
/// let (a, _) = Request::get("http://a.example/x").body(()).unwrap().into_parts();
/// let (b, _) = Request::get("http://b.example/y").body(()).unwrap().into_parts();
/// breakers.breaker(&breakers.key_of(&a)).force_open();
/// assert_eq!(breakers.breaker(&breakers.key_of(&a)).state(), State::ForcedOpen);
/// assert_eq!(breakers.breaker(&breakers.key_of(&b)).state(), State::Closed);
/// ```
pub struct KeyedBreakers<K> {
    inner: Arc<Inner<K>>,
}

struct Inner<K> {
    config: BreakerConfig,
    key: KeyFn<K>,
    on_state_change: Option<KeyedHook<K>>,
    on_rejection: Option<KeyedRejectionHook<K>>,
    max_keys: u64,
    cache: Cache<K, CircuitBreaker>,
    /// The map's metrics (named by the configuration; no state gauge), shared by
    /// every key's breaker.
    metrics: Arc<BreakerMetrics>,
}

impl KeyedBreakers<Option<Authority>> {
    /// One breaker per authority (`host:port`) of the request URI, or of its `Host`
    /// header when the URI has none; requests with neither share one breaker (key
    /// `None`). Behind a tonic `Channel`, which adds the origin itself, requests
    /// usually carry no authority: one channel is one downstream anyway.
    pub fn per_authority(config: BreakerConfig) -> Self {
        Self::new(config, |parts: &Parts| {
            parts.uri.authority().cloned().or_else(|| {
                parts
                    .headers
                    .get(http::header::HOST)
                    .and_then(|host| Authority::try_from(host.as_bytes()).ok())
            })
        })
    }
}

impl<K> KeyedBreakers<K>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
{
    /// One breaker per `key(request head)`, each configured by `config` (checked, with
    /// the map's bound, by [`build`](Self::build)). For example, per route:
    /// `KeyedBreakers::new(config, |p| p.uri.path().to_owned())`.
    pub fn new(config: BreakerConfig, key: impl Fn(&Parts) -> K + Send + Sync + 'static) -> Self {
        KeyedBreakers {
            inner: Arc::new(Inner {
                metrics: Arc::new(BreakerMetrics::new(config.name(), false)),
                config,
                key: Arc::new(key),
                on_state_change: None,
                on_rejection: None,
                max_keys: DEFAULT_MAX_KEYS,
                cache: cache(DEFAULT_MAX_KEYS),
            }),
        }
    }

    /// Bounds the map to `max_keys` breakers (default 1024; from 1 to 1 048 576, checked
    /// by [`build`](Self::build); a bound out of range is used as the nearest one).
    /// Returns a new, empty map.
    pub fn max_keys(self, max_keys: u64) -> Self {
        self.rebuild(|inner| inner.max_keys = max_keys)
    }

    /// Checks the settings, the breakers' configuration included: the error names every
    /// one out of range.
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        v.take(self.inner.config.clone().build());
        let max_keys = self.inner.max_keys;
        v.check(max_keys > 0, "max_keys", "must be greater than zero");
        v.check(
            max_keys <= MAX_MAX_KEYS,
            "max_keys",
            "must be at most 1048576",
        );
        v.finish(self)
    }

    /// Calls `f` with the key after every change of state of one of the map's
    /// breakers (after the configuration's own
    /// [`on_state_change`](BreakerConfig::on_state_change), if any). Returns a new,
    /// empty map.
    pub fn on_state_change(self, f: impl Fn(&K, StateChange) + Send + Sync + 'static) -> Self {
        self.rebuild(|inner| inner.on_state_change = Some(Arc::new(f)))
    }

    /// Calls `f` with the key on every call one of the map's breakers refuses (after
    /// the configuration's own [`on_rejection`](BreakerConfig::on_rejection), if any).
    /// Returns a new, empty map.
    pub fn on_rejection(self, f: impl Fn(&K, &BreakerRejection) + Send + Sync + 'static) -> Self {
        self.rebuild(|inner| inner.on_rejection = Some(Arc::new(f)))
    }

    fn rebuild(self, f: impl FnOnce(&mut Inner<K>)) -> Self {
        let old = &self.inner;
        let mut inner = Inner {
            config: old.config.clone(),
            key: old.key.clone(),
            on_state_change: old.on_state_change.clone(),
            on_rejection: old.on_rejection.clone(),
            max_keys: old.max_keys,
            cache: cache(1),
            metrics: old.metrics.clone(),
        };
        f(&mut inner);
        inner.cache = cache(inner.max_keys);
        KeyedBreakers {
            inner: Arc::new(inner),
        }
    }

    /// The key of a request with head `parts`.
    #[doc(hidden)]
    pub fn key_of(&self, parts: &Parts) -> K {
        (self.inner.key)(parts)
    }

    /// The breaker of `key`, made (closed) if the map has none.
    pub fn breaker(&self, key: &K) -> CircuitBreaker {
        let inner = &self.inner;
        inner.cache.get_with_by_ref(key, || inner.make(key))
    }

    /// The breaker of `key`, if the map has one.
    pub fn get(&self, key: &K) -> Option<CircuitBreaker> {
        self.inner.cache.get(key)
    }
}

impl<K> Inner<K>
where
    K: Clone + Send + Sync + 'static,
{
    /// A new breaker for `key`.
    fn make(&self, key: &K) -> CircuitBreaker {
        let mut config = self.config.clone();
        if let Some(hook) = &self.on_state_change {
            let hook = hook.clone();
            let key = key.clone();
            let own = config.on_state_change().cloned();
            config = config.with_on_state_change(move |change| {
                if let Some(own) = &own {
                    own(change.clone());
                }
                hook(&key, change);
            });
        }
        if let Some(hook) = &self.on_rejection {
            let hook = hook.clone();
            let key = key.clone();
            let own = config.on_rejection().cloned();
            config = config.with_on_rejection(move |rejection| {
                if let Some(own) = &own {
                    own(rejection);
                }
                hook(&key, rejection);
            });
        }
        CircuitBreaker::with_metrics(config, self.metrics.clone())
    }
}

fn cache<K, V>(max_keys: u64) -> Cache<K, V>
where
    K: Hash + Eq + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    Cache::builder()
        .max_capacity(max_keys.clamp(1, MAX_MAX_KEYS))
        .eviction_policy(EvictionPolicy::lru())
        .build()
}

impl<K> Clone for KeyedBreakers<K> {
    fn clone(&self) -> Self {
        KeyedBreakers {
            inner: self.inner.clone(),
        }
    }
}

impl<K> fmt::Debug for KeyedBreakers<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedBreakers")
            .field("config", &self.inner.config)
            .field("max_keys", &self.inner.max_keys)
            .finish_non_exhaustive()
    }
}

impl<K> Select for KeyedBreakers<K>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
{
    fn select(&self, parts: &Parts) -> CircuitBreaker {
        self.breaker(&self.key_of(parts))
    }
}
