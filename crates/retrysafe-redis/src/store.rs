//! [`RedisStore`]: the store, its options and its [`IdempotencyStore`] implementation.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rand::Rng;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{IntoConnectionInfo, RedisError, RedisResult};
use retrysafe_core::__private::Validate;
use retrysafe_core::ConfigError;
use retrysafe_core::idempotency::{
    Completed, Fingerprint, InProgress, OutcomeUnknown, Record, RecordId, Token,
};
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, RESEND_WINDOW, StoreError};
use retrysafe_core::wire::MAX_TIMEOUT;
use tokio::time::Instant;

use crate::CheckError;
use crate::scripts::{BECAME_UNKNOWN, CLAIMED, EXISTING, SCRIPTS, TAKEN_OVER};

/// The default key prefix.
const DEFAULT_KEY_PREFIX: &str = "retrysafe:";

/// The default bound on every store call.
const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// Durations longer than this (a century) are clamped before they become milliseconds.
const MAX_SPAN: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// The first and the longest pause between two polls of [`IdempotencyStore::wait`].
const POLL_MIN: Duration = Duration::from_millis(5);
const POLL_MAX: Duration = Duration::from_millis(100);

/// How often [`RedisStore::connect`] retries a connection (also when reconnecting).
const CONNECT_RETRIES: usize = 2;

/// The longest pause between two connection attempts of [`RedisStore::connect`].
const CONNECT_MAX_DELAY: Duration = Duration::from_secs(1);

/// An [`IdempotencyStore`] on Redis: one key per record, each transition one Lua script.
///
/// - **Keys.** A record lives under `{prefix}{<record id in hex>}` (default prefix
///   `retrysafe:`); the braces are a Redis Cluster hash tag, so every key maps to the
///   slot of its own record id and each script touches one key. See
///   [`key`](Self::key). A release or `mark_unknown` also writes its token, for a
///   minute ([`RESEND_WINDOW`]), under that key with `:last` appended, so that the same
///   call sent again after a lost reply succeeds.
/// - **Values.** The record's [`Record::encode`] blob: a record's size in Redis is its
///   encoded length, and app servers of two releases read each other's records.
/// - **Transitions.** `claim`, `complete`, `release`, `renew`, `commit_point` and
///   `mark_unknown` are Lua scripts (`EVALSHA`, loaded on first use) that check the token
///   and, for a claim, return the existing record: one round trip per call. `get` is one
///   `GET`.
/// - **Time.** Lease ends come from Redis's own clock (`TIME` inside the script), so
///   app-server clock skew cannot break a lease. Expiry is `PX`: an `in_progress` key
///   lives for its lease plus the claim's retention, so that an expired lease can still
///   be taken over (before the commit point, same fingerprint) or turned into
///   `outcome_unknown` by the next copy; completed and `outcome_unknown` records live for
///   their retention.
/// - **Timeouts.** Every call is bounded by the [`call_timeout`](RedisStoreOptions::call_timeout)
///   (default 1 s): a slow call is [`StoreError::Timeout`], a failed one
///   [`StoreError::Unavailable`]. The connection may have its own response timeout
///   (redis-rs's `ConnectionManager` defaults to 500 ms; [`connect`](Self::connect)
///   turns it off so that the call timeout decides).
/// - **Waiting.** [`wait`](IdempotencyStore::wait) polls with backoff (5 ms doubling to
///   100 ms, jittered) and returns when the record leaves `in_progress` or its lease
///   ends (by Redis's clock).
///
/// The store is generic over the connection: a [`ConnectionManager`] (the default), a
/// cluster connection (`redis::cluster_async::ClusterConnection`, see
/// `connect_cluster` with the `cluster` feature), or any `ConnectionLike` that is
/// `Clone`. Cloning the store is cheap and shares the connection.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use retrysafe_core::idempotency::{
///     CommitPoint, Completed, Fingerprint, Record, RecordId, Scope, Token,
/// };
/// use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore};
/// use retrysafe_core::wire::IdempotencyKey;
/// use retrysafe_redis::RedisStore;
///
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// let id = RecordId::new(&Scope::new("tenant-1"), &IdempotencyKey::new("order-42")?);
/// let claim = Claim::new(
///     Token::random(),
///     Fingerprint::from_bytes([7; 32]),
///     Duration::from_secs(10),
///     Duration::from_secs(24 * 60 * 60),
///     CommitPoint::Undeclared,
/// );
/// assert_eq!(store.claim(&id, &claim).await?, ClaimOutcome::Claimed { takeover: false });
///
/// let done = Completed::new(claim.fingerprint, None);
/// store.complete(&id, claim.token, &done, claim.retention).await?;
/// assert_eq!(store.get(&id).await?, Some(Record::Completed(done)));
/// # Ok(()) }
/// ```
pub struct RedisStore<C = ConnectionManager> {
    conn: C,
    config: Arc<Config>,
}

