//! What an operator sees of retrysafe: instance names, the attempt number of each
//! request, and the metrics.
//!
//! Every layer, breaker, budget, store and reconciler takes `.name(…)` (a [`Name`],
//! `default` unless set); its events, hooks, spans and metrics carry it.
//!
//! # Metrics
//!
//! With the cargo feature `metrics`, retrysafe records through the
//! [`metrics`](https://docs.rs/metrics) facade, so any recorder serves them (the
//! Prometheus exporter `metrics-exporter-prometheus`, OpenTelemetry through
//! `metrics-exporter-opentelemetry`, …). Handles are resolved when a layer, store or
//! reconciler is built — for the client layers, and an `IdempotencyLayer` used
//! without `build`, when the layer makes its service (`Layer::layer`), or when a reqwest stack is applied (`ClientMiddlewares::apply`;
//! a middleware added on its own, at its first call): **install the recorder before
//! building them**. Without the feature nothing is recorded and nothing is paid.
//!
//! | Metric | Kind | Labels | What it counts |
//! |---|---|---|---|
//! | `retrysafe_client_attempts_total` | counter | `name`, `outcome` | attempts a client call made (counted when the planner decides on them): `outcome` is `success`, `failure` (a failed response that was retried or given up on), `rejected` (a failed response not to retry: 4xx, `do-not-retry`, a request not safe to repeat), `error` (no response: a transport error, a time-out, a local refusal from below) |
//! | `retrysafe_client_retries_total` | counter | `name`, `reason` | retries decided: `reason` is `pushback` (the server said when: `retry-after`, `grpc-retry-pushback-ms`), else `status` (a retryable response) or `error` (no response) |
//! | `retrysafe_budget_refusals_total` | counter | `name` | withdrawals the budget refused: retries (by a retry layer or a budget layer) and hedges; `name` is the budget's |
//! | `retrysafe_breaker_state` | gauge | `name` | 0 closed (or disabled), 1 half-open, 2 open (or forced open); set when the breaker is made and on every change; not reported by keyed breakers |
//! | `retrysafe_breaker_rejections_total` | counter | `name` | calls an open (or half-open, every probe out) breaker refused; keyed breakers count under their configuration's name |
//! | `retrysafe_deadline_exceeded_total` | counter | `name` | calls of a deadline layer or middleware (or `ClientLayers`) that ended with `DeadlineExceeded` |
//! | `retrysafe_hedges_total` | counter | `name`, `outcome` | hedges: `won` (its answer ended the call), `lost` (sent, and another copy's answer ended the call), `refused` (by the budget: not sent) |
//! | `retrysafe_throttle_rejections_total` | counter | `name` | calls the adaptive throttle refused locally |
//! | `retrysafe_idempotency_requests_total` | counter | `name`, `decision` | guarded requests with a key, by their one (last) decision, as [`Decision::as_str`](crate::idempotency::Decision::as_str): `first`, `takeover` (an expired lease before its commit point), `replay`, `in_flight`, `mismatch`, `unknown` (the record is `outcome_unknown`), `pending` (being resolved), `evicted` (its response was evicted), `not_stored` (too large to store), `invalid` (a bad key, no scope, a body too large or too slow), `unavailable` (the store failed, or a bound was reached), `unguarded` (the store failed and the layer fails open) |
//! | `retrysafe_idempotency_outcome_unknown_total` | counter | `name`, `reason` | records the layer made `outcome_unknown`: `reason` as [`UnknownReason::as_str`](crate::idempotency::UnknownReason::as_str) — `panicked`, `service_error`, `body_error`, `lease_expired`, `cancelled`, `status_408`, `status_500` … `status_511` —, or `other` (another status) |
//! | `retrysafe_idempotency_store_seconds` | histogram | `name`, `op` | store round trips of the layer (each attempt of a retried write): `op` is `claim`, `wait`, `complete`, `release`, `mark_unknown`, `renew` |
//! | `retrysafe_reconciler_resolutions_total` | counter | `name`, `resolution` | records a reconciler adopted, by how it left them: `happened`, `did_not_happen`, `released` (before a commit point), `unknown` (left for a later pass), `error` (a store call failed) |
//! | `retrysafe_reconciler_pending` | gauge | `name` | records due for resolution at the reconciler's last pass (at most its batch) |
//! | `retrysafe_memory_store_bytes` | gauge | `name` | the weighted bytes of the records the `MemoryStore` keeps (tombstones aside), set on every change |
//! | `retrysafe_memory_store_effective_retention_seconds` | gauge | `name` | how far back the `MemoryStore` still remembers every key, set when it forgets keys early (0 until then) |
//! | `retrysafe_outbox_backlog` | gauge | `name` | outbox rows not yet delivered, counted after each pass of the relay |
//!
//! The `name` label is the instance's [`Name`]. Keyed breakers report per key only
//! through their hooks, never as a label (the keys are unbounded).
//!
//! # Tracing
//!
//! Each client call runs in one `retrysafe.call` span (level INFO: one atomic load
//! when disabled) with the fields `name`, `attempts` (the attempts sent so far),
//! `give_up` (why it gave up: [`GiveUp::as_str`](crate::strategy::GiveUp::as_str)),
//! `budget` (`granted`, `refused`), `breaker` (`rejected`) and `deadline`
//! (`exceeded`), recorded as they happen. The attempts are traced by the transport,
//! through [`AttemptNumber`].

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// The name of a layer, breaker, budget, store or reconciler in events, spans and
/// metrics (the `name` label). `default` unless set.
///
/// ```
/// use retrysafe::observe::Name;
///
/// assert_eq!(Name::default().as_str(), "default");
/// assert_eq!(Name::new("payments-api").to_string(), "payments-api");
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Name(Repr);

