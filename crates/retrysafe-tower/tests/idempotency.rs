//! HTTP-level tests of the IdempotencyLayer: an axum `Router` driven with `oneshot`,
//! one test (or more) for every row of the layer's decision table (see the module docs).
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    missing_docs
)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, to_bytes};
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use bytes::Bytes;
use retrysafe_core::idempotency::{CommitPoint, Fingerprinter, RecordId, Scope, Token};
use retrysafe_core::store::{Claim, ClaimOutcome, FaultyStore, IdempotencyStore};
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_memory::MemoryStore;
use retrysafe_tower::idempotency::{
    EventKind, IdempotencyContext, IdempotencyEvent, IdempotencyLayer, NoEffect, Principal,
    ProblemKind, UnknownOutcome, UnknownReason,
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

use retrysafe_test_support::bearer::auth;

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

// Row: no key, route does not require one → passes through, not guarded.
#[tokio::test]
async fn no_key_passes_through_unguarded() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory());
    for _ in 0..2 {
        let r = send(&app, post_req(None, "").body(Body::from("a")).unwrap()).await;
        assert_eq!(r.0, StatusCode::CREATED);
        assert!(r.1.get("idempotent-replayed").is_none());
        assert_eq!(
            r.1["set-cookie"], "session=abc",
            "an unguarded response is untouched"
        );
    }
    assert_eq!(effects.get(), 2);
}

// Row: no key with require_key → 400, no record.
#[tokio::test]
async fn require_key_refuses_a_request_without_key() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory().require_key());
    let r = send(&app, post_req(None, "").body(Body::from("a")).unwrap()).await;
    assert_problem(&r, ProblemKind::KeyMissing);
    assert_eq!(effects.get(), 0);
}

// Row: key empty, over 255 characters, or not printable ASCII → 400.
#[tokio::test]
async fn invalid_keys_are_refused() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory());
    let long = "k".repeat(256);
    let max = "k".repeat(255);
    let bad: Vec<HeaderValue> = vec![
        HeaderValue::from_static(""),
        HeaderValue::from_static("   "),
        HeaderValue::from_static("\"\""),
        HeaderValue::from_str(&long).unwrap(),
        HeaderValue::from_bytes("clé".as_bytes()).unwrap(),
        HeaderValue::from_bytes(b"a\tb").unwrap(),
        HeaderValue::from_bytes(b"\xff\xfe").unwrap(),
        HeaderValue::from_static("two words"),
    ];
    for value in bad {
        let r = Request::post("/pay")
            .header("idempotency-key", value.clone())
            .body(Body::from("a"))
            .unwrap();
        let r = send(&app, r).await;
        assert_problem(&r, ProblemKind::KeyInvalid);
    }
    // The key sent twice is ambiguous.
    let r = Request::post("/pay")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(Body::from("a"))
        .unwrap();
    assert_problem(&send(&app, r).await, ProblemKind::KeyInvalid);
    assert_eq!(effects.get(), 0);
    // 255 characters, and the sf-string form with a space, are fine.
    assert_eq!(send(&app, req(&max, "a")).await.0, StatusCode::CREATED);
    assert_eq!(
        send(&app, req("\"two words\"", "a")).await.0,
        StatusCode::CREATED
    );
    assert_eq!(effects.get(), 2);
}

// Both wire forms of one key are the same key.
#[tokio::test]
async fn quoted_and_bare_forms_are_one_key() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory());
    assert_eq!(send(&app, req("abc-1", "a")).await.0, StatusCode::CREATED);
    let r = send(&app, req("\"abc-1\"", "a")).await;
    assert_eq!(r.1["idempotent-replayed"], "true");
    assert_eq!(effects.get(), 1);
}

// Row: request body over the limit → 413 before any claim.
#[tokio::test]
async fn oversize_body_is_refused_before_any_claim() {
    let layer = IdempotencyLayer::in_memory()
        .max_request_body(1024)
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let big = vec![b'x'; 1025];
    let r = send(
        &app,
        post_req(Some("k"), "")
            .body(Body::from(big.clone()))
            .unwrap(),
    )
    .await;
    assert_problem(&r, ProblemKind::BodyTooLarge);
    // Streamed without a content-length.
    let chunks = futures_util::stream::iter(
        big.chunks(100)
            .map(|c| Ok::<_, std::io::Error>(Bytes::copy_from_slice(c)))
            .collect::<Vec<_>>(),
    );
    let r = send(
        &app,
        post_req(Some("k"), "")
            .body(Body::from_stream(chunks))
            .unwrap(),
    )
    .await;
    assert_problem(&r, ProblemKind::BodyTooLarge);
    assert_eq!(effects.get(), 0);
    // No record was made: the same key with a small body runs.
    assert_eq!(send(&app, req("k", "small")).await.0, StatusCode::CREATED);
    assert_eq!(effects.get(), 1);
}

// Rows: first request, then completed → replay with status, body, stable headers.
#[tokio::test]
async fn completed_request_is_replayed_with_stable_headers() {
    let rec = Recorder::default();
    let (app, effects) = make_app(rec.attach(IdempotencyLayer::in_memory()));
    let first = send(&app, req("k1", "hello")).await;
    assert_eq!(first.0, StatusCode::CREATED);
    assert!(first.1.get("idempotent-replayed").is_none());
    assert_eq!(
        first.1["set-cookie"], "session=abc",
        "the first answer is the handler's own"
    );
    let again = send(&app, req("k1", "hello")).await;
    assert_eq!(again.0, StatusCode::CREATED);
    assert_eq!(again.2, first.2);
    assert_eq!(again.2, Bytes::from("effect 1: hello"));
    assert_eq!(again.1["idempotent-replayed"], "true");
    assert_eq!(again.1["x-custom"], "kept");
    assert_eq!(again.1["content-type"], first.1["content-type"]);
    let links: Vec<_> = again.1.get_all("link").iter().collect();
    assert_eq!(
        links,
        ["<a>; rel=next", "<b>; rel=prev"],
        "multi-value headers intact"
    );
    assert!(
        again.1.get("set-cookie").is_none(),
        "set-cookie is never replayed"
    );
    assert!(
        again.1.get("x-request-id").is_none(),
        "x-request-id is never replayed"
    );
    assert_eq!(effects.get(), 1);
    assert_eq!(rec.count(EventKind::Claimed), 1);
    assert_eq!(rec.count(EventKind::Replayed), 1);
}

