//! A yardstick, not a product: the least per-call work required of the client
//! stack (deadline → retry → budget → breaker) on the success path, written as one
//! hand-made service with no layering, so that benches can show what any
//! implementation of the convention must add to a bare call.
//!
//! Per call ([`Floor::new`] with `all = true`): one clock read for the deadline, a copy
//! of the request head kept for a retry (method, URI and headers, as tower's retry
//! policy keeps), the `request-timeout-ms` header written, one deposit into a retrysafe
//! ratio budget, a breaker permit taken and its outcome recorded (from the status), and,
//! with [`Floor::with_timer`], the deadline enforced by a `tokio::time::Sleep` made when
//! the call first waits (as `DeadlineLayer` does). With `all = false` only the header is
//! written.
//!
//! [`floor_required`] adds to the floor the reads of the request that
//! DESIGN.md requires of every retrying call and that the floor leaves out: the
//! inherited call context (its deadline), the request's own `NoRetry`, `Idempotent`,
//! `RetryBudget`, `Deadline`, hedge-copy and attempt-number extensions, and its
//! `idempotency-key`, `content-type` (gRPC or not) and timeout headers.
//!
//! [`FloorFlat`] (`floor_flat`) does what the fused `ClientLayers` stack does on the success
//! path, by hand, in one future that nests nothing but the transport's. It uses
//! retrysafe's planner (`RetryPolicy::begin_within`, `prepare_attempt_with`, `decide`).
//! It takes the request's own breaker or the service's, and uses its permit, its
//! classification of the answer and its slow-call timing. It keeps a `ReplayBody` with
//! its copy, and the whole head. It enters the call's span, wraps the response body with
//! room for a gRPC answer's pending record, and makes a deadline timer when the call
//! first waits. It is not a product: it retries nothing. It prices a design whose first
//! attempt is not a future nested in the retry loop's.
//!
//! [`FloorFlatFeatures`] (`floor_flat_features`) is `floor_flat` with what the fused
//! stack carries per call besides that work, each piece by hand and still in one flat
//! future: the throttle and hedge it may have in front (a check, and a future that says
//! which answered), a handle on the transport for a retry's attempt, the breaker's
//! shared configuration held for the call, the checks of the request's own budget and
//! hedge race, the transport's readiness checked in place, and the retry loop's states
//! with what a pending retry keeps. It still retries nothing. It prices the flat design
//! of the product as it is, features and all.
//!
//! [`FloorSeparate`] (`floor_separate`) adds what four *separate* layers must hand each
//! other through the request, by their contracts, on top of the floor: the `Deadline`
//! extension the deadline layer inserts for the layers below it; the whole head (its
//! extensions too) kept by the retry layer for a retry; the extension by which the retry
//! layer tells a budget layer below that the attempt is counted; and the breaker's
//! reading of the attempt's timeout header (it is not told the time the retry layer
//! wrote there).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, LazyLock, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, Uri};
use http_body::Body;
use pin_project_lite::pin_project;
use retrysafe_core::__private::{
    Attempt, BreakerFacts, Local, RetryCall, RetryPolicy, Striped, Verdict,
};
use retrysafe_core::Deadline;
use retrysafe_core::breaker::{CircuitBreaker, Permit};
use retrysafe_core::budget::RetryBudget;
use retrysafe_core::classify::{BreakerOutcome, Classifier, DefaultClassifier};
use retrysafe_core::error::DeadlineExceeded;
use retrysafe_core::strategy::RetryToken;
use retrysafe_core::wire::Convention;
use retrysafe_tower::retry::ReplayBody;
use tokio::time::{Instant, Sleep};
use tower::Service;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const REQUEST_TIMEOUT_MS: HeaderName = HeaderName::from_static("request-timeout-ms");
const TIMEOUT: Duration = Duration::from_secs(10);
/// The header names the yardsticks read by (the default convention).
static CONVENTION: LazyLock<Convention> = LazyLock::new(Convention::default);

