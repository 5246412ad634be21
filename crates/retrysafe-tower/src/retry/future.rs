use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::{HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use pin_project_lite::pin_project;
use retrysafe_core::classify::{Classification, Failure, RequestFacts};
use retrysafe_core::error::DeadlineExceeded;
use retrysafe_core::strategy::{GiveUp, RetryCharged, RetryToken};
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
    pub struct ResponseFuture<F, S, B, M> {
        #[pin]
        state: State<F>,
        // Boxed and made on first need (an attempt that did not complete at once, or a
        // backoff): the future stays small, and a call answered at once never touches
        // the timer wheel.
        timer: Option<Pin<Box<Sleep>>>,
        armed: bool,
        service: S,
        template: http::request::Parts,
        body: ReplayBody<B>,
        token: Option<RetryToken>,
        attempts: Attempts,
        span: Option<tracing::Span>,
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
    Retry(RetryToken),
}

impl<F, S, B, M> ResponseFuture<F, S, B, M> {
    pub(crate) fn start(
        mut service: S,
        template: http::request::Parts,
        body: ReplayBody<B>,
        token: RetryToken,
        attempts: Attempts,
    ) -> Self
    where
        S: Service<Request<ReplayBody<B>>, Future = F>,
    {
        let backup = body.clone();
        let state = if attempts.deadline.is_some_and(Deadline::is_expired) {
            State::Failed {
                error: Some(Box::new(DeadlineExceeded::new())),
            }
        } else {
            let mut parts = template.clone();
            attempts.prepare(&mut parts, 1);
            let request = Request::from_parts(parts, body);
            State::Calling {
                future: RetryCharged::scope(|| service.call(request)),
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
            attempts,
            span: None,
            _local: PhantomData,
        }
    }
}

fn arm(timer: &mut Option<Pin<Box<Sleep>>>, at: Instant) {
    match timer {
        Some(sleep) => sleep.as_mut().reset(at),
        None => *timer = Some(Box::pin(tokio::time::sleep_until(at))),
    }
}

impl<F, S, B, M, R, E> Future for ResponseFuture<F, S, B, M>
where
    F: Future<Output = Result<Response<R>, E>>,
    S: Service<Request<ReplayBody<B>>, Future = F, Response = Response<R>, Error = E>,
    E: Into<BoxError>,
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
                        let _entered = this.span.as_ref().map(tracing::Span::enter);
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
                                arm(this.timer, at);
                                *this.armed = true;
                            }
                            match this.timer.as_mut().map(Pin::as_mut) {
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
                    match this.attempts.decide::<R, M, B>(outcome, token, this.body) {
                        Step::Done(result) => {
                            this.state.set(State::Failed { error: None });
                            return Poll::Ready(result);
                        }
                        Step::Retry(next) => {
                            let delay = next.delay();
                            *this.span = Some(tracing::debug_span!(
                                "retry",
                                http.request.resend_count = next.attempt() - 1
                            ));
                            *this.token = Some(next);
                            if delay.is_zero() {
                                this.state.set(State::Readying);
                            } else {
                                arm(this.timer, Instant::now() + delay);
                                *this.armed = true;
                                this.state.set(State::Backoff);
                            }
                        }
                    }
                }
                StateProj::Backoff => {
                    if let Some(timer) = this.timer.as_mut().map(Pin::as_mut) {
                        ready!(timer.poll(cx));
                    }
                    *this.armed = false;
                    this.state.set(State::Readying);
                }
                StateProj::Readying => match this.service.poll_ready(cx) {
                    Poll::Ready(Ok(())) => {
                        *this.armed = false;
                        let attempt = this.token.as_ref().map_or(1, RetryToken::attempt);
                        let mut parts = this.template.clone();
                        this.attempts.prepare(&mut parts, attempt);
                        let request = Request::from_parts(parts, this.body.clone());
                        let future = {
                            let _entered = this.span.as_ref().map(tracing::Span::enter);
                            RetryCharged::scope(|| this.service.call(request))
                        };
                        this.state.set(State::Calling { future });
                    }
                    Poll::Ready(Err(e)) => {
                        this.state.set(State::Failed { error: None });
                        return Poll::Ready(Err(e.into()));
                    }
                    Poll::Pending => {
                        // Waiting for readiness counts against the deadline.
                        if !*this.armed {
                            let Some(at) = this.attempts.overall_until() else {
                                return Poll::Pending;
                            };
                            arm(this.timer, at);
                            *this.armed = true;
                        }
                        if let Some(timer) = this.timer.as_mut().map(Pin::as_mut) {
                            ready!(timer.poll(cx));
                        }
                        let grpc = this.attempts.facts.grpc;
                        let convention = this.attempts.config.convention.clone();
                        this.attempts.gave_up();
                        this.state.set(State::Failed { error: None });
                        return Poll::Ready(M::answer(
                            grpc,
                            Box::new(DeadlineExceeded::new()),
                            &convention,
                        ));
                    }
                },
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
    pub(crate) fn prepare(&self, parts: &mut http::request::Parts, attempt: u32) {
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
            parts.extensions.insert(RetryCharged { attempt });
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

    fn gave_up(&self) {
        if let Some(context) = &self.context {
            context.mark_downstream_gave_up();
        }
    }

    fn decide<R, M: LocalFailure<R>, B>(
        &mut self,
        outcome: Outcome<R>,
        token: RetryToken,
        body: &ReplayBody<B>,
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
        let decision = if self.passthrough {
            Err(GiveUp::NotRetryable)
        } else if !body.is_replayable() {
            // A body over the replay cap is sent once.
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
                Step::Retry(next)
            }
            Err(reason) => {
                let gave_up = reason.after_retryable_failure();
                if gave_up {
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
                }
                let grpc = self.facts.grpc;
                Step::Done(match outcome {
                    Outcome::Response(mut r) => {
                        if gave_up {
                            r.headers_mut().insert(
                                config.convention.do_not_retry().clone(),
                                DO_NOT_RETRY_VALUE,
                            );
                        }
                        Ok(r)
                    }
                    Outcome::Error(e) => M::answer(grpc, e, &config.convention),
                    Outcome::TimedOut => {
                        M::answer(grpc, Box::new(DeadlineExceeded::new()), &config.convention)
                    }
                })
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

impl<F, S: fmt::Debug, B, M> fmt::Debug for ResponseFuture<F, S, B, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("service", &self.service)
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}
