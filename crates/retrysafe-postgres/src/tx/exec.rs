//! The transactional backend: inside the layer's spawned task, begin the transaction,
//! take the key, run the handler with the transaction in a slot, take it back, and
//! commit (with the key row) or roll back.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response};
use http_body::Body;
use retrysafe_core::idempotency::{
    Completed, Disposition, Fingerprint, IdempotencyContext, NoEffect, Record, RecordId, Token,
};
use retrysafe_core::store::StoreError;
use retrysafe_core::{CallContext, Deadline};
use retrysafe_tower::idempotency::{
    Answer, Backend, Captured, EventKind, Guard, GuardedRequest, Handler, Problem, ProblemKind,
    RequestBody, ResponseBody,
};
use sqlx::Row;
use tokio::time::Instant;

use super::backend::TxBackend;
use super::extract::TxSlot;
use super::sql::lock_key;
use super::txn::LayerTx;
use crate::store::{db_error, micros, record_from_row};

type Res<B> = Response<ResponseBody<B>>;
type Tx = LayerTx;
type Panic = Box<dyn Any + Send>;

/// How many times the key statement is repeated when it took the lock but found the
/// key held by a row its snapshot predates (a holder committed while it started).
const CLAIM_ATTEMPTS: usize = 8;

impl Backend for TxBackend {
    /// A request without a key runs in a transaction of its own, with no key row.
    const GUARDS_UNKEYED: bool = true;
    /// A failed call is rolled back: nothing happened, a retry is safe.
    const ROLLS_BACK: bool = true;

    fn run<H: Handler>(
        &self,
        guard: &Guard,
        handler: H,
        request: GuardedRequest,
    ) -> impl Future<Output = Answer<H>> + Send {
        run_keyed(guard, self, handler, request)
    }

    fn run_unkeyed<H: Handler>(
        &self,
        guard: &Guard,
        handler: H,
        request: Request<RequestBody<H::ReqBody>>,
    ) -> impl Future<Output = Answer<H>> + Send {
        run_unkeyed(guard, self, handler, request)
    }
}

/// A request on a guarded method without a key (and a layer that does not require
/// one): the handler runs in a transaction of its own, with no key row and no
/// deduplication, committed or rolled back by the same rules.
async fn run_unkeyed<H: Handler>(
    guard: &Guard,
    backend: &TxBackend,
    handler: H,
    req: Request<RequestBody<H::ReqBody>>,
) -> Answer<H> {
    let deadline = req.extensions().get::<Deadline>().copied();
    match opening(backend, deadline, begin(backend)).await {
        Some(Ok(tx)) => {
            let context = CallContext::inherited(req.extensions()).unwrap_or_default();
            run_in_tx(guard, backend, handler, req, tx, context, None).await
        }
        Some(Err(e)) => Ok(begin_failed(guard, &e)),
        None => Ok(begin_timed_out(guard)),
    }
}

/// Runs the opening of a transaction under the acquire timeout and the request's
/// deadline; `None` when the time ran out. With no time left it does not start (a step
/// cut off on the wire costs the connection: see [`LayerTx`]).
async fn opening<T>(
    backend: &TxBackend,
    deadline: Option<Deadline>,
    open: impl Future<Output = Result<T, StoreError>>,
) -> Option<Result<T, StoreError>> {
    let limit = Deadline::bound(deadline, backend.acquire_timeout);
    if limit.is_zero() {
        return None;
    }
    tokio::time::timeout(limit, open).await.ok()
}

fn begin_failed<B>(guard: &Guard, error: &StoreError) -> Res<B> {
    tracing::warn!(target: "retrysafe::idempotency", error = %error, "could not begin the transaction");
    guard.store_unavailable("the database is unavailable; retry later")
}

fn begin_timed_out<B>(guard: &Guard) -> Res<B> {
    tracing::warn!(
        target: "retrysafe::idempotency",
        "no connection and transaction within the request's deadline or the acquire timeout"
    );
    guard.store_unavailable("the database is busy; retry later")
}

/// Checks a connection out and begins the transaction: `BEGIN ISOLATION LEVEL READ
/// COMMITTED` and the `SET LOCAL`s in one simple query (one round trip). Safe to cancel
/// at any point (see [`LayerTx`]).
async fn begin(backend: &TxBackend) -> Result<Tx, StoreError> {
    let conn = backend.pool.acquire().await.map_err(db_error)?;
    LayerTx::begin(conn, backend.begin.clone())
        .await
        .map_err(db_error)
}

