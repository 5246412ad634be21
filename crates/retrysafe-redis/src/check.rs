//! The start-up check of the server's configuration: [`RedisStore::check_config`], run
//! by [`RedisStore::connect`] and [`RedisStoreOptions::build`](crate::RedisStoreOptions::build)
//! unless skipped.

use std::collections::HashMap;
use std::fmt;

use redis::aio::ConnectionLike;
use redis::{RedisError, RedisResult, Value};
use retrysafe_core::ConfigError;
use retrysafe_core::store::StoreError;

use crate::RedisStore;
use crate::store::{bounded, store_error};

/// The server's `maxmemory-policy`: what Redis does when it reaches `maxmemory`.
///
/// ```
/// use retrysafe::redis::EvictionPolicy;
/// assert_eq!(EvictionPolicy::parse("noeviction"), EvictionPolicy::NoEviction);
/// assert!(EvictionPolicy::NoEviction.is_supported());
/// assert!(EvictionPolicy::parse("volatile-lru").is_unsafe());
/// assert!(!EvictionPolicy::parse("allkeys-lru").is_supported());
/// assert!(EvictionPolicy::parse("allkeys-lfu").is_unsafe());
/// assert!(!EvictionPolicy::Unknown.is_unsafe());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EvictionPolicy {
    /// `noeviction`: writes fail instead (the store answers them as unavailable).
    NoEviction,
    /// A `volatile-*` policy (named): only keys with an expiry are evicted, but every
    /// record has one (an in-flight claim's is a leak bound), so a claim may be evicted
    /// and a duplicate run. Not supported.
    Volatile(String),
    /// An `allkeys-*` policy (named): any key may be evicted, an in-flight claim
    /// included, and then a duplicate runs. Not supported.
    AllKeys(String),
    /// A policy this release does not know (named). Not supported.
    Other(String),
    /// The policy could not be read (the `CONFIG` command is refused, as on many
    /// managed services, or the reply named no policy).
    Unknown,
}

impl EvictionPolicy {
    /// Reads a `maxmemory-policy` value (case-insensitive).
    #[doc(hidden)]
    pub fn parse(value: &str) -> Self {
        let v = value.trim().to_ascii_lowercase();
        if v == "noeviction" {
            EvictionPolicy::NoEviction
        } else if v.starts_with("volatile-") {
            EvictionPolicy::Volatile(v)
        } else if v.starts_with("allkeys-") {
            EvictionPolicy::AllKeys(v)
        } else if v.is_empty() {
            EvictionPolicy::Unknown
        } else {
            EvictionPolicy::Other(v)
        }
    }

    /// Whether the store supports the policy: only `noeviction`.
    pub fn is_supported(&self) -> bool {
        matches!(self, EvictionPolicy::NoEviction)
    }

    /// Whether the policy is known and not supported (`volatile-*`, `allkeys-*`, or
    /// unknown to this release). [`Unknown`](Self::Unknown) is not unsafe: it could not
    /// be checked.
    pub fn is_unsafe(&self) -> bool {
        matches!(
            self,
            EvictionPolicy::Volatile(_) | EvictionPolicy::AllKeys(_) | EvictionPolicy::Other(_)
        )
    }
}

impl fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EvictionPolicy::NoEviction => f.write_str("noeviction"),
            EvictionPolicy::Volatile(p) | EvictionPolicy::AllKeys(p) | EvictionPolicy::Other(p) => {
                f.write_str(p)
            }
            EvictionPolicy::Unknown => f.write_str("unknown"),
        }
    }
}

/// What [`RedisStore::check_config`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConfigReport {
    /// The `maxmemory-policy`.
    pub eviction_policy: EvictionPolicy,
    /// Whether the append-only file is on (`appendonly yes`); `None` when unknown.
    pub aof: Option<bool>,
    /// Whether RDB snapshots are scheduled (a non-empty `save`); `None` when unknown.
    pub rdb: Option<bool>,
    /// Whether the node runs in Redis Cluster mode (`cluster-enabled yes`); `None` when
    /// unknown. Making a store on a cluster node keeps the in-flight index as one key
    /// per hash slot.
    pub cluster: Option<bool>,
}

