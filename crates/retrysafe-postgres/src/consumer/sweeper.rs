//! The sweeper of a consumer's processed ids: deletes those past the retention, on a
//! task of its own.

use std::time::Duration;

use retrysafe_core::store::StoreError;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::store::{db_error, micros};

/// Ids deleted per statement: a sweep deletes in batches, so that no statement holds
/// many row locks or runs long.
const BATCH: i64 = 1_000;

/// What a sweep needs of a [`Consumer`](super::Consumer), owned, for its task.
#[derive(Debug, Clone)]
pub(super) struct Sweep {
    pub(super) pool: PgPool,
    /// `$1 consumer, $2 retention µs, $3 batch`.
    pub(super) sql: String,
    pub(super) name: String,
    pub(super) retention: Duration,
}

impl Sweep {
    /// The delete statement of table `t`.
    pub(super) fn statement(t: &str) -> String {
        format!(
            "DELETE FROM {t} WHERE ctid IN (
                 SELECT ctid FROM {t}
                 WHERE consumer = $1 AND seen_at < clock_timestamp() - make_interval(secs => $2::float8 / 1e6)
                 LIMIT $3 FOR UPDATE SKIP LOCKED)"
        )
    }

    /// Deletes up to `batch` ids older than the retention; returns how many.
    pub(super) async fn once(&self, batch: i64) -> Result<u64, StoreError> {
        let done = sqlx::query(&self.sql)
            .bind(&self.name)
            .bind(micros(self.retention))
            .bind(batch)
            .execute(&self.pool)
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected())
    }

    /// Deletes every id past the retention, a batch at a time.
    async fn all(&self) -> Result<u64, StoreError> {
        let mut deleted = 0;
        loop {
            let n = self.once(BATCH).await?;
            deleted += n;
            if n < BATCH.unsigned_abs() {
                return Ok(deleted);
            }
        }
    }

    /// Sweeps every `every` until stopped. A dropped handle leaves it running.
    pub(super) fn spawn(self, every: Duration) -> SweeperHandle {
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            while !*stopped.borrow() {
                if let Err(e) = self.all().await {
                    tracing::warn!(target: "retrysafe::consumer", consumer = self.name.as_str(), error = %e, "processed-id sweep failed");
                }
                if let Ok(Err(_)) = tokio::time::timeout(every, stopped.changed()).await {
                    // The handle is gone: nobody can stop the sweeper any more, and it
                    // keeps its pace.
                    tokio::time::sleep(every).await;
                }
            }
        });
        SweeperHandle { stop, task }
    }
}

/// The handle of a consumer's sweeper ([`Consumer::spawn_sweeper`](super::Consumer::spawn_sweeper)).
/// Dropping it leaves the sweeper running.
#[derive(Debug)]
pub struct SweeperHandle {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl SweeperHandle {
    /// Stops the sweeper after its current sweep and waits for it.
    pub async fn stop(self) {
        self.stop.send_replace(true);
        let _ = self.task.await;
    }

    /// Whether the sweeper's task has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}