/// What the key statement found.
enum Opened {
    /// The lock is ours and the key row is inserted: run the handler in `Tx`.
    Mine(Tx),
    /// A live record exists (the transaction is dropped: rolled back).
    Existing(Record),
    /// The lock is held by another transaction, and no committed record is visible:
    /// in flight.
    Busy,
}

/// The key step of a keyed request: the transaction, the advisory lock and the key row.
struct KeyRow {
    id: RecordId,
    token: Token,
    fingerprint: Fingerprint,
    lock_key: i32,
    retention: Duration,
}

async fn open(backend: &TxBackend, row: &KeyRow) -> Result<Opened, StoreError> {
    let mut tx = begin(backend).await?;
    let token = row.token.to_bytes();
    for _ in 0..CLAIM_ATTEMPTS {
        let query = sqlx::query(&backend.sql.claim)
            .bind(&row.id.as_bytes()[..])
            .bind(&row.fingerprint.as_bytes()[..])
            .bind(&token[..])
            // The in-progress row is never seen committed: its lease only has to
            // outlast the transaction.
            .bind(micros(row.retention))
            .bind(micros(row.retention))
            .bind(backend.lock_class)
            .bind(row.lock_key);
        let found = tx.fetch_one(query).await.map_err(db_error)?;
        let locked: bool = found.try_get("locked").map_err(db_error)?;
        let mine: Option<bool> = found.try_get("mine").map_err(db_error)?;
        match mine {
            Some(true) => return Ok(Opened::Mine(tx)),
            // Dropping the transaction rolls it back (sqlx queues the ROLLBACK, sent as
            // the connection returns to the pool): the answer need not wait for it.
            Some(false) => return record_from_row(&found).map(Opened::Existing),
            None if !locked => return Ok(Opened::Busy),
            // Locked, yet no row: a holder committed while this statement started, after
            // its snapshot. Look again, with the lock (re-entrant) held.
            None => {}
        }
    }
    Err(StoreError::unavailable(
        "the key statement kept finding a concurrently changing row",
    ))
}

/// The keyed request inside its task: take the key (or wait), then replay or run.
async fn run_keyed<H: Handler>(
    guard: &Guard,
    backend: &TxBackend,
    handler: H,
    request: GuardedRequest,
) -> Answer<H> {
    let id = request.record_id();
    let row = KeyRow {
        id,
        token: Token::random(),
        fingerprint: request.fingerprint,
        lock_key: lock_key(&id, backend.sql.table_salt),
        retention: guard.retention(),
    };
    let deadline = request.deadline();
    let mut in_flight = guard.in_flight_wait(deadline);
    loop {
        let opened = match opening(backend, deadline, open(backend, &row)).await {
            Some(Ok(opened)) => opened,
            Some(Err(e)) => return Ok(begin_failed(guard, &e)),
            None => return Ok(begin_timed_out(guard)),
        };
        let existing = match opened {
            Opened::Mine(tx) => {
                guard.emit(EventKind::Claimed, &id);
                return run_mine(guard, backend, handler, request, row, tx).await;
            }
            Opened::Existing(record) => Some(record),
            Opened::Busy => None,
        };
        if let Some(answer) = existing
            .as_ref()
            .and_then(|record| guard.answer(&id, record, &row.fingerprint))
        {
            return Ok(answer);
        }

        // In flight.
        let left = match in_flight.next(&id) {
            Ok(left) => left,
            Err(problem) => return Ok(guard.problem(problem)),
        };
        match wait(backend, &row, Instant::now() + left).await {
            Ok(Waited::Record(record)) => {
                if let Some(answer) = guard.answer(&id, &record, &row.fingerprint) {
                    return Ok(answer);
                }
            }
            // The holder rolled back (or is gone): race to take the key.
            Ok(Waited::Free) => {}
            Ok(Waited::TimedOut) => return Ok(guard.problem(in_flight.timed_out())),
            Err(e) => {
                tracing::warn!(target: "retrysafe::idempotency", error = %e, "waiting for a request in flight failed");
                return Ok(guard.store_unavailable("the database is unavailable; retry later"));
            }
        }
    }
}

enum Waited {
    /// A record that is no longer in flight.
    Record(Record),
    /// No record and the lock is free.
    Free,
    TimedOut,
}

