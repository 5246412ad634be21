//! [`RedisStore`]: the store, its options and its [`IdempotencyStore`] implementation.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::time::Duration;

use bytes::Bytes;
use rand::Rng;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{
    ErrorKind, FromRedisValue, IntoConnectionInfo, RedisError, RedisResult, ScriptInvocation,
    ServerErrorKind,
};
use retrysafe_core::__private::{Reconcilers, Validate};
use retrysafe_core::ConfigError;
use retrysafe_core::idempotency::{
    Completed, Fingerprint, InProgress, OutcomeUnknown, Record, RecordId, Resolving, Token,
    UnknownReason,
};
use retrysafe_core::observe::Name;
use retrysafe_core::store::{
    Claim, ClaimOutcome, IdempotencyStore, MAX_NOTE, RESEND_WINDOW, StoreError,
};
use retrysafe_core::wire::MAX_TIMEOUT;
use tokio::time::Instant;

use crate::RedisStoreError;
use crate::scripts::{BECAME_UNKNOWN, CLAIMED, EXISTING, RESOLVING, SCRIPTS, TAKEN_OVER};
use crate::slots::{SLOTS, slot_of_tag, tag_of_slot};

/// The default key prefix.
const DEFAULT_KEY_PREFIX: &str = "retrysafe:";

/// The default bound on every store call.
pub(crate) const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// Durations longer than this (a century) are clamped before they become milliseconds.
const MAX_SPAN: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// The first and the longest pause between two polls of [`IdempotencyStore::wait`].
const POLL_MIN: Duration = Duration::from_millis(5);
const POLL_MAX: Duration = Duration::from_millis(100);

/// The response timeout of the cluster client of [`RedisStoreOptions::connect_cluster`]:
/// longer than any call the store makes (a waited write takes at most the call
/// timeout), so that only a node that stopped answering meets it.
#[cfg(feature = "cluster")]
const CLUSTER_RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

/// How often [`RedisStore::connect`] retries a connection (also when reconnecting).
const CONNECT_RETRIES: usize = 2;

/// The longest pause between two connection attempts of [`RedisStore::connect`].
const CONNECT_MAX_DELAY: Duration = Duration::from_secs(1);

/// An [`IdempotencyStore`] on Redis: one key per record, each transition one Lua script.
///
/// - **Keys.** A record lives under `{prefix}{<record id in hex>}` (default prefix
///   `retrysafe:`); the braces are a Redis Cluster hash tag, so every key maps to the
///   slot of its own record id. See [`key`](Self::key). A release, `mark_unknown` or
///   reconciler settlement also writes its token, for a minute ([`RESEND_WINDOW`]),
///   under that key with `:last` appended, so that the same call sent again after a
///   lost reply succeeds.
/// - **Values.** The record's [`Record::encode`] blob: a record's size in Redis is its
///   encoded length, and app servers of two releases read each other's records. The
///   scripts accept records at least as long as this release writes (a later release
///   may append fields).
/// - **Companion hash.** Under the record's key with `:meta` appended (the same hash
///   tag), expiring with the record: `at` (claim time), `req` (the encoded
///   [`RequestInfo`](retrysafe_core::idempotency::RequestInfo) of the claim), `note`
///   (the [`commit_point_with`](IdempotencyStore::commit_point_with) note, at most
///   [`MAX_NOTE`] bytes), `reason` (the [`UnknownReason`] code), `notified` (`0`/`1`),
///   `atok` and `auntil` (a reconciler's adoption: token, end), `next` (when an unknown
///   record is due again). Times are milliseconds of Redis `TIME`.
/// - **In-flight index.** A sorted set, `{prefix}inflight` (on a Redis Cluster one
///   per hash slot, `{prefix}inflight:{<tag>}`, in the slot of the records it lists),
///   of the ids (hex) of pending records, scored by when each becomes due for a reconciler: a claim at its
///   lease end, an unknown record at once (or, after a reconciler's pass, at its next
///   pass); completed and released records leave it, and entries of records that
///   expired are dropped when a scan finds them. The scripts that change a record keep
///   it, so the request path gains no round trip.
/// - **Transitions.** `claim`, `complete`, `release`, `renew`, `commit_point` and
///   `mark_unknown` are Lua scripts (`EVALSHA`, loaded on first use) that check the token
///   and, for a claim, return the existing record: one round trip per call. `get` is
///   one script too (it reports an adopted record as [`Record::Resolving`]).
/// - **Recovery.** As a [`ReconcilableStore`](retrysafe_core::recovery::ReconcilableStore):
///   `due` scans the index, `adopt` records an adoption in the companion hash without
///   touching the record (so a lapsed adoption leaves it as it was), `settle` completes,
///   deletes or defers the record; one script each. While an adoption is live, a claim
///   answers [`Record::Resolving`] and every token call of the record's holder is
///   refused as stale.
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
/// use retrysafe::wire::IdempotencyKey;
/// use retrysafe::redis::RedisStore;
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
    replication: Option<Replication>,
}