// A configured deny list keeps a header out of replays.
#[tokio::test]
async fn deny_header_is_not_replayed() {
    let layer = IdempotencyLayer::in_memory().deny_header("x-custom".parse().unwrap());
    let (app, _) = make_app(layer);
    send(&app, req("k", "a")).await;
    let again = send(&app, req("k", "a")).await;
    assert!(again.1.get("x-custom").is_none());
    assert_eq!(again.1["idempotent-replayed"], "true");
}

// Row: same key, same fingerprint, in flight → 409 with retry-after.
#[tokio::test]
async fn in_flight_duplicate_gets_409_with_retry_after() {
    let rec = Recorder::default();
    let (app, effects) = make_app(rec.attach(IdempotencyLayer::in_memory()));
    let slow = post_req(Some("k"), "")
        .header("x-sleep-ms", "300")
        .body(Body::from("a"))
        .unwrap();
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, slow).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let dup = send(
        &app,
        post_req(Some("k"), "")
            .header("x-sleep-ms", "300")
            .body(Body::from("a"))
            .unwrap(),
    )
    .await;
    assert_problem(&dup, ProblemKind::InFlight);
    assert_eq!(dup.1["retry-after"], "1");
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(effects.get(), 1);
    assert_eq!(rec.count(EventKind::Conflict), 1);
}

// Row: in flight with wait_for_in_flight → wait and replay.
#[tokio::test]
async fn in_flight_duplicate_waits_and_replays() {
    let layer = IdempotencyLayer::in_memory()
        .wait_for_in_flight(Duration::from_secs(5))
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let mk = || {
        post_req(Some("k"), "")
            .header("x-sleep-ms", "200")
            .body(Body::from("a"))
            .unwrap()
    };
    let first = tokio::spawn({
        let app = app.clone();
        let r = mk();
        async move { send(&app, r).await }
    });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let dup = send(&app, mk()).await;
    let first = first.await.unwrap();
    assert_eq!(dup.0, StatusCode::CREATED);
    assert_eq!(dup.2, first.2);
    assert_eq!(dup.1["idempotent-replayed"], "true");
    assert_eq!(effects.get(), 1);
}

// Row: wait mode past its maximum → 409.
#[tokio::test(start_paused = true)]
async fn wait_past_its_maximum_gets_409() {
    let layer = IdempotencyLayer::in_memory()
        .wait_for_in_flight(Duration::from_secs(2))
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let mk = || {
        post_req(Some("k"), "")
            .header("x-sleep-ms", "8000")
            .body(Body::from("a"))
            .unwrap()
    };
    let first = tokio::spawn({
        let app = app.clone();
        let r = mk();
        async move { send(&app, r).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let start = tokio::time::Instant::now();
    let dup = send(&app, mk()).await;
    assert_problem(&dup, ProblemKind::InFlight);
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(effects.get(), 1);
}

// Row: waiters whose holder released race to claim: exactly one runs next.
#[tokio::test]
async fn waiters_race_to_claim_after_a_release() {
    let layer = IdempotencyLayer::in_memory()
        .wait_for_in_flight(Duration::from_secs(5))
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let first = tokio::spawn({
        let app = app.clone();
        let r = post_req(Some("k"), "")
            .header("x-sleep-ms", "200")
            .header("x-status", "503")
            .header("x-no-effect", "1")
            .body(Body::from("a"))
            .unwrap();
        async move { send(&app, r).await }
    });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let mut waiters = Vec::new();
    for _ in 0..8 {
        let app = app.clone();
        waiters.push(tokio::spawn(async move { send(&app, req("k", "a")).await }));
    }
    assert_eq!(first.await.unwrap().0, StatusCode::SERVICE_UNAVAILABLE);
    let mut bodies = Vec::new();
    for w in waiters {
        let r = w.await.unwrap();
        assert_eq!(r.0, StatusCode::CREATED);
        bodies.push(r.2);
    }
    assert!(
        bodies.windows(2).all(|w| w[0] == w[1]),
        "all waiters see one execution"
    );
    assert_eq!(effects.get(), 2, "the released first call and one re-run");
}

// Row: same key, different fingerprint, completed or in flight → 422 do-not-retry.
#[tokio::test]
async fn other_request_with_same_key_is_a_mismatch() {
    let rec = Recorder::default();
    let (app, effects) = make_app(rec.attach(IdempotencyLayer::in_memory()));
    send(&app, req("k", "amount=1")).await;
    let r = send(&app, req("k", "amount=2")).await;
    assert_problem(&r, ProblemKind::KeyMismatch);
    // Another path, query, method or content-type is another request too.
    let r = Request::post("/pay?x=1")
        .header("idempotency-key", "k")
        .header("content-type", "text/plain")
        .body(Body::from("amount=1"))
        .unwrap();
    assert_eq!(send(&app, r).await.0, StatusCode::UNPROCESSABLE_ENTITY);
    let r = Request::patch("/pay")
        .header("idempotency-key", "k")
        .header("content-type", "text/plain")
        .body(Body::from("amount=1"))
        .unwrap();
    assert_eq!(send(&app, r).await.0, StatusCode::UNPROCESSABLE_ENTITY);
    let r = Request::post("/pay")
        .header("idempotency-key", "k")
        .header("content-type", "application/json")
        .body(Body::from("amount=1"))
        .unwrap();
    assert_eq!(send(&app, r).await.0, StatusCode::UNPROCESSABLE_ENTITY);
    // In flight.
    let slow = post_req(Some("k2"), "")
        .header("x-sleep-ms", "200")
        .body(Body::from("a"))
        .unwrap();
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, slow).await }
    });
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_problem(&send(&app, req("k2", "b")).await, ProblemKind::KeyMismatch);
    first.await.unwrap();
    assert_eq!(effects.get(), 2);
    assert_eq!(rec.count(EventKind::Mismatch), 5);
}

