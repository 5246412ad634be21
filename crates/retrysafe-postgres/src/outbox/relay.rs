//! [`OutboxRelay`]: takes due rows, sends them, and marks what came of it.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use http::{Request, Response};
use retrysafe_core::__private::Validate;
use retrysafe_core::__private::handles::Gauge;
use retrysafe_core::ConfigError;
use retrysafe_core::backoff::{Backoff, Jitter, RetryRng};
use retrysafe_core::error::BoxError;
use retrysafe_core::idempotency::Token;
use retrysafe_core::observe::{Name, names};
use retrysafe_core::store::StoreError;
use sqlx::{PgPool, Row};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower_service::Service;

use super::item::{decode_headers, request_of};
use super::publisher::DynPublisher;
use super::send::{DynHttp, HttpClient, Verdict, publish};
use super::sql::{DEAD, KIND_HTTP, OutboxSql, PENDING, REJECTED, SUCCEEDED};
use super::{Message, Outbox, Publisher};
use crate::store::{db_error, micros};

type Hook = Arc<dyn Fn(&Settled) + Send + Sync>;
type CrashHook = Arc<dyn Fn(i64) -> bool + Send + Sync>;

/// A row that ended `rejected` or `dead`, as the hooks see it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Settled {
    /// The row's id.
    pub id: i64,
    /// Its child key (`Idempotency-Key`, or message id).
    pub key: String,
    /// The URI, or the routing key of a message.
    pub target: String,
    /// Sends started.
    pub attempts: i32,
    /// The last answer's status (HTTP), if any.
    pub status: Option<u16>,
    /// The last error, if any.
    pub error: Option<String>,
    /// The relay's [`name`](OutboxRelay::name).
    pub name: Name,
}

/// What one pass of a relay did ([`OutboxRelay::run_once`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayPass {
    /// Rows taken (with a lease).
    pub taken: usize,
    /// Rows that ended `succeeded`.
    pub succeeded: usize,
    /// Rows that ended `rejected`.
    pub rejected: usize,
    /// Rows that ended `dead`.
    pub dead: usize,
    /// Rows left pending for a later attempt.
    pub retried: usize,
    /// Marks refused because the lease had passed to another relay.
    pub fenced: usize,
    /// A test hook stopped the pass between a send and its mark.
    pub(crate) crashed: bool,
}

/// A background task that delivers the outbox: takes due rows with
/// `FOR UPDATE SKIP LOCKED` and a lease, sends each through the HTTP client stack or
/// the [`Publisher`], and marks the row (fenced by its lease token). See the
/// [module docs](super) for the states and guarantees.
///
/// Defaults: batches of 64 rows, polled every 100 ms when the last batch was not full;
/// a 30 s lease and a 10 s send timeout; backoff from 100 ms doubling to 60 s with
/// full jitter (`retry-after` a minimum); dead-letter age 1 h, checked shorter than the
/// downstream's key retention (default 24 h, the `IdempotencyLayer`'s default);
/// finished rows deleted after 7 days, swept every minute.
///
/// ```
/// use std::time::Duration;
/// use retrysafe::postgres::outbox::OutboxRelay;
/// use retrysafe::postgres::sqlx::postgres::PgPoolOptions;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let pool = PgPoolOptions::new().connect_lazy("postgres://postgres@127.0.0.1:5432/test").unwrap();
/// let error = OutboxRelay::new(pool)
///     .dead_letter_age(Duration::from_secs(48 * 3600))
///     .downstream_key_retention(Duration::from_secs(24 * 3600))
///     .lease(Duration::from_secs(5))
///     .send_timeout(Duration::from_secs(5))
///     .build()
///     .unwrap_err();
/// assert_eq!(
///     error.fields().collect::<Vec<_>>(),
///     ["sender", "send_timeout", "dead_letter_age"]
/// );
/// # }
/// ```
#[must_use]
pub struct OutboxRelay {
    pool: PgPool,
    outbox: Outbox,
    sql: Option<OutboxSql>,
    http: Option<Arc<dyn DynHttp>>,
    publisher: Option<Arc<dyn DynPublisher>>,
    batch: usize,
    poll_interval: Duration,
    lease: Duration,
    send_timeout: Duration,
    backoff: Backoff,
    dead_letter_age: Duration,
    downstream_key_retention: Duration,
    retention: Duration,
    sweep_interval: Duration,
    on_rejected: Option<Hook>,
    on_dead: Option<Hook>,
    crash_after_send: Option<CrashHook>,
    name: Name,
    /// `retrysafe_outbox_backlog`, resolved by `build`.
    backlog: Gauge,
}

