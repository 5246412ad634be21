//! The payments server shared by the `payments` and `quickstart` examples.
//!
//! `POST /payments` records a payment once per `Idempotency-Key` (required);
//! `GET /payments?account=A` answers the count and total of that account's payments.
//! Two request headers are test hooks, outside the fingerprint: `x-simulate-delay-ms: N`
//! waits before the effect, and `x-simulate-fail: 500` answers a 500 marked `NoEffect`
//! without an effect, so a retry with the same key runs again.
//!
//! Layers, outermost first: `TraceLayer` → authentication (`Authorization: Bearer T` is
//! principal `T`, no header an anonymous principal) → `IdempotencyLayer` → handlers.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
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
use retrysafe::server::ServerLayers;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tower_http::trace::TraceLayer;

/// The principal of requests without an `Authorization` header. It contains a space,
/// which no bearer token can, so no token shares its scope.
pub(crate) const ANONYMOUS: &str = "anonymous client";

/// How long a copy waits for the in-flight original with `--in-flight wait`.
pub(crate) const WAIT_FOR_IN_FLIGHT: Duration = Duration::from_secs(5);

/// The longest `x-simulate-delay-ms` honoured.
const MAX_SIMULATED_DELAY: Duration = Duration::from_secs(30);

/// Server settings; `None` keeps the `IdempotencyLayer` default.
#[derive(Debug, Clone, Default)]
pub(crate) struct Options {
    /// `IdempotencyLayer::lease`.
    pub(crate) lease: Option<Duration>,
    /// `IdempotencyLayer::retention`.
    pub(crate) retention: Option<Duration>,
    /// `IdempotencyLayer::wait_for_in_flight(WAIT_FOR_IN_FLIGHT)` instead of 409.
    pub(crate) wait_for_in_flight: bool,
}

/// The payments app over an in-memory idempotency store, and the handle that drains
/// its guarded requests on shutdown.
pub(crate) fn router(options: &Options) -> Result<(Router, Shutdown), ConfigError> {
    let mut idempotency = IdempotencyLayer::in_memory()
        .require_key()
        .handlers_declare_commit_point();
    if let Some(lease) = options.lease {
        idempotency = idempotency.lease(lease)?;
    }
    if let Some(retention) = options.retention {
        idempotency = idempotency.retention(retention)?;
    }
    if options.wait_for_in_flight {
        idempotency = idempotency.wait_for_in_flight(WAIT_FOR_IN_FLIGHT)?;
    }
    let shutdown = idempotency.shutdown_handle();

    let router = Router::new()
        .route("/payments", post(create_payment).get(totals))
        .with_state(Ledger::default())
        .layer(
            ServerLayers::new(idempotency)
                .authentication(axum::middleware::map_request(authenticate)),
        )
        // The IdempotencyLayer enforces its own 1 MiB limit (413 problem) on every
        // POST; axum's 2 MB default must not answer first with something else.
        .layer(DefaultBodyLimit::disable())
        .layer(TraceLayer::new_for_http());
    Ok((router, shutdown))
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

/// One recorded payment.
#[derive(Debug, Clone, Serialize)]
struct Payment {
    id: String,
    account: String,
    amount_cents: i64,
}

/// The backend: an in-memory ledger.
#[derive(Debug, Clone, Default)]
struct Ledger(Arc<Mutex<Vec<Payment>>>);

impl Ledger {
    fn record(&self, account: String, amount_cents: i64) -> Payment {
        let mut payments = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let payment = Payment {
            id: format!("pay_{:x}_{}", std::process::id(), payments.len() + 1),
            account,
            amount_cents,
        };
        payments.push(payment.clone());
        payment
    }

    fn totals(&self, account: Option<&str>) -> Totals {
        let payments = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        payments
            .iter()
            .filter(|p| account.is_none_or(|a| p.account == a))
            .fold(Totals::default(), |t, p| Totals {
                count: t.count + 1,
                total_cents: t.total_cents.saturating_add(p.amount_cents),
            })
    }
}

#[derive(Debug, Deserialize)]
struct NewPayment {
    account: String,
    amount_cents: i64,
}

#[derive(Debug, Default, Serialize)]
struct Totals {
    count: u64,
    total_cents: i64,
}

#[derive(Debug, Deserialize)]
struct TotalsQuery {
    /// Without it, the whole ledger.
    account: Option<String>,
}

async fn create_payment(
    State(ledger): State<Ledger>,
    idempotency: Option<Extension<IdempotencyContext>>,
    headers: HeaderMap,
    payment: Result<Json<NewPayment>, JsonRejection>,
) -> Response {
    let hooks = simulated_delay(&headers).and_then(|d| Ok((d, simulated_failure(&headers)?)));
    let (delay, fail) = match hooks {
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

    if let Some(delay) = delay {
        tokio::time::sleep(delay).await;
    }
    if let Some(status) = fail {
        // Nothing happened: the IdempotencyLayer releases the key, a retry runs again.
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
        // Just before the effect: a copy may take over a stalled claim until here.
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
    let recorded = ledger.record(payment.account, payment.amount_cents);
    (StatusCode::CREATED, Json(recorded)).into_response()
}

async fn totals(State(ledger): State<Ledger>, Query(query): Query<TotalsQuery>) -> Json<Totals> {
    Json(ledger.totals(query.account.as_deref()))
}

/// `x-simulate-delay-ms: N`; the error is the problem detail.
fn simulated_delay(headers: &HeaderMap) -> Result<Option<Duration>, &'static str> {
    let Some(value) = headers.get("x-simulate-delay-ms") else {
        return Ok(None);
    };
    let ms = value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok());
    match ms.map(Duration::from_millis) {
        Some(d) if d <= MAX_SIMULATED_DELAY => Ok(Some(d)),
        _ => Err("x-simulate-delay-ms must be a whole number of milliseconds, at most 30000"),
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
