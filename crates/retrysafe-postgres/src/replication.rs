//! Standbys and failover: the `synchronous_commit` level of the store's sessions, and
//! the check of the server's replication settings made on connect.

use std::fmt;

use sqlx::Row;
use sqlx::postgres::PgPool;

use crate::PostgresStore;

/// The `synchronous_commit` level of the store's sessions (see
/// [`PostgresStoreOptions::synchronous_commit`](crate::PostgresStoreOptions::synchronous_commit)).
///
/// With a synchronous standby configured on the server (`synchronous_standby_names`),
/// a level from [`On`](Self::On) up makes each store write wait, before its
/// acknowledgement, until the standby has it: [`RemoteApply`](Self::RemoteApply) until
/// the standby has applied it, so a copy of the request that reaches the standby
/// once it is promoted sees every acknowledged claim and completion. Without a
/// synchronous standby no level waits for one.
///
/// ```
/// use retrysafe::postgres::SynchronousCommit;
/// assert_eq!(SynchronousCommit::RemoteApply.as_str(), "remote_apply");
/// assert!(SynchronousCommit::On.waits_for_standby());
/// assert!(!SynchronousCommit::Local.waits_for_standby());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SynchronousCommit {
    /// `off`: not even the local flush is waited for.
    Off,
    /// `local`: the local flush only.
    Local,
    /// `remote_write`: the standby has written it (not flushed).
    RemoteWrite,
    /// `on`: the standby has flushed it.
    On,
    /// `remote_apply`: the standby has applied it (visible to reads there).
    RemoteApply,
}

impl SynchronousCommit {
    /// The setting's value, as PostgreSQL spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            SynchronousCommit::Off => "off",
            SynchronousCommit::Local => "local",
            SynchronousCommit::RemoteWrite => "remote_write",
            SynchronousCommit::On => "on",
            SynchronousCommit::RemoteApply => "remote_apply",
        }
    }

    /// Whether a commit at this level waits for a synchronous standby (when one is
    /// configured).
    #[doc(hidden)]
    pub fn waits_for_standby(self) -> bool {
        matches!(
            self,
            SynchronousCommit::RemoteWrite | SynchronousCommit::On | SynchronousCommit::RemoteApply
        )
    }

    fn parse(value: &str) -> Option<Self> {
        Some(match value.trim() {
            "off" | "false" | "no" | "0" => SynchronousCommit::Off,
            "local" => SynchronousCommit::Local,
            "remote_write" => SynchronousCommit::RemoteWrite,
            "on" | "true" | "yes" | "1" => SynchronousCommit::On,
            "remote_apply" => SynchronousCommit::RemoteApply,
            _ => return None,
        })
    }
}

impl fmt::Display for SynchronousCommit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What [`PostgresStore::check_replication`] found, from the store's own session.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplicationReport {
    /// The session's `synchronous_commit`; `None` if unreadable.
    pub synchronous_commit: Option<SynchronousCommit>,
    /// The server's `synchronous_standby_names` (empty: no synchronous standby).
    pub synchronous_standby_names: String,
    /// Standbys streaming from this server now, synchronous or not
    /// (`pg_stat_replication`, which needs `pg_monitor` to see them all).
    pub standbys: u64,
    /// Of them, those the server waits for (`sync_state` `sync` or `quorum`).
    pub synchronous_standbys: u64,
}

impl ReplicationReport {
    /// Whether the store's writes wait for a synchronous standby: a level from `on`
    /// up and a synchronous standby named. Then a promoted synchronous standby has
    /// every write the store acknowledged.
    pub fn survives_promotion(&self) -> bool {
        self.synchronous_commit
            .is_some_and(SynchronousCommit::waits_for_standby)
            && !self.synchronous_standby_names.trim().is_empty()
    }
}

