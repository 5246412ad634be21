use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use retrysafe_core::__private::{Decision, Outcome as Seen, RetryCall};
use retrysafe_core::error::DeadlineExceeded;
use retrysafe_core::strategy::{GiveUp, RetryToken};
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use super::attempts::{Attempts, Plain, Sent};
use super::body::ReplayBody;
use super::transport::failure_of;
use crate::local::BoxError;

pin_project! {
    /// The response future of [`RetryService`](super::RetryService).
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<ReplayBody<B>>>,
    {
        #[pin]
        inner: Driver<Plain<S>, B>,
    }
}

pin_project! {
    /// The retry loop over attempts made by `A`: the [`ResponseFuture`] of the
    /// [`RetryService`](super::RetryService), and the fused client stack's.
    #[project = DriverProj]
    pub(crate) struct Driver<A, B>
    where
        A: Attempts<B>,
    {
        #[pin]
        state: State<A::Future>,
        // The attempt timeout, the backoff, or the deadline while awaiting readiness.
        // Made on first need: a call answered at once never touches the timer wheel.
        #[pin]
        timer: Option<Sleep>,
        armed: bool,
        service: A,
        template: http::request::Parts,
        body: ReplayBody<B>,
        token: Option<RetryToken>,
        // What only a retry needs, made on the first retry (a call that does not retry
        // keeps the future small and allocates nothing for it).
        retry: Option<Box<Retrying<A::Response>>>,
        // The planner's state of this call (retrysafe-core).
        call: RetryCall,
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
}

/// What a [`Driver`] does with an attempt's outcome.
enum Next {
    /// Answer with the outcome as it is.
    Answer,
    /// Answer as a give-up does.
    GiveUp,
    /// Retry with this token.
    Retry(RetryToken),
    /// Nothing to decide with: polled after completion.
    Done,
}

enum Outcome<R> {
    Response(Response<R>),
    Error(BoxError),
    TimedOut,
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>>,
{
    pub(crate) fn new(inner: Driver<Plain<S>, B>) -> Self {
        ResponseFuture { inner }
    }
}

impl<A, B> Driver<A, B>
where
    A: Attempts<B>,
{
    /// Starts the call: its first attempt made at once by `first` (given the attempts'
    /// maker), unless the deadline is spent already. `now` is the clock reading the
    /// caller's deadline was made from, if it read the clock for one (the first
    /// attempt's timeout header needs no second read), with the call's time left at
    /// that reading when the caller knows it.
    #[inline]
    pub(crate) fn start(
        mut service: A,
        (template, body): (http::request::Parts, ReplayBody<B>),
        token: RetryToken,
        call: RetryCall,
        now: Option<(Instant, Option<Duration>)>,
        first: impl FnOnce(&mut A, Request<ReplayBody<B>>, Sent) -> A::Future,
    ) -> Self {
        let backup = body.clone();
        // One clock read for the check, the timeout header and the breaker's timing.
        let (at, left) = match now {
            Some((now, Some(left))) => (Some(now), Some(left)),
            Some((now, None)) => call.read_time_left(Some(now)),
            None => call.read_time_left(None),
        };
        let state = if RetryCall::too_late_with(left) {
            State::Failed {
                error: Some(Box::new(DeadlineExceeded::new())),
            }
        } else {
            let mut parts = template.clone();
            let timeout =
                call.prepare_attempt_with(&mut parts.headers, &mut parts.extensions, &token, left);
            let sent = Sent {
                at,
                timeout,
                grpc: call.is_grpc(),
            };
            // In the call's span, as every later attempt is: a breaker or budget below
            // records its verdict on it.
            let _entered = call.span().map(tracing::Span::enter);
            State::Calling {
                future: first(&mut service, Request::from_parts(parts, body), sent),
            }
        };
        Driver {
            state,
            timer: None,
            armed: false,
            service,
            template,
            body: backup,
            token: Some(token),
            retry: None,
            call,
        }
    }
}

fn arm(mut timer: Pin<&mut Option<Sleep>>, at: Instant) {
    match timer.as_mut().as_pin_mut() {
        Some(sleep) => sleep.reset(at),
        None => timer.set(Some(tokio::time::sleep_until(at))),
    }
}

impl<S, B, R> Future for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    B: Body,
{
    type Output = Result<Response<R>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().inner.poll(cx)
    }
}

impl<A, B, R> Future for Driver<A, B>
where
    A: Attempts<B, Response = Response<R>>,
    A::Error: Into<BoxError>,
    B: Body,
{
    type Output = Result<Response<R>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        // The call's span, entered while its attempts are polled (a disabled span is
        // neither cloned nor entered).
        let _entered = this.call.span().map(|span| span.clone().entered());
        // The attempt under way first, its response returned where it lies when it is
        // the answer (as it is more often than not): a large response is copied once
        // less for every layer of `Poll` and `Option` it is not wrapped in.
        let over = match this.state.as_mut().project() {
            StateProj::Calling { future } => match future.poll(cx) {
                Poll::Ready(Ok(response)) => {
                    *this.armed = false;
                    match this.decide(Seen::response(response.status(), response.headers())) {
                        Next::Answer => {
                            this.state.set(State::Failed { error: None });
                            return Poll::Ready(Ok(response));
                        }
                        next => this.after(next, Outcome::Response(response)),
                    }
                }
                polled => ready!(this.attempt_over(polled, cx)),
            },
            _ => None,
        };
        let answer = match over {
            Some(answer) => answer,
            None => ready!(this.poll_call(cx)),
        };
        if let Err(error) = &answer
            && error.is::<DeadlineExceeded>()
        {
            this.call.deadline_expired();
        }
        Poll::Ready(answer)
    }
}

