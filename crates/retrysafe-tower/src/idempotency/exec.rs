//! The guarded execution: buffer, fingerprint, then one spawned task that claims, runs
//! the handler, captures the response and completes the record.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use retrysafe_core::CallContext;
use retrysafe_core::Deadline;
use retrysafe_core::idempotency::{
    Completed, Decision, Disposition, Fingerprint, IdempotencyContext, NoEffect, RecordId, Scope,
    StoredResponse, Token, decide,
};
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, StoreError};
use retrysafe_core::wire::{DO_NOT_RETRY_VALUE, IdempotencyKey, encode_retry_after};
use tokio::time::Instant;
use tower_service::Service;
use tracing::Instrument;

use super::blocks::{self, CapturedBody};
use super::body::{RequestBody, ResponseBody};
use super::event::{EventKind, IdempotencyEvent, UnknownOutcome, UnknownReason};
use super::layer::{Config, IdempotencyLayer, InFlight};
use super::problem::{Problem, ProblemKind};

type Res<B> = Response<ResponseBody<B>>;

/// Builds a problem response with the headers its case requires.
pub(crate) fn problem_response<B>(config: &Config, problem: Problem) -> Res<B> {
    let res = match &config.responder {
        Some(f) => f(&problem),
        None => problem.to_response(),
    };
    let (mut parts, body) = res.into_parts();
    if problem.kind().do_not_retry() {
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

fn emit(config: &Config, kind: EventKind, record: &RecordId) {
    tracing::debug!(target: "retrysafe::idempotency", event = kind.as_str(), record = ?record);
    if let Some(f) = &config.on_event {
        f(&IdempotencyEvent {
            kind,
            record: *record,
        });
    }
}

fn reconcile(config: &Config, record: &RecordId, reason: UnknownReason) {
    tracing::warn!(
        target: "retrysafe::idempotency",
        event = EventKind::OutcomeUnknown.as_str(),
        record = ?record,
        reason = ?reason,
        "idempotency record has an unknown outcome; it will not be re-run"
    );
    emit(config, EventKind::OutcomeUnknown, record);
    if let Some(f) = &config.on_outcome_unknown {
        f(&UnknownOutcome {
            record: *record,
            reason,
        });
    }
}

/// Runs one store call bounded by the store timeout and the request's deadline.
async fn bounded<T>(
    config: &Config,
    deadline: Option<Deadline>,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let limit = Deadline::bound(deadline, config.store_timeout);
    match tokio::time::timeout(limit, call).await {
        Ok(r) => r,
        Err(_) => Err(StoreError::Timeout),
    }
}

/// The guarded path, from the outer future: buffer and fingerprint, then spawn.
pub(crate) async fn guarded<S, B, ResB>(
    layer: IdempotencyLayer,
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
    // The permit is taken before the body is buffered, so the bound also caps the
    // memory held by buffered request bodies.
    let Ok(permit) = Arc::clone(&layer.shared.permits).try_acquire_owned() else {
        return Ok(problem_response(
            config,
            Problem::new(
                ProblemKind::Overloaded,
                "too many requests with idempotency keys in progress",
            )
            .retry_after(config.unavailable_retry_after),
        ));
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
            let res = execute(&layer, inner, parts, body, key, scope, fingerprint).await;
            drop(permit);
            res
        }
        .instrument(tracing::Span::current())
    };
    match layer.shared.tracker.spawn(task).await {
        Ok(res) => res,
        Err(e) => {
            // `execute` catches handler panics; this is a panic of our own or a runtime
            // shutting down.
            tracing::error!(target: "retrysafe::idempotency", error = %e, "guarded task failed");
            Ok(problem_response(
                config,
                Problem::new(
                    ProblemKind::HandlerPanicked,
                    "the request could not be completed",
                ),
            ))
        }
    }
}

/// Inside the spawned task: claim (and wait, in wait mode), then replay or run.
async fn execute<S, B, ResB>(
    layer: &IdempotencyLayer,
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
    let config = &*layer.config;
    let id = RecordId::new(&scope, &key);
    let deadline = parts.extensions.get::<Deadline>().copied();
    let started = Instant::now();
    let mut seen_record = false;
    let mut waited = false;
    loop {
        let claim = Claim {
            token: Token::random(),
            fingerprint,
            lease: config.lease,
            retention: config.retention,
            commit_point: config.commit_point,
        };
        let outcome = bounded(config, deadline, config.store.claim(&id, &claim)).await;
        let (record, became_unknown) = match outcome {
            Ok(ClaimOutcome::Claimed { takeover }) => {
                emit(
                    config,
                    if takeover {
                        EventKind::Takeover
                    } else {
                        EventKind::Claimed
                    },
                    &id,
                );
                let ctx = IdempotencyContext::new(
                    scope,
                    key,
                    claim.token,
                    config.store.clone(),
                    config.store_timeout,
                );
                return run_guarded(config, inner, parts, body, ctx, fingerprint).await;
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
                    let store = config.store.clone();
                    let timeout = config.store_timeout;
                    layer.shared.tracker.spawn(async move {
                        let _ =
                            tokio::time::timeout(timeout, store.release(&id, claim.token)).await;
                    });
                }
                // Fail open only when no record was seen and the store is just down:
                // never past a record that exists, never over corrupt data.
                let may_run =
                    !seen_record && matches!(e, StoreError::Timeout | StoreError::Unavailable(_));
                return store_failed(config, inner, parts, body, &e, may_run).await;
            }
        };
        seen_record = true;
        if became_unknown {
            reconcile(config, &id, UnknownReason::LeaseExpired);
        }
        match decide(&record, &fingerprint) {
            Decision::Replay(stored) => {
                emit(config, EventKind::Replayed, &id);
                return Ok(replay(config, stored));
            }
            Decision::Mismatch => {
                emit(config, EventKind::Mismatch, &id);
                return Ok(problem_response(
                    config,
                    Problem::new(
                        ProblemKind::KeyMismatch,
                        "this Idempotency-Key was already used with a different request",
                    ),
                ));
            }
            Decision::OutcomeUnknown => {
                return Ok(problem_response(
                    config,
                    Problem::new(
                        ProblemKind::OutcomeUnknown,
                        "the first request with this Idempotency-Key may or may not have taken \
                         effect; it will not be run again",
                    ),
                ));
            }
            Decision::NotStored => {
                return Ok(problem_response(
                    config,
                    Problem::new(
                        ProblemKind::ResponseNotStored,
                        "the request with this Idempotency-Key completed, but its response was \
                         too large to store",
                    ),
                ));
            }
            Decision::InFlight => {
                if !waited {
                    emit(config, EventKind::Conflict, &id);
                }
                waited = true;
                let (max, retry_after) = match config.in_flight {
                    InFlight::Conflict { retry_after } => (Duration::ZERO, retry_after),
                    InFlight::Wait { max, retry_after } => (max, retry_after),
                };
                let left = Deadline::bound(deadline, max.saturating_sub(started.elapsed()));
                if left.is_zero() {
                    return Ok(problem_response(
                        config,
                        Problem::new(
                            ProblemKind::InFlight,
                            "a request with this Idempotency-Key is still in progress; retry later",
                        )
                        .retry_after(retry_after),
                    ));
                }
                let wait = tokio::time::timeout(
                    left.saturating_add(config.store_timeout),
                    config.store.wait(&id, left),
                )
                .await;
                match wait {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        return store_failed(config, inner, parts, body, &e, false).await;
                    }
                    Err(_) => {
                        let e = StoreError::Timeout;
                        return store_failed(config, inner, parts, body, &e, false).await;
                    }
                }
            }
        }
    }
}

