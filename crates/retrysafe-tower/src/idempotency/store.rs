//! The store engine: inside the layer's detachable task, does the I/O of the
//! idempotency protocol over an [`IdempotencyStore`] — claim the key (a lease and a
//! token), run the handler with its lease renewed, store its response or mark its
//! outcome unknown.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response};
use http_body::Body;
use retrysafe_core::__private::idempotency_context;
use retrysafe_core::__private::protocol::Protocol;
use retrysafe_core::__private::protocol::{Claimed, Note, Settle, Settled, Waited};
use retrysafe_core::idempotency::{
    CommitPoint, Completed, Fingerprint, IdempotencyContext, Principal, RecordId, RequestInfo,
    Scope, Token, defaults,
};
use retrysafe_core::store::{BoxStore, Claim, ClaimOutcome, IdempotencyStore, StoreError};
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_core::{CallContext, ConfigError, Deadline};
use tokio::time::Instant;

use super::answers::CapturedResponse;
use super::backend::{Backend, Handler, Served};
use super::body::RequestBody;
use super::engine::{Engine, Ran, drive, unguarded};
use super::event::{EventKind, ReconcileHook, UnknownOutcome, UnknownReason};
use super::renewal::{Held, Registration, Renewable, Renewals};
use super::request::{Admitted, KeyedRequest};
use super::shared::Shared;
use super::telemetry::{RoundTrips, StoreOp};
use super::timer;

/// The default [`Backend`] of an [`IdempotencyLayer`](super::IdempotencyLayer): the
/// claim (a lease and a token), the handler with its lease renewed, and the completion
/// over an [`IdempotencyStore`]; a call whose outcome cannot be known is marked
/// `outcome_unknown`. Made by [`IdempotencyLayer::new`](super::IdempotencyLayer::new)
/// and set with the layer's methods ([`lease`](super::IdempotencyLayer::lease),
/// [`fail_open`](super::IdempotencyLayer::fail_open), …).
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
    /// The claims whose leases are renewed.
    pub(crate) renewals: Renewals,
    /// A reconciler runs for the store in another process.
    pub(crate) reconciled_elsewhere: bool,
}

impl StoreBackend {
    /// The backend over `store`, with the defaults (see
    /// [`IdempotencyLayer::new`](super::IdempotencyLayer::new)).
    pub(crate) fn new(store: BoxStore) -> Self {
        StoreBackend {
            store,
            lease: defaults::LEASE,
            max_execution: defaults::MAX_EXECUTION,
            store_timeout: Duration::from_secs(1),
            fail_open: false,
            commit_point: CommitPoint::Undeclared,
            on_outcome_unknown: None,
            store_keys: false,
            renewals: Renewals::default(),
            reconciled_elsewhere: false,
        }
    }
}

/// A copy is another backend (a layer's builder copies a shared backend to change its
/// settings): it renews its own claims, so a claim of a shorter lease never waits on a
/// driver paced for another backend's.
impl Clone for StoreBackend {
    fn clone(&self) -> Self {
        StoreBackend {
            store: self.store.clone(),
            lease: self.lease,
            max_execution: self.max_execution,
            store_timeout: self.store_timeout,
            fail_open: self.fail_open,
            commit_point: self.commit_point,
            on_outcome_unknown: self.on_outcome_unknown.clone(),
            store_keys: self.store_keys,
            renewals: Renewals::default(),
            reconciled_elsewhere: self.reconciled_elsewhere,
        }
    }
}

impl fmt::Debug for StoreBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreBackend")
            .field("store", &self.store)
            .field("lease", &self.lease)
            .field("max_execution", &self.max_execution)
            .field("store_timeout", &self.store_timeout)
            .field("fail_open", &self.fail_open)
            .field("reconciled_elsewhere", &self.reconciled_elsewhere)
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

    // (An `async` block, not an `async fn`: that would keep a second copy of the
    // arguments in the future, which lies in the request's task.)
    #[allow(
        clippy::manual_async_fn,
        reason = "an `async fn` keeps its arguments twice in its future"
    )]
    fn run<H: Handler>(
        &self,
        shared: &Shared,
        handler: H,
        request: Admitted<H::ReqBody>,
    ) -> impl Future<Output = Served<H>> + Send {
        async move {
            let Admitted::Keyed(keyed) = &request else {
                // Only a backend that guards requests without a key gets one.
                return unguarded(handler, request).await;
            };
            let policy = shared
                .policy()
                .fail_open(self.fail_open)
                .reconciled(self.reconciled_elsewhere || self.store.reconciled());
            let protocol = Protocol::new(&policy, keyed.fingerprint, keyed.deadline());
            let mut engine = StoreEngine::new(shared, self, keyed);
            drive(shared, protocol, &mut engine, handler, request).await
        }
    }
}