#[derive(Debug)]
struct Config {
    prefix: String,
    call_timeout: Duration,
}

impl<C: Clone> Clone for RedisStore<C> {
    fn clone(&self) -> Self {
        RedisStore {
            conn: self.conn.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<C> fmt::Debug for RedisStore<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("connection", &std::any::type_name::<C>())
            .field("key_prefix", &self.config.prefix)
            .field("call_timeout", &self.config.call_timeout)
            .finish()
    }
}

impl RedisStore {
    /// Connects to the Redis server at `url` (for example `redis://127.0.0.1:6379`)
    /// with a [`ConnectionManager`], checks the server's configuration (see
    /// [`RedisStoreOptions::build`]: `maxmemory-policy` must be `noeviction`), and
    /// returns a store with the default settings.
    ///
    /// The manager reconnects by itself after a lost connection. It is configured
    /// here with a 1 s connection timeout, two retries per connection attempt, and no
    /// response timeout of its own (the store's call timeout bounds every call). To
    /// configure it differently (or to skip the check), build it yourself and pass it
    /// to [`options`](Self::options)`().build(conn)`.
    ///
    /// A server that cannot be reached is [`CheckError::Store`] with
    /// [`StoreError::Unavailable`] (or [`StoreError::Timeout`]), never a hang.
    pub async fn connect(url: impl IntoConnectionInfo) -> Result<Self, CheckError> {
        let client = redis::Client::open(url).map_err(StoreError::unavailable)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(DEFAULT_CALL_TIMEOUT))
            .set_response_timeout(None)
            .set_number_of_retries(CONNECT_RETRIES)
            .set_max_delay(CONNECT_MAX_DELAY);
        // Each attempt is bounded by the connection timeout; the whole by a few of them.
        let bound = DEFAULT_CALL_TIMEOUT * 5;
        let conn = bounded(bound, ConnectionManager::new_with_config(client, config)).await?;
        RedisStoreOptions::new().build(conn).await
    }

    /// The settings of a store (key prefix, call timeout) with their defaults, to be
    /// changed and then [built](RedisStoreOptions::build) over a connection.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use retrysafe_redis::RedisStore;
    ///
    /// let client = redis::Client::open("redis://127.0.0.1:6379")?;
    /// let conn = redis::aio::ConnectionManager::new(client).await?;
    /// let store = RedisStore::options()
    ///     .key_prefix("billing:idem:")
    ///     .call_timeout(Duration::from_millis(300))
    ///     .build(conn) // also checks the server's maxmemory-policy
    ///     .await?;
    /// assert_eq!(store.key_prefix(), "billing:idem:");
    /// # Ok(()) }
    /// ```
    pub fn options() -> RedisStoreOptions {
        RedisStoreOptions::new()
    }
}

