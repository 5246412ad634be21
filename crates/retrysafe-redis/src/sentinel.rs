//! [`SentinelConnection`]: a connection to the primary that Redis Sentinel names, which
//! follows it across failovers (feature `sentinel`), and [`RedisStoreOptions::connect_sentinel`].

use std::fmt;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Cmd, ErrorKind, IntoConnectionInfo, Pipeline, RedisError, RedisFuture,
    RedisResult, ServerErrorKind, Value,
};
use retrysafe_core::store::StoreError;
use tokio::time::Instant;

use crate::store::{DEFAULT_CALL_TIMEOUT, bounded, unreachable};
use crate::{RedisStore, RedisStoreError, RedisStoreOptions};

/// How long a connection may stay silent under a request before it is given up: a
/// request abandoned (by its caller's timeout) after this long, with no reply on its
/// connection since it was sent, means the primary froze or the network lost it.
const STALLED: Duration = Duration::from_millis(500);

/// A connection to the primary of a service that Redis Sentinel monitors: asks the
/// sentinels where the primary is, connects to it, and asks again after a failover.
/// Feature `sentinel`.
///
/// The primary is given up, and the next request finds it anew through the sentinels,
/// when:
///
/// - its connection breaks (a killed or restarted primary, a sentinel's `CLIENT KILL`
///   after it reconfigured the node);
/// - it answers `READONLY` (it was demoted to a replica by a failover);
/// - a request is abandoned by its caller after half a second or more without any
///   reply on that connection since it was sent (a frozen primary, a lost network).
///
/// The request that met the failure fails (a store answers it 503
/// `store-unavailable`); later ones go to the primary the sentinels name. Each change
/// of primary is logged (target `retrysafe::redis`): a warning naming the cause when
/// one is given up, and the address of the next. Requests are pipelined on one
/// multiplexed connection; clones share it. Scripts are sent by SHA and loaded again
/// on a primary that lacks them (`NOSCRIPT`), so a promoted replica needs nothing.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use retrysafe::redis::{RedisStore, SentinelConnection};
///
/// let conn = SentinelConnection::connect(
///     ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379"],
///     "payments",
///     None,
/// )
/// .await?;
/// assert_eq!(conn.service(), "payments");
/// let store = RedisStore::options().build(conn).await?;
/// # let _ = store;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SentinelConnection {
    shared: Arc<Shared>,
}

struct Shared {
    service: String,
    /// Asks the sentinels; held while a primary is found and connected to, so that
    /// concurrent requests after a failover make one connection, not one each.
    sentinel: tokio::sync::Mutex<SentinelClient>,
    /// The primary in use; `None` once it was given up.
    current: Mutex<Option<Primary>>,
    config: AsyncConnectionConfig,
    /// Numbers the connections made, so that a late failure of an old one cannot give
    /// up its successor.
    made: AtomicU64,
    db: AtomicI64,
    /// The start of the clock of [`Primary::last_reply`].
    epoch: Instant,
}

/// One connection to a primary.
#[derive(Clone)]
struct Primary {
    conn: MultiplexedConnection,
    addr: Arc<str>,
    generation: u64,
    /// When this connection last brought a reply, in ms since [`Shared::epoch`].
    last_reply: Arc<AtomicU64>,
}

impl fmt::Debug for SentinelConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelConnection")
            .field("service", &self.shared.service)
            .field("primary", &self.primary())
            .finish_non_exhaustive()
    }
}

impl SentinelConnection {
    /// Asks the `sentinels` (in order, until one answers) for the primary of `service`,
    /// checks that it is a primary (`ROLE`), and connects to it. `primary_info` carries
    /// what the primary needs beyond its address (password, database, TLS); the
    /// sentinels' own credentials go in their URLs.
    ///
    /// Each connection attempt is bounded by a 1 s connection timeout; the whole is not
    /// (a store's constructor bounds it).
    pub async fn connect<T: IntoConnectionInfo>(
        sentinels: impl IntoIterator<Item = T>,
        service: &str,
        primary_info: Option<SentinelNodeConnectionInfo>,
    ) -> RedisResult<Self> {
        let client = SentinelClient::build(
            sentinels.into_iter().collect(),
            service.to_owned(),
            primary_info,
            SentinelServerType::Master,
        )?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(DEFAULT_CALL_TIMEOUT))
            // The caller's timeout bounds each request: a `WAIT` may rightly take long.
            .set_response_timeout(None);
        let conn = SentinelConnection {
            shared: Arc::new(Shared {
                service: service.to_owned(),
                sentinel: tokio::sync::Mutex::new(client),
                current: Mutex::new(None),
                config,
                made: AtomicU64::new(0),
                db: AtomicI64::new(0),
                epoch: Instant::now(),
            }),
        };
        conn.shared.primary().await?;
        Ok(conn)
    }

    /// The name of the service the sentinels monitor.
    pub fn service(&self) -> &str {
        &self.shared.service
    }

    /// The address (`host:port`) of the primary in use, or `None` while it is being
    /// found again after a failover.
    pub fn primary(&self) -> Option<String> {
        lock(&self.shared.current)
            .as_ref()
            .map(|p| p.addr.to_string())
    }
}

