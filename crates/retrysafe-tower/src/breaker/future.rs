//! The response future: drives the inner service's readiness, calls it, and records
//! the outcome on the permit.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use http::{HeaderMap, Request, Response};
use pin_project_lite::pin_project;
use retrysafe_core::__private::{BreakerFacts, Local};
use retrysafe_core::breaker::Permit;
use retrysafe_core::classify::{BreakerOutcome, Classification, Classifier, Failure, RequestFacts};
use retrysafe_core::error::CircuitOpen;
use tokio::time::Instant;
use tower_service::Service;

use super::body::ResponseBody;
use super::layer::Config;
use crate::BoxError;

pin_project! {
    /// The response future of [`CircuitBreakerService`](super::CircuitBreakerService).
    ///
    /// Dropping it before the response arrives drops its permit: a half-open probe
    /// dropped this way counts as a failure, a call of a closed breaker as nothing.
    pub struct ResponseFuture<S, ReqB>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, Request<ReqB>, S::Future>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, R, F> {
        // Admitted: awaiting the readiness of the inner service, the instance that was
        // not ready (boxed: this slow path is rare, and the future stays small for the
        // common one).
        Readying { waiting: Option<Box<(S, R)>>, call: Option<Call> },
        Calling { #[pin] future: F, call: Option<Call> },
        Refused { open: Option<CircuitOpen> },
        // The inner service failed to become ready (recorded already).
        Failed { error: Option<BoxError> },
        Done,
    }
}

impl<S, ReqB> ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    /// An admitted call of `request` on `service`: called at once, in place, when
    /// `service` is ready already (polled with a no-op waker), else awaiting its
    /// readiness in the future — the instance polled goes there, to be polled again with
    /// the caller's waker. Either way that leaves `service` to the next call only when it
    /// is good for one: an instance that moved into the future, or that failed its
    /// readiness (tower's contract: discard it), is replaced by `fresh()`. So the common
    /// case clones nothing. `now` is a clock reading the caller just made, if any, to
    /// time the call from.
    #[inline]
    pub(crate) fn admitted(
        service: &mut S,
        request: Request<ReqB>,
        mut call: Call,
        now: Option<Instant>,
        fresh: impl FnOnce() -> S,
    ) -> Self
    where
        S::Error: Into<BoxError>,
    {
        let state = match service.poll_ready(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(Ok(())) => {
                call.start(now);
                State::Calling {
                    future: service.call(request),
                    call: Some(call),
                }
            }
            Poll::Ready(Err(error)) => {
                *service = fresh();
                let error = error.into();
                call.failed(&*error);
                State::Failed { error: Some(error) }
            }
            Poll::Pending => State::Readying {
                waiting: Some(Box::new((std::mem::replace(service, fresh()), request))),
                call: Some(call),
            },
        };
        ResponseFuture { state }
    }

    /// A call refused before the breaker (a budget's refusal): `error`, and nothing
    /// recorded.
    #[cfg(feature = "client")]
    pub(crate) fn failed(error: BoxError) -> Self {
        ResponseFuture {
            state: State::Failed { error: Some(error) },
        }
    }

    /// A refused call.
    pub(crate) fn refused(open: CircuitOpen) -> Self {
        ResponseFuture {
            state: State::Refused { open: Some(open) },
        }
    }
}

impl<S, ReqB, ResB> Future for ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
{
    type Output = Result<Response<ResponseBody<ResB>>, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let mut state = self.as_mut().project().state;
            let answer = match state.as_mut().project() {
                // The common case first, answered where it is: a call that has answered
                // keeps its state (the inner future and no call: see `calling`), so
                // nothing is dropped or written on the way out.
                StateProj::Calling { future, call } => {
                    return calling(future, call, cx);
                }
                StateProj::Readying { waiting, call } => {
                    match ready!(poll_readying(waiting, call, cx)) {
                        Ok(Some(next)) => {
                            state.set(next);
                            continue;
                        }
                        Ok(None) => {
                            state.set(State::Done);
                            continue;
                        }
                        Err(error) => Err(error),
                    }
                }
                StateProj::Failed { error } => {
                    Err(error.take().unwrap_or_else(polled_after_completion))
                }
                StateProj::Refused { open } => Err(refused(open)),
                StateProj::Done => {
                    return Poll::Ready(Err(polled_after_completion()));
                }
            };
            state.set(State::Done);
            return Poll::Ready(answer);
        }
    }
}

/// `Calling`: awaits the inner service's answer and records it. Every call in this
/// state has its `Call` until it answers, so a call without one has answered already.
#[inline]
fn calling<F, ResB, E>(
    future: Pin<&mut F>,
    call: &mut Option<Call>,
    cx: &mut Context<'_>,
) -> Poll<Result<Response<ResponseBody<ResB>>, BoxError>>
where
    F: Future<Output = Result<Response<ResB>, E>>,
    E: Into<BoxError>,
{
    if call.is_none() {
        return Poll::Ready(Err(polled_after_completion()));
    }
    let result = ready!(future.poll(cx));
    let Some(call) = call.take() else {
        return Poll::Ready(Err(polled_after_completion()));
    };
    Poll::Ready(match result {
        Ok(response) => Ok(call.respond(response)),
        Err(error) => {
            let error = error.into();
            call.failed(&*error);
            Err(error)
        }
    })
}

/// The state of a future of service `S` for requests of body `ReqB`.
type CallState<S, ReqB> = State<S, Request<ReqB>, <S as Service<Request<ReqB>>>::Future>;

