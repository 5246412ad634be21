//! The outbox table's statements, rendered once per table name.

use retrysafe_core::__private::Validate;
use retrysafe_core::ConfigError;

use crate::sql::{check_schema, check_table};

/// Row states, as stored in the `state` column.
pub(crate) const PENDING: i16 = 0;
pub(crate) const SUCCEEDED: i16 = 1;
pub(crate) const REJECTED: i16 = 2;
pub(crate) const DEAD: i16 = 3;

/// Row kinds, as stored in the `kind` column.
pub(crate) const KIND_HTTP: i16 = 1;
pub(crate) const KIND_MESSAGE: i16 = 2;

/// The columns a relay reads of a row it takes.
const ROW: &str = "id, child_key, kind, method, target, headers, body, attempts, \
     (clock_timestamp() - created_at) > make_interval(secs => $4::float8 / 1e6) AS too_old, \
     created_at";

/// The rendered statements of one outbox table.
#[derive(Debug, Clone)]
pub(crate) struct OutboxSql {
    pub(crate) migration: String,
    /// `$1 child_key, $2 kind, $3 method, $4 target, $5 headers, $6 body, $7 ordering_key`.
    pub(crate) insert: String,
    /// `$1 ordering key`: a lock on the key in this table, until the transaction ends.
    pub(crate) lock_order: String,
    /// `$1 token, $2 lease µs, $3 batch, $4 dead-letter age µs`.
    pub(crate) take: String,
    /// `$1 id, $2 token, $3 state, $4 last_status, $5 last_error`.
    pub(crate) finish: String,
    /// `$1 id, $2 token, $3 delay µs, $4 last_status, $5 last_error`.
    pub(crate) retry: String,
    /// `$1 retention µs, $2 batch`.
    pub(crate) sweep: String,
    /// The rows not yet delivered (pending).
    pub(crate) backlog: String,
}

impl OutboxSql {
    pub(crate) fn new(schema: Option<&str>, table: &str) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        if let Some(schema) = schema {
            v.take(check_schema(schema));
        }
        v.take(check_table(table));
        if let Some(e) = v.error() {
            return Err(e.clone());
        }
        let t = match schema {
            Some(s) => format!("{s}.{table}"),
            None => table.to_owned(),
        };
        Ok(OutboxSql {
            migration: migration(schema, table, &t),
            insert: format!(
                "INSERT INTO {t} (child_key, kind, method, target, headers, body, ordering_key)
                 VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id"
            ),
            // The table's name is part of the lock's key, so that tables do not wait on
            // each other's keys.
            lock_order: format!(
                "SELECT pg_advisory_xact_lock(hashtextextended('{t}/' || $1, 0))"
            ),
            take: format!(
                "UPDATE {t} SET lease_token = $1,
                     lease_until = clock_timestamp() + make_interval(secs => $2::float8 / 1e6),
                     attempts = attempts + 1
                 WHERE id IN (
                     SELECT o.id FROM {t} o
                     WHERE o.state = 0 AND o.next_attempt <= clock_timestamp()
                       AND (o.lease_until IS NULL OR o.lease_until < clock_timestamp())
                       AND (o.ordering_key IS NULL OR NOT EXISTS (
                           SELECT 1 FROM {t} p
                           WHERE p.ordering_key = o.ordering_key AND p.state = 0 AND p.id < o.id))
                     ORDER BY o.id LIMIT $3 FOR UPDATE SKIP LOCKED)
                 RETURNING {ROW}"
            ),
            finish: format!(
                "UPDATE {t} SET state = $3, finished_at = clock_timestamp(), lease_token = NULL,
                     lease_until = NULL, last_status = $4, last_error = $5
                 WHERE id = $1 AND lease_token = $2 AND state = 0"
            ),
            retry: format!(
                "UPDATE {t} SET next_attempt = clock_timestamp() + make_interval(secs => $3::float8 / 1e6),
                     lease_token = NULL, lease_until = NULL, last_status = $4, last_error = $5
                 WHERE id = $1 AND lease_token = $2 AND state = 0"
            ),
            sweep: format!(
                "DELETE FROM {t} WHERE id IN (
                     SELECT id FROM {t}
                     WHERE state <> 0
                       AND finished_at < clock_timestamp() - make_interval(secs => $1::float8 / 1e6)
                     LIMIT $2 FOR UPDATE SKIP LOCKED)"
            ),
            backlog: format!("SELECT count(*) FROM {t} WHERE state = 0"),
        })
    }
}

/// The table and its indexes (and the schema), all `IF NOT EXISTS`.
fn migration(schema: Option<&str>, table: &str, t: &str) -> String {
    let create_schema = schema
        .map(|s| format!("CREATE SCHEMA IF NOT EXISTS {s};\n"))
        .unwrap_or_default();
    format!(
                "{create_schema}CREATE TABLE IF NOT EXISTS {t} (
    id            bigserial   PRIMARY KEY,
    child_key     text        NOT NULL,
    kind          smallint    NOT NULL CHECK (kind IN (1, 2)),
    method        text        NOT NULL,
    target        text        NOT NULL,
    headers       bytea       NOT NULL,
    body          bytea       NOT NULL,
    ordering_key  text,
    state         smallint    NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),
    attempts      integer     NOT NULL DEFAULT 0,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    next_attempt  timestamptz NOT NULL DEFAULT clock_timestamp(),
    lease_token   bytea,
    lease_until   timestamptz,
    finished_at   timestamptz,
    last_status   integer,
    last_error    text
);
CREATE INDEX IF NOT EXISTS {table}_due_idx ON {t} (next_attempt, id) WHERE state = 0;
CREATE INDEX IF NOT EXISTS {table}_order_idx ON {t} (ordering_key, id) WHERE state = 0 AND ordering_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS {table}_finished_idx ON {t} (finished_at) WHERE state <> 0;"
            )
}