/// A static name, or a shared one: cloning a name never allocates (events carry it).
#[derive(Clone)]
enum Repr {
    Static(&'static str),
    Shared(Arc<str>),
}

impl Repr {
    fn as_str(&self) -> &str {
        match self {
            Repr::Static(s) => s,
            Repr::Shared(s) => s,
        }
    }
}

impl PartialEq for Repr {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for Repr {}

impl std::hash::Hash for Repr {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl PartialOrd for Repr {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Repr {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl Name {
    /// A name.
    pub fn new(name: impl Into<Cow<'static, str>>) -> Self {
        match name.into() {
            Cow::Borrowed(s) => Name(Repr::Static(s)),
            Cow::Owned(s) => Name(Repr::Shared(s.into())),
        }
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl Default for Name {
    fn default() -> Self {
        Name(Repr::Static("default"))
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&'static str> for Name {
    fn from(name: &'static str) -> Self {
        Name::new(name)
    }
}

impl From<String> for Name {
    fn from(name: String) -> Self {
        Name::new(name)
    }
}

impl From<Cow<'static, str>> for Name {
    fn from(name: Cow<'static, str>) -> Self {
        Name::new(name)
    }
}

/// The 1-based number of the attempt a request is, in its extensions: the client
/// layers (`RetryLayer`, `ClientLayers`, `HedgeLayer`, the reqwest middlewares) put it
/// on every attempt they resend, hedges included, so the transport's own client span
/// can record OpenTelemetry's `http.request.resend_count` (attempt − 1). A request
/// without one is a first attempt: the first is left unmarked (marking it would
/// allocate the extensions of most requests), unless it already carried a number.
///
/// The recipe: make the transport's span *below* the retry — tower-http's
/// `TraceLayer::new_for_http().make_span_with(…)` under the `RetryLayer` or
/// `ClientLayers`, or a reqwest-tracing `ReqwestOtelSpanBackend` in a
/// `TracingMiddleware` added after the `RetryMiddleware` (it reads the middleware
/// `Extensions`) — and record `http.request.resend_count` from this number when it is
/// above zero (the conventions set it on resent requests only). The docs of
/// `retrysafe_tower::retry` and `retrysafe_reqwest::retry` show both, in full. The
/// span of the whole call, `retrysafe.call`, never carries the count. In short:
///
/// ```
/// use retrysafe::observe::AttemptNumber;
///
/// /// The transport's span of one attempt (`extensions`: the request's, or reqwest
/// /// middleware's).
/// fn attempt_span(extensions: &http::Extensions) -> tracing::Span {
///     let span = tracing::info_span!("HTTP", http.request.resend_count = tracing::field::Empty);
///     if let Some(attempt) = AttemptNumber::of(extensions).filter(|a| a.resend_count() > 0) {
///         span.record("http.request.resend_count", attempt.resend_count());
///     }
///     span
/// }
/// # let _ = attempt_span(&http::Extensions::new());
/// ```
///
/// ```
/// use retrysafe::observe::AttemptNumber;
///
/// let mut extensions = http::Extensions::new();
/// assert_eq!(AttemptNumber::of(&extensions), None);
/// extensions.insert(AttemptNumber::new(3));
/// let attempt = AttemptNumber::of(&extensions).unwrap();
/// assert_eq!(attempt.get(), 3);
/// assert_eq!(attempt.resend_count(), 2);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AttemptNumber(u32);

impl AttemptNumber {
    /// Attempt `n` (1 for the first; 0 is taken as 1).
    pub fn new(n: u32) -> Self {
        AttemptNumber(n.max(1))
    }

    /// The attempt's number, from 1.
    pub fn get(self) -> u32 {
        self.0
    }

    /// How many attempts were sent before this one: OpenTelemetry's
    /// `http.request.resend_count`.
    pub fn resend_count(self) -> u32 {
        self.0 - 1
    }

    /// The attempt number in `extensions`, if a client layer put one there.
    pub fn of(extensions: &http::Extensions) -> Option<Self> {
        extensions.get::<AttemptNumber>().copied()
    }
}

/// Metric names, as in the table of the [module docs](self).
pub mod names {
    /// Counter `{name, outcome}`.
    pub const CLIENT_ATTEMPTS_TOTAL: &str = "retrysafe_client_attempts_total";
    /// Counter `{name, reason}`.
    pub const CLIENT_RETRIES_TOTAL: &str = "retrysafe_client_retries_total";
    /// Counter `{name}`.
    pub const BUDGET_REFUSALS_TOTAL: &str = "retrysafe_budget_refusals_total";
    /// Gauge `{name}`: 0 closed, 1 half-open, 2 open.
    pub const BREAKER_STATE: &str = "retrysafe_breaker_state";
    /// Counter `{name}`.
    pub const BREAKER_REJECTIONS_TOTAL: &str = "retrysafe_breaker_rejections_total";
    /// Counter `{name}`.
    pub const DEADLINE_EXCEEDED_TOTAL: &str = "retrysafe_deadline_exceeded_total";
    /// Counter `{name, outcome}`.
    pub const HEDGES_TOTAL: &str = "retrysafe_hedges_total";
    /// Counter `{name}`.
    pub const THROTTLE_REJECTIONS_TOTAL: &str = "retrysafe_throttle_rejections_total";
    /// Counter `{name, decision}`.
    pub const IDEMPOTENCY_REQUESTS_TOTAL: &str = "retrysafe_idempotency_requests_total";
    /// Counter `{name, reason}`.
    pub const IDEMPOTENCY_OUTCOME_UNKNOWN_TOTAL: &str =
        "retrysafe_idempotency_outcome_unknown_total";
    /// Histogram `{name, op}`, seconds.
    pub const IDEMPOTENCY_STORE_SECONDS: &str = "retrysafe_idempotency_store_seconds";
    /// Counter `{name, resolution}`.
    pub const RECONCILER_RESOLUTIONS_TOTAL: &str = "retrysafe_reconciler_resolutions_total";
    /// Gauge `{name}`.
    pub const RECONCILER_PENDING: &str = "retrysafe_reconciler_pending";
    /// Gauge `{name}`, bytes.
    pub const MEMORY_STORE_BYTES: &str = "retrysafe_memory_store_bytes";
    /// Gauge `{name}`, seconds.
    pub const MEMORY_STORE_EFFECTIVE_RETENTION_SECONDS: &str =
        "retrysafe_memory_store_effective_retention_seconds";
    /// Gauge `{name}`.
    pub const OUTBOX_BACKLOG: &str = "retrysafe_outbox_backlog";

    /// Every metric name, for a recorder's descriptions or bucket configuration.
    pub const ALL: [&str; 16] = [
        CLIENT_ATTEMPTS_TOTAL,
        CLIENT_RETRIES_TOTAL,
        BUDGET_REFUSALS_TOTAL,
        BREAKER_STATE,
        BREAKER_REJECTIONS_TOTAL,
        DEADLINE_EXCEEDED_TOTAL,
        HEDGES_TOTAL,
        THROTTLE_REJECTIONS_TOTAL,
        IDEMPOTENCY_REQUESTS_TOTAL,
        IDEMPOTENCY_OUTCOME_UNKNOWN_TOTAL,
        IDEMPOTENCY_STORE_SECONDS,
        RECONCILER_RESOLUTIONS_TOTAL,
        RECONCILER_PENDING,
        MEMORY_STORE_BYTES,
        MEMORY_STORE_EFFECTIVE_RETENTION_SECONDS,
        OUTBOX_BACKLOG,
    ];
}

/// Metric handles for the retrysafe crates, resolved once when an instance is built.
/// Without the feature `metrics` they are empty and every call on them compiles to
/// nothing. Reached by the sibling crates through `__private::handles`.
pub(crate) mod handles {
    use super::Name;

    /// The labels of a handle: `name` first, then at most one more.
    #[cfg(feature = "metrics")]
    fn labels(
        name: &Name,
        extra: Option<(&'static str, &'static str)>,
    ) -> Vec<(&'static str, String)> {
        let mut labels = vec![("name", name.as_str().to_owned())];
        if let Some((key, value)) = extra {
            labels.push((key, value.to_owned()));
        }
        labels
    }

    /// A counter handle.
    #[derive(Clone, Default)]
    pub struct Counter {
        #[cfg(feature = "metrics")]
        inner: Option<metrics::Counter>,
    }

    impl Counter {
        /// Counter `metric{name="…"}`, or with one more label `key="value"`.
        pub fn new(
            metric: &'static str,
            name: &Name,
            extra: Option<(&'static str, &'static str)>,
        ) -> Self {
            #[cfg(feature = "metrics")]
            {
                let labels = labels(name, extra);
                Counter {
                    inner: Some(metrics::counter!(metric, &labels)),
                }
            }
            #[cfg(not(feature = "metrics"))]
            {
                let _ = (metric, name, extra);
                Counter {}
            }
        }

        /// Adds one.
        #[inline]
        pub fn increment(&self) {
            #[cfg(feature = "metrics")]
            if let Some(c) = &self.inner {
                c.increment(1);
            }
        }
    }

    impl std::fmt::Debug for Counter {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Counter")
        }
    }

    /// A gauge handle.
    #[derive(Clone, Default)]
    pub struct Gauge {
        #[cfg(feature = "metrics")]
        inner: Option<metrics::Gauge>,
    }

    impl Gauge {
        /// Gauge `metric{name="…"}`.
        pub fn new(metric: &'static str, name: &Name) -> Self {
            #[cfg(feature = "metrics")]
            {
                let labels = labels(name, None);
                Gauge {
                    inner: Some(metrics::gauge!(metric, &labels)),
                }
            }
            #[cfg(not(feature = "metrics"))]
            {
                let _ = (metric, name);
                Gauge {}
            }
        }

        /// Sets the value.
        #[inline]
        pub fn set(&self, value: f64) {
            #[cfg(feature = "metrics")]
            if let Some(g) = &self.inner {
                g.set(value);
            }
            #[cfg(not(feature = "metrics"))]
            let _ = value;
        }

        /// Whether setting does anything (the feature is on and the handle resolved):
        /// lets a caller skip work that only the gauge needs.
        #[inline]
        pub fn enabled(&self) -> bool {
            #[cfg(feature = "metrics")]
            {
                self.inner.is_some()
            }
            #[cfg(not(feature = "metrics"))]
            {
                false
            }
        }
    }

    impl std::fmt::Debug for Gauge {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Gauge")
        }
    }

