//! The client form: [`DeadlineLayer`], [`DeadlineService`] and its [`ResponseFuture`].

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use http::{Request, Response};
use pin_project_lite::pin_project;
use retrysafe_core::__private::{ExpiryObserver, Validate};
use retrysafe_core::DeadlineExpiry;
use retrysafe_core::error::DeadlineExceeded;
use retrysafe_core::observe::Name;
use retrysafe_core::{ConfigError, Deadline};
use tokio::time::{Instant, Sleep};
use tower_layer::Layer;
use tower_service::Service;

use super::body::{BoundBody, Unbounded, WrapBody};
use super::server::ServerDeadlineLayer;
use crate::BoxError;

/// Bounds a whole call by a deadline; see the [module docs](super).
///
/// The deadline running out is the error [`DeadlineExceeded`] (for gRPC, a
/// [`GrpcStatusLayer`](crate::answer::GrpcStatusLayer) above turns it into a synthesised
/// `DEADLINE_EXCEEDED`). `W` says whether the response body is bounded too
/// ([`Unbounded`], [`BoundBody`]).
#[must_use]
pub struct DeadlineLayer<W = Unbounded> {
    timeout: Duration,
    expiry: Arc<ExpiryObserver>,
    _marker: PhantomData<fn() -> W>,
}

impl DeadlineLayer {
    /// A client-side layer giving each call at most `timeout` (greater than zero, at most
    /// 30 days, checked by [`build`](Self::build); a longer one is used as 30 days), or
    /// less when the request or the inherited context has a sooner deadline.
    pub fn new(timeout: Duration) -> Self {
        DeadlineLayer {
            timeout,
            expiry: Arc::new(ExpiryObserver::new(Name::default())),
            _marker: PhantomData,
        }
    }

    /// The server form: enforces the inbound deadline and hands what is left of it to
    /// the handler's outbound calls; see [`ServerDeadlineLayer`].
    pub fn server() -> ServerDeadlineLayer {
        ServerDeadlineLayer::default()
    }
}

impl<W> DeadlineLayer<W> {
    /// The layer's name (default `default`): the `name` of its expiry events and of
    /// `retrysafe_deadline_exceeded_total`, whose handle is resolved when the layer makes
    /// its service.
    pub fn name(mut self, name: impl Into<Name>) -> Self {
        self.expiry = Arc::new(self.expiry.renamed(name.into()));
        self
    }

    /// Calls `f` on every call that ends with a [`DeadlineExceeded`] error (the
    /// deadline passed, here or in a layer below).
    pub fn on_expiry(mut self, f: impl Fn(&DeadlineExpiry) + Send + Sync + 'static) -> Self {
        self.expiry = Arc::new(ExpiryObserver::clone(&self.expiry).with_hook(f));
        self
    }

    /// Checks the settings: the error names every one out of range.
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        v.timeout(self.timeout, "timeout");
        v.finish(self)
    }

    /// The deadline also bounds the response body: a body still streaming at the
    /// deadline ends with a [`DeadlineExceeded`] error (see
    /// [`DeadlineBody`](super::DeadlineBody)).
    pub fn bound_body(self) -> DeadlineLayer<BoundBody> {
        DeadlineLayer {
            timeout: self.timeout,
            expiry: self.expiry,
            _marker: PhantomData,
        }
    }
}

impl<W> Clone for DeadlineLayer<W> {
    fn clone(&self) -> Self {
        DeadlineLayer {
            timeout: self.timeout,
            expiry: self.expiry.clone(),
            _marker: PhantomData,
        }
    }
}

impl<W> fmt::Debug for DeadlineLayer<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeadlineLayer")
            .field("name", self.expiry.name())
            .field("timeout", &self.timeout)
            .field("body", &std::any::type_name::<W>())
            .finish()
    }
}

impl<S, W> Layer<S> for DeadlineLayer<W> {
    type Service = DeadlineService<S, W>;

    fn layer(&self, inner: S) -> Self::Service {
        self.expiry.resolve_metrics();
        DeadlineService {
            inner,
            timeout: self.timeout,
            expiry: self.expiry.clone(),
            _marker: PhantomData,
        }
    }
}

/// The service of a [`DeadlineLayer`].
///
/// Its `poll_ready` is always ready: the inner service's readiness is awaited inside the
/// response future, so that time waiting for it counts against the deadline.
pub struct DeadlineService<S, W = Unbounded> {
    inner: S,
    timeout: Duration,
    expiry: Arc<ExpiryObserver>,
    _marker: PhantomData<fn() -> W>,
}

impl<S, W> DeadlineService<S, W> {
    define_inner_service_accessors!();
}

// By hand: derives would bound the marker `W` by `Clone` and `Debug` too, and show the
// expiry observer.
impl<S: Clone, W> Clone for DeadlineService<S, W> {
    fn clone(&self) -> Self {
        DeadlineService {
            inner: self.inner.clone(),
            timeout: self.timeout,
            expiry: self.expiry.clone(),
            _marker: PhantomData,
        }
    }
}