// Row: same key, different scope → an independent record.
#[tokio::test]
async fn same_key_in_another_scope_is_independent() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory());
    let as_user = |who: &str| {
        post_req(Some("k"), "")
            .header("authorization", format!("Bearer {who}"))
            .body(Body::from("a"))
            .unwrap()
    };
    let a = send(&app, as_user("alice")).await;
    let b = send(&app, as_user("bob")).await;
    assert!(a.1.get("idempotent-replayed").is_none());
    assert!(
        b.1.get("idempotent-replayed").is_none(),
        "never a replay across scopes"
    );
    assert_ne!(a.2, b.2);
    assert_eq!(send(&app, as_user("alice")).await.2, a.2);
    assert_eq!(effects.get(), 2);
}

// Scope rules: global and by Authorization hash.
#[tokio::test]
async fn explicit_scope_rules() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory().global_scope());
    let as_user = |who: &str| {
        post_req(Some("k"), "")
            .header("authorization", format!("Bearer {who}"))
            .body(Body::from("a"))
            .unwrap()
    };
    send(&app, as_user("alice")).await;
    assert_eq!(
        send(&app, as_user("bob")).await.1["idempotent-replayed"],
        "true"
    );
    assert_eq!(effects.get(), 1);

    let (app, effects) =
        app_without_auth(IdempotencyLayer::in_memory().scope_by_authorization_hash());
    send(&app, as_user("alice")).await;
    assert!(
        send(&app, as_user("bob"))
            .await
            .1
            .get("idempotent-replayed")
            .is_none()
    );
    assert_eq!(effects.get(), 2);
    assert_problem(&send(&app, req("k", "a")).await, ProblemKind::ScopeMissing);

    let layer = IdempotencyLayer::in_memory().scope_by(|parts| {
        parts
            .headers
            .get("x-tenant")
            .map(|v| Scope::new(v.as_bytes()))
    });
    let (app, effects) = app_without_auth(layer);
    let tenant = |t: &str| {
        post_req(Some("k"), "")
            .header("x-tenant", t)
            .body(Body::from("a"))
            .unwrap()
    };
    send(&app, tenant("t1")).await;
    send(&app, tenant("t2")).await;
    assert_eq!(
        send(&app, tenant("t1")).await.1["idempotent-replayed"],
        "true"
    );
    assert_eq!(effects.get(), 2);
}

fn app_without_auth(layer: IdempotencyLayer) -> (Router, Arc<Effects>) {
    let effects = Arc::new(Effects::default());
    let router = Router::new()
        .route("/pay", post(handler))
        .layer(layer)
        .layer(Extension(Arc::clone(&effects)));
    (router, effects)
}

// No principal: the layer refuses to guard (500 scope-missing), and the handler never runs.
#[tokio::test]
async fn no_principal_is_a_configuration_error() {
    let (app, effects) = app_without_auth(IdempotencyLayer::in_memory());
    assert_problem(&send(&app, req("k", "a")).await, ProblemKind::ScopeMissing);
    assert_eq!(effects.get(), 0);
    // Without a key the request is not guarded and passes.
    assert_eq!(
        send(&app, post_req(None, "").body(Body::empty()).unwrap())
            .await
            .0,
        StatusCode::CREATED
    );
}

// Row: 2xx, 3xx and 4xx other than 401/403/408/429 are stored.
#[tokio::test]
async fn stored_statuses_are_replayed() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory());
    for (i, status) in [200u16, 201, 204, 302, 400, 404, 409, 422]
        .into_iter()
        .enumerate()
    {
        let key = format!("k{i}");
        let mk = || {
            post_req(Some(&key), "")
                .header("x-status", status.to_string())
                .body(Body::from("a"))
                .unwrap()
        };
        let first = send(&app, mk()).await;
        let again = send(&app, mk()).await;
        assert_eq!(first.0.as_u16(), status);
        assert_eq!(again.0.as_u16(), status);
        assert_eq!(
            again.1["idempotent-replayed"], "true",
            "{status} is replayed"
        );
        assert_eq!(again.2, first.2);
        assert_eq!(effects.get(), i + 1);
    }
}

// Row: 401, 403, 429 or NoEffect → released: a retry runs the handler again.
#[tokio::test]
async fn released_statuses_run_again() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory());
    let mut expected = 0;
    for (i, (status, no_effect)) in [
        (401u16, false),
        (403, false),
        (429, false),
        (503, true),
        (500, true),
        (201, true),
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("k{i}");
        let mut b = post_req(Some(&key), "").header("x-status", status.to_string());
        if no_effect {
            b = b.header("x-no-effect", "1");
        }
        let first = send(&app, b.body(Body::from("a")).unwrap()).await;
        assert_eq!(first.0.as_u16(), status);
        assert!(
            first.1.get("do-not-retry").is_none(),
            "a released answer may be retried"
        );
        let retry = send(&app, req(&key, "a")).await;
        assert_eq!(retry.0, StatusCode::CREATED, "the retry ran");
        assert!(retry.1.get("idempotent-replayed").is_none());
        expected += 2;
        assert_eq!(effects.get(), expected);
    }
}

