//! The transactional execution: buffer and fingerprint, then one spawned task that
//! begins the transaction, takes the key, runs the handler with the transaction in a
//! slot, takes it back, and commits (with the key row) or rolls back.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use retrysafe_core::idempotency::{
    Completed, Decision, Disposition, Fingerprint, IdempotencyContext, NoEffect, Record, RecordId,
    Scope, StoredResponse, Token, decide,
};
use retrysafe_core::store::StoreError;
use retrysafe_core::wire::{DO_NOT_RETRY_VALUE, IdempotencyKey, encode_retry_after};
use retrysafe_core::{CallContext, Deadline};
use retrysafe_tower::idempotency::blocks::{self, CapturedBody};
use retrysafe_tower::idempotency::{
    EventKind, IdempotencyEvent, Problem, ProblemKind, RequestBody, ResponseBody,
};
use sqlx::Row;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Instrument;

use super::extract::TxSlot;
use super::layer::{Config, TxIdempotencyLayer};
use super::sql::lock_key;
use super::txn::LayerTx;
use crate::store::{db_error, micros, record_from_row};

type Res<B> = Response<ResponseBody<B>>;
type Tx = LayerTx;
type Panic = Box<dyn Any + Send>;

/// How many times the key statement is repeated when it took the lock but found the
/// key held by a row its snapshot predates (a holder committed while it started).
const CLAIM_ATTEMPTS: usize = 8;

/// Builds a problem response with the headers its case requires. Unlike the
/// `IdempotencyLayer`, a panicked handler is answered without `do-not-retry`: its
/// transaction was rolled back, so nothing happened and a retry is safe.
pub(crate) fn problem_response<B>(config: &Config, problem: Problem) -> Res<B> {
    let res = match &config.responder {
        Some(f) => f(&problem),
        None => problem.to_response(),
    };
    let (mut parts, body) = res.into_parts();
    let kind = problem.kind();
    if kind.do_not_retry() && kind != ProblemKind::HandlerPanicked {
        parts
            .headers
            .insert(config.convention.do_not_retry().clone(), DO_NOT_RETRY_VALUE);
    }
    if let Some(d) = problem.retry_after_hint() {
        parts.headers.insert(
            config.convention.retry_after().clone(),
            encode_retry_after(d),
        );
    }
    parts.extensions.insert(problem);
    Response::from_parts(parts, ResponseBody::full(body, None))
}

fn unavailable<B>(config: &Config, detail: &'static str) -> Res<B> {
    problem_response(
        config,
        Problem::new(ProblemKind::StoreUnavailable, detail)
            .retry_after(config.unavailable_retry_after),
    )
}

fn emit(config: &Config, kind: EventKind, record: &RecordId) {
    tracing::debug!(target: "retrysafe::idempotency", event = kind.as_str(), record = ?record);
    if let Some(f) = &config.on_event {
        f(&IdempotencyEvent {
            kind,
            record: *record,
        });
    }
}

/// The bound of guarded requests in flight, taken before a body is buffered.
fn permit(layer: &TxIdempotencyLayer) -> Option<OwnedSemaphorePermit> {
    Arc::clone(&layer.shared.permits).try_acquire_owned().ok()
}

fn overloaded<B>(config: &Config) -> Res<B> {
    problem_response(
        config,
        Problem::new(
            ProblemKind::Overloaded,
            "too many requests with idempotency keys in progress",
        )
        .retry_after(config.unavailable_retry_after),
    )
}

/// Runs `task` in the layer's tracked tasks and awaits it: dropping the caller's future
/// (the client went away) cancels nothing.
async fn spawned<B, E>(
    layer: &TxIdempotencyLayer,
    task: impl Future<Output = Result<Res<B>, E>> + Send + 'static,
) -> Result<Res<B>, E>
where
    B: Send + 'static,
    E: Send + 'static,
{
    let task = task.instrument(tracing::Span::current());
    match layer.shared.shutdown.spawn(task).await {
        Ok(res) => res,
        Err(e) => {
            // Handler panics are caught inside; this is a panic of our own or a
            // runtime shutting down. A transaction not committed by then rolls back.
            tracing::error!(target: "retrysafe::idempotency", error = %e, "transactional task failed");
            Ok(problem_response(
                &layer.config,
                Problem::new(
                    ProblemKind::HandlerPanicked,
                    "the request could not be completed",
                ),
            ))
        }
    }
}

