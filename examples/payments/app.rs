//! The payments server shared by the `payments` and `quickstart` examples.
//!
//! `POST /payments` records a payment once per `Idempotency-Key` (required);
//! `GET /payments?account=A` answers the count and total of that account's payments.
//! Three request headers are test hooks, outside the fingerprint:
//! `x-simulate-delay-ms: N` waits before the effect (before the commit point),
//! `x-simulate-delay-after-ms: N` waits after the effect, before answering (so that a
//! test can kill the process once the payment is recorded but before its answer is
//! stored or, with PostgreSQL, committed), and `x-simulate-fail: 500` answers a 500
//! marked `NoEffect` without an effect, so a retry with the same key runs again.
//! With `--test-hooks` (`Options::test_hooks`) two more headers are honoured (and
//! ignored without it): `x-simulate-crash: after-commit-point | after-effect` aborts the
//! process at that point — no completion, no release — as a crash would; and
//! `x-simulate-failure: before-commit-point` answers 503 before the commit point, not
//! marked `NoEffect`: the layer releases the key because the handler declares its commit
//! point and had not reached it, so a retry runs again.
//!
//! Recovery: the ledger is unique on (scope, key), so [`PaymentsResolver`] can tell
//! whether the payment of a pending key happened: found → `Happened` with the original
//! 201 and body; none → `DidNotHappen` (a late holder's write would find the key
//! taken). With Redis and PostgreSQL a `Reconciler` runs it every `--reconcile-ms`
//! (default 1 s); while it runs, copies of a pending key get 503 `outcome-pending`
//! and, once it is resolved, the replay or a fresh run.
//!
//! The backend ([`Backend`]) holds both the idempotency records and the ledger:
//!
//! - memory: the `IdempotencyLayer` over a `MemoryStore`, and an in-process ledger;
//! - Redis: the `IdempotencyLayer` over a `RedisStore`; the payment is written to Redis
//!   just after the handler's `commit_point()`. A holder that dies before it is taken
//!   over once its lease expires; one that dies after it leaves its key pending until
//!   the reconciler resolves it from the ledger (without a reconciler, an
//!   `outcome_unknown` record: a 500 `outcome-unknown` problem for later copies, never a
//!   second payment);
//! - PostgreSQL: the `TxIdempotencyLayer`; the payment is inserted through the
//!   `IdempotentTx` guard, in the transaction that also writes the key: both commit or
//!   neither does. The handler code is the same: `commit_point()` on the transactional
//!   layer's (detached) context returns at once, the transaction being the commit point;
//! - PostgreSQL, plain mode (`PAYMENTS_PG_MODE=plain`, a test hook for the crash and
//!   outage tests): the `IdempotencyLayer` over a `PostgresStore`, the payment inserted
//!   on its own just after `commit_point()`, with the same outcomes as Redis.
//!
//! Layers, outermost first: `TraceLayer` → authentication (`Authorization: Bearer T` is
//! principal `T`, no header an anonymous principal) → the server `DeadlineLayer`
//! (`request-timeout-ms` / `grpc-timeout`: malformed → 400 `timeout-invalid`, no time
//! left → 504 `deadline-exceeded` before the handler starts) → `IdempotencyLayer` (or
//! `TxIdempotencyLayer`) → handlers.

mod ledger;

use std::future::Future;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Query, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use retrysafe::idempotency::{
    IdempotencyContext, IdempotencyLayer, NoEffect, Principal, Shutdown, StoredResponse,
};
use retrysafe::memory::MemoryStore;
use retrysafe::postgres::PostgresStore;
use retrysafe::postgres::tx::{IdempotentTx, TxBackend, TxIdempotencyLayer};
use retrysafe::recovery::{
    PendingRecord, ReconcilableStore, ReconcilerHandle, Resolution, Resolver,
};
use retrysafe::redis::redis::cluster_async::ClusterConnection;
use retrysafe::redis::{RedisStore, SentinelConnection};
use retrysafe::server::ServerLayers;
use retrysafe::{ConfigError, DeadlineLayer};
use serde::Deserialize;
use tokio::net::TcpListener;
use tower_http::trace::TraceLayer;

pub(crate) use ledger::{Ledger, RedisConn};
use ledger::{Owner, Payment};

/// The principal of requests without an `Authorization` header. It contains a space,
/// which no bearer token can, so no token shares its scope.
pub(crate) const ANONYMOUS: &str = "anonymous client";

