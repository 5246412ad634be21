//! The SQL of the store, rendered once per table name.
//!
//! Every statement reads the time from `clock_timestamp()` — once per statement, in a
//! `c` common table expression — so leases and retention are measured by the
//! database's clock, never by an application server's (`now()` would be frozen at the
//! start of an enclosing transaction).
//!
//! Durations are bound as whole microseconds (`$n * interval '1 microsecond'`).

use retrysafe_core::ConfigError;
use retrysafe_core::idempotency::UnknownReason;
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
const PENDING_INDEX_SUFFIX: &str = "_pending_idx";

/// The advisory-lock class (first key of the two-int form) under which `migrate`
/// serialises concurrent migrations of one table.
const MIGRATE_LOCK_CLASS: i32 = 0x7273_0001;

/// The columns every record-returning statement selects, in this order, from a table
/// aliased `r` (see [`crate::store`] for how they become a record).
///
/// `adopt_ms` is the end of a live adoption (the record reads as `resolving`), NULL when
/// there is none.
pub(crate) const RECORD_COLUMNS: &str = "r.state, r.fingerprint, r.token, r.commit_point, \
     floor(extract(epoch FROM r.lease_until) * 1000)::bigint AS lease_ms, r.record, \
     CASE WHEN r.adopt_until > clock_timestamp() \
          THEN floor(extract(epoch FROM r.adopt_until) * 1000)::bigint END AS adopt_ms";

/// The columns of a pending record, from a table aliased `r` and the statement's time
/// `c.t` (see `crate::store` for how they become a `PendingRecord`).
const PENDING_COLUMNS: &str = "r.state, r.fingerprint, r.commit_point, r.request, r.note, \
     r.unknown_reason, coalesce(r.notified, false) AS notified, \
     greatest(floor(extract(epoch FROM c.t - coalesce(r.claimed_at, c.t)) * 1000000), 0)::bigint \
     AS age_us";

/// The columns appended after the first release, each nullable so that a release
/// that does not know them keeps working on the table.
const ADDED_COLUMNS: [(&str, &str); 9] = [
    ("request", "bytea"),
    ("note", "bytea"),
    ("unknown_reason", "integer"),
    ("notified", "boolean"),
    ("adopt_token", "bytea"),
    ("adopt_until", "timestamptz"),
    ("next_pass", "timestamptz"),
    ("claimed_at", "timestamptz"),
    ("lease_ended", "timestamptz"),
];

/// A row not adopted by a live reconciler, at the statement's time `c.t`.
const NOT_ADOPTED: &str = "(adopt_until IS NULL OR adopt_until <= c.t)";

/// A row `r` a reconciler may adopt: a claim (not a released one) or an unknown outcome.
const PENDING: &str = "((r.state = 1 AND r.lease_until IS NOT NULL) OR r.state = 3)";

/// A row adopted by a live reconciler with the token `$2` and still pending (a release
/// that does not know adoptions may have completed it meanwhile: then the settlement
/// is refused).
const ADOPTED: &str = "(adopt_until > c.t AND expires_at > c.t
       AND ((state = 1 AND lease_until IS NOT NULL) OR state = 3))";

/// What a record that is no longer pending does not need.
const CLEARED: &str = "request = NULL, note = NULL, unknown_reason = NULL, notified = NULL, \
     next_pass = NULL, claimed_at = NULL, lease_ended = NULL";