impl fmt::Debug for OutboxRelay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxRelay")
            .field("outbox", &self.outbox)
            .field("http", &self.http.is_some())
            .field("publisher", &self.publisher.is_some())
            .field("batch", &self.batch)
            .field("lease", &self.lease)
            .field("send_timeout", &self.send_timeout)
            .field("dead_letter_age", &self.dead_letter_age)
            .finish_non_exhaustive()
    }
}

const DAY: Duration = Duration::from_secs(24 * 3600);

impl OutboxRelay {
    /// A relay of the default outbox table on `pool`, with the defaults above. It
    /// needs an [`http_client`](Self::http_client) or a [`publisher`](Self::publisher)
    /// (or both) before [`build`](Self::build).
    pub fn new(pool: PgPool) -> Self {
        OutboxRelay {
            pool,
            outbox: Outbox::new(),
            sql: None,
            http: None,
            publisher: None,
            batch: 64,
            poll_interval: Duration::from_millis(100),
            lease: Duration::from_secs(30),
            send_timeout: Duration::from_secs(10),
            backoff: Backoff::new(
                Duration::from_millis(100),
                Duration::from_secs(60),
                Jitter::Full,
            ),
            dead_letter_age: Duration::from_secs(3600),
            downstream_key_retention: DAY,
            retention: 7 * DAY,
            sweep_interval: Duration::from_secs(60),
            on_rejected: None,
            on_dead: None,
            crash_after_send: None,
            name: Name::default(),
            backlog: Gauge::default(),
        }
    }

    /// The relay's name (default `default`): the `name` of its hooks' rows and of its
    /// metric `retrysafe_outbox_backlog` (rows not yet delivered, counted after each
    /// pass while a recorder is installed), which [`build`](Self::build) resolves.
    pub fn name(mut self, name: impl Into<Name>) -> Self {
        self.name = name.into();
        self
    }

    /// The outbox table (default: [`Outbox::new`]).
    pub fn outbox(mut self, outbox: Outbox) -> Self {
        self.outbox = outbox;
        self
    }

    /// The tower client stack HTTP rows are sent through, as `Request<B>` with `B`
    /// built from the stored body (`axum::body::Body`, `http_body_util::Full<Bytes>`,
    /// …). It should add authentication, which the outbox never stores; its retries,
    /// if any, happen within one send (bounded by [`send_timeout`](Self::send_timeout)).
    pub fn http_client<S, B, RB>(mut self, client: S) -> Self
    where
        S: Service<Request<B>, Response = Response<RB>> + Clone + Send + Sync + 'static,
        S::Future: Send + 'static,
        S::Error: Into<BoxError>,
        B: From<Bytes> + Send + 'static,
        RB: Send + 'static,
    {
        self.http = Some(Arc::new(HttpClient {
            service: client,
            body: PhantomData,
        }));
        self
    }

    /// The publisher message rows are published with.
    pub fn publisher(mut self, publisher: impl Publisher) -> Self {
        self.publisher = Some(Arc::new(publisher));
        self
    }

    /// Rows taken per pass (1 to 10,000; default 64), sent concurrently.
    pub fn batch(mut self, rows: usize) -> Self {
        self.batch = rows;
        self
    }

