//! The store engine: inside the layer's detachable task (see `service::spawned`),
//! drives the idempotency protocol over an [`IdempotencyStore`]: claim the key, run the
//! handler with its lease renewed, capture the response and complete the record.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response};
use http_body::Body;
use retrysafe_core::__private::idempotency_context;
use retrysafe_core::__private::protocol::Protocol;
use retrysafe_core::__private::protocol::{Claimed, Note, Settle, Settled, Step, Waited};
use retrysafe_core::idempotency::{
    CommitPoint, Completed, Fingerprint, IdempotencyContext, Principal, RecordId, RequestInfo,
    Token,
};
use retrysafe_core::store::{BoxStore, Claim, ClaimOutcome, IdempotencyStore, StoreError};
use retrysafe_core::{ConfigError, Deadline};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::body::{RequestBody, ResponseBody};
use super::engine::{Engine, abandon, answer_of, conclude, negotiate};
use super::event::{EventKind, ReconcileHook, UnknownOutcome, UnknownReason};
use super::guard::{Answer, Backend, Call, Captured, Guard, Guarded, GuardedRequest, Handler};
use super::observe::{Metrics, RoundTrips, StoreOp};
use super::timer;

/// The [`Backend`] of an [`IdempotencyLayer`](super::IdempotencyLayer) over an
/// [`IdempotencyStore`]: claim the key (a lease and a token), run the handler with the
/// lease renewed, store its response, and mark a call whose outcome cannot be known
/// `outcome_unknown`. Made by [`IdempotencyLayer::new`](super::IdempotencyLayer::new)
/// and set with the layer's methods ([`lease`](super::IdempotencyLayer::lease),
/// [`fail_open`](super::IdempotencyLayer::fail_open), …).
#[derive(Clone)]
pub struct StoreBackend {
    pub(crate) store: BoxStore,
    pub(crate) lease: Duration,
    pub(crate) max_execution: Duration,
    pub(crate) store_timeout: Duration,
    pub(crate) fail_open: bool,
    pub(crate) commit_point: CommitPoint,
    pub(crate) on_outcome_unknown: Option<ReconcileHook>,
    /// Keep the raw key beside pending records, for a resolver.
    pub(crate) store_keys: bool,
}

impl fmt::Debug for StoreBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreBackend")
            .field("store", &self.store)
            .field("lease", &self.lease)
            .field("max_execution", &self.max_execution)
            .field("store_timeout", &self.store_timeout)
            .field("fail_open", &self.fail_open)
            .finish_non_exhaustive()
    }
}

impl Backend for StoreBackend {
    /// A lease must exceed three store call timeouts: the lease is renewed every third
    /// of it, and each renewal must be able to take its whole timeout and still land
    /// before the lease it extends has run out.
    fn conflicts(&self) -> Option<ConfigError> {
        (self.lease <= self.store_timeout.saturating_mul(3))
            .then(|| ConfigError::new("lease", "must be longer than three store_timeout"))
    }

    async fn run<H: Handler>(&self, call: Call<'_, H>) -> Answer<H> {
        match call.request {
            Guarded::Keyed(request) => execute(call.guard, self, call.handler, request).await,
            Guarded::Unkeyed(request) => Call::unguarded(call.handler, request).await,
        }
    }
}

impl StoreBackend {
    /// Runs one store call bounded by the store timeout and the request's deadline.
    async fn bounded<T>(
        &self,
        deadline: Option<Deadline>,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let limit = Deadline::bound(deadline, self.store_timeout);
        timer::within(limit, call)
            .await
            .unwrap_or(Err(StoreError::Timeout))
    }

    fn reconcile(
        &self,
        guard: &Guard,
        record: &RecordId,
        reason: UnknownReason,
        info: &RequestInfo,
        note: Option<Bytes>,
    ) {
        tracing::warn!(
            target: "retrysafe::idempotency",
            event = EventKind::OutcomeUnknown.as_str(),
            record = ?record,
            reason = ?reason,
            "idempotency record has an unknown outcome; it will not be re-run"
        );
        guard.became_unknown(reason);
        guard.emit(EventKind::OutcomeUnknown, Some(record));
        if let Some(f) = &self.on_outcome_unknown {
            let request = Some(Arc::new(info.clone()));
            f(&UnknownOutcome::new(*record, reason).with_request(request, note));
            // Told: a reconciler need not tell it again (best effort; at worst it is
            // told twice).
            let (store, id, timeout) = (self.store.clone(), *record, self.store_timeout);
            guard.shared.tracker.spawn(async move {
                let _ = tokio::time::timeout(timeout, store.mark_notified(&id)).await;
            });
        }
    }
}

