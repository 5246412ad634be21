//! The payments ledger: where a payment is recorded, in memory, in Redis or in
//! PostgreSQL.
//!
//! Every payment made under an idempotency key is unique on (scope, key) for the
//! retention of the idempotency records (`--ttl-ms`, the key window): a second write
//! for the same key within it finds the first payment and records nothing. That makes
//! the ledger the resolver's source of truth (`find`): a pending key whose payment is
//! in the ledger happened; one whose payment is not can no longer happen, since a late
//! holder's write would find the key taken. After the window, as for the idempotency
//! layer, the key is new again.
//!
//! - **Memory**: a list in the process (the `quickstart` and the default `payments`),
//!   with an index by (scope, key).
//! - **Redis** (one server, or the primary Redis Sentinel names): one hash per account,
//!   `{prefix}{ledger}:account:{account}`, mapping each payment id to its amount, the
//!   set of accounts `{prefix}{ledger}:accounts`, and one key per idempotency key,
//!   `{prefix}{ledger}:by-key:<scope hash>:<key>`, holding the payment and expiring
//!   with the key window, written together by one script that first checks it.
//! - **Redis Cluster** ([`RedisConn::Cluster`]): the same keys, per hash slot, in the
//!   slot of the payment's idempotency record: `{prefix}{<tag>}:account:{account}`,
//!   `{prefix}{<tag>}:all` (every payment of the slot: id → amount) and
//!   `{prefix}{<tag>}:by-key:…`, `<tag>` the short hash tag of the record's slot
//!   (`retrysafe::redis::slots`). A payment then lives on the node of the record that
//!   says it happened, and a failover of one node loses both or neither: kept on a node
//!   of its own, a payment could be lost while its record survived, and a later copy
//!   would be answered a replayed 201 for a payment that no longer exists. The script
//!   runs on that one node; totals read every slot, one pipeline per range of slots a
//!   node holds (`CLUSTER SLOTS`).
//! - **PostgreSQL**: a `payments` table (in the store's schema when it has one), unique
//!   on (scope, key), written inside the request's transaction through the
//!   [`IdempotentTx`] guard, so the payment and the idempotency key commit together; or,
//!   in the plain mode (`PAYMENTS_PG_MODE=plain`, a test hook), on its own in
//!   autocommit, after the handler's commit point, as with Redis.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use retrysafe::idempotency::{RecordId, Scope, Token};
use retrysafe::postgres::PostgresStore;
use retrysafe::postgres::sqlx::{self, Row};
use retrysafe::postgres::tx::IdempotentTx;
use retrysafe::redis::SentinelConnection;
use retrysafe::redis::redis::aio::{ConnectionLike, ConnectionManager};
use retrysafe::redis::redis::cluster_async::ClusterConnection;
use retrysafe::redis::redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
use retrysafe::redis::redis::{self, Cmd, Pipeline, RedisFuture, RedisResult, Value};
use retrysafe::redis::slots::{SLOTS, slot_of_record, tag_of_slot};
use retrysafe::wire::IdempotencyKey;
use serde::{Deserialize, Serialize};

/// How long one ledger call to Redis or PostgreSQL may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// One recorded payment.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Payment {
    pub(crate) id: String,
    pub(crate) account: String,
    pub(crate) amount_cents: i64,
}

/// The count and total of some payments.
#[derive(Debug, Default, Serialize)]
pub(crate) struct Totals {
    pub(crate) count: u64,
    pub(crate) total_cents: i64,
}

impl Totals {
    fn add(self, amount_cents: i64) -> Totals {
        Totals {
            count: self.count + 1,
            total_cents: self.total_cents.saturating_add(amount_cents),
        }
    }
}

/// Why the ledger could not answer.
#[derive(Debug)]
pub(crate) enum LedgerError {
    /// The backend failed or did not answer in time.
    Unavailable(String),
    /// A PostgreSQL ledger was asked to record a payment outside a request transaction
    /// (the route is not behind the `TxIdempotencyLayer`): a programming error.
    NoTransaction,
}

impl std::fmt::Display for LedgerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LedgerError::Unavailable(e) => write!(f, "the ledger is unavailable: {e}"),
            LedgerError::NoTransaction => {
                f.write_str("no request transaction to record the payment in")
            }
        }
    }
}

/// The payments of the in-memory ledger, and their index by (scope, key): the payment's
/// place and when the key window of its key ends.
#[derive(Debug)]
pub(crate) struct MemoryLedger {
    payments: Vec<Payment>,
    by_key: std::collections::HashMap<String, (usize, tokio::time::Instant)>,
    window: Duration,
}