/// `floor` and `floor_header` (see the module docs).
#[derive(Clone, Debug)]
pub struct Floor<S> {
    inner: S,
    /// `false`: only the header (`floor_header`).
    all: bool,
    timer: bool,
    budget: RetryBudget,
    breaker: CircuitBreaker,
}

impl<S> Floor<S> {
    /// The floor over `inner`; `all = false` writes only the header (`floor_header`).
    pub fn new(inner: S, all: bool) -> Self {
        Floor {
            inner,
            all,
            timer: false,
            budget: RetryBudget::ratio(),
            breaker: CircuitBreaker::default(),
        }
    }

    /// Also enforce the deadline with a timer (needed once calls really wait).
    pub fn with_timer(mut self) -> Self {
        self.timer = true;
        self
    }
}

impl<S, B, R> Service<Request<B>> for Floor<S>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Error: Into<BoxError>,
{
    type Response = Response<R>;
    type Error = BoxError;
    type Future = FloorFuture<S::Future, (Method, Uri, HeaderMap)>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let mut kept = None;
        let mut permit = None;
        let mut deadline = None;
        if self.all {
            let now = Instant::now();
            let at = now + TIMEOUT;
            kept = Some((
                request.method().clone(),
                request.uri().clone(),
                request.headers().clone(),
            ));
            request
                .headers_mut()
                .insert(REQUEST_TIMEOUT_MS, time_left(at, now));
            self.budget.deposit();
            permit = self.breaker.try_acquire().ok();
            deadline = self.timer.then_some(at);
        } else {
            let ms = u64::try_from(TIMEOUT.as_millis()).unwrap_or(u64::MAX);
            request
                .headers_mut()
                .insert(REQUEST_TIMEOUT_MS, HeaderValue::from(ms));
        }
        FloorFuture {
            future: self.inner.call(request),
            sleep: None,
            deadline,
            kept,
            permit,
        }
    }
}

/// A call that waits: the deadline `at` enforced by the timer in `sleep`, made on the
/// first wait; the deadline's error once it passes.
#[inline]
fn expire(mut sleep: Pin<&mut Option<Sleep>>, at: Instant, cx: &mut Context<'_>) -> Poll<BoxError> {
    if sleep.is_none() {
        sleep.set(Some(tokio::time::sleep_until(at)));
    }
    if let Some(sleep) = sleep.as_pin_mut() {
        std::task::ready!(sleep.poll(cx));
    }
    Poll::Ready(DeadlineExceeded::new().into())
}

/// The `request-timeout-ms` value of a deadline `at`, read at `now`.
#[inline]
fn time_left(at: Instant, now: Instant) -> HeaderValue {
    HeaderValue::from(
        u64::try_from(at.saturating_duration_since(now).as_millis()).unwrap_or(u64::MAX),
    )
}

pin_project! {
    /// [`Floor`]'s future.
    #[derive(Debug)]
    pub struct FloorFuture<F, K> {
        #[pin]
        future: F,
        // Made when the call first waits.
        #[pin]
        sleep: Option<Sleep>,
        deadline: Option<Instant>,
        // The head a retry would resend.
        kept: Option<K>,
        permit: Option<Permit>,
    }
}

impl<F, K, R, E> Future for FloorFuture<F, K>
where
    F: Future<Output = Result<Response<R>, E>>,
    E: Into<BoxError>,
{
    type Output = Result<Response<R>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let result = match this.future.poll(cx) {
            Poll::Ready(result) => result.map_err(Into::into),
            Poll::Pending => {
                let Some(deadline) = *this.deadline else {
                    return Poll::Pending;
                };
                Err(std::task::ready!(expire(this.sleep, deadline, cx)))
            }
        };
        let outcome = match &result {
            Ok(r) if !r.status().is_server_error() => BreakerOutcome::Success,
            _ => BreakerOutcome::Failure,
        };
        if let Some(permit) = this.permit.take() {
            permit.record(outcome, Duration::ZERO);
        }
        *this.kept = None;
        Poll::Ready(result)
    }
}