/// Inside the layer's detachable task: claim (and wait, in wait mode), then replay or run.
async fn execute<H: Handler>(
    guard: &Guard,
    backend: &StoreBackend,
    handler: H,
    request: GuardedRequest,
) -> Answer<H> {
    let policy = guard
        .policy()
        .fail_open(backend.fail_open)
        .reconciled(backend.store.reconciled());
    let mut protocol = Protocol::new(&policy, request.fingerprint, request.deadline());
    let mut engine = StoreEngine::new(guard, backend, &request);
    let step = negotiate(guard, &mut protocol, &mut engine, &request.span).await;
    match step {
        Step::Run => engine.run(guard, &mut protocol, handler, request).await,
        Step::RunUnguarded => {
            let req = Request::from_parts(request.parts, RequestBody::buffered(request.body));
            handler
                .call(req)
                .await
                .map(|res| res.map(ResponseBody::stream))
        }
        step => Ok(answer_of(guard, step)),
    }
}

/// The I/O of one guarded request over a store.
struct StoreEngine<'a> {
    backend: &'a StoreBackend,
    id: RecordId,
    deadline: Option<Deadline>,
    fingerprint: Fingerprint,
    retention: Duration,
    /// The token of the last claim.
    token: Token,
    /// When the claim was ours (set by `run`).
    claimed_at: Option<Instant>,
    /// The lease as the renewal task last renewed it; shared with that task, so made
    /// only when it starts.
    lease: Option<Arc<Lease>>,
    /// The renewal task, spawned once the handler may outlive a third of its lease.
    renewal: Option<Renewal>,
    /// The handler's view of the claim (set by `run`): the renewal task marks its
    /// lease lost there.
    context: Option<IdempotencyContext>,
    /// When the handler (and the capture of its response) must be done by (set by
    /// `run`).
    cap: Option<Instant>,
    /// What the store keeps of the request for recovery.
    info: RequestInfo,
    /// The store round trips, for the request's span and the store histogram.
    trips: RoundTrips,
    /// The layer's rules (its metrics).
    guard: &'a Guard,
}

impl<'a> StoreEngine<'a> {
    fn new(guard: &'a Guard, backend: &'a StoreBackend, request: &GuardedRequest) -> Self {
        StoreEngine {
            backend,
            id: request.record_id(),
            deadline: request.deadline(),
            fingerprint: request.fingerprint,
            retention: guard.retention(),
            // Every claim draws its own token; this one is never sent.
            token: Token::from_bytes([0; 16]),
            claimed_at: None,
            lease: None,
            renewal: None,
            context: None,
            cap: None,
            info: request_info(backend, request),
            trips: guard.round_trips(request.span.clone()),
            guard,
        }
    }

    /// Runs the handler of a claim that is ours, then settles the record. A handler
    /// still running at `max_execution`, or whose lease was lost, is cancelled.
    async fn run<H: Handler>(
        &mut self,
        guard: &Guard,
        protocol: &mut Protocol,
        handler: H,
        request: GuardedRequest,
    ) -> Answer<H> {
        let backend = self.backend;
        let token = self.token;
        // The handler runs in this (detachable) task: re-scope the inherited call
        // context (as a task-local and an extension), now carrying the record, so
        // outbound client layers derive child keys and report back when they give up.
        let (req, call_context) = request.into_request(|scope, key| {
            let context = idempotency_context(
                self.id,
                scope,
                key,
                token,
                backend.store.clone(),
                backend.store_timeout,
            );
            self.context = Some(context.clone());
            context
        });
        let claimed_at = Instant::now();
        self.claimed_at = Some(claimed_at);
        self.cap = Some(claimed_at + backend.max_execution);
        let outcome = {
            let handler = AssertUnwindSafe(call_context.scope(handler.call(req))).catch_unwind();
            // Pinned here and polled in place: the handler's future is never moved. It
            // is dropped at the end of this block, so a cancelled handler is gone
            // before its record is settled.
            self.supervised(std::pin::pin!(handler)).await
        };
        match outcome {
            Some(outcome) => conclude(guard, protocol, self, outcome).await,
            None => {
                let before = self.cancelled();
                abandon(guard, protocol, self, before).await
            }
        }
    }