/// The store failed: 503 (fail closed), or, when `may_run` and `fail_open()`, run
/// unguarded.
async fn store_failed<S, B, ResB>(
    config: &Config,
    mut inner: S,
    parts: Parts,
    body: Bytes,
    error: &StoreError,
    may_run: bool,
) -> Result<Res<ResB>, S::Error>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes>,
{
    if config.fail_open && may_run {
        tracing::warn!(
            target: "retrysafe::idempotency",
            error = %error,
            "idempotency store failed; running the request unguarded (fail_open)"
        );
        let res = inner
            .call(Request::from_parts(parts, RequestBody::buffered(body)))
            .await?;
        return Ok(res.map(ResponseBody::stream));
    }
    tracing::warn!(target: "retrysafe::idempotency", error = %error, "idempotency store failed");
    Ok(problem_response(
        config,
        Problem::new(
            ProblemKind::StoreUnavailable,
            "the idempotency store is unavailable; retry later",
        )
        .retry_after(config.unavailable_retry_after),
    ))
}

fn replay<B>(config: &Config, stored: &StoredResponse) -> Res<B> {
    blocks::replay_response(&config.convention, stored)
}

/// Runs the handler with its lease renewed, then records what became of it.
async fn run_guarded<S, B, ResB>(
    config: &Config,
    mut inner: S,
    mut parts: Parts,
    body: Bytes,
    ctx: IdempotencyContext,
    fingerprint: Fingerprint,
) -> Result<Res<ResB>, S::Error>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
{
    let token = ctx.token();
    let id = *ctx.record_id();
    // The handler runs in this spawned task: re-scope the inherited call context (as a
    // task-local and an extension), now carrying the record, so outbound client layers
    // derive child keys and report back when they give up.
    let call_context = CallContext::inherited(&parts.extensions)
        .unwrap_or_default()
        .with_idempotency(ctx.clone());
    parts.extensions.insert(ctx);
    parts.extensions.insert(call_context.clone());
    let req = Request::from_parts(parts, RequestBody::buffered(body));
    let claimed_at = Instant::now();
    let lease = Lease::new(claimed_at, config.lease);
    let cap = claimed_at + config.max_execution;

    let handler =
        AssertUnwindSafe(call_context.scope(async move { inner.call(req).await })).catch_unwind();
    let mut handler = std::pin::pin!(handler);
    // The lease is renewed concurrently with the handler and the capture of its
    // response (never delaying them), every third of a lease, never past
    // `max_execution`. It is only polled inside the two `select!`s below, so it stops
    // (is simply no longer polled) before the record is written.
    let mut renewals = std::pin::pin!(renew_lease(config, &id, token, cap, &lease));
    let outcome = tokio::select! {
        biased;
        out = &mut handler => out,
        () = &mut renewals => handler.await,
    };

    let lease = &lease;
    let unknown = |reason: UnknownReason| async move {
        let r = write_with_retry(config, lease.until(), || {
            config.store.mark_unknown(&id, token, config.retention)
        })
        .await;
        match r {
            Ok(()) => reconcile(config, &id, reason),
            Err(e) => {
                tracing::error!(target: "retrysafe::idempotency", record = ?id, error = %e, "could not mark the record outcome_unknown");
                emit(config, EventKind::CompletionLost, &id);
            }
        }
    };

    let response = match outcome {
        Err(_panic) => {
            unknown(UnknownReason::Panicked).await;
            return Ok(problem_response(
                config,
                Problem::new(ProblemKind::HandlerPanicked, "the request handler failed"),
            ));
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
                write_with_retry(config, lease.until(), || config.store.release(&id, token)).await
            {
                tracing::warn!(target: "retrysafe::idempotency", record = ?id, error = %e, "could not release the record");
                emit(config, EventKind::CompletionLost, &id);
            }
            Ok(response.map(ResponseBody::stream))
        }
        Disposition::OutcomeUnknown => {
            unknown(UnknownReason::Status(response.status())).await;
            let mut response = response.map(ResponseBody::stream);
            response
                .headers_mut()
                .insert(config.convention.do_not_retry().clone(), DO_NOT_RETRY_VALUE);
            Ok(response)
        }
        Disposition::Store => {
            let (head, body) = response.into_parts();
            let capturing = AssertUnwindSafe(blocks::capture_response_body(
                body,
                config.max_stored_response,
                cap,
            ))
            .catch_unwind();
            let mut capturing = std::pin::pin!(capturing);
            let captured = tokio::select! {
                biased;
                c = &mut capturing => c,
                () = &mut renewals => capturing.await,
            };
            // A panic while the body was produced is a failed body.
            match captured.unwrap_or(CapturedBody::Failed) {
                CapturedBody::Whole { data, trailers } => {
                    let stored = StoredResponse::capture(
                        head.status,
                        &head.headers,
                        data.clone(),
                        trailers.as_ref(),
                        &config.header_filter,
                    );
                    let done = Completed {
                        fingerprint,
                        response: Some(stored),
                    };
                    complete(config, &id, token, &done, lease.until()).await;
                    Ok(Response::from_parts(
                        head,
                        ResponseBody::full(data, trailers),
                    ))
                }
                CapturedBody::TooLarge(rest) => {
                    let done = Completed {
                        fingerprint,
                        response: None,
                    };
                    complete(config, &id, token, &done, lease.until()).await;
                    Ok(Response::from_parts(head, rest))
                }
                CapturedBody::Failed => {
                    unknown(UnknownReason::BodyError).await;
                    Ok(problem_response(
                        config,
                        Problem::new(
                            ProblemKind::OutcomeUnknown,
                            "the response failed while it was being produced",
                        ),
                    ))
                }
            }
        }
    }
}

