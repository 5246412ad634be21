use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Method, Request, Response};
use http_body::Body;
use retrysafe_core::__private::HedgeRace;
use retrysafe_core::budget::RetryBudget;
use retrysafe_core::classify::RequestFacts;
use retrysafe_core::observe::AttemptNumber;
use retrysafe_core::strategy::{Idempotent, NoRetry};
use retrysafe_core::{CallContext, Deadline};
use tower_service::Service;

use super::future::ResponseFuture;
use super::layer::Config;
use crate::BoxError;
use crate::retry::ReplayBody;

/// The service of a [`HedgeLayer`](super::HedgeLayer).
#[derive(Clone, Debug)]
pub struct HedgeService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> HedgeService<S> {
    pub(super) fn new(inner: S, config: Arc<Config>) -> Self {
        HedgeService { inner, config }
    }

    define_inner_service_accessors!();
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for HedgeService<S>
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
        let (mut parts, body) = request.into_parts();
        if parts.extensions.get::<RetryBudget>().is_none() {
            parts.extensions.insert(self.config.budget.clone());
        }
        match hedgeable(&self.config, &parts) {
            Some(hedgeable) => {
                let body = ReplayBody::new(body, self.config.replay_cap.min(1 << 30));
                let next = self.inner.clone();
                race(&self.config, service, next, parts, body, hedgeable)
            }
            None => {
                let mut service = service;
                let body = ReplayBody::new(body, 0);
                ResponseFuture::plain(service.call(Request::from_parts(parts, body)))
            }
        }
    }
}

/// Starts the race of a hedgeable request (`hedgeable` is what [`hedgeable`] said of
/// it): its first copy is sent on `service` at once, with `body` (which keeps the copy
/// the hedges replay); the hedges go to `next`.
pub(crate) fn race<S, B>(
    config: &Arc<Config>,
    mut service: S,
    next: S,
    mut parts: http::request::Parts,
    body: ReplayBody<B>,
    (facts, deadline): (RequestFacts, Option<Deadline>),
) -> ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>>,
{
    // Every copy's breaker sees a cancellation by the hedge as neutral.
    parts.extensions.insert(HedgeRace::new());
    // The first copy is attempt 1; the hedges number on from it.
    parts.extensions.insert(AttemptNumber::new(1));
    let template = parts.clone();
    // The first copy holds the body (the one `ReplayBody::new` made: a clone would wait
    // for it) and streams it; the hedges replay what it read.
    let copies = body.clone();
    let primary = service.call(Request::from_parts(parts, body));
    let request = super::future::Copyable {
        template,
        body: copies,
        facts,
        deadline,
    };
    ResponseFuture::hedged(primary, next, request, config)
}

/// The facts of a request this layer may hedge, or `None`: a request that is not safe
/// to repeat (a keyed POST is, with `hedge_keyed_requests`), one that asks for no
/// retry, or one whose caller is the retry point (only it may add attempts).
pub(crate) fn hedgeable(
    config: &Config,
    parts: &http::request::Parts,
) -> Option<(RequestFacts, Option<Deadline>)> {
    let ext = &parts.extensions;
    if ext.get::<NoRetry>().is_some() {
        return None;
    }
    let context = CallContext::inherited(ext);
    if context
        .as_ref()
        .is_some_and(CallContext::caller_is_retry_point)
    {
        return None;
    }
    let mut facts = RequestFacts::of(&parts.method, &parts.headers, &config.convention);
    let declared = ext.get::<Idempotent>().is_some();
    let keyed_only = !parts.method.is_idempotent() && !declared && facts.has_key;
    if keyed_only && !config.keyed {
        return None;
    }
    if !(parts.method.is_idempotent() || declared || facts.has_key)
        || parts.method == Method::CONNECT
    {
        return None;
    }
    facts.safe = true;
    let deadline = ext
        .get::<Deadline>()
        .copied()
        .or_else(|| context.as_ref().and_then(CallContext::deadline));
    facts.deadline_sent = deadline.is_some() || facts.deadline_sent;
    Some((facts, deadline))
}