/// The setting of [`RedisStoreOptions::replicated_writes`].
#[derive(Debug, Clone, Copy)]
struct Replication {
    replicas: u32,
    timeout: Duration,
}

impl Replication {
    /// The `WAIT` timeout in ms: at least 1 (0 would block for ever), at most the call
    /// timeout.
    fn wait_millis(self, call_timeout: Duration) -> u64 {
        millis(self.timeout.min(call_timeout)).max(1)
    }
}

#[derive(Debug)]
struct Config {
    name: Name,
    prefix: String,
    call_timeout: Duration,
    /// The reconcilers running for this store (shared by its clones).
    reconcilers: Reconcilers,
    /// Set on a Redis Cluster: the in-flight index is one key per hash slot.
    per_slot: AtomicBool,
    /// The slot where the next walk of a reconciler over the slots starts.
    cursor: AtomicU16,
    /// The token of this store's scan leases on a cluster.
    owner: Token,
    /// The store's connection when it is a [`ConnectionManager`], which reconnects only
    /// when its connection breaks: on `READONLY` the store closes it (see
    /// [`RedisStore::read_only`]).
    manager: Option<ConnectionManager>,
    /// Set by a `READONLY` reply (logged once), cleared by the next write that succeeds.
    read_only: AtomicBool,
    /// Set while the store makes its [`ConnectionManager`] reconnect.
    reconnecting: AtomicBool,
}

impl<C: Clone> Clone for RedisStore<C> {
    fn clone(&self) -> Self {
        RedisStore {
            conn: self.conn.clone(),
            config: Arc::clone(&self.config),
            replication: self.replication,
        }
    }
}

impl<C> RedisStore<C> {
    fn per_slot_flag(&self) -> bool {
        self.config.per_slot.load(Ordering::Relaxed)
    }
}

impl<C> fmt::Debug for RedisStore<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("connection", &std::any::type_name::<C>())
            .field("key_prefix", &self.config.prefix)
            .field("call_timeout", &self.config.call_timeout)
            .field("per_slot_index", &self.per_slot_flag())
            .field("replicas", &self.replication.map_or(0, |r| r.replicas))
            .finish()
    }
}

impl RedisStore {
    /// Connects to the Redis server at `url` (for example `redis://127.0.0.1:6379`) and
    /// returns a store with the default settings: [`options`](Self::options)`()`
    /// `.connect(url)`.
    pub async fn connect(url: impl IntoConnectionInfo) -> Result<Self, RedisStoreError> {
        RedisStoreOptions::new().connect(url).await
    }

