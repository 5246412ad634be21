//! The layer as a whole: the guard rules of the `IdempotencyLayer`, the store's sweeper,
//! the handler's context and savepoints, validated settings, and its metrics.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Extension, Router};
use retrysafe_core::store::IdempotencyStore;
use retrysafe_postgres::sqlx;
use retrysafe_postgres::tx::{IdempotentTx, TxBackend, TxIdempotencyLayer};
use retrysafe_tower::idempotency::{IdempotencyContext, ProblemKind};

use super::{Ctx, Env, auth, pay, pay_req, problem_type, record_id, send};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_rules_as_the_idempotency_layer() {
    let env = Env::new(4).await;
    let app = env.app(env.layer());

    // Unguarded methods pass untouched: no transaction for them.
    let plain = send(&app, Request::get("/plain").body(Body::empty()).unwrap()).await;
    assert_eq!(plain.status, StatusCode::OK);
    let no_tx = send(&app, Request::get("/tx").body(Body::empty()).unwrap()).await;
    assert_eq!(no_tx.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        no_tx.problem(),
        problem_type(ProblemKind::TransactionMissing)
    );
    let maybe = send(&app, Request::get("/maybe").body(Body::empty()).unwrap()).await;
    assert_eq!(&maybe.body[..], b"none");

    // gRPC passes untouched too.
    let grpc = Request::post("/pay")
        .header("content-type", "application/grpc")
        .header("idempotency-key", "g")
        .body(Body::from("acc"))
        .unwrap();
    let grpc = send(&app, grpc).await;
    assert_eq!(grpc.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        grpc.problem(),
        problem_type(ProblemKind::TransactionMissing)
    );

    // Invalid keys.
    let bad = send(&app, pay_req(Some(""), "ok", "acc")).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(bad.problem(), problem_type(ProblemKind::KeyInvalid));

    // Required keys.
    let strict = env.app(env.layer().require_key());
    let missing = send(&strict, pay_req(None, "ok", "acc")).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.problem(), problem_type(ProblemKind::KeyMissing));

    // Body over the limit: 413 before anything.
    let small = env.app(env.layer().max_request_body(8));
    let large = send(&small, pay_req(Some("k"), "ok", "a-long-account-name")).await;
    assert_eq!(large.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(large.problem(), problem_type(ProblemKind::BodyTooLarge));

    // No principal: 500 scope-missing.
    let ctx = Ctx {
        schema: env.store.schema.clone(),
        hooks: Arc::clone(&env.hooks),
    };
    let anonymous = Router::new()
        .route("/pay", post(pay))
        .with_state(ctx)
        .layer(env.layer());
    let refused = send(&anonymous, pay_req(Some("k"), "ok", "acc")).await;
    assert_eq!(refused.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(refused.problem(), problem_type(ProblemKind::ScopeMissing));

    assert_eq!(env.payments().await, 0);
    assert_eq!(env.key_rows().await, (0, 0));
}

/// Key rows follow the retention: the store's sweeper deletes them once expired, and
/// the key is new again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_key_rows_go_by_the_store_sweeper() {
    let env = Env::new(4).await;
    let app = env.app(env.layer().retention(Duration::from_millis(300)));
    assert_eq!(
        send(&app, pay_req(Some("k"), "ok", "acc")).await.status,
        StatusCode::CREATED
    );
    let id = record_id("k");
    assert!(env.store.get(&id).await.unwrap().is_some());
    for _ in 0..200 {
        if env.store.get(&id).await.unwrap().is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(env.store.get(&id).await.unwrap().is_none(), "expired");
    let swept = env.store.sweep_expired(100).await.unwrap();
    assert_eq!(swept.rows, 1);
    assert_eq!(env.key_rows().await, (0, 0));

    let again = send(&app, pay_req(Some("k"), "ok", "acc")).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.replayed(), "the key is new again");
    assert_eq!(env.payments().await, 2);
}

