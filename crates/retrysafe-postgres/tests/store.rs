//! PostgresStore beyond the conformance suite, against the real PostgreSQL at
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`): round trips
//! counted on the wire, the sweeper, corrupt rows, unreachable and hanging servers,
//! migrations, the database clock, and the store behind an `IdempotencyLayer`.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::{Body, to_bytes};
use axum::extract::Request;
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use retrysafe_core::ConfigError;
use retrysafe_core::idempotency::{
    CommitPoint, Completed, DecodeError, Fingerprint, Record, RecordId, StoredResponse, Token,
};
use retrysafe_core::store::conformance::fresh_id;
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, StoreError};
use retrysafe_postgres::sqlx::postgres::PgPoolOptions;
use retrysafe_postgres::sqlx::{self, PgConnection};
use retrysafe_postgres::{PostgresStore, PostgresStoreError, PostgresStoreOptions};
use retrysafe_test_support::pg_store::{
    Proxy, TestStore, fresh_schema, isolated_store, isolated_store_with, pg_admin,
};
use retrysafe_tower::idempotency::{IdempotencyLayer, Principal};
use tower::ServiceExt;

fn claim(fp: u8, lease: Duration, retention: Duration) -> Claim<'static> {
    Claim::new(
        Token::random(),
        Fingerprint::from_bytes([fp; 32]),
        lease,
        retention,
        CommitPoint::Before,
    )
}

fn completed(fp: u8, body: &'static str) -> Completed {
    Completed::new(
        Fingerprint::from_bytes([fp; 32]),
        Some(StoredResponse::new(
            StatusCode::CREATED,
            vec![(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain"),
            )],
            Bytes::from_static(body.as_bytes()),
            Vec::new(),
        )),
    )
}

const HOUR: Duration = Duration::from_secs(3600);

async fn must_claim(store: &impl IdempotencyStore, id: &RecordId, c: &Claim<'_>) {
    match store.claim(id, c).await.unwrap() {
        ClaimOutcome::Claimed { .. } => {}
        other => panic!("expected a claim, got {other:?}"),
    }
}

async fn rows(conn: &mut PgConnection, store: &TestStore) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {}", store.table()))
        .fetch_one(conn)
        .await
        .unwrap()
}

/// Every store call is one statement on the wire: after each statement was prepared
/// once on the (single) connection, N calls send N `Execute`s, each in one
/// `Bind/Execute/Close/Sync` batch — one round trip — with no further `Parse` and no
/// simple query. (sqlx pings a connection as it returns to the pool, after the call
/// has returned; those pings are counted apart.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_round_trip_per_call() {
    let proxy = Proxy::start().await;
    let store = isolated_store_with(proxy.connect_options(), |b| b.max_connections(1)).await;

    // One of every call, twice over: the first round prepares the statements.
    async fn every_call(store: &TestStore) -> u64 {
        let id = fresh_id();
        let first = claim(1, HOUR, HOUR);
        must_claim(store, &id, &first).await; // 1 insert
        let copy = claim(1, HOUR, HOUR);
        assert!(matches!(
            store.claim(&id, &copy).await.unwrap(), // 2 existing, in progress
            ClaimOutcome::Existing {
                record: Record::InProgress(_),
                ..
            }
        ));
        store.renew(&id, first.token, HOUR).await.unwrap(); // 3
        store.commit_point(&id, first.token).await.unwrap(); // 4
        assert!(matches!(
            store.get(&id).await.unwrap(),
            Some(Record::InProgress(_))
        )); // 5
        store
            .complete(&id, first.token, &completed(1, "done"), HOUR)
            .await
            .unwrap(); // 6
        assert!(matches!(
            store.claim(&id, &copy).await.unwrap(), // 7 replay
            ClaimOutcome::Existing {
                record: Record::Completed(_),
                ..
            }
        ));
        assert!(matches!(
            store.release(&id, first.token).await, // 8 refused: stale
            Err(StoreError::StaleToken)
        ));
        let other = fresh_id();
        let c = claim(2, HOUR, HOUR);
        must_claim(store, &other, &c).await; // 9
        store
            .mark_unknown(
                &other,
                c.token,
                HOUR,
                retrysafe_core::idempotency::UnknownReason::ServiceError,
            )
            .await
            .unwrap(); // 10
        let third = fresh_id();
        let c = claim(3, HOUR, HOUR);
        must_claim(store, &third, &c).await; // 11
        store.release(&third, c.token).await.unwrap(); // 12
        12
    }

    every_call(&store).await;
    let before = proxy.seen();
    let mut calls = 0;
    for _ in 0..5 {
        calls += every_call(&store).await;
    }
    let seen = proxy.seen() - before;
    assert_eq!(seen.statements, calls, "one statement per call: {seen:?}");
    assert_eq!(seen.prepares, 0, "statements are prepared once: {seen:?}");
    assert_eq!(seen.simple_queries, 0, "{seen:?}");
    assert_eq!(seen.connections, 0, "one pooled connection: {seen:?}");
    // At most one release ping per call (the last may still be on its way).
    assert!(seen.pings <= calls + 1, "{seen:?}");
}

/// A guarded request that runs costs two round trips (claim, complete); a replay one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarded_request_round_trips_through_the_layer() {
    let proxy = Proxy::start().await;
    let store = isolated_store_with(proxy.connect_options(), |b| b.max_connections(1)).await;
    let effects = Arc::new(AtomicUsize::new(0));
    let app = app(store.store.clone(), Arc::clone(&effects));
    // Warm: prepare the claim and complete statements.
    assert_eq!(send(&app, "warm", "a").await.0, StatusCode::CREATED);

    let before = proxy.seen();
    assert_eq!(send(&app, "k1", "a").await.0, StatusCode::CREATED);
    let first = proxy.seen() - before;
    assert_eq!(first.statements, 2, "claim and complete: {first:?}");
    assert_eq!(first.prepares + first.simple_queries, 0, "{first:?}");

    let before = proxy.seen();
    let (status, headers, body) = send(&app, "k1", "a").await;
    let replay = proxy.seen() - before;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(body, "effect 2");
    assert_eq!(
        replay.statements, 1,
        "one claim answers the replay: {replay:?}"
    );
    assert_eq!(
        effects.load(Ordering::SeqCst),
        2,
        "warm-up and k1, once each"
    );
}

fn app(store: PostgresStore, effects: Arc<AtomicUsize>) -> Router {
    async fn pay(Extension(effects): Extension<Arc<AtomicUsize>>) -> (StatusCode, String) {
        let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
        (StatusCode::CREATED, format!("effect {n}"))
    }
    async fn auth(mut req: Request) -> Request {
        req.extensions_mut().insert(Principal::new("alice"));
        req
    }
    Router::new()
        .route("/pay", post(pay))
        .layer(IdempotencyLayer::new(store))
        .layer(axum::middleware::map_request(auth))
        .layer(Extension(effects))
}

async fn send(app: &Router, key: &str, body: &'static str) -> (StatusCode, http::HeaderMap, Bytes) {
    let req = Request::post("/pay")
        .header("idempotency-key", key)
        .header("content-type", "text/plain")
        .body(Body::from(body))
        .unwrap();
    let res = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = res.into_parts();
    (
        parts.status,
        parts.headers,
        to_bytes(body, usize::MAX).await.unwrap(),
    )
}

/// Through the layer, concurrent copies of one request run the handler once, and a
/// different body under the same key is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_runs_the_handler_once() {
    let store = isolated_store(|b| b).await;
    let effects = Arc::new(AtomicUsize::new(0));
    let app = app(store.store.clone(), Arc::clone(&effects));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let app = app.clone();
        tasks.push(tokio::spawn(
            async move { send(&app, "pay-1", "10").await.0 },
        ));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    assert_eq!(effects.load(Ordering::SeqCst), 1, "{statuses:?}");
    assert!(
        statuses
            .iter()
            .all(|s| *s == StatusCode::CREATED || *s == StatusCode::CONFLICT),
        "{statuses:?}"
    );
    let (status, headers, body) = send(&app, "pay-1", "10").await;
    assert_eq!(
        (status, body.as_ref()),
        (StatusCode::CREATED, &b"effect 1"[..])
    );
    assert_eq!(headers.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(
        send(&app, "pay-1", "99").await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(effects.load(Ordering::SeqCst), 1);
}

/// The sweeper deletes rows past their retention in batches, and only those.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_deletes_expired_rows_in_batches() {
    let store = isolated_store(|b| b).await;
    let tiny = Duration::from_millis(1);
    let mut live = Vec::new();
    // 20 completed records with a 1 ms retention, 5 with an hour.
    for i in 0..25 {
        let id = fresh_id();
        let c = claim(1, HOUR, HOUR);
        must_claim(&*store, &id, &c).await;
        let retention = if i < 20 { tiny } else { HOUR };
        store
            .complete(&id, c.token, &completed(1, "x"), retention)
            .await
            .unwrap();
        if i >= 20 {
            live.push(id);
        }
    }
    // 5 outcome_unknown records with a 1 ms retention.
    for _ in 0..5 {
        let id = fresh_id();
        let c = claim(1, HOUR, HOUR);
        must_claim(&*store, &id, &c).await;
        store
            .mark_unknown(
                &id,
                c.token,
                tiny,
                retrysafe_core::idempotency::UnknownReason::ServiceError,
            )
            .await
            .unwrap();
    }
    // 3 abandoned claims, lease and retention 1 ms; 2 live claims.
    for _ in 0..3 {
        must_claim(&*store, &fresh_id(), &claim(1, tiny, tiny)).await;
    }
    for _ in 0..2 {
        let id = fresh_id();
        must_claim(&*store, &id, &claim(1, HOUR, HOUR)).await;
        live.push(id);
    }
    let mut conn = pg_admin().await;
    assert_eq!(rows(&mut conn, &store).await, 35);
    // Wait until the short records are past their retention by the database's clock
    // (1 ms; the loop only guards against a stalled machine).
    let expired_sql = format!(
        "SELECT count(*) FROM {} WHERE expires_at <= clock_timestamp()",
        store.table()
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let n: i64 = sqlx::query_scalar(&expired_sql)
            .fetch_one(&mut conn)
            .await
            .unwrap();
        if n == 28 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "28 rows expire, {n} did"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let swept = store.sweep_expired(10).await.unwrap();
    assert_eq!((swept.rows, swept.batches), (28, 3), "10 + 10 + 8");
    assert_eq!(rows(&mut conn, &store).await, 7);
    for id in &live {
        assert!(store.get(id).await.unwrap().is_some(), "live rows are kept");
    }
    let again = store.sweep_expired(10).await.unwrap();
    assert_eq!((again.rows, again.batches), (0, 1));
}

/// A released row stays (dead, absent to readers) through a sweep within the resend
/// window, so that the same release sent again still succeeds; another token does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_keeps_a_recent_release_for_its_resend() {
    let store = isolated_store(|b| b).await;
    let id = fresh_id();
    let c = claim(1, HOUR, HOUR);
    must_claim(&*store, &id, &c).await;
    store.release(&id, c.token).await.unwrap();
    let mut conn = pg_admin().await;
    assert_eq!(
        rows(&mut conn, &store).await,
        1,
        "kept for the resend window"
    );
    assert_eq!(store.get(&id).await.unwrap(), None, "absent to readers");
    let swept = store.sweep_expired(10).await.unwrap();
    assert_eq!(swept.rows, 0);
    store.release(&id, c.token).await.unwrap();
    assert!(matches!(
        store.release(&id, Token::random()).await,
        Err(StoreError::StaleToken)
    ));
    // The next copy claims the key afresh, replacing the released row.
    must_claim(&*store, &id, &claim(1, HOUR, HOUR)).await;
    assert_eq!(rows(&mut conn, &store).await, 1);
}

/// The spawned sweeper deletes expired rows on its own, and stops when asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spawned_sweeper_runs_and_stops() {
    let store = isolated_store(|b| b).await;
    for _ in 0..7 {
        let id = fresh_id();
        let c = claim(1, HOUR, HOUR);
        must_claim(&*store, &id, &c).await;
        store
            .complete(&id, c.token, &completed(1, "x"), Duration::from_millis(1))
            .await
            .unwrap();
    }
    let keep = fresh_id();
    must_claim(&*store, &keep, &claim(1, HOUR, HOUR)).await;

    let sweeper = store.spawn_sweeper(Duration::from_millis(20), 2).unwrap();
    let mut conn = pg_admin().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while rows(&mut conn, &store).await > 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sweeper did not delete the 7 expired rows"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!sweeper.is_finished());
    sweeper.stop().await;
    assert!(store.get(&keep).await.unwrap().is_some());

    // Refused settings.
    assert_eq!(
        store.spawn_sweeper(Duration::ZERO, 10).unwrap_err().field(),
        "interval"
    );
    assert_eq!(
        store
            .spawn_sweeper(Duration::from_secs(1), 0)
            .unwrap_err()
            .field(),
        "batch"
    );
}

/// A dropped sweeper handle stops the task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_sweeper_stops() {
    let proxy = Proxy::start().await;
    let store = isolated_store_with(proxy.connect_options(), |b| b.max_connections(1)).await;
    let sweeper = store.spawn_sweeper(Duration::from_millis(10), 100).unwrap();
    // Let it sweep a few times, then drop the handle.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let start = proxy.seen().statements;
    while proxy.seen().statements < start + 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sweeper never ran"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(sweeper);
    // Stopped: the count of statements settles (the task may finish the batch it was
    // running) and then stays, over many of the sweeper's 10 ms intervals.
    let mut last = proxy.seen().statements;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = proxy.seen().statements;
        if now == last {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sweeper kept running after its handle was dropped"
        );
        last = now;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(proxy.seen().statements, last, "no sweeps after the drop");
}

/// A row that does not describe a record is `Corrupt`, from `get` and from `claim`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_rows_are_reported() {
    let store = isolated_store(|b| b).await;
    let mut conn = pg_admin().await;
    let table = store.table().to_owned();
    let id = fresh_id();
    let c = claim(1, HOUR, HOUR);
    must_claim(&*store, &id, &c).await;
    store
        .complete(&id, c.token, &completed(1, "fine"), HOUR)
        .await
        .unwrap();

    let tamper = |set: &str| format!("UPDATE {table} SET {set} WHERE k = $1");
    let corrupt = |r: Result<Option<Record>, StoreError>| match r {
        Err(StoreError::Corrupt(e)) => e,
        other => panic!("expected Corrupt, got {other:?}"),
    };

    // An unknown version byte.
    sqlx::query(&tamper(
        "record = '\\x09'::bytea || substring(record from 2)",
    ))
    .bind(&id.as_bytes()[..])
    .execute(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        corrupt(store.get(&id).await),
        DecodeError::UnknownVersion(9)
    );
    match store.claim(&id, &claim(1, HOUR, HOUR)).await {
        Err(StoreError::Corrupt(DecodeError::UnknownVersion(9))) => {}
        other => panic!("expected Corrupt from claim, got {other:?}"),
    }
    // A truncated blob.
    sqlx::query(&tamper("record = '\\x0102'::bytea"))
        .bind(&id.as_bytes()[..])
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(corrupt(store.get(&id).await), DecodeError::Truncated);
    // No blob at all.
    sqlx::query(&tamper("record = NULL"))
        .bind(&id.as_bytes()[..])
        .execute(&mut conn)
        .await
        .unwrap();
    assert!(matches!(store.get(&id).await, Err(StoreError::Corrupt(_))));
    // An in-progress row with a short token, and one with an unknown commit point.
    let other = fresh_id();
    let c = claim(1, HOUR, HOUR);
    must_claim(&*store, &other, &c).await;
    sqlx::query(&tamper("token = '\\x01'::bytea"))
        .bind(&other.as_bytes()[..])
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        corrupt(store.get(&other).await),
        DecodeError::Invalid("token")
    );
    sqlx::query(&tamper("token = $2, commit_point = 9"))
        .bind(&other.as_bytes()[..])
        .bind(&c.token.to_bytes()[..])
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        corrupt(store.get(&other).await),
        DecodeError::Invalid("commit point")
    );
    // Nothing panicked, and other records are unaffected.
    let fine = fresh_id();
    must_claim(&*store, &fine, &claim(1, HOUR, HOUR)).await;
    assert!(store.get(&fine).await.unwrap().is_some());
}

/// A port nobody listens on: `connect` fails, and a store on a lazy pool answers
/// `Timeout` or `Unavailable` — promptly, without panicking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_is_unavailable() {
    let port = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("postgres://postgres@127.0.0.1:{port}/test");
    let guard = Duration::from_secs(30);

    let connect = PostgresStore::options()
        .connect_timeout(Duration::from_millis(300))
        .connect(&url);
    let result = tokio::time::timeout(guard, connect)
        .await
        .expect("connect hung");
    assert!(result.is_err(), "connect to a closed port: {result:?}");

    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(60))
        .connect_lazy(&url)
        .unwrap();
    let store = PostgresStore::options()
        .call_timeout(Duration::from_millis(300))
        .build(pool)
        .unwrap();
    let id = fresh_id();
    let c = claim(1, HOUR, HOUR);
    let results = [
        tokio::time::timeout(guard, store.claim(&id, &c))
            .await
            .expect("claim hung")
            .map(drop),
        tokio::time::timeout(guard, store.get(&id))
            .await
            .expect("get hung")
            .map(drop),
        tokio::time::timeout(guard, store.release(&id, c.token))
            .await
            .expect("release hung"),
    ];
    for r in results {
        match r {
            Err(e @ (StoreError::Timeout | StoreError::Unavailable(_))) => {
                assert!(e.is_transient());
            }
            other => panic!("expected Timeout or Unavailable, got {other:?}"),
        }
    }
}

/// A server that stops answering mid-way: calls fail with `Timeout` after the call
/// timeout instead of hanging, and work again once it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_server_times_out() {
    let proxy = Proxy::start().await;
    let store = isolated_store_with(proxy.connect_options(), |b| {
        b.call_timeout(Duration::from_millis(300))
            .max_connections(2)
    })
    .await;
    let id = fresh_id();
    let c = claim(1, HOUR, HOUR);
    must_claim(&*store, &id, &c).await;

    proxy.freeze(true);
    let r = tokio::time::timeout(Duration::from_secs(30), store.get(&id))
        .await
        .expect("get hung past the call timeout");
    assert!(matches!(r, Err(StoreError::Timeout)), "{r:?}");
    let r = tokio::time::timeout(Duration::from_secs(30), store.claim(&id, &c))
        .await
        .expect("claim hung past the call timeout");
    assert!(matches!(r, Err(StoreError::Timeout)), "{r:?}");
    proxy.freeze(false);

    // Connections abandoned mid-call are replaced; the store recovers.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !matches!(store.get(&id).await, Ok(Some(Record::InProgress(_)))) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the store works again once the server answers"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `migrate` is idempotent, also run concurrently, and creates schema, table and index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_idempotent() {
    let store = isolated_store(|b| b.table("keys")).await; // migrated once already
    store.migrate().await.unwrap();
    let mut runs = Vec::new();
    for _ in 0..4 {
        let s = store.store.clone();
        runs.push(tokio::spawn(async move { s.migrate().await }));
    }
    for r in runs {
        r.await.unwrap().unwrap();
    }
    let mut conn = pg_admin().await;
    let index: Option<String> = sqlx::query_scalar(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname = 'keys_expires_at_idx'",
    )
    .bind(&store.schema)
    .fetch_optional(&mut conn)
    .await
    .unwrap();
    assert!(index.unwrap().contains("(expires_at)"));
    assert_eq!(store.table(), format!("{}.keys", store.schema));
    assert!(store.migration_sql().contains(&format!(
        "CREATE TABLE IF NOT EXISTS {}.keys (",
        store.schema
    )));
    // A fresh schema migrated by hand with the documented SQL works the same.
    let schema = fresh_schema();
    let by_hand = PostgresStore::options()
        .schema(schema.clone())
        .build(store.pool().clone())
        .unwrap();
    sqlx::raw_sql(&by_hand.migration_sql())
        .execute(&mut conn)
        .await
        .unwrap();
    let by_hand = TestStore {
        store: by_hand,
        schema,
    };
    let id = fresh_id();
    must_claim(&*by_hand, &id, &claim(1, HOUR, HOUR)).await;
    assert!(by_hand.get(&id).await.unwrap().is_some());
    // Each table has its own records.
    assert!(store.get(&id).await.unwrap().is_none());
}

/// Leases are measured by the database's clock: `lease_until_ms` is
/// `clock_timestamp()` at the claim plus the lease, in milliseconds since the epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_use_the_database_clock() {
    let store = isolated_store(|b| b).await;
    let mut conn = pg_admin().await;
    let db_ms = "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint";
    let lease = Duration::from_secs(30);
    let before: i64 = sqlx::query_scalar(db_ms)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let id = fresh_id();
    let c = claim(1, lease, HOUR);
    must_claim(&*store, &id, &c).await;
    let after: i64 = sqlx::query_scalar(db_ms)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let Some(Record::InProgress(p)) = store.get(&id).await.unwrap() else {
        panic!("expected in_progress");
    };
    let until = i64::try_from(p.lease_until_ms).unwrap();
    assert!(
        before + 30_000 <= until && until <= after + 30_000,
        "{before} + 30 s <= {until} <= {after} + 30 s"
    );
    // Renewal moves it from the database's now, too.
    store.renew(&id, c.token, lease * 2).await.unwrap();
    let Some(Record::InProgress(p)) = store.get(&id).await.unwrap() else {
        panic!("expected in_progress");
    };
    assert!(i64::try_from(p.lease_until_ms).unwrap() >= after + 60_000);
}

/// The configuration error of a store that could not be made.
fn config(err: PostgresStoreError) -> ConfigError {
    match err {
        PostgresStoreError::Config(e) => e,
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

/// Settings are validated where the store is made; `connect` reports them as
/// configuration errors.
#[tokio::test]
async fn settings_are_validated() {
    let pool = PgPoolOptions::new()
        .connect_lazy("postgres://postgres@127.0.0.1:1/test")
        .unwrap();
    let build = |options: PostgresStoreOptions| options.build(pool.clone());
    let b = PostgresStore::options;
    assert!(build(b()).is_ok());
    assert_eq!(
        config(build(b().table("a b")).unwrap_err()).field(),
        "table"
    );
    assert_eq!(config(build(b().schema("")).unwrap_err()).field(), "schema");
    assert_eq!(
        config(build(b().call_timeout(Duration::ZERO)).unwrap_err()).field(),
        "call_timeout"
    );
    // A refused setting stops `connect` before any connection is tried.
    let err = b()
        .table("a b")
        .connect("postgres://postgres@127.0.0.1:1/test")
        .await
        .unwrap_err();
    assert!(matches!(err, PostgresStoreError::Config(_)), "{err:?}");
    let err = b()
        .max_connections(0)
        .connect("postgres://postgres@127.0.0.1:1/test")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("max_connections"), "{err}");
    let err = PostgresStore::connect("postgres://127.0.0.1/test?sslmode=bogus")
        .await
        .unwrap_err();
    assert!(matches!(err, PostgresStoreError::InvalidUrl(_)), "{err:?}");
}

/// One validation names every refused setting, for `build` and for `connect`.
#[tokio::test]
async fn every_refused_setting_is_named() {
    let pool = PgPoolOptions::new()
        .connect_lazy("postgres://postgres@127.0.0.1:1/test")
        .unwrap();
    let e = PostgresStore::options()
        .table("a b")
        .call_timeout(Duration::ZERO)
        .build(pool)
        .unwrap_err();
    let e = config(e);
    assert_eq!(e.fields().collect::<Vec<_>>(), ["call_timeout", "table"]);

    let err = PostgresStore::options()
        .connect_timeout(Duration::ZERO)
        .max_connections(0)
        .schema("")
        .connect("postgres://postgres@127.0.0.1:1/test")
        .await
        .unwrap_err();
    let e = config(err);
    assert_eq!(
        e.fields().collect::<Vec<_>>(),
        ["connect_timeout", "max_connections", "schema"]
    );
}