impl ConfigReport {
    /// Whether the server persists its data (AOF or RDB), `None` when unknown. Without
    /// persistence a restart forgets every record: in-flight claims, stored responses
    /// and `outcome_unknown` records, so copies of past requests run again.
    pub fn persistent(&self) -> Option<bool> {
        match (self.aof, self.rdb) {
            (Some(true), _) | (_, Some(true)) => Some(true),
            (Some(false), Some(false)) => Some(false),
            _ => None,
        }
    }
}

/// Why making a store ([`RedisStore::connect`],
/// [`RedisStoreOptions::build`](crate::RedisStoreOptions::build)) or
/// [`RedisStore::check_config`] failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum RedisStoreError {
    /// The store's settings were refused (every refused one is named).
    Config(ConfigError),
    /// The URL of the server (or of a sentinel, a cluster node) does not parse.
    InvalidUrl(String),
    /// The server could not be reached: nothing answers at `at`, or it refused the
    /// connection.
    Unreachable {
        /// The address asked, `host:port`.
        at: String,
        /// Why, in a few words (`connection refused`, `timed out`).
        cause: String,
    },
    /// The server's eviction policy may evict records (anything but `noeviction`). The
    /// report says what else was found.
    UnsafeEvictionPolicy(ConfigReport),
    /// The server refused `CONFIG GET` (as many managed services do), so the eviction
    /// policy could not be checked: make sure it is `noeviction`, then build the store
    /// with [`skip_config_check`](crate::RedisStoreOptions::skip_config_check).
    EvictionPolicyUnreadable,
    /// The node is a read-only replica (`role:slave`): every write would be refused.
    /// Connect to its primary (named when the replica reports it), or through Redis
    /// Sentinel (`RedisStore::options().connect_sentinel`, feature `sentinel`), which finds it.
    ReadOnlyReplica {
        /// The primary it replicates, `host:port`, when it says.
        primary: Option<String>,
    },
    /// The server could not be asked.
    Store(StoreError),
}

impl fmt::Display for RedisStoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RedisStoreError::Config(e) => write!(f, "invalid Redis store settings: {e}"),
            RedisStoreError::InvalidUrl(e) => write!(f, "invalid Redis URL: {e}"),
            RedisStoreError::Unreachable { at, cause } => {
                write!(f, "cannot connect to Redis at {at}: {cause}")
            }
            RedisStoreError::UnsafeEvictionPolicy(r) => write!(
                f,
                "Redis maxmemory-policy is {}: it may evict in-flight idempotency claims; \
                 set maxmemory-policy noeviction",
                r.eviction_policy
            ),
            RedisStoreError::EvictionPolicyUnreadable => f.write_str(
                "cannot read the Redis maxmemory-policy (CONFIG GET refused): make sure it \
                 is noeviction and build the store with skip_config_check()",
            ),
            RedisStoreError::ReadOnlyReplica { primary } => {
                f.write_str("the Redis node is a read-only replica, and a store writes: ")?;
                match primary {
                    Some(p) => write!(f, "connect to its primary, {p}"),
                    None => f.write_str("connect to its primary"),
                }
            }
            RedisStoreError::Store(e) => write!(f, "cannot check the Redis configuration: {e}"),
        }
    }
}

impl std::error::Error for RedisStoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RedisStoreError::Config(e) => Some(e),
            RedisStoreError::InvalidUrl(_)
            | RedisStoreError::Unreachable { .. }
            | RedisStoreError::UnsafeEvictionPolicy(_)
            | RedisStoreError::EvictionPolicyUnreadable
            | RedisStoreError::ReadOnlyReplica { .. } => None,
            RedisStoreError::Store(e) => Some(e),
        }
    }
}

impl From<ConfigError> for RedisStoreError {
    fn from(e: ConfigError) -> Self {
        RedisStoreError::Config(e)
    }
}

