//! The SQL of the transactional layer, rendered once per table, on the store's table
//! and row format (see [`crate::sql`]).

use std::time::Duration;

use retrysafe_core::idempotency::RecordId;

use crate::SynchronousCommit;
use crate::sql::{RECORD_COLUMNS, STATE_IN_PROGRESS, Sql};

/// The statements of one table: the store's (for the completion, shared with
/// `PostgresStore::complete`), and the two of the transactional layer.
#[derive(Debug)]
pub(crate) struct TxSql {
    /// The store's statements of this table.
    pub(crate) store: Sql,
    /// A 64-bit hash of the qualified table name, mixed into the advisory-lock key so
    /// that the same record key in two tables takes two locks.
    pub(crate) table_salt: i64,
    /// The key statement, run inside the transaction:
    /// `$1 k, $2 fingerprint, $3 token, $4 lease µs, $5 retention µs, $6 lock key`.
    ///
    /// Tries the transaction-scoped advisory lock; only when it was taken, inserts the
    /// key row `in_progress` (replacing a row past its retention). Returns one row:
    /// `locked`, then `mine` and the record columns of the inserted row, or of the
    /// existing live row the statement's snapshot sees (a completed record is replayed
    /// even when the lock is busy), or NULLs when there is none.
    ///
    /// When the lock is busy the key row is never touched, so the statement cannot park
    /// on a row another transaction has inserted and not committed yet.
    pub(crate) claim: String,
    /// The wait-mode probe, one short autocommit read: `$1 k, $2 lock key`. Returns `free` (whether the advisory lock could be taken at that moment; it
    /// is released at once, with the statement's implicit transaction) and the record
    /// columns of the live row, or NULLs.
    pub(crate) probe: String,
}

impl TxSql {
    /// Renders the statements of `table` in `schema` (both already validated).
    pub(crate) fn new(schema: Option<&str>, table: &str) -> Self {
        let store = Sql::new(schema, table);
        let t = &store.table;
        let claim = format!(
            "WITH c AS (SELECT clock_timestamp() AS t),
l AS (SELECT pg_try_advisory_xact_lock($6::int8) AS locked),
up AS (
    INSERT INTO {t} AS r
        (k, state, fingerprint, token, commit_point, lease_until, takeovers, expires_at, record)
    SELECT $1, {STATE_IN_PROGRESS}, $2, $3, 0,
           c.t + $4 * interval '1 microsecond', 0,
           c.t + ($4 + $5) * interval '1 microsecond', NULL
    FROM c, l
    WHERE l.locked
    ON CONFLICT (k) DO UPDATE SET
        state        = excluded.state,
        fingerprint  = excluded.fingerprint,
        token        = excluded.token,
        commit_point = excluded.commit_point,
        lease_until  = excluded.lease_until,
        takeovers    = 0,
        expires_at   = excluded.expires_at,
        record       = NULL,
        request      = NULL,
        note         = NULL,
        unknown_reason = NULL,
        notified     = NULL,
        adopt_token  = NULL,
        adopt_until  = NULL,
        next_pass    = NULL,
        claimed_at   = NULL
    WHERE r.expires_at <= (SELECT t FROM c)
    RETURNING {RECORD_COLUMNS}
)
SELECT l.locked, x.mine, x.state, x.fingerprint, x.token, x.commit_point, x.lease_ms, x.record,
       x.adopt_ms
FROM l LEFT JOIN (
    SELECT true AS mine, state, fingerprint, token, commit_point, lease_ms, record, adopt_ms
    FROM up
    UNION ALL
    SELECT false, {RECORD_COLUMNS}
    FROM {t} r, c
    WHERE r.k = $1 AND r.expires_at > c.t AND NOT EXISTS (SELECT 1 FROM up)
) x ON true"
        );
        let probe = format!(
            "SELECT pg_try_advisory_xact_lock($2::int8) AS free,
       x.state, x.fingerprint, x.token, x.commit_point, x.lease_ms, x.record, x.adopt_ms
FROM (SELECT 1) one LEFT JOIN (
    SELECT {RECORD_COLUMNS} FROM {t} r WHERE r.k = $1 AND r.expires_at > clock_timestamp()
) x ON true"
        );
        TxSql {
            table_salt: fnv1a(t.as_bytes()),
            store,
            claim,
            probe,
        }
    }
}

/// The `BEGIN` of every transaction, with its `SET LOCAL`s, sent as one simple query
/// (one round trip).
pub(crate) fn begin(idle_in_transaction: Duration, level: Option<SynchronousCommit>) -> String {
    // Whole milliseconds, at least 1 (0 would disable the timeout).
    let ms = idle_in_transaction.as_millis().clamp(1, i32::MAX as u128);
    let mut begin = format!(
        "BEGIN ISOLATION LEVEL READ COMMITTED; \
         SET LOCAL idle_in_transaction_session_timeout = {ms}"
    );
    if let Some(level) = level {
        begin.push_str(&format!("; SET LOCAL synchronous_commit = {level}"));
    }
    begin
}

/// The key of a record's advisory lock (`pg_try_advisory_xact_lock(bigint)`): the first
/// 64 bits of the record key, mixed with the table's salt. (The bigint key space and the
/// two-int one do not overlap.)
pub(crate) fn lock_key(id: &RecordId, table_salt: i64) -> i64 {
    let [a, b, c, d, e, f, g, h, ..] = *id.as_bytes();
    i64::from_be_bytes([a, b, c, d, e, f, g, h]) ^ table_salt
}

/// 64-bit FNV-1a, as a signed int (a stable hash of a table name).
fn fnv1a(bytes: &[u8]) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    i64::from_be_bytes(h.to_be_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_use_the_store_table() {
        let sql = TxSql::new(Some("app"), "keys");
        assert!(sql.claim.contains("INSERT INTO app.keys AS r"));
        assert!(sql.claim.contains("pg_try_advisory_xact_lock"));
        assert!(sql.probe.contains("FROM app.keys r"));
        assert!(sql.store.complete.contains("UPDATE app.keys"));
        for stmt in [&sql.claim, &sql.probe] {
            assert!(!stmt.contains("now()"), "time only from clock_timestamp()");
        }
    }

    #[test]
    fn lock_keys_differ_by_table() {
        let id = RecordId::from_bytes([7; 32]);
        let a = TxSql::new(None, "a");
        let b = TxSql::new(None, "b");
        assert_ne!(lock_key(&id, a.table_salt), lock_key(&id, b.table_salt));
        assert_eq!(
            lock_key(&id, a.table_salt),
            lock_key(&id, TxSql::new(None, "a").table_salt)
        );
    }

    #[test]
    fn begin_sets_the_idle_timeout_in_whole_milliseconds() {
        assert_eq!(
            begin(Duration::from_millis(2500), None),
            "BEGIN ISOLATION LEVEL READ COMMITTED; \
             SET LOCAL idle_in_transaction_session_timeout = 2500"
        );
        assert!(begin(Duration::from_micros(10), None).ends_with("= 1"));
        assert!(begin(Duration::MAX, None).ends_with(&format!("= {}", i32::MAX)));
        assert!(
            begin(Duration::from_secs(1), Some(SynchronousCommit::RemoteApply))
                .ends_with("= 1000; SET LOCAL synchronous_commit = remote_apply")
        );
    }
}