// Row: 5xx or 408 without NoEffect → answered as the handler did, do-not-retry;
// later copies get 500 outcome-unknown; the reconcile hook is called once.
#[tokio::test]
async fn server_errors_become_outcome_unknown() {
    let rec = Recorder::default();
    let (app, effects) = make_app(rec.attach(IdempotencyLayer::in_memory()));
    for (i, status) in [500u16, 502, 503, 408].into_iter().enumerate() {
        let key = format!("k{i}");
        let r = post_req(Some(&key), "")
            .header("x-status", status.to_string())
            .body(Body::from("a"))
            .unwrap();
        let first = send(&app, r).await;
        assert_eq!(first.0.as_u16(), status);
        assert_eq!(first.1["do-not-retry"], "1");
        assert!(first.2.starts_with(b"effect"), "the handler's own body");
        for _ in 0..2 {
            let later = send(&app, req(&key, "a")).await;
            assert_problem(&later, ProblemKind::OutcomeUnknown);
        }
    }
    assert_eq!(effects.get(), 4, "never re-run");
    let unknown = rec.unknown.lock().unwrap().clone();
    assert_eq!(unknown.len(), 4, "reconcile hook called once per record");
    assert_eq!(
        unknown[0].reason,
        UnknownReason::Status(StatusCode::INTERNAL_SERVER_ERROR)
    );
    assert_eq!(
        unknown[3].reason,
        UnknownReason::Status(StatusCode::REQUEST_TIMEOUT)
    );
}

// Row: a panicking handler → 500 problem, do-not-retry, outcome unknown.
#[tokio::test]
async fn panics_become_outcome_unknown() {
    let rec = Recorder::default();
    let (app, effects) = make_app(rec.attach(IdempotencyLayer::in_memory()));
    let r = post_req(Some("k"), "")
        .header("x-panic", "1")
        .body(Body::from("a"))
        .unwrap();
    assert_problem(&send(&app, r).await, ProblemKind::HandlerPanicked);
    assert_problem(
        &send(&app, req("k", "a")).await,
        ProblemKind::OutcomeUnknown,
    );
    assert_eq!(effects.get(), 0);
    assert_eq!(
        rec.unknown.lock().unwrap()[0].reason,
        UnknownReason::Panicked
    );
    // The service keeps working.
    assert_eq!(send(&app, req("k2", "a")).await.0, StatusCode::CREATED);
}

// Row: client disconnected mid-request → the handler runs to completion, is stored.
#[tokio::test(start_paused = true)]
async fn dropped_outer_future_still_stores_the_result() {
    let layer = IdempotencyLayer::in_memory();
    let shutdown = layer.shutdown_handle();
    let (app, effects) = make_app(layer);
    let r = post_req(Some("k"), "")
        .header("x-sleep-ms", "1000")
        .body(Body::from("a"))
        .unwrap();
    let outer = tokio::time::timeout(Duration::from_millis(100), app.clone().oneshot(r)).await;
    assert!(outer.is_err(), "the client gave up");
    assert_eq!(effects.get(), 0);
    assert_eq!(shutdown.in_flight(), 1, "the handler still runs");
    shutdown.clone().drain().await;
    assert_eq!(effects.get(), 1);
    let retry = send(
        &app,
        post_req(Some("k"), "")
            .header("x-sleep-ms", "1000")
            .body(Body::from("a"))
            .unwrap(),
    )
    .await;
    assert_eq!(retry.0, StatusCode::CREATED);
    assert_eq!(retry.1["idempotent-replayed"], "true");
    assert_eq!(effects.get(), 1);
}

/// Claims `key` for `who` directly in the store, as a holder that then dies.
async fn dead_holder(
    store: &MemoryStore,
    who: &str,
    key: &str,
    body: &'static str,
    cp: CommitPoint,
    lease: Duration,
) -> Token {
    let scope = Scope::from(&Principal::new(who));
    let id = RecordId::new(&scope, &IdempotencyKey::new(key).unwrap());
    let uri = "/pay".parse().unwrap();
    let mut headers = axum::http::HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("text/plain"));
    let fingerprint = Fingerprinter::default().fingerprint(
        &axum::http::Method::POST,
        &uri,
        &headers,
        body.as_bytes(),
    );
    let token = Token::random();
    let claim = Claim::new(token, fingerprint, lease, Duration::from_secs(3600), cp);
    assert_eq!(
        store.claim(&id, &claim).await.unwrap(),
        ClaimOutcome::Claimed { takeover: false }
    );
    token
}

fn record_id(who: &str, key: &str) -> RecordId {
    RecordId::new(
        &Scope::from(&Principal::new(who)),
        &IdempotencyKey::new(key).unwrap(),
    )
}

// Row: holder died before its commit point → after the lease, the next copy takes over.
#[tokio::test(start_paused = true)]
async fn dead_holder_before_commit_point_is_taken_over() {
    let store = MemoryStore::new();
    let rec = Recorder::default();
    let layer = rec.attach(IdempotencyLayer::new(store.clone()).handlers_declare_commit_point());
    let (app, effects) = make_app(layer);
    let lease = Duration::from_secs(10);
    dead_holder(&store, "anonymous", "k", "a", CommitPoint::Before, lease).await;
    assert_problem(&send(&app, req("k", "a")).await, ProblemKind::InFlight);
    tokio::time::advance(lease + Duration::from_millis(1)).await;
    let r = send(
        &app,
        post_req(Some("k"), "")
            .header("x-commit", "1")
            .body(Body::from("a"))
            .unwrap(),
    )
    .await;
    assert_eq!(r.0, StatusCode::CREATED, "taken over and run");
    assert_eq!(effects.get(), 1);
    assert_eq!(rec.count(EventKind::Takeover), 1);
    assert_eq!(
        send(&app, req("k", "a")).await.1["idempotent-replayed"],
        "true"
    );
}