    /// The settings of a store (name, key prefix, call timeout, replicated writes)
    /// with their defaults, to be changed and then used to
    /// [connect](RedisStoreOptions::connect) to a server (or a
    /// [cluster](RedisStoreOptions::connect_cluster), or the primary
    /// [a Sentinel names](RedisStoreOptions::connect_sentinel)), or to
    /// [build](RedisStoreOptions::build) a store over a connection of yours.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use retrysafe::redis::RedisStore;
    ///
    /// let store = RedisStore::options()
    ///     .key_prefix("billing:idem:")
    ///     .call_timeout(Duration::from_millis(300))
    ///     .connect("redis://127.0.0.1:6379") // also checks the server's maxmemory-policy
    ///     .await?;
    /// assert_eq!(store.key_prefix(), "billing:idem:");
    /// # Ok(()) }
    /// ```
    pub fn options() -> RedisStoreOptions {
        RedisStoreOptions::new()
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
    /// use retrysafe::idempotency::RecordId;
    /// use retrysafe::redis::RedisStore;
    ///
    /// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
    /// let id = RecordId::from_bytes([0xab; 32]);
    /// assert_eq!(store.key(&id), format!("retrysafe:{{{}}}", "ab".repeat(32)));
    /// # Ok(()) }
    /// ```
    pub fn key(&self, id: &RecordId) -> String {
        format!("{}{{{}}}", self.config.prefix, id.to_hex())
    }

    /// The key of the in-flight index that lists `id` while it is pending (a claim,
    /// or an unknown outcome): a sorted set of record ids (hex) scored by when each
    /// becomes due for a reconciler.
    ///
    /// On one server, one index per key prefix, `{prefix}inflight`. On a Redis Cluster
    /// every script must touch keys of one slot, so there the index is one key per hash
    /// slot, `{prefix}inflight:{<tag>}`, where the tag is a short number that hashes to
    /// the slot of the record's own hash tag: record key names are the same in both
    /// forms. (A record key always has a `{` right after the prefix, so the names
    /// cannot meet.)
    pub(crate) fn index_key(&self, id: &RecordId) -> String {
        if self.config.per_slot.load(Ordering::Relaxed) {
            slot_index_key(&self.config.prefix, slot_of_tag(&id.to_hex()))
        } else {
            single_index_key(&self.config.prefix)
        }
    }

    /// Every index key (see [`index_key`](Self::index_key)). Per slot, the walk starts
    /// at slot `from`, and the per-prefix key comes first: a store that found out it
    /// runs on a cluster only when the cluster refused a script (`CROSSSLOT`) may have
    /// listed records of that key's slot there before.
    /// Each with its slot (`None` for the per-prefix key).
    pub(crate) fn index_keys(&self, from: u16) -> Vec<(Option<u16>, String)> {
        let single = (None, single_index_key(&self.config.prefix));
        if !self.config.per_slot.load(Ordering::Relaxed) {
            return vec![single];
        }
        let slots = (0..SLOTS).map(|i| (from % SLOTS + i) % SLOTS);
        std::iter::once(single)
            .chain(slots.map(|slot| (Some(slot), slot_index_key(&self.config.prefix, slot))))
            .collect()
    }

    /// The key of the scan lease of the slots `group * SLOTS_PER_LEASE ..` on a
    /// cluster: `{prefix}scan:{<tag>}`, in the first slot of the group.
    pub(crate) fn scan_lease_key(&self, group: u16) -> String {
        let slot = group.saturating_mul(SLOTS_PER_LEASE) % SLOTS;
        format!("{}scan:{{{}}}", self.config.prefix, tag_of_slot(slot))
    }

    /// The token this store (and its clones) holds scan leases with.
    pub(crate) fn owner(&self) -> Token {
        self.config.owner
    }

    /// Keeps the in-flight index as one key per hash slot from now on.
    pub(crate) fn index_per_slot(&self) {
        if !self.config.per_slot.swap(true, Ordering::Relaxed) {
            tracing::debug!(
                target: "retrysafe::redis",
                name = self.config.name.as_str(),
                "Redis Cluster: the in-flight index is kept as one key per hash slot"
            );
        }
    }

    /// Whether the in-flight index is kept as one key per hash slot (on a Redis
    /// Cluster).
    pub(crate) fn per_slot(&self) -> bool {
        self.config.per_slot.load(Ordering::Relaxed)
    }

    /// Where the next walk over the slots starts, and where the one after it will.
    pub(crate) fn cursor(&self) -> &AtomicU16 {
        &self.config.cursor
    }

    /// Runs the script `build` makes, with the index key of `id` appended as its last
    /// key; with [`replicated_writes`](Self::replicated_writes) and `wait`, pipelined
    /// with `WAIT`. Also returns whether enough replicas acknowledged the write (always
    /// `true` without the setting). When a Redis Cluster refuses it because the index
    /// lives in another slot (`CROSSSLOT`, refused before the script runs: a store
    /// made without the configuration check does not know it runs on a cluster), the
    /// store switches to one index key per slot and runs it again.
    pub(crate) async fn indexed<T: FromRedisValue>(
        &self,
        id: &RecordId,
        wait: bool,
        build: impl Fn() -> ScriptInvocation<'static> + Sync,
    ) -> Result<(T, bool), StoreError> {
        let mut script = build();
        script.key(self.index_key(id));
        let timeout = self.config.call_timeout;
        match tokio::time::timeout(timeout, self.run(&script, wait)).await {
            Ok(Err(e)) if e.code() == Some("CROSSSLOT") && !self.per_slot() => {
                self.index_per_slot();
            }
            Ok(reply) => return self.written(reply),
            Err(_elapsed) => return Err(StoreError::Timeout),
        }
        let mut script = build();
        script.key(self.index_key(id));
        match tokio::time::timeout(timeout, self.run(&script, wait)).await {
            Ok(reply) => self.written(reply),
            Err(_elapsed) => Err(StoreError::Timeout),
        }
    }

    /// The reply of a write: a success ends a spell of `READONLY` replies.
    fn written<T>(&self, reply: RedisResult<T>) -> Result<T, StoreError> {
        let value = reply.map_err(|e| self.failed(e))?;
        if self.config.read_only.load(Ordering::Relaxed)
            && self.config.read_only.swap(false, Ordering::Relaxed)
        {
            tracing::info!(
                target: "retrysafe::redis",
                name = self.config.name.as_str(),
                "the Redis node takes writes again"
            );
        }
        Ok(value)
    }

    /// Runs `script`, pipelined with `WAIT replicas timeout` when `wait` and replicated
    /// writes are on: one round trip, on the connection of the primary that owns the
    /// script's keys (a cluster connection routes a pipeline by its keyed command; the
    /// keyless `WAIT` goes with it, not to every primary). The flag says whether enough
    /// replicas acknowledged.
    pub(crate) async fn run<T: FromRedisValue>(
        &self,
        script: &ScriptInvocation<'_>,
        wait: bool,
    ) -> RedisResult<(T, bool)> {
        let mut conn = self.conn.clone();
        let Some(r) = self.replication.filter(|r| wait && r.replicas > 0) else {
            return Ok((script.invoke_async(&mut conn).await?, true));
        };
        let mut pipe = redis::pipe();
        pipe.invoke_script(script)
            .cmd("WAIT")
            .arg(r.replicas)
            .arg(r.wait_millis(self.config.call_timeout));
        let (reply, acked): (T, u64) = match pipe.query_async(&mut conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                script.load_async(&mut conn).await?;
                pipe.query_async(&mut conn).await?
            }
            other => other?,
        };
        Ok((reply, acked >= u64::from(r.replicas)))
    }