/// A request with an idempotency key: buffer and fingerprint, then run in a task.
pub(crate) async fn keyed<S, B, ResB>(
    layer: TxIdempotencyLayer,
    inner: S,
    parts: Parts,
    body: B,
    key: IdempotencyKey,
    scope: Scope,
) -> Result<Res<ResB>, S::Error>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResB: Body<Data = Bytes> + Send + 'static,
{
    let config = &layer.config;
    let limit = config.max_request_body;
    let mut body = std::pin::pin!(body);
    if let Err(problem) = blocks::check_declared_length(&parts.headers, body.as_mut(), limit).await
    {
        return Ok(problem_response(config, problem));
    }
    // Taken before the body is buffered: the bound also caps buffered bodies.
    let Some(permit) = permit(&layer) else {
        return Ok(overloaded(config));
    };
    let body = match blocks::buffer_request_body(body.as_mut(), limit).await {
        Ok(b) => b,
        Err(problem) => return Ok(problem_response(config, problem)),
    };
    let fingerprint =
        config
            .fingerprinter
            .fingerprint(&parts.method, &parts.uri, &parts.headers, &body);
    let task = {
        let layer = layer.clone();
        async move {
            let res = run_keyed(&layer.config, inner, parts, body, key, scope, fingerprint).await;
            drop(permit);
            res
        }
    };
    spawned(&layer, task).await
}

/// A request on a guarded method without a key (and a layer that does not require
/// one): the handler runs in a transaction of its own, with no key row and no
/// deduplication, committed or rolled back by the same rules.
pub(crate) async fn unkeyed<S, B, ResB>(
    layer: TxIdempotencyLayer,
    inner: S,
    parts: Parts,
    body: B,
) -> Result<Res<ResB>, S::Error>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
{
    let Some(permit) = permit(&layer) else {
        return Ok(overloaded(&layer.config));
    };
    let task = {
        let layer = layer.clone();
        async move {
            let config = &*layer.config;
            let deadline = parts.extensions.get::<Deadline>().copied();
            let res = match opening(config, deadline, begin(config)).await {
                Some(Ok(tx)) => {
                    let context = CallContext::inherited(&parts.extensions).unwrap_or_default();
                    let req = Request::from_parts(parts, RequestBody::stream(body));
                    run_in_tx(config, inner, req, tx, context, None).await
                }
                Some(Err(e)) => Ok(begin_failed(config, &e)),
                None => Ok(begin_timed_out(config)),
            };
            drop(permit);
            res
        }
    };
    spawned(&layer, task).await
}

/// Runs the opening of a transaction under the acquire timeout and the request's
/// deadline; `None` when the time ran out. With no time left it does not start (a step
/// cut off on the wire costs the connection: see [`LayerTx`]).
async fn opening<T>(
    config: &Config,
    deadline: Option<Deadline>,
    open: impl Future<Output = Result<T, StoreError>>,
) -> Option<Result<T, StoreError>> {
    let limit = Deadline::bound(deadline, config.acquire_timeout);
    if limit.is_zero() {
        return None;
    }
    tokio::time::timeout(limit, open).await.ok()
}

fn begin_failed<B>(config: &Config, error: &StoreError) -> Res<B> {
    tracing::warn!(target: "retrysafe::idempotency", error = %error, "could not begin the transaction");
    unavailable(config, "the database is unavailable; retry later")
}

fn begin_timed_out<B>(config: &Config) -> Res<B> {
    tracing::warn!(
        target: "retrysafe::idempotency",
        "no connection and transaction within the request's deadline or the acquire timeout"
    );
    unavailable(config, "the database is busy; retry later")
}