// Row: holder died after its commit point (or never declared one) → outcome_unknown.
#[tokio::test(start_paused = true)]
async fn dead_holder_after_commit_point_is_outcome_unknown() {
    let store = MemoryStore::new();
    let rec = Recorder::default();
    let layer = rec.attach(IdempotencyLayer::new(store.clone()).handlers_declare_commit_point());
    let (app, effects) = make_app(layer);
    let lease = Duration::from_secs(10);
    let token = dead_holder(&store, "anonymous", "k", "a", CommitPoint::Before, lease).await;
    store
        .commit_point(&record_id("anonymous", "k"), token)
        .await
        .unwrap();
    dead_holder(
        &store,
        "anonymous",
        "undeclared",
        "a",
        CommitPoint::Undeclared,
        lease,
    )
    .await;
    tokio::time::advance(lease + Duration::from_millis(1)).await;
    assert_problem(
        &send(&app, req("k", "a")).await,
        ProblemKind::OutcomeUnknown,
    );
    assert_problem(
        &send(&app, req("undeclared", "a")).await,
        ProblemKind::OutcomeUnknown,
    );
    assert_problem(
        &send(&app, req("k", "a")).await,
        ProblemKind::OutcomeUnknown,
    );
    assert_eq!(effects.get(), 0, "never re-run");
    let unknown = rec.unknown.lock().unwrap().clone();
    assert_eq!(unknown.len(), 2, "reported once each");
    assert!(
        unknown
            .iter()
            .all(|u| u.reason == UnknownReason::LeaseExpired)
    );
}

// A live holder's lease is renewed every third; renewals stop at max_execution, where
// the handler is cancelled.
#[tokio::test(start_paused = true)]
async fn lease_is_renewed_until_max_execution() {
    let layer = IdempotencyLayer::in_memory()
        .lease(Duration::from_secs(10))
        .max_execution(Duration::from_secs(30))
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let stalled = tokio::spawn({
        let app = app.clone();
        let r = post_req(Some("k"), "")
            .header("x-sleep-ms", "100000")
            .body(Body::from("a"))
            .unwrap();
        async move { send(&app, r).await }
    });
    tokio::time::sleep(Duration::from_secs(25)).await;
    // 25 s in: past two unrenewed leases, but renewed, so still in flight.
    assert_problem(&send(&app, req("k", "a")).await, ProblemKind::InFlight);
    tokio::time::sleep(Duration::from_secs(10)).await;
    // 35 s in: renewals stopped at 30 s, where the undeclared holder was cancelled and
    // its record became outcome_unknown.
    assert_problem(
        &send(&app, req("k", "a")).await,
        ProblemKind::OutcomeUnknown,
    );
    let first = stalled.await.unwrap();
    assert_problem(&first, ProblemKind::OutcomeUnknown);
    assert_eq!(
        effects.get(),
        0,
        "the cancelled handler never got to its effect"
    );
}

// Declared commit point: a stalled holder past max_execution, still before its commit
// point, is cancelled and its key released: the next copy runs (a holder that died
// instead is taken over: `dead_holder_before_commit_point_is_taken_over`).
#[tokio::test(start_paused = true)]
async fn stalled_holder_before_commit_point_is_cancelled_and_released() {
    let rec = Recorder::default();
    let layer = rec.attach(
        IdempotencyLayer::in_memory()
            .handlers_declare_commit_point()
            .max_execution(Duration::from_secs(10))
            .build()
            .unwrap(),
    );
    let (app, effects) = make_app(layer);
    let stalled = tokio::spawn({
        let app = app.clone();
        let r = post_req(Some("k"), "")
            .header("x-sleep-ms", "60000")
            .header("x-commit", "1")
            .body(Body::from("a"))
            .unwrap();
        async move { app.clone().oneshot(r).await }
    });
    tokio::time::sleep(Duration::from_secs(20)).await;
    // Cancelled at 10 s, before its commit point: a retryable 5xx, the key released.
    let first = stalled.await.unwrap().unwrap();
    assert!(first.status().is_server_error());
    assert!(
        !first.headers().contains_key("do-not-retry"),
        "a retry is safe"
    );
    let r = send(&app, req("k", "a")).await;
    assert_eq!(r.0, StatusCode::CREATED, "the next copy runs");
    assert_eq!(
        rec.count(EventKind::Takeover),
        0,
        "released, not taken over"
    );
    assert_eq!(effects.get(), 1, "only the new holder's effect");
    assert_eq!(
        send(&app, req("k", "a")).await.1["idempotent-replayed"],
        "true"
    );
}

// Row: completion write fails after the handler ran → retried; the real response
// returned either way; completion_lost when it never lands.
#[tokio::test(start_paused = true)]
async fn completion_failures_are_retried_then_reported() {
    let store = FaultyStore::new(MemoryStore::new());
    let rec = Recorder::default();
    let (app, effects) = make_app(rec.attach(IdempotencyLayer::new(store.clone())));
    store.fail_next_completions(3);
    let first = send(&app, req("k", "a")).await;
    assert_eq!(first.0, StatusCode::CREATED);
    assert_eq!(
        send(&app, req("k", "a")).await.1["idempotent-replayed"],
        "true",
        "completed after retries"
    );
    assert_eq!(rec.count(EventKind::CompletionLost), 0);

    store.fail_next_completions(u32::MAX);
    let r = send(&app, req("k2", "a")).await;
    assert_eq!(r.0, StatusCode::CREATED, "the handler's real response");
    assert_eq!(rec.count(EventKind::CompletionLost), 1);
    assert_eq!(effects.get(), 2);
}

// Row: response over the storable limit → not-replayable marker; later copies 409.
#[tokio::test]
async fn oversize_response_is_streamed_once_and_never_rerun() {
    let layer = IdempotencyLayer::in_memory()
        .max_stored_response(1000)
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let mk = || {
        post_req(Some("k"), "")
            .header("x-big", "5000")
            .body(Body::from("a"))
            .unwrap()
    };
    let first = send(&app, mk()).await;
    assert_eq!(first.0, StatusCode::CREATED);
    assert_eq!(first.2.len(), 5000, "the first client gets the whole body");
    let later = send(&app, mk()).await;
    assert_problem(&later, ProblemKind::ResponseNotStored);
    assert_eq!(effects.get(), 1);
    // At the limit it is stored.
    let mk = || {
        post_req(Some("k2"), "")
            .header("x-big", "1000")
            .body(Body::from("a"))
            .unwrap()
    };
    send(&app, mk()).await;
    let again = send(&app, mk()).await;
    assert_eq!(again.2.len(), 1000);
    assert_eq!(again.1["idempotent-replayed"], "true");
}

