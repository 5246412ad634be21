use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use retrysafe_core::classify::Failure;
use retrysafe_core::error::DeadlineExceeded;
use retrysafe_core::retry::{Decision, Outcome as Seen, RetryCall};
use retrysafe_core::strategy::{GiveUp, RetryCharged, RetryToken};
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use super::body::ReplayBody;
use super::transport::failure_of;
use crate::local::{BoxError, LocalAnswer, LocalFailure};

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
        // The planner's state of this call (retrysafe-core).
        call: RetryCall,
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

enum Outcome<R> {
    Response(Response<R>),
    /// A response a layer below synthesised for its own failure ([`LocalAnswer`]).
    Local(Response<R>),
    Error(BoxError),
    TimedOut,
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
        call: RetryCall,
    ) -> Self {
        let backup = body.clone();
        // One clock read for the check and the timeout header.
        let left = call.time_left();
        let state = if RetryCall::too_late_with(left) {
            State::Failed {
                error: Some(Box::new(DeadlineExceeded::new())),
            }
        } else {
            let mut parts = template.clone();
            call.prepare_attempt_with(&mut parts.headers, &mut parts.extensions, &token, left);
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
            call,
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
                        Poll::Ready(Ok(response))
                            if response.extensions().get::<LocalAnswer>().is_some() =>
                        {
                            Outcome::Local(response)
                        }
                        Poll::Ready(Ok(response)) => Outcome::Response(response),
                        // An error once the deadline is spent is the deadline's: a
                        // transport that times the call from its timeout header (a
                        // tonic `Channel`) may fire at the very instant of ours.
                        Poll::Ready(Err(_)) if this.call.too_late() => Outcome::TimedOut,
                        Poll::Ready(Err(e)) => Outcome::Error(e.into()),
                        Poll::Pending => {
                            if !*this.armed {
                                let Some(at) = this.call.attempt_until() else {
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
                    let last = this.retry.as_ref().and_then(|r| r.last.as_ref());
                    let decision = this.call.decide(
                        match &outcome {
                            Outcome::Response(r) => Seen::response(r.status(), r.headers()),
                            Outcome::Local(_) => Seen::Failure(Failure::Local),
                            Outcome::Error(e) => Seen::Failure(failure_of(&**e)),
                            Outcome::TimedOut => Seen::TimedOut,
                        },
                        token,
                        this.body.is_replayable(),
                        last.map(Response::status),
                    );
                    let next = match decision {
                        Decision::Retry(next) => next,
                        Decision::Success => {
                            this.state.set(State::Failed { error: None });
                            return Poll::Ready(match outcome {
                                Outcome::Response(r) | Outcome::Local(r) => Ok(r),
                                Outcome::Error(e) => Err(e),
                                Outcome::TimedOut => Err(Box::new(DeadlineExceeded::new())),
                            });
                        }
                        Decision::Final => {
                            this.state.set(State::Failed { error: None });
                            return Poll::Ready(match outcome {
                                Outcome::Response(r) | Outcome::Local(r) => Ok(r),
                                Outcome::Error(e) => answer::<R, M>(this.call, e),
                                Outcome::TimedOut => {
                                    answer::<R, M>(this.call, Box::new(DeadlineExceeded::new()))
                                }
                            });
                        }
                        Decision::GiveUp(_) => {
                            this.state.set(State::Failed { error: None });
                            let last = this.retry.as_mut().and_then(|r| r.last.take());
                            let (last, error): (_, BoxError) = match outcome {
                                Outcome::Response(r) => {
                                    (Some(r), Box::new(DeadlineExceeded::new()))
                                }
                                // The real response before the refusal; or, with none,
                                // the refusal's own answer.
                                Outcome::Local(r) => match last {
                                    Some(last) => (Some(last), Box::new(DeadlineExceeded::new())),
                                    None => return Poll::Ready(Ok(r)),
                                },
                                Outcome::Error(e) => (last, e),
                                Outcome::TimedOut => (last, Box::new(DeadlineExceeded::new())),
                            };
                            return Poll::Ready(given_up::<R, M>(this.call, last, error));
                        }
                    };
                    let delay = next.delay();
                    let span = RetryCall::attempt_span(&next);
                    let last = match outcome {
                        Outcome::Response(r) => Some(r),
                        Outcome::Local(_) | Outcome::Error(_) | Outcome::TimedOut => {
                            this.retry.as_mut().and_then(|r| r.last.take())
                        }
                    };
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
                    // One clock read for the check and the timeout header.
                    let mut left = None;
                    let expired = match ready {
                        Poll::Ready(Ok(())) => {
                            left = this.call.time_left();
                            RetryCall::too_late_with(left)
                        }
                        Poll::Ready(Err(_)) => false,
                        Poll::Pending => {
                            // Waiting for readiness counts against the deadline.
                            if !*this.armed {
                                let Some(at) = this.call.overall_until() else {
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
                        let attempts = this.token.take().map_or(1, |t| t.attempt()) - 1;
                        let last = this.retry.as_mut().and_then(|r| r.last.take());
                        this.call.give_up(
                            GiveUp::NotEnoughTime,
                            attempts,
                            last.as_ref().map(Response::status),
                        );
                        this.state.set(State::Failed { error: None });
                        return Poll::Ready(given_up::<R, M>(
                            this.call,
                            last,
                            Box::new(DeadlineExceeded::new()),
                        ));
                    }
                    match ready {
                        Poll::Ready(Ok(())) => {
                            *this.armed = false;
                            let Some(token) = this.token.as_ref() else {
                                this.state.set(State::Failed { error: None });
                                return Poll::Ready(Err(
                                    "retry future polled after completion".into()
                                ));
                            };
                            let mut parts = this.template.clone();
                            this.call.prepare_attempt_with(
                                &mut parts.headers,
                                &mut parts.extensions,
                                token,
                                left,
                            );
                            let request = Request::from_parts(parts, this.body.clone());
                            let future = {
                                let _entered = this.retry.as_ref().map(|r| r.span.enter());
                                let _mark = token.budget_id().map(RetryCharged::mark);
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
                    return Poll::Ready(answer::<R, M>(this.call, error));
                }
            }
        }
    }
}

/// A local failure (or an error passed on), answered as `M` says.
fn answer<R, M: LocalFailure<R>>(
    call: &RetryCall,
    error: BoxError,
) -> Result<Response<R>, BoxError> {
    M::answer(call.is_grpc(), error, call.policy().convention())
}

/// The answer of a give-up: the last real response marked `do-not-retry`, or, with
/// none, `error`.
fn given_up<R, M: LocalFailure<R>>(
    call: &RetryCall,
    last: Option<Response<R>>,
    error: BoxError,
) -> Result<Response<R>, BoxError> {
    match last {
        Some(mut response) => {
            call.mark_given_up(response.headers_mut());
            Ok(response)
        }
        None => answer::<R, M>(call, error),
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
            .field("call", &self.call)
            .finish_non_exhaustive()
    }
}
