//! The fused service: [`ClientService`] and its [`ResponseFuture`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower_service::Service;

use retrysafe_core::__private::Striped;
use retrysafe_core::error::Throttled;

use crate::BoxError;
use crate::breaker::{self, Guarded, ResponseBody, StackBudget, Transport};
use crate::retry::{self, Attempts, ReplayBody, Within};
use crate::{hedge, throttle};

/// The service of [`ClientLayers`](super::ClientLayers): deadline, retry, budget and
/// breaker in one, behind the stack's throttle and hedge when it has them.
///
/// Its `poll_ready` is always ready: the transport's readiness is awaited inside the
/// response future, where it counts against the deadline (and, for the breaker, after
/// the permit is taken), as in the separate layers. Hence `S: Clone` (wrap a service
/// that is not in a `tower::buffer::Buffer`).
#[derive(Clone)]
pub struct ClientService<S> {
    /// The transport a call's first attempt is made on (in place, when it is ready).
    inner: S,
    /// The transport the calls' futures clone for their retries and hedges.
    transport: Transport<S>,
    /// `inner` was lent out mutably since `transport` was copied from it: the next call
    /// copies it again.
    stale: bool,
    retry: Arc<retry::Config>,
    breaker: Striped<breaker::Config>,
    /// The breaker takes the planner's word for the timeout headers it writes.
    same_names: bool,
    deadline: Option<Duration>,
    throttle: Option<Arc<throttle::Config>>,
    hedge: Option<Arc<hedge::Config>>,
}

/// What the stack puts in front of its fused part (both optional).
pub(crate) struct Front {
    pub(crate) throttle: Option<Arc<throttle::Config>>,
    pub(crate) hedge: Option<Arc<hedge::Config>>,
}

impl<S> ClientService<S> {
    pub(crate) fn new(
        inner: S,
        retry: Arc<retry::Config>,
        breaker: Striped<breaker::Config>,
        deadline: Option<Duration>,
        front: Front,
    ) -> Self
    where
        S: Clone,
    {
        ClientService {
            same_names: Guarded::<S>::same_names(&breaker, retry.policy.convention()),
            transport: Arc::new(Mutex::new(inner.clone())),
            stale: false,
            inner,
            retry,
            breaker,
            deadline,
            throttle: front.throttle,
            hedge: front.hedge,
        }
    }

    // Not `define_inner_service_accessors!`: the transport has a copy that the calls'
    // retries and hedges clone, which `get_mut` must bring up to date.

    /// The transport.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The transport, mutably. The calls made after a change make every attempt on the
    /// changed transport, retries and hedges included; calls under way keep the one
    /// they started with.
    pub fn get_mut(&mut self) -> &mut S {
        self.stale = true;
        &mut self.inner
    }

    /// The transport, `self` consumed.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// Copies the transport again for the calls' retries and hedges (after `get_mut`).
    #[cold]
    fn refresh_transport(&mut self)
    where
        S: Clone,
    {
        self.transport = Arc::new(Mutex::new(self.inner.clone()));
        self.stale = false;
    }
}

// By hand: a derive would show the transport twice and the cached `same_names`.
impl<S: fmt::Debug> fmt::Debug for ClientService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientService")
            .field("inner", &self.inner)
            .field("retry", &self.retry)
            .field("breaker", &self.breaker)
            .field("deadline", &self.deadline)
            .field("throttle", &self.throttle)
            .field("hedge", &self.hedge)
            .finish()
    }
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for ClientService<S>
where
    S: Service<Request<ReplayBody<ReqB>>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
    ReqB: Body,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = BoxError;
    type Future = ResponseFuture<S, ReqB>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The breaker decides in `call`, and readiness is awaited in the future.
        Poll::Ready(Ok(()))
    }

    #[inline]
    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        if self.stale {
            self.refresh_transport();
        }
        if self.throttle.is_some() || self.hedge.is_some() {
            return self.call_in_front(request);
        }
        let (parts, body) = request.into_parts();
        let within = self.within();
        // Built where it is returned: the future is large, and every move is a copy.
        ResponseFuture {
            kind: Kind::Fused {
                inner: self.fused(parts, body, within),
            },
            admitted: None,
        }
    }
}