// Row: store unavailable → 503 with retry-after (fail closed); fail_open runs unguarded.
#[tokio::test]
async fn store_failure_fails_closed_or_open() {
    let store = FaultyStore::new(MemoryStore::new());
    store.fail_all(true);
    let (app, effects) = make_app(IdempotencyLayer::new(store.clone()));
    let r = send(&app, req("k", "a")).await;
    assert_problem(&r, ProblemKind::StoreUnavailable);
    assert_eq!(r.1["retry-after"], "1");
    assert_eq!(effects.get(), 0);
    // Recovers without a restart.
    store.fail_all(false);
    assert_eq!(send(&app, req("k", "a")).await.0, StatusCode::CREATED);

    let store = FaultyStore::new(MemoryStore::new());
    store.fail_all(true);
    let (app, effects) = make_app(IdempotencyLayer::new(store).fail_open());
    assert_eq!(send(&app, req("k", "a")).await.0, StatusCode::CREATED);
    assert_eq!(send(&app, req("k", "a")).await.0, StatusCode::CREATED);
    assert_eq!(effects.get(), 2, "unguarded");
}

// A claim the store applied but whose reply was lost (a connection reset after the
// script ran) answers 503 and is released with its token in the background, so the
// retry runs the handler — not a key stuck in progress, nor an unknown outcome.
#[tokio::test(start_paused = true)]
async fn a_claim_applied_with_its_reply_lost_is_released_and_the_retry_runs() {
    let store = FaultyStore::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(store.clone());
    let shutdown = layer.shutdown_handle();
    let (app, effects) = make_app(layer);
    store.lose_next_replies(1);
    let lost = send(&app, req("k", "a")).await;
    assert_problem(&lost, ProblemKind::StoreUnavailable);
    assert_eq!(effects.get(), 0);
    shutdown.drain().await; // the background release
    let (retry, headers, _) = send(&app, req("k", "a")).await;
    assert_eq!(retry, StatusCode::CREATED);
    assert!(!headers.contains_key("idempotent-replayed"));
    assert_eq!(effects.get(), 1);
}

// Row: a slow store times out (1 s default, or the request deadline) → 503.
#[tokio::test(start_paused = true)]
async fn slow_store_times_out() {
    let store = FaultyStore::new(MemoryStore::new());
    store.delay(Duration::from_secs(5));
    let (app, effects) = make_app(IdempotencyLayer::new(store.clone()));
    let start = tokio::time::Instant::now();
    assert_problem(
        &send(&app, req("k", "a")).await,
        ProblemKind::StoreUnavailable,
    );
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    // A request deadline shortens it.
    let mut r = req("k", "a");
    r.extensions_mut()
        .insert(retrysafe_core::Deadline::after(Duration::from_millis(200)));
    let start = tokio::time::Instant::now();
    assert_problem(&send(&app, r).await, ProblemKind::StoreUnavailable);
    assert_eq!(start.elapsed(), Duration::from_millis(200));
    assert_eq!(effects.get(), 0);
}

// Row: too many guarded requests in flight → 503 with retry-after.
#[tokio::test]
async fn in_flight_bound_answers_503() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory().max_in_flight(1));
    let slow = tokio::spawn({
        let app = app.clone();
        let r = post_req(Some("a"), "")
            .header("x-sleep-ms", "200")
            .body(Body::from("a"))
            .unwrap();
        async move { send(&app, r).await }
    });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let r = send(&app, req("b", "a")).await;
    assert_problem(&r, ProblemKind::Overloaded);
    assert!(r.1.contains_key("retry-after"));
    assert_eq!(slow.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(send(&app, req("b", "a")).await.0, StatusCode::CREATED);
    assert_eq!(effects.get(), 2);
}

// Row: after the retention the key is new again.
#[tokio::test(start_paused = true)]
async fn retention_expires() {
    let (app, effects) = make_app(
        IdempotencyLayer::in_memory()
            .retention(Duration::from_secs(60))
            .build()
            .unwrap(),
    );
    send(&app, req("k", "a")).await;
    tokio::time::advance(Duration::from_secs(59)).await;
    assert_eq!(
        send(&app, req("k", "a")).await.1["idempotent-replayed"],
        "true"
    );
    tokio::time::advance(Duration::from_secs(2)).await;
    let r = send(&app, req("k", "b")).await;
    assert_eq!(r.0, StatusCode::CREATED);
    assert!(
        r.1.get("idempotent-replayed").is_none(),
        "a new key: even another body runs"
    );
    assert_eq!(effects.get(), 2);
}

// Other methods and gRPC requests pass untouched by default.
#[tokio::test]
async fn unguarded_methods_and_grpc_pass_untouched() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory());
    for _ in 0..2 {
        let r = Request::put("/pay")
            .header("idempotency-key", "k")
            .body(Body::from("a"))
            .unwrap();
        assert!(send(&app, r).await.1.get("idempotent-replayed").is_none());
        let r = Request::get("/pay")
            .header("idempotency-key", "k")
            .body(Body::empty())
            .unwrap();
        assert!(send(&app, r).await.1.get("idempotent-replayed").is_none());
        let r = Request::post("/pay")
            .header("idempotency-key", "k")
            .header("content-type", "application/grpc+proto")
            .body(Body::from("a"))
            .unwrap();
        assert!(send(&app, r).await.1.get("idempotent-replayed").is_none());
    }
    assert_eq!(effects.get(), 6);
    // Configured methods and gRPC opt-in.
    let (app, effects) = make_app(
        IdempotencyLayer::in_memory()
            .methods([axum::http::Method::PUT])
            .guard_grpc(),
    );
    for _ in 0..2 {
        let r = Request::put("/pay")
            .header("idempotency-key", "k")
            .body(Body::from("a"))
            .unwrap();
        send(&app, r).await;
    }
    assert_eq!(effects.get(), 1);
}

