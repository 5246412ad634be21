//! Servers for the checker to check, on loopback: retrysafe's own stack, a small
//! guard written from the convention alone (with defects that can be switched on), and
//! layers that break one thing of an answer. Each has a payments-like endpoint whose
//! handler takes a while (so copies overlap) and a ledger of its effects.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    dead_code,
    unreachable_pub,
    missing_docs
)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes, to_bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use retrysafe::DeadlineLayer;
use retrysafe::idempotency::{IdempotencyLayer, Principal};
use retrysafe::server::ServerLayers;
use retrysafe::wire::IdempotencyKey;
use retrysafe_conformance::{Command, Report, parse_args};

/// How long the handler works before its effect: long enough for copies sent at once
/// to find it in flight.
pub const HANDLER_TIME: Duration = Duration::from_millis(60);

/// The effects of one server: a payment id per effect.
#[derive(Clone, Default)]
pub struct Ledger {
    payments: Arc<Mutex<Vec<u64>>>,
    next: Arc<AtomicU64>,
}

impl Ledger {
    pub fn count(&self) -> usize {
        self.payments.lock().unwrap().len()
    }
}

/// The endpoint: works a while, records one payment, answers 201 with its id.
async fn pay(State(ledger): State<Ledger>, body: Bytes) -> Response {
    tokio::time::sleep(HANDLER_TIME).await;
    let id = ledger.next.fetch_add(1, Ordering::SeqCst);
    ledger.payments.lock().unwrap().push(id);
    let order: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let answer = serde_json::json!({ "id": format!("pay-{id}"), "order": order });
    (StatusCode::CREATED, Json(answer)).into_response()
}

/// The ledger as a JSON array, one element per effect.
async fn ledger_array(State(ledger): State<Ledger>) -> Json<Vec<u64>> {
    Json(ledger.payments.lock().unwrap().clone())
}

/// The ledger as `{"count": N}`.
async fn ledger_count(State(ledger): State<Ledger>) -> Json<serde_json::Value> {
    Json(serde_json::json!({ "count": ledger.count() }))
}

/// A running server: its address and its ledger.
pub struct Server {
    pub base: String,
    pub ledger: Ledger,
}

impl Server {
    /// The checker's arguments for this server: the endpoint, a body, and the ledger
    /// (an array at `/ledger`, a count at `/count`).
    pub fn args(&self) -> Vec<String> {
        vec![
            "--url".to_owned(),
            format!("{}/payments", self.base),
            "--header".to_owned(),
            "authorization: Bearer conformance".to_owned(),
            "--body".to_owned(),
            r#"{"account":"acct-1","amount_cents":100}"#.to_owned(),
            "--ledger-url".to_owned(),
            format!("{}/ledger", self.base),
        ]
    }

    /// Runs the checker against this server with [`args`](Self::args).
    pub async fn check(&self) -> Report {
        check(&self.args()).await
    }
}

/// Runs the checker with a command line.
pub async fn check(args: &[String]) -> Report {
    let Command::Check(options) = parse_args(args.iter().map(Into::into)).unwrap() else {
        panic!("not a check: {args:?}");
    };
    retrysafe_conformance::check(&options).await
}

async fn serve(app: Router, ledger: Ledger) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Server { base, ledger }
}

/// The `Authorization: Bearer T` principal.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let principal = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("anonymous")
        .to_owned();
    request.extensions_mut().insert(Principal::new(principal));
    next.run(request).await
}

/// retrysafe's stack: the server `DeadlineLayer` outermost, authentication, the
/// `IdempotencyLayer` requiring a key, the handler. `breakage` wraps the whole
/// (outermost): it stands for a proxy or a framework layer that changes answers.
pub async fn retrysafe_stack(breakage: Option<Breakage>) -> Server {
    let ledger = Ledger::default();
    let guard = ServerLayers::new(IdempotencyLayer::in_memory().require_key())
        .authentication(middleware::from_fn(authenticate))
        .build()
        .unwrap();
    let mut app = Router::new()
        .route("/payments", post(pay))
        .with_state(ledger.clone())
        .layer(guard)
        .layer(DeadlineLayer::server())
        .merge(routes_open(&ledger));
    if let Some(breakage) = breakage {
        app = app.layer(middleware::from_fn_with_state(breakage, break_answer));
    }
    serve(app, ledger).await
}