    /// How long the relay sleeps after a pass that found fewer rows than a batch
    /// (default 100 ms): the most a row waits after its commit, at low load.
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll_interval = every;
        self
    }

    /// How long a relay holds the rows it took (default 30 s): when it dies, another
    /// relay takes them after that. Must be longer than the send timeout.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The longest one send may take (default 10 s); a send cut off is retried.
    pub fn send_timeout(mut self, timeout: Duration) -> Self {
        self.send_timeout = timeout;
        self
    }

    /// The backoff between sends of one row (`retry-after` is a minimum).
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// How long after its commit a row that keeps failing is given up as `dead`
    /// (default 1 h). Must be shorter than the downstream's key retention.
    pub fn dead_letter_age(mut self, age: Duration) -> Self {
        self.dead_letter_age = age;
        self
    }

    /// How long the downstream keeps an idempotency key (default 24 h): a row sent
    /// again after that would run its effect again, so the dead-letter age must be
    /// shorter.
    pub fn downstream_key_retention(mut self, retention: Duration) -> Self {
        self.downstream_key_retention = retention;
        self
    }

    /// How long finished rows are kept before they are deleted (default 7 days).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// How often the relay deletes finished rows past their retention (default 60 s).
    pub fn sweep_interval(mut self, every: Duration) -> Self {
        self.sweep_interval = every;
        self
    }

    /// Called for each row that ends `rejected` (a final 4xx).
    pub fn on_rejected(mut self, hook: impl Fn(&Settled) + Send + Sync + 'static) -> Self {
        self.on_rejected = Some(Arc::new(hook));
        self
    }

    /// Called for each row that ends `dead` (past the dead-letter age).
    pub fn on_dead(mut self, hook: impl Fn(&Settled) + Send + Sync + 'static) -> Self {
        self.on_dead = Some(Arc::new(hook));
        self
    }

    /// Test hook: called with a row's id after its send and before its mark; `true`
    /// stops the relay there, as a crash would (the row stays leased).
    #[doc(hidden)]
    pub fn __crash_after_send(
        mut self,
        hook: impl Fn(i64) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.crash_after_send = Some(Arc::new(hook));
        self
    }

    /// Validates the settings, naming every refused one.
    pub fn build(mut self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        v.check(
            self.http.is_some() || self.publisher.is_some(),
            "sender",
            "needs an http_client or a publisher",
        );
        v.check(
            (1..=10_000).contains(&self.batch),
            "batch",
            "must be 1 to 10,000",
        );
        for (value, field) in [
            (self.poll_interval, "poll_interval"),
            (self.lease, "lease"),
            (self.send_timeout, "send_timeout"),
            (self.dead_letter_age, "dead_letter_age"),
            (self.sweep_interval, "sweep_interval"),
        ] {
            v.timeout(value, field);
        }
        v.check(
            self.send_timeout < self.lease,
            "send_timeout",
            "must be shorter than the lease",
        );
        v.check(
            self.dead_letter_age < self.downstream_key_retention,
            "dead_letter_age",
            "must be shorter than the downstream's key retention",
        );
        v.check(
            !self.retention.is_zero() && self.retention <= 366 * DAY,
            "retention",
            "must be greater than zero and at most 366 days",
        );
        v.take(self.backoff.build());
        self.sql = v.take(self.outbox.sql());
        self.backlog = Gauge::new(names::OUTBOX_BACKLOG, &self.name);
        v.finish(self)
    }

    /// One pass: takes up to a batch of due rows, sends them concurrently and marks
    /// each. For a relay driven by a scheduler of its own; [`spawn`](Self::spawn)
    /// loops over it.
    pub async fn run_once(&self) -> Result<RelayPass, StoreError> {
        let sql = self.statements()?;
        let token = Token::random();
        let rows = sqlx::query(&sql.take)
            .bind(token.to_bytes().to_vec())
            .bind(micros(self.lease))
            .bind(i64::try_from(self.batch).unwrap_or(i64::MAX))
            .bind(micros(self.dead_letter_age))
            .fetch_all(&self.pool)
            .await
            .map_err(db_error)?;
        let rows: Vec<Taken> = rows.iter().filter_map(Taken::read).collect();
        let mut pass = RelayPass {
            taken: rows.len(),
            ..RelayPass::default()
        };
        // Each row is marked as soon as its own send ends: a quick answer does not wait
        // for a slow one.
        let outcomes = join_all(rows.iter().map(|row| self.deliver(sql, &token, row))).await;
        for (row, outcome) in rows.iter().zip(outcomes) {
            match outcome? {
                None => pass.crashed = true,
                Some((_, false)) => pass.fenced += 1,
                Some((mark, true)) => self.settled(row, &mark, &mut pass),
            }
        }
        if self.backlog.enabled() {
            self.count_backlog(sql).await?;
        }
        Ok(pass)
    }

    /// Sets `retrysafe_outbox_backlog` to the rows not yet delivered.
    async fn count_backlog(&self, sql: &OutboxSql) -> Result<(), StoreError> {
        let (rows,): (i64,) = sqlx::query_as(&sql.backlog)
            .fetch_one(&self.pool)
            .await
            .map_err(db_error)?;
        self.backlog.set(rows as f64);
        Ok(())
    }

    /// Sends one row and marks it; the mark and whether it held (`None`: the test hook
    /// stopped it in between).
    async fn deliver(
        &self,
        sql: &OutboxSql,
        token: &Token,
        row: &Taken,
    ) -> Result<Option<(Mark, bool)>, StoreError> {
        let verdict = self.send(row).await;
        if verdict.is_some() && self.crash_after_send.as_ref().is_some_and(|h| h(row.id)) {
            return Ok(None);
        }
        let mark = self.plan(row, verdict);
        let held = self.mark(sql, token, row, &mark).await?;
        Ok(Some((mark, held)))
    }

    fn statements(&self) -> Result<&OutboxSql, StoreError> {
        self.sql
            .as_ref()
            .ok_or_else(|| StoreError::unavailable("the relay was not built: call build()"))
    }

    /// Sends one row; `None` for a row past its dead-letter age, which is not sent.
    async fn send(&self, row: &Taken) -> Option<Verdict> {
        if row.too_old {
            return None;
        }
        let sending = if row.kind == KIND_HTTP {
            let Some(http) = &self.http else {
                return Some(Verdict::failed("the relay has no HTTP client"));
            };
            match request_of(
                &row.method,
                &row.target,
                decode_headers(&row.headers),
                row.body.clone(),
                &row.key,
            ) {
                Ok(request) => http.send(request),
                Err(e) => return Some(Verdict::failed(format!("unreadable request: {e}"))),
            }
        } else {
            let message = Message::from_row(
                &row.method,
                &row.target,
                decode_headers(&row.headers),
                row.body.clone(),
            );
            Box::pin(publish(self.publisher.clone(), row.key.clone(), message))
        };
        Some(
            match tokio::time::timeout(self.send_timeout, sending).await {
                Ok(verdict) => verdict,
                Err(_) => Verdict::failed("the send timed out"),
            },
        )
    }

    /// What a verdict makes of a row: its next state, or its next attempt's delay.
    fn plan(&self, row: &Taken, verdict: Option<Verdict>) -> Mark {
        let finish = |state, status, error| Mark {
            state,
            status,
            error,
            delay: None,
        };
        match verdict {
            None => finish(DEAD, None, Some("past the dead-letter age".to_owned())),
            Some(Verdict::Succeeded(status)) => finish(SUCCEEDED, status, None),
            Some(Verdict::Rejected(status)) => finish(REJECTED, Some(status), None),
            Some(Verdict::Retry {
                status,
                error,
                min_delay,
            }) => {
                let throttled = matches!(status, Some(429 | 503));
                let retries = u32::try_from(row.attempts.saturating_sub(1)).unwrap_or(0);
                let mut rng = RetryRng::from_os();
                let delay = self
                    .backoff
                    .delay(retries, Duration::ZERO, throttled, &mut rng);
                Mark {
                    state: PENDING,
                    status,
                    error,
                    delay: Some(delay.max(min_delay)),
                }
            }
        }
    }

    /// Writes `mark` to the row, fenced by the lease token: `false` when the lease had
    /// passed to another relay.
    async fn mark(
        &self,
        sql: &OutboxSql,
        token: &Token,
        row: &Taken,
        mark: &Mark,
    ) -> Result<bool, StoreError> {
        let query = match mark.delay {
            Some(delay) => sqlx::query(&sql.retry)
                .bind(row.id)
                .bind(token.to_bytes().to_vec())
                .bind(micros(delay)),
            None => sqlx::query(&sql.finish)
                .bind(row.id)
                .bind(token.to_bytes().to_vec())
                .bind(mark.state),
        };
        let done = query
            .bind(mark.status.map(i32::from))
            .bind(mark.error.as_deref())
            .execute(&self.pool)
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected() == 1)
    }

    /// Counts a marked row, and tells the hooks of a rejected or dead one.
    fn settled(&self, row: &Taken, mark: &Mark, pass: &mut RelayPass) {
        let hook = match (mark.delay, mark.state) {
            (Some(_), _) => {
                pass.retried += 1;
                return;
            }
            (None, SUCCEEDED) => {
                pass.succeeded += 1;
                return;
            }
            (None, REJECTED) => {
                pass.rejected += 1;
                tracing::warn!(target: "retrysafe::outbox", name = self.name.as_str(), id = row.id, status = mark.status, "outbox row rejected");
                &self.on_rejected
            }
            (None, _) => {
                pass.dead += 1;
                tracing::error!(target: "retrysafe::outbox", name = self.name.as_str(), id = row.id, attempts = row.attempts, "outbox row dead-lettered");
                &self.on_dead
            }
        };
        if let Some(hook) = hook {
            hook(&Settled {
                id: row.id,
                key: row.key.clone(),
                target: row.target.clone(),
                attempts: row.attempts,
                status: mark.status,
                error: mark.error.clone(),
                name: self.name.clone(),
            });
        }
    }

    /// Deletes up to `batch` finished rows past the retention; returns how many.
    pub async fn sweep(&self, batch: i64) -> Result<u64, StoreError> {
        let sql = self.statements()?;
        let done = sqlx::query(&sql.sweep)
            .bind(micros(self.retention))
            .bind(batch)
            .execute(&self.pool)
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected())
    }

    /// Runs the relay on a tokio task until [`RelayHandle::stop`]: a pass, then at once
    /// another when the batch was full, else after the poll interval; a sweep every
    /// sweep interval. Errors (the database away) are logged and retried after the
    /// poll interval.
    pub fn spawn(self) -> RelayHandle {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(self.run(stopped));
        RelayHandle { stop, task }
    }

    async fn run(self, mut stopped: watch::Receiver<bool>) {
        let mut next_sweep = Instant::now();
        while !*stopped.borrow() {
            let full = match self.run_once().await {
                Ok(pass) if pass.crashed => return,
                Ok(pass) => pass.taken >= self.batch,
                Err(e) => {
                    tracing::warn!(target: "retrysafe::outbox", name = self.name.as_str(), error = %e, "outbox pass failed");
                    false
                }
            };
            if Instant::now() >= next_sweep {
                next_sweep = Instant::now() + self.sweep_interval;
                if let Err(e) = self.sweep(1_000).await {
                    tracing::warn!(target: "retrysafe::outbox", name = self.name.as_str(), error = %e, "outbox sweep failed");
                }
            }
            if !full
                && let Ok(Err(_)) =
                    tokio::time::timeout(self.poll_interval, stopped.changed()).await
            {
                // The handle is gone, and with it the stop signal: keep the pace
                // instead of passing again at once.
                tokio::time::sleep(self.poll_interval).await;
            }
        }
    }
}