impl<S> ClientService<S> {
    /// One clock read for the deadline and the first attempt's timeout header. The
    /// deadline goes to the retry planner directly, not through the request's
    /// extensions: nothing between needs it there (but a hedge: see `hedged`).
    #[inline]
    fn within(&self) -> Option<Within> {
        self.deadline.map(|timeout| {
            let now = Instant::now();
            let (deadline, left) = crate::deadline::deadline_and_left(timeout, now);
            Within {
                deadline,
                now,
                left,
            }
        })
    }

    /// A call through the throttle or the hedge in front of the fused part.
    #[inline]
    fn call_in_front<ReqB, ResB>(&mut self, request: Request<ReqB>) -> ResponseFuture<S, ReqB>
    where
        S: Service<Request<ReplayBody<ReqB>>, Response = Response<ResB>> + Clone,
        S::Error: Into<BoxError>,
        ReqB: Body,
    {
        // The throttle sees one call per logical request, before any copy or attempt.
        let admitted = match &self.throttle {
            Some(config) => match throttle::admit(config, request.headers()) {
                Some(admitted) => Some(admitted),
                None => {
                    return ResponseFuture {
                        kind: Kind::Throttled,
                        admitted: None,
                    };
                }
            },
            None => None,
        };
        let (parts, body) = request.into_parts();
        let within = self.within();
        let kind = match &self.hedge {
            Some(config) => self.hedged(&Arc::clone(config), parts, body, within),
            None => Kind::Fused {
                inner: self.fused(parts, body, within),
            },
        };
        ResponseFuture { kind, admitted }
    }
}

impl<S> ClientService<S> {
    /// The fused part's call: the retry loop, each attempt through the breaker; the
    /// first attempt on this service's own transport, the others on clones of it.
    #[inline]
    fn fused<B, ResB>(
        &mut self,
        parts: http::request::Parts,
        body: B,
        within: Option<Within>,
    ) -> retry::Driver<Guarded<S>, B>
    where
        S: Service<Request<ReplayBody<B>>, Response = Response<ResB>> + Clone,
        S::Error: Into<BoxError>,
        B: Body,
    {
        // One breaker lookup per call, on the head as the planner leaves it.
        let (breaker, same_names) = (&self.breaker, self.same_names);
        let policy = &self.retry.policy;
        let stack = policy.budget().map(|budget| StackBudget {
            budget,
            retry_attempt: policy.convention().retry_attempt(),
        });
        let (transport, inner) = (&self.transport, &mut self.inner);
        retry::begin(
            &self.retry,
            (parts, body),
            within,
            |parts| Guarded::new(transport, breaker, parts, same_names, stack),
            |guarded, request, sent| guarded.attempt_on(inner, request, sent),
        )
    }

    /// A call through the hedge: a request it may hedge races copies, each one a call
    /// of the fused part sharing one copy of the body; any other goes to the fused
    /// part as it is.
    fn hedged<B, ResB>(
        &mut self,
        config: &Arc<hedge::Config>,
        mut parts: http::request::Parts,
        body: B,
        within: Option<Within>,
    ) -> Kind<S, B>
    where
        S: Service<Request<ReplayBody<B>>, Response = Response<ResB>> + Clone,
        S::Error: Into<BoxError>,
        Fused<S>: Service<Request<ReplayBody<B>>>,
        B: Body,
    {
        // The deadline is outermost: the hedge and every copy see it.
        if let Some(Within { deadline, .. }) = within {
            let deadline = deadline.tightened_by(&parts.extensions);
            parts.extensions.insert(deadline);
        }
        let Some(hedgeable) = hedge::hedgeable(config, &parts) else {
            return Kind::Fused {
                inner: self.fused(parts, body, within),
            };
        };
        // One copy of the body serves the hedges and the first copy's retries.
        let cap = config.replay_cap.max(self.retry.replay_cap);
        let body = ReplayBody::new(body, cap.min(retry::MAX_REPLAY_CAP));
        let fused = || Fused {
            transport: Arc::clone(&self.transport),
            retry: Arc::clone(&self.retry),
            breaker: self.breaker.clone(),
            same_names: self.same_names,
        };
        // Boxed: the race is larger than the plain loop, and every call's future would
        // carry its size (a rare path, which allocates for its copies anyway).
        Kind::Hedged {
            inner: Box::pin(hedge::race(
                config,
                fused(),
                fused(),
                parts,
                body,
                hedgeable,
            )),
        }
    }
}

