//! [`ReconcilableStore`] for [`PostgresStore`]: the pending records of the table, their
//! adoption by a reconciler, and their settlement.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use retrysafe_core::idempotency::{
    Completed, DecodeError, Fingerprint, Record, RecordId, RequestInfo, Token, UnknownReason,
};
use retrysafe_core::recovery::{PendingRecord, PendingState, ReconcilableStore, Settlement};
use retrysafe_core::store::StoreError;
use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::sql::{STATE_IN_PROGRESS, STATE_UNKNOWN};
use crate::store::{PostgresStore, commit_point_from_code, db_error, exact, micros};

/// The reconciler's side of the store. Each call is one statement, except a completing
/// settlement: it first reads the adopted record's fingerprint, which no one else can
/// change while the adoption lasts.
impl ReconcilableStore for PostgresStore {
    async fn due(&self, stale: Duration, limit: usize) -> Result<Vec<RecordId>, StoreError> {
        self.call(async {
            let rows: Vec<Vec<u8>> = sqlx::query_scalar(&self.sql().due)
                .bind(micros(stale))
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .fetch_all(self.pool())
                .await
                .map_err(db_error)?;
            rows.into_iter()
                .map(|k| exact(k, "key").map(RecordId::from_bytes))
                .collect()
        })
        .await
    }

    async fn list_pending(&self, limit: usize) -> Result<Vec<RecordId>, StoreError> {
        self.call(async {
            let rows: Vec<Vec<u8>> = sqlx::query_scalar(&self.sql().list_pending)
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .fetch_all(self.pool())
                .await
                .map_err(db_error)?;
            rows.into_iter()
                .map(|k| exact(k, "key").map(RecordId::from_bytes))
                .collect()
        })
        .await
    }

    async fn adopt(
        &self,
        id: &RecordId,
        token: Token,
        hold: Duration,
        stale: Option<Duration>,
    ) -> Result<Option<PendingRecord>, StoreError> {
        self.call(async {
            let query = sqlx::query(&self.sql().adopt)
                .bind(&id.as_bytes()[..])
                .bind(token.to_bytes().to_vec())
                .bind(micros(hold))
                .bind(stale.map(micros));
            let row = self.write_returning(query).await.map_err(db_error)?;
            row.map(|row| pending_from_row(*id, &row)).transpose()
        })
        .await
    }

    async fn peek(&self, id: &RecordId) -> Result<Option<PendingRecord>, StoreError> {
        self.call(async {
            let row = sqlx::query(&self.sql().peek)
                .bind(&id.as_bytes()[..])
                .fetch_optional(self.pool())
                .await
                .map_err(db_error)?;
            row.map(|row| pending_from_row(*id, &row)).transpose()
        })
        .await
    }

    async fn settle(
        &self,
        id: &RecordId,
        token: Token,
        settlement: Settlement,
        notified: bool,
    ) -> Result<(), StoreError> {
        let sql = self.sql();
        let k = &id.as_bytes()[..];
        let token = token.to_bytes();
        match settlement {
            Settlement::Complete {
                response,
                retention,
            } => {
                let fingerprint = self.adopted_fingerprint(id, token).await?;
                let blob = Record::Completed(Completed::new(fingerprint, Some(response))).encode();
                self.change(
                    sqlx::query(&sql.settle_complete)
                        .bind(k)
                        .bind(&token[..])
                        .bind(&fingerprint.as_bytes()[..])
                        .bind(micros(retention))
                        .bind(&blob[..]),
                )
                .await
            }
            Settlement::Release => {
                self.change(sqlx::query(&sql.settle_release).bind(k).bind(&token[..]))
                    .await
            }
            Settlement::Later { after } => {
                self.change(
                    sqlx::query(&sql.settle_later)
                        .bind(k)
                        .bind(&token[..])
                        .bind(micros(after))
                        .bind(notified),
                )
                .await
            }
            // A settlement this release does not know: leave the record to its
            // adoption's end, as an unknown resolution would.
            _ => Err(StoreError::unavailable("unsupported settlement")),
        }
    }

    fn set_reconciled(&self, running: bool) {
        self.reconcilers().set(running);
    }
}

impl PostgresStore {
    /// The fingerprint of the record `token` adopted (or completed with a settlement):
    /// [`StoreError::StaleToken`] if there is none.
    async fn adopted_fingerprint(
        &self,
        id: &RecordId,
        token: [u8; 16],
    ) -> Result<Fingerprint, StoreError> {
        self.call(async {
            let fingerprint: Option<Vec<u8>> = sqlx::query_scalar(&self.sql().adopted_fingerprint)
                .bind(&id.as_bytes()[..])
                .bind(&token[..])
                .fetch_optional(self.pool())
                .await
                .map_err(db_error)?;
            let fingerprint = fingerprint.ok_or(StoreError::StaleToken)?;
            Ok(Fingerprint::from_bytes(exact(fingerprint, "fingerprint")?))
        })
        .await
    }
}

/// Reads a pending record (`state, fingerprint, commit_point, request, note,
/// unknown_reason, notified, age_us`). Total: a row that does not describe one is
/// [`StoreError::Corrupt`]; request information that does not decode (written by a
/// later release) is left out rather than failing the record.
fn pending_from_row(record: RecordId, row: &PgRow) -> Result<PendingRecord, StoreError> {
    let get = |e| db_error(e);
    let state: i16 = row.try_get("state").map_err(get)?;
    let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(get)?;
    let fingerprint = Fingerprint::from_bytes(exact(fingerprint, "fingerprint")?);
    let state = match state {
        STATE_IN_PROGRESS => {
            let code: Option<i16> = row.try_get("commit_point").map_err(get)?;
            let commit_point = code
                .ok_or(DecodeError::Invalid("commit point"))
                .and_then(commit_point_from_code)
                .map_err(StoreError::Corrupt)?;
            PendingState::Claim { commit_point }
        }
        STATE_UNKNOWN => {
            let code: Option<i32> = row.try_get("unknown_reason").map_err(get)?;
            let reason = code
                .and_then(|c| u16::try_from(c).ok())
                .and_then(UnknownReason::from_code);
            PendingState::Unknown { reason }
        }
        _ => return Err(StoreError::Corrupt(DecodeError::Invalid("state"))),
    };
    let request: Option<Vec<u8>> = row.try_get("request").map_err(get)?;
    let request = request
        .and_then(|b| RequestInfo::decode(Bytes::from(b)).ok())
        .map(Arc::new);
    let note: Option<Vec<u8>> = row.try_get("note").map_err(get)?;
    let notified: bool = row.try_get("notified").map_err(get)?;
    let age_us: i64 = row.try_get("age_us").map_err(get)?;
    let age = Duration::from_micros(u64::try_from(age_us).unwrap_or(0));
    Ok(PendingRecord::new(record, state, fingerprint).with_details(
        request,
        note.map(Bytes::from),
        age,
        notified,
    ))
}