type Answer<R> = Result<Response<R>, BoxError>;

impl<A, B, R> DriverProj<'_, A, B>
where
    A: Attempts<B, Response = Response<R>>,
    A::Error: Into<BoxError>,
    B: Body,
{
    /// The state machine: one `match` on the state, each arm a helper.
    #[inline]
    fn poll_call(&mut self, cx: &mut Context<'_>) -> Poll<Answer<R>> {
        loop {
            match self.state.as_mut().project() {
                StateProj::Calling { future } => {
                    // The response first: a timer polled before it would drop a response
                    // that was ready.
                    let polled = future.poll(cx);
                    if let Some(answer) = ready!(self.attempt_over(polled, cx)) {
                        return Poll::Ready(answer);
                    }
                }
                StateProj::Backoff => ready!(self.poll_backoff(cx)),
                StateProj::Readying => {
                    if let Some(answer) = ready!(self.poll_readying(cx)) {
                        return Poll::Ready(answer);
                    }
                }
                StateProj::Failed { error } => {
                    let error = error.take();
                    return Poll::Ready(self.failed(error));
                }
            }
        }
    }
}

impl<A, B, R> DriverProj<'_, A, B>
where
    A: Attempts<B, Response = Response<R>>,
    A::Error: Into<BoxError>,
    B: Body,
{
    /// `Calling`: decides on what the attempt produced, once it produced something or
    /// its timer fired; the answer, or `None` when a retry was scheduled. A response is
    /// decided on where it lies (it is the answer more often than not).
    #[inline]
    fn attempt_over(
        &mut self,
        polled: Poll<Result<Response<R>, A::Error>>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Answer<R>>> {
        let (next, outcome) = match polled {
            Poll::Ready(Ok(response)) => {
                *self.armed = false;
                let next = self.decide(Seen::response(response.status(), response.headers()));
                if let Next::Answer = next {
                    self.state.set(State::Failed { error: None });
                    return Poll::Ready(Some(Ok(response)));
                }
                (next, Outcome::Response(response))
            }
            polled => {
                let outcome = ready!(self.attempt_outcome(polled, cx));
                (self.decide(outcome.seen()), outcome)
            }
        };
        Poll::Ready(self.after(next, outcome))
    }

    /// `Calling`, decided: the answer, or `None` when a retry was scheduled.
    #[inline]
    fn after(&mut self, next: Next, outcome: Outcome<R>) -> Option<Answer<R>> {
        match next {
            Next::Answer => {
                self.state.set(State::Failed { error: None });
                Some(outcome.into_answer())
            }
            Next::GiveUp => Some(self.gave_up(outcome)),
            Next::Retry(next) => {
                self.schedule_retry(next, outcome);
                None
            }
            Next::Done => Some(Err(polled_after_completion())),
        }
    }

    /// `Calling`: what the attempt produced, once it produced something or its timer
    /// (the attempt timeout) fired.
    #[inline]
    fn attempt_outcome(
        &mut self,
        polled: Poll<Result<Response<R>, A::Error>>,
        cx: &mut Context<'_>,
    ) -> Poll<Outcome<R>> {
        let outcome = match polled {
            Poll::Ready(Ok(response)) => Outcome::Response(response),
            // An error once the deadline is spent is the deadline's: a transport that
            // times the call from its timeout header (a tonic `Channel`) may fire at the
            // very instant of ours.
            Poll::Ready(Err(_)) if self.call.too_late() => Outcome::TimedOut,
            Poll::Ready(Err(e)) => Outcome::Error(e.into()),
            Poll::Pending => {
                ready!(self.poll_timer(cx, RetryCall::attempt_until));
                Outcome::TimedOut
            }
        };
        *self.armed = false;
        Poll::Ready(outcome)
    }

    /// Waits for the timer, armed on first need for the instant `until` gives (never,
    /// when it gives none).
    fn poll_timer(
        &mut self,
        cx: &mut Context<'_>,
        until: impl FnOnce(&mut RetryCall) -> Option<Instant>,
    ) -> Poll<()> {
        if !*self.armed {
            let Some(at) = until(self.call) else {
                return Poll::Pending;
            };
            arm(self.timer.as_mut(), at);
            *self.armed = true;
        }
        match self.timer.as_mut().as_pin_mut() {
            Some(timer) => timer.poll(cx),
            None => Poll::Pending,
        }
    }

    /// `Calling`, the attempt over: asks the planner what to do with the outcome it has `seen`.
    #[inline]
    fn decide(&mut self, seen: Seen<'_>) -> Next {
        let Some(token) = self.token.take() else {
            return Next::Done;
        };
        let last = self.retry.as_ref().and_then(|r| r.last.as_ref());
        let decision = self.call.decide(
            seen,
            token,
            self.body.is_replayable(),
            last.map(Response::status),
        );
        match decision {
            Decision::Retry(next) => Next::Retry(next),
            Decision::Success | Decision::Final => Next::Answer,
            Decision::GiveUp(_) => Next::GiveUp,
        }
    }

    /// `Calling`, given up on a retryable failure: the last real response, marked; or,
    /// with none, the failure.
    fn gave_up(&mut self, outcome: Outcome<R>) -> Answer<R> {
        self.state.set(State::Failed { error: None });
        let last = self.retry.as_mut().and_then(|r| r.last.take());
        let (last, error): (_, BoxError) = match outcome {
            Outcome::Response(r) => (Some(r), Box::new(DeadlineExceeded::new())),
            Outcome::Error(e) => (last, e),
            Outcome::TimedOut => (last, Box::new(DeadlineExceeded::new())),
        };
        given_up(self.call, last, error)
    }

    /// `Calling`, to retry: keeps the last real response, then
    /// waits the token's delay (`Backoff`) or goes on at once (`Readying`).
    fn schedule_retry(&mut self, next: RetryToken, outcome: Outcome<R>) {
        let delay = next.delay();
        let last = match outcome {
            Outcome::Response(r) => Some(r),
            Outcome::Error(_) | Outcome::TimedOut => {
                self.retry.as_mut().and_then(|r| r.last.take())
            }
        };
        match self.retry {
            Some(r) => r.last = last,
            None => *self.retry = Some(Box::new(Retrying { last })),
        }
        *self.token = Some(next);
        if delay.is_zero() {
            self.state.set(State::Readying);
        } else {
            arm(self.timer.as_mut(), Instant::now() + delay);
            *self.armed = true;
            self.state.set(State::Backoff);
        }
    }

    /// `Backoff`: waits for the delay to pass, then awaits readiness.
    fn poll_backoff(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if let Some(timer) = self.timer.as_mut().as_pin_mut() {
            ready!(timer.poll(cx));
        }
        *self.armed = false;
        self.state.set(State::Readying);
        Poll::Ready(())
    }

    /// `Readying`: awaits the inner service's readiness, bounded by the deadline, then
    /// starts the next attempt (`None`) — or answers.
    fn poll_readying(&mut self, cx: &mut Context<'_>) -> Poll<Option<Answer<R>>> {
        let left = match self.service.poll_ready(cx) {
            // The deadline may have passed during the backoff or the wait. One clock
            // read for the check and the timeout header.
            Poll::Ready(Ok(())) => {
                let (at, left) = self.call.read_time_left(None);
                if RetryCall::too_late_with(left) {
                    return Poll::Ready(Some(self.out_of_time()));
                }
                (at, left)
            }
            Poll::Ready(Err(e)) => {
                self.state.set(State::Failed { error: None });
                return Poll::Ready(Some(Err(e.into())));
            }
            Poll::Pending => {
                // Waiting for readiness counts against the deadline.
                ready!(self.poll_timer(cx, RetryCall::overall_until));
                return Poll::Ready(Some(self.out_of_time()));
            }
        };
        *self.armed = false;
        Poll::Ready(self.start_retry(left).err())
    }

    /// `Readying`, too late for the next attempt: gives up with the last real response.
    fn out_of_time(&mut self) -> Answer<R> {
        let attempts = self.token.take().map_or(1, |t| t.attempt()) - 1;
        let last = self.retry.as_mut().and_then(|r| r.last.take());
        self.call.give_up(
            GiveUp::NotEnoughTime,
            attempts,
            last.as_ref().map(Response::status),
        );
        self.state.set(State::Failed { error: None });
        given_up(self.call, last, Box::new(DeadlineExceeded::new()))
    }

    /// `Readying`, the inner service ready: makes the attempt of the current token with
    /// the time `left` read at `at` for its timeout header (`Calling`); `Err` with the
    /// answer when there is no token (a poll after completion).
    fn start_retry(
        &mut self,
        (at, left): (Option<Instant>, Option<Duration>),
    ) -> Result<(), Answer<R>> {
        let Some(token) = self.token.as_ref() else {
            self.state.set(State::Failed { error: None });
            return Err(Err(polled_after_completion()));
        };
        let mut parts = self.template.clone();
        let timeout =
            self.call
                .prepare_attempt_with(&mut parts.headers, &mut parts.extensions, token, left);
        let sent = Sent {
            at,
            timeout,
            grpc: self.call.is_grpc(),
        };
        let request = Request::from_parts(parts, self.body.clone());
        let future = self.service.attempt(request, sent);
        self.state.set(State::Calling { future });
        Ok(())
    }

    /// `Failed`: answers `error` (a failure before the first attempt), once.
    fn failed(&mut self, error: Option<BoxError>) -> Answer<R> {
        match error {
            Some(error) => Err(error),
            None => Err(polled_after_completion()),
        }
    }
}

impl<R> Outcome<R> {
    /// What the planner is told of the outcome.
    fn seen(&self) -> Seen<'_> {
        match self {
            Outcome::Response(r) => Seen::response(r.status(), r.headers()),
            Outcome::Error(e) => Seen::Failure(failure_of(&**e)),
            Outcome::TimedOut => Seen::TimedOut,
        }
    }

    /// The outcome as it is: a response, unmarked; a failure, its error; a time-out, a
    /// [`DeadlineExceeded`].
    #[inline]
    fn into_answer(self) -> Answer<R> {
        match self {
            Outcome::Response(r) => Ok(r),
            Outcome::Error(e) => Err(e),
            Outcome::TimedOut => Err(Box::new(DeadlineExceeded::new())),
        }
    }
}

fn polled_after_completion() -> BoxError {
    "retry future polled after completion".into()
}

/// The answer of a give-up: the last real response marked `do-not-retry`, or, with
/// none, `error`.
fn given_up<R>(
    call: &RetryCall,
    last: Option<Response<R>>,
    error: BoxError,
) -> Result<Response<R>, BoxError> {
    match last {
        Some(mut response) => {
            call.mark_given_up(response.headers_mut());
            Ok(response)
        }
        None => Err(error),
    }
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>> + fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        f.debug_struct("ResponseFuture")
            .field("service", &inner.service.0)
            .field("token", &inner.token)
            .field("call", &inner.call)
            .finish_non_exhaustive()
    }
}

impl<A, B> fmt::Debug for Driver<A, B>
where
    A: Attempts<B> + fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver")
            .field("service", &self.service)
            .field("token", &self.token)
            .field("call", &self.call)
            .finish_non_exhaustive()
    }
}
