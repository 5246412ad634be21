//! [`IdempotentTx::enqueue`]: an outbox entry in the request's transaction.

use std::sync::atomic::Ordering;

use retrysafe_core::idempotency::Token;
use retrysafe_core::store::StoreError;
use retrysafe_core::wire::IdempotencyKey;

use super::{Outbox, Outgoing};
use crate::tx::IdempotentTx;

/// The label of the `n`th entry a request enqueues, for its child key.
fn label(n: u32) -> String {
    format!("retrysafe-outbox/{n}")
}

impl IdempotentTx {
    /// Writes `outgoing` (an `http::Request<Bytes>` or a
    /// [`Message`](crate::outbox::Message)) into the default outbox table
    /// (`retrysafe_outbox`) in this request's transaction: it is sent by an
    /// [`OutboxRelay`](crate::outbox::OutboxRelay) once, and only if, the transaction
    /// commits. Returns the row's id.
    ///
    /// Its key (`Idempotency-Key`, or the message id) is the child key
    /// `retrysafe-outbox/N` of the request's record, N counting the entries this request
    /// enqueued: the same on every send of the row, and derived from the inbound key,
    /// so a downstream deduplicates it. A request without a key gets a random one,
    /// stored with the row.
    ///
    /// ```no_run
    /// use bytes::Bytes;
    /// use retrysafe::postgres::outbox::Message;
    /// use retrysafe::postgres::tx::IdempotentTx;
    ///
    /// async fn handler(mut tx: IdempotentTx) -> Result<&'static str, String> {
    ///     let call = http::Request::post("http://ledger.internal/entries")
    ///         .body(Bytes::from_static(b"{}"))
    ///         .map_err(|e| e.to_string())?;
    ///     let first = tx.enqueue(call).await.map_err(|e| e.to_string())?;
    ///     let second = tx
    ///         .enqueue(Message::new("", "orders", "created"))
    ///         .await
    ///         .map_err(|e| e.to_string())?;
    ///     assert!(second > first);
    ///     Ok("ok")
    /// }
    /// ```
    pub async fn enqueue(&mut self, outgoing: impl Into<Outgoing>) -> Result<i64, StoreError> {
        self.enqueue_into(&Outbox::new(), outgoing).await
    }

    /// [`enqueue`](Self::enqueue) into the table of `outbox`.
    pub async fn enqueue_into(
        &mut self,
        outbox: &Outbox,
        outgoing: impl Into<Outgoing>,
    ) -> Result<i64, StoreError> {
        let n = self.enqueued.fetch_add(1, Ordering::Relaxed);
        let key = match &self.context {
            Some(context) => context.child_key(&label(n)),
            None => {
                IdempotencyKey::new(&Token::random().to_hex()).map_err(StoreError::unavailable)?
            }
        };
        outbox.enqueue(&mut *self, &key, outgoing).await
    }
}
