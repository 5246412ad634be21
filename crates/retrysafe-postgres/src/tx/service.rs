use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::AUTHORIZATION;
use http::{Request, Response};
use http_body::Body;
use retrysafe_core::idempotency::{Principal, Scope};
use retrysafe_tower::idempotency::{Problem, ProblemKind, RequestBody, ResponseBody, blocks};
use tower_service::Service;

use super::exec;
use super::future::ResponseFuture;
use super::layer::{ScopeRule, TxIdempotencyLayer};

/// Middleware that runs each guarded request in one PostgreSQL transaction holding its
/// idempotency key. Built by [`TxIdempotencyLayer`].
#[derive(Clone, Debug)]
pub struct TxIdempotency<S> {
    inner: S,
    layer: TxIdempotencyLayer,
}

impl<S> TxIdempotency<S> {
    pub(crate) fn new(inner: S, layer: TxIdempotencyLayer) -> Self {
        TxIdempotency { inner, layer }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, B, ResB> Service<Request<B>> for TxIdempotency<S>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResB: Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let config = &self.layer.config;
        let (parts, body) = req.into_parts();

        let guarded = config.methods.contains(&parts.method)
            && (config.guard_grpc || !blocks::is_grpc(&parts.headers));
        if !guarded {
            return ResponseFuture::passthrough(
                inner.call(Request::from_parts(parts, RequestBody::stream(body))),
            );
        }

        let key =
            match blocks::idempotency_key(&parts.headers, &config.convention, config.require_key) {
                Ok(Some(key)) => key,
                Ok(None) => {
                    let layer = self.layer.clone();
                    return ResponseFuture::guarded(Box::pin(exec::unkeyed(
                        layer, inner, parts, body,
                    )));
                }
                Err(problem) => return self.problem(problem),
            };

        let scope = match &config.scope {
            ScopeRule::Principal => parts.extensions.get::<Principal>().map(Scope::from),
            ScopeRule::Global => Some(Scope::global()),
            ScopeRule::AuthorizationHash => parts
                .headers
                .get(AUTHORIZATION)
                .map(|v| Scope::from_authorization(v.as_bytes())),
            ScopeRule::Custom(f) => f(&parts),
        };
        let Some(scope) = scope else {
            if !self.layer.shared.scope_warned.swap(true, Ordering::Relaxed) {
                tracing::error!(
                    target: "retrysafe::idempotency",
                    "no idempotency scope: insert a retrysafe Principal extension in an \
                     authentication layer outside the TxIdempotencyLayer, or configure scope_by"
                );
            }
            return self.problem(Problem::new(
                ProblemKind::ScopeMissing,
                "the server could not determine whom this request belongs to",
            ));
        };

        let layer = self.layer.clone();
        ResponseFuture::guarded(Box::pin(exec::keyed(layer, inner, parts, body, key, scope)))
    }
}

impl<S> TxIdempotency<S> {
    fn problem<F, ResB, E>(&self, problem: Problem) -> ResponseFuture<F, ResB, E> {
        ResponseFuture::ready(exec::problem_response(&self.layer.config, problem))
    }
}