impl From<StoreError> for RedisStoreError {
    fn from(e: StoreError) -> Self {
        RedisStoreError::Store(e)
    }
}

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Checks the server's configuration, where permitted: reads `maxmemory-policy`,
    /// `appendonly`, `save` and `cluster-enabled` with `CONFIG GET` (one round trip). Making a store runs
    /// it (and also refuses an unreadable policy) unless
    /// [`skip_config_check`](crate::RedisStoreOptions::skip_config_check) was set; call
    /// it again to read the report.
    ///
    /// - Any policy but `noeviction` (`volatile-*`, `allkeys-*`, one this release does
    ///   not know) is [`RedisStoreError::UnsafeEvictionPolicy`]: Redis could evict an
    ///   in-flight claim, which carries an expiry, and a duplicate would run.
    /// - A refused `CONFIG` command (managed services, ACLs) is not an error: the report
    ///   says [`EvictionPolicy::Unknown`] and the persistence is `None`; it is logged.
    /// - No persistence is logged as a warning, not an error.
    /// - A server that cannot be reached is [`RedisStoreError::Store`].
    ///
    /// On a cluster connection the command goes to one node; configure all alike.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use retrysafe::redis::{EvictionPolicy, RedisStore};
    ///
    /// let store = RedisStore::connect("redis://127.0.0.1:6379").await?; // checks
    /// let report = store.check_config().await?;
    /// if report.eviction_policy == EvictionPolicy::Unknown {
    ///     eprintln!("could not check maxmemory-policy: make sure it is noeviction");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn check_config(&self) -> Result<ConfigReport, RedisStoreError> {
        let mut conn = self.connection().clone();
        let mut pipe = redis::pipe();
        for name in ["maxmemory-policy", "appendonly", "save", "cluster-enabled"] {
            pipe.cmd("CONFIG").arg("GET").arg(name);
        }
        let reply: RedisResult<Vec<HashMap<String, String>>> =
            bounded_raw(self, pipe.query_async(&mut conn)).await?;
        let report = match reply {
            Ok(maps) => report_from(&maps),
            Err(e) if e.code().is_some() => {
                // The server answered, refusing: the configuration cannot be read.
                tracing::warn!(
                    target: "retrysafe::redis",
                    name = self.name().as_str(),
                    error = %e,
                    "cannot read the Redis configuration (CONFIG GET refused): \
                     make sure maxmemory-policy is noeviction and that \
                     persistence is on"
                );
                ConfigReport {
                    eviction_policy: EvictionPolicy::Unknown,
                    aof: None,
                    rdb: None,
                    cluster: None,
                }
            }
            Err(e) => return Err(RedisStoreError::Store(store_error(e))),
        };
        if report.eviction_policy.is_unsafe() {
            tracing::error!(
                target: "retrysafe::redis",
                name = self.name().as_str(),
                policy = %report.eviction_policy,
                "Redis maxmemory-policy may evict idempotency records"
            );
            return Err(RedisStoreError::UnsafeEvictionPolicy(report));
        }
        if report.persistent() == Some(false) {
            tracing::warn!(
                target: "retrysafe::redis",
                name = self.name().as_str(),
                "Redis persists nothing (appendonly no, no save schedule): a restart \
                 forgets every idempotency record"
            );
        }
        Ok(report)
    }
}

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The check run when a store is made: [`check_config`](Self::check_config), and a
    /// policy that could not be read is refused too. A cluster node makes the store
    /// keep its in-flight index per hash slot.
    pub(crate) async fn check_on_start(&self) -> Result<(), RedisStoreError> {
        let report = self.check_config().await?;
        if report.eviction_policy == EvictionPolicy::Unknown {
            return Err(RedisStoreError::EvictionPolicyUnreadable);
        }
        if report.cluster == Some(true) {
            self.index_per_slot();
        }
        Ok(())
    }

    /// Refuses a read-only replica ([`RedisStoreError::ReadOnlyReplica`]), from the node's
    /// `INFO` (`role`, `cluster_enabled`, `master_host`, `master_port`). Not on a
    /// Redis Cluster: its client sends each write to the primary of its slot, and
    /// fans `INFO` out to every primary. A refused `INFO` is not checked.
    pub(crate) async fn check_role(&self) -> Result<(), RedisStoreError> {
        if self.per_slot() {
            return Ok(());
        }
        let mut conn = self.connection().clone();
        let reply: RedisResult<Value> =
            bounded_raw(self, redis::cmd("INFO").query_async(&mut conn)).await?;
        let info = match reply {
            Ok(Value::BulkString(bytes)) => String::from_utf8_lossy(&bytes).into_owned(),
            Ok(Value::VerbatimString { text, .. }) => text,
            // A fan-out's map: a cluster client, whose writes go to primaries.
            Ok(_) => return Ok(()),
            Err(e) if e.code().is_some() => {
                tracing::warn!(
                    target: "retrysafe::redis",
                    name = self.name().as_str(),
                    error = %e,
                    "cannot read the Redis node's role (INFO refused): make sure it is a primary"
                );
                return Ok(());
            }
            Err(e) => return Err(RedisStoreError::Store(store_error(e))),
        };
        match replica_of(&info) {
            Some(primary) => {
                tracing::error!(
                    target: "retrysafe::redis",
                    name = self.name().as_str(),
                    primary = primary.as_deref().unwrap_or("unknown"),
                    "the Redis node is a read-only replica: a store needs its primary"
                );
                Err(RedisStoreError::ReadOnlyReplica { primary })
            }
            None => Ok(()),
        }
    }
}

