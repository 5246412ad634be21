use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, Method, Response};
use retrysafe_core::__private::handles::Lazy;
use retrysafe_core::ConfigError;
use retrysafe_core::idempotency::{CommitPoint, Fingerprinter, Scope};
use retrysafe_core::observe::Name;
use retrysafe_core::store::{BoxStore, IdempotencyStore};
use retrysafe_core::wire::Convention;
use tokio::sync::Semaphore;
use tokio_util::task::TaskTracker;
use tower_layer::Layer;

use super::MemoryStore;
use super::backend::{Backend, StoreBackend};
use super::event::{IdempotencyEvent, UnknownOutcome};
use super::problem::Problem;
use super::rules::ScopeRule;
use super::service::IdempotencyService;
use super::shared::{Config, InFlight, Shared};

/// Applies [`IdempotencyService`] to a service: makes POST and PATCH safe to retry by
/// `Idempotency-Key`. See the [module docs](super) for the full behaviour.
///
/// Builder methods take and return the layer and never fail; [`build`](Self::build)
/// validates them once and names every refused setting. The methods of
/// `IdempotencyLayer<X>` set the rules, the answers and the telemetry whatever the
/// [`Backend`] `X`; those of `IdempotencyLayer` (over the default [`StoreBackend`]) set
/// the store protocol. The transactional layer of `retrysafe-postgres` is this layer
/// over its own backend, made with [`with_backend`](Self::with_backend).
#[must_use]
pub struct IdempotencyLayer<X = StoreBackend> {
    pub(crate) shared: Shared,
    pub(crate) backend: Arc<X>,
}

// By hand: a derive would require `X: Clone`, and the backend is shared, not cloned.
impl<X> Clone for IdempotencyLayer<X> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            shared: self.shared.clone(),
            backend: Arc::clone(&self.backend),
        }
    }
}

impl<X: fmt::Debug> fmt::Debug for IdempotencyLayer<X> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("shared", &self.shared)
            .field("backend", &self.backend)
            .finish()
    }
}

/// A handle to drain the work a layer spawned, on graceful shutdown.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use retrysafe::idempotency::IdempotencyLayer;
/// let layer = IdempotencyLayer::in_memory();
/// let shutdown = layer.shutdown_handle();
/// assert_eq!(shutdown.in_flight(), 0);
/// shutdown.drain().await; // returns once every guarded call has finished
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Shutdown {
    tracker: TaskTracker,
}

impl Shutdown {
    /// Guarded calls still running (their handlers run to completion even when their
    /// clients are gone).
    pub fn in_flight(&self) -> usize {
        self.tracker.len()
    }

    /// Waits for every guarded call to finish. New requests are still served; call it
    /// after the server stopped accepting connections.
    pub async fn drain(self) {
        self.tracker.close();
        self.tracker.wait().await;
        self.tracker.reopen();
    }
}

/// The longest lease, execution, wait or store timeout accepted (30 days): larger
/// values are configuration mistakes, and refusing them keeps every deadline
/// arithmetic in range.
const MAX_SPAN: Duration = retrysafe_core::wire::MAX_TIMEOUT;
/// The longest retention accepted (366 days).
const MAX_RETENTION: Duration = Duration::from_secs(366 * 24 * 60 * 60);
/// The largest body limit accepted (1 GiB): record lengths are 32-bit.
const MAX_BODY_LIMIT: usize = 1 << 30;

/// `d`, unless it is zero or over 30 days.
fn positive(d: Duration, field: &'static str) -> Result<Duration, ConfigError> {
    duration_setting(d, field, MAX_SPAN)
}

/// A duration setting named `field`, validated as the layers validate theirs: greater
/// than zero and at most `max`.
pub fn duration_setting(
    value: Duration,
    field: &'static str,
    max: Duration,
) -> Result<Duration, ConfigError> {
    if value.is_zero() {
        Err(ConfigError::new(field, "must be greater than zero"))
    } else if value > max {
        Err(ConfigError::new(field, "is too large"))
    } else {
        Ok(value)
    }
}

impl IdempotencyLayer {
    /// A layer over `store`, with the defaults: POST and PATCH guarded, key optional,
    /// scope from the [`Principal`](retrysafe_core::idempotency::Principal) extension,
    /// fingerprint over method, path, query, `content-type` and body, 1 MiB request and
    /// stored-response limits, 24 h retention, 5 s lease renewed every third up to 10 s
    /// of execution, 409 with `retry-after: 1` for in-flight copies, 1 s store timeout,
    /// fail closed, 1024 guarded requests in flight. The timing defaults compose with
    /// the reconciler's and the default client's: see
    /// [`defaults`](retrysafe_core::idempotency::defaults).
    pub fn new(store: impl IdempotencyStore) -> Self {
        Self::with_backend(StoreBackend::new(BoxStore::new(store)))
    }