/// How long a copy waits for the in-flight original with `--in-flight wait`.
pub(crate) const WAIT_FOR_IN_FLIGHT: Duration = Duration::from_secs(5);

/// The layer's default store call timeout, kept for leases long enough to allow it.
const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(1);

/// The longest `x-simulate-delay-ms` (or `x-simulate-delay-after-ms`) honoured.
const MAX_SIMULATED_DELAY: Duration = Duration::from_secs(30);

/// Server settings; `None` keeps the layer's default.
#[derive(Debug, Clone, Default)]
pub(crate) struct Options {
    /// `IdempotencyLayer::lease`, with a `store_timeout` of a quarter of it (at most
    /// the default 1 s). With PostgreSQL, whose transactional layer has no
    /// lease (the open transaction holds the key), the
    /// `TxBackend::idle_in_transaction_timeout`: how long the key of a holder
    /// gone silent stays taken.
    pub(crate) lease: Option<Duration>,
    /// `IdempotencyLayer::retention` (`TxIdempotencyLayer::retention`).
    pub(crate) retention: Option<Duration>,
    /// `wait_for_in_flight(WAIT_FOR_IN_FLIGHT)` instead of 409.
    pub(crate) wait_for_in_flight: bool,
    /// `IdempotencyLayer::max_execution`: a handler still running then is cancelled.
    /// (The transactional layer has none: its transaction's idle timeout bounds it.)
    pub(crate) max_execution: Option<Duration>,
    /// The `MemoryStore`'s byte budget (`MemoryStore::max_bytes`), with `--store memory`.
    pub(crate) memory_bytes: Option<u64>,
    /// Run the reconciler with [`PaymentsResolver`] this often; `None` (or zero): off.
    pub(crate) reconcile: Option<Duration>,
    /// Honour the `x-simulate-crash` header.
    pub(crate) test_hooks: bool,
}

/// How long idempotency records are kept unless `--ttl-ms` says otherwise (the
/// layers' default).
const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

impl Options {
    /// How long a payment keeps its idempotency key unique in the ledger: the records'
    /// retention.
    pub(crate) fn key_window(&self) -> Duration {
        self.retention.unwrap_or(DEFAULT_RETENTION)
    }
}

/// The name of the app's layer, store and reconciler in their events and metrics.
pub(crate) const NAME: &str = "payments";

/// What the handlers share: the ledger, and whether the crash hook is on.
#[derive(Debug, Clone)]
struct AppState {
    ledger: Ledger,
    test_hooks: bool,
}

/// The running app: its router, the handle that drains its guarded requests on
/// shutdown, and its reconciler (stopped when dropped).
#[derive(Debug)]
pub(crate) struct App {
    pub(crate) router: Router,
    pub(crate) shutdown: Shutdown,
    pub(crate) reconciler: Option<ReconcilerHandle>,
}

/// Finds out whether the payment of a pending key happened, from the ledger, which is
/// unique on (scope, key).
#[derive(Debug, Clone)]
pub(crate) struct PaymentsResolver {
    ledger: Ledger,
}

impl Resolver for PaymentsResolver {
    async fn resolve(&self, pending: &PendingRecord) -> Resolution {
        // The layer stores keys for resolution; a record without one cannot be looked up.
        let (Some(scope), Some(key)) = (pending.scope(), pending.key()) else {
            return Resolution::Unknown;
        };
        match self.ledger.find(scope, key).await {
            Ok(Some(payment)) => Resolution::Happened(created(&payment)),
            // Unique on (scope, key): a late write of this key's payment would fail.
            Ok(None) => Resolution::DidNotHappen,
            Err(e) => {
                tracing::warn!(error = %e, "cannot look a pending payment up; trying later");
                Resolution::Unknown
            }
        }
    }
}