#[cfg(feature = "cluster")]
impl RedisStore<redis::cluster_async::ClusterConnection> {
    /// Connects to a Redis Cluster through its `nodes` (any subset; the others are
    /// discovered), checks the configuration of the node it asks (see
    /// [`RedisStoreOptions::build`]), and returns a store with the default settings.
    /// Feature `cluster`.
    ///
    /// Every record is one key whose hash tag is its record id, so each script runs on
    /// the node that owns that key's slot.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use retrysafe_redis::RedisStore;
    /// let store = RedisStore::connect_cluster([
    ///     "redis://10.0.0.1:6379",
    ///     "redis://10.0.0.2:6379",
    /// ])
    /// .await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_cluster<T: IntoConnectionInfo>(
        nodes: impl IntoIterator<Item = T>,
    ) -> Result<Self, CheckError> {
        let timeout = DEFAULT_CALL_TIMEOUT;
        let client = redis::cluster::ClusterClient::builder(nodes)
            .connection_timeout(timeout)
            .build()
            .map_err(StoreError::unavailable)?;
        let conn = bounded(timeout * 5, client.get_async_connection()).await?;
        RedisStoreOptions::new().build(conn).await
    }
}

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The Redis key of a record: the key prefix, then the record id in lowercase hex
    /// inside braces (a Redis Cluster hash tag).
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use retrysafe_core::idempotency::RecordId;
    /// use retrysafe_redis::RedisStore;
    ///
    /// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
    /// let id = RecordId::from_bytes([0xab; 32]);
    /// assert_eq!(store.key(&id), format!("retrysafe:{{{}}}", "ab".repeat(32)));
    /// # Ok(()) }
    /// ```
    pub fn key(&self, id: &RecordId) -> String {
        format!("{}{{{}}}", self.config.prefix, id.to_hex())
    }

    /// The key prefix.
    pub fn key_prefix(&self) -> &str {
        &self.config.prefix
    }

    /// The bound on every store call.
    pub fn call_timeout(&self) -> Duration {
        self.config.call_timeout
    }

    /// The connection (a clone shares it).
    pub fn connection(&self) -> &C {
        &self.conn
    }

    /// Awaits one request, bounded by the call timeout.
    async fn bounded<T>(&self, fut: impl Future<Output = RedisResult<T>>) -> Result<T, StoreError> {
        bounded(self.config.call_timeout, fut).await
    }

    /// Whether the record of `id` is `in_progress` with a live lease (by Redis's clock).
    async fn live(&self, id: &RecordId) -> Result<bool, StoreError> {
        let key = self.key(id);
        let mut conn = self.conn.clone();
        let live: i64 = self
            .bounded(SCRIPTS.live.key(&key).invoke_async(&mut conn))
            .await?;
        Ok(live == 1)
    }
}

/// The reply of a token-checking script: `Ok` when the token held the record.
fn held(reply: i64) -> Result<(), StoreError> {
    match reply {
        1 => Ok(()),
        _ => Err(StoreError::StaleToken),
    }
}

impl<C> IdempotencyStore for RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    async fn claim(&self, id: &RecordId, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        let key = self.key(id);
        let template = Record::InProgress(InProgress::new(
            0,
            claim.token,
            claim.fingerprint,
            claim.commit_point,
        ))
        .encode();
        let unknown = unknown(claim.fingerprint).encode();
        let mut conn = self.conn.clone();
        let (status, record): (i64, Vec<u8>) = self
            .bounded(
                SCRIPTS
                    .claim
                    .key(&key)
                    .arg(&template[..])
                    .arg(millis(claim.lease))
                    .arg(retention_millis(claim.retention))
                    .arg(&unknown[..])
                    .invoke_async(&mut conn),
            )
            .await?;
        match status {
            CLAIMED => Ok(ClaimOutcome::Claimed { takeover: false }),
            TAKEN_OVER => Ok(ClaimOutcome::Claimed { takeover: true }),
            EXISTING | BECAME_UNKNOWN => {
                let record = decode(record)?;
                if status == EXISTING && claim.holds(&record) {
                    // The same claim sent again (its reply was lost): the caller holds it.
                    return Ok(ClaimOutcome::Claimed { takeover: false });
                }
                Ok(ClaimOutcome::Existing {
                    record,
                    became_unknown: status == BECAME_UNKNOWN,
                })
            }
            other => Err(StoreError::unavailable(format!(
                "unexpected claim script status {other}"
            ))),
        }
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: Token,
        record: &Completed,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let key = self.key(id);
        let blob = Record::Completed(record.clone()).encode();
        let mut conn = self.conn.clone();
        let reply = self
            .bounded(
                SCRIPTS
                    .complete
                    .key(&key)
                    .arg(&token.to_bytes()[..])
                    .arg(&blob[..])
                    .arg(retention_millis(retention))
                    .invoke_async(&mut conn),
            )
            .await?;
        held(reply)
    }

    async fn release(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        let key = self.key(id);
        let mut conn = self.conn.clone();
        let reply = self
            .bounded(
                SCRIPTS
                    .release
                    .key(&key)
                    .key(last_key(&key))
                    .arg(&token.to_bytes()[..])
                    .arg(millis(RESEND_WINDOW))
                    .invoke_async(&mut conn),
            )
            .await?;
        held(reply)
    }

    async fn renew(&self, id: &RecordId, token: Token, lease: Duration) -> Result<(), StoreError> {
        let key = self.key(id);
        let mut conn = self.conn.clone();
        let reply = self
            .bounded(
                SCRIPTS
                    .renew
                    .key(&key)
                    .arg(&token.to_bytes()[..])
                    .arg(millis(lease))
                    .invoke_async(&mut conn),
            )
            .await?;
        held(reply)
    }

    async fn commit_point(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        let key = self.key(id);
        let mut conn = self.conn.clone();
        let reply = self
            .bounded(
                SCRIPTS
                    .commit_point
                    .key(&key)
                    .arg(&token.to_bytes()[..])
                    .invoke_async(&mut conn),
            )
            .await?;
        held(reply)
    }

    async fn mark_unknown(
        &self,
        id: &RecordId,
        token: Token,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let key = self.key(id);
        let mut conn = self.conn.clone();
        let reply = self
            .bounded(
                SCRIPTS
                    .mark_unknown
                    .key(&key)
                    .key(last_key(&key))
                    .arg(&token.to_bytes()[..])
                    .arg(retention_millis(retention))
                    .arg(millis(RESEND_WINDOW))
                    .invoke_async(&mut conn),
            )
            .await?;
        held(reply)
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let key = self.key(id);
        let mut conn = self.conn.clone();
        let bytes: Option<Vec<u8>> = self
            .bounded(redis::cmd("GET").arg(&key).query_async(&mut conn))
            .await?;
        bytes.map(decode).transpose()
    }

    /// Polls with backoff (5 ms doubling to 100 ms, each pause jittered between half
    /// and all of it) until the record is no longer `in_progress` with a live lease (by
    /// Redis's clock), or `max` passed. Each poll is one script call.
    async fn wait(&self, id: &RecordId, max: Duration) -> Result<(), StoreError> {
        let until = Instant::now() + max.min(MAX_TIMEOUT);
        let mut delay = POLL_MIN;
        loop {
            if !self.live(id).await? {
                return Ok(());
            }
            let now = Instant::now();
            if now >= until {
                return Ok(());
            }
            tokio::time::sleep_until(until.min(now + jitter(delay))).await;
            delay = (delay * 2).min(POLL_MAX);
        }
    }
}

