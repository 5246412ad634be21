//! The example's PostgreSQL backend, read directly.

use std::collections::BTreeMap;
use std::str::FromStr;

use retrysafe_postgres::sqlx::postgres::PgConnectOptions;
use retrysafe_postgres::sqlx::{self, Connection, PgConnection};

use super::audit::{KeyAudit, Payment, RecordState};
use super::record_id;
use crate::services::{database_url, drop_stale_schemas, pg_admin, pg_connect, unique};

/// The prefix of the schemas these tests create.
const SCHEMA_PREFIX: &str = "payments_test_";

/// A schema of one test in the database at `DATABASE_URL`, with direct access to what
/// the example writes in it. Dropped (best effort) when dropped.
#[derive(Debug)]
pub struct PgSpace {
    /// `PAYMENTS_PG_SCHEMA` for the example.
    pub schema: String,
    /// The database's URL (`DATABASE_URL`, or the one given to [`at`](Self::at)).
    pub url: String,
    admin: tokio::sync::Mutex<PgConnection>,
}

impl PgSpace {
    /// A schema of one test in the database at `DATABASE_URL`.
    pub async fn new() -> PgSpace {
        drop_stale_schemas(SCHEMA_PREFIX).await;
        PgSpace {
            schema: format!("{SCHEMA_PREFIX}{}", unique()),
            url: database_url(),
            admin: tokio::sync::Mutex::new(pg_admin().await),
        }
    }

    /// A schema of one test in the database at `url` (a private cluster). The audits
    /// ([`audit`](Self::audit), [`table_counts`](Self::table_counts)) open a connection
    /// of their own, so they work across a restart of that server.
    pub async fn at(url: &str) -> PgSpace {
        PgSpace {
            schema: format!("{SCHEMA_PREFIX}{}", unique()),
            url: url.to_owned(),
            admin: tokio::sync::Mutex::new(pg_connect(url).await),
        }
    }

    /// The environment that points the example at this schema.
    pub fn env(&self) -> [(&str, &str); 1] {
        [("PAYMENTS_PG_SCHEMA", self.schema.as_str())]
    }

    /// `DATABASE_URL` with `application_name=NAME`, so that the sessions of one instance
    /// can be told apart in `pg_stat_activity`.
    pub fn url_named(name: &str) -> String {
        let url = database_url();
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}application_name={name}")
    }

    /// The amounts of `account`'s committed payments, by id.
    pub async fn amounts(&self, account: &str) -> Vec<i64> {
        let sql = format!(
            "SELECT amount_cents FROM {}.payments WHERE account = $1 ORDER BY id",
            self.schema
        );
        sqlx::query_scalar(&sql)
            .bind(account)
            .fetch_all(&mut *self.admin.lock().await)
            .await
            .unwrap()
    }

    /// Whether a committed key row exists for an anonymous client's `key`.
    pub async fn key_row_exists(&self, key: &str) -> bool {
        let sql = format!(
            "SELECT count(*) FROM {}.retrysafe_idempotency WHERE k = $1",
            self.schema
        );
        let n: i64 = sqlx::query_scalar(&sql)
            .bind(&record_id(key).as_bytes()[..])
            .fetch_one(&mut *self.admin.lock().await)
            .await
            .unwrap();
        n > 0
    }

    /// Whether a session of application `name` holds a row lock on the payments table
    /// of this schema: it has inserted a payment it has not committed yet.
    pub async fn uncommitted_insert(&self, name: &str) -> bool {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE a.application_name = $1 AND l.locktype = 'relation'
               AND l.mode = 'RowExclusiveLock' AND l.granted
               AND l.relation = to_regclass($2)",
        )
        .bind(name)
        .bind(format!("{}.payments", self.schema))
        .fetch_one(&mut *self.admin.lock().await)
        .await
        .unwrap();
        n > 0
    }

    /// Whether a session of application `name` holds an advisory lock: the
    /// transactional layer's lock on a key in flight.
    pub async fn holds_key_lock(&self, name: &str) -> bool {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE a.application_name = $1 AND l.locktype = 'advisory' AND l.granted",
        )
        .bind(name)
        .fetch_one(&mut *self.admin.lock().await)
        .await
        .unwrap();
        n > 0
    }

    /// How many sessions of application `name` the server still has.
    pub async fn sessions(&self, name: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
            .bind(name)
            .fetch_one(&mut *self.admin.lock().await)
            .await
            .unwrap()
    }
}

impl Drop for PgSpace {
    fn drop(&mut self) {
        let schema = self.schema.clone();
        let url = self.url.clone();
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let Ok(options) = PgConnectOptions::from_str(&url) else {
                    return;
                };
                if let Ok(mut conn) = PgConnection::connect_with(&options).await {
                    let _ = sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                        .execute(&mut conn)
                        .await;
                    let _ = conn.close().await;
                }
            });
        })
        .join();
    }
}

impl PgSpace {
    /// The record and committed payments of each of `payments`, on a connection of its
    /// own, with the lease of an `in_progress` row compared with `clock_timestamp()`.
    pub async fn audit(&self, payments: &[Payment]) -> Vec<KeyAudit> {
        let mut conn = pg_connect(&self.url).await;
        let ks: Vec<Vec<u8>> = payments
            .iter()
            .map(|p| record_id(&p.key).as_bytes().to_vec())
            .collect();
        let accounts: Vec<String> = payments.iter().map(|p| p.account.clone()).collect();
        let rows: Vec<(Vec<u8>, i16, bool, bool)> = sqlx::query_as(&format!(
            "SELECT k, state, coalesce(commit_point = 2, false),
                    coalesce(lease_until <= clock_timestamp(), false)
             FROM {}.retrysafe_idempotency WHERE k = ANY($1)",
            self.schema
        ))
        .bind(&ks)
        .fetch_all(&mut conn)
        .await
        .unwrap();
        let records: BTreeMap<Vec<u8>, RecordState> = rows
            .into_iter()
            .map(|(k, state, passed, expired)| {
                let state = match state {
                    1 => RecordState::InProgress { passed, expired },
                    2 => RecordState::Completed,
                    3 => RecordState::OutcomeUnknown,
                    other => panic!("unknown state {other}"),
                };
                (k, state)
            })
            .collect();
        let paid: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT account, id FROM {}.payments WHERE account = ANY($1) ORDER BY id",
            self.schema
        ))
        .bind(&accounts)
        .fetch_all(&mut conn)
        .await
        .unwrap();
        let mut by_account: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (account, id) in paid {
            by_account
                .entry(account)
                .or_default()
                .push(format!("pay_{id}"));
        }
        let _ = conn.close().await;
        payments
            .iter()
            .zip(&ks)
            .map(|(p, k)| KeyAudit {
                record: records.get(k).copied().unwrap_or(RecordState::Absent),
                payments: by_account.remove(&p.account).unwrap_or_default(),
            })
            .collect()
    }

    /// Every row of the key table and of the payments table in this schema:
    /// `(key rows, in_progress key rows, payments)`.
    pub async fn table_counts(&self) -> (i64, i64, i64) {
        let mut conn = pg_connect(&self.url).await;
        let counts = sqlx::query_as(&format!(
            "SELECT (SELECT count(*) FROM {s}.retrysafe_idempotency),
                    (SELECT count(*) FROM {s}.retrysafe_idempotency WHERE state = 1),
                    (SELECT count(*) FROM {s}.payments)",
            s = self.schema
        ))
        .fetch_one(&mut conn)
        .await
        .unwrap();
        let _ = conn.close().await;
        counts
    }
}
