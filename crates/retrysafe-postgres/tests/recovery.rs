//! What PostgresStore keeps for recovery, beyond the reconcile conformance suite,
//! against the real PostgreSQL at `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`): no extra round trip on the request path,
//! an old table upgraded in place (and rows written by the previous release), the
//! pending index, notes cut to their bound, and adoptions bounded by the record's life.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use retrysafe_core::idempotency::{
    CommitPoint, Completed, Fingerprint, Record, RecordId, RequestInfo, Scope, StoredResponse,
    Token, UnknownReason,
};
use retrysafe_core::recovery::{PendingState, ReconcilableStore};
use retrysafe_core::store::conformance::fresh_id;
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, MAX_NOTE};
use retrysafe_postgres::PostgresStore;
use retrysafe_postgres::sqlx;
use retrysafe_test_support::pg_store::{
    Proxy, TestStore, database_url, fresh_schema, isolated_store, isolated_store_with, pg_admin,
};

const HOUR: Duration = Duration::from_secs(3600);

fn fp(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

fn info(path: &str) -> RequestInfo {
    RequestInfo::new(Scope::new("tenant-1"), Method::POST, path)
}

fn claim<'a>(request: Option<&'a RequestInfo>, lease: Duration) -> Claim<'a> {
    let c = Claim::new(Token::random(), fp(1), lease, HOUR, CommitPoint::Undeclared);
    match request {
        Some(r) => c.with_request(r),
        None => c,
    }
}

fn completed() -> Completed {
    Completed::new(
        fp(1),
        Some(StoredResponse::new(
            StatusCode::CREATED,
            Vec::new(),
            Bytes::from_static(b"done"),
            Vec::new(),
        )),
    )
}

async fn must_claim(store: &impl IdempotencyStore, id: &RecordId, c: &Claim<'_>) {
    match store.claim(id, c).await.unwrap() {
        ClaimOutcome::Claimed { .. } => {}
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// The request information rides in the claim statement: a guarded request that runs
/// is still one claim and one completion on the wire, as without it, and the row holds
/// the encoded information until the completion clears it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_info_costs_no_round_trip() {
    let proxy = Proxy::start().await;
    let store = isolated_store_with(proxy.connect_options(), |b| b.max_connections(1)).await;
    let mut conn = pg_admin().await;
    let request = info("/payments");
    let kept = format!("SELECT request FROM {} WHERE k = $1", store.table());

    async fn guarded(store: &TestStore, id: &RecordId, request: Option<&RequestInfo>) -> Token {
        let c = claim(request, HOUR);
        must_claim(store, id, &c).await;
        c.token
    }
    // Warm: prepare the statements on the one connection.
    let warm = fresh_id();
    let token = guarded(&store, &warm, Some(&request)).await;
    store
        .complete(&warm, token, &completed(), HOUR)
        .await
        .unwrap();

    for with_info in [false, true] {
        let id = fresh_id();
        let before = proxy.seen();
        let token = guarded(&store, &id, with_info.then_some(&request)).await;
        let stored: Option<Vec<u8>> = sqlx::query_scalar(&kept)
            .bind(&id.as_bytes()[..])
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            stored.map(Bytes::from),
            with_info.then(|| request.encode()),
            "the claim wrote the request information"
        );
        store
            .complete(&id, token, &completed(), HOUR)
            .await
            .unwrap();
        let seen = proxy.seen() - before;
        assert_eq!(seen.statements, 2, "claim and complete: {seen:?}");
        assert_eq!(seen.prepares + seen.simple_queries, 0, "{seen:?}");
        let stored: Option<Vec<u8>> = sqlx::query_scalar(&kept)
            .bind(&id.as_bytes()[..])
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            stored, None,
            "a completed record keeps no request information"
        );
    }
}

