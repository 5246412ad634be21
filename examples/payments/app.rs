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
//!
//! The backend ([`Backend`]) holds both the idempotency records and the ledger:
//!
//! - memory: the `IdempotencyLayer` over a `MemoryStore`, and an in-process ledger;
//! - Redis: the `IdempotencyLayer` over a `RedisStore`; the payment is written to Redis
//!   just after the handler's `commit_point()`. A holder that dies before it is taken
//!   over once its lease expires; one that dies after it leaves an `outcome_unknown`
//!   record (a 500 `outcome-unknown` problem for later copies, never a second payment);
//! - PostgreSQL: the `TxIdempotencyLayer`; the payment is inserted through the
//!   `IdempotentTx` guard, in the transaction that also writes the key: both commit or
//!   neither does. The handler code is the same: `commit_point()` on the transactional
//!   layer's (detached) context returns at once, the transaction being the commit point;
//! - PostgreSQL, plain mode (`PAYMENTS_PG_MODE=plain`, a test hook for the crash and
//!   outage tests): the `IdempotencyLayer` over a `PostgresStore`, the payment inserted
//!   on its own just after `commit_point()`, with the same outcomes as Redis.
//!
//! Layers, outermost first: `TraceLayer` → authentication (`Authorization: Bearer T` is
//! principal `T`, no header an anonymous principal) → `IdempotencyLayer` (or
//! `TxIdempotencyLayer`) → handlers.

#[path = "ledger.rs"]
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
use retrysafe::ConfigError;
use retrysafe::idempotency::{IdempotencyContext, IdempotencyLayer, NoEffect, Principal, Shutdown};
use retrysafe::memory::MemoryStore;
use retrysafe::server::ServerLayers;
use retrysafe_postgres::PostgresStore;
use retrysafe_postgres::tx::{IdempotentTx, TxBackend, TxIdempotencyLayer};
use retrysafe_redis::RedisStore;
use serde::Deserialize;
use tokio::net::TcpListener;
use tower_http::trace::TraceLayer;

pub(crate) use ledger::Ledger;

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
    router_on(Backend::Memory, options)
}

/// The payments app over `backend`, and the handle that drains its guarded requests on
/// shutdown.
pub(crate) fn router_on(
    backend: Backend,
    options: &Options,
) -> Result<(Router, Shutdown), ConfigError> {
    let report = |unknown: &retrysafe::idempotency::UnknownOutcome| {
        tracing::error!(
            record = %unknown.record.to_hex(),
            reason = ?unknown.reason,
            "a payment's outcome is unknown: reconcile it with the ledger"
        );
    };
    let (layer, ledger) = match backend {
        Backend::Memory => {
            let store = match options.memory_bytes {
                Some(bytes) => MemoryStore::new().max_bytes(bytes).build()?,
                None => MemoryStore::new(),
            };
            (IdempotencyLayer::new(store), Ledger::memory())
        }
        Backend::Redis { store, ledger } => (
            IdempotencyLayer::new(store).on_outcome_unknown(report),
            ledger,
        ),
        Backend::PostgresPlain { store, ledger } => (
            IdempotencyLayer::new(store).on_outcome_unknown(report),
            ledger,
        ),
        Backend::Postgres { store, ledger } => return transactional(&store, ledger, options),
    };
    let mut idempotency = layer.require_key().handlers_declare_commit_point();
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

    let router = Router::new()
        .route("/payments", post(create_payment).get(totals))
        .with_state(ledger)
        .layer(
            ServerLayers::new(idempotency)
                .authentication(axum::middleware::map_request(authenticate)),
        );
    Ok((outer(router), shutdown))
}

/// The app with PostgreSQL's transactional layer: key and payment in one transaction.
fn transactional(
    store: &PostgresStore,
    ledger: Ledger,
    options: &Options,
) -> Result<(Router, Shutdown), ConfigError> {
    let mut backend = TxBackend::from_store(store);
    if let Some(lease) = options.lease {
        backend = backend.idle_in_transaction_timeout(lease);
    }
    let mut idempotency = TxIdempotencyLayer::with_backend(backend).require_key();
    if let Some(retention) = options.retention {
        idempotency = idempotency.retention(retention);
    }
    if options.wait_for_in_flight {
        idempotency = idempotency.wait_for_in_flight(WAIT_FOR_IN_FLIGHT);
    }
    let idempotency = idempotency.build()?;
    let shutdown = idempotency.shutdown_handle();

    let router = Router::new()
        .route("/payments", post(create_payment).get(totals))
        .with_state(ledger)
        .layer(idempotency)
        .layer(axum::middleware::map_request(authenticate));
    Ok((outer(router), shutdown))
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

/// The test hooks of one request.
#[derive(Debug)]
struct Hooks {
    delay: Option<Duration>,
    delay_after: Option<Duration>,
    fail: Option<StatusCode>,
}

impl Hooks {
    /// Reads the hook headers; the error is the problem detail.
    fn read(headers: &HeaderMap) -> Result<Hooks, &'static str> {
        Ok(Hooks {
            delay: simulated_delay(headers, "x-simulate-delay-ms")?,
            delay_after: simulated_delay(headers, "x-simulate-delay-after-ms")?,
            fail: simulated_failure(headers)?,
        })
    }
}

async fn create_payment(
    State(ledger): State<Ledger>,
    idempotency: Option<Extension<IdempotencyContext>>,
    // The request's transaction with PostgreSQL; `None` with the other backends.
    tx: Option<IdempotentTx>,
    headers: HeaderMap,
    payment: Result<Json<NewPayment>, JsonRejection>,
) -> Response {
    let hooks = match Hooks::read(&headers) {
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
    if let Some(Extension(ctx)) = idempotency {
        // Just before the effect: a copy may take over a stalled claim until here. (With
        // PostgreSQL's transactional layer this returns at once: the transaction is the
        // commit point.)
        if let Err(e) = ctx.commit_point().await {
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
    let recorded = match ledger
        .record(tx, payment.account, payment.amount_cents)
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
    if let Some(delay) = hooks.delay_after {
        tokio::time::sleep(delay).await;
    }
    (StatusCode::CREATED, Json(recorded)).into_response()
}

async fn totals(State(ledger): State<Ledger>, Query(query): Query<TotalsQuery>) -> Response {
    match ledger.totals(query.account.as_deref()).await {
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