impl PostgresStore {
    /// Reads the replication settings that decide what survives the promotion of a
    /// standby (one round trip): the session's `synchronous_commit`, the server's
    /// `synchronous_standby_names`, and the standbys streaming from it.
    ///
    /// [`PostgresStoreOptions::connect`](crate::PostgresStoreOptions::connect) runs it
    /// and logs a warning (never a refusal) when standbys stream asynchronously, or
    /// when a synchronous level was asked for but no synchronous standby is named: an
    /// acknowledged claim or completion can then be missing on a promoted standby, and
    /// a copy of its request run again there.
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
    /// use retrysafe::postgres::{PostgresStore, SynchronousCommit};
    /// let store = PostgresStore::options()
    ///     .synchronous_commit(SynchronousCommit::RemoteApply)
    ///     .connect("postgres://postgres@127.0.0.1:5432/test")
    ///     .await?;
    /// let report = store.check_replication().await?;
    /// assert_eq!(report.synchronous_commit, Some(SynchronousCommit::RemoteApply));
    /// # Ok(()) }
    /// ```
    pub async fn check_replication(&self) -> Result<ReplicationReport, sqlx::Error> {
        check(self.pool()).await
    }
}

async fn check(pool: &PgPool) -> Result<ReplicationReport, sqlx::Error> {
    let row = sqlx::query(
        "SELECT current_setting('synchronous_commit') AS level, \
                current_setting('synchronous_standby_names') AS names, \
                (SELECT count(*) FROM pg_stat_replication) AS standbys, \
                (SELECT count(*) FROM pg_stat_replication \
                  WHERE sync_state IN ('sync', 'quorum')) AS sync",
    )
    .fetch_one(pool)
    .await?;
    let level: String = row.try_get("level")?;
    let standbys: i64 = row.try_get("standbys")?;
    let sync: i64 = row.try_get("sync")?;
    Ok(ReplicationReport {
        synchronous_commit: SynchronousCommit::parse(&level),
        synchronous_standby_names: row.try_get("names")?,
        standbys: u64::try_from(standbys).unwrap_or_default(),
        synchronous_standbys: u64::try_from(sync).unwrap_or_default(),
    })
}

/// The check run on connect: warnings only.
pub(crate) async fn warn_on_connect(store: &PostgresStore, asked: Option<SynchronousCommit>) {
    let report = match store.check_replication().await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(
                target: "retrysafe::postgres",
                error = %e,
                "could not read the replication settings"
            );
            return;
        }
    };
    if asked.is_some_and(SynchronousCommit::waits_for_standby) && !report.survives_promotion() {
        tracing::warn!(
            target: "retrysafe::postgres",
            synchronous_commit = ?report.synchronous_commit,
            "a synchronous commit level was asked for but synchronous_standby_names is \
             empty: writes wait for no standby, and a promoted standby may miss \
             acknowledged claims and completions"
        );
    } else if report.standbys > report.synchronous_standbys && !report.survives_promotion() {
        tracing::warn!(
            target: "retrysafe::postgres",
            standbys = report.standbys,
            "standbys replicate asynchronously: a promoted standby may miss acknowledged \
             claims and completions (a copy of such a request would run again); name a \
             synchronous standby and use PostgresStoreOptions::synchronous_commit"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_round_trip() {
        for level in [
            SynchronousCommit::Off,
            SynchronousCommit::Local,
            SynchronousCommit::RemoteWrite,
            SynchronousCommit::On,
            SynchronousCommit::RemoteApply,
        ] {
            assert_eq!(SynchronousCommit::parse(level.as_str()), Some(level));
        }
        assert_eq!(SynchronousCommit::parse("bogus"), None);
    }

    #[test]
    fn survives_promotion_needs_a_level_and_a_name() {
        let mut r = ReplicationReport {
            synchronous_commit: Some(SynchronousCommit::RemoteApply),
            synchronous_standby_names: String::new(),
            standbys: 1,
            synchronous_standbys: 0,
        };
        assert!(!r.survives_promotion());
        r.synchronous_standby_names = "*".to_owned();
        assert!(r.survives_promotion());
        r.synchronous_commit = Some(SynchronousCommit::Local);
        assert!(!r.survives_promotion());
    }
}