impl Shared {
    /// The primary in use, or a new connection to the one the sentinels name now.
    async fn primary(&self) -> RedisResult<Primary> {
        if let Some(primary) = lock(&self.current).clone() {
            return Ok(primary);
        }
        let mut sentinel = self.sentinel.lock().await;
        // Found by another request while this one waited.
        if let Some(primary) = lock(&self.current).clone() {
            return Ok(primary);
        }
        let client = sentinel.async_get_client().await?;
        let addr: Arc<str> = client.get_connection_info().addr().to_string().into();
        let conn = client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        self.db.store(conn.get_db(), Ordering::Relaxed);
        let primary = Primary {
            conn,
            addr,
            generation: self.made.fetch_add(1, Ordering::Relaxed) + 1,
            last_reply: Arc::new(AtomicU64::new(self.now_ms())),
        };
        *lock(&self.current) = Some(primary.clone());
        tracing::info!(
            target: "retrysafe::redis",
            service = self.service.as_str(),
            primary = &*primary.addr,
            "Redis Sentinel: connected to the primary"
        );
        Ok(primary)
    }

    /// Gives `primary` up, unless it was already replaced: the next request asks the
    /// sentinels.
    fn give_up(&self, primary: &Primary, cause: &dyn fmt::Display) {
        let mut current = lock(&self.current);
        if current
            .as_ref()
            .is_some_and(|c| c.generation == primary.generation)
        {
            *current = None;
            drop(current);
            tracing::warn!(
                target: "retrysafe::redis",
                service = self.service.as_str(),
                primary = &*primary.addr,
                cause = %cause,
                "Redis Sentinel: gave up the primary; asking the sentinels for the current one"
            );
        }
    }

    /// Gives `primary` up when `reply` says it is no longer one, or that its connection
    /// is lost.
    fn check<T>(&self, primary: &Primary, reply: &RedisResult<T>, read_only: impl Fn(&T) -> bool) {
        primary.last_reply.store(self.now_ms(), Ordering::Relaxed);
        match reply {
            Err(e) if lost(e) => self.give_up(primary, e),
            Ok(value) if read_only(value) => self.give_up(
                primary,
                &"it answered READONLY: a failover made it a replica",
            ),
            _ => {}
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// Whether an error means the connection is gone or its node is no longer a primary.
fn lost(e: &RedisError) -> bool {
    e.is_unrecoverable_error()
        || e.is_connection_dropped()
        || e.is_io_error()
        || e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
}

/// Whether a reply is a `READONLY` error.
fn read_only(value: &Value) -> bool {
    matches!(value, Value::ServerError(e) if e.kind() == Some(ServerErrorKind::ReadOnly))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A request on its way: when dropped before its reply came (its caller gave up), and
/// its connection brought no reply since it was sent, for [`STALLED`] or longer, the
/// connection is given up.
struct InFlight<'a> {
    shared: &'a Shared,
    primary: Primary,
    sent_ms: u64,
    answered: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let now = self.shared.now_ms();
        let silent = self.primary.last_reply.load(Ordering::Relaxed) < self.sent_ms;
        if silent && now.saturating_sub(self.sent_ms) >= millis(STALLED) {
            self.shared.give_up(
                &self.primary,
                &format_args!(
                    "no reply for {} ms (a frozen primary, or a lost network)",
                    now - self.sent_ms
                ),
            );
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl ConnectionLike for SentinelConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let shared = &*self.shared;
            let primary = shared.primary().await?;
            let mut flight = InFlight {
                sent_ms: shared.now_ms(),
                primary,
                shared,
                answered: false,
            };
            let mut conn = flight.primary.conn.clone();
            let reply = conn.send_packed_command(cmd).await;
            flight.answered = true;
            shared.check(&flight.primary, &reply, read_only);
            reply
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let shared = &*self.shared;
            let primary = shared.primary().await?;
            let mut flight = InFlight {
                sent_ms: shared.now_ms(),
                primary,
                shared,
                answered: false,
            };
            let mut conn = flight.primary.conn.clone();
            let reply = conn.send_packed_commands(pipeline, offset, count).await;
            flight.answered = true;
            shared.check(&flight.primary, &reply, |values: &Vec<Value>| {
                values.iter().any(read_only)
            });
            reply
        })
    }

    fn get_db(&self) -> i64 {
        self.shared.db.load(Ordering::Relaxed)
    }
}

impl RedisStoreOptions {
    /// Finds the primary of `service` through `sentinels` (any subset of them; each a
    /// `redis://HOST:PORT` URL, with the sentinels' credentials if they need any),
    /// checks it as [`build`](Self::build) does, and returns a store with these
    /// settings that follows the primary across failovers (see
    /// [`SentinelConnection`]). Feature `sentinel`.
    ///
    /// A primary that needs a password: make the connection with
    /// [`SentinelConnection::connect`] and [`build`](Self::build) over it.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use retrysafe::redis::RedisStore;
    ///
    /// let store = RedisStore::options().connect_sentinel(
    ///     ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"],
    ///     "payments",
    /// )
    /// .await?;
    /// println!("primary: {:?}", store.connection().primary());
    /// # Ok(()) }
    /// ```
    pub async fn connect_sentinel<T: IntoConnectionInfo>(
        self,
        sentinels: impl IntoIterator<Item = T>,
        service: &str,
    ) -> Result<RedisStore<SentinelConnection>, RedisStoreError> {
        let conn = bounded(
            DEFAULT_CALL_TIMEOUT * 5,
            SentinelConnection::connect(sentinels, service, None),
        )
        .await
        .map_err(|e| {
            let at = format!("the primary of the Redis Sentinel service {service:?}");
            match e {
                StoreError::Timeout => RedisStoreError::Unreachable {
                    at,
                    cause: format!("not found within {:?}", DEFAULT_CALL_TIMEOUT * 5),
                },
                e => unreachable(at, &e),
            }
        })?;
        self.build(conn).await
    }
}
