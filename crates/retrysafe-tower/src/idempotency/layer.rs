use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, Method, Response};
use retrysafe_core::ConfigError;
use retrysafe_core::idempotency::{CommitPoint, Fingerprinter, HeaderFilter, Scope};
use retrysafe_core::store::{BoxStore, IdempotencyStore};
use retrysafe_core::wire::Convention;
use tokio::sync::Semaphore;
use tokio_util::task::TaskTracker;
use tower_layer::Layer;

use super::MemoryStore;
use super::event::{EventHook, IdempotencyEvent, ReconcileHook, UnknownOutcome};
use super::problem::{Problem, Responder};
use super::service::Idempotency;

/// How a copy that finds its key in flight is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InFlight {
    /// 409 with this `retry-after`.
    Conflict { retry_after: Duration },
    /// Wait up to `max` for the holder, then replay (or 409 with `retry_after`).
    Wait {
        max: Duration,
        retry_after: Duration,
    },
}

/// A user's rule from request head to scope.
pub(crate) type ScopeFn = Arc<dyn Fn(&Parts) -> Option<Scope> + Send + Sync>;

#[derive(Clone)]
pub(crate) enum ScopeRule {
    Principal,
    Global,
    AuthorizationHash,
    Custom(ScopeFn),
}

impl fmt::Debug for ScopeRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScopeRule::Principal => "Principal",
            ScopeRule::Global => "Global",
            ScopeRule::AuthorizationHash => "AuthorizationHash",
            ScopeRule::Custom(_) => "Custom",
        })
    }
}

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: BoxStore,
    pub(crate) convention: Convention,
    pub(crate) methods: Vec<Method>,
    pub(crate) guard_grpc: bool,
    pub(crate) require_key: bool,
    pub(crate) scope: ScopeRule,
    pub(crate) fingerprinter: Fingerprinter,
    pub(crate) header_filter: HeaderFilter,
    pub(crate) max_request_body: usize,
    pub(crate) max_stored_response: usize,
    pub(crate) retention: Duration,
    pub(crate) lease: Duration,
    pub(crate) max_execution: Duration,
    pub(crate) in_flight: InFlight,
    pub(crate) store_timeout: Duration,
    pub(crate) unavailable_retry_after: Duration,
    pub(crate) fail_open: bool,
    pub(crate) commit_point: CommitPoint,
    pub(crate) responder: Option<Responder>,
    pub(crate) on_event: Option<EventHook>,
    pub(crate) on_outcome_unknown: Option<ReconcileHook>,
}

/// Runtime state shared by every clone of a layer and its services.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) permits: Arc<Semaphore>,
    pub(crate) tracker: TaskTracker,
    pub(crate) scope_warned: AtomicBool,
}

/// Applies [`Idempotency`] to a service: makes POST and PATCH safe to retry by
/// `Idempotency-Key`. See the [module docs](super) for the full behaviour.
///
/// Builder methods take and return the layer; those whose value can be invalid return
/// `Result<Self, ConfigError>`.
#[derive(Clone)]
#[must_use]
pub struct IdempotencyLayer {
    pub(crate) config: Arc<Config>,
    pub(crate) shared: Arc<Shared>,
}

/// A handle to drain the work a layer spawned, on graceful shutdown.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use retrysafe_tower::idempotency::IdempotencyLayer;
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

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    /// A handle of its own, tracking nothing yet: for an idempotency layer of another
    /// crate (the transactional layer of `retrysafe-postgres`) that runs its guarded
    /// calls through [`spawn`](Self::spawn).
    pub fn new() -> Self {
        Shutdown {
            tracker: TaskTracker::new(),
        }
    }

    /// Spawns `task` on the current tokio runtime as one guarded call, tracked by this
    /// handle (and every clone of it).
    pub fn spawn<F>(&self, task: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(task)
    }

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

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("IdempotencyLayer")
            .field("store", &c.store)
            .field("methods", &c.methods)
            .field("require_key", &c.require_key)
            .field("scope", &c.scope)
            .field("retention", &c.retention)
            .field("lease", &c.lease)
            .field("max_execution", &c.max_execution)
            .field("in_flight", &c.in_flight)
            .field("fail_open", &c.fail_open)
            .finish_non_exhaustive()
    }
}

const DEFAULT_MAX_IN_FLIGHT: usize = 1024;
const MIB: usize = 1024 * 1024;

/// The longest lease, execution, wait or store timeout accepted (30 days): larger
/// values are configuration mistakes, and refusing them keeps every deadline
/// arithmetic in range.
const MAX_SPAN: Duration = retrysafe_core::wire::MAX_TIMEOUT;
/// The longest retention accepted (366 days).
const MAX_RETENTION: Duration = Duration::from_secs(366 * 24 * 60 * 60);
/// The largest body limit accepted (1 GiB): record lengths are 32-bit.
const MAX_BODY_LIMIT: usize = 1 << 30;

fn positive(d: Duration, field: &'static str) -> Result<Duration, ConfigError> {
    within(d, field, MAX_SPAN)
}

