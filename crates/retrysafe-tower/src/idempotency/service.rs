//! The layer's service: decides in `call` which requests are guarded, answers the bad
//! ones itself, reads and fingerprints the body of the others, and hands them to the
//! layer's backend in a detachable task.

use std::fmt;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use retrysafe_core::Deadline;
use retrysafe_core::idempotency::Decision;
use retrysafe_core::idempotency::Scope;
use retrysafe_core::wire::IdempotencyKey;
use tower_service::Service;
use tracing::Span;

use super::backend::{Backend, Handler, Inner, Served, StoreBackend};
use super::body::{RequestBody, ResponseBody};
use super::future::ResponseFuture;
use super::layer::IdempotencyLayer;
use super::problem::ProblemKind;
use super::request::{self, Admitted, KeyedRequest};
use super::shared::Shared;
use super::slots::Slot;
use super::task::spawned;
use super::timer;

type Res<B> = Response<ResponseBody<B>>;

/// Middleware that makes non-idempotent requests safe to retry by `Idempotency-Key`.
/// Built by [`IdempotencyLayer`].
///
/// It decides in `call` which requests are guarded and answers the bad ones (key,
/// scope, body) itself; the others run in a detachable task through the layer's
/// [`Backend`](super::backend::Backend) `X`.
pub struct IdempotencyService<S, X = StoreBackend> {
    inner: S,
    layer: IdempotencyLayer<X>,
}

impl<S: Clone, X> Clone for IdempotencyService<S, X> {
    fn clone(&self) -> Self {
        IdempotencyService {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S: fmt::Debug, X: fmt::Debug> fmt::Debug for IdempotencyService<S, X> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("layer", &self.layer)
            .finish()
    }
}

impl<S, X> IdempotencyService<S, X> {
    pub(crate) fn new(inner: S, layer: IdempotencyLayer<X>) -> Self {
        IdempotencyService { inner, layer }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, X, B, ResB> Service<Request<B>> for IdempotencyService<S, X>
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
        let shared = &self.layer.shared;
        let rules = shared.rules();
        let (parts, body) = req.into_parts();

        if !rules.guards(&parts) {
            return passthrough(&mut inner, parts, body);
        }
        let key = match rules.key(&parts.headers) {
            Ok(Some(key)) => key,
            Ok(None) if X::GUARDS_UNKEYED => {
                let handler = Inner::new(inner);
                return ResponseFuture::guarded(Box::pin(unkeyed(
                    self.layer.clone(),
                    handler,
                    parts,
                    body,
                )));
            }
            Ok(None) => return passthrough(&mut inner, parts, body),
            Err(problem) => {
                shared
                    .telemetry()
                    .refused(Decision::Invalid, None, &Span::none());
                return ResponseFuture::ready(shared.answers().problem(problem));
            }
        };

        let Some(scope) = rules.scope(&parts) else {
            if !shared.in_flight.scope_warned.swap(true, Ordering::Relaxed) {
                tracing::error!(
                    target: "retrysafe::idempotency",
                    "no idempotency scope: insert a retrysafe Principal extension in an \
                     authentication layer outside the idempotency layer, or configure scope_by"
                );
            }
            shared
                .telemetry()
                .refused(Decision::Invalid, None, &Span::none());
            return ResponseFuture::ready(shared.problem_of(
                ProblemKind::ScopeMissing,
                "the server could not determine whom this request belongs to",
            ));
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

/// A request refused before its claim: how it was decided, and its answer.
type Refused<B> = (Decision, Box<Res<B>>);

/// The bound of guarded requests in flight: a slot (within the fair share of `scope`),
/// or the 503 `overloaded` answer.
fn slot<B>(shared: &Shared, scope: Option<&Scope>) -> Result<Slot, Refused<B>> {
    shared.slot(scope).ok_or_else(|| {
        let answer = shared.problem_of(
            ProblemKind::Overloaded,
            "too many requests with idempotency keys in progress",
        );
        (Decision::Unavailable, Box::new(answer))
    })
}

/// A request with a key: buffer and fingerprint, then run it through the backend in
/// a task.
///
/// (A function returning an `async` block, not an `async fn`: an `async fn` keeps a
/// second copy of its arguments in its future, which is boxed, so every byte counts.)
#[allow(
    clippy::manual_async_fn,
    reason = "an `async fn` keeps its arguments twice in its (boxed) future"
)]
fn keyed<H, X>(
    layer: IdempotencyLayer<X>,
    handler: H,
    parts: Parts,
    body: H::ReqBody,
    key: IdempotencyKey,
    scope: Scope,
) -> impl Future<Output = Served<H>>
where
    H: Handler,
    X: Backend,
    <H::ReqBody as Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    async move {
        let shared = &layer.shared;
        let telemetry = shared.telemetry();
        let span = telemetry.span(&scope, &key);
        let (permit, body) = match read_body(shared, &parts, body, Some(&scope)).await {
            Ok(read) => read,
            Err((decision, answer)) => {
                telemetry.refused(decision, Some((&scope, &key)), &span);
                return Ok(*answer);
            }
        };
        let fingerprint = shared.rules().fingerprint(&parts, &body);
        let request = Box::new(KeyedRequest {
            parts,
            body,
            key,
            scope,
            fingerprint,
            span: span.clone(),
        });
        spawned(layer, handler, Admitted::Keyed(request), permit, span).await
    }
}

/// Takes a slot of the in-flight bound (within the fair share of `scope`), then buffers the body within the limit and
/// in time: the slot is taken first, so the bound also caps the memory held by
/// buffered bodies, and the body must arrive within `request_body_timeout` (or the
/// request's deadline), so a client that trickles its body cannot hold a slot for as
/// long as it likes, and a scope that trickles many cannot hold more than its share.
/// The answer when it cannot: 413, 408, 400 or 503 `overloaded`.
async fn read_body<B, R>(
    shared: &Shared,
    parts: &Parts,
    body: B,
    scope: Option<&Scope>,
) -> Result<(Slot, Bytes), Refused<R>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let rules = shared.rules();
    let limit = rules.max_request_body;
    let mut body = std::pin::pin!(body);
    if let Err(problem) = request::check_declared_length(&parts.headers, body.as_mut(), limit).await
    {
        return Err((
            Decision::Invalid,
            Box::new(shared.answers().problem(problem)),
        ));
    }
    let permit = slot(shared, scope)?;
    let deadline = parts.extensions.get::<Deadline>().copied();
    let patience = Deadline::bound(deadline, rules.request_body_timeout);
    let buffered =
        timer::within(patience, request::buffer_request_body(body.as_mut(), limit)).await;
    match buffered {
        Some(Ok(b)) => Ok((permit, b)),
        Some(Err(problem)) => Err((
            Decision::Invalid,
            Box::new(shared.answers().problem(problem)),
        )),
        None => Err((
            Decision::Invalid,
            Box::new(shared.problem_of(
                ProblemKind::BodyTimeout,
                "the request body did not arrive in time",
            )),
        )),
    }
}

