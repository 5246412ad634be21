//! The lease race of `retrysafe_test_support::lease_race` (every interleaving of a late
//! holder's operations with a takeover's) against the MemoryStore, the
//! RedisStore (127.0.0.1:6379) and the PostgresStore (`DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`) on the real clock, with 2 s leases: each
//! store passes every check of the engine, and the three agree on the outcome of every
//! operation of every interleaving.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::disallowed_methods,
    missing_docs,
    reason = "test code: panics are the assertions; std::time::Instant only times the runs"
)]

use std::time::Duration;

use retrysafe_core::idempotency::Token;
use retrysafe_core::store::IdempotencyStore;
use retrysafe_core::store::conformance::RealClock;
use retrysafe_postgres::PostgresStore;
use retrysafe_postgres::sqlx::postgres::PgConnectOptions;
use retrysafe_redis::RedisStore;
use retrysafe_test_support::lease_race;

async fn timed<S: IdempotencyStore>(
    name: &str,
    store: &S,
    clock: &RealClock,
) -> Vec<(lease_race::Case, lease_race::Trace)> {
    let start = std::time::Instant::now();
    let traces = lease_race::run_all(store, clock).await;
    println!(
        "{name}: {} interleavings in {:.2?}",
        traces.len(),
        start.elapsed()
    );
    traces
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_redis_and_postgres_agree_on_every_interleaving() {
    // Long enough that a renewed lease is still live a few round trips later on a
    // loaded machine; every case's lease expires in one wait of 1.5 leases.
    let clock = RealClock::with_lease(Duration::from_secs(2));

    let memory = retrysafe::memory::MemoryStore::new();

    let url = "redis://127.0.0.1:6379";
    let client = retrysafe_redis::redis::Client::open(url).unwrap();
    let conn = retrysafe_redis::redis::aio::ConnectionManager::new(client)
        .await
        .unwrap_or_else(|e| panic!("cannot reach Redis at {url}: {e}"));
    let redis = RedisStore::options()
        .key_prefix(format!("lease_race:{}:", Token::random().to_hex()))
        .build(conn)
        .await
        .unwrap();

    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let options: PgConnectOptions = database_url.parse().unwrap();
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    // The `rspg_<secs>_` prefix: the PostgreSQL tests' support drops such schemas an
    // hour later.
    let schema = format!("rspg_{secs}_{}", &Token::random().to_hex()[..12]);
    let pg = PostgresStore::options()
        .schema(schema.clone())
        .max_connections(4)
        .call_timeout(Duration::from_secs(10))
        .connect_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {database_url}: {e}"));
    pg.migrate().await.unwrap();

    let (on_memory, on_redis, on_pg) = tokio::join!(
        timed("MemoryStore (real clock)", &memory, &clock),
        timed("RedisStore", &redis, &clock),
        timed("PostgresStore", &pg, &clock),
    );
    let _ = retrysafe_postgres::sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .execute(pg.pool())
        .await;

    let mut differ = 0;
    for (((case, m), (_, r)), (_, p)) in on_memory.iter().zip(&on_redis).zip(&on_pg) {
        if m != r || m != p {
            differ += 1;
            println!("DIFFER {case:?}\n  memory   {m:?}\n  redis    {r:?}\n  postgres {p:?}");
        }
    }
    assert_eq!(on_memory.len(), 108);
    assert_eq!((on_redis.len(), on_pg.len()), (108, 108));
    assert_eq!(differ, 0, "the stores disagree on {differ} interleavings");
}