    /// The store's name ([`RedisStoreOptions::name`]; `default` unless set).
    pub fn name(&self) -> &Name {
        &self.config.name
    }

    /// How many replicas must acknowledge a claim, commit point or completion (see
    /// [`RedisStoreOptions::replicated_writes`]); 0 when the setting is off.
    #[doc(hidden)]
    pub fn replicas(&self) -> u32 {
        self.replication.map_or(0, |r| r.replicas)
    }

    /// The key prefix.
    #[doc(hidden)]
    pub fn key_prefix(&self) -> &str {
        &self.config.prefix
    }

    /// The bound on every store call.
    #[doc(hidden)]
    pub fn call_timeout(&self) -> Duration {
        self.config.call_timeout
    }

    /// The connection (a clone shares it).
    pub fn connection(&self) -> &C {
        &self.conn
    }

    /// The count of reconcilers running for this store (shared by its clones).
    pub(crate) fn reconcilers(&self) -> &Reconcilers {
        &self.config.reconcilers
    }

    /// Awaits one request, bounded by the call timeout.
    pub(crate) async fn bounded<T>(
        &self,
        fut: impl Future<Output = RedisResult<T>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.config.call_timeout, fut).await {
            Ok(reply) => reply.map_err(|e| self.failed(e)),
            Err(_elapsed) => Err(StoreError::Timeout),
        }
    }

    /// A redis error as a store error (see [`store_error`]); a `READONLY` reply is
    /// [`read_only`](Self::read_only).
    pub(crate) fn failed(&self, e: RedisError) -> StoreError {
        if e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly) {
            return self.read_only(&e);
        }
        store_error(e)
    }

    /// A `READONLY` reply: the node the store writes to was made a replica (a failover
    /// behind a fixed name, a proxy or a managed service's endpoint). The call is
    /// refused as unavailable (the layer answers 503 `store-unavailable`), the first
    /// such reply of a spell is logged, and the connection is made to connect again, so
    /// that it finds whatever node the name leads to now: a [`ConnectionManager`]
    /// reconnects only when its connection breaks, so the store asks the server to
    /// close it (`QUIT`) and sends one `PING` that fails and starts the reconnection. A
    /// [`SentinelConnection`](crate::SentinelConnection) finds the new primary by
    /// itself; other connections are left as they are.
    fn read_only(&self, e: &RedisError) -> StoreError {
        let config = &self.config;
        if !config.read_only.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                target: "retrysafe::redis",
                name = config.name.as_str(),
                error = %e,
                "the Redis node answered READONLY: a failover made it a replica; \
                 reconnecting, and refusing calls until a primary takes the writes"
            );
        }
        if let Some(manager) = &config.manager
            && !config.reconnecting.swap(true, Ordering::AcqRel)
        {
            let mut manager = manager.clone();
            let config = Arc::clone(&self.config);
            tokio::spawn(async move {
                let bound = config.call_timeout;
                for command in ["QUIT", "PING"] {
                    let command = redis::cmd(command);
                    let _ =
                        tokio::time::timeout(bound, command.query_async::<()>(&mut manager)).await;
                }
                config.reconnecting.store(false, Ordering::Release);
            });
        }
        StoreError::unavailable(format!(
            "the Redis node is a read-only replica now (a failover demoted it): {e}"
        ))
    }

    /// Whether the record of `id` is `in_progress` with a live lease (by Redis's clock).
    async fn live(&self, id: &RecordId) -> Result<bool, StoreError> {
        let key = self.key(id);
        let mut conn = self.conn.clone();
        let live: i64 = self
            .bounded(
                SCRIPTS
                    .live
                    .key(&key)
                    .key(meta_key(&key))
                    .invoke_async(&mut conn),
            )
            .await?;
        Ok(live == 1)
    }
}

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The commit point (with its note, if any): one script, waited for with
    /// [`replicated_writes`](Self::replicated_writes).
    async fn commit(
        &self,
        id: &RecordId,
        token: Token,
        note: Option<&[u8]>,
    ) -> Result<(), StoreError> {
        let key = self.key(id);
        let mut script = SCRIPTS.commit_point.key(&key);
        script.key(meta_key(&key)).arg(&token.to_bytes()[..]);
        if let Some(note) = note {
            script.arg(note);
        }
        let (reply, acked) =
            match tokio::time::timeout(self.config.call_timeout, self.run(&script, true)).await {
                Ok(reply) => self.written(reply)?,
                Err(_elapsed) => return Err(StoreError::Timeout),
            };
        held(reply)?;
        if !acked {
            return Err(self.unreplicated(id, token, "commit point").await);
        }
        Ok(())
    }

    /// A claim or commit point that replicas did not acknowledge in time: released
    /// (best effort; the handler has not acted on it), and refused.
    async fn unreplicated(&self, id: &RecordId, token: Token, what: &str) -> StoreError {
        if let Err(e) = self.release(id, token).await {
            tracing::warn!(
                target: "retrysafe::redis",
                name = self.config.name.as_str(),
                error = %e,
                "could not release a {what} that replicas did not acknowledge"
            );
        }
        StoreError::unavailable(format!(
            "the {what} was not acknowledged by {} replica(s) in time",
            self.replicas()
        ))
    }
}

