//! The transactional engine: inside the layer's detachable task, drives the
//! idempotency protocol with a PostgreSQL transaction — begin it, take the key, run the
//! handler with the transaction in a slot, take it back, and commit (with the key row)
//! or roll back.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response};
use http_body::Body;
use retrysafe_core::__private::protocol::{Claimed, Note, Protocol, Settle, Settled, Waited};
use retrysafe_core::idempotency::{
    Completed, Fingerprint, IdempotencyContext, Record, RecordId, Scope, Token,
};
use retrysafe_core::problem::ProblemKind;
use retrysafe_core::store::StoreError;
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_core::{CallContext, ConfigError, Deadline};
use retrysafe_tower::__private::{
    Admitted, CapturedResponse, Engine, Handler, HandlerResult, KeyedRequest, Ran, RoundTrips,
    Served, Shared, StoreOp, drive,
};
use retrysafe_tower::idempotency::RequestBody;
use retrysafe_tower::idempotency::backend::Backend;
use sqlx::Row;
use tokio::time::Instant;
use tracing::Span;

use super::backend::TxBackend;
use super::extract::TxSlot;
use super::sql::lock_key;
use super::txn::LayerTx;
use crate::store::{db_error, micros, record_from_row};

type Tx = LayerTx;

/// How many times the key statement is repeated when it took the lock but found the
/// key held by a row its snapshot predates (a holder committed while it started).
const CLAIM_ATTEMPTS: usize = 8;

impl Backend for TxBackend {
    /// A request without a key runs in a transaction of its own, with no key row.
    const GUARDS_UNKEYED: bool = true;
    /// A failed call is rolled back: nothing happened, a retry is safe.
    const ROLLS_BACK: bool = true;

    fn refused(&self) -> Option<&ConfigError> {
        self.checks.error()
    }

    /// A keyed request: take the key (or wait), then replay or run. A request without
    /// one (and a layer that does not require one): the handler runs in a transaction
    /// of its own, with no key row and no deduplication, committed or rolled back by
    /// the same rules.
    async fn run<H: Handler>(
        &self,
        shared: &Shared,
        handler: H,
        request: Admitted<H::ReqBody>,
    ) -> Served<H> {
        let (protocol, mut engine) = match &request {
            Admitted::Keyed(keyed) => {
                let deadline = keyed.deadline();
                let protocol = Protocol::new(shared.policy(), keyed.fingerprint, deadline);
                let row = KeyRow::new(self, shared, keyed);
                let span = keyed.span.clone();
                (
                    protocol,
                    TxEngine::new(self, shared, deadline, Some(row), span),
                )
            }
            Admitted::Unkeyed(req) => {
                let deadline = req.extensions().get::<Deadline>().copied();
                let unkeyed = Fingerprint::from_bytes([0; 32]);
                let protocol = Protocol::new(shared.policy(), unkeyed, deadline);
                (
                    protocol,
                    TxEngine::new(self, shared, deadline, None, Span::none()),
                )
            }
        };
        drive(shared, protocol, &mut engine, handler, request).await
    }
}

/// The I/O of one request run in a transaction.
struct TxEngine<'a> {
    backend: &'a TxBackend,
    deadline: Option<Deadline>,
    /// The key; `None` for a request without one.
    row: Option<KeyRow>,
    /// The transaction, once begun (and while the handler does not hold it).
    tx: Option<Tx>,
    /// What the layer's requests share (its telemetry).
    shared: &'a Shared,
    /// The round trips to the database: opening the transaction with its key, waiting
    /// for a holder, committing or rolling back.
    trips: RoundTrips,
}

impl<'a> TxEngine<'a> {
    fn new(
        backend: &'a TxBackend,
        shared: &'a Shared,
        deadline: Option<Deadline>,
        row: Option<KeyRow>,
        span: Span,
    ) -> Self {
        TxEngine {
            backend,
            deadline,
            row,
            tx: None,
            shared,
            trips: shared.telemetry().round_trips(span),
        }
    }