impl StoreBackend {
    /// Runs one store call bounded by the store timeout and the request's deadline.
    /// (A combinator, not an `async fn`, which would hold the call twice.)
    fn bounded<T>(
        &self,
        deadline: Option<Deadline>,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> impl Future<Output = Result<T, StoreError>> {
        let limit = Deadline::bound(deadline, self.store_timeout);
        timer::within(limit, call).map(|done| done.unwrap_or(Err(StoreError::Timeout)))
    }

    fn reconcile(
        &self,
        shared: &Shared,
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
        let telemetry = shared.telemetry();
        telemetry.became_unknown(reason);
        telemetry.emit(EventKind::OutcomeUnknown, Some(record));
        if let Some(f) = &self.on_outcome_unknown {
            let request = Some(Arc::new(info.clone()));
            f(&UnknownOutcome::new(*record, reason).with_request(request, note));
            // Told: a reconciler need not tell it again (best effort; at worst it is
            // told twice).
            let (store, id, timeout) = (self.store.clone(), *record, self.store_timeout);
            shared.spawn(async move {
                let _ = tokio::time::timeout(timeout, store.mark_notified(&id)).await;
            });
        }
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
    /// The claim's place among the renewed ones (set by `run`, dropped once the
    /// record is settled).
    renewal: Option<Registration<'a>>,
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
    /// What the layer's requests share (its telemetry).
    shared: &'a Shared,
}

impl<'a> StoreEngine<'a> {
    fn new(shared: &'a Shared, backend: &'a StoreBackend, request: &KeyedRequest) -> Self {
        StoreEngine {
            backend,
            id: request.record_id(),
            deadline: request.deadline(),
            fingerprint: request.fingerprint,
            retention: shared.retention(),
            // Every claim draws its own token; this one is never sent.
            token: Token::from_bytes([0; 16]),
            claimed_at: None,
            renewal: None,
            context: None,
            cap: None,
            info: request_info(backend, request),
            trips: shared.telemetry().round_trips(request.span.clone()),
            shared,
        }
    }

    /// Awaits the handler (its lease renewed by the renewal driver); `None` once it
    /// was cancelled: when `max_execution` has passed, or its lease was lost.
    async fn supervised<F: Future>(&mut self, mut work: Pin<&mut F>) -> Option<F::Output> {
        let cap = self.cap();
        let third = self
            .claimed_at
            .map_or(cap, |at| at + self.backend.lease / 3);
        let context = &self.context;
        // Made on its first poll only: a handler that is ready at once never touches
        // the timer wheel. A lease can only be lost once it was renewed, after a third.
        let stop = async {
            tokio::time::sleep_until(third.min(cap)).await;
            let lost = async {
                match context {
                    Some(c) => c.until_lease_lost().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = tokio::time::sleep_until(cap) => {}
                () = lost => {}
            }
        };
        tokio::select! {
            biased;
            out = &mut work => Some(out),
            () = stop => None,
        }
    }

    /// Where the handler stands against its commit point: `Before` while a handler
    /// that declares one has not reached it (nothing happened yet), `Passed` once it
    /// has, `Undeclared` for handlers that declare none.
    fn commit_point_state(&self) -> CommitPoint {
        let committed = self
            .context
            .as_ref()
            .is_some_and(IdempotencyContext::is_committed);
        match self.backend.commit_point {
            CommitPoint::Before if committed => CommitPoint::Passed,
            declared => declared,
        }
    }

    /// Reports the cancelled handler.
    fn cancelled(&self) {
        let lost = self
            .context
            .as_ref()
            .is_some_and(IdempotencyContext::lease_lost);
        let why = if lost {
            "the handler's lease was lost (another copy may have taken over)"
        } else {
            "the handler exceeded max_execution"
        };
        tracing::warn!(
            target: "retrysafe::idempotency",
            record = ?self.id,
            before_commit_point = self.commit_point_state() == CommitPoint::Before,
            "{why}; it is cancelled"
        );
    }

    /// Registers the claim made at `claimed_at` for renewal until the record is
    /// settled; whether a renewal driver was started for it.
    fn renew(&mut self, claimed_at: Instant) -> bool {
        let backend = self.backend;
        let claim = Renewable {
            store: backend.store.clone(),
            lease: backend.lease,
            timeout: backend.store_timeout,
            claimed_at,
            cap: self.cap(),
            held: Held {
                id: self.id,
                token: self.token,
                context: self.context.clone(),
                config: Arc::clone(&self.shared.config),
            },
        };
        let (registration, started) = backend.renewals.register(claim);
        self.renewal = Some(registration);
        started
    }

    /// When the handler and the capture of its response must be done by.
    fn cap(&self) -> Instant {
        self.cap.unwrap_or_else(Instant::now)
    }

    /// The end of the claim's lease, as last renewed.
    fn lease_until(&self) -> Instant {
        match (&self.renewal, self.claimed_at) {
            (Some(renewal), _) => renewal.lease_until(),
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
        self.shared
            .telemetry()
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
        self.shared
            .telemetry()
            .round_trip(&mut self.trips, StoreOp::Wait, started);
        match wait {
            Ok(Ok(())) => Waited::LookAgain,
            Ok(Err(e)) => Waited::Failed(e),
            Err(_) => Waited::Failed(StoreError::Timeout),
        }
    }

    fn context(&mut self, scope: Scope, key: IdempotencyKey) -> IdempotencyContext {
        let backend = self.backend;
        let context = idempotency_context(
            self.id,
            scope,
            key,
            self.token,
            backend.store.clone(),
            backend.store_timeout,
        );
        self.context = Some(context.clone());
        context
    }

    /// Runs the handler with its lease renewed; cancels it when `max_execution` has
    /// passed or its lease was lost.
    async fn handle<H: Handler>(
        &mut self,
        handler: H,
        request: Request<RequestBody<H::ReqBody>>,
        context: CallContext,
    ) -> Ran<H::ResBody, H::Error> {
        let claimed_at = Instant::now();
        self.claimed_at = Some(claimed_at);
        self.cap = Some(claimed_at + self.backend.max_execution);
        if self.renew(claimed_at) {
            // The renewal driver was just spawned into this worker's own queue: let it
            // arm its timer before the handler can block this thread.
            tokio::task::yield_now().await;
        }
        let handler = AssertUnwindSafe(context.scope(handler.call(request))).catch_unwind();
        // Pinned here and polled in place: the handler's future is never moved. It is
        // dropped before this returns, so a cancelled handler is gone before its record
        // is settled.
        match self.supervised(std::pin::pin!(handler)).await {
            Some(outcome) => Ran::Done(outcome),
            None => {
                self.cancelled();
                Ran::Cancelled
            }
        }
    }

    fn commit_point(&self) -> CommitPoint {
        self.commit_point_state()
    }

    fn capture<B>(
        &mut self,
        shared: &Shared,
        response: Response<B>,
    ) -> impl Future<Output = Option<CapturedResponse<B>>> + Send
    where
        B: Body<Data = Bytes> + Send,
    {
        // The capture's future itself: an `async fn` here would hold the response twice.
        let cap = self.cap();
        shared.answers().capture(response, cap)
    }

    #[allow(
        clippy::manual_async_fn,
        reason = "an `async fn` keeps its arguments twice in its future"
    )]
    fn settle(
        &mut self,
        settle: Settle,
        completed: Option<Completed>,
    ) -> impl Future<Output = Settled> + Send {
        async move {
            let (backend, id, token, retention) =
                (self.backend, &self.id, self.token, self.retention);
            let until = self.lease_until();
            let store = &backend.store;
            let trips = Some((self.shared, &mut self.trips));
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
    }

    fn note(&mut self, shared: &Shared, note: Note) {
        match note {
            Note::Event(kind) => shared.telemetry().emit(kind, Some(&self.id)),
            Note::Unknown(reason) => {
                let note = self
                    .context
                    .as_ref()
                    .and_then(IdempotencyContext::resolution_note);
                self.backend
                    .reconcile(shared, &self.id, reason, &self.info, note);
            }
            Note::ReleaseClaim => {
                // The claim may have landed and only its reply been lost: take it back,
                // best effort and in the background, retried while its lease lasts, so
                // the key does not sit in progress for a lease.
                let (backend, id, token) = (self.backend.clone(), self.id, self.token);
                let until = Instant::now() + backend.lease;
                shared.spawn(async move {
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
fn request_info(backend: &StoreBackend, request: &KeyedRequest) -> RequestInfo {
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
    mut trips: Option<(&Shared, &mut RoundTrips)>,
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
        if let Some((shared, trips)) = trips.as_mut() {
            shared.telemetry().round_trip(trips, op, started);
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::idempotency::IdempotencyLayer;

    // A layer's builder copies a shared backend to change it: the copy renews its own
    // claims (a driver paced for the original's longer lease would renew a shorter one
    // too late), while clones of one layer share the backend and its renewals.
    #[test]
    fn a_copied_backend_has_renewals_of_its_own() {
        let layer = IdempotencyLayer::in_memory();
        let shared = layer.clone();
        assert!(shared.backend.renewals.is(&layer.backend.renewals));
        let shorter = layer.clone().lease(Duration::from_secs(3));
        assert!(!shorter.backend.renewals.is(&layer.backend.renewals));
        assert_eq!(shorter.backend.lease, Duration::from_secs(3));
    }
}
