//! The SQL of the store, rendered once per table name.
//!
//! Every statement reads the time from `clock_timestamp()` — once per statement, in a
//! `c` common table expression — so leases and retention are measured by the
//! database's clock, never by an application server's (`now()` would be frozen at the
//! start of an enclosing transaction).
//!
//! Durations are bound as whole microseconds (`$n * interval '1 microsecond'`).

use retrysafe_core::ConfigError;
use retrysafe_core::store::RESEND_WINDOW;

/// The `state` column of an `in_progress` record.
pub(crate) const STATE_IN_PROGRESS: i16 = 1;
/// The `state` column of a `completed` record (the `record` column holds it encoded).
pub(crate) const STATE_COMPLETED: i16 = 2;
/// The `state` column of an `outcome_unknown` record.
pub(crate) const STATE_UNKNOWN: i16 = 3;

/// The default table name.
pub(crate) const DEFAULT_TABLE: &str = "retrysafe_idempotency";

/// The longest table name: PostgreSQL's 63-byte identifiers, less the index suffix.
const MAX_TABLE_LEN: usize = 63 - INDEX_SUFFIX.len();
const MAX_SCHEMA_LEN: usize = 63;
const INDEX_SUFFIX: &str = "_expires_at_idx";

/// The advisory-lock class (first key of the two-int form) under which `migrate`
/// serialises concurrent migrations of one table.
const MIGRATE_LOCK_CLASS: i32 = 0x7273_0001;

/// The columns every record-returning statement selects, in this order, from a table
/// aliased `r` (see [`crate::store`] for how they become a record).
pub(crate) const RECORD_COLUMNS: &str = "r.state, r.fingerprint, r.token, r.commit_point, \
     floor(extract(epoch FROM r.lease_until) * 1000)::bigint AS lease_ms, r.record";

/// Checks a schema or table name: lowercase ASCII letters, digits and underscores, not
/// starting with a digit, so that it needs no quoting and reads the same in SQL
/// written by hand.
pub(crate) fn check_identifier(
    name: &str,
    field: &'static str,
    max_len: usize,
) -> Result<(), ConfigError> {
    let mut chars = name.chars();
    let Some(first) = chars.next() else {
        return Err(ConfigError::new(field, "must not be empty"));
    };
    if name.len() > max_len {
        return Err(ConfigError::new(
            field,
            "too long (tables at most 48 bytes, schemas 63)",
        ));
    }
    let ok = |c: char| c.is_ascii_lowercase() || c == '_' || c.is_ascii_digit();
    if first.is_ascii_digit() || !ok(first) || !chars.all(ok) {
        return Err(ConfigError::new(
            field,
            "use lowercase ASCII letters, digits and underscores, not starting with a digit",
        ));
    }
    Ok(())
}

/// Validates a table name.
pub(crate) fn check_table(name: &str) -> Result<(), ConfigError> {
    check_identifier(name, "table", MAX_TABLE_LEN)
}

/// Validates a schema name.
pub(crate) fn check_schema(name: &str) -> Result<(), ConfigError> {
    check_identifier(name, "schema", MAX_SCHEMA_LEN)
}

/// The rendered statements of one table.
#[derive(Debug)]
pub(crate) struct Sql {
    /// The table name, qualified by its schema when one is set.
    pub(crate) table: String,
    /// `CREATE TABLE IF NOT EXISTS …; CREATE INDEX IF NOT EXISTS …` (and the schema).
    pub(crate) migration: Vec<String>,
    /// The migration as one script (one implicit transaction) that first takes an
    /// advisory lock on the table name and lifts the statement timeout.
    pub(crate) migrate: String,
    /// `$1 k, $2 fingerprint, $3 token, $4 commit_point, $5 lease µs, $6 retention µs`.
    pub(crate) claim: String,
    /// `$1 k`.
    pub(crate) get: String,
    /// `$1 k, $2 token, $3 fingerprint, $4 retention µs, $5 encoded record`.
    pub(crate) complete: String,
    /// `$1 k, $2 token`.
    pub(crate) release: String,
    /// `$1 k, $2 token, $3 lease µs`.
    pub(crate) renew: String,
    /// `$1 k, $2 token`.
    pub(crate) commit_point: String,
    /// `$1 k, $2 token, $3 retention µs`.
    pub(crate) mark_unknown: String,
    /// `$1 batch size`.
    pub(crate) sweep: String,
}