    /// A histogram handle.
    #[derive(Clone, Default)]
    pub struct Histogram {
        #[cfg(feature = "metrics")]
        inner: Option<metrics::Histogram>,
    }

    impl Histogram {
        /// Histogram `metric{name="…", key="value"}`.
        pub fn new(
            metric: &'static str,
            name: &Name,
            extra: Option<(&'static str, &'static str)>,
        ) -> Self {
            #[cfg(feature = "metrics")]
            {
                let labels = labels(name, extra);
                Histogram {
                    inner: Some(metrics::histogram!(metric, &labels)),
                }
            }
            #[cfg(not(feature = "metrics"))]
            {
                let _ = (metric, name, extra);
                Histogram {}
            }
        }

        /// Records a value.
        #[inline]
        pub fn record(&self, value: f64) {
            #[cfg(feature = "metrics")]
            if let Some(h) = &self.inner {
                h.record(value);
            }
            #[cfg(not(feature = "metrics"))]
            let _ = value;
        }

        /// Whether recording does anything (the feature is on); lets a caller skip a
        /// clock read that only the histogram needs.
        #[inline]
        pub fn enabled(&self) -> bool {
            #[cfg(feature = "metrics")]
            {
                self.inner.is_some()
            }
            #[cfg(not(feature = "metrics"))]
            {
                false
            }
        }
    }