/// The reply of a token-checking script: `Ok` when the token held the record.
pub(crate) fn held(reply: i64) -> Result<(), StoreError> {
    match reply {
        1 => Ok(()),
        _ => Err(StoreError::StaleToken),
    }
}

impl<C> IdempotencyStore for RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    async fn claim(&self, id: &RecordId, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        let key = self.key(id);
        let template = Record::InProgress(InProgress::new(
            0,
            claim.token,
            claim.fingerprint,
            claim.commit_point,
        ))
        .encode();
        let unknown = unknown(claim.fingerprint).encode();
        let request = claim.request.map(|r| r.encode()).unwrap_or_default();
        let ((status, record, until_ms), acked): ((i64, Vec<u8>, u64), bool) = self
            .indexed(id, true, || {
                let mut script = SCRIPTS.claim.key(&key);
                script
                    .key(meta_key(&key))
                    .arg(&template[..])
                    .arg(millis(claim.lease))
                    .arg(retention_millis(claim.retention))
                    .arg(&unknown[..])
                    .arg(&request[..])
                    .arg(id.to_hex());
                script
            })
            .await?;
        let outcome = match status {
            CLAIMED => ClaimOutcome::Claimed { takeover: false },
            TAKEN_OVER => ClaimOutcome::Claimed { takeover: true },
            RESOLVING => ClaimOutcome::Existing {
                record: resolving(record, until_ms)?,
                became_unknown: false,
            },
            EXISTING | BECAME_UNKNOWN => {
                let record = decode(record)?;
                if status == EXISTING && claim.holds(&record) {
                    // The same claim sent again (its reply was lost): the caller holds it.
                    ClaimOutcome::Claimed { takeover: false }
                } else {
                    ClaimOutcome::Existing {
                        record,
                        became_unknown: status == BECAME_UNKNOWN,
                    }
                }
            }
            other => {
                return Err(StoreError::unavailable(format!(
                    "unexpected claim script status {other}"
                )));
            }
        };
        if !acked && matches!(outcome, ClaimOutcome::Claimed { .. }) {
            return Err(self.unreplicated(id, claim.token, "claim").await);
        }
        Ok(outcome)
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
        let (reply, acked) = self
            .indexed(id, true, || {
                let mut script = SCRIPTS.complete.key(&key);
                script
                    .key(meta_key(&key))
                    .arg(&token.to_bytes()[..])
                    .arg(&blob[..])
                    .arg(retention_millis(retention))
                    .arg(id.to_hex());
                script
            })
            .await?;
        held(reply)?;
        if !acked {
            return Err(StoreError::unavailable(format!(
                "the completion was not acknowledged by {} replica(s) in time; it may be \
                 lost on a failover",
                self.replicas()
            )));
        }
        Ok(())
    }

    async fn release(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        let key = self.key(id);
        let (reply, _) = self
            .indexed(id, false, || {
                let mut script = SCRIPTS.release.key(&key);
                script
                    .key(last_key(&key))
                    .key(meta_key(&key))
                    .arg(&token.to_bytes()[..])
                    .arg(millis(RESEND_WINDOW))
                    .arg(id.to_hex());
                script
            })
            .await?;
        held(reply)
    }

    async fn renew(&self, id: &RecordId, token: Token, lease: Duration) -> Result<(), StoreError> {
        let key = self.key(id);
        let (reply, _) = self
            .indexed(id, false, || {
                let mut script = SCRIPTS.renew.key(&key);
                script
                    .key(meta_key(&key))
                    .arg(&token.to_bytes()[..])
                    .arg(millis(lease))
                    .arg(id.to_hex());
                script
            })
            .await?;
        held(reply)
    }

    async fn commit_point(&self, id: &RecordId, token: Token) -> Result<(), StoreError> {
        self.commit(id, token, None).await
    }

    /// Also keeps the note (cut to [`MAX_NOTE`] bytes) in the record's meta hash, in
    /// the same script.
    async fn commit_point_with(
        &self,
        id: &RecordId,
        token: Token,
        note: &[u8],
    ) -> Result<(), StoreError> {
        let note = note.get(..MAX_NOTE).unwrap_or(note);
        self.commit(id, token, Some(note)).await
    }

    async fn mark_unknown(
        &self,
        id: &RecordId,
        token: Token,
        retention: Duration,
        reason: UnknownReason,
    ) -> Result<(), StoreError> {
        let key = self.key(id);
        let (reply, _) = self
            .indexed(id, false, || {
                let mut script = SCRIPTS.mark_unknown.key(&key);
                script
                    .key(last_key(&key))
                    .key(meta_key(&key))
                    .arg(&token.to_bytes()[..])
                    .arg(retention_millis(retention))
                    .arg(millis(RESEND_WINDOW))
                    .arg(reason.to_code())
                    .arg(id.to_hex());
                script
            })
            .await?;
        held(reply)
    }

    async fn mark_notified(&self, id: &RecordId) -> Result<(), StoreError> {
        let key = self.key(id);
        let mut conn = self.conn.clone();
        let _: i64 = self
            .bounded(
                SCRIPTS
                    .mark_notified
                    .key(&key)
                    .key(meta_key(&key))
                    .invoke_async(&mut conn),
            )
            .await?;
        Ok(())
    }

    fn reconciled(&self) -> bool {
        self.config.reconcilers.any()
    }

    /// One script: the record, as [`Record::Resolving`] while a reconciler has adopted
    /// it.
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let key = self.key(id);
        let mut conn = self.conn.clone();
        let (exists, bytes, until_ms): (i64, Vec<u8>, u64) = self
            .bounded(
                SCRIPTS
                    .read
                    .key(&key)
                    .key(meta_key(&key))
                    .invoke_async(&mut conn),
            )
            .await?;
        match (exists, until_ms) {
            (0, _) => Ok(None),
            (_, 0) => decode(bytes).map(Some),
            (_, until_ms) => resolving(bytes, until_ms).map(Some),
        }
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
/// use retrysafe::redis::{RedisStoreError, RedisStoreOptions};
///
/// let client = redis::Client::open("redis://127.0.0.1:6379")?;
/// let conn = redis::aio::ConnectionManager::new(client).await?;
/// // The settings are validated before the server is asked anything.
/// let refused = RedisStoreOptions::new()
///     .key_prefix("{tenant}:")
///     .call_timeout(Duration::ZERO)
///     .build(conn)
///     .await;
/// let Err(RedisStoreError::Config(refused)) = refused else { unreachable!() };
/// assert_eq!(refused.fields().collect::<Vec<_>>(), ["key_prefix", "call_timeout"]);
/// # Ok(()) }
/// ```
#[must_use]
#[derive(Debug, Clone)]
pub struct RedisStoreOptions {
    prefix: String,
    call_timeout: Duration,
    check_config: bool,
    per_slot_index: bool,
    replication: Option<Replication>,
    name: Name,
}