/// `Readying`: awaits the readiness of the service, then calls it: the `Calling` state
/// (`None` after completion), or the readiness error (recorded).
fn poll_readying<S, ReqB>(
    waiting: &mut Option<Box<(S, Request<ReqB>)>>,
    call: &mut Option<Call>,
    cx: &mut Context<'_>,
) -> Poll<Result<Option<CallState<S, ReqB>>, BoxError>>
where
    S: Service<Request<ReqB>>,
    S::Error: Into<BoxError>,
{
    let Some((service, _)) = waiting.as_deref_mut() else {
        return Poll::Ready(Ok(None));
    };
    match ready!(service.poll_ready(cx)) {
        Ok(()) => {
            let (Some(boxed), Some(mut call)) = (waiting.take(), call.take()) else {
                return Poll::Ready(Ok(None));
            };
            let (mut service, request) = *boxed;
            call.start(None);
            let future = service.call(request);
            Poll::Ready(Ok(Some(State::Calling {
                future,
                call: Some(call),
            })))
        }
        Err(error) => {
            let error = error.into();
            if let Some(call) = call.take() {
                call.failed(&*error);
            }
            Poll::Ready(Err(error))
        }
    }
}

fn polled_after_completion() -> BoxError {
    "breaker response future polled after completion".into()
}

/// `Refused`: the refusal, [`CircuitOpen`].
fn refused(open: &mut Option<CircuitOpen>) -> BoxError {
    Box::new(
        open.take()
            .unwrap_or_else(|| CircuitOpen::new(Duration::ZERO)),
    )
}

impl<S, ReqB> fmt::Debug for ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

/// An admitted call: its permit and what classifying its outcome needs.
pub(crate) struct Call {
    permit: Permit,
    facts: BreakerFacts,
    config: Local<Config>,
    /// Slow calls are tracked: time the call.
    timed: bool,
    started: Option<Instant>,
}

impl Call {
    pub(crate) fn new(
        permit: Permit,
        facts: BreakerFacts,
        config: Local<Config>,
        timed: bool,
    ) -> Self {
        Call {
            permit,
            facts,
            config,
            timed,
            started: None,
        }
    }

    /// The inner service is being called now (readiness waits are not the callee's
    /// slowness, nor part of the time the callee was given), as read at `now` when the
    /// caller just read the clock.
    fn start(&mut self, now: Option<Instant>) {
        if self.timed || self.facts.carries_deadline() {
            self.started = Some(now.unwrap_or_else(Instant::now));
        }
    }

    /// The time since [`start`](Self::start) (one clock read; none when untimed).
    fn elapsed(&self) -> Option<Duration> {
        self.started.map(|s| s.elapsed())
    }

    /// Records `outcome` with the time since [`start`](Self::start).
    pub(crate) fn record(self, outcome: BreakerOutcome) {
        let elapsed = if self.timed { self.elapsed() } else { None };
        self.record_after(outcome, elapsed);
    }

    /// Records `outcome` of a call that took `elapsed` (read once for the facts too).
    fn record_after(self, outcome: BreakerOutcome, elapsed: Option<Duration>) {
        let elapsed = match elapsed {
            Some(elapsed) if self.timed => elapsed,
            _ => Duration::ZERO,
        };
        self.permit.record(outcome, elapsed);
    }

    /// Classifies the answer with `classify` given the facts as they stand now (a
    /// deadline the request carried is spent when the answer comes at, or near, its end:
    /// a timeout then is the caller's), and records it: one clock read for both, and
    /// none for a success the time cannot change (an untimed call, a classifier that
    /// reads the spent deadline for failures only).
    fn settle(self, classify: impl Fn(&dyn Classifier, &RequestFacts) -> Classification) {
        let classifier = &*self.config.classifier;
        if !self.timed && !classifier.reads_spent_on_success() {
            let c = classify(classifier, &self.facts.after(None));
            if c.is_success() {
                self.permit.record(c.breaker_outcome(), Duration::ZERO);
                return;
            }
        }
        let elapsed = self.elapsed();
        let c = classify(&*self.config.classifier, &self.facts.after(elapsed));
        self.record_after(c.breaker_outcome(), elapsed);
    }

    /// The call failed with `error` (no response, or a broken response stream).
    pub(crate) fn failed(self, error: &(dyn StdError + 'static)) {
        let failure = failure_of(error);
        self.settle(|c, facts| c.classify_failure(failure, facts));
    }

    /// The response stream broke after the head.
    pub(crate) fn stream_failed(self) {
        self.settle(|c, facts| c.classify_failure(Failure::Other, facts));
    }

    /// The trailers at the end of the response stream (empty when it ended without).
    pub(crate) fn trailers(self, trailers: &HeaderMap) {
        self.settle(|c, facts| c.classify_trailers(trailers, facts));
    }

    /// The response head arrived: records its outcome now, or — for a gRPC response
    /// whose status will come in the trailers — wraps the body to record it then.
    fn respond<B>(self, response: Response<B>) -> Response<ResponseBody<B>> {
        if self.facts.is_grpc()
            && response.status().is_success()
            && !response.headers().contains_key("grpc-status")
        {
            return response.map(|body| ResponseBody::pending(body, self));
        }
        self.settle(|c, facts| c.classify_response(response.status(), response.headers(), facts));
        response.map(ResponseBody::plain)
    }
}

/// What kind of transport failure `error` is.
fn failure_of(error: &(dyn StdError + 'static)) -> Failure {
    #[cfg(feature = "retry")]
    {
        crate::retry::failure_of(error)
    }
    #[cfg(not(feature = "retry"))]
    {
        Failure::of(error, |_| None)
    }
}
