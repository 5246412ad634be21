//! The replication settings of PostgresStore against the real PostgreSQL at
//! `DATABASE_URL`, which has no standby: the warning `connect` logs, read from a
//! tracing layer that captures events, and the `synchronous_commit` level the store's
//! writes (and the transactional layer's on the store's pool) commit at, read by a
//! trigger on the store's table inside those writes.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use retrysafe_core::idempotency::{CommitPoint, Completed, Fingerprint, Token};
use retrysafe_core::store::conformance::fresh_id;
use retrysafe_core::store::{Claim, IdempotencyStore};
use retrysafe_postgres::sqlx::postgres::PgPoolOptions;
use retrysafe_postgres::sqlx::{self, PgPool};
use retrysafe_postgres::{PostgresStore, SynchronousCommit};
use retrysafe_test_support::pg_store::{
    TestStore, database_url, isolated_store, pg_admin, pg_options,
};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt as _};

/// The events of one test: level, target, and the message with every field.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<(Level, String, String)>>>);

impl<S: Subscriber> Layer<S> for Captured {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        struct Text<'a>(&'a mut String);
        impl Visit for Text<'_> {
            fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
                let _ = write!(self.0, "{}={value:?} ", field.name());
            }
        }
        let mut text = String::new();
        event.record(&mut Text(&mut text));
        let meta = event.metadata();
        let seen = (*meta.level(), meta.target().to_owned(), text);
        self.0.lock().unwrap().push(seen);
    }
}

impl Captured {
    /// Captures the events of this thread (the test's, on a current-thread runtime)
    /// while the guard lives.
    fn start(&self) -> tracing::subscriber::DefaultGuard {
        tracing::subscriber::set_default(tracing_subscriber::registry().with(self.clone()))
    }

    /// The warnings of the store's target.
    fn warnings(&self) -> Vec<String> {
        let events = self.0.lock().unwrap();
        events
            .iter()
            .filter(|(level, target, _)| *level == Level::WARN && target == "retrysafe::postgres")
            .map(|(_, _, text)| text.clone())
            .collect()
    }
}

/// The server has no synchronous standby and streams to no standby: what every test
/// here starts from.
async fn assert_no_standby() {
    let mut conn = pg_admin().await;
    let (names, standbys): (String, i64) = sqlx::query_as(
        "SELECT current_setting('synchronous_standby_names'), \
                (SELECT count(*) FROM pg_stat_replication)",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        (names.as_str(), standbys),
        ("", 0),
        "DATABASE_URL={} must have no standby for these tests",
        database_url()
    );
}

#[tokio::test]
async fn connect_warns_when_a_level_waits_for_a_standby_that_is_not_named() {
    assert_no_standby().await;
    let captured = Captured::default();
    let guard = captured.start();
    let store = PostgresStore::options()
        .synchronous_commit(SynchronousCommit::RemoteApply)
        .connect_with(pg_options())
        .await
        .unwrap();
    drop(guard);
    let warnings = captured.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("synchronous_standby_names is empty"),
        "{warnings:?}"
    );
    assert!(warnings[0].contains("RemoteApply"), "{warnings:?}");
    let report = store.check_replication().await.unwrap();
    assert!(!report.survives_promotion(), "{report:?}");
}

#[tokio::test]
async fn connect_is_silent_without_standbys_or_a_level_that_waits() {
    assert_no_standby().await;
    for level in [None, Some(SynchronousCommit::Local)] {
        let captured = Captured::default();
        let guard = captured.start();
        let mut options = PostgresStore::options();
        if let Some(level) = level {
            options = options.synchronous_commit(level);
        }
        let store = options.connect_with(pg_options()).await.unwrap();
        drop(guard);
        assert_eq!(captured.warnings(), Vec::<String>::new(), "{level:?}");
        drop(store);
    }
}

/// A trigger on the store's table that notes, for every row the store inserts or
/// updates, the `synchronous_commit` and `statement_timeout` of the transaction.
async fn note_levels(store: &TestStore) {
    let s = &store.schema;
    let statements = [
        format!("CREATE TABLE {s}.levels (n serial, level text, timeout text)"),
        format!(
            "CREATE FUNCTION {s}.note_level() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN INSERT INTO {s}.levels (level, timeout) VALUES \
             (current_setting('synchronous_commit'), current_setting('statement_timeout')); \
             RETURN NULL; END $$"
        ),
        format!(
            "CREATE TRIGGER note_level AFTER INSERT OR UPDATE ON {} \
             FOR EACH ROW EXECUTE FUNCTION {s}.note_level()",
            store.table()
        ),
    ];
    let mut conn = pg_admin().await;
    for statement in statements {
        sqlx::raw_sql(&statement).execute(&mut conn).await.unwrap();
    }
}