/// The code of the reason of an unknown outcome made from an expired lease.
fn lease_expired() -> i32 {
    i32::from(UnknownReason::LeaseExpired.to_code())
}

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
    /// `$1 k, $2 fingerprint, $3 token, $4 commit_point, $5 lease µs, $6 retention µs,
    /// $7 encoded request info (or NULL)`.
    pub(crate) claim: String,
    /// `$1 k`.
    pub(crate) get: String,
    /// `$1 k, $2 token, $3 fingerprint, $4 retention µs, $5 encoded record`.
    pub(crate) complete: String,
    /// `$1 k, $2 token`.
    pub(crate) release: String,
    /// `$1 k, $2 token, $3 lease µs`.
    pub(crate) renew: String,
    /// `$1 k, $2 token, $3 note (or NULL: the note is kept)`.
    pub(crate) commit_point: String,
    /// `$1 k, $2 token, $3 retention µs, $4 reason code`.
    pub(crate) mark_unknown: String,
    /// `$1 k`.
    pub(crate) mark_notified: String,
    /// `$1 batch size`.
    pub(crate) sweep: String,
    /// `$1 stale µs, $2 limit`.
    pub(crate) due: String,
    /// `$1 limit`.
    pub(crate) list_pending: String,
    /// `$1 k, $2 adoption token, $3 hold µs, $4 stale µs (or NULL: any claim)`.
    pub(crate) adopt: String,
    /// `$1 k`.
    pub(crate) peek: String,
    /// `$1 k, $2 adoption token`: the fingerprint of the record the token adopted.
    pub(crate) adopted_fingerprint: String,
    /// `$1 k, $2 adoption token, $3 fingerprint, $4 retention µs, $5 encoded record`.
    pub(crate) settle_complete: String,
    /// `$1 k, $2 adoption token`.
    pub(crate) settle_release: String,
    /// `$1 k, $2 adoption token, $3 after µs, $4 notified`.
    pub(crate) settle_later: String,
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
        // and not adopted by a live reconciler (the late holder is refused meanwhile).
        let holder =
            format!("k = $1 AND state = {STATE_IN_PROGRESS} AND token = $2 AND {NOT_ADOPTED}");
        let window = RESEND_WINDOW.as_secs();
        Sql {
            claim: claim(t),
            get: format!(
                "SELECT {RECORD_COLUMNS} FROM {t} r WHERE r.k = $1 AND r.expires_at > clock_timestamp()"
            ),
            complete: complete(t),
            release: release(t, &holder, window),
            renew: renew(t, &holder),
            commit_point: commit_point(t, &holder),
            mark_unknown: mark_unknown(t),
            mark_notified: format!(
                "UPDATE {t} SET notified = true
WHERE k = $1 AND state = {STATE_UNKNOWN} AND expires_at > clock_timestamp()"
            ),
            due: due(t),
            list_pending: list_pending(t),
            adopt: adopt(t),
            peek: format!(
                "WITH c AS (SELECT clock_timestamp() AS t)
SELECT {PENDING_COLUMNS} FROM {t} r, c
WHERE r.k = $1 AND r.expires_at > c.t AND {PENDING}"
            ),
            adopted_fingerprint: format!(
                "SELECT fingerprint FROM {t}
WHERE k = $1 AND adopt_token = $2 AND expires_at > clock_timestamp()"
            ),
            settle_complete: settle_complete(t),
            settle_release: settle_release(t, window),
            settle_later: settle_later(t),
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
    let mut alter = format!("ALTER TABLE {t}");
    for (i, (name, ty)) in ADDED_COLUMNS.iter().enumerate() {
        let sep = if i == 0 { "" } else { "," };
        alter.push_str(&format!(
            "{sep}\n    ADD COLUMN IF NOT EXISTS {name:<14} {ty}"
        ));
    }
    migration.push(alter);
    migration.push(format!(
        "CREATE INDEX IF NOT EXISTS {table}{PENDING_INDEX_SUFFIX} ON {t} (state, lease_until, next_pass)
    WHERE state IN ({STATE_IN_PROGRESS}, {STATE_UNKNOWN})"
    ));
    migration
}

/// `FROM` clause that reads the database's clock once, as `c.t`.
const NOW: &str = "FROM (SELECT clock_timestamp() AS t) c";

/// Stores a completed record. Also matches the same completion sent again (its reply
/// was lost): the row already completed with exactly this record, left as it is.
fn complete(t: &str) -> String {
    let now = NOW;
    format!(
        "UPDATE {t} SET state = {STATE_COMPLETED}, fingerprint = $3, token = NULL,
    commit_point = NULL, lease_until = NULL, record = $5, {CLEARED},
    expires_at = CASE WHEN state = {STATE_IN_PROGRESS}
                      THEN c.t + $4 * interval '1 microsecond' ELSE expires_at END
{now}
WHERE k = $1 AND expires_at > c.t
  AND ((state = {STATE_IN_PROGRESS} AND token = $2 AND {NOT_ADOPTED})
       OR (state = {STATE_COMPLETED} AND fingerprint = $3 AND record = $5))"
    )
}