    impl std::fmt::Debug for Histogram {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Histogram")
        }
    }

    /// Handles made once, on first need or ahead of it ([`Lazy::get`] from a
    /// layer's `Layer::layer`): the builder methods of a layer may still rename it
    /// after its constructor, and handles made by the constructor would leave a series
    /// named `default` behind. Clones share the handles. Without the feature `metrics`,
    /// the empty handles themselves: no state and nothing to check.
    pub struct Lazy<T> {
        #[cfg(feature = "metrics")]
        cell: std::sync::Arc<std::sync::OnceLock<T>>,
        #[cfg(not(feature = "metrics"))]
        empty: T,
    }

    impl<T: Default> Default for Lazy<T> {
        fn default() -> Self {
            Lazy {
                #[cfg(feature = "metrics")]
                cell: std::sync::Arc::default(),
                #[cfg(not(feature = "metrics"))]
                empty: T::default(),
            }
        }
    }

    impl<T: Clone> Clone for Lazy<T> {
        fn clone(&self) -> Self {
            Lazy {
                #[cfg(feature = "metrics")]
                cell: self.cell.clone(),
                #[cfg(not(feature = "metrics"))]
                empty: self.empty.clone(),
            }
        }
    }

    impl<T> Lazy<T> {
        /// The handles, made by `make` the first time (against the recorder installed
        /// then).
        #[inline]
        pub fn get(&self, make: impl FnOnce() -> T) -> &T {
            #[cfg(feature = "metrics")]
            {
                self.cell.get_or_init(make)
            }
            #[cfg(not(feature = "metrics"))]
            {
                let _ = make;
                &self.empty
            }
        }
    }

    impl<T> std::fmt::Debug for Lazy<T> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Lazy")
        }
    }

    /// Whether the crate was built with the feature `metrics`.
    pub const ENABLED: bool = cfg!(feature = "metrics");
}
