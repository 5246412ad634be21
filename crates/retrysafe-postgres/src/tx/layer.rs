use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, Method, Response};
use retrysafe_core::ConfigError;
use retrysafe_core::idempotency::{Fingerprinter, HeaderFilter, Scope};
use retrysafe_core::wire::Convention;
use retrysafe_tower::idempotency::{IdempotencyEvent, Problem, Shutdown};
use sqlx::PgPool;
use tokio::sync::Semaphore;
use tower_layer::Layer;

use super::service::TxIdempotency;
use super::sql::{self, TxSql};
use crate::PostgresStore;

/// A user's rule from request head to scope.
pub(crate) type ScopeFn = Arc<dyn Fn(&Parts) -> Option<Scope> + Send + Sync>;
pub(crate) type Responder = Arc<dyn Fn(&Problem) -> Response<Bytes> + Send + Sync>;
pub(crate) type EventHook = Arc<dyn Fn(&IdempotencyEvent) + Send + Sync>;

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
    pub(crate) pool: PgPool,
    pub(crate) schema: Option<String>,
    pub(crate) table: String,
    pub(crate) sql: Arc<TxSql>,
    pub(crate) begin: String,
    pub(crate) lock_class: i32,
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
    pub(crate) in_flight_retry_after: Duration,
    pub(crate) wait_for_in_flight: Option<Duration>,
    pub(crate) acquire_timeout: Duration,
    pub(crate) commit_timeout: Duration,
    pub(crate) idle_in_transaction: Duration,
    pub(crate) unavailable_retry_after: Duration,
    pub(crate) responder: Option<Responder>,
    pub(crate) on_event: Option<EventHook>,
}

/// Runtime state shared by every clone of a layer and its services.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) permits: Arc<Semaphore>,
    pub(crate) shutdown: Shutdown,
    pub(crate) scope_warned: AtomicBool,
}

/// Applies [`TxIdempotency`] to a service: runs each guarded request (POST and PATCH by
/// default) in one PostgreSQL transaction that also holds its idempotency key, so that
/// the key and the handler's effects commit — or roll back — together. See the
/// [module docs](super) for the pattern and the full behaviour.
///
/// Builder methods take and return the layer; those whose value can be invalid return
/// `Result<Self, ConfigError>`. The layer holds its configuration in an `Arc`: cloning
/// it, and applying it to services, is cheap.
#[derive(Clone)]
#[must_use]
pub struct TxIdempotencyLayer {
    pub(crate) config: Arc<Config>,
    pub(crate) shared: Arc<Shared>,
}

impl fmt::Debug for TxIdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("TxIdempotencyLayer")
            .field("table", &c.sql.store.table)
            .field("methods", &c.methods)
            .field("require_key", &c.require_key)
            .field("scope", &c.scope)
            .field("retention", &c.retention)
            .field("wait_for_in_flight", &c.wait_for_in_flight)
            .field("acquire_timeout", &c.acquire_timeout)
            .field("idle_in_transaction_timeout", &c.idle_in_transaction)
            .finish_non_exhaustive()
    }
}

const MIB: usize = 1024 * 1024;
const DEFAULT_MAX_IN_FLIGHT: usize = 1024;
/// The longest timeout, wait or hint accepted (30 days).
const MAX_SPAN: Duration = retrysafe_core::wire::MAX_TIMEOUT;
/// The longest retention accepted (366 days).
const MAX_RETENTION: Duration = Duration::from_secs(366 * 24 * 60 * 60);
/// The largest body limit accepted (1 GiB): record lengths are 32-bit.
const MAX_BODY_LIMIT: usize = 1 << 30;
/// The longest `idle_in_transaction_session_timeout` PostgreSQL accepts (an `int` of
/// milliseconds).
const MAX_IDLE: Duration = Duration::from_millis(i32::MAX as u64);

fn within(d: Duration, field: &'static str, max: Duration) -> Result<Duration, ConfigError> {
    if d.is_zero() {
        Err(ConfigError::new(field, "must be greater than zero"))
    } else if d > max {
        Err(ConfigError::new(field, "is too large"))
    } else {
        Ok(d)
    }
}

impl TxIdempotencyLayer {
    /// The default advisory-lock class: the first key of the two-int
    /// `pg_try_advisory_xact_lock(class, key)` the layer takes per record key.
    pub const DEFAULT_LOCK_CLASS: i32 = 0x7273_0002;