    /// A layer over a fresh [`MemoryStore`] with its defaults.
    pub fn in_memory() -> Self {
        Self::new(MemoryStore::new())
    }

    fn store_config(mut self, f: impl FnOnce(&mut StoreBackend)) -> Self {
        f(Arc::make_mut(&mut self.backend));
        self
    }

    /// The lease of a claim (default 5 s), renewed every third of it while the handler
    /// runs. It must be longer than three [`store_timeout`](Self::store_timeout)s
    /// (checked by [`build`](Self::build)), so that a renewal that takes its whole
    /// timeout still lands within the lease; with a short lease, lower the store
    /// timeout too.
    pub fn lease(mut self, lease: Duration) -> Self {
        let checked = positive(lease, "lease").and_then(|l| {
            if l < Duration::from_millis(3) {
                Err(ConfigError::new("lease", "must be at least 3 ms"))
            } else {
                Ok(l)
            }
        });
        match self.checked(checked) {
            Some(l) => self.store_config(|c| c.lease = l),
            None => self,
        }
    }

    /// The longest a handler's lease is renewed (default 10 s, the default client's
    /// per-attempt timeout); a handler still running then is cancelled. Set a
    /// reconciler's `max_execution` to the same value.
    pub fn max_execution(mut self, max: Duration) -> Self {
        match self.checked(positive(max, "max_execution")) {
            Some(m) => self.store_config(|c| c.max_execution = m),
            None => self,
        }
    }

    /// The timeout of one store call without a request deadline (default 1 s); with a
    /// [`Deadline`](retrysafe_core::Deadline) extension, the sooner of the two. Three
    /// of them must fit within the [`lease`](Self::lease).
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        match self.checked(positive(timeout, "store_timeout")) {
            Some(t) => self.store_config(|c| c.store_timeout = t),
            None => self,
        }
    }

    /// Runs the handler unguarded (and logs) when the store fails, instead of the
    /// default 503 `store-unavailable`.
    pub fn fail_open(self) -> Self {
        self.store_config(|c| c.fail_open = true)
    }

    /// Declares that the handlers behind this layer call
    /// [`IdempotencyContext::commit_point`](retrysafe_core::idempotency::IdempotencyContext::commit_point)
    /// just before their effect. Until they do, a holder whose lease expires (it died or
    /// stalled) is taken over by the next copy, which runs the handler; without this
    /// declaration an expired lease always becomes `outcome_unknown`.
    pub fn handlers_declare_commit_point(self) -> Self {
        self.store_config(|c| c.commit_point = CommitPoint::Before)
    }

    /// The reconcile hook: called for every record this layer makes `outcome_unknown`
    /// (a claim finding an expired lease past its commit point included), so the
    /// application can find out what happened. After it returns, the record is marked
    /// *notified* in the store (in the background), so a reconciler with the same hook
    /// does not tell it again; a crash in between means it is told twice: hooks are
    /// idempotent on the record id. Records made unknown elsewhere (a store's sweep)
    /// reach the hook of a [`Reconciler`](retrysafe_core::recovery::Reconciler).
    pub fn on_outcome_unknown<F>(self, f: F) -> Self
    where
        F: Fn(&UnknownOutcome) + Send + Sync + 'static,
    {
        self.store_config(|c| c.on_outcome_unknown = Some(Arc::new(f)))
    }

    /// Keep the raw idempotency key beside each pending record (off by default: stores
    /// hold hashes, not keys), so that a
    /// [`Resolver`](retrysafe_core::recovery::Resolver) can look the effect up in the
    /// downstream by (scope, key). Only while the record is pending (in progress or
    /// unknown); a completed record keeps no key.
    pub fn store_keys_for_resolution(self) -> Self {
        self.store_config(|c| c.store_keys = true)
    }

    /// Declares that a [`Reconciler`](retrysafe_core::recovery::Reconciler) runs for
    /// this layer's store in another process (a worker of its own, another app server):
    /// copies of a pending record (an unknown outcome, or a record being resolved) are
    /// then told to come back, 503 `outcome-pending` with `retry-after`, rather than 500
    /// `outcome-unknown` with `do-not-retry`. A reconciler spawned in this process over
    /// the same store counts without it. Declare it only where one does run: without a
    /// reconciler, clients would come back until the record's retention ends.
    pub fn reconciled_elsewhere(self) -> Self {
        self.store_config(|c| c.reconciled_elsewhere = true)
    }
}

