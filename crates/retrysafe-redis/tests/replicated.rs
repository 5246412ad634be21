//! `RedisStoreOptions::replicated_writes` against the server at `REDIS_URL`, which has no
//! replicas: every write that waits for one is refused, and what the store does then
//! (a claim or commit point released, a completion kept but reported) is what a
//! primary whose replicas lag behind gets. Then the same over HTTP: an app server on a
//! loopback port, guarded by an `IdempotencyLayer` over a primary of its own whose
//! replica is stopped (SIGSTOP) and resumed. The cluster form is in `cluster.rs`.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use common::{fresh_prefix, manager, manager_to};
use retrysafe_core::idempotency::{CommitPoint, Completed, Fingerprint, Record, Token};
use retrysafe_core::store::conformance::fresh_id;
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, StoreError};
use retrysafe_redis::{RedisStore, RedisStoreOptions};
use retrysafe_test_support::redis_nodes::LocalReplicaPair;
use retrysafe_tower::idempotency::{EventKind, IdempotencyEvent, IdempotencyLayer, Principal};

/// Two stores on one fresh key prefix: one plain, one whose writes wait for
/// `replicas` replicas at most 10 ms.
async fn plain_and_waiting(replicas: u32) -> (RedisStore, RedisStore) {
    let options = RedisStoreOptions::new().key_prefix(fresh_prefix());
    let plain = options.clone().build(manager().await).await.unwrap();
    let waiting = options
        .replicated_writes(replicas, Duration::from_millis(10))
        .build(manager().await)
        .await
        .unwrap();
    (plain, waiting)
}

fn claim() -> Claim<'static> {
    Claim::new(
        Token::random(),
        Fingerprint::from_bytes([3; 32]),
        Duration::from_secs(10),
        Duration::from_secs(60),
        CommitPoint::Before,
    )
}