impl Sql {
    /// Renders the statements for `table` in `schema` (both already validated).
    pub(crate) fn new(schema: Option<&str>, table: &str) -> Self {
        let qualified = match schema {
            Some(s) => format!("{s}.{table}"),
            None => table.to_owned(),
        };
        let t = &qualified;
        let migration = migration(schema, table, t);
        let mut migrate = format!(
            "SET LOCAL statement_timeout = 0;
SELECT pg_advisory_xact_lock({MIGRATE_LOCK_CLASS}, hashtext('{qualified}'));
"
        );
        for stmt in &migration {
            migrate.push_str(stmt);
            migrate.push_str(";\n");
        }
        // Every token-carrying change: the row must be in progress, held by the token,
        // and not dead.
        let holder = format!("k = $1 AND state = {STATE_IN_PROGRESS} AND token = $2");
        let window = RESEND_WINDOW.as_secs();
        Sql {
            claim: claim(t),
            get: format!(
                "SELECT {RECORD_COLUMNS} FROM {t} r WHERE r.k = $1 AND r.expires_at > clock_timestamp()"
            ),
            // Also matches the same completion sent again (its reply was lost): the row
            // already completed with exactly this record, left as it is.
            complete: format!(
                "UPDATE {t} SET state = {STATE_COMPLETED}, fingerprint = $3, token = NULL,
    commit_point = NULL, lease_until = NULL, record = $5,
    expires_at = CASE WHEN state = {STATE_IN_PROGRESS}
                      THEN c.t + $4 * interval '1 microsecond' ELSE expires_at END
FROM (SELECT clock_timestamp() AS t) c
WHERE k = $1 AND expires_at > c.t
  AND ((state = {STATE_IN_PROGRESS} AND token = $2)
       OR (state = {STATE_COMPLETED} AND fingerprint = $3 AND record = $5))"
            ),
            // A released row is kept dead (absent to every reader, and replaced by the
            // next claim) with its token and no lease, for the resend window: the same
            // release sent again (its reply was lost) matches it.
            release: format!(
                "UPDATE {t} SET commit_point = NULL, lease_until = NULL, record = NULL,
    expires_at = CASE WHEN lease_until IS NULL THEN expires_at ELSE c.t END
FROM (SELECT clock_timestamp() AS t) c
WHERE {holder}
  AND ((lease_until IS NOT NULL AND expires_at > c.t)
       OR (lease_until IS NULL AND expires_at > c.t - interval '{window} seconds'))"
            ),
            // The retention of an in-progress row (expires_at - lease_until) is kept.
            renew: format!(
                "UPDATE {t} SET lease_until = c.t + $3 * interval '1 microsecond',
    expires_at = c.t + $3 * interval '1 microsecond' + (expires_at - lease_until)
FROM (SELECT clock_timestamp() AS t) c
WHERE {holder} AND expires_at > c.t"
            ),
            commit_point: format!(
                "UPDATE {t} SET commit_point = 2 WHERE {holder} AND expires_at > clock_timestamp()"
            ),
            // The token stays on the unknown row, so that the same mark sent again (its
            // reply was lost) matches it and leaves it as it is.
            mark_unknown: format!(
                "UPDATE {t} SET state = {STATE_UNKNOWN}, commit_point = NULL,
    lease_until = NULL, record = NULL,
    expires_at = CASE WHEN state = {STATE_IN_PROGRESS}
                      THEN c.t + $3 * interval '1 microsecond' ELSE expires_at END
FROM (SELECT clock_timestamp() AS t) c
WHERE k = $1 AND token = $2 AND state IN ({STATE_IN_PROGRESS}, {STATE_UNKNOWN})
  AND expires_at > c.t"
            ),
            sweep: sweep(t, window),
            table: qualified,
            migrate,
            migration,
        }
    }

    /// The migration as one script, statements separated by `;`.
    pub(crate) fn migration_script(&self) -> String {
        let mut out = String::new();
        for stmt in &self.migration {
            out.push_str(stmt);
            out.push_str(";\n");
        }
        out
    }
}

/// The migration statements: the schema (if any), the table and its index.
fn migration(schema: Option<&str>, table: &str, t: &str) -> Vec<String> {
    let mut migration = Vec::new();
    if let Some(s) = schema {
        migration.push(format!("CREATE SCHEMA IF NOT EXISTS {s}"));
    }
    migration.push(format!(
        "CREATE TABLE IF NOT EXISTS {t} (
    k            bytea       PRIMARY KEY,
    state        smallint    NOT NULL CHECK (state IN (1, 2, 3)),
    fingerprint  bytea       NOT NULL,
    token        bytea,
    commit_point smallint,
    lease_until  timestamptz,
    takeovers    integer     NOT NULL DEFAULT 0,
    expires_at   timestamptz NOT NULL,
    record       bytea
)"
    ));
    migration.push(format!(
        "CREATE INDEX IF NOT EXISTS {table}{INDEX_SUFFIX} ON {t} (expires_at)"
    ));
    migration
}