impl Default for RedisStoreOptions {
    fn default() -> Self {
        RedisStoreOptions {
            prefix: DEFAULT_KEY_PREFIX.to_owned(),
            call_timeout: DEFAULT_CALL_TIMEOUT,
            check_config: true,
            per_slot_index: false,
            replication: None,
            name: Name::default(),
        }
    }
}

impl RedisStoreOptions {
    /// The defaults: key prefix `retrysafe:`, 1 s call timeout.
    pub fn new() -> Self {
        RedisStoreOptions::default()
    }

    /// The store's name (default `default`), carried by its tracing events; see
    /// [`retrysafe_core::observe`].
    pub fn name(mut self, name: impl Into<Name>) -> Self {
        self.name = name.into();
        self
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
    /// services that refuse the `CONFIG` command (the node's role is still checked). The server's `maxmemory-policy` must
    /// still be `noeviction`: that is then the user's responsibility (any other policy
    /// can evict an in-flight claim, and a copy of its request would run again).
    pub fn skip_config_check(mut self) -> Self {
        self.check_config = false;
        self
    }

    /// Keeps the reconcilers' in-flight index as one key per hash slot, as a Redis
    /// Cluster needs (every script touches keys of one slot). Making a store finds
    /// out by itself when its server is a cluster node (`cluster-enabled`, read by the
    /// configuration check) and [`RedisStoreOptions::connect_cluster`] sets it; set it when
    /// you [skip the check](Self::skip_config_check) on a cluster, so that the
    /// reconcilers of every app server look for pending records in the same keys.
    /// Record key names are the same either way.
    pub fn per_slot_index(mut self) -> Self {
        self.per_slot_index = true;
        self
    }

    /// Writes pipelined with `WAIT`: each claim, commit point and completion is
    /// acknowledged only once `replicas` replicas of the primary that holds the record
    /// have it, or refused after `timeout` (clamped to at least 1 ms and at most the
    /// [call timeout](RedisStoreOptions::call_timeout)). `replicas` 0 turns it off (the
    /// default).
    ///
    /// Redis replicates asynchronously: a claim or a completion acknowledged by a
    /// primary that dies before its replica has it is lost when the replica is
    /// promoted, and a copy of the request may then run again. This setting
    /// **reduces** that loss; it does not remove it (Redis's own documentation of
    /// `WAIT` says so: a replica that acknowledged can still lose the write, and a
    /// failover can promote another replica). The `WAIT` is pipelined with the script
    /// on the connection of the record's primary (one round trip, plus the replicas'
    /// acknowledgement), not sent to every primary, and not run inside the script,
    /// where it does not block.
    ///
    /// - A **claim** (or a commit point) not acknowledged in time is released by the
    ///   store (best effort) and refused as
    ///   [`StoreError::Unavailable`](retrysafe_core::store::StoreError::Unavailable):
    ///   the layer answers 503 `store-unavailable`, and nothing ran.
    /// - A **completion** not acknowledged in time is refused the same way; the layer
    ///   then returns the handler's real response and emits `completion_lost`.
    /// - Releases, renewals and unknown outcomes are not waited for.
    ///
    /// Costs: each of those calls waits for the replicas' acknowledgement (a
    /// replication round trip more).
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use retrysafe::redis::RedisStore;
    ///
    /// let store = RedisStore::options()
    ///     .replicated_writes(1, Duration::from_millis(100))
    ///     .connect("redis://127.0.0.1:6379")
    ///     .await?;
    /// assert_eq!(store.replicas(), 1);
    /// # Ok(()) }
    /// ```
    pub fn replicated_writes(mut self, replicas: u32, timeout: Duration) -> Self {
        self.replication = (replicas > 0).then_some(Replication { replicas, timeout });
        self
    }

    /// Connects to the Redis server at `url` (for example `redis://127.0.0.1:6379`)
    /// with a [`ConnectionManager`], and [builds](Self::build) the store over it.
    ///
    /// The manager reconnects by itself after a lost connection. It is configured
    /// here with a 1 s connection timeout, two retries per connection attempt, and no
    /// response timeout of its own (the store's call timeout bounds every call). To
    /// configure it differently, make it yourself and [`build`](Self::build) over it.
    ///
    /// A URL that does not parse is [`RedisStoreError::InvalidUrl`]; a server that
    /// cannot be reached is [`RedisStoreError::Unreachable`], naming its address, never
    /// a hang.
    pub async fn connect(
        self,
        url: impl IntoConnectionInfo,
    ) -> Result<RedisStore, RedisStoreError> {
        let info = url
            .into_connection_info()
            .map_err(|e| RedisStoreError::InvalidUrl(e.to_string()))?;
        let at = info.addr().to_string();
        let client =
            redis::Client::open(info).map_err(|e| RedisStoreError::InvalidUrl(e.to_string()))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(DEFAULT_CALL_TIMEOUT))
            .set_response_timeout(None)
            .set_number_of_retries(CONNECT_RETRIES)
            .set_max_delay(CONNECT_MAX_DELAY);
        // Each attempt is bounded by the connection timeout; the whole by a few of them.
        let bound = DEFAULT_CALL_TIMEOUT * 5;
        let conn = bounded(bound, ConnectionManager::new_with_config(client, config))
            .await
            .map_err(|e| unreachable(at, &e))?;
        self.build(conn).await
    }