/// `floor_separate`: the floor plus the hand-overs of separate layers (see the module
/// docs).
#[derive(Clone, Debug)]
pub struct FloorSeparate<S> {
    inner: S,
    budget: RetryBudget,
    breaker: CircuitBreaker,
}

impl<S> FloorSeparate<S> {
    /// The yardstick over `inner`.
    pub fn new(inner: S) -> Self {
        FloorSeparate {
            inner,
            budget: RetryBudget::ratio(),
            breaker: CircuitBreaker::default(),
        }
    }
}

/// The retry layer's mark for a budget layer below (as large as retrysafe's).
#[derive(Clone, Copy)]
struct Counted {
    #[allow(dead_code, reason = "carried, as the mark is")]
    attempt: u32,
    #[allow(dead_code, reason = "carried, as the mark is")]
    budget: u64,
}

impl<S, B, R> Service<Request<B>> for FloorSeparate<S>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Error: Into<BoxError>,
{
    type Response = Response<R>;
    type Error = BoxError;
    type Future = FloorFuture<S::Future, http::request::Parts>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let now = Instant::now();
        let at = now + TIMEOUT;
        // The deadline layer: the deadline, for the layers below.
        request.extensions_mut().insert(Deadline::at(at));
        // The retry layer: the whole head kept for a retry, the attempt's header, and
        // the "counted" mark for the budget layer below.
        let (parts, body) = request.into_parts();
        let kept = Some(parts.clone());
        let mut request = Request::from_parts(parts, body);
        request
            .headers_mut()
            .insert(REQUEST_TIMEOUT_MS, time_left(at, now));
        request.extensions_mut().insert(Counted {
            attempt: 1,
            budget: 1,
        });
        self.budget.deposit();
        // The breaker: the attempt's timeout, read back from its header.
        std::hint::black_box(BreakerFacts::of(request.headers(), &CONVENTION));
        let permit = self.breaker.try_acquire().ok();
        FloorFuture {
            future: self.inner.call(request),
            sleep: None,
            deadline: None,
            kept,
            permit,
        }
    }
}

/// `floor_required`: the floor plus the reads every retrying call must make (see the
/// module docs), hand-made: made before the floor's call, by a `MapRequest`.
pub fn floor_required<S, B>(inner: S) -> FloorRequired<S, B> {
    tower::util::MapRequest::new(Floor::new(inner, true), read_required::<B>)
}

/// The service of [`floor_required`].
pub type FloorRequired<S, B> = tower::util::MapRequest<Floor<S>, fn(Request<B>) -> Request<B>>;

/// The reads of [`floor_required`].
fn read_required<B>(request: Request<B>) -> Request<B> {
    use retrysafe_core::__private::HedgeCopy;
    use retrysafe_core::CallContext;
    use retrysafe_core::observe::AttemptNumber;
    use retrysafe_core::strategy::{Idempotent, NoRetry};
    let extensions = request.extensions();
    let headers = request.headers();
    let c = &*CONVENTION;
    std::hint::black_box((
        CallContext::inherited(extensions).and_then(|c| c.deadline()),
        extensions.get::<NoRetry>().is_some(),
        extensions.get::<Idempotent>().is_some(),
        extensions.get::<RetryBudget>().is_some(),
        extensions.get::<Deadline>().copied(),
        extensions.get::<HedgeCopy>().is_some(),
        extensions.get::<AttemptNumber>().is_some(),
        headers.contains_key(c.idempotency_key()),
        retrysafe_core::__private::is_grpc(headers),
        headers.get(c.request_timeout_ms()).is_some(),
    ));
    request
}

/// `floor_flat`: the fused stack's own per-call work in one hand-made service whose
/// future nests nothing but the transport's (see the module docs). It does what
/// `client_layers` does on the success path, with no layering and no nested state
/// machine: the yardstick of a flattened design.
#[derive(Clone, Debug)]
pub struct FloorFlat<S> {
    inner: S,
    policy: Striped<RetryPolicy>,
    breaker: CircuitBreaker,
    /// The breaker's classifier (the planner has its own).
    classifier: Arc<dyn Classifier>,
}

