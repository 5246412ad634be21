//! Holders that die or stall: takeover before the commit point, `outcome-unknown` after
//! it, lease renewal up to `max_execution`, and a stalled holder cancelled.

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode};
use retrysafe_core::idempotency::{CommitPoint, Fingerprinter, RecordId, Scope, Token};
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore};
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_memory::MemoryStore;
use retrysafe_tower::idempotency::{
    EventKind, IdempotencyLayer, Principal, ProblemKind, UnknownReason,
};
use tower::ServiceExt;

use super::{Recorder, assert_problem, make_app, post_req, req, send};

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