    /// Opens the transaction of a request without a key: no key row, nothing to find.
    async fn begin_unkeyed(&mut self) -> Claimed {
        match opening(self.backend, self.deadline, begin(self.backend)).await {
            Some(Ok(tx)) => {
                self.tx = Some(tx);
                Claimed::Mine { takeover: false }
            }
            Some(Err(e)) => Claimed::Failed(e),
            None => Claimed::Failed(StoreError::Timeout),
        }
    }
}

impl Engine for TxEngine<'_> {
    async fn claim(&mut self) -> Claimed {
        let Some(row) = &self.row else {
            return self.begin_unkeyed().await;
        };
        let started = self.trips.start();
        let opened = opening(self.backend, self.deadline, open(self.backend, row)).await;
        self.shared
            .telemetry()
            .round_trip(&mut self.trips, StoreOp::Claim, started);
        match opened {
            Some(Ok(Opened::Mine(tx))) => {
                self.tx = Some(tx);
                Claimed::Mine { takeover: false }
            }
            Some(Ok(Opened::Existing(record))) => Claimed::Existing {
                record,
                became_unknown: false,
            },
            Some(Ok(Opened::Busy)) => Claimed::Busy,
            Some(Err(e)) => Claimed::Failed(e),
            None => Claimed::Failed(StoreError::Timeout),
        }
    }

    async fn wait(&mut self, max: Duration) -> Waited {
        let Some(row) = &self.row else {
            return Waited::TimedOut;
        };
        let started = self.trips.start();
        let waited = wait(self.backend, row, Instant::now() + max).await;
        self.shared
            .telemetry()
            .round_trip(&mut self.trips, StoreOp::Wait, started);
        match waited {
            Ok(Probed::Record(record)) => Waited::Record(record),
            // The holder rolled back (or is gone): race to take the key.
            Ok(Probed::Free) => Waited::LookAgain,
            Ok(Probed::TimedOut) => Waited::TimedOut,
            Err(e) => Waited::Failed(e),
        }
    }

    /// A detached context: the commit point is the transaction itself.
    fn context(&mut self, scope: Scope, key: IdempotencyKey) -> IdempotencyContext {
        let token = self
            .row
            .as_ref()
            .map_or(Token::from_bytes([0; 16]), |r| r.token);
        IdempotencyContext::detached(scope, key, token)
    }

    /// Hands the transaction to the handler (in a slot its guard borrows from) and
    /// takes it back.
    async fn handle<H: Handler>(
        &mut self,
        handler: H,
        mut request: Request<RequestBody<H::ReqBody>>,
        context: CallContext,
    ) -> Ran<H::ResBody, H::Error> {
        let Some(tx) = self.tx.take() else {
            // Claimed without a transaction: a bug, answered 500.
            return Ran::Refused(self.shared.policy().problem(
                ProblemKind::HandlerPanicked,
                "the request could not be completed",
            ));
        };
        let slot = TxSlot::new(tx);
        request.extensions_mut().insert(slot.clone());
        request.extensions_mut().insert(context.clone());
        // The handler's future (and any guard it holds) is dropped by the end of this
        // statement, panicked or not.
        let outcome: HandlerResult<H::ResBody, H::Error> =
            AssertUnwindSafe(context.scope(handler.call(request)))
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
            return Ran::Refused(self.shared.policy().problem(
                ProblemKind::TransactionLeaked,
                "the request handler kept its transaction after answering; nothing was committed",
            ));
        };
        self.tx = Some(tx);
        Ran::Done(outcome)
    }

    async fn capture<B>(
        &mut self,
        shared: &Shared,
        response: Response<B>,
    ) -> Option<CapturedResponse<B>>
    where
        B: Body<Data = Bytes> + Send,
    {
        // Too large (or too slow) to store: the key row records that it completed,
        // committed before the rest streams.
        let until = Instant::now() + self.backend.idle_in_transaction / 2;
        shared.answers().capture(response, until).await
    }

    async fn settle(&mut self, settle: Settle, completed: Option<Completed>) -> Settled {
        let Some(tx) = self.tx.take() else {
            return Settled::Done;
        };
        let backend = self.backend;
        let started = self.trips.start();
        let telemetry = self.shared.telemetry();
        if settle != Settle::Complete {
            // 401/403/429, NoEffect, 5xx, 408, a panic: nothing happened, provably — the
            // key is simply absent and a retry runs again.
            rollback(backend, tx).await;
            telemetry.round_trip(&mut self.trips, StoreOp::Release, started);
            return Settled::Done;
        }
        let done = completed.map(Record::Completed);
        let commit = commit(backend, tx, self.row.as_ref(), done.as_ref());
        let committed = tokio::time::timeout(backend.commit_timeout, commit).await;
        telemetry.round_trip(&mut self.trips, StoreOp::Complete, started);
        match committed {
            Ok(Ok(())) => Settled::Done,
            Ok(Err(Unfinished::Aborted)) => Settled::Aborted,
            Ok(Err(Unfinished::Failed(e))) => Settled::Failed(e),
            Err(_) => Settled::Failed(StoreError::Timeout),
        }
    }

    fn note(&mut self, shared: &Shared, note: Note) {
        if let (Note::Event(kind), Some(row)) = (note, &self.row) {
            shared.telemetry().emit(kind, Some(&row.id));
        }
    }
}

