use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::{HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use pin_project_lite::pin_project;
use retrysafe_core::budget::BudgetId;
use retrysafe_core::classify::{Classification, Failure, RequestFacts};
use retrysafe_core::error::DeadlineExceeded;
use retrysafe_core::strategy::{GiveUp, MIN_ATTEMPT_TIME, RetryCharged, RetryToken};
use retrysafe_core::wire::{
    DO_NOT_RETRY_VALUE, encode_grpc_timeout, encode_request_timeout_ms, encode_retry_attempt,
};
use retrysafe_core::{CallContext, Deadline};
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use super::body::ReplayBody;
use super::layer::{Config, GiveUpEvent, RetryEvent};
use super::transport::failure_of;
use crate::local::{BoxError, LocalFailure};

pin_project! {
    /// The response future of [`Retry`](super::Retry).
    pub struct ResponseFuture<S, B, M>
    where
        S: Service<Request<ReplayBody<B>>>,
    {
        #[pin]
        state: State<S::Future>,
        // The attempt timeout, the backoff, or the deadline while awaiting readiness.
        // Made on first need: a call answered at once never touches the timer wheel.
        #[pin]
        timer: Option<Sleep>,
        armed: bool,
        service: S,
        template: http::request::Parts,
        body: ReplayBody<B>,
        token: Option<RetryToken>,
        // What only a retry needs, made on the first retry (a call that does not retry
        // keeps the future small and allocates nothing for it).
        retry: Option<Box<Retrying<S::Response>>>,
        attempts: Attempts,
        _local: PhantomData<fn() -> M>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Calling { #[pin] future: F },
        Backoff,
        Readying,
        Failed { error: Option<BoxError> },
    }
}

/// The state of a call that retries.
struct Retrying<Res> {
    /// The last real response while a retry is pending: returned, marked
    /// `do-not-retry`, when the retry cannot be made after all.
    last: Option<Res>,
    /// The span of the retried attempt (`http.request.resend_count`).
    span: tracing::Span,
}

/// What the future knows about the logical request across its attempts.
pub(crate) struct Attempts {
    pub(crate) config: Arc<Config>,
    pub(crate) facts: RequestFacts,
    pub(crate) context: Option<CallContext>,
    /// Make one attempt and pass its answer through unmarked (`NoRetry`, or the caller
    /// is the retry point).
    pub(crate) passthrough: bool,
    pub(crate) deadline: Option<Deadline>,
    /// When the call started, taken lazily, for the default timeouts.
    pub(crate) started: Option<Instant>,
}

enum Outcome<R> {
    Response(Response<R>),
    Error(BoxError),
    TimedOut,
}

enum Step<R> {
    Done(Result<Response<R>, BoxError>),
    Retry(RetryToken, Option<Response<R>>),
}

/// Whether a deadline leaves too little time to start an attempt.
fn too_late(deadline: Option<Deadline>) -> bool {
    deadline.is_some_and(|d| d.remaining() < MIN_ATTEMPT_TIME)
}

impl<S, B, M> ResponseFuture<S, B, M>
where
    S: Service<Request<ReplayBody<B>>>,
{
    pub(crate) fn start(
        mut service: S,
        template: http::request::Parts,
        body: ReplayBody<B>,
        token: RetryToken,
        attempts: Attempts,
    ) -> Self {
        let backup = body.clone();
        let state = if too_late(attempts.deadline) {
            State::Failed {
                error: Some(Box::new(DeadlineExceeded::new())),
            }
        } else {
            let mut parts = template.clone();
            attempts.prepare(&mut parts, 1, token.budget_id());
            let request = Request::from_parts(parts, body);
            let _mark = token.budget_id().map(RetryCharged::mark);
            State::Calling {
                future: service.call(request),
            }
        };
        ResponseFuture {
            state,
            timer: None,
            armed: false,
            service,
            template,
            body: backup,
            token: Some(token),
            retry: None,
            attempts,
            _local: PhantomData,
        }
    }
}

fn arm(mut timer: Pin<&mut Option<Sleep>>, at: Instant) {
    match timer.as_mut().as_pin_mut() {
        Some(sleep) => sleep.reset(at),
        None => timer.set(Some(tokio::time::sleep_until(at))),
    }
}

impl<S, B, M, R> Future for ResponseFuture<S, B, M>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    B: Body,
    M: LocalFailure<R>,
{
    type Output = Result<Response<R>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Calling { future } => {
                    // The response first: a timer polled before it would drop a response
                    // that was ready.
                    let polled = {
                        let _entered = this.retry.as_ref().map(|r| r.span.enter());
                        future.poll(cx)
                    };
                    let outcome = match polled {
                        Poll::Ready(Ok(response)) => Outcome::Response(response),
                        Poll::Ready(Err(e)) => Outcome::Error(e.into()),
                        Poll::Pending => {
                            if !*this.armed {
                                let Some(at) = this.attempts.attempt_until() else {
                                    return Poll::Pending;
                                };
                                arm(this.timer.as_mut(), at);
                                *this.armed = true;
                            }
                            match this.timer.as_mut().as_pin_mut() {
                                Some(timer) => ready!(timer.poll(cx)),
                                None => return Poll::Pending,
                            }
                            Outcome::TimedOut
                        }
                    };
                    *this.armed = false;
                    let Some(token) = this.token.take() else {
                        return Poll::Ready(Err("retry future polled after completion".into()));
                    };
                    let step = this.attempts.decide::<R, M, B>(
                        outcome,
                        token,
                        this.body,
                        this.retry.as_mut().and_then(|r| r.last.take()),
                    );
                    match step {
                        Step::Done(result) => {
                            this.state.set(State::Failed { error: None });
                            return Poll::Ready(result);
                        }
                        Step::Retry(next, last) => {
                            let delay = next.delay();
                            let span = tracing::debug_span!(
                                "retry",
                                http.request.resend_count = next.attempt() - 1
                            );
                            match this.retry {
                                Some(r) => {
                                    r.last = last;
                                    r.span = span;
                                }
                                None => *this.retry = Some(Box::new(Retrying { last, span })),
                            }
                            *this.token = Some(next);
                            if delay.is_zero() {
                                this.state.set(State::Readying);
                            } else {
                                arm(this.timer.as_mut(), Instant::now() + delay);
                                *this.armed = true;
                                this.state.set(State::Backoff);
                            }
                        }
                    }
                }
                StateProj::Backoff => {
                    if let Some(timer) = this.timer.as_mut().as_pin_mut() {
                        ready!(timer.poll(cx));
                    }
                    *this.armed = false;
                    this.state.set(State::Readying);
                }
                StateProj::Readying => {
                    let ready = this.service.poll_ready(cx);
                    // The deadline may have passed during the backoff or the wait.
                    let expired = match ready {
                        Poll::Ready(Ok(())) => too_late(this.attempts.deadline),
                        Poll::Ready(Err(_)) => false,
                        Poll::Pending => {
                            // Waiting for readiness counts against the deadline.
                            if !*this.armed {
                                let Some(at) = this.attempts.overall_until() else {
                                    return Poll::Pending;
                                };
                                arm(this.timer.as_mut(), at);
                                *this.armed = true;
                            }
                            if let Some(timer) = this.timer.as_mut().as_pin_mut() {
                                ready!(timer.poll(cx));
                            }
                            true
                        }
                    };
                    if expired {
                        let token = this.token.take();
                        let result = this.attempts.give_up::<R, M>(
                            GiveUp::NotEnoughTime,
                            token.as_ref().map_or(1, RetryToken::attempt) - 1,
                            this.retry.as_mut().and_then(|r| r.last.take()),
                            Box::new(DeadlineExceeded::new()),
                        );
                        this.state.set(State::Failed { error: None });
                        return Poll::Ready(result);
                    }
                    match ready {
                        Poll::Ready(Ok(())) => {
                            *this.armed = false;
                            let attempt = this.token.as_ref().map_or(1, RetryToken::attempt);
                            let budget = this.token.as_ref().and_then(RetryToken::budget_id);
                            let mut parts = this.template.clone();
                            this.attempts.prepare(&mut parts, attempt, budget);
                            let request = Request::from_parts(parts, this.body.clone());
                            let future = {
                                let _entered = this.retry.as_ref().map(|r| r.span.enter());
                                let _mark = budget.map(RetryCharged::mark);
                                this.service.call(request)
                            };
                            this.state.set(State::Calling { future });
                        }
                        Poll::Ready(Err(e)) => {
                            this.state.set(State::Failed { error: None });
                            return Poll::Ready(Err(e.into()));
                        }
                        Poll::Pending => return Poll::Pending,
                    }
                }
                StateProj::Failed { error } => {
                    let Some(error) = error.take() else {
                        return Poll::Ready(Err("retry future polled after completion".into()));
                    };
                    return Poll::Ready(M::answer(
                        this.attempts.facts.grpc,
                        error,
                        &this.attempts.config.convention,
                    ));
                }
            }
        }
    }
}