impl MemoryLedger {
    /// The payment of `name` while its key window lasts.
    fn owned(&self, name: &str) -> Option<&Payment> {
        let &(at, until) = self.by_key.get(name)?;
        (tokio::time::Instant::now() < until)
            .then(|| self.payments.get(at))
            .flatten()
    }
}

/// The idempotency key a payment was made under, in its scope: what the ledger is
/// unique on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Owner<'a> {
    pub(crate) scope: &'a Scope,
    pub(crate) key: &'a IdempotencyKey,
}

impl Owner<'_> {
    /// `<scope hash in hex>:<key>`: the ledger's unique name of the key.
    fn name(&self) -> String {
        let hex: String = self
            .scope
            .as_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("{hex}:{}", self.key.as_str())
    }
}

/// Records a payment unless its (scope, key) already has one within the key window;
/// replies the payment stored under the key (the new one, or the first). The third key
/// is the set of accounts on one server, the slot's hash of payments on a cluster.
const REDIS_RECORD: &str = r"
local first = redis.call('GET', KEYS[1])
if first then return first end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[5])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
if ARGV[6] == 'slot' then
  redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
else
  redis.call('SADD', KEYS[3], ARGV[4])
end
return ARGV[1]
";

/// A connection to one Redis server, to the primary Redis Sentinel names, or to a
/// Redis Cluster (a payment's keys are in the slot of its idempotency record, so the
/// ledger's script runs on the node that holds that record).
#[derive(Clone)]
pub(crate) enum RedisConn {
    /// One server, through a reconnecting manager.
    Server(ConnectionManager),
    /// The primary of a Sentinel service, followed across failovers.
    Sentinel(SentinelConnection),
    /// A cluster, through the cluster client (it follows `MOVED` and `ASK`).
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RedisConn::Server(_) => "RedisConn::Server",
            RedisConn::Sentinel(_) => "RedisConn::Sentinel",
            RedisConn::Cluster(_) => "RedisConn::Cluster",
        })
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Server(c) => c.req_packed_command(cmd),
            RedisConn::Sentinel(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConn::Server(c) => c.req_packed_commands(pipeline, offset, count),
            RedisConn::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
            RedisConn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Server(c) => c.get_db(),
            RedisConn::Sentinel(c) => c.get_db(),
            RedisConn::Cluster(c) => c.get_db(),
        }
    }
}

impl RedisConn {
    /// The hash tag of the ledger keys of a payment made under `owner`: `ledger` (one
    /// slot for the whole ledger) but on a cluster, where it is the tag of the slot of
    /// the owner's idempotency record (slot 0 for a payment without a key).
    fn tag(&self, owner: Option<Owner<'_>>) -> String {
        match self {
            RedisConn::Cluster(_) => {
                tag_of_slot(owner.map_or(0, |o| slot_of_record(&RecordId::new(o.scope, o.key))))
            }
            RedisConn::Server(_) | RedisConn::Sentinel(_) => "ledger".to_owned(),
        }
    }
}

/// The ledger of one backend. Cloning it is cheap and shares the backend.
#[derive(Debug, Clone)]
pub(crate) enum Ledger {
    /// In this process.
    Memory(Arc<Mutex<MemoryLedger>>),
    /// In Redis, under a key prefix.
    Redis {
        conn: RedisConn,
        prefix: Arc<str>,
        window: Duration,
    },
    /// In a PostgreSQL table (qualified by its schema when there is one): inside the
    /// request's transaction when `transactional`, else on its own (autocommit).
    Postgres {
        pool: sqlx::PgPool,
        table: Arc<str>,
        transactional: bool,
        window: Duration,
    },
}

impl Ledger {
    /// An empty in-memory ledger whose payments are unique per key for `window`.
    pub(crate) fn memory(window: Duration) -> Ledger {
        Ledger::Memory(Arc::new(Mutex::new(MemoryLedger {
            payments: Vec::new(),
            by_key: std::collections::HashMap::new(),
            window,
        })))
    }

    /// A ledger in Redis whose keys start with `prefix`, payments unique per key for
    /// `window`.
    pub(crate) fn redis(conn: RedisConn, prefix: &str, window: Duration) -> Ledger {
        Ledger::Redis {
            conn,
            prefix: prefix.into(),
            window,
        }
    }