/// The 201 the handler answers for `payment`, as a stored response.
fn created(payment: &Payment) -> StoredResponse {
    let body = serde_json::to_vec(payment).unwrap_or_default();
    StoredResponse::new(
        StatusCode::CREATED,
        vec![(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        body.into(),
        Vec::new(),
    )
}

/// Starts the reconciler of `store` when `options` ask for one.
fn reconciler<S: ReconcilableStore>(
    store: &S,
    ledger: &Ledger,
    options: &Options,
) -> Result<Option<ReconcilerHandle>, ConfigError> {
    let Some(every) = options.reconcile.filter(|d| !d.is_zero()) else {
        return Ok(None);
    };
    let mut reconciler = store
        .reconciler(PaymentsResolver {
            ledger: ledger.clone(),
        })
        .name(NAME)
        .interval(every)
        .grace(every)
        .on_outcome_unknown(report_unknown);
    if let Some(max) = options.max_execution {
        reconciler = reconciler.max_execution(max);
    }
    if let Some(retention) = options.retention {
        reconciler = reconciler.retention(retention);
    }
    reconciler.spawn().map(Some)
}

/// The reconcile hook: a payment whose outcome is (still) unknown.
fn report_unknown(unknown: &retrysafe::idempotency::UnknownOutcome) {
    tracing::error!(
        record = %unknown.record.to_hex(),
        reason = ?unknown.reason,
        "a payment's outcome is unknown: reconcile it with the ledger"
    );
}

/// Where idempotency records and payments live.
#[derive(Debug)]
pub(crate) enum Backend {
    /// Both in this process.
    Memory,
    /// Records in a `RedisStore` (with its own key prefix), payments in a Redis ledger.
    Redis {
        /// The idempotency store.
        store: RedisStore,
        /// The ledger (`Ledger::Redis`).
        ledger: Ledger,
    },
    /// The same on the primary of a Redis Sentinel service, followed across failovers.
    RedisSentinel {
        /// The idempotency store.
        store: RedisStore<SentinelConnection>,
        /// The ledger (`Ledger::Redis`, on the same connection).
        ledger: Ledger,
    },
    /// The same on a Redis Cluster: records in a `RedisStore` over the cluster client
    /// (its in-flight index kept per slot), each payment in the slot of its record.
    RedisCluster {
        /// The idempotency store.
        store: RedisStore<ClusterConnection>,
        /// The ledger (`Ledger::Redis`, on a cluster connection).
        ledger: Ledger,
    },
    /// Records and payments in one PostgreSQL transaction per request.
    Postgres {
        /// The store whose table the transactional layer writes its key rows to.
        store: PostgresStore,
        /// The ledger (`Ledger::Postgres`, on the store's pool).
        ledger: Ledger,
    },
    /// Records in a `PostgresStore` under the `IdempotencyLayer`, payments written on
    /// their own (the plain mode, `PAYMENTS_PG_MODE=plain`).
    PostgresPlain {
        /// The idempotency store.
        store: PostgresStore,
        /// The ledger (`Ledger::Postgres`, not transactional, on the store's pool).
        ledger: Ledger,
    },
}

/// The payments app over an in-memory idempotency store, and the handle that drains
/// its guarded requests on shutdown.
#[allow(
    dead_code,
    reason = "the quickstart's entry point; `payments` uses `router_on`"
)]
pub(crate) fn router(options: &Options) -> Result<(Router, Shutdown), ConfigError> {
    let app = router_on(Backend::Memory, options)?;
    Ok((app.router, app.shutdown))
}

/// The payments app over `backend`, and the handle that drains its guarded requests on
/// shutdown.
pub(crate) fn router_on(backend: Backend, options: &Options) -> Result<App, ConfigError> {
    let (layer, ledger, reconciler) = match backend {
        Backend::Memory => {
            let store = MemoryStore::new().name(NAME);
            let store = match options.memory_bytes {
                Some(bytes) => store.max_bytes(bytes),
                None => store,
            }
            .build()?;
            let ledger = Ledger::memory(options.key_window());
            let reconciler = reconciler(&store, &ledger, options)?;
            (IdempotencyLayer::new(store), ledger, reconciler)
        }
        Backend::Redis { store, ledger } => {
            let reconciler = reconciler(&store, &ledger, options)?;
            (IdempotencyLayer::new(store), ledger, reconciler)
        }
        Backend::RedisSentinel { store, ledger } => {
            let reconciler = reconciler(&store, &ledger, options)?;
            (IdempotencyLayer::new(store), ledger, reconciler)
        }
        Backend::RedisCluster { store, ledger } => {
            let reconciler = reconciler(&store, &ledger, options)?;
            (IdempotencyLayer::new(store), ledger, reconciler)
        }
        Backend::PostgresPlain { store, ledger } => {
            let reconciler = reconciler(&store, &ledger, options)?;
            (IdempotencyLayer::new(store), ledger, reconciler)
        }
        Backend::Postgres { store, ledger } => return transactional(&store, ledger, options),
    };
    let mut idempotency = layer
        .name(NAME)
        .require_key()
        .handlers_declare_commit_point()
        .store_keys_for_resolution()
        .on_outcome_unknown(report_unknown);
    if let Some(lease) = options.lease {
        // A lease must outlast three store calls: a short one takes a short timeout.
        let store_timeout = (lease / 4).min(DEFAULT_STORE_TIMEOUT);
        idempotency = idempotency.lease(lease).store_timeout(store_timeout);
    }
    if let Some(retention) = options.retention {
        idempotency = idempotency.retention(retention);
    }
    if options.wait_for_in_flight {
        idempotency = idempotency.wait_for_in_flight(WAIT_FOR_IN_FLIGHT);
    }
    if let Some(max) = options.max_execution {
        idempotency = idempotency.max_execution(max);
    }
    let idempotency = idempotency.build()?;
    let shutdown = idempotency.shutdown_handle();

    let state = AppState {
        ledger,
        test_hooks: options.test_hooks,
    };
    let router = Router::new()
        .route("/payments", post(create_payment).get(totals))
        .with_state(state)
        .layer(
            // Authentication → the inbound deadline → idempotency.
            ServerLayers::new(idempotency)
                .authentication(axum::middleware::map_request(authenticate))
                .deadline(DeadlineLayer::server())
                .build()?,
        );
    Ok(App {
        router: outer(router),
        shutdown,
        reconciler,
    })
}

