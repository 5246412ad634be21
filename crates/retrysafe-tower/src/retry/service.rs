use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body::Body;
use retrysafe_core::retry::RetryPolicy;
use tower_service::Service;

use super::body::ReplayBody;
use super::future::ResponseFuture;
use super::layer::Config;
use crate::local::{BoxError, LocalFailure};

/// The service of a [`RetryLayer`](super::RetryLayer).
pub struct RetryService<S, M> {
    inner: S,
    config: Arc<Config>,
    _local: PhantomData<fn() -> M>,
}

impl<S, M> RetryService<S, M> {
    pub(crate) fn from_config(inner: S, config: Arc<Config>) -> Self {
        RetryService {
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

impl<S: Clone, M> Clone for RetryService<S, M> {
    fn clone(&self) -> Self {
        RetryService {
            inner: self.inner.clone(),
            config: self.config.clone(),
            _local: PhantomData,
        }
    }
}

impl<S: fmt::Debug, M> fmt::Debug for RetryService<S, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryService")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
}

impl<S, M, ReqB, ResB> Service<Request<ReqB>> for RetryService<S, M>
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
        let (mut parts, body) = request.into_parts();
        let (call, token) = RetryPolicy::begin(&self.config.policy, &mut parts);
        let body = ReplayBody::new(body, self.config.replay_cap);
        ResponseFuture::start(service, parts, body, token, call)
    }
}