/// From an `INFO` reply: `None` for a primary (or a cluster node, or an unknown role);
/// for a replica, `Some` of its primary's `host:port` when the reply names it.
pub(crate) fn replica_of(info: &str) -> Option<Option<String>> {
    let field = |name: &str| {
        info.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            (key == name).then(|| value.trim())
        })
    };
    if field("role") != Some("slave") || field("cluster_enabled") == Some("1") {
        return None;
    }
    Some(match (field("master_host"), field("master_port")) {
        (Some(host), Some(port)) => Some(format!("{host}:{port}")),
        _ => None,
    })
}

/// Bounds `fut` by the store's call timeout, keeping the redis result (for its error
/// code) unless the call timed out.
async fn bounded_raw<C, T>(
    store: &RedisStore<C>,
    fut: impl Future<Output = RedisResult<T>>,
) -> Result<RedisResult<T>, StoreError>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    bounded(store.call_timeout(), async {
        Ok::<_, RedisError>(fut.await)
    })
    .await
}

/// The report from the `CONFIG GET` replies (in order: `maxmemory-policy`,
/// `appendonly`, `save`, `cluster-enabled`), each a map from the parameter to its value.
pub(crate) fn report_from(maps: &[HashMap<String, String>]) -> ConfigReport {
    let value = |i: usize, name: &str| maps.get(i).and_then(|m| m.get(name)).map(String::as_str);
    ConfigReport {
        eviction_policy: value(0, "maxmemory-policy")
            .map_or(EvictionPolicy::Unknown, EvictionPolicy::parse),
        aof: value(1, "appendonly").map(|v| v.trim().eq_ignore_ascii_case("yes")),
        rdb: value(2, "save").map(|v| !v.trim().is_empty()),
        cluster: value(3, "cluster-enabled").map(|v| v.trim().eq_ignore_ascii_case("yes")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(k: &str, v: &str) -> HashMap<String, String> {
        HashMap::from([(k.to_owned(), v.to_owned())])
    }

    #[test]
    fn parses_policies() {
        assert_eq!(
            EvictionPolicy::parse("noeviction"),
            EvictionPolicy::NoEviction
        );
        assert_eq!(
            EvictionPolicy::parse(" NoEviction "),
            EvictionPolicy::NoEviction
        );
        for p in [
            "volatile-lru",
            "volatile-lfu",
            "volatile-random",
            "volatile-ttl",
        ] {
            let parsed = EvictionPolicy::parse(p);
            assert_eq!(parsed, EvictionPolicy::Volatile(p.to_owned()));
            assert!(!parsed.is_supported() && parsed.is_unsafe());
            assert_eq!(parsed.to_string(), p);
        }
        for p in ["allkeys-lru", "allkeys-lfu", "allkeys-random"] {
            let parsed = EvictionPolicy::parse(p);
            assert_eq!(parsed, EvictionPolicy::AllKeys(p.to_owned()));
            assert!(!parsed.is_supported() && parsed.is_unsafe());
        }
        assert_eq!(
            EvictionPolicy::parse("some-future-policy"),
            EvictionPolicy::Other("some-future-policy".to_owned())
        );
        assert!(EvictionPolicy::parse("some-future-policy").is_unsafe());
        assert_eq!(EvictionPolicy::parse(""), EvictionPolicy::Unknown);
        assert!(!EvictionPolicy::Unknown.is_supported());
        assert!(!EvictionPolicy::Unknown.is_unsafe());
    }

    #[test]
    fn report_from_replies() {
        let r = report_from(&[
            map("maxmemory-policy", "allkeys-lru"),
            map("appendonly", "yes"),
            map("save", ""),
            map("cluster-enabled", "yes"),
        ]);
        assert_eq!(
            r,
            ConfigReport {
                eviction_policy: EvictionPolicy::AllKeys("allkeys-lru".to_owned()),
                aof: Some(true),
                rdb: Some(false),
                cluster: Some(true),
            }
        );
        assert_eq!(r.persistent(), Some(true));

        let r = report_from(&[
            map("maxmemory-policy", "noeviction"),
            map("appendonly", "no"),
            map("save", "3600 1 300 100 60 10000"),
        ]);
        assert_eq!(r.eviction_policy, EvictionPolicy::NoEviction);
        assert_eq!(
            (r.aof, r.rdb, r.persistent()),
            (Some(false), Some(true), Some(true))
        );

        let r = report_from(&[
            map("maxmemory-policy", "noeviction"),
            map("appendonly", "no"),
            map("save", ""),
        ]);
        assert_eq!(r.persistent(), Some(false));

        // A parameter the server does not know comes back as an empty reply.
        let r = report_from(&[HashMap::new(), HashMap::new()]);
        assert_eq!(r.eviction_policy, EvictionPolicy::Unknown);
        assert_eq!((r.aof, r.rdb, r.persistent()), (None, None, None));
    }

    #[test]
    fn replicas_are_found_in_info() {
        let primary = "# Replication\r\nrole:master\r\nconnected_slaves:1\r\n";
        assert_eq!(replica_of(primary), None);
        let replica = "# Server\r\nredis_version:7.0.15\r\n# Replication\r\nrole:slave\r\n\
                       master_host:10.0.0.1\r\nmaster_port:6379\r\n# Cluster\r\ncluster_enabled:0\r\n";
        assert_eq!(replica_of(replica), Some(Some("10.0.0.1:6379".to_owned())));
        assert_eq!(replica_of("role:slave\r\n"), Some(None));
        // A cluster replica: the cluster client routes writes to primaries.
        assert_eq!(replica_of("role:slave\r\ncluster_enabled:1\r\n"), None);
        assert_eq!(replica_of(""), None);
        let e = RedisStoreError::ReadOnlyReplica {
            primary: Some("10.0.0.1:6379".to_owned()),
        };
        assert!(e.to_string().contains("read-only replica"), "{e}");
        assert!(e.to_string().contains("10.0.0.1:6379"), "{e}");
    }

    #[test]
    fn check_error_messages() {
        let e = RedisStoreError::UnsafeEvictionPolicy(report_from(&[map(
            "maxmemory-policy",
            "allkeys-lru",
        )]));
        assert!(e.to_string().contains("allkeys-lru"), "{e}");
        assert!(e.to_string().contains("noeviction"), "{e}");
    }
}