impl<S> FloorFlat<S> {
    /// Over `inner`, with the planner of `strategy` (which holds the stack's budget).
    pub fn new(inner: S, strategy: retrysafe_core::strategy::StandardRetryStrategy) -> Self {
        // No budget layer below: no "counted" mark on the attempt (as `ClientLayers`).
        let policy = RetryPolicy::new()
            .with_strategy(strategy)
            .without_charge_mark();
        FloorFlat {
            inner,
            policy: Striped::new(policy),
            breaker: CircuitBreaker::default(),
            classifier: Arc::new(DefaultClassifier::default()),
        }
    }
}

/// The call of both flat yardsticks, written out where it is used (a function here
/// made `floor_flat`'s future one copy dearer in the bench's harness, + 115 per call):
/// the transport's future of `$request`, as `$wrap` keeps it, beside what a retry needs
/// and `$extra`, as a [`FlatFuture`].
macro_rules! flat_call {
    ($this:expr, $request:expr, $wrap:expr, $extra:expr) => {{
        let now = Instant::now();
        let deadline = Deadline::after_from(TIMEOUT, now);
        let (mut template, body) = $request.into_parts();
        let body = ReplayBody::new(body, 64 * 1024);
        let (call, token) =
            RetryPolicy::begin_within(&$this.policy, &mut template, Some((deadline, now)));
        // The call's deadline is ours: the time left at `now` is the timeout.
        let left = Some(TIMEOUT);
        let mut parts = template.clone();
        let timeout =
            call.prepare_attempt_with(&mut parts.headers, &mut parts.extensions, &token, left);
        // The first attempt's check, as the stack makes it (never true here).
        std::hint::black_box(RetryCall::too_late_with(left));
        // The request's own breaker, or the service's: kept for the call's retries.
        let breaker = match template.extensions.get::<CircuitBreaker>() {
            Some(breaker) => breaker.clone(),
            None => $this.breaker.clone(),
        };
        let permit = breaker.try_acquire().ok();
        let facts = BreakerFacts::sent(call.is_grpc(), timeout);
        // Slow calls are timed (not by the default breaker).
        let started = breaker
            .config()
            .slow_call_duration()
            .is_some()
            .then_some(now);
        let backup = body.clone();
        // In the call's span (none when tracing is off).
        let entered = call.span().map(tracing::Span::enter);
        let future = $wrap($this.inner.call(Request::from_parts(parts, body)));
        drop(entered);
        FlatFuture {
            future,
            extra: $extra,
            breaker,
            started,
            sleep: None,
            deadline: deadline.instant(),
            template,
            body: backup,
            call,
            token: Some(token),
            permit,
            facts,
            classifier: $this.classifier.clone(),
        }
    }};
}

/// The transport of the flat yardsticks: a service of replayable requests.
pub trait Inner<B>: Service<Request<ReplayBody<B>>, Error: Into<BoxError>> {}

impl<S, B> Inner<B> for S
where
    S: Service<Request<ReplayBody<B>>>,
    S::Error: Into<BoxError>,
{
}

impl<S: Inner<B, Response = Response<R>>, B: Body, R> Service<Request<B>> for FloorFlat<S> {
    type Response = Response<Wrapped<R>>;
    type Error = BoxError;
    type Future = FlatFuture<S::Future, B, ()>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        flat_call!(self, request, |future| future, ())
    }
}

