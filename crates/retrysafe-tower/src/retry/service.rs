use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Method, Request, Response};
use http_body::Body;
use retrysafe_core::classify::{RequestFacts, is_grpc};
use retrysafe_core::idempotency::Token;
use retrysafe_core::strategy::{Idempotent, NoRetry};
use retrysafe_core::wire::{
    IdempotencyKey, RETRY_POINT_CALLER, parse_grpc_timeout, parse_request_timeout_ms,
};
use retrysafe_core::{CallContext, Deadline};
use tower_service::Service;

use super::body::ReplayBody;
use super::future::{Attempts, ResponseFuture};
use super::layer::Config;
use crate::local::{BoxError, LocalFailure};

/// The service of a [`RetryLayer`](super::RetryLayer).
pub struct Retry<S, M> {
    inner: S,
    config: Arc<Config>,
    _local: PhantomData<fn() -> M>,
}

impl<S, M> Retry<S, M> {
    pub(crate) fn from_config(inner: S, config: Arc<Config>) -> Self {
        Retry {
            inner,
            config,
            _local: PhantomData,
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone, M> Clone for Retry<S, M> {
    fn clone(&self) -> Self {
        Retry {
            inner: self.inner.clone(),
            config: self.config.clone(),
            _local: PhantomData,
        }
    }
}

impl<S: fmt::Debug, M> fmt::Debug for Retry<S, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retry")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
}

impl<S, M, ReqB, ResB> Service<Request<ReqB>> for Retry<S, M>
where
    S: Service<Request<ReplayBody<ReqB>>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
    ReqB: Body,
    M: LocalFailure<ResB>,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<S, ReqB, M>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        let clone = self.inner.clone();
        let service = std::mem::replace(&mut self.inner, clone);
        let config = &*self.config;
        let convention = &config.convention;
        let (mut parts, body) = request.into_parts();

        let context = CallContext::inherited(&parts.extensions);
        // (Not `RequestFacts::of`: the deadline headers are read once, below.)
        let mut facts = RequestFacts::UNSAFE;
        facts.has_key = parts.headers.contains_key(convention.idempotency_key());
        facts.safe = parts.method.is_idempotent() || facts.has_key;
        facts.grpc = is_grpc(&parts.headers);
        if parts.extensions.get::<Idempotent>().is_some()
            || config.idempotent_if.as_ref().is_some_and(|f| f(&parts))
        {
            facts.safe = true;
        }
        let no_retry = parts.extensions.get::<NoRetry>().is_some();

        if config.generate_keys
            && !facts.has_key
            && !no_retry
            && (parts.method == Method::POST || parts.method == Method::PATCH)
        {
            let key = match context.as_ref().and_then(|c| c.idempotency()) {
                Some(idem) => Some(idem.next_child_key(&label(&parts))),
                None => random_key(),
            };
            if let Some(key) = key {
                parts
                    .headers
                    .insert(convention.idempotency_key().clone(), key.to_header_value());
                facts.has_key = true;
                facts.safe = true;
            }
        }
        let caller_is_retry_point = context
            .as_ref()
            .is_some_and(CallContext::caller_is_retry_point);
        // This layer is the retry point, or an upstream caller is: either way, nothing
        // below may retry this request's calls.
        if config.retry_point || caller_is_retry_point {
            parts
                .headers
                .insert(convention.retry_point().clone(), RETRY_POINT_CALLER);
        }

        // The deadline: the request's, the inherited one, and a timeout header the
        // caller already set, whichever is soonest.
        let mut deadline = parts.extensions.get::<Deadline>().copied();
        if let Some(inherited) = context.as_ref().and_then(CallContext::deadline) {
            deadline = Some(inherited.tighten(deadline));
        }
        if let Some(d) = header_deadline(&parts, &facts, convention) {
            deadline = Some(d.tighten(deadline));
        }
        // Every attempt carries the deadline header when there is a deadline, so a 504 or
        // `DEADLINE_EXCEEDED` may be the callee running out of the time we gave it.
        facts.deadline_sent = deadline.is_some();

        let budget = parts
            .extensions
            .get::<retrysafe_core::budget::RetryBudget>()
            .cloned();
        let mut token = config.strategy.acquire_initial_retry_token(budget);
        let passthrough = no_retry || caller_is_retry_point;
        if passthrough {
            token.limit_attempts(1);
        }

        let attempts = Attempts {
            config: self.config.clone(),
            facts,
            context,
            passthrough,
            deadline,
            started: None,
        };
        ResponseFuture::start(
            service,
            parts,
            ReplayBody::new(body, config.replay_cap),
            token,
            attempts,
        )
    }
}

/// The label of a child key: method, authority and path.
fn label(parts: &http::request::Parts) -> String {
    let authority = parts.uri.authority().map_or("", |a| a.as_str());
    format!("{} {}{}", parts.method, authority, parts.uri.path())
}

/// A random 128-bit key (32 hex digits, always valid).
fn random_key() -> Option<IdempotencyKey> {
    IdempotencyKey::new(&Token::random().to_hex()).ok()
}

fn header_deadline(
    parts: &http::request::Parts,
    facts: &RequestFacts,
    convention: &retrysafe_core::wire::Convention,
) -> Option<Deadline> {
    let timeout = if facts.grpc {
        parts
            .headers
            .get(convention.grpc_timeout())
            .and_then(|v| parse_grpc_timeout(v.as_bytes()).ok())
    } else {
        parts
            .headers
            .get(convention.request_timeout_ms())
            .and_then(|v| parse_request_timeout_ms(v.as_bytes()).ok())
    };
    timeout.map(Deadline::after)
}