impl<S: fmt::Debug, W> fmt::Debug for DeadlineService<S, W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeadlineService")
            .field("inner", &self.inner)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl<S, W, ReqB, ResB> Service<Request<ReqB>> for DeadlineService<S, W>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
    W: WrapBody<ResB>,
{
    type Response = Response<W::Body>;
    type Error = BoxError;
    type Future = ResponseFuture<S, ReqB, W>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is awaited in the future, against the deadline.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: Request<ReqB>) -> Self::Future {
        // The inner service, ready or not; a clone stays for the next call.
        let clone = self.inner.clone();
        let service = std::mem::replace(&mut self.inner, clone);

        let (deadline, now) = settle(self.timeout, request.extensions_mut());
        let state = if deadline.instant() <= now {
            // No attempt starts that cannot finish in time.
            State::Expired
        } else {
            // Called at once when the inner service is ready already (polled with a
            // no-op waker: the future polls it again with the caller's waker when not).
            let mut service = service;
            match service.poll_ready(&mut Context::from_waker(Waker::noop())) {
                Poll::Ready(Ok(())) => State::Calling {
                    future: service.call(request),
                },
                Poll::Ready(Err(e)) => State::Failed {
                    error: Some(e.into()),
                },
                Poll::Pending => State::Readying {
                    service,
                    request: Some(request),
                },
            }
        };
        ResponseFuture {
            state,
            sleep: None,
            deadline,
            expiry: self.expiry.clone(),
            _marker: PhantomData,
        }
    }
}

/// The deadline `timeout` after `now` ([`Deadline::after_from`]), with the time from
/// `now` to it, known without a subtraction (none left when the sum saturated, which
/// 30 days never makes it do).
#[cfg(feature = "client")]
pub(crate) fn deadline_and_left(timeout: Duration, now: Instant) -> (Deadline, Duration) {
    let deadline = Deadline::after_from(timeout, now);
    let left = if deadline.instant() == now {
        Duration::ZERO
    } else {
        timeout.min(retrysafe_core::wire::MAX_TIMEOUT)
    };
    (deadline, left)
}

/// Sets the call's [`Deadline`] extension to the soonest of: now plus `timeout`, the
/// request's own, the inherited one; returns it with the one clock read it took.
fn settle(timeout: Duration, extensions: &mut http::Extensions) -> (Deadline, Instant) {
    let now = Instant::now();
    let deadline = Deadline::after_from(timeout, now).tightened_by(extensions);
    extensions.insert(deadline);
    (deadline, now)
}

pin_project! {
    /// The response future of [`DeadlineService`]: awaits the inner service's readiness,
    /// then its response head, both bounded by the deadline.
    pub struct ResponseFuture<S, ReqB, W>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, Request<ReqB>, S::Future>,
        // Made when the call first waits: a call answered at once never touches the
        // timer wheel (nor needs a runtime).
        #[pin]
        sleep: Option<Sleep>,
        deadline: Deadline,
        expiry: Arc<ExpiryObserver>,
        _marker: PhantomData<fn() -> W>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, R, F> {
        Readying { service: S, request: Option<R> },
        Calling { #[pin] future: F },
        // The inner service failed to become ready.
        Failed { error: Option<BoxError> },
        Expired,
        Done,
    }
}

impl<S, W, ReqB, ResB> Future for ResponseFuture<S, ReqB, W>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
    W: WrapBody<ResB>,
{
    type Output = Result<Response<W::Body>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let deadline = *this.deadline;
            // `None`: the deadline passed first.
            let answer = match this.state.as_mut().project() {
                StateProj::Readying { service, request } => match service.poll_ready(cx) {
                    Poll::Ready(Ok(())) => match request.take() {
                        Some(request) => {
                            let future = service.call(request);
                            this.state.set(State::Calling { future });
                            continue;
                        }
                        None => Some(Err(polled_after_completion())),
                    },
                    Poll::Ready(Err(e)) => Some(Err(e.into())),
                    Poll::Pending => {
                        ready!(poll_expiry(this.sleep.as_mut(), deadline, cx));
                        None
                    }
                },
                // The inner future before the timer: a response that is ready is never
                // dropped.
                StateProj::Calling { future } => match future.poll(cx) {
                    Poll::Ready(Ok(r)) => Some(Ok(r.map(|b| W::wrap(b, deadline)))),
                    // An error once the deadline has passed is the deadline's (a
                    // transport timing the call from the timeout header, such as a
                    // tonic `Channel`, may fire at the same instant).
                    Poll::Ready(Err(_)) if deadline.is_expired() => None,
                    Poll::Ready(Err(e)) => Some(Err(e.into())),
                    Poll::Pending => {
                        ready!(poll_expiry(this.sleep.as_mut(), deadline, cx));
                        None
                    }
                },
                StateProj::Failed { error } => {
                    Some(Err(error.take().unwrap_or_else(polled_after_completion)))
                }
                StateProj::Expired => None,
                StateProj::Done => return Poll::Ready(Err(polled_after_completion())),
            };
            // Drops the inner future (or the unready service) at once.
            this.state.set(State::Done);
            let answer = answer.unwrap_or_else(|| Err(Box::new(DeadlineExceeded::new())));
            if let Err(error) = &answer
                && error.is::<DeadlineExceeded>()
            {
                this.expiry.expired();
            }
            return Poll::Ready(answer);
        }
    }
}

/// Waits for the deadline, the timer made on first need.
fn poll_expiry(
    mut sleep: Pin<&mut Option<Sleep>>,
    deadline: Deadline,
    cx: &mut Context<'_>,
) -> Poll<()> {
    if sleep.is_none() {
        sleep.set(Some(tokio::time::sleep_until(deadline.instant())));
    }
    if let Some(sleep) = sleep.as_pin_mut() {
        ready!(sleep.poll(cx));
    }
    tracing::debug!("deadline exceeded before the response head");
    Poll::Ready(())
}

fn polled_after_completion() -> BoxError {
    "deadline ResponseFuture polled after completion".into()
}

impl<S, ReqB, W> fmt::Debug for ResponseFuture<S, ReqB, W>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("deadline", &self.deadline.remaining())
            .finish_non_exhaustive()
    }
}
