//! Helpers shared by the Redis test binaries: the server at `REDIS_URL`, stores with a
//! random key prefix per test.
#![allow(dead_code, clippy::panic)]

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use retrysafe_core::idempotency::Token;
use retrysafe_redis::RedisStore;

/// `REDIS_URL`, default `redis://127.0.0.1:6379`.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// `host:port` of a `redis://[user[:password]@]host:port[/db]` URL.
pub fn host_port(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let hp = rest.split('/').next().unwrap_or(rest);
    if hp.contains(':') {
        hp.to_owned()
    } else {
        format!("{hp}:6379")
    }
}

/// A connection manager to `url` without a response timeout of its own (the store's
/// call timeout decides); fails the test, naming REDIS_URL, when Redis cannot be reached.
pub async fn manager_to(url: &str) -> ConnectionManager {
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
pub async fn manager() -> ConnectionManager {
    manager_to(&redis_url()).await
}

/// A key prefix no other test uses.
pub fn fresh_prefix() -> String {
    format!("retrysafe-test:{}:", Token::random().to_hex())
}

/// A store on `REDIS_URL` with a fresh key prefix.
pub async fn store() -> RedisStore {
    RedisStore::builder(manager().await)
        .key_prefix(fresh_prefix())
        .build()
        .unwrap_or_else(|e| panic!("builder: {e}"))
}