/// Releases a claim. A released row is kept dead (absent to every reader, and replaced
/// by the next claim) with its token and no lease, for the resend window: the same
/// release sent again (its reply was lost) matches it.
fn release(t: &str, holder: &str, window: u64) -> String {
    let now = NOW;
    format!(
        "UPDATE {t} SET commit_point = NULL, lease_until = NULL, record = NULL, {CLEARED},
    expires_at = CASE WHEN lease_until IS NULL THEN expires_at ELSE c.t END
{now}
WHERE {holder}
  AND ((lease_until IS NOT NULL AND expires_at > c.t)
       OR (lease_until IS NULL AND expires_at > c.t - interval '{window} seconds'))"
    )
}

/// Renews a lease; the retention of an in-progress row (expires_at - lease_until) is
/// kept.
fn renew(t: &str, holder: &str) -> String {
    let now = NOW;
    format!(
        "UPDATE {t} SET lease_until = c.t + $3 * interval '1 microsecond',
    expires_at = c.t + $3 * interval '1 microsecond' + (expires_at - lease_until)
{now}
WHERE {holder} AND expires_at > c.t"
    )
}

/// Records the commit point, with its note if one is given.
fn commit_point(t: &str, holder: &str) -> String {
    let now = NOW;
    format!(
        "UPDATE {t} SET commit_point = 2, note = coalesce($3, note)
{now}
WHERE {holder} AND expires_at > c.t"
    )
}

/// Marks a claim `outcome_unknown`. The token stays on the unknown row, so that the same
/// mark sent again (its reply was lost) matches it and leaves it as it is.
fn mark_unknown(t: &str) -> String {
    let now = NOW;
    format!(
        "UPDATE {t} SET state = {STATE_UNKNOWN}, commit_point = NULL,
    lease_until = NULL, record = NULL,
    unknown_reason = CASE WHEN state = {STATE_IN_PROGRESS} THEN $4 ELSE unknown_reason END,
    notified = CASE WHEN state = {STATE_IN_PROGRESS} THEN false ELSE notified END,
    next_pass = CASE WHEN state = {STATE_IN_PROGRESS} THEN c.t ELSE next_pass END,
    expires_at = CASE WHEN state = {STATE_IN_PROGRESS}
                      THEN c.t + $3 * interval '1 microsecond' ELSE expires_at END
{now}
WHERE k = $1 AND token = $2 AND state IN ({STATE_IN_PROGRESS}, {STATE_UNKNOWN})
  AND expires_at > c.t AND {NOT_ADOPTED}"
    )
}

/// The claim, in one statement. An existing row `r` is replaced when it is dead (past
/// its retention: the key is new again) or when it is in progress, its lease has
/// expired and the fingerprint matches; then it is taken over if its holder had not
/// reached the commit point, and turned into outcome_unknown otherwise. Any other
/// existing row is left alone (but locked for the moment of the statement, as ON
/// CONFLICT DO UPDATE does) and returned from the statement's snapshot by the second
/// branch of the UNION.
fn claim(t: &str) -> String {
    let now = "(SELECT t FROM c)";
    let dead = format!("r.expires_at <= {now}");
    let fresh = format!("({dead} OR r.commit_point = 1)");
    let lease_expired = lease_expired();
    format!(
        "WITH c AS (SELECT clock_timestamp() AS t),
up AS (
    INSERT INTO {t} AS r
        (k, state, fingerprint, token, commit_point, lease_until, takeovers, expires_at, record,
         request, claimed_at)
    SELECT $1, {STATE_IN_PROGRESS}, $2, $3, $4,
           c.t + $5 * interval '1 microsecond', 0,
           c.t + ($5 + $6) * interval '1 microsecond', NULL, $7, c.t
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
                            ELSE {now} + $6 * interval '1 microsecond' END,
        record       = NULL,
        request      = CASE WHEN {fresh} THEN excluded.request ELSE r.request END,
        note         = CASE WHEN {fresh} THEN NULL ELSE r.note END,
        claimed_at   = CASE WHEN {fresh} THEN excluded.claimed_at ELSE r.claimed_at END,
        unknown_reason = CASE WHEN {fresh} THEN NULL ELSE {lease_expired} END,
        notified     = CASE WHEN {fresh} THEN NULL ELSE false END,
        next_pass    = CASE WHEN {fresh} THEN NULL ELSE {now} END,
        lease_ended  = CASE WHEN {fresh} THEN NULL ELSE r.lease_until END,
        adopt_token  = NULL,
        adopt_until  = NULL
    WHERE {dead}
       OR (r.state = {STATE_IN_PROGRESS} AND r.lease_until <= {now}
           AND r.fingerprint = excluded.fingerprint
           AND (r.adopt_until IS NULL OR r.adopt_until <= {now}))
    RETURNING r.takeovers, {RECORD_COLUMNS}
)
SELECT true AS mine, takeovers, state, fingerprint, token, commit_point, lease_ms, record, adopt_ms
FROM up
UNION ALL
SELECT false, r.takeovers, {RECORD_COLUMNS}
FROM {t} r, c
WHERE r.k = $1 AND r.expires_at > c.t AND NOT EXISTS (SELECT 1 FROM up)"
    )
}