fn unavailable<T: std::fmt::Debug>(r: Result<T, StoreError>) -> String {
    match r {
        Err(StoreError::Unavailable(e)) => e.to_string(),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[tokio::test]
async fn an_unacknowledged_claim_is_released_and_refused() {
    let (_, store) = plain_and_waiting(1).await;
    assert_eq!(store.replicas(), 1);
    let id = fresh_id();
    let e = unavailable(store.claim(&id, &claim()).await);
    assert!(e.contains("claim was not acknowledged by 1 replica"), "{e}");
    assert_eq!(store.get(&id).await.unwrap(), None, "released");
}

#[tokio::test]
async fn an_unacknowledged_commit_point_is_released_and_refused() {
    let (plain, waiting) = plain_and_waiting(1).await;
    let id = fresh_id();
    let c = claim();
    assert_eq!(
        plain.claim(&id, &c).await.unwrap(),
        ClaimOutcome::Claimed { takeover: false }
    );
    let e = unavailable(waiting.commit_point_with(&id, c.token, b"note").await);
    assert!(e.contains("commit point"), "{e}");
    assert_eq!(plain.get(&id).await.unwrap(), None, "released");
}

#[tokio::test]
async fn an_unacknowledged_completion_is_reported_not_undone() {
    let (plain, waiting) = plain_and_waiting(1).await;
    let id = fresh_id();
    let c = claim();
    plain.claim(&id, &c).await.unwrap();
    let done = Completed::new(c.fingerprint, None);
    let e = unavailable(
        waiting
            .complete(&id, c.token, &done, Duration::from_secs(60))
            .await,
    );
    assert!(e.contains("completion"), "{e}");
    // Written on the primary: a copy replays it unless a failover loses it.
    assert_eq!(plain.get(&id).await.unwrap(), Some(Record::Completed(done)));
}

#[tokio::test]
async fn zero_replicas_turns_it_off() {
    let (_, store) = plain_and_waiting(0).await;
    assert_eq!(store.replicas(), 0);
    let id = fresh_id();
    let c = claim();
    store.claim(&id, &c).await.unwrap();
    store.commit_point(&id, c.token).await.unwrap();
    store
        .complete(
            &id,
            c.token,
            &Completed::new(c.fingerprint, None),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
}

/// What a handler does before it answers, besides counting its effect.
type During = Arc<dyn Fn() + Send + Sync>;

/// An app server on a loopback port: `POST /pay` guarded by an `IdempotencyLayer` over
/// a store on the pair's primary that waits for its replica; the handler counts its
/// effects per key.
struct App {
    base: String,
    http: reqwest::Client,
    effects: Arc<Mutex<HashMap<String, u32>>>,
    events: Arc<Mutex<Vec<EventKind>>>,
    server: tokio::task::JoinHandle<()>,
}

impl App {
    async fn start(pair: &LocalReplicaPair, lease: Duration, during: During) -> App {
        let store = RedisStore::options()
            .key_prefix(fresh_prefix())
            // Long enough for a running loopback replica on a loaded machine (the wait
            // ends as soon as it acknowledges): only a stopped one lets it run out. The
            // call and store timeouts leave room for the whole wait.
            .replicated_writes(1, Duration::from_secs(2))
            .call_timeout(Duration::from_secs(3))
            .build(manager_to(&pair.url()).await)
            .await
            .unwrap();
        let events = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&events);
        let layer = IdempotencyLayer::new(store)
            .lease(lease)
            .store_timeout(Duration::from_secs(3))
            .on_event(move |e: &IdempotencyEvent| seen.lock().unwrap().push(e.kind))
            .build()
            .unwrap();
        let effects = Arc::new(Mutex::new(HashMap::new()));
        let counted = Arc::clone(&effects);
        let router = Router::new()
            .route(
                "/pay",
                post(move |headers: HeaderMap| async move {
                    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                    *counted.lock().unwrap().entry(key).or_insert(0) += 1;
                    during();
                    (StatusCode::CREATED, "paid")
                }),
            )
            .layer(layer)
            .layer(axum::middleware::map_request(
                |mut req: Request| async move {
                    req.extensions_mut().insert(Principal::new("tenant-1"));
                    req
                },
            ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        App {
            base,
            http,
            effects,
            events,
            server,
        }
    }

    /// `POST /pay` with `key`: the status, the headers and the body.
    async fn pay(&self, key: &str) -> (StatusCode, reqwest::header::HeaderMap, String) {
        let res = self
            .http
            .post(format!("{}/pay", self.base))
            .header("idempotency-key", key)
            .body("pay 10")
            .send()
            .await
            .unwrap();
        let status = StatusCode::from_u16(res.status().as_u16()).unwrap();
        let headers = res.headers().clone();
        (status, headers, res.text().await.unwrap())
    }

    fn effects(&self, key: &str) -> u32 {
        self.effects.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    fn events(&self, kind: EventKind) -> usize {
        let events = self.events.lock().unwrap();
        events.iter().filter(|k| **k == kind).count()
    }
}

impl Drop for App {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn replayed(headers: &reqwest::header::HeaderMap) -> Option<&str> {
    headers
        .get("idempotent-replayed")
        .map(|v| v.to_str().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http_an_unacknowledged_claim_is_answered_503_and_released() {
    let pair = LocalReplicaPair::start().unwrap();
    // A lease far longer than the test: a claim left held would answer 409 throughout.
    let app = App::start(&pair, Duration::from_secs(600), Arc::new(|| {})).await;
    let (status, _, body) = app.pay("acknowledged").await;
    assert_eq!((status, body.as_str()), (StatusCode::CREATED, "paid"));

    pair.stop_replica().unwrap();
    let (status, headers, body) = app.pay("k").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(headers["content-type"], "application/problem+json");
    assert!(headers.contains_key("retry-after"), "{headers:?}");
    assert!(
        body.contains("urn:retrysafe:problem:store-unavailable"),
        "{body}"
    );
    assert_eq!(app.effects("k"), 0, "the handler did not run");
    // Released: a copy claims the key again (and is refused again), not 409 in flight.
    let (status, _, body) = app.pay("k").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(app.events(EventKind::CompletionLost), 0);

    pair.resume_replica().unwrap();
    let (status, headers, body) = app.pay("k").await;
    assert_eq!((status, body.as_str()), (StatusCode::CREATED, "paid"));
    assert_eq!(replayed(&headers), None, "it ran");
    assert_eq!(app.effects("k"), 1);
    let (status, headers, _) = app.pay("k").await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(replayed(&headers), Some("true"));
    assert_eq!(app.effects("k"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http_an_unacknowledged_completion_returns_the_real_response() {
    let pair = Arc::new(LocalReplicaPair::start().unwrap());
    // The handler stops the replica once its claim was acknowledged: the completion
    // is written on the primary but never acknowledged (it is retried while the 10 s
    // lease lasts, then given up).
    let stopper = Arc::clone(&pair);
    let app = App::start(
        &pair,
        Duration::from_secs(10),
        Arc::new(move || stopper.stop_replica().unwrap()),
    )
    .await;
    let (status, headers, body) = app.pay("k").await;
    assert_eq!((status, body.as_str()), (StatusCode::CREATED, "paid"));
    assert_eq!(replayed(&headers), None, "the handler's own response");
    assert_eq!(app.events(EventKind::CompletionLost), 1);
    assert_eq!(app.effects("k"), 1);

    // Written on the primary all along: once the replica has it, a copy replays it.
    pair.resume_replica().unwrap();
    let (status, headers, body) = app.pay("k").await;
    assert_eq!((status, body.as_str()), (StatusCode::CREATED, "paid"));
    assert_eq!(replayed(&headers), Some("true"));
    assert_eq!(app.effects("k"), 1);
}
