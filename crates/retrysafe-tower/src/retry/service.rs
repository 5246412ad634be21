use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use http_body::Body;
use retrysafe_core::__private::RetryPolicy;
use retrysafe_core::Deadline;
use tower_service::Service;

use super::attempts::{Attempts, Plain, Sent};
use super::body::ReplayBody;
use super::future::{Driver, ResponseFuture};
use super::layer::{Config, MAX_REPLAY_CAP};
use crate::BoxError;

/// The service of a [`RetryLayer`](super::RetryLayer).
#[derive(Clone, Debug)]
pub struct RetryService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> RetryService<S> {
    pub(crate) fn from_config(inner: S, config: Arc<Config>) -> Self {
        RetryService { inner, config }
    }

    define_inner_service_accessors!();
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for RetryService<S>
where
    S: Service<Request<ReplayBody<ReqB>>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
    ReqB: Body,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<S, ReqB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        let clone = self.inner.clone();
        let service = std::mem::replace(&mut self.inner, clone);
        let (parts, body) = request.into_parts();
        ResponseFuture::new(begin(
            &self.config,
            (parts, body),
            None,
            |_| Plain(service),
            Attempts::attempt,
        ))
    }
}

/// A deadline of a fused stack's own, made at the start of a call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Within {
    /// The deadline.
    pub(crate) deadline: Deadline,
    /// The clock reading it was made from.
    pub(crate) now: tokio::time::Instant,
    /// The time from `now` to the deadline (the timeout it was made with), known
    /// without a subtraction.
    pub(crate) left: Duration,
}

/// Starts a call of `parts` and `body` (the attempts' maker, ready or not, made by
/// `attempts` from the head as the planner leaves it; the first attempt made by `first`):
/// the planner's `begin`, the body made replayable, the first attempt. `within` is a
/// deadline of the caller's own, if it has one: its clock reading is the call's start
/// (the budget's deposit and the first attempt's check and timeout header need no
/// other), and its time left the first attempt's when no sooner deadline applies.
#[inline]
pub(crate) fn begin<A, B>(
    config: &Config,
    (parts, body): (http::request::Parts, B),
    within: Option<Within>,
    attempts: impl FnOnce(&http::request::Parts) -> A,
    first: impl FnOnce(&mut A, Request<ReplayBody<B>>, Sent) -> A::Future,
) -> Driver<A, B>
where
    A: Attempts<B>,
    B: Body,
{
    let body = ReplayBody::new(body, config.replay_cap.min(MAX_REPLAY_CAP));
    begin_replay(config, (parts, body), within, attempts, first)
}

/// [`begin`] with a body made replayable already (a hedge's copy, which shares the
/// copy of the body its race keeps).
#[inline]
pub(crate) fn begin_replay<A, B>(
    config: &Config,
    (mut parts, body): (http::request::Parts, ReplayBody<B>),
    within: Option<Within>,
    attempts: impl FnOnce(&http::request::Parts) -> A,
    first: impl FnOnce(&mut A, Request<ReplayBody<B>>, Sent) -> A::Future,
) -> Driver<A, B>
where
    A: Attempts<B>,
{
    let (call, token) = RetryPolicy::begin_within(
        &config.policy,
        &mut parts,
        within.map(|w| (w.deadline, w.now)),
    );
    // The call's deadline is ours (nothing in the request is sooner): the time left at
    // our reading is the timeout it was made with.
    let now = within.map(|w| {
        (
            w.now,
            (call.deadline() == Some(w.deadline)).then_some(w.left),
        )
    });
    let attempts = attempts(&parts);
    Driver::start(attempts, (parts, body), token, call, now, first)
}