/// The app with PostgreSQL's transactional layer: key and payment in one transaction.
fn transactional(
    store: &PostgresStore,
    ledger: Ledger,
    options: &Options,
) -> Result<App, ConfigError> {
    // Nothing is ever pending with the transactional layer (a crash rolls key and
    // payment back together); the reconciler runs for operators' tools and rows of the
    // plain mode sharing the table.
    let reconciler = reconciler(store, &ledger, options)?;
    let mut backend = TxBackend::from_store(store);
    if let Some(lease) = options.lease {
        backend = backend.idle_in_transaction_timeout(lease);
    }
    let mut idempotency = TxIdempotencyLayer::with_backend(backend)
        .name(NAME)
        .require_key();
    if let Some(retention) = options.retention {
        idempotency = idempotency.retention(retention);
    }
    if options.wait_for_in_flight {
        idempotency = idempotency.wait_for_in_flight(WAIT_FOR_IN_FLIGHT);
    }
    let idempotency = idempotency.build()?;
    let shutdown = idempotency.shutdown_handle();

    let state = AppState {
        ledger,
        test_hooks: options.test_hooks,
    };
    let router = Router::new()
        .route("/payments", post(create_payment).get(totals))
        .with_state(state)
        .layer(
            // Authentication → the inbound deadline → idempotency.
            ServerLayers::new(idempotency)
                .authentication(axum::middleware::map_request(authenticate))
                .deadline(DeadlineLayer::server())
                .build()?,
        );
    Ok(App {
        router: outer(router),
        shutdown,
        reconciler,
    })
}

/// The layers outside authentication.
fn outer(router: Router) -> Router {
    router
        // The idempotency layers enforce their own 1 MiB limit (413 problem) on every
        // POST; axum's 2 MB default must not answer first with something else.
        .layer(DefaultBodyLimit::disable())
        .layer(TraceLayer::new_for_http())
}

/// Serves `router` until `signal` completes, then waits for the guarded requests still
/// running (their handlers finish even when their clients are gone).
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: Shutdown,
    signal: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(signal)
        .await?;
    if shutdown.in_flight() > 0 {
        tracing::info!(
            in_flight = shutdown.in_flight(),
            "waiting for guarded requests to finish"
        );
    }
    shutdown.drain().await;
    Ok(())
}

#[derive(Debug, Deserialize)]
struct NewPayment {
    account: String,
    amount_cents: i64,
}

#[derive(Debug, Deserialize)]
struct TotalsQuery {
    /// Without it, the whole ledger.
    account: Option<String>,
}

/// Where `x-simulate-crash` aborts the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Crash {
    /// Just after the commit point, before the payment.
    AfterCommitPoint,
    /// Just after the payment, before the answer.
    AfterEffect,
}

/// The test hooks of one request.
#[derive(Debug)]
struct Hooks {
    delay: Option<Duration>,
    delay_after: Option<Duration>,
    fail: Option<StatusCode>,
    crash: Option<Crash>,
    /// `x-simulate-failure: before-commit-point`.
    fail_before_commit_point: bool,
}