pin_project! {
    /// The future of both flat yardsticks ([`FloorFlat`], [`FloorFlatFeatures`]): the
    /// transport's future (in the retry loop's states, for the second) and what a retry
    /// needs, side by side.
    pub struct FlatFuture<F, B, X> {
        #[pin]
        future: F,
        // What `floor_flat_features` adds (nothing for `floor_flat`).
        extra: X,
        // The deadline, enforced by a timer made when the call first waits.
        #[pin]
        sleep: Option<Sleep>,
        deadline: Instant,
        // The head and the body a retry would resend.
        template: http::request::Parts,
        body: ReplayBody<B>,
        call: RetryCall,
        token: Option<RetryToken>,
        permit: Option<Permit>,
        breaker: CircuitBreaker,
        started: Option<Instant>,
        facts: BreakerFacts,
        classifier: Arc<dyn Classifier>,
    }
}

impl<F, B, R, E, X> Future for FlatFuture<F, B, X>
where
    F: Future<Output = Result<Response<R>, E>>,
    E: Into<BoxError>,
    X: Finish<F>,
{
    type Output = Result<Response<Wrapped<R>>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let _entered = this.call.span().map(|span| span.clone().entered());
        let polled = match this.future.as_mut().poll(cx) {
            Poll::Ready(polled) => polled.map_err(Into::into),
            Poll::Pending => Err(std::task::ready!(expire(
                this.sleep.as_mut(),
                *this.deadline,
                cx
            ))),
        };
        let response = match polled {
            Ok(response) => response,
            Err(error) => {
                if let Some(permit) = this.permit.take() {
                    permit.record(BreakerOutcome::Failure, Duration::ZERO);
                }
                return Poll::Ready(Err(error));
            }
        };
        // A gRPC answer whose status comes in the trailers is recorded at the end of
        // the body (never here: this yardstick's requests are not gRPC).
        let pending = this.facts.is_grpc()
            && response.status().is_success()
            && !response.headers().contains_key("grpc-status");
        let permit = this.permit.take();
        let pending = match permit {
            Some(permit) if pending => Some(Box::new(permit)),
            Some(permit) => {
                let elapsed = this.started.map(|s| s.elapsed());
                let c = this.classifier.classify_response(
                    response.status(),
                    response.headers(),
                    &this.facts.after(elapsed),
                );
                permit.record(c.breaker_outcome(), elapsed.unwrap_or_default());
                None
            }
            None => None,
        };
        let response = response.map(|inner| Wrapped { inner, pending });
        if let Some(token) = this.token.take() {
            let seen = Attempt::response(response.status(), response.headers());
            // A retry is not the yardstick's path: its answer goes out as it is.
            let decision = this
                .call
                .decide(seen, token, this.body.is_replayable(), None);
            std::hint::black_box(matches!(decision, Verdict::Success));
        }
        this.extra.finish(this.future);
        Poll::Ready(Ok(response))
    }
}

/// What a flat yardstick's future does with its own state once it has answered.
pub trait Finish<F> {
    /// Done with `future`, which has answered.
    fn finish(&mut self, future: Pin<&mut F>);
}

impl<F> Finish<F> for () {
    #[inline]
    fn finish(&mut self, _: Pin<&mut F>) {}
}

/// `floor_flat_features`: [`FloorFlat`] with what the fused stack carries per call
/// beyond the work every retrying, guarded call must do, each by hand, still in one flat
/// future: the optional throttle and hedge in front of it (a dispatch, and a future
/// that says which answered), a handle on the transport for a retry's attempt, a
/// handle on shared configuration held for the call (a stand-in for the breaker's: a
/// `Striped` value taken per call, as the stack takes it), the checks of the request's own
/// budget and hedge race, the transport's readiness checked in place, and the retry
/// loop's states (calling, backoff, readying, done) with what a pending retry keeps.
#[derive(Clone, Debug)]
pub struct FloorFlatFeatures<S> {
    flat: FloorFlat<S>,
    transport: Arc<Mutex<S>>,
    /// A stand-in for the breaker's shared configuration.
    config: Striped<()>,
    /// The throttle or the hedge in front (neither here).
    front: Option<Arc<()>>,
}