/// The settings of a [`RedisStore`]: made by [`RedisStore::options`] (or `new`, or
/// `default`) with the defaults, changed by setters that never fail, and validated once
/// by [`build`](Self::build), which makes the store over a connection.
///
/// A value of its own rather than setters on the store: the store's
/// [`key_prefix`](RedisStore::key_prefix) and [`call_timeout`](RedisStore::call_timeout)
/// read its settings back, and the settings exist before the connection they are built
/// over (one set of options can make stores over several connections).
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use retrysafe_redis::{CheckError, RedisStoreOptions};
///
/// let client = redis::Client::open("redis://127.0.0.1:6379")?;
/// let conn = redis::aio::ConnectionManager::new(client).await?;
/// // The settings are validated before the server is asked anything.
/// let refused = RedisStoreOptions::new()
///     .key_prefix("{tenant}:")
///     .call_timeout(Duration::ZERO)
///     .build(conn)
///     .await;
/// let Err(CheckError::Options(refused)) = refused else { unreachable!() };
/// assert_eq!(refused.fields().collect::<Vec<_>>(), ["key_prefix", "call_timeout"]);
/// # Ok(()) }
/// ```
#[must_use]
#[derive(Debug, Clone)]
pub struct RedisStoreOptions {
    prefix: String,
    call_timeout: Duration,
    check_config: bool,
}

impl Default for RedisStoreOptions {
    fn default() -> Self {
        RedisStoreOptions {
            prefix: DEFAULT_KEY_PREFIX.to_owned(),
            call_timeout: DEFAULT_CALL_TIMEOUT,
            check_config: true,
        }
    }
}

impl RedisStoreOptions {
    /// The defaults: key prefix `retrysafe:`, 1 s call timeout.
    pub fn new() -> Self {
        RedisStoreOptions::default()
    }

    /// The prefix of every key (default `retrysafe:`), to share a Redis database with
    /// other data or other stores. It must not contain `{` or `}`: the record id is the
    /// key's hash tag.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The bound on every store call (default 1 s): a call still running then is
    /// abandoned with [`StoreError::Timeout`]. The `IdempotencyLayer` also bounds its
    /// calls by the request's deadline; this covers direct users. Must be greater than
    /// zero and at most 30 days.
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// Makes the store without checking the server's configuration, for managed
    /// services that refuse the `CONFIG` command. The server's `maxmemory-policy` must
    /// still be `noeviction`: that is then the user's responsibility (any other policy
    /// can evict an in-flight claim, and a copy of its request would run again).
    pub fn skip_config_check(mut self) -> Self {
        self.check_config = false;
        self
    }