// 64 concurrent duplicates → exactly one execution: the 201s identical, the rest 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_run_once() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory());
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let app = app.clone();
        let r = post_req(Some("k"), "")
            .header("x-sleep-ms", "300")
            .body(Body::from("a"))
            .unwrap();
        tasks.push(tokio::spawn(async move { send(&app, r).await }));
    }
    let mut created = Vec::new();
    let mut conflicts = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r.0 {
            StatusCode::CREATED => created.push(r.2),
            StatusCode::CONFLICT => {
                assert_problem(&r, ProblemKind::InFlight);
                conflicts += 1;
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(effects.get(), 1);
    assert_eq!(created.len() + conflicts, 64);
    assert!(!created.is_empty());
    assert!(created.windows(2).all(|w| w[0] == w[1]));
}

// In wait mode all 64 get the identical 201.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_in_wait_mode_all_get_the_answer() {
    let layer = IdempotencyLayer::in_memory()
        .wait_for_in_flight(Duration::from_secs(5))
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let app = app.clone();
        let r = post_req(Some("k"), "")
            .header("x-sleep-ms", "300")
            .body(Body::from("a"))
            .unwrap();
        tasks.push(tokio::spawn(async move { send(&app, r).await }));
    }
    let mut bodies = Vec::new();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.0, StatusCode::CREATED);
        bodies.push(r.2);
    }
    assert_eq!(effects.get(), 1);
    assert!(bodies.windows(2).all(|w| w[0] == w[1]));
}