impl<X: Backend> IdempotencyLayer<X> {
    /// A layer that runs its guarded requests with `backend` (see
    /// [`backend`](super::backend)), with the defaults of the rules: POST and PATCH
    /// guarded, key optional, scope from the
    /// [`Principal`](retrysafe_core::idempotency::Principal) extension, fingerprint over
    /// method, path, query, `content-type` and body, 1 MiB request and stored-response
    /// limits, 24 h retention, 409 with `retry-after: 1` for in-flight copies, 1024
    /// guarded requests in flight.
    pub fn with_backend(backend: X) -> Self {
        IdempotencyLayer {
            shared: Shared::new(X::ROLLS_BACK),
            backend: Arc::new(backend),
        }
    }
}

impl<X: Backend> IdempotencyLayer<X> {
    /// Validates the layer: every setting refused by a setter (the layer's and its
    /// backend's) is named in the error. A refused setting keeps its default, so a
    /// layer used without `build` is still safe, but `build` is where mistakes show.
    ///
    /// It also resolves the layer's metric handles (feature `metrics`) in the recorder
    /// installed then; a layer used without `build` resolves them when it first makes
    /// its service (`Layer::layer`), so install the recorder before either.
    ///
    /// ```
    /// use std::time::Duration;
    /// use retrysafe::idempotency::IdempotencyLayer;
    ///
    /// let error = IdempotencyLayer::in_memory()
    ///     .lease(Duration::ZERO)
    ///     .retention(Duration::from_secs(400 * 24 * 3600))
    ///     .build()
    ///     .unwrap_err();
    /// assert_eq!(error.fields().collect::<Vec<_>>(), ["lease", "retention"]);
    /// assert!(IdempotencyLayer::in_memory().require_key().build().is_ok());
    /// ```
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut checks = self.shared.config.checks.clone();
        if let Some(e) = self.backend.refused() {
            checks.refuse(e.clone());
        }
        if let Some(e) = self.backend.conflicts() {
            checks.refuse(e);
        }
        let rules = self.shared.rules();
        let per_attempt = rules.per_attempt_headers();
        checks.check(
            !rules
                .fingerprinter
                .headers()
                .iter()
                .any(|h| per_attempt.contains(&h)),
            "fingerprint_headers",
            "must not name the idempotency key or a header that changes between attempts \
             of one request (retry-attempt, grpc-previous-rpc-attempts, request-timeout-ms, \
             grpc-timeout, retry-point)",
        );
        let bound = self.shared.in_flight.slots.bound();
        let share = rules.max_in_flight_per_scope;
        checks.check(
            share.is_none_or(|n| n <= bound),
            "max_in_flight_per_scope",
            "must be at most max_in_flight",
        );
        let layer = checks.finish(self)?;
        layer.shared.telemetry().metrics();
        Ok(layer)
    }
}

