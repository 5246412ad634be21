//! Middleware that runs each guarded request in one PostgreSQL transaction holding its
//! idempotency key, so that the key and the handler's effects commit together: a
//! request repeated with the same `Idempotency-Key` has its effect **exactly once**.
//!
//! The [`IdempotencyLayer`](retrysafe_tower::idempotency::IdempotencyLayer) with any
//! store can only promise "at most once, never silently twice": a call that fails after
//! its handler started has an unknown outcome. Here nothing is unknown, because the key
//! row is written by the same transaction as the effect:
//!
//! 1. the layer checks a connection out of the pool (bounded by the request's
//!    [`Deadline`](retrysafe_core::Deadline), default 1 s: 503 past it) and begins a
//!    `READ COMMITTED` transaction with its own `idle_in_transaction_session_timeout`;
//! 2. it tries a transaction-scoped advisory lock on the key
//!    (`pg_try_advisory_xact_lock(bigint)`, on 64 bits of the record key mixed with a
//!    hash of the table name): when another transaction holds it, the request is in
//!    flight and gets 409 at once — it never parks on a row that transaction has not
//!    committed yet;
//! 3. with the lock, it inserts the key row (`in_progress`), in the same statement;
//! 4. the handler runs with an [`IdempotentTx`] extractor: a guard that dereferences to
//!    the transaction's connection, usable as an executor, with no way to commit, roll
//!    back or keep it;
//! 5. the layer takes the transaction back and, when the `IdempotencyLayer`'s status
//!    policy would store the answer, writes the response into the key row (`completed`)
//!    and commits, once. Otherwise it rolls back: the effect and the key are both
//!    absent, so a retry simply runs again.
//!
//! The key rows are the records of [`PostgresStore`](crate::PostgresStore), in the same
//! table and format: [`PostgresStore::migrate`](crate::PostgresStore::migrate) creates
//! the table, its sweeper deletes expired rows, and
//! [`get`](retrysafe_core::store::IdempotencyStore::get) reads them. A key row is only
//! ever committed `completed`; a key should be guarded by one layer only (a record a
//! store-backed `IdempotencyLayer` holds in progress counts here as in flight).
//!
//! ```no_run
//! use axum::{Router, routing::post, http::StatusCode};
//! use retrysafe::postgres::{PostgresStore, sqlx};
//! use retrysafe::postgres::tx::{IdempotentTx, TxBackend, TxIdempotencyLayer};
//! use retrysafe::idempotency::Principal;
//!
//! async fn pay(mut tx: IdempotentTx, body: String) -> Result<(StatusCode, String), StatusCode> {
//!     // The effect, in the request's transaction: it commits with the key, or not at all.
//!     let id: i64 = sqlx::query_scalar(
//!         "INSERT INTO payments (account, amount_cents) VALUES ($1, 500) RETURNING id",
//!     )
//!     .bind(body)
//!     .fetch_one(&mut *tx)
//!     .await
//!     .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?; // a 5xx rolls everything back
//!     Ok((StatusCode::CREATED, format!("payment {id}")))
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
//! store.migrate().await?; // the key table, shared with the store
//! let sweeper = store.spawn_sweeper(std::time::Duration::from_secs(60), 1_000)?;
//!
//! let app: Router = Router::new()
//!     .route("/payments", post(pay))
//!     .layer(TxIdempotencyLayer::with_backend(TxBackend::from_store(&store)).require_key())
//!     // authentication, outside: inserts the Principal that scopes the keys
//!     .layer(axum::middleware::map_request(|mut req: axum::extract::Request| async move {
//!         req.extensions_mut().insert(Principal::new("alice"));
//!         req
//!     }));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app).await?;
//! sweeper.stop().await;
//! # Ok(()) }
//! ```
//!
//! # One layer, two backends
//!
//! [`TxIdempotencyLayer`] is the
//! [`IdempotencyLayer`](retrysafe_tower::idempotency::IdempotencyLayer) of
//! `retrysafe-tower` over a [`TxBackend`] instead of a store: the same code decides which
//! requests are guarded, reads the key and the scope, limits and fingerprints the body,
//! bounds the requests in flight, answers with the same problems and reports the same
//! events. The guard's settings (methods, key, scope, limits, retention, in-flight
//! policy, problem answers, events, shutdown) are therefore the `IdempotencyLayer`'s
//! builder methods; the transaction's (pool, table, timeouts) are the
//! [`TxBackend`]'s, set before the layer is built:
//!
//! ```no_run
//! # use std::time::Duration;
//! # use retrysafe::postgres::PostgresStore;
//! # use retrysafe::postgres::tx::{TxBackend, TxIdempotencyLayer};
//! # async fn run(store: PostgresStore) -> Result<(), Box<dyn std::error::Error>> {
//! let backend = TxBackend::from_store(&store)
//!     .idle_in_transaction_timeout(Duration::from_secs(5));
//! let layer = TxIdempotencyLayer::with_backend(backend)
//!     .require_key()
//!     .retention(Duration::from_secs(3600))
//!     .build()?; // names every refused setting, the backend's included
//! assert_eq!(layer.backend().table_name(), store.table());
//! # Ok(()) }
//! ```
//!
//! **Handlers must not make remote calls inside the transaction** (HTTP, gRPC, a
//! message broker, another database): those effects do not roll back with it, and while
//! the handler waits for them the transaction holds its connection, its row locks and
//! the key's lock. Do them before (idempotently, with
//! [`IdempotencyContext::child_key`](retrysafe_core::idempotency::IdempotencyContext::child_key))
//! or after (an outbox table written in the transaction). Likewise, never run `COMMIT`
//! or `ROLLBACK` as SQL on the guard.
//!
//! # What each request gets
//!
//! | situation | answer | transaction and key row |
//! |---|---|---|
//! | method not guarded (default: other than POST, PATCH), or gRPC | passes through | none |
//! | no key, key not required | the handler's answer, no deduplication (its body is read first, like a keyed one's) | a transaction of its own, committed or rolled back by the rules below, no key row |
//! | no key with [`require_key`](retrysafe_tower::idempotency::IdempotencyLayer::require_key) | 400 `key-missing` | none |
//! | key empty, over 255 characters, not printable ASCII, or sent twice | 400 `key-invalid` | none |
//! | no scope (no [`Principal`]) | 500 `scope-missing` | none |
//! | body over the limit (1 MiB) | 413 `body-too-large`, before any connection is taken | none |
//! | body not arrived within [`request_body_timeout`](retrysafe_tower::idempotency::IdempotencyLayer::request_body_timeout) (30 s, or the deadline) | 408 `body-timeout`, before any connection is taken | none |
//! | no connection and transaction within the deadline (1 s) | 503 `store-unavailable` with `retry-after` | none |
//! | first request | the handler runs | key row inserted with the lock |
//! | same key and request, committed | the stored response, `idempotent-replayed: true` | rolled back (read only) |
//! | same key and request, in flight (lock busy) | 409 `request-in-flight` with `retry-after`, at once; or, with [`wait_for_in_flight`](retrysafe_tower::idempotency::IdempotencyLayer::wait_for_in_flight), the replay | rolled back before waiting |
//! | same key, different request | 422 `key-mismatch`, `do-not-retry: 1` | rolled back |
//! | handler answers 2xx, 3xx, or 4xx but 401/403/408/429 | the answer | key row `completed` with the response, one commit with the effect |
//! | handler answers 401, 403, 429, 5xx or 408, or marks [`NoEffect`] | the answer (a 5xx is not marked `do-not-retry`) | rolled back: no key, no effect |
//! | handler panics | 500 `handler-panicked`, no `do-not-retry` | rolled back |
//! | a statement of the handler failed (aborting the transaction) and it answers anyway | a 4xx is passed on, not stored; anything else becomes 500 `handler-panicked` | nothing committed (run statements that may fail in a savepoint: `tx.begin()`) |
//! | handler keeps its [`IdempotentTx`] after answering | 500 `transaction-leaked` | rolled back (when the guard drops, or the server ends the idle session) |
//! | response body over 1 MiB | the response, streamed | key row `completed` as not stored, committed before the rest streams; later copies get 409 `response-not-stored` |
//! | key row write or commit fails | 503 `store-unavailable` with `retry-after` | committed or not: a retry replays or runs |
//! | client disconnects, or the process crashes | — | a disconnect changes nothing (the task runs on); a crash commits nothing |
//! | more than 1024 guarded requests in flight | 503 `overloaded` with `retry-after` | none |
//!
//! The problem answers are the `IdempotencyLayer`'s
//! ([`Problem`](retrysafe_tower::idempotency::Problem), replaceable with
//! [`problem_responder`](retrysafe_tower::idempotency::IdempotencyLayer::problem_responder)).
//!
//! # Execution model
//!
//! As with the `IdempotencyLayer`: after the body is buffered and fingerprinted, one
//! spawned task (bounded by `max_in_flight`, tracked by
//! [`shutdown_handle`](retrysafe_tower::idempotency::IdempotencyLayer::shutdown_handle)) runs the transaction and
//! the handler; dropping the response future cancels nothing. The guard must be gone
//! when the handler's response is returned (an axum handler that takes it as an
//! argument drops it by returning); a response body cannot use it.
//!
//! A copy that finds the key in flight holds no connection while it waits: it uses one
//! only for its own two short statements, then answers 409 at once or, in wait mode,
//! polls with short autocommit reads (one statement each). Fifty copies of one request
//! therefore never exhaust the pool: only the holder keeps a connection. A vanished
//! holder frees the key when the server ends its idle transaction.
//!
//! # Round trips
//!
//! A first request costs **BEGIN and COMMIT plus two statements**, once sqlx has
//! prepared the statements on the connection (its statement cache; the first use of a
//! statement on a connection adds one round trip to prepare it):
//!
//! 1. `BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL idle_in_transaction_session_timeout
//!    = …` — one simple query;
//! 2. the key statement: the advisory lock and the key row's insert, or the existing
//!    record, in one statement;
//! 3. (the handler's own statements;)
//! 4. the key row's completion — `PostgresStore`'s own `complete` statement;
//! 5. `COMMIT`.
//!
//! A replay, a 409 or a 422 costs BEGIN and the key statement; its `ROLLBACK` travels
//! with the ping sqlx sends as the connection goes back to the pool, after the answer.
//! A rolled-back call costs BEGIN, the key statement and `ROLLBACK`. A pool built with
//! sqlx's default `test_before_acquire` adds a ping to every checkout (the pools
//! [`PostgresStore::connect`](crate::PostgresStore::connect) makes do not).
//!
//! # Layer order
//!
//! As for the `IdempotencyLayer`: authentication (inserting the `Principal`) and the
//! deadline layers outside; nothing that cancels the handler or answers 408/5xx for it
//! (a timeout layer) inside.