fn routes_open(ledger: &Ledger) -> Router<()> {
    Router::new()
        .route("/ledger", get(ledger_array))
        .route("/count", get(ledger_count))
        .with_state(ledger.clone())
}

/// One thing an outer layer breaks in the answers of a correct server.
#[derive(Debug, Clone, Copy)]
pub enum Breakage {
    /// Removes `idempotent-replayed`.
    UnmarkedReplays,
    /// Removes `retry-after` from 409 answers.
    NoRetryAfterOn409,
    /// Renames the problem type `key-invalid` to `invalid-key`.
    RenamedKeyInvalid,
    /// Answers problems as `application/json`.
    ProblemsAsJson,
    /// Removes `content-type` from replays.
    ReplaysWithoutContentType,
}

async fn break_answer(State(breakage): State<Breakage>, request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let replayed = response.headers().contains_key("idempotent-replayed");
    let conflict = response.status() == StatusCode::CONFLICT;
    let headers = response.headers_mut();
    match breakage {
        Breakage::UnmarkedReplays => {
            headers.remove("idempotent-replayed");
        }
        Breakage::NoRetryAfterOn409 if conflict => {
            headers.remove(header::RETRY_AFTER);
        }
        Breakage::ReplaysWithoutContentType if replayed => {
            headers.remove(header::CONTENT_TYPE);
        }
        Breakage::ProblemsAsJson
            if headers.get(header::CONTENT_TYPE)
                == Some(&HeaderValue::from_static("application/problem+json")) =>
        {
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        }
        Breakage::RenamedKeyInvalid => {
            let (mut parts, body) = response.into_parts();
            let body = to_bytes(body, 1 << 20).await.unwrap();
            let text = String::from_utf8_lossy(&body).replace(
                "urn:retrysafe:problem:key-invalid",
                "urn:retrysafe:problem:invalid-key",
            );
            parts.headers.remove(header::CONTENT_LENGTH);
            return Response::from_parts(parts, Body::from(text));
        }
        _ => {}
    }
    response
}

/// What the small guard gets wrong, on purpose.
#[derive(Debug, Clone, Copy, Default)]
pub struct Defects {
    /// Keeps no record of a request in flight: copies at once all run (a
    /// check-then-act guard).
    pub runs_copies_in_flight: bool,
    /// Replays a key's answer whatever the request: no fingerprint.
    pub ignores_mismatch: bool,
}

enum Record {
    InFlight {
        fingerprint: Vec<u8>,
    },
    Done {
        fingerprint: Vec<u8>,
        status: StatusCode,
        content_type: Option<HeaderValue>,
        body: Bytes,
    },
}

#[derive(Clone, Default)]
struct Guard {
    defects: Defects,
    records: Arc<Mutex<HashMap<String, Record>>>,
}