/// Checks a connection out and begins the transaction: `BEGIN ISOLATION LEVEL READ
/// COMMITTED` and the `SET LOCAL`s in one simple query (one round trip). Safe to cancel
/// at any point (see [`LayerTx`]).
async fn begin(config: &Config) -> Result<Tx, StoreError> {
    let conn = config.pool.acquire().await.map_err(db_error)?;
    LayerTx::begin(conn, config.begin.clone())
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
}

async fn open(config: &Config, row: &KeyRow) -> Result<Opened, StoreError> {
    let mut tx = begin(config).await?;
    let token = row.token.to_bytes();
    for _ in 0..CLAIM_ATTEMPTS {
        let query = sqlx::query(&config.sql.claim)
            .bind(&row.id.as_bytes()[..])
            .bind(&row.fingerprint.as_bytes()[..])
            .bind(&token[..])
            // The in-progress row is never seen committed: its lease only has to
            // outlast the transaction.
            .bind(micros(config.retention))
            .bind(micros(config.retention))
            .bind(config.lock_class)
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
async fn run_keyed<S, B, ResB>(
    config: &Config,
    inner: S,
    parts: Parts,
    body: Bytes,
    key: IdempotencyKey,
    scope: Scope,
    fingerprint: Fingerprint,
) -> Result<Res<ResB>, S::Error>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
{
    let id = RecordId::new(&scope, &key);
    let row = KeyRow {
        id,
        token: Token::random(),
        fingerprint,
        lock_key: lock_key(&id, config.sql.table_salt),
    };
    let deadline = parts.extensions.get::<Deadline>().copied();
    let started = Instant::now();
    let mut waited = false;
    loop {
        let opened = match opening(config, deadline, open(config, &row)).await {
            Some(Ok(opened)) => opened,
            Some(Err(e)) => return Ok(begin_failed(config, &e)),
            None => return Ok(begin_timed_out(config)),
        };
        let existing = match opened {
            Opened::Mine(tx) => {
                emit(config, EventKind::Claimed, &id);
                return run_mine(config, inner, parts, body, scope, key, row, tx).await;
            }
            Opened::Existing(record) => Some(record),
            Opened::Busy => None,
        };
        if let Some(answer) = existing
            .as_ref()
            .and_then(|record| answer_existing(config, record, &row))
        {
            return Ok(answer);
        }

        // In flight.
        if !waited {
            emit(config, EventKind::Conflict, &id);
        }
        waited = true;
        let max = config.wait_for_in_flight.unwrap_or(Duration::ZERO);
        let left = Deadline::bound(deadline, max.saturating_sub(started.elapsed()));
        if left.is_zero() {
            return Ok(in_flight(config));
        }
        match wait(config, &row, Instant::now() + left).await {
            Ok(Waited::Record(record)) => {
                if let Some(answer) = answer_existing(config, &record, &row) {
                    return Ok(answer);
                }
            }
            // The holder rolled back (or is gone): race to take the key.
            Ok(Waited::Free) => {}
            Ok(Waited::TimedOut) => return Ok(in_flight(config)),
            Err(e) => {
                tracing::warn!(target: "retrysafe::idempotency", error = %e, "waiting for a request in flight failed");
                return Ok(unavailable(
                    config,
                    "the database is unavailable; retry later",
                ));
            }
        }
    }
}

fn in_flight<B>(config: &Config) -> Res<B> {
    problem_response(
        config,
        Problem::new(
            ProblemKind::InFlight,
            "a request with this Idempotency-Key is still in progress; retry later",
        )
        .retry_after(config.in_flight_retry_after),
    )
}

/// The answer an existing record gives, or `None` when it is in flight.
fn answer_existing<B>(config: &Config, record: &Record, row: &KeyRow) -> Option<Res<B>> {
    match decide(record, &row.fingerprint) {
        Decision::Replay(stored) => {
            emit(config, EventKind::Replayed, &row.id);
            Some(blocks::replay_response(&config.convention, stored))
        }
        Decision::Mismatch => {
            emit(config, EventKind::Mismatch, &row.id);
            Some(problem_response(
                config,
                Problem::new(
                    ProblemKind::KeyMismatch,
                    "this Idempotency-Key was already used with a different request",
                ),
            ))
        }
        Decision::NotStored => Some(problem_response(
            config,
            Problem::new(
                ProblemKind::ResponseNotStored,
                "the first response to this Idempotency-Key was too large to store",
            ),
        )),
        // Only a PostgresStore sharing the table writes these.
        Decision::OutcomeUnknown => Some(problem_response(
            config,
            Problem::new(
                ProblemKind::OutcomeUnknown,
                "the outcome of the first request with this Idempotency-Key is unknown",
            ),
        )),
        Decision::InFlight => None,
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
async fn wait(config: &Config, row: &KeyRow, until: Instant) -> Result<Waited, StoreError> {
    let mut delay = Duration::from_millis(5);
    loop {
        let now = Instant::now();
        if now >= until {
            return Ok(Waited::TimedOut);
        }
        tokio::time::sleep_until(until.min(now + delay)).await;
        delay = (delay * 2).min(Duration::from_millis(100));
        let probe = tokio::time::timeout(config.acquire_timeout, probe(config, row))
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

async fn probe(config: &Config, row: &KeyRow) -> Result<(bool, Option<Record>), StoreError> {
    let found = sqlx::query(&config.sql.probe)
        .bind(&row.id.as_bytes()[..])
        .bind(config.lock_class)
        .bind(row.lock_key)
        .fetch_one(&config.pool)
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
#[allow(clippy::too_many_arguments)]
async fn run_mine<S, B, ResB>(
    config: &Config,
    inner: S,
    mut parts: Parts,
    body: Bytes,
    scope: Scope,
    key: IdempotencyKey,
    row: KeyRow,
    tx: Tx,
) -> Result<Res<ResB>, S::Error>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
{
    // A detached context: the commit point is the transaction itself. The handler runs
    // in this spawned task: re-scope the inherited call context, now carrying the
    // record, so outbound client layers derive child keys from it.
    let ctx = IdempotencyContext::detached(scope, key, row.token);
    let context = CallContext::inherited(&parts.extensions)
        .unwrap_or_default()
        .with_idempotency(ctx.clone());
    parts.extensions.insert(ctx);
    let req = Request::from_parts(parts, RequestBody::buffered(body));
    run_in_tx(config, inner, req, tx, context, Some(row)).await
}

/// Hands the transaction to the handler (in a slot its guard borrows from), takes it
/// back, and commits or rolls back as the answer says.
async fn run_in_tx<S, B, ResB>(
    config: &Config,
    mut inner: S,
    mut req: Request<RequestBody<B>>,
    tx: Tx,
    context: CallContext,
    row: Option<KeyRow>,
) -> Result<Res<ResB>, S::Error>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
{
    let slot = TxSlot::new(tx);
    req.extensions_mut().insert(slot.clone());
    req.extensions_mut().insert(context.clone());
    // The handler's future (and any guard it holds) is dropped by the end of this
    // statement, panicked or not.
    let outcome: Result<Result<Response<ResB>, S::Error>, Panic> =
        AssertUnwindSafe(context.scope(async move { inner.call(req).await }))
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
        return Ok(problem_response(
            config,
            Problem::new(
                ProblemKind::TransactionLeaked,
                "the request handler kept its transaction after answering; nothing was committed",
            ),
        ));
    };
    let response = match outcome {
        Err(_panic) => {
            rollback(config, tx).await;
            return Ok(problem_response(
                config,
                Problem::new(
                    ProblemKind::HandlerPanicked,
                    "the request handler failed; nothing was committed",
                ),
            ));
        }
        Ok(Err(e)) => {
            rollback(config, tx).await;
            return Err(e);
        }
        Ok(Ok(response)) => response,
    };

    let no_effect = response.extensions().get::<NoEffect>().is_some();
    match (Disposition::of(response.status(), no_effect), row) {
        // 401/403/429, NoEffect, 5xx, 408: nothing happened, provably — the key is
        // simply absent and a retry runs again.
        (Disposition::Release | Disposition::OutcomeUnknown, _) => {
            rollback(config, tx).await;
            Ok(response.map(ResponseBody::stream))
        }
        (Disposition::Store, None) => {
            match tokio::time::timeout(config.commit_timeout, tx.commit()).await {
                Ok(Ok(())) => Ok(response.map(ResponseBody::stream)),
                Ok(Err(e)) => Ok(commit_failed(config, &db_error(e))),
                Err(_) => Ok(commit_failed(config, &StoreError::Timeout)),
            }
        }
        (Disposition::Store, Some(row)) => store(config, tx, &row, response).await,
    }
}

/// Collects the response (up to the storable limit), writes it into the key row and
/// commits; the response is returned only once the commit succeeded.
async fn store<B, E>(
    config: &Config,
    mut tx: Tx,
    row: &KeyRow,
    response: Response<B>,
) -> Result<Res<B>, E>
where
    B: Body<Data = Bytes> + Send + 'static,
{
    let (head, body) = response.into_parts();
    let until = Instant::now() + config.idle_in_transaction / 2;
    let captured = AssertUnwindSafe(blocks::capture_response_body(
        body,
        config.max_stored_response,
        until,
    ))
    .catch_unwind()
    .await
    // A panic while the body was produced is a failed body.
    .unwrap_or(CapturedBody::Failed);
    let (stored, response) = match captured {
        CapturedBody::Whole { data, trailers } => {
            let stored = StoredResponse::capture(
                head.status,
                &head.headers,
                data.clone(),
                trailers.as_ref(),
                &config.header_filter,
            );
            let response = Response::from_parts(head, ResponseBody::full(data, trailers));
            (Some(stored), response)
        }
        // Too large (or too slow) to store: the key row records that it completed,
        // committed before the rest streams.
        CapturedBody::TooLarge(rest) => (None, Response::from_parts(head, rest)),
        CapturedBody::Failed => {
            rollback(config, tx).await;
            return Ok(problem_response(
                config,
                Problem::new(
                    ProblemKind::HandlerPanicked,
                    "the response failed while it was being produced; nothing was committed",
                ),
            ));
        }
    };
    let done = Record::Completed(Completed {
        fingerprint: row.fingerprint,
        response: stored,
    });
    let status = response.status();
    let commit = async {
        match complete(config, &mut tx, row, &done).await {
            Ok(()) => tx
                .commit()
                .await
                .map_err(|e| Unfinished::Failed(db_error(e))),
            Err(e) => {
                rollback(config, tx).await;
                Err(e)
            }
        }
    };
    match tokio::time::timeout(config.commit_timeout, commit).await {
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
            Ok(problem_response(
                config,
                Problem::new(
                    ProblemKind::HandlerPanicked,
                    "a statement of the request's transaction failed; nothing was committed",
                ),
            ))
        }
        Ok(Err(Unfinished::Failed(e))) => Ok(commit_failed(config, &e)),
        Err(_) => Ok(commit_failed(config, &StoreError::Timeout)),
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
    config: &Config,
    tx: &mut Tx,
    row: &KeyRow,
    done: &Record,
) -> Result<(), Unfinished> {
    let blob = done.encode();
    let token = row.token.to_bytes();
    let query = sqlx::query(&config.sql.store.complete)
        .bind(&row.id.as_bytes()[..])
        .bind(&token[..])
        .bind(&row.fingerprint.as_bytes()[..])
        .bind(micros(config.retention))
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
fn commit_failed<B>(config: &Config, error: &StoreError) -> Res<B> {
    tracing::warn!(
        target: "retrysafe::idempotency",
        error = %error,
        "could not commit the request's transaction; answering 503"
    );
    unavailable(
        config,
        "the request's transaction could not be committed; retry with the same key",
    )
}

/// Rolls back (bounded by the commit timeout). A failure is only logged: a transaction
/// that cannot be rolled back explicitly is rolled back by the server when its
/// connection closes.
async fn rollback(config: &Config, tx: Tx) {
    match tokio::time::timeout(config.commit_timeout, tx.rollback()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::debug!(target: "retrysafe::idempotency", error = %e, "rollback failed");
        }
        Err(_) => tracing::debug!(target: "retrysafe::idempotency", "rollback timed out"),
    }
}
