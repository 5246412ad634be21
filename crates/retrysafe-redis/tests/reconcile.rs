//! RedisStore as a `ReconcilableStore`, against the real Redis at `REDIS_URL`: the
//! shared reconcile conformance cases (a fresh key prefix each, since the reconciler
//! case adopts whatever is due in its store), then what is specific to Redis (the
//! companion and index keys, round trips on the request path).
#![allow(clippy::unwrap_used, clippy::panic, missing_docs)]

mod common;

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::routing::post;
use common::{ServerLock, fresh_prefix, manager, store};

use retrysafe_core::idempotency::{
    CommitPoint, Completed, Fingerprint, Record, RequestInfo, Scope, Token, UnknownReason,
};
use retrysafe_core::recovery::{PendingState, ReconcilableStore, Settlement};
use retrysafe_core::store::conformance::fresh_id;
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, MAX_NOTE};
use retrysafe_redis::RedisStore;
use retrysafe_test_support::redis_nodes::CountingConnection;
use retrysafe_tower::idempotency::{IdempotencyLayer, Principal};
use tower::ServiceExt;

mod conformance {
    retrysafe_core::reconcilable_store_tests! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        store = super::store,
        clock = retrysafe_core::store::conformance::RealClock::default(),
    }
}

const LEASE: Duration = Duration::from_secs(10);
const RETENTION: Duration = Duration::from_secs(60);

fn claim(request: &RequestInfo) -> Claim<'_> {
    Claim::new(
        Token::random(),
        Fingerprint::from_bytes([1; 32]),
        LEASE,
        RETENTION,
        CommitPoint::Undeclared,
    )
    .with_request(request)
}

fn info() -> RequestInfo {
    RequestInfo::new(Scope::new("tenant-1"), Method::POST, "/payments")
}

async fn pttl(key: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(key)
        .query_async(&mut manager().await)
        .await
        .unwrap()
}

async fn index(store: &RedisStore) -> Vec<String> {
    redis::cmd("ZRANGE")
        .arg(format!("{}inflight", store.key_prefix()))
        .arg(0)
        .arg(-1)
        .query_async(&mut manager().await)
        .await
        .unwrap()
}

#[tokio::test]
async fn side_data_lives_beside_the_record_with_its_ttl() {
    let store = store().await;
    let id = fresh_id();
    let key = store.key(&id);
    let request = info();
    let c = claim(&request);
    store.claim(&id, &c).await.unwrap();
    let meta = format!("{key}:meta");
    let kind: String = redis::cmd("TYPE")
        .arg(&meta)
        .query_async(&mut manager().await)
        .await
        .unwrap();
    assert_eq!(kind, "hash");
    let (record_ttl, meta_ttl) = (pttl(&key).await, pttl(&meta).await);
    assert!(
        (record_ttl - meta_ttl).abs() < 1000,
        "{record_ttl} {meta_ttl}"
    );
    assert_eq!(index(&store).await, vec![id.to_hex()]);

    // The note is cut to MAX_NOTE bytes.
    let long = vec![b'n'; MAX_NOTE + 10];
    store.commit_point_with(&id, c.token, &long).await.unwrap();
    let p = store.peek(&id).await.unwrap().unwrap();
    assert_eq!(p.note.as_deref(), long.get(..MAX_NOTE));
    assert_eq!(p.request.as_deref(), Some(&request));

    // Marked unknown: the record and its side data live for the retention.
    let reason = UnknownReason::Panicked;
    store
        .mark_unknown(&id, c.token, Duration::from_secs(5), reason)
        .await
        .unwrap();
    assert!(pttl(&meta).await <= 5000);
    let p = store.peek(&id).await.unwrap().unwrap();
    assert_eq!(
        p.state,
        PendingState::Unknown {
            reason: Some(reason)
        }
    );

    // Completed through a settlement: side data and index entry are gone.
    let t = Token::random();
    store
        .adopt(&id, t, LEASE, None)
        .await
        .unwrap()
        .expect("an unknown record is adoptable");
    let response = retrysafe_core::idempotency::StoredResponse::new(
        StatusCode::OK,
        Vec::new(),
        bytes::Bytes::from_static(b"ok"),
        Vec::new(),
    );
    store
        .settle(
            &id,
            t,
            Settlement::Complete {
                response: response.clone(),
                retention: RETENTION,
            },
            true,
        )
        .await
        .unwrap();
    assert_eq!(
        store.get(&id).await.unwrap(),
        Some(Record::Completed(Completed::new(
            Fingerprint::from_bytes([1; 32]),
            Some(response)
        )))
    );
    assert_eq!(pttl(&meta).await, -2, "no side data left");
    assert!(index(&store).await.is_empty());
}

#[tokio::test]
async fn index_entries_of_expired_records_are_dropped_when_seen() {
    let store = store().await;
    let id = fresh_id();
    let request = info();
    let mut c = claim(&request);
    c.lease = Duration::from_millis(50);
    c.retention = Duration::from_millis(50);
    store.claim(&id, &c).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(index(&store).await, vec![id.to_hex()]);
    assert!(store.due(Duration::ZERO, 10).await.unwrap().is_empty());
    assert!(index(&store).await.is_empty());
}