    /// A ledger in the `payments` table beside `store`'s key table (in the same
    /// schema), created if it does not exist, on the store's pool. With `transactional`
    /// every payment is written in the request's transaction; without, on its own.
    pub(crate) async fn postgres(
        store: &PostgresStore,
        transactional: bool,
        window: Duration,
    ) -> Result<Ledger, sqlx::Error> {
        // The store's table name is validated and qualified as `schema.table`.
        let table = match store.table().split_once('.') {
            Some((schema, _)) => format!("{schema}.payments"),
            None => "payments".to_owned(),
        };
        // One transaction under an advisory lock: several instances may start at once,
        // and concurrent `CREATE TABLE IF NOT EXISTS` can collide.
        let migrate = format!(
            "BEGIN;
             SELECT pg_advisory_xact_lock(hashtext('retrysafe-example-payments'), hashtext('{table}'));
             CREATE TABLE IF NOT EXISTS {table} (
                 id           bigserial   PRIMARY KEY,
                 account      text        NOT NULL,
                 amount_cents bigint      NOT NULL,
                 created_at   timestamptz NOT NULL DEFAULT now()
             );
             CREATE INDEX IF NOT EXISTS payments_account_idx ON {table} (account);
             ALTER TABLE {table} ADD COLUMN IF NOT EXISTS scope bytea;
             ALTER TABLE {table} ADD COLUMN IF NOT EXISTS idem_key text;
             CREATE UNIQUE INDEX IF NOT EXISTS payments_owner_idx ON {table} (scope, idem_key);
             COMMIT;"
        );
        sqlx::raw_sql(&migrate).execute(store.pool()).await?;
        Ok(Ledger::Postgres {
            pool: store.pool().clone(),
            table: table.into(),
            transactional,
            window,
        })
    }

    /// Whether a failed call leaves nothing behind: with PostgreSQL the request's
    /// transaction rolls back on a failure.
    pub(crate) fn is_transactional(&self) -> bool {
        matches!(
            self,
            Ledger::Postgres {
                transactional: true,
                ..
            }
        )
    }

    /// Records one payment made under `owner` (unique: if that key has a payment
    /// already, nothing is recorded and the first payment is returned). With
    /// PostgreSQL, `tx` is the request's transaction: the payment commits with the
    /// idempotency key, or not at all.
    pub(crate) async fn record(
        &self,
        tx: Option<IdempotentTx>,
        owner: Option<Owner<'_>>,
        account: String,
        amount_cents: i64,
    ) -> Result<Payment, LedgerError> {
        match self {
            Ledger::Memory(ledger) => {
                let mut ledger = ledger.lock().unwrap_or_else(PoisonError::into_inner);
                let name = owner.map(|o| o.name());
                if let Some(first) = name.as_deref().and_then(|n| ledger.owned(n)) {
                    return Ok(first.clone());
                }
                let payment = Payment {
                    id: format!("pay_{:x}_{}", std::process::id(), ledger.payments.len() + 1),
                    account,
                    amount_cents,
                };
                ledger.payments.push(payment.clone());
                if let Some(name) = name {
                    let at = ledger.payments.len() - 1;
                    let until = tokio::time::Instant::now() + ledger.window;
                    ledger.by_key.insert(name, (at, until));
                }
                Ok(payment)
            }
            Ledger::Redis {
                conn,
                prefix,
                window,
            } => {
                let payment = Payment {
                    id: format!("pay_{}", Token::random().to_hex()),
                    account,
                    amount_cents,
                };
                let json = serde_json::to_string(&payment).map_err(unavailable)?;
                // A keyless payment gets a name of its own, so the script is one.
                let name = owner.map_or_else(|| format!("unkeyed:{}", payment.id), |o| o.name());
                let tag = conn.tag(owner);
                let per_slot = matches!(conn, RedisConn::Cluster(_));
                let mut conn = conn.clone();
                let script = redis::Script::new(REDIS_RECORD);
                let mut call = script.prepare_invoke();
                call.key(by_key(prefix, &tag, &name))
                    .key(account_key(prefix, &tag, &payment.account))
                    .key(if per_slot {
                        all_key(prefix, &tag)
                    } else {
                        accounts_key(prefix)
                    })
                    .arg(&json)
                    .arg(&payment.id)
                    .arg(payment.amount_cents)
                    .arg(&payment.account)
                    .arg(millis(*window))
                    .arg(if per_slot { "slot" } else { "one" });
                let stored: String = bounded(call.invoke_async(&mut conn)).await?;
                serde_json::from_str(&stored).map_err(unavailable)
            }
            Ledger::Postgres {
                pool,
                table,
                transactional,
                window,
            } => {
                // A key whose window has ended is new again: its old payment lets go of it.
                let release = format!(
                    "UPDATE {table} SET scope = NULL, idem_key = NULL
                     WHERE scope = $1 AND idem_key = $2
                       AND created_at < now() - $3 * interval '1 millisecond'"
                );
                let insert = format!(
                    "INSERT INTO {table} (account, amount_cents, scope, idem_key)
                     VALUES ($1, $2, $3, $4)
                     ON CONFLICT (scope, idem_key) DO NOTHING RETURNING id"
                );
                let (scope, key) = owner.map_or((None, None), |o| {
                    (
                        Some(o.scope.as_bytes().to_vec()),
                        Some(o.key.as_str().to_owned()),
                    )
                });
                let released = sqlx::query(&release)
                    .bind(scope.clone())
                    .bind(key.clone())
                    .bind(millis(*window));
                let query = sqlx::query_scalar(&insert)
                    .bind(&account)
                    .bind(amount_cents)
                    .bind(scope)
                    .bind(key);
                let id: Option<i64> = if *transactional {
                    let mut tx = tx.ok_or(LedgerError::NoTransaction)?;
                    if owner.is_some() {
                        bounded(released.execute(&mut *tx)).await?;
                    }
                    bounded(query.fetch_optional(&mut *tx)).await?
                } else {
                    if owner.is_some() {
                        bounded(released.execute(pool)).await?;
                    }
                    bounded(query.fetch_optional(pool)).await?
                };
                match (id, owner) {
                    (Some(id), _) => Ok(Payment {
                        id: format!("pay_{id}"),
                        account,
                        amount_cents,
                    }),
                    // The key has its payment already: that one.
                    (None, Some(owner)) => self
                        .find(owner.scope, owner.key)
                        .await?
                        .ok_or_else(|| LedgerError::Unavailable("payment vanished".into())),
                    (None, None) => Err(LedgerError::Unavailable("no payment id".into())),
                }
            }
        }
    }

