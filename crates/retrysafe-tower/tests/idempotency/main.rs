//! HTTP-level tests of the IdempotencyLayer: an axum `Router` driven with `oneshot`,
//! one test (or more) for every row of the layer's decision table (see the module docs),
//! grouped by concern: keys, limits, replays, duplicates, scopes, unknown outcomes,
//! holders, store failures, the handler's context and configuration. This file holds
//! the app and the requests they share.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    missing_docs
)]

mod configuration;
mod context;
mod duplicates;
mod holders;
mod keys;
mod limits;
mod outcome_unknown;
mod replays;
mod scopes;
mod store_failures;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, to_bytes};
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use retrysafe_test_support::bearer::auth;
use retrysafe_tower::idempotency::{
    EventKind, IdempotencyContext, IdempotencyEvent, IdempotencyLayer, NoEffect, ProblemKind,
    UnknownOutcome,
};
use tower::ServiceExt;

/// What the test handler did.
#[derive(Default)]
struct Effects {
    count: AtomicUsize,
}

impl Effects {
    fn get(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

/// A handler steered by request headers:
/// `x-status: N`, `x-sleep-ms: N`, `x-no-effect`, `x-panic`, `x-big: N` (body size),
/// `x-commit` (declare the commit point before the effect).
async fn handler(
    Extension(effects): Extension<Arc<Effects>>,
    ctx: Option<Extension<IdempotencyContext>>,
    req: Request,
) -> Response {
    let h = req.headers().clone();
    let num = |name: &str| -> Option<u64> { h.get(name)?.to_str().ok()?.parse().ok() };
    if let Some(ms) = num("x-sleep-ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if h.contains_key("x-panic") {
        panic!("handler panicked on purpose");
    }
    if h.contains_key("x-commit")
        && let Some(Extension(ctx)) = &ctx
    {
        ctx.commit_point().await.unwrap();
    }
    let n = effects.count.fetch_add(1, Ordering::SeqCst) + 1;
    let status = num("x-status").map_or(StatusCode::CREATED, |s| {
        StatusCode::from_u16(s as u16).unwrap()
    });
    let body = to_bytes(req.into_body(), usize::MAX).await.unwrap();
    let payload = match num("x-big") {
        Some(size) => Bytes::from(vec![b'x'; size as usize]),
        None => Bytes::from(format!("effect {n}: {}", String::from_utf8_lossy(&body))),
    };
    let mut res = (status, payload).into_response();
    res.headers_mut()
        .insert("set-cookie", HeaderValue::from_static("session=abc"));
    res.headers_mut()
        .insert("x-request-id", HeaderValue::from_static("req-1"));
    res.headers_mut()
        .append("link", HeaderValue::from_static("<a>; rel=next"));
    res.headers_mut()
        .append("link", HeaderValue::from_static("<b>; rel=prev"));
    res.headers_mut()
        .insert("x-custom", HeaderValue::from_static("kept"));
    if h.contains_key("x-no-effect") {
        res.extensions_mut().insert(NoEffect);
    }
    res
}

fn make_app(layer: IdempotencyLayer) -> (Router, Arc<Effects>) {
    let effects = Arc::new(Effects::default());
    let router = Router::new()
        .route(
            "/pay",
            post(handler).patch(handler).get(handler).put(handler),
        )
        .layer(layer)
        .layer(axum::middleware::map_request(auth))
        .layer(Extension(Arc::clone(&effects)));
    (router, effects)
}

fn post_req(key: Option<&str>, body: &'static str) -> axum::http::request::Builder {
    let _ = body;
    let mut b = Request::post("/pay").header("content-type", "text/plain");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b
}

fn req(key: &str, body: &'static str) -> Request {
    post_req(Some(key), body).body(Body::from(body)).unwrap()
}

async fn send(app: &Router, r: Request) -> (StatusCode, axum::http::HeaderMap, Bytes) {
    let res = app.clone().oneshot(r).await.unwrap();
    let (parts, body) = res.into_parts();
    (
        parts.status,
        parts.headers,
        to_bytes(body, usize::MAX).await.unwrap(),
    )
}

fn problem_type(body: &Bytes) -> String {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap();
    v["type"].as_str().unwrap().to_owned()
}

fn assert_problem(res: &(StatusCode, axum::http::HeaderMap, Bytes), kind: ProblemKind) {
    assert_eq!(res.0, kind.status(), "status of {kind}: body {:?}", res.2);
    assert_eq!(res.1["content-type"], "application/problem+json");
    assert_eq!(problem_type(&res.2), kind.type_uri());
    let v: serde_json::Value = serde_json::from_slice(&res.2).unwrap();
    assert_eq!(v["status"], kind.status().as_u16());
    assert!(v["title"].is_string() && v["detail"].is_string());
    assert_eq!(
        res.1.get("do-not-retry").is_some(),
        kind.do_not_retry(),
        "do-not-retry on {kind}"
    );
}

#[derive(Clone, Default)]
struct Recorder {
    events: Arc<Mutex<Vec<EventKind>>>,
    unknown: Arc<Mutex<Vec<UnknownOutcome>>>,
}

impl Recorder {
    fn attach(&self, layer: IdempotencyLayer) -> IdempotencyLayer {
        let events = Arc::clone(&self.events);
        let unknown = Arc::clone(&self.unknown);
        layer
            .on_event(move |e: &IdempotencyEvent| events.lock().unwrap().push(e.kind))
            .on_outcome_unknown(move |u: &UnknownOutcome| unknown.lock().unwrap().push(u.clone()))
    }
    fn count(&self, kind: EventKind) -> usize {
        self.events
            .lock()
            .unwrap()
            .iter()
            .filter(|k| **k == kind)
            .count()
    }
}
