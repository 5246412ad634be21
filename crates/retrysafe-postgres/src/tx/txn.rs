//! [`LayerTx`]: the request's transaction on a pooled connection, safe to cancel.

use std::ops::{Deref, DerefMut};

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgConnection, PgQueryResult, PgRow, PgTransactionManager};
use sqlx::query::Query;
use sqlx::{Postgres, TransactionManager};

/// A transaction the layer began on a connection it checked out of the pool.
///
/// Like sqlx's `Transaction`, it rolls back when dropped uncommitted (the `ROLLBACK` is
/// queued and sent as the connection returns to the pool), and nested `begin`s on the
/// connection are savepoints. Unlike it, every step the layer awaits on it may be
/// cancelled (a deadline, a timeout): when it is dropped while one of them is on the
/// wire — a `BEGIN` sent whose answer was not read, say — the connection's state is not
/// known, so it is closed instead of returned to the pool (the server rolls back what a
/// closed connection had open). A connection is never handed to the next user inside a
/// transaction nobody knows about.
pub(crate) struct LayerTx {
    conn: PoolConnection<Postgres>,
    /// A step is on the wire.
    busy: bool,
}

impl LayerTx {
    /// Begins a transaction with `statement` (a `BEGIN …`, with `SET LOCAL`s: one
    /// simple query) on `conn`.
    pub(crate) async fn begin(
        conn: PoolConnection<Postgres>,
        statement: String,
    ) -> Result<Self, sqlx::Error> {
        let mut tx = LayerTx { conn, busy: true };
        PgTransactionManager::begin(&mut tx.conn, Some(statement.into())).await?;
        tx.busy = false;
        Ok(tx)
    }

    /// Runs `query` in the transaction and returns its one row.
    pub(crate) async fn fetch_one(
        &mut self,
        query: Query<'_, Postgres, PgArguments>,
    ) -> Result<PgRow, sqlx::Error> {
        self.busy = true;
        let row = query.fetch_one(&mut *self.conn).await;
        self.busy = false;
        row
    }

    /// Runs `query` in the transaction.
    pub(crate) async fn execute(
        &mut self,
        query: Query<'_, Postgres, PgArguments>,
    ) -> Result<PgQueryResult, sqlx::Error> {
        self.busy = true;
        let done = query.execute(&mut *self.conn).await;
        self.busy = false;
        done
    }

    /// Commits. On failure the transaction is dropped: rolled back.
    pub(crate) async fn commit(mut self) -> Result<(), sqlx::Error> {
        self.busy = true;
        PgTransactionManager::commit(&mut self.conn).await?;
        self.busy = false;
        Ok(())
    }

    /// Rolls back.
    pub(crate) async fn rollback(mut self) -> Result<(), sqlx::Error> {
        self.busy = true;
        PgTransactionManager::rollback(&mut self.conn).await?;
        self.busy = false;
        Ok(())
    }
}

impl Deref for LayerTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.conn
    }
}

impl DerefMut for LayerTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}

impl Drop for LayerTx {
    fn drop(&mut self) {
        if self.busy {
            self.conn.close_on_drop();
        } else {
            // A no-op when the transaction has ended.
            PgTransactionManager::start_rollback(&mut self.conn);
        }
    }
}
