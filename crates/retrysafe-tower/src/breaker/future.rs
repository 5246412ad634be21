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
use retrysafe_core::classify::{BreakerOutcome, Failure, RequestFacts};
use retrysafe_core::error::CircuitOpen;
use tokio::time::Instant;
use tower_service::Service;

use super::body::ResponseBody;
use super::layer::Config;
use crate::local::BoxError;

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
        // Admitted: awaiting the readiness of a clone of the inner service (boxed: this
        // slow path is rare, and the future stays small for the common one).
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
    /// An admitted call of `request` on `service`: called at once when `service` is
    /// ready already (polled with a no-op waker: the future polls it again with the
    /// caller's waker when it is not), else awaiting its readiness in the future.
    pub(crate) fn admitted(mut service: S, request: Request<ReqB>, mut call: Call) -> Self
    where
        S::Error: Into<BoxError>,
    {
        let state = match service.poll_ready(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(Ok(())) => {
                call.start();
                State::Calling {
                    future: service.call(request),
                    call: Some(call),
                }
            }
            Poll::Ready(Err(error)) => {
                let error = error.into();
                call.failed(&*error);
                State::Failed { error: Some(error) }
            }
            Poll::Pending => State::Readying {
                waiting: Some(Box::new((service, request))),
                call: Some(call),
            },
        };
        ResponseFuture { state }
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
                StateProj::Failed { error } => Err(error
                    .take()
                    .unwrap_or_else(|| "breaker response future polled after completion".into())),
                StateProj::Calling { future, call } => {
                    let result = ready!(future.poll(cx));
                    responded(result, call.take())
                }
                StateProj::Refused { open } => Err(refused(open)),
                StateProj::Done => {
                    return Poll::Ready(Err(
                        "breaker response future polled after completion".into()
                    ));
                }
            };
            state.set(State::Done);
            return Poll::Ready(answer);
        }
    }
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
            call.start();
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

/// `Calling`, the inner service answered: records the outcome on the permit.
fn responded<ResB, E: Into<BoxError>>(
    result: Result<Response<ResB>, E>,
    call: Option<Call>,
) -> Result<Response<ResponseBody<ResB>>, BoxError> {
    match (result, call) {
        (Ok(response), Some(call)) => Ok(call.respond(response)),
        (Ok(response), None) => Ok(response.map(ResponseBody::plain)),
        (Err(error), call) => {
            let error = error.into();
            if let Some(call) = call {
                call.failed(&*error);
            }
            Err(error)
        }
    }
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
    /// slowness, nor part of the time the callee was given).
    fn start(&mut self) {
        if self.timed || self.facts.carries_deadline() {
            self.started = Some(Instant::now());
        }
    }

    /// The facts to classify with now: a deadline the request carried is spent when
    /// the callee's answer comes at (or near) its end — a timeout then is the caller's.
    fn facts(&self) -> RequestFacts {
        self.facts.after(self.started.map(|s| s.elapsed()))
    }

    /// Records `outcome` with the time since [`start`](Self::start).
    pub(crate) fn record(self, outcome: BreakerOutcome) {
        let elapsed = match self.started {
            Some(started) if self.timed => started.elapsed(),
            _ => Duration::ZERO,
        };
        self.permit.record(outcome, elapsed);
    }

    /// The call failed with `error` (no response, or a broken response stream).
    pub(crate) fn failed(self, error: &(dyn StdError + 'static)) {
        let c = self
            .config
            .classifier
            .classify_failure(failure_of(error), &self.facts());
        self.record(c.breaker_outcome());
    }

    /// The response stream broke after the head.
    pub(crate) fn stream_failed(self) {
        let c = self
            .config
            .classifier
            .classify_failure(Failure::Other, &self.facts());
        self.record(c.breaker_outcome());
    }

    /// The trailers at the end of the response stream (empty when it ended without).
    pub(crate) fn trailers(self, trailers: &HeaderMap) {
        let c = self
            .config
            .classifier
            .classify_trailers(trailers, &self.facts());
        self.record(c.breaker_outcome());
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
        let c = self.config.classifier.classify_response(
            response.status(),
            response.headers(),
            &self.facts(),
        );
        self.record(c.breaker_outcome());
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
