//! Helpers shared by the Redis test binaries: the server at `REDIS_URL`, stores with a
//! random key prefix per test.
#![allow(dead_code, clippy::panic)]

pub(crate) mod events;

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use retrysafe_core::idempotency::Token;
use retrysafe_redis::RedisStore;
pub(crate) use retrysafe_test_support::services::redis_url;

/// A connection manager to `url` without a response timeout of its own (the store's
/// call timeout decides); fails the test, naming REDIS_URL, when Redis cannot be reached.
pub(crate) async fn manager_to(url: &str) -> ConnectionManager {
    let client = redis::Client::open(url)
        .unwrap_or_else(|e| panic!("REDIS_URL={url} is not a valid Redis URL: {e}"));
    let config = ConnectionManagerConfig::new()
        .set_response_timeout(None)
        .set_number_of_retries(2);
    match tokio::time::timeout(
        Duration::from_secs(10),
        ConnectionManager::new_with_config(client, config),
    )
    .await
    {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => panic!(
            "cannot reach Redis at REDIS_URL={url}: {e}. Start redis-server (or run \
             scripts/test) or point REDIS_URL at a running server."
        ),
        Err(_) => panic!("timed out connecting to Redis at REDIS_URL={url}"),
    }
}

/// A connection manager to `REDIS_URL`.
pub(crate) async fn manager() -> ConnectionManager {
    manager_to(&redis_url()).await
}

/// A key prefix no other test uses.
pub(crate) fn fresh_prefix() -> String {
    format!("retrysafe-test:{}:", Token::random().to_hex())
}

/// A store on `REDIS_URL` with a fresh key prefix.
pub(crate) async fn store() -> RedisStore {
    RedisStore::options()
        .key_prefix(fresh_prefix())
        .build(manager().await)
        .await
        .unwrap_or_else(|e| panic!("options: {e}"))
}

/// A lock held in Redis, so that tests that change server-wide state (the eviction
/// policy, the script cache) do not overlap, in this process or another test run. It
/// expires by itself after 30 s should a test fail while holding it.
pub(crate) struct ServerLock {
    key: String,
    token: String,
}

impl ServerLock {
    pub(crate) async fn acquire(conn: &mut ConnectionManager, name: &str) -> Self {
        let key = format!("retrysafe-test:lock:{name}");
        let token = Token::random().to_hex();
        for _ in 0..600 {
            let set: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg(&token)
                .arg("NX")
                .arg("PX")
                .arg(30_000)
                .query_async(conn)
                .await
                .unwrap_or_else(|e| panic!("lock {key}: {e}"));
            if set.is_some() {
                return ServerLock { key, token };
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("lock {key} not acquired within a minute");
    }

    pub(crate) async fn release(self, conn: &mut ConnectionManager) {
        let _: i64 = redis::Script::new(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then \
             return redis.call('DEL', KEYS[1]) end return 0",
        )
        .key(&self.key)
        .arg(&self.token)
        .invoke_async(conn)
        .await
        .unwrap_or_else(|e| panic!("unlock {}: {e}", self.key));
    }
}