/// A problem+json answer of the convention.
fn problem(status: StatusCode, slug: &str, title: &str) -> Response {
    // Written by hand: the members go in the convention's order.
    let body = format!(
        r#"{{"type":"urn:retrysafe:problem:{slug}","title":"{title}","status":{},"detail":"{title}"}}"#,
        status.as_u16()
    );
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

fn with_header(mut response: Response, name: &'static str, value: &'static str) -> Response {
    response
        .headers_mut()
        .insert(name, HeaderValue::from_static(value));
    response
}

/// The small guard: keys parsed by the convention's grammar, records in a map, the
/// handler run in a task of its own (a closed connection does not stop it), its
/// answer stored before it is sent.
async fn guard(State(guard): State<Guard>, request: Request, next: Next) -> Response {
    if request.method() != Method::POST {
        return next.run(request).await;
    }
    let keys: Vec<_> = request
        .headers()
        .get_all("idempotency-key")
        .iter()
        .collect();
    let key = match keys.as_slice() {
        [] => {
            return problem(
                StatusCode::BAD_REQUEST,
                "key-missing",
                "Idempotency-Key is required",
            );
        }
        [one] => match IdempotencyKey::parse(one.as_bytes()) {
            Ok(key) => key.as_str().to_owned(),
            Err(_) => {
                return problem(
                    StatusCode::BAD_REQUEST,
                    "key-invalid",
                    "Idempotency-Key is invalid",
                );
            }
        },
        _ => {
            return problem(
                StatusCode::BAD_REQUEST,
                "key-invalid",
                "Idempotency-Key is invalid",
            );
        }
    };
    let (parts, body) = request.into_parts();
    let body = to_bytes(body, 1 << 20).await.unwrap_or_default();
    let mut fingerprint = format!("{} {} ", parts.method, parts.uri).into_bytes();
    fingerprint.extend_from_slice(&body);
    let mismatch = || {
        with_header(
            problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "key-mismatch",
                "Idempotency-Key was used with a different request",
            ),
            "do-not-retry",
            "1",
        )
    };
    {
        let mut records = guard.records.lock().unwrap();
        let same = |f: &Vec<u8>| *f == fingerprint || guard.defects.ignores_mismatch;
        match records.get(&key) {
            Some(Record::Done {
                fingerprint: f,
                status,
                content_type,
                body,
            }) if same(f) => {
                let mut response = (*status, body.clone()).into_response();
                if let Some(ct) = content_type {
                    response
                        .headers_mut()
                        .insert(header::CONTENT_TYPE, ct.clone());
                }
                return with_header(response, "idempotent-replayed", "true");
            }
            Some(Record::Done { .. }) => return mismatch(),
            Some(Record::InFlight { fingerprint: f }) if !same(f) => return mismatch(),
            Some(Record::InFlight { .. }) if !guard.defects.runs_copies_in_flight => {
                let busy = problem(
                    StatusCode::CONFLICT,
                    "request-in-flight",
                    "A request with this Idempotency-Key is in flight",
                );
                return with_header(busy, "retry-after", "1");
            }
            _ => {}
        }
        if !guard.defects.runs_copies_in_flight {
            records.insert(
                key.clone(),
                Record::InFlight {
                    fingerprint: fingerprint.clone(),
                },
            );
        }
    }
    let request = Request::from_parts(parts, Body::from(body));
    let records = Arc::clone(&guard.records);
    let task = tokio::spawn(async move {
        let response = next.run(request).await;
        let (parts, body) = response.into_parts();
        let body = to_bytes(body, 1 << 20).await.unwrap_or_default();
        let content_type = parts.headers.get(header::CONTENT_TYPE).cloned();
        records.lock().unwrap().insert(
            key,
            Record::Done {
                fingerprint,
                status: parts.status,
                content_type,
                body: body.clone(),
            },
        );
        Response::from_parts(parts, Body::from(body))
    });
    task.await.unwrap()
}

/// The small guard in front of the endpoint, behind retrysafe's server
/// `DeadlineLayer` (unless `deadline` is off).
pub async fn small_guard(defects: Defects, deadline: bool) -> Server {
    let ledger = Ledger::default();
    let guard = Guard {
        defects,
        records: Arc::default(),
    };
    let guarded = Router::new()
        .route("/payments", post(pay))
        .with_state(ledger.clone())
        .layer(middleware::from_fn_with_state(guard, self::guard));
    let guarded = if deadline {
        guarded.layer(DeadlineLayer::server())
    } else {
        guarded
    };
    serve(guarded.merge(routes_open(&ledger)), ledger).await
}