/// Waits for a key in flight with short autocommit probes (each checks a connection out
/// for one statement), backing off from 5 ms to 100 ms, until `until`.
async fn wait(backend: &TxBackend, row: &KeyRow, until: Instant) -> Result<Waited, StoreError> {
    let mut delay = Duration::from_millis(5);
    loop {
        let now = Instant::now();
        if now >= until {
            return Ok(Waited::TimedOut);
        }
        tokio::time::sleep_until(until.min(now + delay)).await;
        delay = (delay * 2).min(Duration::from_millis(100));
        let probe = tokio::time::timeout(backend.acquire_timeout, probe(backend, row))
            .await
            .unwrap_or(Err(StoreError::Timeout))?;
        match probe {
            (_, Some(Record::InProgress(_))) => {}
            (_, Some(record)) => return Ok(Waited::Record(record)),
            (true, None) => return Ok(Waited::Free),
            (false, None) => {}
        }
    }
}

async fn probe(backend: &TxBackend, row: &KeyRow) -> Result<(bool, Option<Record>), StoreError> {
    let found = sqlx::query(&backend.sql.probe)
        .bind(&row.id.as_bytes()[..])
        .bind(backend.lock_class)
        .bind(row.lock_key)
        .fetch_one(&backend.pool)
        .await
        .map_err(db_error)?;
    let free: bool = found.try_get("free").map_err(db_error)?;
    let state: Option<i16> = found.try_get("state").map_err(db_error)?;
    let record = match state {
        Some(_) => Some(record_from_row(&found)?),
        None => None,
    };
    Ok((free, record))
}

/// Runs the handler of a request whose key row this transaction inserted.
async fn run_mine<H: Handler>(
    guard: &Guard,
    backend: &TxBackend,
    handler: H,
    request: GuardedRequest,
    row: KeyRow,
    tx: Tx,
) -> Answer<H> {
    // A detached context: the commit point is the transaction itself. The handler runs
    // in this spawned task: re-scope the inherited call context, now carrying the
    // record, so outbound client layers derive child keys from it.
    let (req, context) =
        request.into_request(|scope, key| IdempotencyContext::detached(scope, key, row.token));
    run_in_tx(guard, backend, handler, req, tx, context, Some(row)).await
}

/// Hands the transaction to the handler (in a slot its guard borrows from), takes it
/// back, and commits or rolls back as the answer says.
async fn run_in_tx<H: Handler>(
    guard: &Guard,
    backend: &TxBackend,
    handler: H,
    mut req: Request<RequestBody<H::ReqBody>>,
    tx: Tx,
    context: CallContext,
    row: Option<KeyRow>,
) -> Answer<H> {
    let slot = TxSlot::new(tx);
    req.extensions_mut().insert(slot.clone());
    req.extensions_mut().insert(context.clone());
    // The handler's future (and any guard it holds) is dropped by the end of this
    // statement, panicked or not.
    let outcome: Result<Result<Response<H::ResBody>, H::Error>, Panic> =
        AssertUnwindSafe(context.scope(handler.call(req)))
            .catch_unwind()
            .await;

    let Some(tx) = slot.reclaim() else {
        // A guard outlived the handler's answer. The transaction stays with it and
        // rolls back when it is dropped (or when the server ends the idle session);
        // nothing of it is ever committed.
        tracing::error!(
            target: "retrysafe::idempotency",
            "a handler kept its IdempotentTx guard after answering; its transaction is rolled back"
        );
        return Ok(guard.problem(Problem::new(
            ProblemKind::TransactionLeaked,
            "the request handler kept its transaction after answering; nothing was committed",
        )));
    };
    let response = match outcome {
        Err(_panic) => {
            rollback(backend, tx).await;
            return Ok(guard.problem(Problem::new(
                ProblemKind::HandlerPanicked,
                "the request handler failed; nothing was committed",
            )));
        }
        Ok(Err(e)) => {
            rollback(backend, tx).await;
            return Err(e);
        }
        Ok(Ok(response)) => response,
    };

    let no_effect = response.extensions().get::<NoEffect>().is_some();
    match (Disposition::of(response.status(), no_effect), row) {
        // 401/403/429, NoEffect, 5xx, 408: nothing happened, provably — the key is
        // simply absent and a retry runs again.
        (Disposition::Release | Disposition::OutcomeUnknown, _) => {
            rollback(backend, tx).await;
            Ok(response.map(ResponseBody::stream))
        }
        (Disposition::Store, None) => {
            match tokio::time::timeout(backend.commit_timeout, tx.commit()).await {
                Ok(Ok(())) => Ok(response.map(ResponseBody::stream)),
                Ok(Err(e)) => Ok(commit_failed(guard, &db_error(e))),
                Err(_) => Ok(commit_failed(guard, &StoreError::Timeout)),
            }
        }
        (Disposition::Store, Some(row)) => store(guard, backend, tx, &row, response).await,
    }
}