impl Hooks {
    /// Reads the hook headers (`x-simulate-crash` and `x-simulate-failure` only with
    /// `test_hooks`); the error is the problem detail.
    fn read(headers: &HeaderMap, test_hooks: bool) -> Result<Hooks, &'static str> {
        Ok(Hooks {
            delay: simulated_delay(headers, "x-simulate-delay-ms")?,
            delay_after: simulated_delay(headers, "x-simulate-delay-after-ms")?,
            fail: simulated_failure(headers)?,
            crash: if test_hooks {
                simulated_crash(headers)?
            } else {
                None
            },
            fail_before_commit_point: test_hooks && simulated_failure_point(headers)?,
        })
    }

    /// Aborts the process if the crash hook asks for it at `point`: no completion, no
    /// release, no flush.
    fn crash_at(&self, point: Crash) {
        if self.crash == Some(point) {
            tracing::warn!(?point, "x-simulate-crash: aborting");
            std::process::abort();
        }
    }
}

/// Whether `x-simulate-failure: before-commit-point` is sent; the error is the detail.
fn simulated_failure_point(headers: &HeaderMap) -> Result<bool, &'static str> {
    match headers.get("x-simulate-failure").map(HeaderValue::as_bytes) {
        None => Ok(false),
        Some(b"before-commit-point") => Ok(true),
        Some(_) => Err("x-simulate-failure must be `before-commit-point`"),
    }
}

/// `x-simulate-crash: after-commit-point | after-effect`; the error is the detail.
fn simulated_crash(headers: &HeaderMap) -> Result<Option<Crash>, &'static str> {
    match headers.get("x-simulate-crash").map(HeaderValue::as_bytes) {
        None => Ok(None),
        Some(b"after-commit-point") => Ok(Some(Crash::AfterCommitPoint)),
        Some(b"after-effect") => Ok(Some(Crash::AfterEffect)),
        Some(_) => Err("x-simulate-crash must be `after-commit-point` or `after-effect`"),
    }
}

async fn create_payment(
    State(state): State<AppState>,
    idempotency: Option<Extension<IdempotencyContext>>,
    // The request's transaction with PostgreSQL; `None` with the other backends.
    tx: Option<IdempotentTx>,
    headers: HeaderMap,
    payment: Result<Json<NewPayment>, JsonRejection>,
) -> Response {
    let ledger = state.ledger;
    let hooks = match Hooks::read(&headers, state.test_hooks) {
        Ok(hooks) => hooks,
        Err(detail) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "invalid-test-hook",
                "Invalid test hook header",
                detail,
            );
        }
    };
    let Json(payment) = match payment {
        Ok(p) => p,
        Err(rejection) => {
            return problem(
                rejection.status(),
                "invalid-payment",
                "The payment is not valid JSON of the expected shape",
                &rejection.body_text(),
            );
        }
    };

    if let Some(delay) = hooks.delay {
        tokio::time::sleep(delay).await;
    }
    if let Some(status) = hooks.fail {
        // Nothing happened: the idempotency layer releases the key (or rolls back), and
        // a retry runs again.
        let mut res = problem(
            status,
            "simulated-failure",
            "Simulated failure",
            "x-simulate-fail asked for this failure; no payment was recorded",
        );
        res.extensions_mut().insert(NoEffect);
        return res;
    }
    if hooks.fail_before_commit_point {
        // Not marked `NoEffect`: the handler declares its commit point and has not
        // reached it, which is enough for the layer to release the key.
        let mut res = problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "simulated-failure",
            "Simulated failure",
            "x-simulate-failure asked for a failure before the commit point; no payment \
             was recorded",
        );
        res.headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from_static("1"));
        return res;
    }
    if let Some(Extension(ctx)) = &idempotency {
        // Just before the effect: a copy may take over a stalled claim until here. (With
        // PostgreSQL's transactional layer this returns at once: the transaction is the
        // commit point.) The note tells a resolver what was about to be paid.
        let note = format!("{} {}", payment.account, payment.amount_cents);
        if let Err(e) = ctx.commit_point_with(note).await {
            tracing::warn!(error = %e, "commit point failed; the payment is not recorded");
            let mut res = problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "commit-point-failed",
                "The payment could not be started",
                "the idempotency claim could not be confirmed; no payment was recorded",
            );
            res.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("1"));
            res.extensions_mut().insert(NoEffect);
            return res;
        }
    }
    hooks.crash_at(Crash::AfterCommitPoint);
    let owner = idempotency.as_ref().map(|Extension(ctx)| Owner {
        scope: ctx.scope(),
        key: ctx.key(),
    });
    let recorded = match ledger
        .record(tx, owner, payment.account, payment.amount_cents)
        .await
    {
        Ok(recorded) => recorded,
        Err(e) if ledger.is_transactional() => {
            // The 5xx rolls the transaction back: nothing happened, a retry runs again.
            tracing::warn!(error = %e, "the payment could not be recorded; rolled back");
            let mut res = problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "ledger-unavailable",
                "The payment could not be recorded",
                &e.to_string(),
            );
            res.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("1"));
            return res;
        }
        Err(e) => {
            // Not marked `NoEffect`: the write may have reached Redis before it failed.
            // The idempotency layer records the outcome as unknown (never run again) and
            // reports it to the reconcile hook.
            tracing::error!(error = %e, "the payment may or may not have been recorded");
            return problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "payment-outcome-unknown",
                "The payment may or may not have been recorded",
                &e.to_string(),
            );
        }
    };
    // With PostgreSQL's transactional layer the payment is still in the open
    // transaction here: a crash rolls key and payment back together.
    hooks.crash_at(Crash::AfterEffect);
    if let Some(delay) = hooks.delay_after {
        tokio::time::sleep(delay).await;
    }
    (StatusCode::CREATED, Json(recorded)).into_response()
}