/// The claim, in one statement. An existing row `r` is replaced when it is dead (past
/// its retention: the key is new again) or when it is in progress, its lease has
/// expired and the fingerprint matches; then it is taken over if its holder had not
/// reached the commit point, and turned into outcome_unknown otherwise. Any other
/// existing row is left alone (but locked for the moment of the statement, as ON
/// CONFLICT DO UPDATE does) and returned from the statement's snapshot by the second
/// branch of the UNION.
fn claim(t: &str) -> String {
    let dead = "r.expires_at <= (SELECT t FROM c)";
    let fresh = format!("({dead} OR r.commit_point = 1)");
    format!(
        "WITH c AS (SELECT clock_timestamp() AS t),
up AS (
    INSERT INTO {t} AS r
        (k, state, fingerprint, token, commit_point, lease_until, takeovers, expires_at, record)
    SELECT $1, {STATE_IN_PROGRESS}, $2, $3, $4,
           c.t + $5 * interval '1 microsecond', 0,
           c.t + ($5 + $6) * interval '1 microsecond', NULL
    FROM c
    ON CONFLICT (k) DO UPDATE SET
        state        = CASE WHEN {fresh} THEN {STATE_IN_PROGRESS} ELSE {STATE_UNKNOWN} END,
        fingerprint  = excluded.fingerprint,
        token        = CASE WHEN {fresh} THEN excluded.token END,
        commit_point = CASE WHEN {fresh} THEN excluded.commit_point END,
        lease_until  = CASE WHEN {fresh} THEN excluded.lease_until END,
        takeovers    = CASE WHEN {dead} THEN 0 WHEN {fresh} THEN r.takeovers + 1
                            ELSE r.takeovers END,
        expires_at   = CASE WHEN {fresh} THEN excluded.expires_at
                            ELSE (SELECT t FROM c) + $6 * interval '1 microsecond' END,
        record       = NULL
    WHERE {dead}
       OR (r.state = {STATE_IN_PROGRESS} AND r.lease_until <= (SELECT t FROM c)
           AND r.fingerprint = excluded.fingerprint)
    RETURNING r.takeovers, {RECORD_COLUMNS}
)
SELECT true AS mine, takeovers, state, fingerprint, token, commit_point, lease_ms, record
FROM up
UNION ALL
SELECT false, r.takeovers, {RECORD_COLUMNS}
FROM {t} r, c
WHERE r.k = $1 AND r.expires_at > c.t AND NOT EXISTS (SELECT 1 FROM up)"
    )
}

/// One batch of the sweeper: rows locked by someone else (a claim replacing a dead row
/// right now) are skipped, not waited for, and so are rows released less than the
/// resend window (`window` seconds) ago.
fn sweep(t: &str, window: u64) -> String {
    let kept = format!(
        "NOT (state = {STATE_IN_PROGRESS} AND lease_until IS NULL
         AND expires_at > (SELECT t FROM c) - interval '{window} seconds')"
    );
    format!(
        "WITH c AS (SELECT clock_timestamp() AS t)
DELETE FROM {t}
WHERE k IN (
    SELECT k FROM {t}
    WHERE expires_at <= (SELECT t FROM c) AND {kept}
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
AND expires_at <= (SELECT t FROM c) AND {kept}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_checked() {
        assert!(check_table("retrysafe_idempotency").is_ok());
        assert!(check_table("_t1").is_ok());
        assert!(check_schema("tenant_7").is_ok());
        for bad in ["", "1abc", "Upper", "a-b", "a b", "a\"b", "é", "a;drop"] {
            assert!(check_table(bad).is_err(), "{bad:?}");
            assert!(check_schema(bad).is_err(), "{bad:?}");
        }
        assert!(check_table(&"a".repeat(48)).is_ok());
        assert!(check_table(&"a".repeat(49)).is_err());
        assert!(check_schema(&"a".repeat(63)).is_ok());
        assert!(check_schema(&"a".repeat(64)).is_err());
    }

    #[test]
    fn names_are_qualified() {
        let sql = Sql::new(Some("s"), "t");
        assert_eq!(sql.table, "s.t");
        assert!(
            sql.migration_script()
                .starts_with("CREATE SCHEMA IF NOT EXISTS s;\n")
        );
        assert!(sql.claim.contains("INSERT INTO s.t AS r"));
        let sql = Sql::new(None, DEFAULT_TABLE);
        assert_eq!(sql.table, DEFAULT_TABLE);
        assert!(
            sql.migration_script()
                .contains("CREATE INDEX IF NOT EXISTS retrysafe_idempotency_expires_at_idx")
        );
        // The SQL shown in the crate docs.
        assert_eq!(
            sql.migration_script(),
            "CREATE TABLE IF NOT EXISTS retrysafe_idempotency (
    k            bytea       PRIMARY KEY,
    state        smallint    NOT NULL CHECK (state IN (1, 2, 3)),
    fingerprint  bytea       NOT NULL,
    token        bytea,
    commit_point smallint,
    lease_until  timestamptz,
    takeovers    integer     NOT NULL DEFAULT 0,
    expires_at   timestamptz NOT NULL,
    record       bytea
);
CREATE INDEX IF NOT EXISTS retrysafe_idempotency_expires_at_idx ON retrysafe_idempotency (expires_at);
"
        );
        for stmt in [&sql.claim, &sql.get, &sql.complete, &sql.renew, &sql.sweep] {
            assert!(!stmt.contains("now()"), "time only from clock_timestamp()");
        }
    }
}