impl Attempts {
    /// Sets the per-attempt headers: the attempt number and the time left.
    pub(crate) fn prepare(
        &self,
        parts: &mut http::request::Parts,
        attempt: u32,
        budget: Option<BudgetId>,
    ) {
        let convention = &self.config.convention;
        if attempt >= 2 {
            parts.headers.insert(
                convention.retry_attempt().clone(),
                encode_retry_attempt(attempt),
            );
            if self.facts.grpc {
                parts.headers.insert(
                    convention.grpc_previous_rpc_attempts().clone(),
                    HeaderValue::from(attempt - 1),
                );
            }
            if let Some(budget) = budget {
                parts.extensions.insert(RetryCharged { attempt, budget });
            }
        }
        if let Some(deadline) = self.deadline {
            let left = deadline.remaining();
            if self.facts.grpc {
                parts
                    .headers
                    .insert(convention.grpc_timeout().clone(), encode_grpc_timeout(left));
            } else {
                parts.headers.insert(
                    convention.request_timeout_ms().clone(),
                    encode_request_timeout_ms(left),
                );
            }
        }
    }

    /// When the whole call must end: the deadline, or the default overall timeout.
    fn overall_until(&mut self) -> Option<Instant> {
        overall_until(self.deadline, &mut self.started, &self.config)
    }