impl<S: Clone> FloorFlatFeatures<S> {
    /// As [`FloorFlat::new`].
    pub fn new(inner: S, strategy: retrysafe_core::strategy::StandardRetryStrategy) -> Self {
        FloorFlatFeatures {
            transport: Arc::new(Mutex::new(inner.clone())),
            flat: FloorFlat::new(inner, strategy),
            config: Striped::new(()),
            front: None,
        }
    }
}

impl<S: Inner<B, Response = Response<R>>, B: Body, R> Service<Request<B>> for FloorFlatFeatures<S> {
    type Response = Response<Wrapped<R>>;
    type Error = BoxError;
    type Future = Front<FlatFuture<Loop<S::Future>, B, Kept<S>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.flat.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        if self.front.is_some() {
            return Front::Refused;
        }
        let extensions = request.extensions();
        std::hint::black_box((
            extensions.get::<RetryBudget>().is_some(),
            extensions
                .get::<retrysafe_core::__private::HedgeRace>()
                .is_some(),
        ));
        let ready = self
            .flat
            .inner
            .poll_ready(&mut Context::from_waker(Waker::noop()));
        std::hint::black_box(matches!(ready, Poll::Ready(Ok(()))));
        let kept = Kept {
            transport: Arc::clone(&self.transport),
            config: self.config.local(),
            armed: false,
            last: None,
        };
        Front::Fused {
            future: flat_call!(self.flat, request, |future| Loop::Calling { future }, kept),
        }
    }
}

/// What [`FloorFlatFeatures`]'s future keeps besides [`FlatFuture`]'s.
#[allow(dead_code, reason = "carried, as the fused stack carries it")]
#[derive(Debug)]
pub struct Kept<S> {
    transport: Arc<Mutex<S>>,
    config: Local<()>,
    /// A timer is armed.
    armed: bool,
    /// The last real response while a retry is pending.
    last: Option<Box<Response<()>>>,
}

impl<F, S> Finish<Loop<F>> for Kept<S> {
    #[inline]
    fn finish(&mut self, mut future: Pin<&mut Loop<F>>) {
        future.set(Loop::Done);
        self.armed = false;
        std::hint::black_box(self.last.is_some());
    }
}

pin_project! {
    /// The retry loop's states, in [`FloorFlatFeatures`]'s future.
    #[project = LoopProj]
    #[derive(Debug)]
    #[allow(missing_docs, reason = "pin-project-lite takes no docs on a variant's fields")]
    pub enum Loop<F> {
        /// An attempt in flight.
        Calling { #[pin] future: F },
        /// Waiting out a backoff.
        Backoff,
        /// Waiting for the transport's readiness.
        Readying,
        /// Finished.
        Done,
    }
}

impl<F, T, E> Future for Loop<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            LoopProj::Calling { future } => future.poll(cx).map_err(Into::into),
            _ => Poll::Ready(Err("polled after completion".into())),
        }
    }
}

pin_project! {
    /// [`FloorFlatFeatures`]'s future: the call, or the throttle's refusal (the hedge's
    /// race is never made here).
    #[project = FrontProj]
    #[derive(Debug)]
    #[allow(missing_docs, reason = "pin-project-lite takes no docs on a variant's fields")]
    pub enum Front<F> {
        /// The call, in place.
        Fused { #[pin] future: F },
        /// The call, boxed as a hedge's race would hold it.
        Hedged { future: Pin<Box<F>> },
        /// The throttle's refusal.
        Refused,
    }
}

impl<F, T> Future for Front<F>
where
    F: Future<Output = Result<T, BoxError>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            FrontProj::Fused { future } => future.poll(cx),
            FrontProj::Hedged { future } => future.as_mut().poll(cx),
            FrontProj::Refused => Poll::Ready(Err("throttled".into())),
        }
    }
}

/// The response body of [`FloorFlat`]: the body, and room for the breaker's record of
/// a gRPC answer whose status comes in the trailers (as the breaker's `ResponseBody`).
#[allow(dead_code, reason = "carried, as the breaker's body carries it")]
#[derive(Debug)]
pub struct Wrapped<B> {
    inner: B,
    pending: Option<Box<Permit>>,
}
