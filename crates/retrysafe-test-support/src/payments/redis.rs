//! The example's Redis backend, read directly.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use retrysafe_core::idempotency::{CommitPoint, Record};
use retrysafe_core::store::IdempotencyStore;
use retrysafe_redis::RedisStore;
use retrysafe_redis::redis::cluster_async::ClusterConnection;
use retrysafe_redis::redis::{self, aio::ConnectionManager};

use super::audit::{KeyAudit, Payment, RecordState};
use super::record_id;
use crate::services::{redis_url, unique};

/// A key prefix of one test on the Redis at `REDIS_URL` (or on a Redis Cluster: `C` is
/// then a `ClusterConnection`), with direct access to what the example writes under it.
/// On one server its keys are deleted (best effort) when dropped; a test cluster is
/// private and goes away with the test process.
pub struct RedisSpace<C = ConnectionManager> {
    /// `PAYMENTS_REDIS_PREFIX` for the example.
    pub prefix: String,
    /// The Redis server's URL (`REDIS_URL`, or the one given to [`at`](Self::at)); for
    /// a cluster, one node's.
    pub url: String,
    /// A connection of the test's own.
    pub conn: C,
    /// The idempotency store the example uses, seen directly.
    pub store: RedisStore<C>,
    /// Whether the keys are deleted when dropped (one server, not a cluster).
    cleanup: bool,
}

impl<C> std::fmt::Debug for RedisSpace<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSpace")
            .field("prefix", &self.prefix)
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl RedisSpace {
    /// A key prefix of one test on the Redis at `REDIS_URL`.
    pub async fn new() -> RedisSpace {
        RedisSpace::at(&redis_url()).await
    }

    /// A key prefix of one test on the Redis server at `url` (a private server).
    pub async fn at(url: &str) -> RedisSpace {
        let url = url.to_owned();
        let client = redis::Client::open(url.as_str())
            .unwrap_or_else(|e| panic!("REDIS_URL={url} is not a valid Redis URL: {e}"));
        let conn =
            match tokio::time::timeout(Duration::from_secs(10), ConnectionManager::new(client))
                .await
            {
                Ok(Ok(conn)) => conn,
                Ok(Err(e)) => panic!(
                    "cannot reach Redis at REDIS_URL={url}: {e}. Start redis-server (or run \
                 scripts/test) or point REDIS_URL at a running server."
                ),
                Err(_) => panic!("timed out connecting to Redis at REDIS_URL={url}"),
            };
        RedisSpace::on(url, conn, true).await
    }
}

impl RedisSpace<ClusterConnection> {
    /// A key prefix of one test on the Redis Cluster whose nodes are `urls` (the
    /// example is given the first).
    pub async fn cluster(urls: &[String]) -> RedisSpace<ClusterConnection> {
        let client = redis::cluster::ClusterClient::new(urls.to_vec()).unwrap();
        let conn = tokio::time::timeout(Duration::from_secs(30), client.get_async_connection())
            .await
            .unwrap_or_else(|_| panic!("timed out connecting to the Redis Cluster at {urls:?}"))
            .unwrap_or_else(|e| panic!("cannot reach the Redis Cluster at {urls:?}: {e}"));
        RedisSpace::on(urls[0].clone(), conn, false).await
    }
}

impl<C> RedisSpace<C>
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
{
    async fn on(url: String, conn: C, cleanup: bool) -> RedisSpace<C> {
        let prefix = format!("payments-test:{}:", unique());
        let store = RedisStore::options()
            .key_prefix(format!("{prefix}idem:"))
            .call_timeout(Duration::from_secs(5))
            .build(conn.clone())
            .await
            .unwrap();
        RedisSpace {
            prefix,
            url,
            conn,
            store,
            cleanup,
        }
    }

    /// The environment that points the example at this prefix.
    pub fn env(&self) -> [(&str, &str); 1] {
        [("PAYMENTS_REDIS_PREFIX", self.prefix.as_str())]
    }

    /// The payments of `account` in the example's Redis ledger: id → amount.
    pub async fn payments(&self, account: &str) -> BTreeMap<String, i64> {
        redis::cmd("HGETALL")
            .arg(format!("{}{{ledger}}:account:{account}", self.prefix))
            .query_async(&mut self.conn.clone())
            .await
            .unwrap()
    }

    /// The amounts of `account`'s payments in the example's Redis ledger.
    pub async fn amounts(&self, account: &str) -> Vec<i64> {
        self.payments(account).await.into_values().collect()
    }

    /// The idempotency record of an anonymous client's `key`.
    pub async fn record(&self, key: &str) -> Option<Record> {
        self.store.get(&record_id(key)).await.unwrap()
    }
}

impl<C> Drop for RedisSpace<C> {
    fn drop(&mut self) {
        if !self.cleanup {
            return;
        }
        let pattern = format!("{}*", self.prefix);
        let url = self.url.clone();
        let _ = std::thread::spawn(move || {
            let Ok(client) = redis::Client::open(url.as_str()) else {
                return;
            };
            let Ok(mut conn) = client.get_connection() else {
                return;
            };
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(&pattern)
                .query(&mut conn)
                .unwrap_or_default();
            if !keys.is_empty() {
                let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(keys).query(&mut conn);
            }
        })
        .join();
    }
}

impl RedisSpace {
    /// The record and payments of each of `payments`, read in two pipelines, with the
    /// lease of an `in_progress` record compared with Redis's own clock (`TIME`).
    pub async fn audit(&self, payments: &[Payment]) -> Vec<KeyAudit> {
        let mut conn = self.conn.clone();
        let mut out = Vec::with_capacity(payments.len());
        for chunk in payments.chunks(500) {
            let mut pipe = redis::pipe();
            for p in chunk {
                pipe.cmd("GET").arg(self.store.key(&record_id(&p.key)));
            }
            for p in chunk {
                pipe.cmd("HKEYS")
                    .arg(format!("{}{{ledger}}:account:{}", self.prefix, p.account));
            }
            pipe.cmd("TIME");
            // The connection may have been broken by a restart of the server: the
            // manager reconnects after the first failed call.
            let mut tries = 0;
            let mut replies: Vec<redis::Value> = loop {
                match pipe.query_async(&mut conn).await {
                    Ok(replies) => break replies,
                    Err(e) if tries < 50 => {
                        tries += 1;
                        let _ = e;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => panic!("cannot read Redis: {e}"),
                }
            };
            let time: (u64, u64) = redis::from_redis_value(replies.pop().unwrap()).unwrap();
            let now_ms = time.0 * 1000 + time.1 / 1000;
            let ledgers = replies.split_off(chunk.len());
            for (record, ledger) in replies.into_iter().zip(ledgers) {
                let record: Option<Vec<u8>> = redis::from_redis_value(record).unwrap();
                let record = match record.map(|b| Record::decode(Bytes::from(b)).unwrap()) {
                    None => RecordState::Absent,
                    Some(Record::InProgress(p)) => RecordState::InProgress {
                        passed: p.commit_point == CommitPoint::Passed,
                        expired: p.lease_until_ms <= now_ms,
                    },
                    Some(Record::Completed(_)) => RecordState::Completed,
                    Some(Record::OutcomeUnknown(_)) => RecordState::OutcomeUnknown,
                    Some(other) => panic!("a record state this check does not know: {other:?}"),
                };
                let payments: Vec<String> = redis::from_redis_value(ledger).unwrap();
                out.push(KeyAudit { record, payments });
            }
        }
        out
    }
}
