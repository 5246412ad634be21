use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::{Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use super::error::{ConnectionReset, ReplyLost};
use super::layer::{Config, Counts, Fault, Plan};
use crate::BoxError;
use crate::answer::LocalBody;

pin_project! {
    /// The response future of [`FaultService`](super::FaultService).
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S, B>,
        config: Arc<Config>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B>
    where
        S: Service<Request<B>>,
    {
        // An injected latency, before the call (or its fault).
        Delayed {
            #[pin]
            sleep: Sleep,
            call: Option<(S, Request<B>)>,
            fault: Option<Fault>,
        },
        // The inner service's call; its answer is dropped when `lose` is set.
        Calling {
            #[pin]
            future: S::Future,
            lose: bool,
        },
        // A fault answered without calling the inner service: an error answer of
        // this status, or (`None`) a reset connection.
        Faulted {
            status: Option<StatusCode>,
        },
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    pub(super) fn delayed(
        plan: Plan,
        service: S,
        request: Request<B>,
        config: Arc<Config>,
    ) -> Self {
        Counts::add(&config.counts.delayed);
        let delay = plan.delay.unwrap_or_default();
        ResponseFuture {
            state: State::Delayed {
                sleep: tokio::time::sleep(delay),
                call: Some((service, request)),
                fault: plan.fault,
            },
            config,
        }
    }

    pub(super) fn now(
        fault: Option<Fault>,
        service: &mut S,
        request: Request<B>,
        config: Arc<Config>,
    ) -> Self {
        ResponseFuture {
            state: start(fault, service, request),
            config,
        }
    }
}

/// The state after any delay: a call, or a fault that makes none.
fn start<S, B>(fault: Option<Fault>, service: &mut S, request: Request<B>) -> State<S, B>
where
    S: Service<Request<B>>,
{
    match fault {
        Some(Fault::Reset) => State::Faulted { status: None },
        Some(Fault::Error(status)) => State::Faulted {
            status: Some(status),
        },
        Some(Fault::LostReply) => State::Calling {
            future: service.call(request),
            lose: true,
        },
        None => State::Calling {
            future: service.call(request),
            lose: false,
        },
    }
}

impl<S, B, ResB> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
{
    type Output = Result<Response<LocalBody<ResB>>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Delayed { sleep, call, fault } => {
                    ready!(sleep.poll(cx));
                    let fault = *fault;
                    let Some((mut service, request)) = call.take() else {
                        // Only polled again after completion, which a caller must not do.
                        return Poll::Pending;
                    };
                    this.state.set(start(fault, &mut service, request));
                }
                StateProj::Calling { future, lose } => {
                    let response = ready!(future.poll(cx)).map_err(Into::into)?;
                    if *lose {
                        // The call ran to its answer; the caller never sees it.
                        drop(response);
                        Counts::add(&this.config.counts.lost_replies);
                        return Poll::Ready(Err(Box::new(ReplyLost::new())));
                    }
                    return Poll::Ready(Ok(response.map(LocalBody::inner)));
                }
                StateProj::Faulted { status } => {
                    return Poll::Ready(faulted(*status, this.config));
                }
            }
        }
    }
}

/// The answer of a fault that calls nothing.
fn faulted<ResB>(
    status: Option<StatusCode>,
    config: &Config,
) -> Result<Response<LocalBody<ResB>>, BoxError> {
    match status {
        Some(status) => {
            Counts::add(&config.counts.errors);
            let mut response = Response::new(LocalBody::default());
            *response.status_mut() = status;
            Ok(response)
        }
        None => {
            Counts::add(&config.counts.resets);
            Err(Box::new(ConnectionReset::new()))
        }
    }
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