/// The records that may be due, from the partial index on pending rows: claims whose
/// lease ended at least the stale time ago, and unknown outcomes whose next pass is due
/// (or was never set, by a release that did not know the column) — those made from a
/// claim whose lease ended, once the stale time has passed since it ended, as for the
/// claim; none adopted.
fn due(t: &str) -> String {
    format!(
        "WITH c AS (SELECT clock_timestamp() AS t)
SELECT k FROM {t}, c
WHERE state IN ({STATE_IN_PROGRESS}, {STATE_UNKNOWN}) AND expires_at > c.t AND {NOT_ADOPTED}
  AND ((state = {STATE_IN_PROGRESS} AND lease_until <= c.t - $1 * interval '1 microsecond')
       OR (state = {STATE_UNKNOWN} AND lease_until IS NULL
           AND (next_pass IS NULL OR next_pass <= c.t)
           AND (lease_ended IS NULL OR lease_ended <= c.t - $1 * interval '1 microsecond')))
LIMIT $2"
    )
}

/// Every pending record, due or not, adopted or not: claims whose lease ended and
/// unknown outcomes.
fn list_pending(t: &str) -> String {
    format!(
        "WITH c AS (SELECT clock_timestamp() AS t)
SELECT k FROM {t}, c
WHERE state IN ({STATE_IN_PROGRESS}, {STATE_UNKNOWN}) AND expires_at > c.t
  AND ((state = {STATE_IN_PROGRESS} AND lease_until <= c.t)
       OR (state = {STATE_UNKNOWN} AND lease_until IS NULL))
LIMIT $1"
    )
}

/// The adoption: only the adoption columns change, so that a lapsed adoption leaves the
/// record exactly as it was. It never outlasts the record's retention, so a row that
/// dies while adopted is never seen adopted by the claim that replaces it.
fn adopt(t: &str) -> String {
    format!(
        "WITH c AS (SELECT clock_timestamp() AS t)
UPDATE {t} r SET adopt_token = $2,
    adopt_until = least(c.t + $3 * interval '1 microsecond', r.expires_at)
FROM c
WHERE r.k = $1 AND r.expires_at > c.t AND {PENDING}
  AND (r.adopt_until IS NULL OR r.adopt_until <= c.t OR r.adopt_token = $2)
  AND ($4::bigint IS NULL
       OR (r.state = {STATE_UNKNOWN}
           AND (r.lease_ended IS NULL OR r.lease_ended <= c.t - $4 * interval '1 microsecond'))
       OR (r.state = {STATE_IN_PROGRESS} AND r.lease_until <= c.t - $4 * interval '1 microsecond'))
RETURNING {PENDING_COLUMNS}"
    )
}

/// Completes an adopted record. The same settlement sent again (its reply was lost)
/// matches the completed row, which keeps the adoption token, and leaves it as it is.
fn settle_complete(t: &str) -> String {
    format!(
        "UPDATE {t} SET state = {STATE_COMPLETED}, token = NULL, commit_point = NULL,
    lease_until = NULL, record = $5, {CLEARED}, adopt_until = NULL,
    expires_at = CASE WHEN adopt_until IS NULL THEN expires_at
                      ELSE c.t + $4 * interval '1 microsecond' END
FROM (SELECT clock_timestamp() AS t) c
WHERE k = $1 AND adopt_token = $2 AND fingerprint = $3 AND expires_at > c.t
  AND ({ADOPTED}
       OR (state = {STATE_COMPLETED} AND adopt_until IS NULL AND record = $5))"
    )
}