/// Collects the response (up to the storable limit), writes it into the key row and
/// commits; the response is returned only once the commit succeeded.
async fn store<B, E>(
    guard: &Guard,
    backend: &TxBackend,
    mut tx: Tx,
    row: &KeyRow,
    response: Response<B>,
) -> Result<Res<B>, E>
where
    B: Body<Data = Bytes> + Send + 'static,
{
    let until = Instant::now() + backend.idle_in_transaction / 2;
    // Too large (or too slow) to store: the key row records that it completed,
    // committed before the rest streams.
    let Some(Captured { stored, response }) = guard.capture(response, until).await else {
        rollback(backend, tx).await;
        return Ok(guard.problem(Problem::new(
            ProblemKind::HandlerPanicked,
            "the response failed while it was being produced; nothing was committed",
        )));
    };
    let done = Record::Completed(Completed {
        fingerprint: row.fingerprint,
        response: stored,
    });
    let status = response.status();
    let commit = async {
        match complete(backend, &mut tx, row, &done).await {
            Ok(()) => tx
                .commit()
                .await
                .map_err(|e| Unfinished::Failed(db_error(e))),
            Err(e) => {
                rollback(backend, tx).await;
                Err(e)
            }
        }
    };
    match tokio::time::timeout(backend.commit_timeout, commit).await {
        Ok(Ok(())) => Ok(response),
        // A statement of the handler failed, which aborted the transaction, and the
        // handler answered anyway. Nothing was committed. A client error is passed on
        // (a retry gets it again); a success would be a lie.
        Ok(Err(Unfinished::Aborted)) if status.is_client_error() => {
            tracing::debug!(
                target: "retrysafe::idempotency",
                %status,
                "the handler answered a client error after a failed statement; nothing committed or stored"
            );
            Ok(response)
        }
        Ok(Err(Unfinished::Aborted)) => {
            tracing::error!(
                target: "retrysafe::idempotency",
                %status,
                "a statement of the request's transaction failed, and the handler answered as if it had not; nothing was committed"
            );
            Ok(guard.problem(Problem::new(
                ProblemKind::HandlerPanicked,
                "a statement of the request's transaction failed; nothing was committed",
            )))
        }
        Ok(Err(Unfinished::Failed(e))) => Ok(commit_failed(guard, &e)),
        Err(_) => Ok(commit_failed(guard, &StoreError::Timeout)),
    }
}

/// Why a transaction to store did not commit.
enum Unfinished {
    /// The handler left it aborted (a statement failed: SQLSTATE 25P02 on ours).
    Aborted,
    /// The key row could not be written, or the commit failed.
    Failed(StoreError),
}

/// Writes the completed record into the key row: the store's own `complete` statement.
async fn complete(
    backend: &TxBackend,
    tx: &mut Tx,
    row: &KeyRow,
    done: &Record,
) -> Result<(), Unfinished> {
    let blob = done.encode();
    let token = row.token.to_bytes();
    let query = sqlx::query(&backend.sql.store.complete)
        .bind(&row.id.as_bytes()[..])
        .bind(&token[..])
        .bind(&row.fingerprint.as_bytes()[..])
        .bind(micros(row.retention))
        .bind(&blob[..]);
    let written = tx.execute(query).await.map_err(|e| match &e {
        sqlx::Error::Database(db) if db.code().as_deref() == Some("25P02") => Unfinished::Aborted,
        _ => Unfinished::Failed(db_error(e)),
    })?;
    if written.rows_affected() == 1 {
        Ok(())
    } else {
        Err(Unfinished::Failed(StoreError::StaleToken))
    }
}

/// The key row or the commit failed: nothing, or everything, was committed — which
/// one, a retry finds out (it runs, or replays).
fn commit_failed<B>(guard: &Guard, error: &StoreError) -> Res<B> {
    tracing::warn!(
        target: "retrysafe::idempotency",
        error = %error,
        "could not commit the request's transaction; answering 503"
    );
    guard.store_unavailable(
        "the request's transaction could not be committed; retry with the same key",
    )
}

/// Rolls back (bounded by the commit timeout). A failure is only logged: a transaction
/// that cannot be rolled back explicitly is rolled back by the server when its
/// connection closes.
async fn rollback(backend: &TxBackend, tx: Tx) {
    match tokio::time::timeout(backend.commit_timeout, tx.rollback()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::debug!(target: "retrysafe::idempotency", error = %e, "rollback failed");
        }
        Err(_) => tracing::debug!(target: "retrysafe::idempotency", "rollback timed out"),
    }
}