/// The handler sees the record's detached context (for child keys) and can open a
/// savepoint on the guard; the layer's commit is still the only one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_sees_the_context_and_nests_savepoints() {
    let env = Env::new(4).await;
    let schema = env.store.schema.clone();
    let app = Router::new()
        .route(
            "/nested",
            post(
                move |Extension(ctx): Extension<IdempotencyContext>, mut tx: IdempotentTx| {
                    let schema = schema.clone();
                    async move {
                        use retrysafe_postgres::sqlx::Connection;
                        let mut sp = tx.begin().await.unwrap();
                        sqlx::query(&format!(
                            "INSERT INTO {schema}.payments (account, amount_cents) VALUES ('sp', 1)"
                        ))
                        .execute(&mut *sp)
                        .await
                        .unwrap();
                        sp.commit().await.unwrap(); // releases the savepoint only
                        (StatusCode::CREATED, ctx.key().as_str().to_owned())
                    }
                },
            ),
        )
        .layer(env.layer())
        .layer(axum::middleware::map_request(auth));
    let req = || {
        Request::post("/nested")
            .header("idempotency-key", "nest")
            .body(Body::empty())
            .unwrap()
    };
    let first = send(&app, req()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(&first.body[..], b"nest");
    assert!(send(&app, req()).await.replayed());
    assert_eq!(env.payments().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_are_validated() {
    let env = Env::new(2).await;
    let l = || env.layer();
    let b = || env.backend();
    assert_eq!(b().table("Bad").build().unwrap_err().field(), "table");
    assert_eq!(b().schema("1x").build().unwrap_err().field(), "schema");
    assert_eq!(
        b().acquire_timeout(Duration::ZERO)
            .build()
            .unwrap_err()
            .field(),
        "acquire_timeout"
    );
    assert_eq!(
        b().idle_in_transaction_timeout(Duration::from_micros(10))
            .build()
            .unwrap_err()
            .field(),
        "idle_in_transaction_timeout"
    );
    assert_eq!(
        b().idle_in_transaction_timeout(Duration::from_secs(30 * 24 * 3600))
            .build()
            .unwrap_err()
            .field(),
        "idle_in_transaction_timeout"
    );
    assert_eq!(
        l().retention(Duration::ZERO).build().unwrap_err().field(),
        "retention"
    );
    assert_eq!(
        l().max_in_flight(0).build().unwrap_err().field(),
        "max_in_flight"
    );
    // Every refused setting is named, the backend's through the layer's build too.
    let both = b()
        .acquire_timeout(Duration::ZERO)
        .table("Bad")
        .build()
        .unwrap_err();
    assert_eq!(
        both.fields().collect::<Vec<_>>(),
        ["acquire_timeout", "table"]
    );
    let through_layer = TxIdempotencyLayer::with_backend(b().commit_timeout(Duration::ZERO))
        .max_in_flight(0)
        .build()
        .unwrap_err();
    assert_eq!(
        through_layer.fields().collect::<Vec<_>>(),
        ["max_in_flight", "commit_timeout"]
    );
    assert_eq!(l().backend().table_name(), env.store.table());
    let named = TxBackend::new(env.store.pool().clone())
        .schema(env.store.schema.clone())
        .build()
        .unwrap();
    assert_eq!(named.table_name(), env.store.table());
}

/// Guards outside the layer, through `from_extensions`.
#[test]
fn no_transaction_without_the_layer() {
    let err = IdempotentTx::from_extensions(&http::Extensions::new()).unwrap_err();
    assert_eq!(err.problem().kind(), ProblemKind::TransactionMissing);
}

/// The transactional layer reports like the store layer: one decision per request and
/// its round trips to the database (the opening with the key, the commit), under its
/// name, in the recorder it was built with.
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transactional_layer_counts_decisions_and_round_trips_by_name() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let env = Env::new(4).await;
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let layer =
        metrics::with_local_recorder(&recorder, || env.layer().name("ledger").build().unwrap());
    let app = env.app(layer);

    let first = send(&app, pay_req(Some("m-1"), "ok", "acc-1")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(
        send(&app, pay_req(Some("m-1"), "ok", "acc-1"))
            .await
            .replayed()
    );
    let changed = send(&app, pay_req(Some("m-1"), "ok", "acc-2")).await;
    assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);

    let seen = snapshotter.snapshot().into_vec();
    let value = |metric: &str, label: (&str, &str)| {
        seen.iter()
            .find(|(key, ..)| {
                let key = key.key();
                let labels: Vec<(&str, &str)> =
                    key.labels().map(|l| (l.key(), l.value())).collect();
                key.name() == metric && labels == [("name", "ledger"), label]
            })
            .map(|(.., value)| match value {
                DebugValue::Counter(n) => *n,
                DebugValue::Histogram(samples) => samples.len() as u64,
                DebugValue::Gauge(_) => panic!("{metric} is no gauge"),
            })
    };
    let requests = "retrysafe_idempotency_requests_total";
    assert_eq!(value(requests, ("decision", "first")), Some(1));
    assert_eq!(value(requests, ("decision", "replay")), Some(1));
    assert_eq!(value(requests, ("decision", "mismatch")), Some(1));
    assert_eq!(value(requests, ("decision", "in_flight")), Some(0));
    let store = "retrysafe_idempotency_store_seconds";
    assert_eq!(value(store, ("op", "claim")), Some(3));
    assert_eq!(value(store, ("op", "complete")), Some(1));
    assert_eq!(value(store, ("op", "release")), Some(0));
    env.pool_settles().await;
}