/// Writes the key row (when there is one) and commits; rolls back when the row cannot
/// be written.
async fn commit(
    backend: &TxBackend,
    mut tx: Tx,
    row: Option<&KeyRow>,
    done: Option<&Record>,
) -> Result<(), Unfinished> {
    if let (Some(row), Some(done)) = (row, done)
        && let Err(e) = complete(backend, &mut tx, row, done).await
    {
        rollback(backend, tx).await;
        return Err(e);
    }
    tx.commit()
        .await
        .map_err(|e| Unfinished::Failed(db_error(e)))
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
    lock_key: i64,
    retention: Duration,
}

impl KeyRow {
    /// The key of `request`, with a fresh token.
    fn new(backend: &TxBackend, shared: &Shared, request: &KeyedRequest) -> Self {
        let id = request.record_id();
        KeyRow {
            id,
            token: Token::random(),
            fingerprint: request.fingerprint,
            lock_key: lock_key(&id, backend.sql.table_salt),
            retention: shared.retention(),
        }
    }
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

enum Probed {
    /// A record that is no longer in flight.
    Record(Record),
    /// No record and the lock is free.
    Free,
    TimedOut,
}

/// Waits for a key in flight with short autocommit probes (each checks a connection out
/// for one statement), backing off from 5 ms to 100 ms, until `until`.
async fn wait(backend: &TxBackend, row: &KeyRow, until: Instant) -> Result<Probed, StoreError> {
    let mut delay = Duration::from_millis(5);
    loop {
        let now = Instant::now();
        if now >= until {
            return Ok(Probed::TimedOut);
        }
        tokio::time::sleep_until(until.min(now + delay)).await;
        delay = (delay * 2).min(Duration::from_millis(100));
        let probe = tokio::time::timeout(backend.acquire_timeout, probe(backend, row))
            .await
            .unwrap_or(Err(StoreError::Timeout))?;
        match probe {
            (_, Some(Record::InProgress(_))) => {}
            (_, Some(record)) => return Ok(Probed::Record(record)),
            (true, None) => return Ok(Probed::Free),
            (false, None) => {}
        }
    }
}

async fn probe(backend: &TxBackend, row: &KeyRow) -> Result<(bool, Option<Record>), StoreError> {
    let found = sqlx::query(&backend.sql.probe)
        .bind(&row.id.as_bytes()[..])
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