fn within(d: Duration, field: &'static str, max: Duration) -> Result<Duration, ConfigError> {
    if d.is_zero() {
        Err(ConfigError::new(field, "must be greater than zero"))
    } else if d > max {
        Err(ConfigError::new(field, "is too large"))
    } else {
        Ok(d)
    }
}

impl IdempotencyLayer {
    /// A layer over `store`, with the defaults: POST and PATCH guarded, key optional,
    /// scope from the [`Principal`](retrysafe_core::idempotency::Principal) extension,
    /// fingerprint over method, path, query, `content-type` and body, 1 MiB request and
    /// stored-response limits, 24 h retention, 10 s lease renewed every third up to 60 s
    /// of execution, 409 with `retry-after: 1` for in-flight copies, 1 s store timeout,
    /// fail closed, 1024 guarded requests in flight.
    pub fn new(store: impl IdempotencyStore) -> Self {
        Self::with_store(BoxStore::new(store))
    }

    /// A layer over a fresh [`MemoryStore`] with its defaults.
    pub fn in_memory() -> Self {
        Self::new(MemoryStore::new())
    }

    /// A layer over an already shared store.
    pub fn with_store(store: BoxStore) -> Self {
        IdempotencyLayer {
            config: Arc::new(Config {
                store,
                convention: Convention::default(),
                methods: vec![Method::POST, Method::PATCH],
                guard_grpc: false,
                require_key: false,
                scope: ScopeRule::Principal,
                fingerprinter: Fingerprinter::default(),
                header_filter: HeaderFilter::default(),
                max_request_body: MIB,
                max_stored_response: MIB,
                retention: Duration::from_secs(24 * 60 * 60),
                lease: Duration::from_secs(10),
                max_execution: Duration::from_secs(60),
                in_flight: InFlight::Conflict {
                    retry_after: Duration::from_secs(1),
                },
                store_timeout: Duration::from_secs(1),
                unavailable_retry_after: Duration::from_secs(1),
                fail_open: false,
                commit_point: CommitPoint::Undeclared,
                responder: None,
                on_event: None,
                on_outcome_unknown: None,
            }),
            shared: Arc::new(Shared {
                permits: Arc::new(Semaphore::new(DEFAULT_MAX_IN_FLIGHT)),
                tracker: TaskTracker::new(),
                scope_warned: AtomicBool::new(false),
            }),
        }
    }

    fn config(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// The methods that are guarded (default POST and PATCH). Other methods pass
    /// untouched.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.config(|c| c.methods = methods)
    }

    /// Also guards gRPC requests (`content-type: application/grpc*`), which pass
    /// untouched by default.
    pub fn guard_grpc(self) -> Self {
        self.config(|c| c.guard_grpc = true)
    }

    /// Requires an `Idempotency-Key` on guarded methods: a request without one gets a
    /// 400 `key-missing` problem.
    pub fn require_key(self) -> Self {
        self.config(|c| c.require_key = true)
    }

    /// Derives the scope with `f` instead of from the `Principal` extension. `None`
    /// refuses to guard (500 `scope-missing`).
    pub fn scope_by<F>(self, f: F) -> Self
    where
        F: Fn(&Parts) -> Option<Scope> + Send + Sync + 'static,
    {
        self.config(|c| c.scope = ScopeRule::Custom(Arc::new(f)))
    }

    /// One scope for every request: keys of all callers share one namespace. Only for
    /// services with a single trusted caller.
    pub fn global_scope(self) -> Self {
        self.config(|c| c.scope = ScopeRule::Global)
    }

    /// Scope by a hash of the `Authorization` header (a request without one is refused
    /// with `scope-missing`). **Unsafe with rotating or signed credentials** (SigV4,
    /// refreshed OAuth tokens): a retry that carries a new credential lands in a new
    /// scope and runs again.
    pub fn scope_by_authorization_hash(self) -> Self {
        self.config(|c| c.scope = ScopeRule::AuthorizationHash)
    }

    /// The headers that are part of the fingerprint (default `content-type`).
    pub fn fingerprint_headers(self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        let f = Fingerprinter::with_headers(headers);
        self.config(|c| c.fingerprinter = f)
    }

    /// Never stores or replays this response header (in addition to the built-in list).
    pub fn deny_header(self, name: HeaderName) -> Self {
        self.config(|c| c.header_filter = c.header_filter.clone().deny(name))
    }

    /// The largest request body accepted on guarded requests (default 1 MiB); larger
    /// ones get 413 before any claim.
    pub fn max_request_body(self, bytes: usize) -> Result<Self, ConfigError> {
        if bytes == 0 || bytes > MAX_BODY_LIMIT {
            return Err(ConfigError::new(
                "max_request_body",
                "must be between 1 byte and 1 GiB",
            ));
        }
        Ok(self.config(|c| c.max_request_body = bytes))
    }

    /// The largest response body stored (default 1 MiB). A larger response is recorded
    /// as not replayable before the rest streams to the client; later copies get 409
    /// `response-not-stored`.
    pub fn max_stored_response(self, bytes: usize) -> Result<Self, ConfigError> {
        if bytes > MAX_BODY_LIMIT {
            return Err(ConfigError::new(
                "max_stored_response",
                "must be at most 1 GiB",
            ));
        }
        Ok(self.config(|c| c.max_stored_response = bytes))
    }