    /// When the current attempt must end.
    fn attempt_until(&mut self) -> Option<Instant> {
        if let Some(d) = self.deadline {
            return Some(d.instant());
        }
        let (attempt, _) = self.config.strategy.default_timeouts();
        let attempt = attempt.map(|t| Instant::now() + t);
        match (attempt, self.overall_until()) {
            (Some(a), Some(o)) => Some(a.min(o)),
            (a, o) => a.or(o),
        }
    }

    /// Gives up on a retryable failure: the last real response marked `do-not-retry`
    /// (or, with none, `error` as a local failure), `downstream_gave_up` recorded, the
    /// hook called.
    fn give_up<R, M: LocalFailure<R>>(
        &self,
        reason: GiveUp,
        attempts: u32,
        last: Option<Response<R>>,
        error: BoxError,
    ) -> Result<Response<R>, BoxError> {
        let config = &*self.config;
        let status = last.as_ref().map(Response::status);
        if let Some(context) = &self.context {
            context.mark_downstream_gave_up();
        }
        tracing::debug!(attempts, %reason, status = status.map(|s| s.as_u16()), "giving up");
        if let Some(hook) = &config.on_give_up {
            hook(&GiveUpEvent {
                attempts,
                reason,
                status,
            });
        }
        match last {
            Some(mut response) => {
                response
                    .headers_mut()
                    .insert(config.convention.do_not_retry().clone(), DO_NOT_RETRY_VALUE);
                Ok(response)
            }
            None => M::answer(self.facts.grpc, error, &config.convention),
        }
    }