    /// Awaits the handler with its lease renewed; `None` once it was cancelled: when
    /// `max_execution` has passed, or its lease was lost.
    async fn supervised<F: Future>(&mut self, mut work: Pin<&mut F>) -> Option<F::Output> {
        let cap = self.cap();
        if let Some(out) = self.until_renewal(work.as_mut(), Some(cap)).await {
            return Some(out);
        }
        let context = self.context.clone();
        let lost = async {
            match &context {
                Some(c) => c.until_lease_lost().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            out = &mut work => Some(out),
            () = tokio::time::sleep_until(cap) => None,
            () = lost => None,
        }
    }

    /// Reports the cancelled handler; whether it was still before its declared commit
    /// point (then nothing happened and its key can be released).
    fn cancelled(&self) -> bool {
        let lost = self
            .context
            .as_ref()
            .is_some_and(IdempotencyContext::lease_lost);
        let committed = self
            .context
            .as_ref()
            .is_some_and(IdempotencyContext::is_committed);
        let before = self.backend.commit_point == CommitPoint::Before && !committed;
        let why = if lost {
            "the handler's lease was lost (another copy may have taken over)"
        } else {
            "the handler exceeded max_execution"
        };
        tracing::warn!(
            target: "retrysafe::idempotency",
            record = ?self.id,
            before_commit_point = before,
            "{why}; it is cancelled"
        );
        before
    }

    /// Awaits `work` with the lease renewed (the capture of a response, which bounds
    /// its own time).
    async fn renewed<F: Future>(&mut self, mut work: Pin<&mut F>) -> F::Output {
        match self.until_renewal(work.as_mut(), None).await {
            Some(out) => out,
            None => work.await,
        }
    }

    /// Awaits `work` until the lease must first be renewed — a third of a lease after
    /// the claim, or `until` if sooner — and starts the renewal task then: the output
    /// if `work` finished first, `None` once the task runs (a request answered sooner
    /// never arms it).
    async fn until_renewal<F: Future>(
        &mut self,
        mut work: Pin<&mut F>,
        until: Option<Instant>,
    ) -> Option<F::Output> {
        let Some(claimed_at) = self.claimed_at else {
            return Some(work.await);
        };
        if self.renewal.is_some() {
            return None;
        }
        let third = claimed_at + self.backend.lease / 3;
        let first = until.map_or(third, |u| u.min(third));
        // The timer is made on its first poll only: a handler that is ready at once
        // never touches the timer wheel.
        tokio::select! {
            biased;
            out = &mut work => return Some(out),
            () = async { tokio::time::sleep_until(first).await } => {}
        }
        let lease = Arc::new(Lease::new(claimed_at, self.backend.lease));
        self.lease = Some(Arc::clone(&lease));
        self.renewal = Some(Renewal::spawn(
            self.backend,
            self.guard,
            (self.id, self.token),
            self.cap(),
            lease,
            self.context.clone(),
        ));
        None
    }

    /// When the handler and the capture of its response must be done by.
    fn cap(&self) -> Instant {
        self.cap.unwrap_or_else(Instant::now)
    }

    /// The end of the claim's lease, as last renewed.
    fn lease_until(&self) -> Instant {
        match (&self.lease, self.claimed_at) {
            (Some(lease), _) => lease.until(),
            (None, Some(at)) => at + self.backend.lease,
            (None, None) => Instant::now(),
        }
    }
}

impl Engine for StoreEngine<'_> {
    async fn claim(&mut self) -> Claimed {
        self.token = Token::random();
        let backend = self.backend;
        let claim = Claim::new(
            self.token,
            self.fingerprint,
            backend.lease,
            self.retention,
            backend.commit_point,
        )
        .with_request(&self.info);
        let started = self.trips.start();
        let outcome = backend
            .bounded(self.deadline, backend.store.claim(&self.id, &claim))
            .await;
        self.guard
            .round_trip(&mut self.trips, StoreOp::Claim, started);
        match outcome {
            Ok(ClaimOutcome::Claimed { takeover }) => Claimed::Mine { takeover },
            Ok(ClaimOutcome::Existing {
                record,
                became_unknown,
            }) => Claimed::Existing {
                record,
                became_unknown,
            },
            Err(e) => Claimed::Failed(e),
            // An outcome this release does not know: fail closed.
            Ok(_) => Claimed::Failed(StoreError::unavailable("unknown claim outcome")),
        }
    }