/// Releases an adopted record the way `release` does: the row is kept dead with the
/// adoption token for the resend window (`window` seconds), then swept.
fn settle_release(t: &str, window: u64) -> String {
    format!(
        "UPDATE {t} SET state = {STATE_IN_PROGRESS}, token = NULL, commit_point = NULL,
    lease_until = NULL, record = NULL, {CLEARED}, adopt_until = NULL,
    expires_at = CASE WHEN adopt_until IS NULL THEN expires_at ELSE c.t END
FROM (SELECT clock_timestamp() AS t) c
WHERE k = $1 AND adopt_token = $2
  AND ({ADOPTED}
       OR (state = {STATE_IN_PROGRESS} AND lease_until IS NULL AND adopt_until IS NULL
           AND expires_at > c.t - interval '{window} seconds'))"
    )
}

/// Leaves an adopted record for a later pass: a claim becomes outcome_unknown (its
/// expiry kept; its holder's token dropped, so the late holder is refused), due again
/// after the wait; the adoption ends. Sent again, it matches the unknown row that keeps
/// the adoption token, and leaves it as it is.
fn settle_later(t: &str) -> String {
    let lease_expired = lease_expired();
    format!(
        "UPDATE {t} SET state = {STATE_UNKNOWN}, token = NULL, commit_point = NULL,
    lease_until = NULL, record = NULL,
    unknown_reason = CASE WHEN adopt_until IS NULL THEN unknown_reason
                          ELSE coalesce(unknown_reason, {lease_expired}) END,
    notified = CASE WHEN adopt_until IS NULL THEN notified ELSE $4 END,
    next_pass = CASE WHEN adopt_until IS NULL THEN next_pass
                     ELSE c.t + $3 * interval '1 microsecond' END,
    lease_ended = CASE WHEN adopt_until IS NOT NULL AND state = {STATE_IN_PROGRESS}
                       THEN lease_until ELSE lease_ended END,
    adopt_until = NULL
FROM (SELECT clock_timestamp() AS t) c
WHERE k = $1 AND adopt_token = $2 AND expires_at > c.t
  AND ({ADOPTED} OR (state = {STATE_UNKNOWN} AND adopt_until IS NULL))"
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
ALTER TABLE retrysafe_idempotency
    ADD COLUMN IF NOT EXISTS request        bytea,
    ADD COLUMN IF NOT EXISTS note           bytea,
    ADD COLUMN IF NOT EXISTS unknown_reason integer,
    ADD COLUMN IF NOT EXISTS notified       boolean,
    ADD COLUMN IF NOT EXISTS adopt_token    bytea,
    ADD COLUMN IF NOT EXISTS adopt_until    timestamptz,
    ADD COLUMN IF NOT EXISTS next_pass      timestamptz,
    ADD COLUMN IF NOT EXISTS claimed_at     timestamptz,
    ADD COLUMN IF NOT EXISTS lease_ended    timestamptz;
CREATE INDEX IF NOT EXISTS retrysafe_idempotency_pending_idx ON retrysafe_idempotency (state, lease_until, next_pass)
    WHERE state IN (1, 3);
"
        );
        let docs: String = sql
            .migration_script()
            .lines()
            .map(|l| format!("//! {l}\n"))
            .collect();
        assert!(
            include_str!("lib.rs").contains(&docs),
            "the crate docs show the migration as it is"
        );
        for stmt in [
            &sql.claim,
            &sql.get,
            &sql.complete,
            &sql.release,
            &sql.renew,
            &sql.commit_point,
            &sql.mark_unknown,
            &sql.mark_notified,
            &sql.sweep,
            &sql.due,
            &sql.list_pending,
            &sql.adopt,
            &sql.peek,
            &sql.adopted_fingerprint,
            &sql.settle_complete,
            &sql.settle_release,
            &sql.settle_later,
        ] {
            assert!(!stmt.contains("now()"), "time only from clock_timestamp()");
        }
    }
}