/// The handle of a [spawned](OutboxRelay::spawn) relay. Dropping it leaves the relay
/// running.
#[derive(Debug)]
pub struct RelayHandle {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl RelayHandle {
    /// Stops the relay after its current pass and waits for it.
    pub async fn stop(self) {
        self.stop.send_replace(true);
        let _ = self.task.await;
    }

    /// Ends the relay at once, wherever it is, as a crash would: rows it took stay
    /// leased until their lease ends, then another relay takes them.
    pub fn abort(self) {
        self.task.abort();
    }

    /// Whether the relay's task has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

/// What a pass writes to a row it took.
struct Mark {
    /// The terminal state, or `PENDING` with a `delay`.
    state: i16,
    status: Option<u16>,
    error: Option<String>,
    /// The delay before the next attempt, for a row left pending.
    delay: Option<Duration>,
}

/// A row a pass took.
struct Taken {
    id: i64,
    key: String,
    kind: i16,
    method: String,
    target: String,
    headers: Vec<u8>,
    body: Bytes,
    attempts: i32,
    too_old: bool,
}

impl Taken {
    fn read(row: &sqlx::postgres::PgRow) -> Option<Taken> {
        let body: Vec<u8> = row.try_get("body").ok()?;
        Some(Taken {
            id: row.try_get("id").ok()?,
            key: row.try_get("child_key").ok()?,
            kind: row.try_get("kind").ok()?,
            method: row.try_get("method").ok()?,
            target: row.try_get("target").ok()?,
            headers: row.try_get("headers").ok()?,
            body: Bytes::from(body),
            attempts: row.try_get("attempts").ok()?,
            too_old: row.try_get("too_old").ok()?,
        })
    }
}