/// The fused part as a service of requests whose body is replayable already: what a
/// hedge's copies are sent to.
pub(crate) struct Fused<S> {
    transport: Transport<S>,
    retry: Arc<retry::Config>,
    breaker: Striped<breaker::Config>,
    same_names: bool,
}

impl<S, B, ResB> Service<Request<ReplayBody<B>>> for Fused<S>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
    B: Body,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = BoxError;
    type Future = retry::Driver<Guarded<S>, B>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<ReplayBody<B>>) -> Self::Future {
        let (breaker, same_names) = (&self.breaker, self.same_names);
        // A hedge's copies are accounted for by the hedge, in the stack's budget; each
        // attempt is made on a clone of the transport.
        retry::begin_replay(
            &self.retry,
            request.into_parts(),
            None,
            |parts| Guarded::new(&self.transport, breaker, parts, same_names, None),
            Attempts::attempt,
        )
    }
}

// By hand: a derive would bound `S` by `Clone`, which sharing the transport does not
// need.
impl<S> Clone for Fused<S> {
    fn clone(&self) -> Self {
        Fused {
            transport: Arc::clone(&self.transport),
            retry: Arc::clone(&self.retry),
            breaker: self.breaker.clone(),
            same_names: self.same_names,
        }
    }
}

// By hand: of a hedge's copy, only the transport is its own (a derive would show the
// stack's configurations too).
impl<S: fmt::Debug> fmt::Debug for Fused<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fused")
            .field("transport", &self.transport)
            .finish_non_exhaustive()
    }
}