/// A request on a guarded method without a key, for a backend that guards those (the
/// transactional layer): its body is read first, like a keyed one's
/// (so a client that trickles it holds neither a slot past `request_body_timeout` nor
/// anything of the backend, such as a transaction), then it runs through the backend in
/// a task.
async fn unkeyed<H: Handler, X: Backend>(
    layer: IdempotencyLayer<X>,
    handler: H,
    parts: Parts,
    body: H::ReqBody,
) -> Served<H>
where
    <H::ReqBody as Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (permit, body) = match read_body(&layer.shared, &parts, body, None).await {
        Ok(read) => read,
        Err((_, answer)) => return Ok(*answer),
    };
    let req = Request::from_parts(parts, RequestBody::buffered(body));
    spawned(
        layer,
        handler,
        Admitted::Unkeyed(Box::new(req)),
        permit,
        Span::current(),
    )
    .await
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use std::convert::Infallible;
    use std::sync::{Arc, Mutex};

    use http::StatusCode;
    use http_body_util::{BodyExt, Full};
    use retrysafe_core::idempotency::Principal;
    use tokio::task::Id;
    use tower::ServiceExt;

    use super::*;
    use crate::idempotency::Problem;

    fn post(key: &str) -> Request<Full<Bytes>> {
        let mut req = Request::post("/pay")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from_static(b"a")))
            .unwrap();
        req.extensions_mut().insert(Principal::new("tenant"));
        req
    }

    /// The task the handler ran on, with the layer over a [`MemoryStore`](super::super::MemoryStore).
    async fn handler_task(key: &str) -> (StatusCode, Option<Id>) {
        let seen = Arc::new(Mutex::new(None));
        let svc = {
            let seen = Arc::clone(&seen);
            tower::service_fn(move |_req: Request<RequestBody<Full<Bytes>>>| {
                let seen = Arc::clone(&seen);
                async move {
                    *seen.lock().unwrap() = tokio::task::try_id();
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
                }
            })
        };
        let svc = tower_layer::Layer::layer(&IdempotencyLayer::in_memory(), svc);
        let res = svc.oneshot(post(key)).await.unwrap();
        let status = res.status();
        assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "done");
        let id = *seen.lock().unwrap();
        (status, id)
    }

    // The guarded handler runs on the caller's task: no spawn per request while the
    // response future is polled to the end.
    #[tokio::test]
    async fn a_guarded_request_runs_on_the_callers_task() {
        let caller = tokio::spawn(async { (tokio::task::id(), handler_task("k").await) });
        let (caller, (status, handler)) = caller.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(handler, Some(caller));
    }

    /// A backend that panics in its own code (not in the handler).
    #[derive(Debug)]
    struct Panicking;

    impl Backend for Panicking {
        async fn run<H: Handler>(
            &self,
            _shared: &Shared,
            _handler: H,
            _request: Admitted<H::ReqBody>,
        ) -> Served<H> {
            panic!("backend bug")
        }
    }

    // A panic of the task itself (a bug of the layer or a backend) answers 500
    // `handler-panicked` and frees its permit and tracker slot; the service keeps working.
    #[tokio::test]
    async fn a_panic_of_the_task_answers_500_and_frees_its_slot() {
        let layer = IdempotencyLayer::with_backend(Panicking)
            .max_in_flight(1)
            .build()
            .unwrap();
        let shutdown = layer.shutdown_handle();
        let svc = tower::service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
        });
        let svc = tower_layer::Layer::layer(&layer, svc);
        for key in ["a", "b"] {
            let res = svc.clone().oneshot(post(key)).await.unwrap();
            assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
            assert_eq!(
                res.extensions().get::<Problem>().map(Problem::kind),
                Some(ProblemKind::HandlerPanicked)
            );
            assert_eq!(shutdown.in_flight(), 0);
        }
    }
}