    /// Validates the settings and makes a store over `conn` with them, then checks the
    /// server's configuration (one round trip) unless
    /// [`skip_config_check`](Self::skip_config_check) was set.
    ///
    /// - Refused settings (a prefix with braces, a zero or huge call timeout) are
    ///   [`CheckError::Options`], naming every one; the server is not asked.
    /// - A `maxmemory-policy` other than `noeviction` is
    ///   [`CheckError::UnsafeEvictionPolicy`]; one that cannot be read (`CONFIG`
    ///   refused) is [`CheckError::EvictionPolicyUnreadable`]. See
    ///   [`RedisStore::check_config`].
    /// - A server that cannot be reached is [`CheckError::Store`].
    ///
    /// Async, like redis-rs's own connection constructors: the store is checked where
    /// it is made, so that no store runs on a server that may evict its claims.
    pub async fn build<C>(self, conn: C) -> Result<RedisStore<C>, CheckError>
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        let check = self.check_config;
        let store = self.validate(conn)?;
        if check {
            store.check_on_start().await?;
        }
        Ok(store)
    }

    /// Validates the settings: names every refused one.
    fn validate<C>(self, conn: C) -> Result<RedisStore<C>, ConfigError> {
        let mut v = Validate::new();
        v.check(
            !self.prefix.contains(['{', '}']),
            "key_prefix",
            "must not contain `{` or `}` (the record id is the hash tag)",
        );
        v.check(
            !self.call_timeout.is_zero(),
            "call_timeout",
            "must be greater than zero",
        );
        v.check(
            self.call_timeout <= MAX_TIMEOUT,
            "call_timeout",
            "must be at most 30 days",
        );
        v.finish(RedisStore {
            conn,
            config: Arc::new(Config {
                prefix: self.prefix,
                call_timeout: self.call_timeout,
            }),
        })
    }
}

/// Awaits `fut` for at most `timeout`, mapping redis errors.
pub(crate) async fn bounded<T>(
    timeout: Duration,
    fut: impl Future<Output = RedisResult<T>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(store_error(e)),
        Err(_elapsed) => Err(StoreError::Timeout),
    }
}

/// A redis error as a store error: an I/O timeout is a timeout, anything else means the
/// store is unavailable.
pub(crate) fn store_error(e: RedisError) -> StoreError {
    if e.is_timeout() {
        StoreError::Timeout
    } else {
        StoreError::unavailable(e)
    }
}

/// The key that holds the token of the last release or `mark_unknown` of the record at
/// `key`, for [`RESEND_WINDOW`]: `key` with `:last` appended (the same hash tag).
fn last_key(key: &str) -> String {
    format!("{key}:last")
}

fn decode(bytes: Vec<u8>) -> Result<Record, StoreError> {
    Record::decode(Bytes::from(bytes)).map_err(StoreError::Corrupt)
}

fn unknown(fingerprint: Fingerprint) -> Record {
    Record::OutcomeUnknown(OutcomeUnknown::new(fingerprint))
}

/// Whole milliseconds of `d`, clamped to a century.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.min(MAX_SPAN).as_millis()).unwrap_or(u64::MAX)
}

/// Milliseconds of a key's time to live: at least 1 (`PX 0` is an error).
fn retention_millis(d: Duration) -> u64 {
    millis(d).max(1)
}

/// A pause between half and all of `d`.
fn jitter(d: Duration) -> Duration {
    d.mul_f64(rand::rng().random_range(0.5..=1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn millis_clamp() {
        assert_eq!(millis(Duration::from_micros(1500)), 1);
        assert_eq!(retention_millis(Duration::ZERO), 1);
        assert_eq!(millis(Duration::MAX), millis(MAX_SPAN));
        assert!(millis(MAX_SPAN) < 1 << 53, "exact in a Lua number");
    }

    #[test]
    fn jitter_stays_in_range() {
        for _ in 0..100 {
            let j = jitter(Duration::from_millis(100));
            assert!(j >= Duration::from_millis(50) && j <= Duration::from_millis(100));
        }
    }
}
