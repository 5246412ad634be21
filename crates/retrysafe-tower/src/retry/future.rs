use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use retrysafe_core::__private::{Attempt as Seen, RetryCall, Verdict};
use retrysafe_core::error::DeadlineExceeded;
use retrysafe_core::strategy::{GiveUp, RetryToken};
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use super::attempts::{Attempts, Plain, Sent};
use super::body::ReplayBody;
use super::transport::failure_of;
use crate::BoxError;

pin_project! {
    /// The response future of [`RetryService`](super::RetryService). Polled again once
    /// it has answered, it answers an error.
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
        // An attempt under way.
        Calling { #[pin] future: F },
        // Waiting out the delay before a retry.
        Backoff,
        // Awaiting the transport's readiness for a retry.
        Readying,
        // The deadline was spent before the first attempt: answered at the first poll.
        TooLate,
        // Answered: a later poll answers an error and touches nothing.
        Done,
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
            State::TooLate
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
        loop {
            let answer = match this.state.as_mut().project() {
                StateProj::Calling { future } => {
                    let (next, outcome) = match future.poll(cx) {
                        // Decided on where it lies, and returned from here when it is the
                        // answer (as it is more often than not): a large response is
                        // copied once less for every layer of `Poll` and `Option` it is
                        // not wrapped in.
                        Poll::Ready(Ok(response)) => {
                            let seen = Seen::response(response.status(), response.headers());
                            match this.decide(seen) {
                                Next::Answer => {
                                    this.state.set(State::Done);
                                    return Poll::Ready(Ok(response));
                                }
                                next => (next, Outcome::Response(response)),
                            }
                        }
                        Poll::Ready(Err(error)) => this.failed(error),
                        Poll::Pending => ready!(this.poll_attempt_timeout(cx)),
                    };
                    match this.after(next, outcome) {
                        Some(answer) => answer,
                        None => continue,
                    }
                }
                StateProj::Backoff => {
                    ready!(this.poll_backoff(cx));
                    continue;
                }
                StateProj::Readying => match ready!(this.poll_readying(cx)) {
                    Some(answer) => answer,
                    None => continue,
                },
                StateProj::TooLate => this.too_late(),
                StateProj::Done => Err(polled_after_completion()),
            };
            if let Err(error) = &answer
                && error.is::<DeadlineExceeded>()
            {
                this.call.deadline_expired();
            }
            return Poll::Ready(answer);
        }
    }
}

type Answer<R> = Result<Response<R>, BoxError>;