/// Retries a token-carrying write with backoff while the lease lasts. A stale token is
/// final.
async fn write_with_retry<F, Fut>(
    config: &Config,
    lease_until: Instant,
    mut write: F,
) -> Result<(), StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), StoreError>>,
{
    let mut backoff = Duration::from_millis(10);
    loop {
        match bounded(config, None, write()).await {
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
    config: &Config,
    id: &RecordId,
    token: Token,
    done: &Completed,
    lease_until: Instant,
) {
    let r = write_with_retry(config, lease_until, || {
        config.store.complete(id, token, done, config.retention)
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
        emit(config, EventKind::CompletionLost, id);
    }
}

/// Renews a claim's lease every third of a lease until `cap`, the lease is lost, or the
/// future is dropped (the handler finished). Updates `lease` on every renewal.
async fn renew_lease(config: &Config, id: &RecordId, token: Token, cap: Instant, state: &Lease) {
    let every = config.lease / 3;
    loop {
        tokio::time::sleep(every).await;
        let now = Instant::now();
        let lease = config.lease.min(cap.saturating_duration_since(now));
        if lease.is_zero() {
            tracing::warn!(
                target: "retrysafe::idempotency",
                record = ?id,
                "handler exceeded max_execution; its lease is no longer renewed"
            );
            break;
        }
        match bounded(config, None, config.store.renew(id, token, lease)).await {
            Ok(()) => state.renewed(now, lease),
            Err(StoreError::StaleToken) => {
                tracing::warn!(target: "retrysafe::idempotency", record = ?id, "lease lost");
                break;
            }
            Err(e) => {
                tracing::warn!(target: "retrysafe::idempotency", record = ?id, error = %e, "lease renewal failed");
            }
        }
        if lease < config.lease {
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