mod backend;
mod exec;
mod extract;
mod sql;
mod txn;

pub use backend::TxBackend;
pub use extract::{IdempotentTx, IdempotentTxRejection};
pub use retrysafe_core::idempotency::{NoEffect, Principal};
/// Response future of [`TxIdempotencyService`]: the
/// [`IdempotencyLayer`](retrysafe_tower::idempotency::IdempotencyLayer)'s own.
pub use retrysafe_tower::idempotency::ResponseFuture;

/// Applies [`TxIdempotencyService`] to a service: runs each guarded request (POST and PATCH by
/// default) in one PostgreSQL transaction that also holds its idempotency key, so that
/// the key and the handler's effects commit — or roll back — together. See the
/// [module docs](self) for the pattern and the full behaviour.
///
/// It is the [`IdempotencyLayer`](retrysafe_tower::idempotency::IdempotencyLayer) over
/// a [`TxBackend`]: built with
/// [`with_backend`](retrysafe_tower::idempotency::IdempotencyLayer::with_backend), set
/// with the `IdempotencyLayer`'s guard methods (methods, key, scope, limits, retention,
/// in-flight policy, problem answers, events) and the backend's own
/// ([`acquire_timeout`](TxBackend::acquire_timeout), …):
///
/// ```no_run
/// use retrysafe::postgres::PostgresStore;
/// use retrysafe::postgres::tx::{TxBackend, TxIdempotencyLayer};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
/// let layer = TxIdempotencyLayer::with_backend(TxBackend::from_store(&store))
///     .require_key()
///     .max_request_body(64 * 1024)
///     .build()?;
/// # drop(layer);
/// # Ok(()) }
/// ```
///
/// The layer holds its configuration in `Arc`s: cloning it, and applying it to
/// services, is cheap.
pub type TxIdempotencyLayer = retrysafe_tower::idempotency::IdempotencyLayer<TxBackend>;

/// Middleware that runs each guarded request in one PostgreSQL transaction holding its
/// idempotency key: the
/// [`IdempotencyService`](retrysafe_tower::idempotency::IdempotencyService) service over a
/// [`TxBackend`]. Built by [`TxIdempotencyLayer`].
pub type TxIdempotencyService<S> = retrysafe_tower::idempotency::IdempotencyService<S, TxBackend>;