    /// A layer on `pool`, with the [`PostgresStore`]'s default table
    /// (`retrysafe_idempotency`, created by [`PostgresStore::migrate`]) and the
    /// defaults: POST and PATCH guarded, key optional, scope from the
    /// [`Principal`](retrysafe_core::idempotency::Principal) extension, fingerprint
    /// over method, path, query, `content-type` and body, 1 MiB request and
    /// stored-response limits, 24 h retention, 409 with `retry-after: 1` for in-flight
    /// copies, 1 s to acquire a connection and open the transaction, 5 s to complete
    /// and commit, a 10 s `idle_in_transaction_session_timeout`, 1024 guarded requests
    /// in flight.
    ///
    /// Each request checks a connection out of `pool`: with sqlx's default
    /// `test_before_acquire`, that adds a ping (one round trip) per request; the pools
    /// [`PostgresStore::connect`] makes skip it.
    pub fn new(pool: PgPool) -> Self {
        Self::build(pool, None, crate::sql::DEFAULT_TABLE.to_owned())
    }

    /// A layer on the store's pool and table: key rows the layer commits are records
    /// that the store reads ([`get`](retrysafe_core::store::IdempotencyStore::get)) and
    /// that its sweeper deletes once expired.
    ///
    /// A pool made by [`PostgresStore::connect`] sets the server's `statement_timeout` to
    /// the store's call timeout (1 s by default): it then bounds the handlers'
    /// statements too. Give the layer a pool of its own with [`new`](Self::new) and
    /// [`schema`](Self::schema) / [`table`](Self::table) for other settings.
    pub fn from_store(store: &PostgresStore) -> Self {
        // The store's table name is validated, and qualified as `schema.table` when it
        // has a schema.
        let (schema, table) = match store.table().split_once('.') {
            Some((s, t)) => (Some(s.to_owned()), t.to_owned()),
            None => (None, store.table().to_owned()),
        };
        Self::build(store.pool().clone(), schema, table)
    }

    fn build(pool: PgPool, schema: Option<String>, table: String) -> Self {
        let idle = Duration::from_secs(10);
        TxIdempotencyLayer {
            config: Arc::new(Config {
                pool,
                sql: Arc::new(TxSql::new(schema.as_deref(), &table)),
                schema,
                table,
                begin: sql::begin(idle),
                lock_class: Self::DEFAULT_LOCK_CLASS,
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
                in_flight_retry_after: Duration::from_secs(1),
                wait_for_in_flight: None,
                acquire_timeout: Duration::from_secs(1),
                commit_timeout: Duration::from_secs(5),
                idle_in_transaction: idle,
                unavailable_retry_after: Duration::from_secs(1),
                responder: None,
                on_event: None,
            }),
            shared: Arc::new(Shared {
                permits: Arc::new(Semaphore::new(DEFAULT_MAX_IN_FLIGHT)),
                shutdown: Shutdown::new(),
                scope_warned: AtomicBool::new(false),
            }),
        }
    }

