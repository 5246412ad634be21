//! The store backend: inside the layer's detachable task (see `service::spawned`),
//! claim the key, run the handler with its lease renewed, capture the response and
//! complete the record.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use http::Request;
use retrysafe_core::Deadline;
use retrysafe_core::idempotency::{
    CommitPoint, Completed, Disposition, IdempotencyContext, NoEffect, RecordId, Token,
};
use retrysafe_core::store::{BoxStore, Claim, ClaimOutcome, IdempotencyStore, StoreError};
use retrysafe_core::wire::DO_NOT_RETRY_VALUE;
use tokio::time::Instant;

use super::body::{RequestBody, ResponseBody};
use super::event::{EventKind, ReconcileHook, UnknownOutcome, UnknownReason};
use super::guard::{Answer, Backend, Captured, Guard, GuardedRequest, Handler};
use super::problem::{Problem, ProblemKind};

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
    fn run<H: Handler>(
        &self,
        guard: &Guard,
        handler: H,
        request: GuardedRequest,
    ) -> impl Future<Output = Answer<H>> + Send {
        execute(guard, self, handler, request)
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
        match tokio::time::timeout(limit, call).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout),
        }
    }

    fn reconcile(&self, guard: &Guard, record: &RecordId, reason: UnknownReason) {
        tracing::warn!(
            target: "retrysafe::idempotency",
            event = EventKind::OutcomeUnknown.as_str(),
            record = ?record,
            reason = ?reason,
            "idempotency record has an unknown outcome; it will not be re-run"
        );
        guard.emit(EventKind::OutcomeUnknown, record);
        if let Some(f) = &self.on_outcome_unknown {
            f(&UnknownOutcome {
                record: *record,
                reason,
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
    let id = request.record_id();
    let deadline = request.deadline();
    let fingerprint = request.fingerprint;
    let mut in_flight = guard.in_flight_wait(deadline);
    let mut seen_record = false;
    loop {
        let claim = Claim {
            token: Token::random(),
            fingerprint,
            lease: backend.lease,
            retention: guard.retention(),
            commit_point: backend.commit_point,
        };
        let outcome = backend
            .bounded(deadline, backend.store.claim(&id, &claim))
            .await;
        let (record, became_unknown) = match outcome {
            Ok(ClaimOutcome::Claimed { takeover }) => {
                let kind = if takeover {
                    EventKind::Takeover
                } else {
                    EventKind::Claimed
                };
                guard.emit(kind, &id);
                return run_guarded(guard, backend, handler, request, id, claim.token).await;
            }
            Ok(ClaimOutcome::Existing {
                record,
                became_unknown,
            }) => (record, became_unknown),
            Err(e) => {
                if matches!(e, StoreError::Timeout) {
                    // The claim may have landed after we stopped waiting: take it back,
                    // best effort and in the background (bounded by the store timeout),
                    // so the key does not sit in progress for a lease.
                    let store = backend.store.clone();
                    let timeout = backend.store_timeout;
                    guard.shared.tracker.spawn(async move {
                        let _ =
                            tokio::time::timeout(timeout, store.release(&id, claim.token)).await;
                    });
                }
                // Fail open only when no record was seen and the store is just down:
                // never past a record that exists, never over corrupt data.
                let may_run =
                    !seen_record && matches!(e, StoreError::Timeout | StoreError::Unavailable(_));
                return store_failed(guard, backend, handler, request, &e, may_run).await;
            }
        };
        seen_record = true;
        if became_unknown {
            backend.reconcile(guard, &id, UnknownReason::LeaseExpired);
        }
        if let Some(answer) = guard.answer(&id, &record, &fingerprint) {
            return Ok(answer);
        }
        let left = match in_flight.next(&id) {
            Ok(left) => left,
            Err(problem) => return Ok(guard.problem(problem)),
        };
        let wait = tokio::time::timeout(
            left.saturating_add(backend.store_timeout),
            backend.store.wait(&id, left),
        )
        .await;
        let e = match wait {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => e,
            Err(_) => StoreError::Timeout,
        };
        return store_failed(guard, backend, handler, request, &e, false).await;
    }
}

/// The store failed: 503 (fail closed), or, when `may_run` and `fail_open()`, run
/// unguarded.
async fn store_failed<H: Handler>(
    guard: &Guard,
    backend: &StoreBackend,
    handler: H,
    request: GuardedRequest,
    error: &StoreError,
    may_run: bool,
) -> Answer<H> {
    if backend.fail_open && may_run {
        tracing::warn!(
            target: "retrysafe::idempotency",
            error = %error,
            "idempotency store failed; running the request unguarded (fail_open)"
        );
        let req = Request::from_parts(request.parts, RequestBody::buffered(request.body));
        let res = handler.call(req).await?;
        return Ok(res.map(ResponseBody::stream));
    }
    if matches!(error, StoreError::Full) {
        // A bound of the store, reached under load (or a key flood): the same answer as
        // the layer's own bound, and no warning per refused request.
        tracing::debug!(target: "retrysafe::idempotency", "idempotency store full");
        return Ok(guard.problem(
            Problem::new(
                ProblemKind::Overloaded,
                "the idempotency store cannot take more requests in progress; retry later",
            )
            .retry_after(guard.config.unavailable_retry_after),
        ));
    }
    tracing::warn!(target: "retrysafe::idempotency", error = %error, "idempotency store failed");
    Ok(guard.store_unavailable("the idempotency store is unavailable; retry later"))
}

/// Runs the handler with its lease renewed, then records what became of it.
async fn run_guarded<H: Handler>(
    guard: &Guard,
    backend: &StoreBackend,
    handler: H,
    request: GuardedRequest,
    id: RecordId,
    token: Token,
) -> Answer<H> {
    let fingerprint = request.fingerprint;
    // The handler runs in this (detachable) task: re-scope the inherited call context (as a
    // task-local and an extension), now carrying the record, so outbound client layers
    // derive child keys and report back when they give up.
    let (req, call_context) = request.into_request(|scope, key| {
        IdempotencyContext::new(
            scope,
            key,
            token,
            backend.store.clone(),
            backend.store_timeout,
        )
    });
    let claimed_at = Instant::now();
    let lease = Lease::new(claimed_at, backend.lease);
    let cap = claimed_at + backend.max_execution;

    let handler = AssertUnwindSafe(call_context.scope(handler.call(req))).catch_unwind();
    let mut handler = std::pin::pin!(handler);
    // The lease is renewed concurrently with the handler and the capture of its
    // response (never delaying them), every third of a lease, never past
    // `max_execution`. It is only polled inside the two `select!`s below, so it stops
    // (is simply no longer polled) before the record is written.
    let mut renewals = std::pin::pin!(renew_lease(backend, &id, token, cap, &lease));
    let outcome = tokio::select! {
        biased;
        out = &mut handler => out,
        () = &mut renewals => handler.await,
    };

    let lease = &lease;
    let unknown = |reason: UnknownReason| async move {
        let r = write_with_retry(backend, lease.until(), || {
            backend.store.mark_unknown(&id, token, guard.retention())
        })
        .await;
        match r {
            Ok(()) => backend.reconcile(guard, &id, reason),
            Err(e) => {
                tracing::error!(target: "retrysafe::idempotency", record = ?id, error = %e, "could not mark the record outcome_unknown");
                guard.emit(EventKind::CompletionLost, &id);
            }
        }
    };

    let response = match outcome {
        Err(_panic) => {
            unknown(UnknownReason::Panicked).await;
            return Ok(guard.problem(Problem::new(
                ProblemKind::HandlerPanicked,
                "the request handler failed",
            )));
        }
        Ok(Err(e)) => {
            unknown(UnknownReason::ServiceError).await;
            return Err(e);
        }
        Ok(Ok(res)) => res,
    };

    let no_effect = response.extensions().get::<NoEffect>().is_some();
    match Disposition::of(response.status(), no_effect) {
        Disposition::Release => {
            if let Err(e) =
                write_with_retry(backend, lease.until(), || backend.store.release(&id, token)).await
            {
                tracing::warn!(target: "retrysafe::idempotency", record = ?id, error = %e, "could not release the record");
                guard.emit(EventKind::CompletionLost, &id);
            }
            Ok(response.map(ResponseBody::stream))
        }
        Disposition::OutcomeUnknown => {
            unknown(UnknownReason::Status(response.status())).await;
            let mut response = response.map(ResponseBody::stream);
            response.headers_mut().insert(
                guard.convention().do_not_retry().clone(),
                DO_NOT_RETRY_VALUE,
            );
            Ok(response)
        }
        Disposition::Store => {
            let mut capturing = std::pin::pin!(guard.capture(response, cap));
            let captured = tokio::select! {
                biased;
                c = &mut capturing => c,
                () = &mut renewals => capturing.await,
            };
            let Some(Captured { stored, response }) = captured else {
                unknown(UnknownReason::BodyError).await;
                return Ok(guard.problem(Problem::new(
                    ProblemKind::OutcomeUnknown,
                    "the response failed while it was being produced",
                )));
            };
            let done = Completed {
                fingerprint,
                response: stored,
            };
            complete(guard, backend, &id, token, &done, lease.until()).await;
            Ok(response)
        }
    }
}

/// Retries a token-carrying write with backoff while the lease lasts. A stale token is
/// final.
async fn write_with_retry<F, Fut>(
    backend: &StoreBackend,
    lease_until: Instant,
    mut write: F,
) -> Result<(), StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), StoreError>>,
{
    let mut backoff = Duration::from_millis(10);
    loop {
        match backend.bounded(None, write()).await {
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

async fn complete(
    guard: &Guard,
    backend: &StoreBackend,
    id: &RecordId,
    token: Token,
    done: &Completed,
    lease_until: Instant,
) {
    let r = write_with_retry(backend, lease_until, || {
        backend.store.complete(id, token, done, guard.retention())
    })
    .await;
    if let Err(e) = r {
        tracing::error!(
            target: "retrysafe::idempotency",
            event = EventKind::CompletionLost.as_str(),
            record = ?id,
            error = %e,
            "could not store the completed record; the handler's response is returned anyway"
        );
        guard.emit(EventKind::CompletionLost, id);
    }
}

/// Renews a claim's lease every third of a lease until `cap`, the lease is lost, or the
/// future is dropped (the handler finished). Updates `lease` on every renewal.
async fn renew_lease(
    backend: &StoreBackend,
    id: &RecordId,
    token: Token,
    cap: Instant,
    state: &Lease,
) {
    let every = backend.lease / 3;
    loop {
        tokio::time::sleep(every).await;
        let now = Instant::now();
        let lease = backend.lease.min(cap.saturating_duration_since(now));
        if lease.is_zero() {
            tracing::warn!(
                target: "retrysafe::idempotency",
                record = ?id,
                "handler exceeded max_execution; its lease is no longer renewed"
            );
            break;
        }
        match backend
            .bounded(None, backend.store.renew(id, token, lease))
            .await
        {
            Ok(()) => state.renewed(now, lease),
            Err(StoreError::StaleToken) => {
                tracing::warn!(target: "retrysafe::idempotency", record = ?id, "lease lost");
                break;
            }
            Err(e) => {
                tracing::warn!(target: "retrysafe::idempotency", record = ?id, error = %e, "lease renewal failed");
            }
        }
        if lease < backend.lease {
            break; // the last renewal, capped by max_execution
        }
    }
    std::future::pending::<()>().await;
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