    async fn wait(&mut self, max: Duration) -> Waited {
        let backend = self.backend;
        let started = self.trips.start();
        let wait = tokio::time::timeout(
            max.saturating_add(backend.store_timeout),
            backend.store.wait(&self.id, max),
        )
        .await;
        self.guard
            .round_trip(&mut self.trips, StoreOp::Wait, started);
        match wait {
            Ok(Ok(())) => Waited::LookAgain,
            Ok(Err(e)) => Waited::Failed(e),
            Err(_) => Waited::Failed(StoreError::Timeout),
        }
    }

    async fn capture<B>(&mut self, guard: &Guard, response: Response<B>) -> Option<Captured<B>>
    where
        B: Body<Data = Bytes> + Send,
    {
        let cap = self.cap();
        self.renewed(std::pin::pin!(guard.capture(response, cap)))
            .await
    }

    async fn settle(&mut self, settle: Settle, completed: Option<Completed>) -> Settled {
        let (backend, id, token, retention) = (self.backend, &self.id, self.token, self.retention);
        let until = self.lease_until();
        let store = &backend.store;
        let trips = Some((self.guard, &mut self.trips));
        let written = match (settle, &completed) {
            (Settle::Complete, Some(done)) => {
                let complete = || store.complete(id, token, done, retention);
                write_with_retry(backend, until, trips, StoreOp::Complete, complete).await
            }
            (Settle::Release, _) => {
                let release = || store.release(id, token);
                write_with_retry(backend, until, trips, StoreOp::Release, release).await
            }
            (Settle::MarkUnknown(reason), _) => {
                let mark = || store.mark_unknown(id, token, retention, reason);
                write_with_retry(backend, until, trips, StoreOp::MarkUnknown, mark).await
            }
            _ => Ok(()),
        };
        // The record is settled (or lost): no renewal past this point.
        self.renewal = None;
        match written {
            Ok(()) => Settled::Done,
            Err(e) => Settled::Failed(e),
        }
    }

    fn note(&mut self, guard: &Guard, note: Note) {
        match note {
            Note::Event(kind) => guard.emit(kind, Some(&self.id)),
            Note::Unknown(reason) => {
                let note = self
                    .context
                    .as_ref()
                    .and_then(IdempotencyContext::resolution_note);
                self.backend
                    .reconcile(guard, &self.id, reason, &self.info, note);
            }
            Note::ReleaseClaim => {
                // The claim may have landed and only its reply been lost: take it back,
                // best effort and in the background, retried while its lease lasts, so
                // the key does not sit in progress for a lease.
                let (backend, id, token) = (self.backend.clone(), self.id, self.token);
                let until = Instant::now() + backend.lease;
                guard.shared.tracker.spawn(async move {
                    let release = || backend.store.release(&id, token);
                    // A stale token (nothing landed, or someone else holds it) is final.
                    let _ =
                        write_with_retry(&backend, until, None, StoreOp::Release, release).await;
                });
            }
            _ => {}
        }
    }
}

/// What the store keeps of a guarded request: scope, the principal's label, method,
/// path, and the key when the layer stores keys for resolution.
fn request_info(backend: &StoreBackend, request: &GuardedRequest) -> RequestInfo {
    let label = request
        .parts
        .extensions
        .get::<Principal>()
        .and_then(Principal::label_arc);
    let info = RequestInfo::new(
        request.scope,
        request.parts.method.clone(),
        request.parts.uri.path(),
    )
    .with_label(label);
    if backend.store_keys {
        info.with_key(request.key.clone())
    } else {
        info
    }
}

