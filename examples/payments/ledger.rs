//! The payments ledger: where a payment is recorded, in memory, in Redis or in
//! PostgreSQL.
//!
//! - **Memory**: a list in the process (the `quickstart` and the default `payments`).
//! - **Redis**: one hash per account, `{prefix}{ledger}:account:{account}`, mapping each
//!   payment id to its amount, and the set of accounts `{prefix}{ledger}:accounts`,
//!   written together in one `MULTI`. (`{ledger}` is a Redis Cluster hash tag: every
//!   ledger key is in one slot.)
//! - **PostgreSQL**: a `payments` table (in the store's schema when it has one), written
//!   inside the request's transaction through the [`IdempotentTx`] guard, so the payment
//!   and the idempotency key commit together; or, in the plain mode
//!   (`PAYMENTS_PG_MODE=plain`, a test hook), on its own in autocommit, after the
//!   handler's commit point, as with Redis.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use retrysafe::core::idempotency::Token;
use retrysafe_postgres::PostgresStore;
use retrysafe_postgres::sqlx::{self, Row};
use retrysafe_postgres::tx::IdempotentTx;
use retrysafe_redis::redis::{self, aio::ConnectionManager};
use serde::Serialize;

/// How long one ledger call to Redis or PostgreSQL may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// One recorded payment.
#[derive(Debug, Clone, Serialize)]
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

/// The ledger of one backend. Cloning it is cheap and shares the backend.
#[derive(Debug, Clone)]
pub(crate) enum Ledger {
    /// In this process.
    Memory(Arc<Mutex<Vec<Payment>>>),
    /// In Redis, under a key prefix.
    Redis {
        conn: ConnectionManager,
        prefix: Arc<str>,
    },
    /// In a PostgreSQL table (qualified by its schema when there is one): inside the
    /// request's transaction when `transactional`, else on its own (autocommit).
    Postgres {
        pool: sqlx::PgPool,
        table: Arc<str>,
        transactional: bool,
    },
}

impl Ledger {
    /// An empty in-memory ledger.
    pub(crate) fn memory() -> Ledger {
        Ledger::Memory(Arc::default())
    }

    /// A ledger in Redis whose keys start with `prefix`.
    pub(crate) fn redis(conn: ConnectionManager, prefix: &str) -> Ledger {
        Ledger::Redis {
            conn,
            prefix: prefix.into(),
        }
    }

    /// A ledger in the `payments` table beside `store`'s key table (in the same
    /// schema), created if it does not exist, on the store's pool. With `transactional`
    /// every payment is written in the request's transaction; without, on its own.
    pub(crate) async fn postgres(
        store: &PostgresStore,
        transactional: bool,
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
             COMMIT;"
        );
        sqlx::raw_sql(&migrate).execute(store.pool()).await?;
        Ok(Ledger::Postgres {
            pool: store.pool().clone(),
            table: table.into(),
            transactional,
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

    /// Records one payment. With PostgreSQL, `tx` is the request's transaction: the
    /// payment commits with the idempotency key, or not at all.
    pub(crate) async fn record(
        &self,
        tx: Option<IdempotentTx>,
        account: String,
        amount_cents: i64,
    ) -> Result<Payment, LedgerError> {
        match self {
            Ledger::Memory(payments) => {
                let mut payments = payments.lock().unwrap_or_else(PoisonError::into_inner);
                let payment = Payment {
                    id: format!("pay_{:x}_{}", std::process::id(), payments.len() + 1),
                    account,
                    amount_cents,
                };
                payments.push(payment.clone());
                Ok(payment)
            }
            Ledger::Redis { conn, prefix } => {
                let id = format!("pay_{}", Token::random().to_hex());
                let mut conn = conn.clone();
                let mut write = redis::pipe();
                write
                    .atomic()
                    .cmd("HSET")
                    .arg(account_key(prefix, &account))
                    .arg(&id)
                    .arg(amount_cents)
                    .ignore()
                    .cmd("SADD")
                    .arg(accounts_key(prefix))
                    .arg(&account)
                    .ignore();
                bounded(write.query_async::<()>(&mut conn)).await?;
                Ok(Payment {
                    id,
                    account,
                    amount_cents,
                })
            }
            Ledger::Postgres {
                pool,
                table,
                transactional,
            } => {
                let insert = format!(
                    "INSERT INTO {table} (account, amount_cents) VALUES ($1, $2) RETURNING id"
                );
                let query = sqlx::query_scalar(&insert)
                    .bind(&account)
                    .bind(amount_cents);
                let id: i64 = if *transactional {
                    let mut tx = tx.ok_or(LedgerError::NoTransaction)?;
                    bounded(query.fetch_one(&mut *tx)).await?
                } else {
                    bounded(query.fetch_one(pool)).await?
                };
                Ok(Payment {
                    id: format!("pay_{id}"),
                    account,
                    amount_cents,
                })
            }
        }
    }

    /// The count and total of `account`'s payments, or of all of them.
    pub(crate) async fn totals(&self, account: Option<&str>) -> Result<Totals, LedgerError> {
        match self {
            Ledger::Memory(payments) => {
                let payments = payments.lock().unwrap_or_else(PoisonError::into_inner);
                Ok(payments
                    .iter()
                    .filter(|p| account.is_none_or(|a| p.account == a))
                    .fold(Totals::default(), |t, p| t.add(p.amount_cents)))
            }
            Ledger::Redis { conn, prefix } => {
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
                    pipe.cmd("HVALS").arg(account_key(prefix, a));
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

/// The Redis hash of `account`'s payments: payment id → amount in cents.
pub(crate) fn account_key(prefix: &str, account: &str) -> String {
    format!("{prefix}{{ledger}}:account:{account}")
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