async fn totals(State(state): State<AppState>, Query(query): Query<TotalsQuery>) -> Response {
    match state.ledger.totals(query.account.as_deref()).await {
        Ok(totals) => Json(totals).into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the ledger");
            let mut res = problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "ledger-unavailable",
                "The ledger cannot be read",
                &e.to_string(),
            );
            res.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("1"));
            res
        }
    }
}

/// `NAME: N` (`x-simulate-delay-ms`, `x-simulate-delay-after-ms`); the error is the
/// problem detail.
fn simulated_delay(headers: &HeaderMap, name: &str) -> Result<Option<Duration>, &'static str> {
    let Some(value) = headers.get(name) else {
        return Ok(None);
    };
    let ms = value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok());
    match ms.map(Duration::from_millis) {
        Some(d) if d <= MAX_SIMULATED_DELAY => Ok(Some(d)),
        _ => Err(
            "x-simulate-delay-ms and x-simulate-delay-after-ms must be whole numbers \
                  of milliseconds, at most 30000",
        ),
    }
}

/// `x-simulate-fail: 5xx`; the error is the problem detail.
fn simulated_failure(headers: &HeaderMap) -> Result<Option<StatusCode>, &'static str> {
    let Some(value) = headers.get("x-simulate-fail") else {
        return Ok(None);
    };
    let status = value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u16>().ok())
        .and_then(|n| StatusCode::from_u16(n).ok());
    match status {
        Some(s) if s.is_server_error() => Ok(Some(s)),
        _ => Err("x-simulate-fail must be a 5xx status code, such as 500"),
    }
}

/// The authentication layer: inserts the caller's `Principal`, which scopes its keys.
async fn authenticate(mut req: Request) -> Result<Request, Response> {
    let mut values = req.headers().get_all(AUTHORIZATION).iter();
    let principal = match (values.next(), values.next()) {
        (None, _) => Principal::new(ANONYMOUS),
        (Some(value), None) => match bearer_token(value.as_bytes()) {
            Some(token) => Principal::new(token),
            None => {
                return Err(unauthorized(
                    "the Authorization header must be `Bearer TOKEN`",
                ));
            }
        },
        (Some(_), Some(_)) => {
            return Err(unauthorized("the Authorization header must be sent once"));
        }
    };
    req.extensions_mut().insert(principal);
    Ok(req)
}

/// The token of `Bearer TOKEN` (scheme case-insensitive), printable ASCII without spaces.
fn bearer_token(value: &[u8]) -> Option<String> {
    let value = std::str::from_utf8(value).ok()?.trim();
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim_start_matches(' ');
    let printable = !token.is_empty() && token.bytes().all(|b| (0x21..=0x7e).contains(&b));
    (scheme.eq_ignore_ascii_case("bearer") && printable).then(|| token.to_owned())
}

fn unauthorized(detail: &str) -> Response {
    let mut res = problem(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "Malformed Authorization header",
        detail,
    );
    res.headers_mut()
        .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    res
}

/// An RFC 9457 problem+json answer of this app.
fn problem(status: StatusCode, slug: &str, title: &str, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": format!("urn:retrysafe-example:payments:{slug}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    (
        status,
        [(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        )],
        body.to_string(),
    )
        .into_response()
}
