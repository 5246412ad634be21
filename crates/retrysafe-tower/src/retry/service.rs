use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body::Body;
use retrysafe_core::__private::RetryPolicy;
use tower_service::Service;

use super::body::ReplayBody;
use super::future::ResponseFuture;
use super::layer::{Config, MAX_REPLAY_CAP};
use crate::local::BoxError;

/// The service of a [`RetryLayer`](super::RetryLayer).
pub struct RetryService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> RetryService<S> {
    pub(crate) fn from_config(inner: S, config: Arc<Config>) -> Self {
        RetryService { inner, config }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone> Clone for RetryService<S> {
    fn clone(&self) -> Self {
        RetryService {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for RetryService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryService")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
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
        let (mut parts, body) = request.into_parts();
        let (call, token) = RetryPolicy::begin(&self.config.policy, &mut parts);
        let body = ReplayBody::new(body, self.config.replay_cap.min(MAX_REPLAY_CAP));
        ResponseFuture::start(service, parts, body, token, call)
    }
}