#[tokio::test]
async fn an_expired_lease_turned_unknown_by_a_copy_waits_like_the_claim() {
    let store = store().await;
    let id = fresh_id();
    let request = info();
    let mut c = claim(&request);
    c.lease = Duration::from_millis(50);
    store.claim(&id, &c).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let copy = claim(&request);
    assert!(matches!(
        store.claim(&id, &copy).await.unwrap(),
        ClaimOutcome::Existing {
            became_unknown: true,
            ..
        }
    ));
    // Due only once a reconciler's wait after the lease's end has passed, as the
    // claim would have been: its holder may still run until then.
    assert!(
        store
            .due(Duration::from_secs(3600), 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        store
            .adopt(&id, Token::random(), LEASE, Some(Duration::from_secs(3600)))
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(
        store.due(Duration::from_millis(100), 10).await.unwrap(),
        [id]
    );
    let p = store.peek(&id).await.unwrap().unwrap();
    assert_eq!(
        p.state,
        PendingState::Unknown {
            reason: Some(UnknownReason::LeaseExpired)
        }
    );
    assert!(!p.notified);
}

/// The request path gains no round trip: a guarded request is one claim and one
/// completion, whatever the store keeps beside the record.
#[tokio::test]
async fn a_guarded_request_is_still_two_round_trips() {
    let conn = CountingConnection::new(manager().await);
    let store = RedisStore::options()
        .key_prefix(fresh_prefix())
        .build(conn.clone())
        .await
        .unwrap();
    let mut admin = manager().await;
    let lock = ServerLock::acquire(&mut admin, "scripts").await;

    // Store calls, each once warm.
    let request = info();
    for round in 0..2 {
        let id = fresh_id();
        let c = claim(&request);
        conn.take();
        store.claim(&id, &c).await.unwrap();
        store
            .commit_point_with(&id, c.token, b"note")
            .await
            .unwrap();
        store
            .complete(
                &id,
                c.token,
                &Completed::new(c.fingerprint, None),
                RETENTION,
            )
            .await
            .unwrap();
        if round == 1 {
            assert_eq!(conn.take(), 3, "claim, commit point with a note, complete");
        }
    }

    // Through the layer.
    let layer = IdempotencyLayer::new(store.clone()).build().unwrap();
    let app = Router::new()
        .route("/pay", post(|| async { (StatusCode::CREATED, "paid") }))
        .layer(layer)
        .layer(axum::middleware::map_request(
            |mut req: Request| async move {
                req.extensions_mut().insert(Principal::new("tenant-1"));
                req
            },
        ));
    for round in 0..2 {
        let req = Request::post("/pay")
            .header("idempotency-key", Token::random().to_hex())
            .body(Body::from("10 EUR"))
            .unwrap();
        conn.take();
        let res = app.clone().oneshot(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::CREATED);
        if round == 1 {
            assert_eq!(conn.take(), 2, "one claim, one completion");
        }
    }
    lock.release(&mut admin).await;
}

async fn raw(key: &str) -> Vec<u8> {
    redis::cmd("GET")
        .arg(key)
        .query_async(&mut manager().await)
        .await
        .unwrap()
}

#[tokio::test]
async fn adoption_never_touches_the_record_and_settlements_survive_a_resend() {
    let store = store().await;
    let id = fresh_id();
    let key = store.key(&id);
    let request = info();
    let mut c = claim(&request);
    c.lease = Duration::from_millis(50);
    store.claim(&id, &c).await.unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let before = raw(&key).await;
    let t = Token::random();
    store
        .adopt(&id, t, Duration::from_secs(5), Some(Duration::ZERO))
        .await
        .unwrap()
        .expect("adoptable");
    assert_eq!(raw(&key).await, before, "the record's bytes are untouched");
    // The same adoption sent again (its reply was lost) still holds.
    assert!(
        store
            .adopt(&id, t, Duration::from_secs(5), Some(Duration::ZERO))
            .await
            .unwrap()
            .is_some()
    );
    let later = Settlement::Later {
        after: Duration::from_secs(30),
    };
    store.settle(&id, t, later.clone(), true).await.unwrap();
    store.settle(&id, t, later, true).await.unwrap();
    assert!(matches!(
        store.get(&id).await.unwrap(),
        Some(Record::OutcomeUnknown(_))
    ));
    // A claim turned unknown by a reconciler keeps the claim's expiry, not a new one.
    let ttl = pttl(&key).await;
    assert!(
        ttl > 0 && ttl <= i64::try_from((RETENTION + LEASE).as_millis()).unwrap(),
        "{ttl}"
    );
    let p = store.peek(&id).await.unwrap().unwrap();
    assert_eq!(
        p.state,
        PendingState::Unknown {
            reason: Some(UnknownReason::LeaseExpired)
        }
    );
    assert!(p.notified);
    assert!(store.due(Duration::ZERO, 10).await.unwrap().is_empty());
}