pin_project! {
    /// The response future of [`ClientService`]: the retry loop, each attempt through
    /// the breaker, bounded by the deadline — or the race of a hedged request's copies,
    /// each such a loop — and the throttle's count of the answer. Polled again once it
    /// has answered, it answers an error.
    #[allow(private_bounds, reason = "the attempts' maker is an implementation detail")]
    pub struct ResponseFuture<S, B>
    where
        Guarded<S>: Attempts<B>,
        Fused<S>: Service<Request<ReplayBody<B>>>,
    {
        #[pin]
        kind: Kind<S, B>,
        admitted: Option<throttle::Admitted>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<S, B>
    where
        Guarded<S>: Attempts<B>,
        Fused<S>: Service<Request<ReplayBody<B>>>,
    {
        Fused {
            #[pin]
            inner: retry::Driver<Guarded<S>, B>,
        },
        Hedged {
            inner: Pin<Box<hedge::ResponseFuture<Fused<S>, B>>>,
        },
        // Refused by the throttle: answered at the first poll.
        Throttled,
        // Answered without a call (the loop and the race have done states of their own).
        Done,
    }
}

impl<S, B, R> Future for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>> + Clone,
    S::Error: Into<BoxError>,
    B: Body,
{
    type Output = Result<Response<ResponseBody<R>>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        // The answer goes out as it comes (no copy of it here), counted by the throttle
        // on the way when there is one.
        let polled = match this.kind.as_mut().project() {
            KindProj::Fused { inner } => inner.poll(cx),
            KindProj::Hedged { inner } => inner.as_mut().poll(cx),
            KindProj::Throttled => {
                this.kind.set(Kind::Done);
                return Poll::Ready(Err(Box::new(Throttled::new())));
            }
            KindProj::Done => {
                return Poll::Ready(Err("client future polled after completion".into()));
            }
        };
        if let (Some(admitted), Poll::Ready(Ok(response))) = (this.admitted.as_ref(), &polled) {
            admitted.answered(response);
        }
        polled
    }
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    Guarded<S>: Attempts<B>,
    Fused<S>: Service<Request<ReplayBody<B>>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Fused { .. } => "fused",
            Kind::Hedged { .. } => "hedged",
            Kind::Throttled => "throttled",
            Kind::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::panic, reason = "test code: panics are the assertions")]

    use std::convert::Infallible;
    use std::future::Future;
    use std::pin::pin;
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    use std::sync::{Arc, Mutex, PoisonError};
    use std::task::{Context, Poll, Waker};

    use http::{Request, Response, StatusCode};
    use retrysafe_core::error::Throttled;
    use retrysafe_core::strategy::StandardRetryStrategy;
    use retrysafe_core::throttle::{AdaptiveThrottle, ThrottleConfig};
    use tower::{Layer, Service, service_fn};

    use crate::client::ClientLayers;
    use crate::retry::{ReplayBody, RetryLayer};
    use crate::throttle::AdaptiveThrottleLayer;

    #[tokio::test(start_paused = true)]
    async fn a_throttled_call_polled_again_answers_an_error_and_calls_nothing() {
        // A callee that accepted none of 1000 calls: the next is refused but for a draw
        // above 1000 / 1001.
        let refusing = AdaptiveThrottle::new(ThrottleConfig::default());
        for _ in 0..1000 {
            assert!(refusing.admit(1.0));
        }
        let throttle = AdaptiveThrottleLayer::new().throttle_with(refusing).seed(7);
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&calls);
        let transport = service_fn(move |_: Request<ReplayBody<String>>| {
            counted.fetch_add(1, Relaxed);
            std::future::ready(Ok::<_, Infallible>(Response::new(String::new())))
        });
        let mut client = ClientLayers::new().throttle(throttle).layer(transport);
        let mut future = pin!(client.call(Request::new(String::new())));
        let mut cx = Context::from_waker(Waker::noop());
        match future.as_mut().poll(&mut cx) {
            Poll::Ready(Err(e)) => assert!(e.is::<Throttled>(), "{e}"),
            other => panic!("the first poll gave {other:?}"),
        }
        match future.as_mut().poll(&mut cx) {
            Poll::Ready(Err(e)) => {
                assert_eq!(e.to_string(), "client future polled after completion");
            }
            other => panic!("a second poll gave {other:?}"),
        }
        assert_eq!(calls.load(Relaxed), 0);
    }

    /// A transport that logs its number at every call and answers 503.
    #[derive(Clone)]
    struct Numbered {
        number: u32,
        log: Arc<Mutex<Vec<u32>>>,
    }

    impl Service<Request<ReplayBody<String>>> for Numbered {
        type Response = Response<String>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<Response<String>, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: Request<ReplayBody<String>>) -> Self::Future {
            self.log
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(self.number);
            let mut response = Response::new(String::new());
            *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            std::future::ready(Ok(response))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_transport_changed_through_get_mut_takes_every_later_attempt() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let transport = Numbered {
            number: 1,
            log: Arc::clone(&log),
        };
        let retry = RetryLayer::new().strategy(StandardRetryStrategy::new().seed(7));
        let mut client = ClientLayers::new().retry(retry).layer(transport);
        let logged = || std::mem::take(&mut *log.lock().unwrap_or_else(PoisonError::into_inner));
        let get = || Request::new(String::new());
        let answer = client.call(get()).await;
        assert!(answer.is_ok_and(|r| r.status() == StatusCode::SERVICE_UNAVAILABLE));
        assert_eq!(logged(), [1, 1, 1]);
        client.get_mut().number = 2;
        assert_eq!(client.get_ref().number, 2);
        let answer = client.call(get()).await;
        assert!(answer.is_ok_and(|r| r.status() == StatusCode::SERVICE_UNAVAILABLE));
        assert_eq!(logged(), [2, 2, 2], "the retries too");
        assert_eq!(client.into_inner().number, 2);
    }
}