/// The levels noted since the last call, oldest first.
async fn levels(store: &TestStore) -> Vec<(String, String)> {
    let mut conn = pg_admin().await;
    let s = &store.schema;
    let seen = sqlx::query_as(&format!(
        "DELETE FROM {s}.levels RETURNING level, timeout, n"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let mut seen: Vec<(String, String, i32)> = seen;
    seen.sort_by_key(|(_, _, n)| *n);
    seen.into_iter().map(|(l, t, _)| (l, t)).collect()
}

/// A claim, a commit point and a completion of a fresh key.
async fn write_one(store: &PostgresStore) {
    let (id, claim) = (
        fresh_id(),
        Claim::new(
            Token::random(),
            Fingerprint::from_bytes([7; 32]),
            Duration::from_secs(10),
            Duration::from_secs(60),
            CommitPoint::Before,
        ),
    );
    store.claim(&id, &claim).await.unwrap();
    store.commit_point(&id, claim.token).await.unwrap();
    let done = Completed::new(claim.fingerprint, None);
    store
        .complete(&id, claim.token, &done, Duration::from_secs(60))
        .await
        .unwrap();
}

/// A pool of one session: what a store built on it writes with, the next statement on
/// the pool reads in the same session.
async fn one_session() -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .connect_with(pg_options())
        .await
        .unwrap()
}

async fn session_level(pool: &PgPool) -> String {
    sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_store_built_on_a_pool_of_yours_commits_its_writes_at_the_level_asked() {
    let store = isolated_store(|o| o).await;
    note_levels(&store).await;
    let pool = one_session().await;
    let default = session_level(&pool).await;
    let built = PostgresStore::options()
        .schema(store.schema.clone())
        .call_timeout(Duration::from_millis(1500))
        .synchronous_commit(SynchronousCommit::RemoteApply)
        .build(pool.clone())
        .unwrap();
    write_one(&built).await;
    // With a level that waits, the server's timeout is twice the call timeout.
    let asked = ("remote_apply".to_owned(), "3s".to_owned());
    assert_eq!(levels(&store).await, vec![asked.clone(); 3]);
    assert_eq!(
        session_level(&pool).await,
        default,
        "SET LOCAL: the session keeps its own"
    );

    let local = PostgresStore::options()
        .schema(store.schema.clone())
        .synchronous_commit(SynchronousCommit::Local)
        .build(pool.clone())
        .unwrap();
    write_one(&local).await;
    let seen = levels(&store).await;
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|(l, _)| l == "local"), "{seen:?}");
    assert!(seen.iter().all(|(_, t)| *t != "3s"), "{seen:?}");

    let plain = PostgresStore::options()
        .schema(store.schema.clone())
        .build(pool.clone())
        .unwrap();
    write_one(&plain).await;
    let seen = levels(&store).await;
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|(l, _)| *l == default), "{seen:?}");
}

#[tokio::test]
async fn a_connected_store_commits_its_writes_at_the_level_asked() {
    let store = isolated_store(|o| {
        o.call_timeout(Duration::from_millis(1500))
            .synchronous_commit(SynchronousCommit::RemoteApply)
    })
    .await;
    note_levels(&store).await;
    write_one(&store).await;
    let asked = ("remote_apply".to_owned(), "3s".to_owned());
    assert_eq!(levels(&store).await, vec![asked; 3]);
}

#[tokio::test]
async fn the_transactional_layer_on_a_built_store_commits_at_its_level() {
    use axum::Router;
    use axum::body::{Body, to_bytes};
    use axum::extract::Request;
    use axum::http::StatusCode;
    use axum::routing::post;
    use retrysafe_core::idempotency::Principal;
    use retrysafe_postgres::tx::{IdempotentTx, TxBackend, TxIdempotencyLayer};
    use tower::ServiceExt;

    let store = isolated_store(|o| o).await;
    note_levels(&store).await;
    let pool = one_session().await;
    let default = session_level(&pool).await;
    let built = PostgresStore::options()
        .schema(store.schema.clone())
        .synchronous_commit(SynchronousCommit::RemoteApply)
        .build(pool.clone())
        .unwrap();
    let app = Router::new()
        .route(
            "/pay",
            post(|mut tx: IdempotentTx| async move {
                let level: String = sqlx::query_scalar("SHOW synchronous_commit")
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
                (StatusCode::CREATED, level)
            }),
        )
        .layer(TxIdempotencyLayer::with_backend(TxBackend::from_store(
            &built,
        )))
        .layer(axum::middleware::map_request(|mut req: Request| async {
            req.extensions_mut().insert(Principal::new("alice"));
            req
        }));
    let req = Request::post("/pay")
        .header("idempotency-key", "k")
        .body(Body::from("pay"))
        .unwrap();
    let res = app.oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    let body = to_bytes(res.into_body(), usize::MAX).await.unwrap();
    assert_eq!(body, "remote_apply", "inside the handler's transaction");
    let seen = levels(&store).await;
    assert!(!seen.is_empty(), "the key row was written");
    assert!(seen.iter().all(|(l, _)| l == "remote_apply"), "{seen:?}");
    assert_eq!(session_level(&pool).await, default);
}
