use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use retrysafe_core::idempotency::Scope;
use retrysafe_core::wire::IdempotencyKey;
use tokio::sync::OwnedSemaphorePermit;
use tower_service::Service;
use tracing::Instrument;

use super::blocks;
use super::body::{RequestBody, ResponseBody};
use super::exec::StoreBackend;
use super::future::ResponseFuture;
use super::guard::{Answer, Backend, Guard, GuardedRequest, Handler, Inner};
use super::layer::IdempotencyLayer;
use super::problem::{Problem, ProblemKind};

type Res<B> = Response<ResponseBody<B>>;

/// Middleware that makes non-idempotent requests safe to retry by `Idempotency-Key`.
/// Built by [`IdempotencyLayer`].
///
/// It decides in `call` which requests are guarded and answers the bad ones (key,
/// scope, body) itself; the others run in a spawned task through the layer's
/// [`Backend`] `X`.
pub struct Idempotency<S, X = StoreBackend> {
    inner: S,
    layer: IdempotencyLayer<X>,
}

impl<S: Clone, X> Clone for Idempotency<S, X> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S: fmt::Debug, X: fmt::Debug> fmt::Debug for Idempotency<S, X> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("layer", &self.layer)
            .finish()
    }
}

impl<S, X> Idempotency<S, X> {
    pub(crate) fn new(inner: S, layer: IdempotencyLayer<X>) -> Self {
        Idempotency { inner, layer }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, X, B, ResB> Service<Request<B>> for Idempotency<S, X>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    X: Backend,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResB: Body<Data = Bytes> + Send + 'static,
{
    type Response = Res<ResB>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let guard = &self.layer.guard;
        let (parts, body) = req.into_parts();

        if !guard.guards(&parts) {
            return passthrough(&mut inner, parts, body);
        }
        let key = match guard.key(&parts.headers) {
            Ok(Some(key)) => key,
            Ok(None) if X::GUARDS_UNKEYED => {
                let req = Request::from_parts(parts, RequestBody::stream(body));
                let handler = Inner::new(inner);
                return ResponseFuture::guarded(Box::pin(unkeyed(
                    self.layer.clone(),
                    handler,
                    req,
                )));
            }
            Ok(None) => return passthrough(&mut inner, parts, body),
            Err(problem) => return ResponseFuture::ready(guard.problem(problem)),
        };

        let Some(scope) = guard.scope(&parts) else {
            if !guard.shared.scope_warned.swap(true, Ordering::Relaxed) {
                tracing::error!(
                    target: "retrysafe::idempotency",
                    "no idempotency scope: insert a retrysafe Principal extension in an \
                     authentication layer outside the idempotency layer, or configure scope_by"
                );
            }
            return ResponseFuture::ready(guard.problem(Problem::new(
                ProblemKind::ScopeMissing,
                "the server could not determine whom this request belongs to",
            )));
        };

        let layer = self.layer.clone();
        let handler = Inner::new(inner);
        ResponseFuture::guarded(Box::pin(keyed(layer, handler, parts, body, key, scope)))
    }
}

/// A request the layer does not guard: the inner service's future, polled in place.
fn passthrough<S, B, ResB>(
    inner: &mut S,
    parts: Parts,
    body: B,
) -> ResponseFuture<S::Future, ResB, S::Error>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
{
    ResponseFuture::passthrough(inner.call(Request::from_parts(parts, RequestBody::stream(body))))
}

/// The bound of guarded requests in flight: a permit, or the 503 `overloaded` answer.
fn permit<B>(guard: &Guard) -> Result<OwnedSemaphorePermit, Box<Res<B>>> {
    Arc::clone(&guard.shared.permits)
        .try_acquire_owned()
        .map_err(|_| {
            Box::new(
                guard.problem(
                    Problem::new(
                        ProblemKind::Overloaded,
                        "too many requests with idempotency keys in progress",
                    )
                    .retry_after(guard.config.unavailable_retry_after),
                ),
            )
        })
}

/// A request with a key: buffer and fingerprint, then run it through the backend in
/// a task.
async fn keyed<H, X>(
    layer: IdempotencyLayer<X>,
    handler: H,
    parts: Parts,
    body: H::ReqBody,
    key: IdempotencyKey,
    scope: Scope,
) -> Answer<H>
where
    H: Handler,
    X: Backend,
    <H::ReqBody as Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let guard = &layer.guard;
    let config = &guard.config;
    let limit = config.max_request_body;
    let mut body = std::pin::pin!(body);
    if let Err(problem) = blocks::check_declared_length(&parts.headers, body.as_mut(), limit).await
    {
        return Ok(guard.problem(problem));
    }
    // The permit is taken before the body is buffered, so the bound also caps the
    // memory held by buffered request bodies.
    let permit = match permit(guard) {
        Ok(p) => p,
        Err(answer) => return Ok(*answer),
    };
    let body = match blocks::buffer_request_body(body.as_mut(), limit).await {
        Ok(b) => b,
        Err(problem) => return Ok(guard.problem(problem)),
    };
    let fingerprint =
        config
            .fingerprinter
            .fingerprint(&parts.method, &parts.uri, &parts.headers, &body);
    let request = GuardedRequest {
        parts,
        body,
        key,
        scope,
        fingerprint,
    };
    let task = {
        let layer = layer.clone();
        async move { layer.backend.run(&layer.guard, handler, request).await }
    };
    spawned(&layer.guard, permit, task).await
}

/// A request on a guarded method without a key, for a backend that
/// [guards those](Backend::GUARDS_UNKEYED): run it through the backend in a task.
async fn unkeyed<H: Handler, X: Backend>(
    layer: IdempotencyLayer<X>,
    handler: H,
    req: Request<RequestBody<H::ReqBody>>,
) -> Answer<H> {
    let permit = match permit(&layer.guard) {
        Ok(p) => p,
        Err(answer) => return Ok(*answer),
    };
    let task = {
        let layer = layer.clone();
        async move { layer.backend.run_unkeyed(&layer.guard, handler, req).await }
    };
    spawned(&layer.guard, permit, task).await
}

/// Runs `task` in the layer's tracked tasks, holding `permit` until it is done, and
/// awaits it: dropping the caller's future (the client went away, an outer timeout
/// fired) cancels nothing.
async fn spawned<B, E>(
    guard: &Guard,
    permit: OwnedSemaphorePermit,
    task: impl Future<Output = Result<Res<B>, E>> + Send + 'static,
) -> Result<Res<B>, E>
where
    B: Send + 'static,
    E: Send + 'static,
{
    let task = async move {
        let res = task.await;
        drop(permit);
        res
    };
    match guard
        .shared
        .tracker
        .spawn(task.instrument(tracing::Span::current()))
        .await
    {
        Ok(res) => res,
        Err(e) => {
            // The backends catch handler panics; this is a panic of our own or a
            // runtime shutting down.
            tracing::error!(target: "retrysafe::idempotency", error = %e, "guarded task failed");
            Ok(guard.problem(Problem::new(
                ProblemKind::HandlerPanicked,
                "the request could not be completed",
            )))
        }
    }
}