/// The table of the previous release (no recovery columns) is upgraded in place by
/// `migrate`; its rows read as before, its unknown outcomes are due, and rows written
/// the previous release's way (naming only its columns) still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_upgrades_an_old_table_in_place() {
    let schema = fresh_schema();
    let mut conn = pg_admin().await;
    sqlx::raw_sql(&format!(
        "CREATE SCHEMA {schema};
CREATE TABLE {schema}.retrysafe_idempotency (
    k            bytea       PRIMARY KEY,
    state        smallint    NOT NULL CHECK (state IN (1, 2, 3)),
    fingerprint  bytea       NOT NULL,
    token        bytea,
    commit_point smallint,
    lease_until  timestamptz,
    takeovers    integer     NOT NULL DEFAULT 0,
    expires_at   timestamptz NOT NULL,
    record       bytea
);"
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    let insert_old = format!(
        "INSERT INTO {schema}.retrysafe_idempotency
    (k, state, fingerprint, token, commit_point, lease_until, takeovers, expires_at, record)
VALUES ($1, $2, $3, $4, $5, clock_timestamp() + $6 * interval '1 second', 0,
        clock_timestamp() + interval '1 hour', NULL)"
    );
    let old_row = |id: RecordId, state: i16, lease_secs: Option<f64>| {
        let cp = lease_secs.map(|_| 2i16);
        let token = lease_secs.map(|_| Token::random().to_bytes().to_vec());
        sqlx::query(&insert_old)
            .bind(id.as_bytes().to_vec())
            .bind(state)
            .bind(fp(1).as_bytes().to_vec())
            .bind(token)
            .bind(cp)
            .bind(lease_secs)
    };
    let (unknown, expired) = (fresh_id(), fresh_id());
    old_row(unknown, 3, None).execute(&mut conn).await.unwrap();
    old_row(expired, 1, Some(-1.0))
        .execute(&mut conn)
        .await
        .unwrap();

    let store = PostgresStore::options()
        .schema(schema.clone())
        .connect(&database_url())
        .await
        .unwrap();
    let store = TestStore { store, schema };
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();

    assert!(matches!(
        store.get(&unknown).await.unwrap(),
        Some(Record::OutcomeUnknown(_))
    ));
    assert!(matches!(
        store.get(&expired).await.unwrap(),
        Some(Record::InProgress(_))
    ));
    let due = store.store.due(Duration::ZERO, 100).await.unwrap();
    assert!(due.contains(&unknown) && due.contains(&expired), "{due:?}");
    let p = store
        .store
        .adopt(&unknown, Token::random(), HOUR, Some(Duration::ZERO))
        .await
        .unwrap()
        .expect("adoptable");
    assert_eq!(p.state, PendingState::Unknown { reason: None });
    assert_eq!((p.request, p.note, p.notified), (None, None, false));
    let p = store.store.peek(&expired).await.unwrap().expect("pending");
    assert_eq!(
        p.state,
        PendingState::Claim {
            commit_point: CommitPoint::Passed
        }
    );

    // The previous release writes only its own columns; the store reads the row.
    let fresh = fresh_id();
    old_row(fresh, 1, Some(60.0))
        .execute(&mut conn)
        .await
        .unwrap();
    assert!(matches!(
        store.get(&fresh).await.unwrap(),
        Some(Record::InProgress(_))
    ));
    assert!(
        !store
            .store
            .due(Duration::ZERO, 100)
            .await
            .unwrap()
            .contains(&fresh)
    );
}

/// `migrate` creates the partial index on pending rows that `due` scans.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_creates_the_pending_index() {
    let store = isolated_store(|b| b.table("keys")).await;
    let mut conn = pg_admin().await;
    let index: String = sqlx::query_scalar(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname = 'keys_pending_idx'",
    )
    .bind(&store.schema)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert!(
        index.contains("(state, lease_until, next_pass)") && index.contains("WHERE"),
        "{index}"
    );
}

/// A note longer than `MAX_NOTE` is cut; `commit_point` without a note keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notes_are_cut_and_kept() {
    let store = isolated_store(|b| b).await;
    let id = fresh_id();
    let c = claim(None, HOUR);
    must_claim(&*store, &id, &c).await;
    let long = vec![7u8; MAX_NOTE + 100];
    store.commit_point_with(&id, c.token, &long).await.unwrap();
    store.commit_point(&id, c.token).await.unwrap();
    let p = store.store.peek(&id).await.unwrap().expect("a claim");
    assert_eq!(p.note.as_deref(), Some(&long[..MAX_NOTE]));
}

/// An adoption never outlasts its record: when the retention ends, the key is new
/// again, and the next claim is not told that it is being resolved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adoption_ends_with_its_record() {
    let store = isolated_store(|b| b).await;
    let id = fresh_id();
    let c = claim(None, HOUR);
    must_claim(&*store, &id, &c).await;
    let retention = Duration::from_millis(600);
    store
        .mark_unknown(&id, c.token, retention, UnknownReason::Panicked)
        .await
        .unwrap();
    let p = store
        .store
        .adopt(&id, Token::random(), HOUR, None)
        .await
        .unwrap()
        .expect("adoptable");
    assert_eq!(
        p.state,
        PendingState::Unknown {
            reason: Some(UnknownReason::Panicked)
        }
    );
    assert!(matches!(
        store.get(&id).await.unwrap(),
        Some(Record::Resolving(_))
    ));
    tokio::time::sleep(retention + Duration::from_millis(200)).await;
    assert_eq!(store.get(&id).await.unwrap(), None);
    must_claim(&*store, &id, &claim(None, HOUR)).await;
    assert!(matches!(
        store.get(&id).await.unwrap(),
        Some(Record::InProgress(_))
    ));
}