    /// Validates the settings and makes a store over `conn` with them, then checks the
    /// server's configuration (one round trip) unless
    /// [`skip_config_check`](Self::skip_config_check) was set, and that the node is a
    /// primary (one round trip, `INFO`; not on a Redis Cluster, whose client routes
    /// each write to a primary).
    ///
    /// - Refused settings (a prefix with braces, a zero or huge call timeout) are
    ///   [`RedisStoreError::Config`], naming every one; the server is not asked.
    /// - A `maxmemory-policy` other than `noeviction` is
    ///   [`RedisStoreError::UnsafeEvictionPolicy`]; one that cannot be read (`CONFIG`
    ///   refused) is [`RedisStoreError::EvictionPolicyUnreadable`]. See
    ///   [`RedisStore::check_config`].
    /// - A read-only replica (`role:slave`) is [`RedisStoreError::ReadOnlyReplica`], which
    ///   names its primary: every write would be refused, and reads would see what
    ///   the replica had copied. (An `INFO` the server refuses is not checked.)
    /// - A server that cannot be reached is [`RedisStoreError::Store`].
    ///
    /// Async, like redis-rs's own connection constructors: the store is checked where
    /// it is made, so that no store runs on a server that may evict its claims.
    pub async fn build<C>(self, conn: C) -> Result<RedisStore<C>, RedisStoreError>
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        let check = self.check_config;
        let store = self.validate(conn)?;
        if check {
            store.check_on_start().await?;
        }
        store.check_role().await?;
        Ok(store)
    }

    /// Validates the settings: names every refused one.
    fn validate<C: 'static>(self, conn: C) -> Result<RedisStore<C>, ConfigError> {
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
        let manager = (&conn as &dyn std::any::Any)
            .downcast_ref::<ConnectionManager>()
            .cloned();
        v.finish(RedisStore {
            conn,
            config: Arc::new(Config {
                prefix: self.prefix,
                call_timeout: self.call_timeout,
                reconcilers: Reconcilers::default(),
                per_slot: AtomicBool::new(self.per_slot_index),
                cursor: AtomicU16::new(0),
                owner: Token::random(),
                name: self.name,
                manager,
                read_only: AtomicBool::new(false),
                reconnecting: AtomicBool::new(false),
            }),
            replication: self.replication,
        })
    }
}