// A full completed-record cache, then a fresh claim and its duplicate: still one run.
#[tokio::test]
async fn full_cache_does_not_let_a_duplicate_run() {
    let store = MemoryStore::new().max_bytes(64 * 1024).build().unwrap();
    let (app, effects) = make_app(IdempotencyLayer::new(store.clone()));
    for i in 0..300 {
        let r = post_req(Some(&format!("fill-{i}")), "")
            .header("x-big", "1000")
            .body(Body::from("a"))
            .unwrap();
        assert_eq!(send(&app, r).await.0, StatusCode::CREATED);
    }
    assert!(store.cached_bytes() <= 64 * 1024);
    let before = effects.get();
    let slow = tokio::spawn({
        let app = app.clone();
        let r = post_req(Some("fresh"), "")
            .header("x-sleep-ms", "100")
            .body(Body::from("a"))
            .unwrap();
        async move { send(&app, r).await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_problem(&send(&app, req("fresh", "a")).await, ProblemKind::InFlight);
    assert_eq!(slow.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(
        send(&app, req("fresh", "a")).await.1["idempotent-replayed"],
        "true"
    );
    assert_eq!(effects.get(), before + 1);
}

// The handler sees its IdempotencyContext; child keys are deterministic.
#[tokio::test]
async fn handler_sees_its_context() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = Arc::clone(&seen);
    let app = Router::new()
        .route(
            "/pay",
            post(move |Extension(ctx): Extension<IdempotencyContext>| {
                let s = Arc::clone(&s);
                async move {
                    s.lock()
                        .unwrap()
                        .push((ctx.key().as_str().to_owned(), ctx.child_key("ledger")));
                    StatusCode::CREATED
                }
            }),
        )
        .layer(
            IdempotencyLayer::in_memory()
                .methods([axum::http::Method::POST, axum::http::Method::PATCH]),
        )
        .layer(axum::middleware::map_request(auth));
    let r = Request::post("/pay")
        .header("idempotency-key", "order-1")
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        app.clone().oneshot(r).await.unwrap().status(),
        StatusCode::CREATED
    );
    let r = Request::patch("/pay")
        .header("idempotency-key", "order-1")
        .body(Body::empty())
        .unwrap();
    let _ = app.oneshot(r).await.unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen.len(),
        1,
        "PATCH is a different request: 422, the handler did not run"
    );
    assert_eq!(seen[0].0, "order-1");
}

// A replaced problem responder keeps the protocol headers and the Problem extension.
#[tokio::test]
async fn problem_responder_can_be_replaced() {
    let layer = IdempotencyLayer::in_memory().problem_responder(|p| {
        let mut res = axum::http::Response::new(Bytes::from(format!("custom {}", p.kind())));
        *res.status_mut() = p.kind().status();
        res
    });
    let (app, _) = make_app(layer);
    send(&app, req("k", "a")).await;
    let res = app.clone().oneshot(req("k", "b")).await.unwrap();
    assert_eq!(res.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(res.headers()["do-not-retry"], "1");
    assert_eq!(
        res.extensions()
            .get::<retrysafe_tower::idempotency::Problem>()
            .unwrap()
            .kind(),
        ProblemKind::KeyMismatch
    );
    assert_eq!(
        to_bytes(res.into_body(), usize::MAX).await.unwrap(),
        "custom key-mismatch"
    );
}

// Builders validate instead of panicking.
#[test]
fn invalid_configuration_is_an_error() {
    assert!(
        IdempotencyLayer::in_memory()
            .lease(Duration::ZERO)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .retention(Duration::ZERO)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .max_execution(Duration::ZERO)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .store_timeout(Duration::ZERO)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .max_in_flight(0)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .max_request_body(0)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .wait_for_in_flight(Duration::ZERO)
            .build()
            .is_err()
    );
    let e = IdempotencyLayer::in_memory()
        .lease(Duration::ZERO)
        .build()
        .err()
        .unwrap();
    assert_eq!(e.field(), "lease");
}

#[allow(dead_code)]
fn _get_route_compiles() -> Router {
    Router::new()
        .route("/x", get(|| async { "x" }))
        .layer(IdempotencyLayer::in_memory())
}

// One build names every refused setting; a refused setting keeps its default, so a
// layer used without build still works.
#[tokio::test]
async fn build_names_every_refused_setting_and_refused_values_keep_their_defaults() {
    let unbuilt = IdempotencyLayer::in_memory()
        .lease(Duration::ZERO)
        .max_request_body(0)
        .retention(Duration::MAX)
        .max_in_flight(0);
    let error = unbuilt.clone().build().unwrap_err();
    assert_eq!(
        error.fields().collect::<Vec<_>>(),
        ["lease", "max_request_body", "retention", "max_in_flight"]
    );
    let (app, effects) = make_app(unbuilt);
    let (first, _, _) = send(&app, req("k", "{}")).await;
    let (again, headers, _) = send(&app, req("k", "{}")).await;
    assert_eq!(first, StatusCode::CREATED);
    assert_eq!(again, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(effects.get(), 1);
}

// Absurd values are refused rather than overflowing deadline arithmetic later.
#[test]
fn huge_configuration_values_are_refused() {
    assert!(
        IdempotencyLayer::in_memory()
            .lease(Duration::MAX)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .max_execution(Duration::MAX)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .wait_for_in_flight(Duration::MAX)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .store_timeout(Duration::MAX)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .retention(Duration::MAX)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .max_stored_response(usize::MAX)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .max_request_body(usize::MAX)
            .build()
            .is_err()
    );
    assert!(
        IdempotencyLayer::in_memory()
            .retention(Duration::from_secs(365 * 86_400))
            .build()
            .is_ok()
    );
}

// fail_open never runs a handler past a record that exists: a waiter whose store
// fails while the holder runs gets 503, not an unguarded second run.
#[tokio::test(start_paused = true)]
async fn fail_open_never_runs_past_an_existing_record() {
    let store = FaultyStore::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(store.clone())
        .fail_open()
        .wait_for_in_flight(Duration::from_secs(5))
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let first = tokio::spawn({
        let app = app.clone();
        let r = post_req(Some("k"), "")
            .header("x-sleep-ms", "3000")
            .body(Body::from("a"))
            .unwrap();
        async move { send(&app, r).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let dup = tokio::spawn({
        let app = app.clone();
        async move { send(&app, req("k", "a")).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The store goes down while the duplicate waits.
    store.fail_all(true);
    let dup = dup.await.unwrap();
    assert_problem(&dup, ProblemKind::StoreUnavailable);
    store.fail_all(false);
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(effects.get(), 1);
}

// A streaming response that outlives max_execution is not held back forever: it is
// recorded as not stored and streams on.
#[tokio::test(start_paused = true)]
async fn slow_response_body_is_bounded_by_max_execution() {
    let layer = IdempotencyLayer::in_memory()
        .max_execution(Duration::from_secs(5))
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/pay",
            post(|| async {
                let chunks = futures_util::stream::unfold(0u32, |n| async move {
                    if n == 10 {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    Some((Ok::<_, std::io::Error>(Bytes::from("chunk ")), n + 1))
                });
                (StatusCode::CREATED, Body::from_stream(chunks))
            }),
        )
        .layer(layer)
        .layer(axum::middleware::map_request(auth));
    let start = tokio::time::Instant::now();
    let res = app.clone().oneshot(req("k", "a")).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert!(
        start.elapsed() <= Duration::from_secs(6),
        "headers after max_execution at most"
    );
    let body = to_bytes(res.into_body(), usize::MAX).await.unwrap();
    assert_eq!(
        body,
        "chunk ".repeat(10),
        "the first client still gets every byte"
    );
    let later = send(&app, req("k", "a")).await;
    assert_problem(&later, ProblemKind::ResponseNotStored);
}

// A response that arrives as one frame larger than the storable limit is streamed on
// as it is, and the key is never re-run.
#[tokio::test]
async fn one_huge_frame_is_passed_on() {
    let layer = IdempotencyLayer::in_memory()
        .max_stored_response(10)
        .build()
        .unwrap();
    let (app, effects) = make_app(layer);
    let mk = || {
        post_req(Some("k"), "")
            .header("x-big", "100000")
            .body(Body::from("a"))
            .unwrap()
    };
    assert_eq!(send(&app, mk()).await.2.len(), 100_000);
    assert_problem(&send(&app, mk()).await, ProblemKind::ResponseNotStored);
    assert_eq!(effects.get(), 1);
}

// A completed record heavier than the whole MemoryStore is kept as a "not stored"
// marker, never silently dropped (which would let a retry run again).
#[tokio::test]
async fn record_heavier_than_the_store_is_kept_as_a_marker() {
    let store = MemoryStore::new().max_bytes(4096).build().unwrap();
    let (app, effects) = make_app(IdempotencyLayer::new(store));
    let mk = || {
        post_req(Some("k"), "")
            .header("x-big", "10000")
            .body(Body::from("a"))
            .unwrap()
    };
    assert_eq!(send(&app, mk()).await.2.len(), 10_000);
    assert_problem(&send(&app, mk()).await, ProblemKind::ResponseNotStored);
    assert_eq!(effects.get(), 1);
}

// Concurrent commit_point calls share one store write: none of them passes on the
// strength of a write that fails.
#[tokio::test]
async fn concurrent_commit_points_share_one_write() {
    let store = MemoryStore::new();
    let scope = Scope::from(&Principal::new("alice"));
    let key = IdempotencyKey::new("k").unwrap();
    // No claim is held with this token: the store refuses it.
    let ctx = IdempotencyContext::new(
        scope,
        key,
        Token::random(),
        retrysafe_core::store::BoxStore::new(store),
        Duration::from_secs(1),
    );
    let (a, b, c) = tokio::join!(ctx.commit_point(), ctx.commit_point(), ctx.commit_point());
    assert!(a.is_err() && b.is_err() && c.is_err());
    assert!(!ctx.is_committed());
}
