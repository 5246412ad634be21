//! Redis for the tests and benches of the Redis store: a connection that counts the
//! requests it sends, so tests and benches can count a store's round trips;
//! [`LocalCluster`], a Redis Cluster of 3 primaries and 3 replicas on loopback ports,
//! for tests of the store on a cluster and across failovers; [`LocalSentinel`], a
//! primary with two replicas watched by three sentinels; and [`LocalReplicaPair`], a
//! primary and one replica, for replica-acknowledged writes.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use retrysafe_redis::RedisStore;
//! use retrysafe_redis::redis::aio::ConnectionManager;
//! use retrysafe_test_support::redis_nodes::CountingConnection;
//!
//! let client = retrysafe_redis::redis::Client::open("redis://127.0.0.1:6379")?;
//! let conn = CountingConnection::new(ConnectionManager::new(client).await?);
//! let store = RedisStore::options().build(conn.clone()).await?;
//! // ... use the store ...
//! println!("{} round trips", conn.take());
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use retrysafe_redis::redis::aio::{ConnectionLike, ConnectionManager};
use retrysafe_redis::redis::{Cmd, Pipeline, RedisFuture, Value};

/// A [`ConnectionManager`] that counts the requests it sends (a pipeline counts once:
/// one round trip). Clones share the count.
#[derive(Clone)]
pub struct CountingConnection {
    inner: ConnectionManager,
    sent: Arc<AtomicU64>,
}

impl CountingConnection {
    /// Counts the requests sent over `inner`, from zero.
    pub fn new(inner: ConnectionManager) -> Self {
        CountingConnection {
            inner,
            sent: Arc::default(),
        }
    }

    /// The requests sent since the last call (or since it was made), and starts over.
    pub fn take(&self) -> u64 {
        self.sent.swap(0, Ordering::SeqCst)
    }
}

impl std::fmt::Debug for CountingConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CountingConnection")
            .field("sent", &self.sent.load(Ordering::SeqCst))
            .finish_non_exhaustive()
    }
}

impl ConnectionLike for CountingConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        self.sent.fetch_add(1, Ordering::SeqCst);
        self.inner.req_packed_command(cmd)
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.sent.fetch_add(1, Ordering::SeqCst);
        self.inner.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}

mod cluster;
mod local;
mod pair;
mod sentinel;

pub use cluster::LocalCluster;
pub use local::{LocalError, info_field};
pub use pair::LocalReplicaPair;
pub use sentinel::LocalSentinel;