    /// The payment made under `key` in `scope`, if any: what the resolver asks.
    pub(crate) async fn find(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> Result<Option<Payment>, LedgerError> {
        let owner = Owner { scope, key };
        let name = owner.name();
        match self {
            Ledger::Memory(ledger) => {
                let ledger = ledger.lock().unwrap_or_else(PoisonError::into_inner);
                Ok(ledger.owned(&name).cloned())
            }
            Ledger::Redis { conn, prefix, .. } => {
                let tag = conn.tag(Some(owner));
                let mut conn = conn.clone();
                let found: Option<String> = bounded(
                    redis::cmd("GET")
                        .arg(by_key(prefix, &tag, &name))
                        .query_async(&mut conn),
                )
                .await?;
                found
                    .map(|json| serde_json::from_str(&json).map_err(unavailable))
                    .transpose()
            }
            Ledger::Postgres {
                pool,
                table,
                window,
                ..
            } => {
                let select = format!(
                    "SELECT id, account, amount_cents FROM {table}
                     WHERE scope = $1 AND idem_key = $2
                       AND created_at >= now() - $3 * interval '1 millisecond'"
                );
                let row = bounded(
                    sqlx::query(&select)
                        .bind(scope.as_bytes().to_vec())
                        .bind(key.as_str())
                        .bind(millis(*window))
                        .fetch_optional(pool),
                )
                .await?;
                row.map(|row| {
                    let id: i64 = row.try_get("id").map_err(unavailable)?;
                    Ok(Payment {
                        id: format!("pay_{id}"),
                        account: row.try_get("account").map_err(unavailable)?,
                        amount_cents: row.try_get("amount_cents").map_err(unavailable)?,
                    })
                })
                .transpose()
            }
        }
    }

    /// The count and total of `account`'s payments, or of all of them.
    pub(crate) async fn totals(&self, account: Option<&str>) -> Result<Totals, LedgerError> {
        match self {
            Ledger::Memory(ledger) => {
                let ledger = ledger.lock().unwrap_or_else(PoisonError::into_inner);
                Ok(ledger
                    .payments
                    .iter()
                    .filter(|p| account.is_none_or(|a| p.account == a))
                    .fold(Totals::default(), |t, p| t.add(p.amount_cents)))
            }
            Ledger::Redis {
                conn: RedisConn::Cluster(conn),
                prefix,
                ..
            } => {
                let amounts = bounded(cluster_amounts(conn.clone(), prefix, account)).await?;
                Ok(amounts.into_iter().fold(Totals::default(), Totals::add))
            }
            Ledger::Redis { conn, prefix, .. } => {
                let mut conn = conn.clone();
                let accounts: Vec<String> = match account {
                    Some(a) => vec![a.to_owned()],
                    None => {
                        bounded(
                            redis::cmd("SMEMBERS")
                                .arg(accounts_key(prefix))
                                .query_async(&mut conn),
                        )
                        .await?
                    }
                };
                let mut pipe = redis::pipe();
                for a in &accounts {
                    pipe.cmd("HVALS").arg(account_key(prefix, "ledger", a));
                }
                let amounts: Vec<Vec<i64>> = if accounts.is_empty() {
                    Vec::new()
                } else {
                    bounded(pipe.query_async(&mut conn)).await?
                };
                Ok(amounts
                    .into_iter()
                    .flatten()
                    .fold(Totals::default(), Totals::add))
            }
            Ledger::Postgres { pool, table, .. } => {
                let select = format!(
                    "SELECT count(*)::bigint AS count,
                            coalesce(sum(amount_cents), 0)::bigint AS total_cents
                     FROM {table} WHERE $1::text IS NULL OR account = $1"
                );
                let row = bounded(sqlx::query(&select).bind(account).fetch_one(pool)).await?;
                let count: i64 = row.try_get("count").map_err(unavailable)?;
                let total_cents: i64 = row.try_get("total_cents").map_err(unavailable)?;
                Ok(Totals {
                    count: u64::try_from(count).unwrap_or(0),
                    total_cents,
                })
            }
        }
    }
}

/// The Redis hash of `account`'s payments (under hash tag `tag`): payment id → amount
/// in cents.
pub(crate) fn account_key(prefix: &str, tag: &str, account: &str) -> String {
    format!("{prefix}{{{tag}}}:account:{account}")
}

/// The Redis key of the payment made under `name` (`<scope hash>:<key>`).
fn by_key(prefix: &str, tag: &str, name: &str) -> String {
    format!("{prefix}{{{tag}}}:by-key:{name}")
}

/// On a cluster, the hash of the payments of the slot of tag `tag`: id → amount.
fn all_key(prefix: &str, tag: &str) -> String {
    format!("{prefix}{{{tag}}}:all")
}

/// The amounts of `account`'s payments (or of every payment) on a Redis Cluster: the
/// hash of each slot, read in one pipeline per range of slots a primary holds.
pub(crate) async fn cluster_amounts(
    mut conn: ClusterConnection,
    prefix: &str,
    account: Option<&str>,
) -> RedisResult<Vec<i64>> {
    let ranges: Vec<Vec<Value>> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut conn)
        .await?;
    let mut amounts = Vec::new();
    for range in ranges {
        let bound = |i: usize| -> RedisResult<u16> {
            redis::from_redis_value(range.get(i).cloned().unwrap_or(Value::Nil)).map_err(Into::into)
        };
        let (first, last) = (bound(0)?, bound(1)?.min(SLOTS - 1));
        let mut pipe = redis::pipe();
        for slot in first..=last {
            let tag = tag_of_slot(slot);
            pipe.cmd("HVALS").arg(match account {
                Some(a) => account_key(prefix, &tag, a),
                None => all_key(prefix, &tag),
            });
        }
        let count = usize::from(last - first) + 1;
        let route = SingleNodeRoutingInfo::SpecificNode(Route::new(first, SlotAddr::Master));
        let replies = conn.route_pipeline(pipe, 0, count, route).await?;
        for reply in replies {
            let slot_amounts: Vec<i64> = redis::from_redis_value(reply.extract_error()?)?;
            amounts.extend(slot_amounts);
        }
    }
    Ok(amounts)
}

/// Whole milliseconds of `d`, for Redis and PostgreSQL.
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The Redis set of the accounts that have payments.
fn accounts_key(prefix: &str) -> String {
    format!("{prefix}{{ledger}}:accounts")
}

fn unavailable(e: impl std::fmt::Display) -> LedgerError {
    LedgerError::Unavailable(e.to_string())
}

/// Bounds a backend call by [`CALL_TIMEOUT`].
async fn bounded<T, E: std::fmt::Display>(
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, LedgerError> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(result) => result.map_err(unavailable),
        Err(_) => Err(LedgerError::Unavailable(format!(
            "no answer within {CALL_TIMEOUT:?}"
        ))),
    }
}