impl<X> IdempotencyLayer<X> {
    fn config(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.shared.config));
        self
    }

    fn rules(self, f: impl FnOnce(&mut super::rules::Rules)) -> Self {
        self.config(|c| f(&mut c.rules))
    }

    /// Records the refusal of a setting unless `ok`; returns `ok`.
    fn check(&mut self, ok: bool, field: &'static str, reason: &'static str) -> bool {
        if !ok {
            Arc::make_mut(&mut self.shared.config)
                .checks
                .refuse(ConfigError::new(field, reason));
        }
        ok
    }

    /// The value of a checked setting, or `None` with its refusal recorded.
    fn checked<T>(&mut self, checked: Result<T, ConfigError>) -> Option<T> {
        Arc::make_mut(&mut self.shared.config).checks.take(checked)
    }

    /// The backend that runs the guarded requests.
    #[doc(hidden)]
    pub fn backend(&self) -> &X {
        &self.backend
    }

    /// The methods that are guarded (default POST and PATCH). Other methods pass
    /// untouched.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.rules(|r| r.methods = methods)
    }

    /// Also guards gRPC requests (`content-type: application/grpc*`), which pass
    /// untouched by default.
    pub fn guard_grpc(self) -> Self {
        self.rules(|r| r.guard_grpc = true)
    }

    /// Requires an `Idempotency-Key` on guarded methods: a request without one gets a
    /// 400 `key-missing` problem. (Without it, such a request is not deduplicated: it
    /// passes untouched, or, with the transactional layer of `retrysafe-postgres`, runs
    /// in a transaction of its own, with no key row.)
    pub fn require_key(self) -> Self {
        self.rules(|r| r.require_key = true)
    }

    /// Derives the scope with `f` instead of from the `Principal` extension. `None`
    /// refuses to guard (500 `scope-missing`).
    pub fn scope_by<F>(self, f: F) -> Self
    where
        F: Fn(&Parts) -> Option<Scope> + Send + Sync + 'static,
    {
        self.rules(|r| r.scope = ScopeRule::Custom(Arc::new(f)))
    }

    /// One scope for every request: keys of all callers share one namespace. Only for
    /// services with a single trusted caller.
    pub fn global_scope(self) -> Self {
        self.rules(|r| r.scope = ScopeRule::Global)
    }

    /// Scope by a hash of the `Authorization` header (a request without one is refused
    /// with `scope-missing`). **Unsafe with rotating or signed credentials** (SigV4,
    /// refreshed OAuth tokens): a retry that carries a new credential lands in a new
    /// scope and runs again.
    pub fn scope_by_authorization_hash(self) -> Self {
        self.rules(|r| r.scope = ScopeRule::AuthorizationHash)
    }

    /// The headers that are part of the fingerprint (default `content-type`).
    ///
    /// The idempotency key and the convention's per-attempt headers (`retry-attempt`,
    /// `grpc-previous-rpc-attempts`, `request-timeout-ms`, `grpc-timeout`,
    /// `retry-point`) are never part of "the same request": [`build`](Self::build)
    /// refuses them here.
    pub fn fingerprint_headers(self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        let f = Fingerprinter::with_headers(headers);
        self.rules(|r| r.fingerprinter = f)
    }

    /// Never stores or replays this response header (in addition to the built-in list).
    pub fn deny_header(self, name: HeaderName) -> Self {
        self.config(|c| c.answers.header_filter = c.answers.header_filter.clone().deny(name))
    }

    /// The largest request body accepted on guarded requests with a key (default
    /// 1 MiB); larger ones get 413 before any claim (or database connection).
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        let ok = bytes > 0 && bytes <= MAX_BODY_LIMIT;
        if self.check(ok, "max_request_body", "must be between 1 byte and 1 GiB") {
            self = self.rules(|r| r.max_request_body = bytes);
        }
        self
    }

    /// How long the body of a guarded request with a key may take to arrive (default
    /// 30 s; with a [`Deadline`](retrysafe_core::Deadline) extension, the sooner of the
    /// two). The request holds one of the [`max_in_flight`](Self::max_in_flight) slots
    /// while its body is read (so that the bound also caps the memory of buffered
    /// bodies); past this time it gets a 408 `body-timeout` problem, before any claim,
    /// and its slot is freed, so clients that trickle their bodies cannot hold every
    /// slot.
    pub fn request_body_timeout(mut self, timeout: Duration) -> Self {
        match self.checked(positive(timeout, "request_body_timeout")) {
            Some(t) => self.rules(|r| r.request_body_timeout = t),
            None => self,
        }
    }

    /// The largest response body stored (default 1 MiB). A larger response is recorded
    /// as not replayable before the rest streams to the client; later copies get 409
    /// `response-not-stored`.
    pub fn max_stored_response(mut self, bytes: usize) -> Self {
        if self.check(
            bytes <= MAX_BODY_LIMIT,
            "max_stored_response",
            "must be at most 1 GiB",
        ) {
            self = self.config(|c| c.answers.max_stored_response = bytes);
        }
        self
    }

    /// How long completed and `outcome_unknown` records (committed key rows) are kept
    /// (default 24 h, at most 366 days); then the key is new again.
    pub fn retention(mut self, retention: Duration) -> Self {
        match self.checked(duration_setting(retention, "retention", MAX_RETENTION)) {
            Some(retention) => self.rules(|r| r.retention = retention),
            None => self,
        }
    }

    /// The `retry-after` of a 409 `request-in-flight` answer (default 1 s).
    pub fn in_flight_retry_after(self, hint: Duration) -> Self {
        self.rules(|r| r.policy = r.policy.in_flight_retry_after(hint))
    }

    /// Copies that find their key in flight wait up to `max` (bounded by the request's
    /// deadline) for the holder and get its replay (after `max`, 409). Waiters whose
    /// holder released (or rolled back) race to claim.
    pub fn wait_for_in_flight(mut self, max: Duration) -> Self {
        match self.checked(positive(max, "wait_for_in_flight")) {
            Some(max) => self.rules(|r| r.policy = r.policy.wait_for_in_flight(Some(max))),
            None => self,
        }
    }

    /// The bound of guarded requests in flight (default 1024); past it, 503 `overloaded`.
    /// One scope may hold at most its [share](Self::max_in_flight_per_scope) of it (by
    /// default 3/4).
    pub fn max_in_flight(mut self, n: usize) -> Self {
        let ok = n > 0 && n <= Semaphore::MAX_PERMITS;
        if self.check(
            ok,
            "max_in_flight",
            "must be between 1 and Semaphore::MAX_PERMITS",
        ) {
            let tracker = self.shared.in_flight.tracker.clone();
            self.shared.in_flight = Arc::new(InFlight::new(n, tracker));
        }
        self
    }

    /// How many of the [`max_in_flight`](Self::max_in_flight) slots the requests of one
    /// scope may hold at once (default 3/4 of the bound, at least 1: 768 of 1024, 3 of
    /// 4); a request of a scope that holds its share gets the same 503 `overloaded`
    /// with `retry-after` as a full bound, before its body is read, while other scopes
    /// are still served. A slot is held from before the body is read until the work is
    /// done, so a scope that trickles its bodies or runs slow handlers cannot take the
    /// slots of the others. At most `max_in_flight`, which turns the share off.
    ///
    /// Fairness holds between scopes, that is per
    /// [`Principal`](retrysafe_core::idempotency::Principal) (or whatever
    /// [`scope_by`](Self::scope_by) derives): a client that can mint principals (sign up
    /// new accounts at will, or choose what the scope is derived from) gets a share for
    /// each of them; bound such clients before this layer.
    pub fn max_in_flight_per_scope(mut self, n: usize) -> Self {
        if self.check(n > 0, "max_in_flight_per_scope", "must be at least 1") {
            self = self.rules(|r| r.max_in_flight_per_scope = Some(n));
        }
        self
    }

    /// The header names in use (default [`Convention::default`]).
    pub fn convention(self, convention: Convention) -> Self {
        // The rules read the request headers by it, the answers write theirs.
        self.config(|c| {
            c.answers.convention = convention.clone();
            c.rules.convention = convention;
        })
    }

    /// Replaces the problem responses. The layer still adds `do-not-retry`,
    /// `retry-after` and the [`Problem`] extension where a case requires them.
    pub fn problem_responder<F>(self, f: F) -> Self
    where
        F: Fn(&Problem) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.config(|c| c.answers.responder = Some(Arc::new(f)))
    }

    /// The layer's name (default `default`): the `name` of its events, its
    /// `retrysafe.idempotency` spans and its metrics (see
    /// [`retrysafe_core::observe`]). Set it before [`build`](Self::build) or
    /// `Layer::layer`, which resolve the metrics under it; renaming a layer resolves
    /// them afresh.
    pub fn name(self, name: impl Into<Name>) -> Self {
        let name = name.into();
        self.config(|c| {
            c.telemetry.name = name;
            c.telemetry.metrics = Lazy::default();
        })
    }

    /// Calls `f` on every event: each guarded request's decision (claimed, replayed,
    /// conflict, mismatch, takeover, unknown, pending, evicted, not stored, invalid,
    /// unavailable, unguarded — a copy that waited for the holder reports its conflict,
    /// then its own decision), and what became of records (outcome unknown, completion
    /// lost). Events carry the layer's [`name`](Self::name).
    pub fn on_event<F>(self, f: F) -> Self
    where
        F: Fn(&IdempotencyEvent) + Send + Sync + 'static,
    {
        self.config(|c| c.telemetry.on_event = Some(Arc::new(f)))
    }

    /// A handle to drain the spawned work on graceful shutdown.
    pub fn shutdown_handle(&self) -> Shutdown {
        Shutdown {
            tracker: self.shared.in_flight.tracker.clone(),
        }
    }
}

impl<S, X> Layer<S> for IdempotencyLayer<X> {
    type Service = IdempotencyService<S, X>;

    fn layer(&self, inner: S) -> Self::Service {
        self.shared.telemetry().metrics();
        IdempotencyService::new(inner, self.clone())
    }
}