/// Retries a token-carrying write with backoff while the lease lasts. A stale token is
/// final. Each attempt is a round trip of `op` in `trips`, when given.
async fn write_with_retry<F, Fut>(
    backend: &StoreBackend,
    lease_until: Instant,
    mut trips: Option<(&Guard, &mut RoundTrips)>,
    op: StoreOp,
    mut write: F,
) -> Result<(), StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), StoreError>>,
{
    let mut backoff = Duration::from_millis(10);
    loop {
        let started = trips.as_ref().and_then(|(_, t)| t.start());
        let written = backend.bounded(None, write()).await;
        if let Some((guard, trips)) = trips.as_mut() {
            guard.round_trip(trips, op, started);
        }
        match written {
            Ok(()) => return Ok(()),
            Err(e) if !e.is_transient() => return Err(e),
            Err(e) => {
                let now = Instant::now();
                if now + backoff >= lease_until {
                    return Err(e);
                }
                tracing::debug!(target: "retrysafe::idempotency", error = %e, "store write failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
        }
    }
}

/// The task that renews a claim's lease every third of a lease until `cap`, or until
/// the lease is lost; aborted when dropped (the record is settled). It is a task of its
/// own, so a handler that blocks its thread does not stop its own renewals.
struct Renewal(JoinHandle<()>);

impl Renewal {
    fn spawn(
        backend: &StoreBackend,
        guard: &Guard,
        (id, token): (RecordId, Token),
        cap: Instant,
        lease: Arc<Lease>,
        context: Option<IdempotencyContext>,
    ) -> Self {
        let (store, every, timeout) = (backend.store.clone(), backend.lease, backend.store_timeout);
        let claim = Held {
            id,
            token,
            context,
            metrics: guard.config.metrics().clone(),
        };
        Renewal(tokio::spawn(renew_lease(
            store, every, timeout, claim, cap, lease,
        )))
    }
}

/// The claim a renewal task renews: its record and token, and the handler's view of it
/// (told when the lease is lost).
struct Held {
    id: RecordId,
    token: Token,
    context: Option<IdempotencyContext>,
    /// The layer's metrics (the renewals' round trips).
    metrics: Metrics,
}

impl Drop for Renewal {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Renews now, then every third of `full` until `cap` or until the lease is lost (a
/// renewal refused with a stale token, which the handler's context is told of).
/// Updates `state` on every renewal.
async fn renew_lease(
    store: BoxStore,
    full: Duration,
    timeout: Duration,
    claim: Held,
    cap: Instant,
    state: Arc<Lease>,
) {
    let id = claim.id;
    loop {
        let now = Instant::now();
        let lease = full.min(cap.saturating_duration_since(now));
        if lease.is_zero() {
            return; // past max_execution: the handler is cancelled
        }
        let renewed = tokio::time::timeout(timeout, store.renew(&id, claim.token, lease)).await;
        if claim.metrics.store_enabled() {
            claim.metrics.store(StoreOp::Renew, now.elapsed());
        }
        match renewed {
            Ok(Ok(())) => state.renewed(now, lease),
            Ok(Err(StoreError::StaleToken)) => {
                tracing::warn!(target: "retrysafe::idempotency", record = ?id, "lease lost");
                if let Some(context) = &claim.context {
                    context.mark_lease_lost();
                }
                return;
            }
            Ok(Err(e)) => {
                tracing::warn!(target: "retrysafe::idempotency", record = ?id, error = %e, "lease renewal failed");
            }
            Err(_) => {
                tracing::warn!(target: "retrysafe::idempotency", record = ?id, "lease renewal timed out");
            }
        }
        if lease < full {
            return; // the last renewal, capped by max_execution
        }
        tokio::time::sleep(full / 3).await;
    }
}

/// The end of a claim's lease, as the holder last renewed it. Shared between the
/// renewal future and the writes that must finish while the lease lasts.
struct Lease {
    claimed_at: Instant,
    /// Nanoseconds from `claimed_at` to the end of the lease.
    until_nanos: AtomicU64,
}

impl Lease {
    fn new(claimed_at: Instant, lease: Duration) -> Self {
        Lease {
            claimed_at,
            until_nanos: AtomicU64::new(nanos(lease)),
        }
    }

    fn renewed(&self, at: Instant, lease: Duration) {
        let since = at.saturating_duration_since(self.claimed_at);
        self.until_nanos
            .store(nanos(since.saturating_add(lease)), Ordering::Relaxed);
    }

    fn until(&self) -> Instant {
        self.claimed_at + Duration::from_nanos(self.until_nanos.load(Ordering::Relaxed))
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
