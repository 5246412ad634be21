use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::future::ResponseFuture;
use super::layer::Config;
use crate::BoxError;
use crate::answer::LocalBody;

/// The service of a [`FaultLayer`](super::FaultLayer).
pub struct FaultService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> FaultService<S> {
    pub(super) fn new(inner: S, config: Arc<Config>) -> Self {
        FaultService { inner, config }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, consuming this one.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone> Clone for FaultService<S> {
    fn clone(&self) -> Self {
        FaultService {
            inner: self.inner.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for FaultService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultService")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for FaultService<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
{
    type Response = Response<LocalBody<ResB>>;
    type Error = BoxError;
    type Future = ResponseFuture<S, ReqB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        let plan = self.config.plan();
        if plan.delay.is_some() {
            // The request reaches the inner service only after the delay: take the
            // service that was made ready, and leave a clone for the next call.
            let clone = self.inner.clone();
            let service = std::mem::replace(&mut self.inner, clone);
            return ResponseFuture::delayed(plan, service, request, Arc::clone(&self.config));
        }
        ResponseFuture::now(
            plan.fault,
            &mut self.inner,
            request,
            Arc::clone(&self.config),
        )
    }
}