    /// How long completed and `outcome_unknown` records are kept (default 24 h, at most
    /// 366 days).
    pub fn retention(self, retention: Duration) -> Result<Self, ConfigError> {
        let r = within(retention, "retention", MAX_RETENTION)?;
        Ok(self.config(|c| c.retention = r))
    }

    /// The lease of a claim (default 10 s), renewed every third of it while the handler
    /// runs.
    pub fn lease(self, lease: Duration) -> Result<Self, ConfigError> {
        let l = positive(lease, "lease")?;
        if l < Duration::from_millis(3) {
            return Err(ConfigError::new("lease", "must be at least 3 ms"));
        }
        Ok(self.config(|c| c.lease = l))
    }

    /// The longest a handler's lease is renewed (default 60 s); a handler still running
    /// then loses its lease.
    pub fn max_execution(self, max: Duration) -> Result<Self, ConfigError> {
        let m = positive(max, "max_execution")?;
        Ok(self.config(|c| c.max_execution = m))
    }

    /// The `retry-after` of a 409 `request-in-flight` answer (default 1 s).
    pub fn in_flight_retry_after(self, hint: Duration) -> Self {
        self.config(|c| match &mut c.in_flight {
            InFlight::Conflict { retry_after } | InFlight::Wait { retry_after, .. } => {
                *retry_after = hint;
            }
        })
    }

    /// Copies that find their key in flight wait up to `max` for the holder and get
    /// its replay (after `max`, 409). Waiters whose holder released race to claim.
    pub fn wait_for_in_flight(self, max: Duration) -> Result<Self, ConfigError> {
        let max = positive(max, "wait_for_in_flight")?;
        Ok(self.config(|c| {
            let retry_after = match c.in_flight {
                InFlight::Conflict { retry_after } | InFlight::Wait { retry_after, .. } => {
                    retry_after
                }
            };
            c.in_flight = InFlight::Wait { max, retry_after };
        }))
    }

    /// The timeout of one store call without a request deadline (default 1 s); with a
    /// [`Deadline`](retrysafe_core::Deadline) extension, the sooner of the two.
    pub fn store_timeout(self, timeout: Duration) -> Result<Self, ConfigError> {
        let t = positive(timeout, "store_timeout")?;
        Ok(self.config(|c| c.store_timeout = t))
    }

    /// Runs the handler unguarded (and logs) when the store fails, instead of the
    /// default 503 `store-unavailable`.
    pub fn fail_open(self) -> Self {
        self.config(|c| c.fail_open = true)
    }

    /// The bound of guarded requests in flight (default 1024); past it, 503 `overloaded`.
    pub fn max_in_flight(mut self, n: usize) -> Result<Self, ConfigError> {
        if n == 0 || n > Semaphore::MAX_PERMITS {
            return Err(ConfigError::new(
                "max_in_flight",
                "must be between 1 and Semaphore::MAX_PERMITS",
            ));
        }
        self.shared = Arc::new(Shared {
            permits: Arc::new(Semaphore::new(n)),
            tracker: self.shared.tracker.clone(),
            scope_warned: AtomicBool::new(false),
        });
        Ok(self)
    }

    /// Declares that the handlers behind this layer call
    /// [`IdempotencyContext::commit_point`](retrysafe_core::idempotency::IdempotencyContext::commit_point)
    /// just before their effect. Until they do, a holder whose lease expires (it died or
    /// stalled) is taken over by the next copy, which runs the handler; without this
    /// declaration an expired lease always becomes `outcome_unknown`.
    pub fn handlers_declare_commit_point(self) -> Self {
        self.config(|c| c.commit_point = CommitPoint::Before)
    }

    /// The header names in use (default [`Convention::default`]).
    pub fn convention(self, convention: Convention) -> Self {
        self.config(|c| c.convention = convention)
    }

    /// Replaces the problem responses. The layer still adds `do-not-retry`,
    /// `retry-after` and the [`Problem`] extension where a case requires them.
    pub fn problem_responder<F>(self, f: F) -> Self
    where
        F: Fn(&Problem) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.config(|c| c.responder = Some(Arc::new(f)))
    }

    /// Calls `f` on every event (claimed, replayed, conflict, …).
    pub fn on_event<F>(self, f: F) -> Self
    where
        F: Fn(&IdempotencyEvent) + Send + Sync + 'static,
    {
        self.config(|c| c.on_event = Some(Arc::new(f)))
    }

    /// The reconcile hook: called once for every record that becomes
    /// `outcome_unknown`, so the application can find out what happened.
    pub fn on_outcome_unknown<F>(self, f: F) -> Self
    where
        F: Fn(&UnknownOutcome) + Send + Sync + 'static,
    {
        self.config(|c| c.on_outcome_unknown = Some(Arc::new(f)))
    }

    /// A handle to drain the spawned work on graceful shutdown.
    pub fn shutdown_handle(&self) -> Shutdown {
        Shutdown {
            tracker: self.shared.tracker.clone(),
        }
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.clone())
    }
}