impl<A, B, R> DriverProj<'_, A, B>
where
    A: Attempts<B, Response = Response<R>>,
    A::Error: Into<BoxError>,
    B: Body,
{
    /// `Calling`, the attempt failed: what to do, and the outcome to do it with.
    #[inline]
    fn failed(&mut self, error: A::Error) -> (Next, Outcome<R>) {
        // An error once the deadline is spent is the deadline's: a transport that times
        // the call from its timeout header (a tonic `Channel`) may fire at the very
        // instant of ours.
        let outcome = if self.call.too_late() {
            Outcome::TimedOut
        } else {
            Outcome::Error(error.into())
        };
        (self.decide(outcome.seen()), outcome)
    }

    /// `Calling`, the attempt under way: waits for its timer (the attempt timeout), then
    /// what to do with the attempt timed out.
    #[inline]
    fn poll_attempt_timeout(&mut self, cx: &mut Context<'_>) -> Poll<(Next, Outcome<R>)> {
        ready!(self.poll_timer(cx, RetryCall::attempt_until));
        Poll::Ready((self.decide(Seen::TimedOut), Outcome::TimedOut))
    }

    /// `Calling`, decided: the answer, or `None` when a retry was scheduled.
    #[inline]
    fn after(&mut self, next: Next, outcome: Outcome<R>) -> Option<Answer<R>> {
        match next {
            Next::Answer => {
                self.state.set(State::Done);
                Some(outcome.into_answer())
            }
            Next::GiveUp => Some(self.gave_up(outcome)),
            Next::Retry(next) => {
                self.schedule_retry(next, outcome);
                None
            }
        }
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

    /// `Calling`, the attempt over (its timer with it): asks the planner what to do with
    /// the outcome it has `seen`.
    #[inline]
    fn decide(&mut self, seen: Seen<'_>) -> Next {
        *self.armed = false;
        // Every attempt is made with a token, and only this takes it: there is always one.
        let Some(token) = self.token.take() else {
            return Next::Answer;
        };
        let last = self.retry.as_ref().and_then(|r| r.last.as_ref());
        let decision = self.call.decide(
            seen,
            token,
            self.body.is_replayable(),
            last.map(Response::status),
        );
        match decision {
            Verdict::Retry(next) => Next::Retry(next),
            Verdict::Success | Verdict::Final => Next::Answer,
            Verdict::GiveUp(_) => Next::GiveUp,
        }
    }

    /// `Calling`, given up on a retryable failure: the last real response, marked; or,
    /// with none, the failure.
    fn gave_up(&mut self, outcome: Outcome<R>) -> Answer<R> {
        self.state.set(State::Done);
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
                self.state.set(State::Done);
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
        self.state.set(State::Done);
        given_up(self.call, last, Box::new(DeadlineExceeded::new()))
    }

    /// `Readying`, the inner service ready: makes the attempt of the current token with
    /// the time `left` read at `at` for its timeout header (`Calling`); `Err` with the
    /// answer when there is no token.
    fn start_retry(
        &mut self,
        (at, left): (Option<Instant>, Option<Duration>),
    ) -> Result<(), Answer<R>> {
        // A retry is scheduled with its token: there is always one.
        let Some(token) = self.token.as_ref() else {
            self.state.set(State::Done);
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

    /// `TooLate`: the deadline was spent before the first attempt.
    fn too_late(&mut self) -> Answer<R> {
        self.state.set(State::Done);
        Err(Box::new(DeadlineExceeded::new()))
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

#[cfg(test)]
mod tests {
    #![allow(clippy::panic, reason = "test code: panics are the assertions")]

    use std::convert::Infallible;
    use std::future::Future;
    use std::pin::pin;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    use std::task::{Context, Poll, Waker};

    use http::{Request, Response, StatusCode};
    use retrysafe_core::Deadline;
    use retrysafe_core::error::DeadlineExceeded;
    use retrysafe_core::strategy::StandardRetryStrategy;
    use tokio::time::Instant;
    use tower::{Layer, Service, service_fn};

    use crate::BoxError;
    use crate::retry::{ReplayBody, RetryLayer};

    /// A transport answering `status` to every call, and the number of calls it got.
    fn transport(
        status: StatusCode,
    ) -> (
        impl Service<Request<ReplayBody<String>>, Response = Response<String>, Error = Infallible>
        + Clone,
        Arc<AtomicUsize>,
    ) {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&calls);
        let service = service_fn(move |_: Request<ReplayBody<String>>| {
            counted.fetch_add(1, Relaxed);
            let mut response = Response::new(String::new());
            *response.status_mut() = status;
            std::future::ready(Ok::<_, Infallible>(response))
        });
        (service, calls)
    }

    /// Polls `future` once with a waker that does nothing.
    fn poll_once<F: Future>(future: std::pin::Pin<&mut F>) -> Poll<F::Output> {
        future.poll(&mut Context::from_waker(Waker::noop()))
    }

    fn after_completion(polled: Poll<Result<Response<String>, BoxError>>) {
        match polled {
            Poll::Ready(Err(e)) => {
                assert_eq!(e.to_string(), "retry future polled after completion");
            }
            other => panic!("a second poll gave {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_answered_call_polled_again_answers_an_error_and_calls_nothing() {
        let (service, calls) = transport(StatusCode::OK);
        let mut retry = RetryLayer::new().layer(service);
        let mut future = pin!(retry.call(Request::new(String::new())));
        match poll_once(future.as_mut()) {
            Poll::Ready(Ok(response)) => assert_eq!(response.status(), StatusCode::OK),
            other => panic!("the first poll gave {other:?}"),
        }
        after_completion(poll_once(future.as_mut()));
        assert_eq!(calls.load(Relaxed), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_given_up_call_polled_again_answers_an_error_and_calls_nothing() {
        let (service, calls) = transport(StatusCode::SERVICE_UNAVAILABLE);
        let strategy = StandardRetryStrategy::new().seed(7);
        let mut retry = RetryLayer::new().strategy(strategy).layer(service);
        let mut future = pin!(retry.call(Request::new(String::new())));
        // The backoffs are waited out on the paused clock.
        let response = std::future::poll_fn(|cx| future.as_mut().poll(cx)).await;
        match response {
            Ok(response) => assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE),
            Err(e) => panic!("gave up with {e}"),
        }
        after_completion(poll_once(future.as_mut()));
        assert_eq!(calls.load(Relaxed), 3, "the strategy's three attempts");
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_out_of_time_at_the_start_answers_once_then_an_error() {
        let (service, calls) = transport(StatusCode::OK);
        let mut retry = RetryLayer::new().layer(service);
        let mut request = Request::new(String::new());
        request
            .extensions_mut()
            .insert(Deadline::at(Instant::now()));
        let mut future = pin!(retry.call(request));
        match poll_once(future.as_mut()) {
            Poll::Ready(Err(e)) => assert!(e.is::<DeadlineExceeded>(), "{e}"),
            other => panic!("the first poll gave {other:?}"),
        }
        after_completion(poll_once(future.as_mut()));
        assert_eq!(calls.load(Relaxed), 0);
    }
}