/// A copy that finds an expired claim past its commit point makes it unknown: reason
/// `lease_expired`, not yet notified, with the request and note kept; due only once a
/// reconciler's wait after the lease's end has passed, as the claim would have been.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_turning_a_lease_unknown_keeps_what_a_resolver_needs() {
    let store = isolated_store(|b| b).await;
    let id = fresh_id();
    let request = info("/orders");
    let c = claim(Some(&request), Duration::from_millis(200));
    must_claim(&*store, &id, &c).await;
    store
        .commit_point_with(&id, c.token, b"order 7")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    match store.claim(&id, &claim(None, HOUR)).await.unwrap() {
        ClaimOutcome::Existing {
            record: Record::OutcomeUnknown(_),
            became_unknown: true,
        } => {}
        other => panic!("expected the claim to become unknown, got {other:?}"),
    }
    assert!(!store.store.due(HOUR, 100).await.unwrap().contains(&id));
    assert!(
        store
            .store
            .adopt(&id, Token::random(), HOUR, Some(HOUR))
            .await
            .unwrap()
            .is_none()
    );
    let waited = Duration::from_millis(50);
    assert!(store.store.due(waited, 100).await.unwrap().contains(&id));
    let p = store.store.peek(&id).await.unwrap().expect("pending");
    assert_eq!(
        p.state,
        PendingState::Unknown {
            reason: Some(UnknownReason::LeaseExpired)
        }
    );
    assert_eq!(p.request.as_deref(), Some(&request));
    assert_eq!(p.note.as_deref(), Some(&b"order 7"[..]));
    assert!(!p.notified);
}

/// `Later` sent again succeeds and changes nothing; the late holder stays refused, and
/// an adopter whose adoption lapsed is refused even when no one adopted after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_is_idempotent_and_lapsed_adopters_are_refused() {
    use retrysafe_core::recovery::Settlement;
    use retrysafe_core::store::StoreError;

    let store = isolated_store(|b| b).await;
    let id = fresh_id();
    let c = claim(None, Duration::from_millis(100));
    must_claim(&*store, &id, &c).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let adopter = Token::random();
    store
        .store
        .adopt(&id, adopter, HOUR, Some(Duration::ZERO))
        .await
        .unwrap()
        .expect("adoptable");
    let later = Settlement::Later { after: HOUR };
    store
        .store
        .settle(&id, adopter, later.clone(), true)
        .await
        .unwrap();
    store
        .store
        .settle(&id, adopter, later, false)
        .await
        .unwrap();
    let p = store.store.peek(&id).await.unwrap().expect("pending");
    assert!(p.notified, "the resend changed nothing");
    assert!(
        !store
            .store
            .due(Duration::ZERO, 100)
            .await
            .unwrap()
            .contains(&id)
    );
    assert!(matches!(
        store
            .mark_unknown(&id, c.token, HOUR, UnknownReason::Cancelled)
            .await,
        Err(StoreError::StaleToken)
    ));

    let other = fresh_id();
    let c = claim(None, Duration::from_millis(100));
    must_claim(&*store, &other, &c).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let lapsed = Token::random();
    store
        .store
        .adopt(&other, lapsed, Duration::from_millis(100), None)
        .await
        .unwrap()
        .expect("adoptable");
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(matches!(
        store
            .store
            .settle(&other, lapsed, Settlement::Release, false)
            .await,
        Err(StoreError::StaleToken)
    ));
    // Its holder's calls work again: the record is what it was.
    store.release(&other, c.token).await.unwrap();
}

/// A record that stopped being pending under an adoption (completed by a release that
/// does not know adoptions) is not settled over: the settlement is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_completed_under_an_adoption_is_not_settled_over() {
    use retrysafe_core::recovery::Settlement;
    use retrysafe_core::store::StoreError;

    let store = isolated_store(|b| b).await;
    let id = fresh_id();
    let c = claim(None, Duration::from_millis(100));
    must_claim(&*store, &id, &c).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let adopter = Token::random();
    store
        .store
        .adopt(&id, adopter, HOUR, Some(Duration::ZERO))
        .await
        .unwrap()
        .expect("adoptable");
    // The earlier release's completion checks only state and token.
    let blob = Record::Completed(completed()).encode();
    let mut conn = pg_admin().await;
    sqlx::query(&format!(
        "UPDATE {} SET state = 2, token = NULL, commit_point = NULL, lease_until = NULL,
             record = $2 WHERE k = $1",
        store.table()
    ))
    .bind(&id.as_bytes()[..])
    .bind(&blob[..])
    .execute(&mut conn)
    .await
    .unwrap();
    assert!(matches!(
        store
            .store
            .settle(&id, adopter, Settlement::Release, false)
            .await,
        Err(StoreError::StaleToken)
    ));
    assert!(matches!(
        store
            .store
            .settle(&id, adopter, Settlement::Later { after: HOUR }, true)
            .await,
        Err(StoreError::StaleToken)
    ));
}