    /// After an attempt: done, or retry after a delay. `last` is the last real response
    /// of an earlier attempt, if any.
    fn decide<R, M: LocalFailure<R>, B>(
        &mut self,
        outcome: Outcome<R>,
        token: RetryToken,
        body: &ReplayBody<B>,
        last: Option<Response<R>>,
    ) -> Step<R> {
        let config = &*self.config;
        let (classification, status) = match &outcome {
            Outcome::Response(r) => (
                config
                    .classifier
                    .classify_response(r.status(), r.headers(), &self.facts),
                Some(r.status()),
            ),
            Outcome::Error(e) => (
                config
                    .classifier
                    .classify_failure(failure_of(&**e), &self.facts),
                None,
            ),
            Outcome::TimedOut => (
                config
                    .classifier
                    .classify_failure(Failure::Timeout, &self.facts),
                None,
            ),
        };
        if classification.is_success() {
            config.strategy.record_success(&token);
            return Step::Done(match outcome {
                Outcome::Response(r) => Ok(r),
                Outcome::Error(e) => Err(e),
                Outcome::TimedOut => Err(Box::new(DeadlineExceeded::new())),
            });
        }
        if classification.marked {
            // Downstream already retried, or answered for good.
            if let Some(context) = &self.context {
                context.mark_downstream_gave_up();
            }
        }
        let attempts = token.attempt();
        let decision = if self.passthrough || !body.is_replayable() {
            // One attempt only; or a body over the replay cap, which is sent once.
            Err(GiveUp::NotRetryable)
        } else {
            // (Split borrows: `config` borrows `self.config`.)
            let time_left = overall_until(self.deadline, &mut self.started, config)
                .map(|at| at.saturating_duration_since(Instant::now()));
            config
                .strategy
                .refresh_retry_token(token, &classification, &self.facts, time_left)
        };
        match decision {
            Ok(next) => {
                on_retry(config, &next, status, &classification);
                let last = match outcome {
                    Outcome::Response(r) => Some(r),
                    Outcome::Error(_) | Outcome::TimedOut => last,
                };
                Step::Retry(next, last)
            }
            Err(GiveUp::NotRetryable) => {
                // Not retryable: this outcome as it is — unless it is a local refusal
                // (a budget or breaker below refused a retry) after a real response,
                // which is then the answer.
                let grpc = self.facts.grpc;
                Step::Done(match (outcome, last) {
                    (Outcome::Response(r), _) => Ok(r),
                    (Outcome::Error(e), Some(last)) if classification.marked => {
                        self.give_up::<R, M>(GiveUp::BudgetExhausted, attempts, Some(last), e)
                    }
                    (Outcome::Error(e), _) => M::answer(grpc, e, &config.convention),
                    (Outcome::TimedOut, _) => {
                        M::answer(grpc, Box::new(DeadlineExceeded::new()), &config.convention)
                    }
                })
            }
            Err(reason) => {
                let (last, error): (_, BoxError) = match outcome {
                    Outcome::Response(r) => (Some(r), Box::new(DeadlineExceeded::new())),
                    Outcome::Error(e) => (last, e),
                    Outcome::TimedOut => (last, Box::new(DeadlineExceeded::new())),
                };
                Step::Done(self.give_up::<R, M>(reason, attempts, last, error))
            }
        }
    }
}

/// When the whole call must end: the deadline, or the default overall timeout counted
/// from `started` (taken now if not yet).
fn overall_until(
    deadline: Option<Deadline>,
    started: &mut Option<Instant>,
    config: &Config,
) -> Option<Instant> {
    if let Some(d) = deadline {
        return Some(d.instant());
    }
    let overall = config.strategy.default_timeouts().1?;
    Some(*started.get_or_insert_with(Instant::now) + overall)
}

fn on_retry(
    config: &Config,
    next: &RetryToken,
    status: Option<StatusCode>,
    classification: &Classification,
) {
    {
        tracing::debug!(
            attempt = next.attempt(),
            delay_ms = u64::try_from(next.delay().as_millis()).unwrap_or(u64::MAX),
            status = status.map(|s| s.as_u16()),
            "retrying"
        );
        if let Some(hook) = &config.on_retry {
            hook(&RetryEvent {
                attempt: next.attempt(),
                delay: next.delay(),
                status,
                classification: *classification,
            });
        }
    }
}

impl<S, B, M> fmt::Debug for ResponseFuture<S, B, M>
where
    S: Service<Request<ReplayBody<B>>> + fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("service", &self.service)
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}