/// A connection that could not be made to `at`, as the error of making a store.
pub(crate) fn unreachable(at: String, error: &StoreError) -> RedisStoreError {
    let cause = match error {
        StoreError::Timeout => "no answer in time".to_owned(),
        StoreError::Unavailable(e) => match e.downcast_ref::<redis::RedisError>() {
            Some(e) if e.is_connection_refusal() => "connection refused".to_owned(),
            Some(e) => e.to_string(),
            None => e.to_string(),
        },
        other => other.to_string(),
    };
    RedisStoreError::Unreachable { at, cause }
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

/// How many hash slots one scan lease covers (16 leases cover a cluster).
pub(crate) const SLOTS_PER_LEASE: u16 = 1024;

/// The in-flight index of a store on one server: `{prefix}inflight`.
fn single_index_key(prefix: &str) -> String {
    format!("{prefix}inflight")
}

/// The in-flight index of hash slot `slot` on a Redis Cluster:
/// `{prefix}inflight:{<tag>}`, the tag a number that hashes to `slot`.
fn slot_index_key(prefix: &str, slot: u16) -> String {
    format!("{prefix}inflight:{{{}}}", tag_of_slot(slot))
}

/// The key that holds the token of the last release or `mark_unknown` of the record at
/// `key`, for [`RESEND_WINDOW`]: `key` with `:last` appended (the same hash tag).
pub(crate) fn last_key(key: &str) -> String {
    format!("{key}:last")
}

/// The key of the record's meta hash (request, note, reason, notified flag, adoption,
/// claim time): `key` with `:meta` appended (the same hash tag), living as long as the
/// record.
pub(crate) fn meta_key(key: &str) -> String {
    format!("{key}:meta")
}

pub(crate) fn decode(bytes: Vec<u8>) -> Result<Record, StoreError> {
    Record::decode(Bytes::from(bytes)).map_err(StoreError::Corrupt)
}

/// The record a reconciler adopted until `until_ms`, as readers see it.
fn resolving(bytes: Vec<u8>, until_ms: u64) -> Result<Record, StoreError> {
    let record = decode(bytes)?;
    Ok(Record::Resolving(Resolving::new(
        *record.fingerprint(),
        until_ms,
    )))
}

fn unknown(fingerprint: Fingerprint) -> Record {
    Record::OutcomeUnknown(OutcomeUnknown::new(fingerprint))
}

/// Whole milliseconds of `d`, clamped to a century.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.min(MAX_SPAN).as_millis()).unwrap_or(u64::MAX)
}

/// Milliseconds of a key's time to live: at least 1 (`PX 0` is an error).
pub(crate) fn retention_millis(d: Duration) -> u64 {
    millis(d).max(1)
}

/// A pause between half and all of `d`.
fn jitter(d: Duration) -> Duration {
    d.mul_f64(rand::rng().random_range(0.5..=1.0))
}

#[cfg(feature = "cluster")]
impl RedisStoreOptions {
    /// Connects to a Redis Cluster through its `nodes` (any subset; the others are
    /// discovered), checks the configuration of the node it asks (see
    /// [`build`](Self::build)), and returns a store with these settings and the
    /// reconcilers' in-flight index kept per slot ([`per_slot_index`](Self::per_slot_index)).
    /// Feature `cluster`.
    ///
    /// Every record is one key whose hash tag is its record id, so each script runs on
    /// the node that owns that key's slot.
    ///
    /// The cluster client is made with a response timeout of twice the default call
    /// timeout (2 s; a waited write may take the call timeout). Without one, redis-rs's
    /// cluster client waits for every reply without end, also inside its slot refresh,
    /// which holds the topology lock that every request needs: one node that stops
    /// answering (frozen, partitioned, or its connection held up behind waited writes)
    /// can then stall every request to every node. Over your own cluster connection,
    /// set one too. A primary that stops answering is still not given up by the
    /// client: calls to its slots fail until it answers again (demoted, with `MOVED`).
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use retrysafe::redis::RedisStore;
    /// let store = RedisStore::options().connect_cluster([
    ///     "redis://10.0.0.1:6379",
    ///     "redis://10.0.0.2:6379",
    /// ])
    /// .await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_cluster<T: IntoConnectionInfo>(
        self,
        nodes: impl IntoIterator<Item = T>,
    ) -> Result<RedisStore<redis::cluster_async::ClusterConnection>, RedisStoreError> {
        let timeout = DEFAULT_CALL_TIMEOUT;
        let nodes: Vec<redis::ConnectionInfo> = nodes
            .into_iter()
            .map(|n| n.into_connection_info())
            .collect::<Result<_, _>>()
            .map_err(|e| RedisStoreError::InvalidUrl(e.to_string()))?;
        let at = nodes
            .iter()
            .map(|n| n.addr().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let client = redis::cluster::ClusterClient::builder(nodes)
            .connection_timeout(timeout)
            .response_timeout(CLUSTER_RESPONSE_TIMEOUT)
            .build()
            .map_err(|e| RedisStoreError::InvalidUrl(e.to_string()))?;
        let conn = bounded(timeout * 5, client.get_async_connection())
            .await
            .map_err(|e| unreachable(at, &e))?;
        self.per_slot_index().build(conn).await
    }
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