    fn config(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// The schema of the key table (default: none, the connection's `search_path`), as
    /// in [`PostgresStoreBuilder::schema`](crate::PostgresStoreBuilder::schema).
    pub fn schema(self, schema: impl Into<String>) -> Result<Self, ConfigError> {
        let schema = schema.into();
        crate::sql::check_schema(&schema)?;
        Ok(self.config(|c| {
            c.sql = Arc::new(TxSql::new(Some(&schema), &c.table));
            c.schema = Some(schema);
        }))
    }

    /// The key table (default `retrysafe_idempotency`), as in
    /// [`PostgresStoreBuilder::table`](crate::PostgresStoreBuilder::table).
    pub fn table(self, table: impl Into<String>) -> Result<Self, ConfigError> {
        let table = table.into();
        crate::sql::check_table(&table)?;
        Ok(self.config(|c| {
            c.sql = Arc::new(TxSql::new(c.schema.as_deref(), &table));
            c.table = table;
        }))
    }

    /// The methods that are guarded (default POST and PATCH). Other methods pass
    /// untouched, without a transaction.
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
    /// 400 `key-missing` problem. (Without it, such a request runs in a transaction of
    /// its own, with no key row.)
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

    /// The largest request body accepted on keyed requests (default 1 MiB); larger ones
    /// get 413 before any connection is taken.
    pub fn max_request_body(self, bytes: usize) -> Result<Self, ConfigError> {
        if bytes == 0 || bytes > MAX_BODY_LIMIT {
            return Err(ConfigError::new(
                "max_request_body",
                "must be between 1 byte and 1 GiB",
            ));
        }
        Ok(self.config(|c| c.max_request_body = bytes))
    }

    /// The largest response body stored (default 1 MiB). A larger response commits a
    /// key row that records it as not replayable, before the rest streams to the
    /// client; later copies get 409 `response-not-stored`.
    pub fn max_stored_response(self, bytes: usize) -> Result<Self, ConfigError> {
        if bytes > MAX_BODY_LIMIT {
            return Err(ConfigError::new(
                "max_stored_response",
                "must be at most 1 GiB",
            ));
        }
        Ok(self.config(|c| c.max_stored_response = bytes))
    }

    /// How long committed key rows are kept (default 24 h, at most 366 days); then the
    /// key is new again, and the store's sweeper deletes the row.
    pub fn retention(self, retention: Duration) -> Result<Self, ConfigError> {
        let r = within(retention, "retention", MAX_RETENTION)?;
        Ok(self.config(|c| c.retention = r))
    }

    /// The `retry-after` of a 409 `request-in-flight` answer (default 1 s).
    pub fn in_flight_retry_after(self, hint: Duration) -> Self {
        self.config(|c| c.in_flight_retry_after = hint)
    }

    /// Copies that find their key in flight wait up to `max` (bounded by the request's
    /// deadline) and get the replay; after `max`, 409. A waiter holds no connection: it
    /// polls with short autocommit reads (backing off from 5 ms to 100 ms). Waiters whose
    /// holder rolled back race to run.
    pub fn wait_for_in_flight(self, max: Duration) -> Result<Self, ConfigError> {
        let max = within(max, "wait_for_in_flight", MAX_SPAN)?;
        Ok(self.config(|c| c.wait_for_in_flight = Some(max)))
    }

    /// How long a request may take to check a connection out of the pool, begin its
    /// transaction and take its key (default 1 s); with a
    /// [`Deadline`](retrysafe_core::Deadline) extension, the sooner of the two. Past it,
    /// 503 `store-unavailable` with `retry-after`.
    pub fn acquire_timeout(self, timeout: Duration) -> Result<Self, ConfigError> {
        let t = within(timeout, "acquire_timeout", MAX_SPAN)?;
        Ok(self.config(|c| c.acquire_timeout = t))
    }

    /// How long writing the key row and committing may take after the handler answered
    /// (default 5 s). Past it, or when either fails, the answer is 503
    /// `store-unavailable`: the retry finds the key committed (and replays) or absent
    /// (and runs).
    pub fn commit_timeout(self, timeout: Duration) -> Result<Self, ConfigError> {
        let t = within(timeout, "commit_timeout", MAX_SPAN)?;
        Ok(self.config(|c| c.commit_timeout = t))
    }

    /// The `idle_in_transaction_session_timeout` set (`SET LOCAL`) on every transaction
    /// (default 10 s, whole milliseconds, at most about 24 days): a transaction left
    /// idle that long — its application host vanished, a leaked guard, a handler waiting
    /// on something else — is ended by the server, which rolls it back and frees its
    /// key. Response bodies are collected for at most half of it.
    pub fn idle_in_transaction_timeout(self, timeout: Duration) -> Result<Self, ConfigError> {
        let t = within(timeout, "idle_in_transaction_timeout", MAX_IDLE)?;
        if t < Duration::from_millis(1) {
            return Err(ConfigError::new(
                "idle_in_transaction_timeout",
                "must be at least 1 ms",
            ));
        }
        Ok(self.config(|c| {
            c.idle_in_transaction = t;
            c.begin = sql::begin(t);
        }))
    }

    /// The advisory-lock class (default [`DEFAULT_LOCK_CLASS`](Self::DEFAULT_LOCK_CLASS)),
    /// the first key of `pg_try_advisory_xact_lock(class, key)`: change it if the
    /// application uses two-int advisory locks of that class itself.
    pub fn advisory_lock_class(self, class: i32) -> Self {
        self.config(|c| c.lock_class = class)
    }

    /// The bound of guarded requests in flight (default 1024); past it, 503
    /// `overloaded`.
    pub fn max_in_flight(mut self, n: usize) -> Result<Self, ConfigError> {
        if n == 0 || n > Semaphore::MAX_PERMITS {
            return Err(ConfigError::new(
                "max_in_flight",
                "must be between 1 and Semaphore::MAX_PERMITS",
            ));
        }
        self.shared = Arc::new(Shared {
            permits: Arc::new(Semaphore::new(n)),
            shutdown: self.shared.shutdown.clone(),
            scope_warned: AtomicBool::new(false),
        });
        Ok(self)
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

    /// Calls `f` on every event: claimed, replayed, conflict, mismatch.
    pub fn on_event<F>(self, f: F) -> Self
    where
        F: Fn(&IdempotencyEvent) + Send + Sync + 'static,
    {
        self.config(|c| c.on_event = Some(Arc::new(f)))
    }

    /// A handle to drain the spawned work on graceful shutdown.
    pub fn shutdown_handle(&self) -> Shutdown {
        self.shared.shutdown.clone()
    }

    /// The pool the layer takes its connections from.
    pub fn pool(&self) -> &PgPool {
        &self.config.pool
    }

    /// The key table, qualified by its schema when one is set.
    pub fn table_name(&self) -> &str {
        &self.config.sql.store.table
    }
}

impl<S> Layer<S> for TxIdempotencyLayer {
    type Service = TxIdempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TxIdempotency::new(inner, self.clone())
    }
}
