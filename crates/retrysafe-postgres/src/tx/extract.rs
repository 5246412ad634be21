//! [`IdempotentTx`]: the handler's guard on the request's transaction.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use http::Extensions;
use retrysafe_core::idempotency::IdempotencyContext;
use retrysafe_tower::idempotency::{Problem, ProblemKind};
use sqlx::postgres::PgConnection;
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};

use super::txn::LayerTx;

/// The request's transaction, in a slot the layer shares with the handler's guard.
///
/// A request extension (private type: only the layer can put one there). The guard
/// locks the slot for as long as it lives; the layer takes the transaction back out
/// after the handler, which only succeeds when no guard is alive.
/// It also counts the entries the request enqueued, so each gets its own child key.
#[derive(Clone)]
pub(crate) struct TxSlot(Arc<Mutex<Option<LayerTx>>>, Arc<AtomicU32>);

impl TxSlot {
    pub(crate) fn new(tx: LayerTx) -> Self {
        TxSlot(Arc::new(Mutex::new(Some(tx))), Arc::default())
    }

    /// Takes the transaction back. `None` when a guard is still alive (the handler
    /// leaked or kept it): the transaction then stays with the guard and rolls back
    /// when the guard is dropped, or when the server ends the idle session.
    pub(crate) fn reclaim(&self) -> Option<LayerTx> {
        self.0.try_lock().ok().and_then(|mut slot| slot.take())
    }
}

/// The connection of the request's transaction, for the handler: an axum extractor (and
/// [`IdempotentTx::from_extensions`] for other tower services) that the
/// [`TxIdempotencyLayer`](super::TxIdempotencyLayer) provides to every request it runs
/// in a transaction.
///
/// It dereferences to the [`PgConnection`], so `&mut *tx` is an sqlx executor:
///
/// ```no_run
/// use retrysafe::postgres::tx::IdempotentTx;
///
/// async fn pay(mut tx: IdempotentTx) -> Result<&'static str, String> {
///     sqlx::query("INSERT INTO payments (account, amount_cents) VALUES ($1, $2)")
///         .bind("acc-1")
///         .bind(500_i64)
///         .execute(&mut *tx)
///         .await
///         .map_err(|e| e.to_string())?;
///     Ok("paid")
/// }
/// # use retrysafe::postgres::sqlx;
/// ```
///
/// It is a guard, not the transaction: it has no `commit` or `rollback` (the layer
/// commits once, after the handler, with the key row; a nested
/// [`begin`](sqlx::Connection::begin) on it is a savepoint), and it cannot be kept: the
/// layer takes the transaction back when the handler has answered. A guard still alive
/// then — moved into a spawned task, stored somewhere — makes the layer roll back and
/// answer a 500 `transaction-leaked` problem; its connection stays unusable for anything
/// but statements that are rolled back, until it is dropped.
///
/// Do not run `COMMIT` or `ROLLBACK` as SQL through it: the guarantee that the key and
/// the effect commit together rests on the layer's single commit.
pub struct IdempotentTx {
    guard: OwnedMappedMutexGuard<Option<LayerTx>, LayerTx>,
    /// The record guarding the request (none for a request without a key).
    pub(crate) context: Option<IdempotencyContext>,
    /// Entries enqueued by this request so far.
    pub(crate) enqueued: Arc<AtomicU32>,
}

impl IdempotentTx {
    /// The guard on the transaction of a request whose extensions the layer filled
    /// (for tower services that are not axum handlers). Fails when there is none (the
    /// request is not behind the layer or not run in a transaction), when another guard
    /// on it is alive, or when the layer has taken it back.
    pub fn from_extensions(extensions: &Extensions) -> Result<Self, IdempotentTxRejection> {
        let slot = extensions
            .get::<TxSlot>()
            .ok_or(IdempotentTxRejection::Missing)?;
        let locked: OwnedMutexGuard<_> = Arc::clone(&slot.0)
            .try_lock_owned()
            .map_err(|_| IdempotentTxRejection::InUse)?;
        let guard = OwnedMutexGuard::try_map(locked, Option::as_mut)
            .map_err(|_| IdempotentTxRejection::Finished)?;
        Ok(IdempotentTx {
            guard,
            context: extensions.get::<IdempotencyContext>().cloned(),
            enqueued: Arc::clone(&slot.1),
        })
    }
}

impl Deref for IdempotentTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.guard
    }
}

impl DerefMut for IdempotentTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.guard
    }
}

impl fmt::Debug for IdempotentTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentTx").finish_non_exhaustive()
    }
}

/// Why a handler could not get its [`IdempotentTx`]. As a response: a 500
/// `application/problem+json` answer of kind
/// [`TransactionMissing`](ProblemKind::TransactionMissing) — a configuration or
/// programming error, not the client's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum IdempotentTxRejection {
    /// The request has no transaction: the route is not behind a
    /// [`TxIdempotencyLayer`](super::TxIdempotencyLayer), or the layer let the request
    /// pass untouched (a method it does not guard, or gRPC).
    Missing,
    /// Another guard on this request's transaction is alive.
    InUse,
    /// The layer has already taken the transaction back (the handler answered).
    Finished,
}

impl IdempotentTxRejection {
    /// The problem this rejection answers with.
    pub fn problem(self) -> Problem {
        Problem::new(ProblemKind::TransactionMissing, self.detail())
    }

    fn detail(self) -> &'static str {
        match self {
            IdempotentTxRejection::Missing => {
                "the request has no transaction: the route is not behind a TxIdempotencyLayer, \
                 or the layer does not run this request in a transaction"
            }
            IdempotentTxRejection::InUse => "the request's transaction is already in use",
            IdempotentTxRejection::Finished => "the request's transaction has finished",
        }
    }
}

impl fmt::Display for IdempotentTxRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.detail())
    }
}

impl std::error::Error for IdempotentTxRejection {}

#[cfg(feature = "axum")]
mod axum_impls {
    use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
    use axum_core::response::{IntoResponse, Response};
    use http::request::Parts;

    use super::{IdempotentTx, IdempotentTxRejection, TxSlot};

    impl<S: Send + Sync> FromRequestParts<S> for IdempotentTx {
        type Rejection = IdempotentTxRejection;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Self, Self::Rejection> {
            IdempotentTx::from_extensions(&parts.extensions)
        }
    }

    /// `Option<IdempotentTx>`: `None` for a request the layer does not run in a
    /// transaction (for handlers that also serve routes without the layer).
    impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotentTx {
        type Rejection = IdempotentTxRejection;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            if parts.extensions.get::<TxSlot>().is_none() {
                return Ok(None);
            }
            IdempotentTx::from_extensions(&parts.extensions).map(Some)
        }
    }

    impl IntoResponse for IdempotentTxRejection {
        fn into_response(self) -> Response {
            let problem = self.problem();
            let (mut parts, body) = problem.to_response().into_parts();
            parts.extensions.insert(problem);
            Response::from_parts(parts, axum_core::body::Body::from(body))
        }
    }
}
