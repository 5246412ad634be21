//! Middleware that retries failed requests that are safe to retry, within a budget and
//! a deadline: [`RetryMiddleware`], the reqwest-middleware twin of the tower
//! `RetryLayer`.
//!
//! Both drive the same planner, [`retrysafe_core::retry`], so they behave alike: the
//! same strategy (default [`StandardRetryStrategy`]: 3 attempts, full jitter, a ratio
//! budget, 10 s per attempt and 30 s overall without a deadline), classifier, budget,
//! safe-request rule and keys. The middleware
//!
//! - retries **safe requests only**: RFC 9110 idempotent methods, requests with an
//!   `Idempotency-Key`, and requests declared idempotent (the [`Idempotent`] extension or
//!   [`RetryMiddleware::idempotent_if`]); a POST without a key is sent once, unless
//!   nothing was sent (a failed connect).
//!   [`generate_idempotency_keys`](RetryMiddleware::generate_idempotency_keys) adds a key
//!   to POST and PATCH, the same on every attempt — the child key of the inbound record
//!   inside a handler guarded by an `IdempotencyLayer` (the inherited
//!   [`CallContext`](retrysafe_core::CallContext));
//! - sends a body that cannot be cloned (a stream: `Request::try_clone` gives `None`)
//!   once, and never fails because of it;
//! - honours `retry-after` as a minimum delay (a delay longer than the time left gives
//!   up at once);
//! - is **deadline-aware**: the deadline is the soonest of a [`Deadline`] in the
//!   reqwest-middleware `Extensions` (a `DeadlineMiddleware` above puts it there), the
//!   inherited context, and a `request-timeout-ms` header already on the request; every
//!   attempt is bounded by the time left (and by an explicitly set
//!   [`attempt_timeout`](retrysafe_core::strategy::StandardRetryStrategy::attempt_timeout)
//!   when the request may be retried) and carries that bound as `request-timeout-ms`; no
//!   attempt starts with less than `MIN_ATTEMPT_TIME` (1 ms)
//!   left; when it runs out, the error is [`DeadlineExceeded`];
//! - sends `retry-attempt: N` on attempts 2 and later;
//! - makes one attempt when the caller is the retry point (inherited `retry-point:
//!   caller`, passed on) or for a request carrying [`NoRetry`];
//! - when it **gives up on a retryable failure** (attempts exhausted, budget refused,
//!   not enough time), answers with the last real response marked `do-not-retry: 1` and
//!   records `downstream_gave_up` in the inherited context;
//! - takes per-request overrides from the reqwest-middleware `Extensions`
//!   (`RequestBuilder::with_extension`): [`NoRetry`], [`Idempotent`], [`Deadline`], a
//!   [`RetryBudget`];
//! - calls [`on_retry`](RetryMiddleware::on_retry) / [`on_give_up`](RetryMiddleware::on_give_up),
//!   emits `tracing` events, and runs each call in one `retrysafe.call` span (INFO:
//!   `name`, `attempts`, `give_up`, `budget`, `breaker`); every resent attempt carries its
//!   [`AttemptNumber`](retrysafe_core::observe::AttemptNumber) in the `Extensions`, for
//!   a reqwest-tracing span below to record `http.request.resend_count` (see
//!   [`observe::AttemptNumber`](retrysafe_core::observe::AttemptNumber)).
//!
//! Failures it generates itself are `reqwest_middleware::Error::Middleware` holding a
//! [`DeadlineExceeded`]; errors from below (reqwest's, or another middleware's) are
//! passed on as they are. reqwest's own transport retries happen below it and are not
//! counted by budgets.
//!
//! [`StandardRetryStrategy`]: retrysafe_core::strategy::StandardRetryStrategy
//! [`Idempotent`]: retrysafe_core::strategy::Idempotent
//! [`NoRetry`]: retrysafe_core::strategy::NoRetry
//! [`Deadline`]: retrysafe_core::Deadline
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use axum::http::StatusCode;
//! use retrysafe::reqwest::retry::RetryMiddleware;
//!
//! // A server that fails once with 503, then answers 200.
//! let hits = Arc::new(AtomicU32::new(0));
//! let seen = hits.clone();
//! let app = axum::Router::new().route(
//!     "/items",
//!     axum::routing::get(move || {
//!         let n = seen.fetch_add(1, Ordering::SeqCst);
//!         async move { if n == 0 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK } }
//!     }),
//! );
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
//! let addr = listener.local_addr().unwrap();
//! tokio::spawn(async move { axum::serve(listener, app).await });
//!
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(RetryMiddleware::new())
//!     .build();
//! let response = client.get(format!("http://{addr}/items")).send().await.unwrap();
//! assert_eq!(response.status(), 200);
//! assert_eq!(hits.load(Ordering::SeqCst), 2);
//! # }
//! ```
//!
//! # Tracing each attempt
//!
//! Every call runs in one `retrysafe.call` span (INFO; `name`, `attempts`, `give_up`,
//! `budget`, `breaker`). Every resent attempt carries its
//! [`AttemptNumber`](retrysafe_core::observe::AttemptNumber) in the middleware
//! `Extensions`, so a reqwest-tracing span backend placed **after** this middleware
//! records OpenTelemetry's `http.request.resend_count` on resent requests:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use axum::http::StatusCode;
//! use http::Extensions;
//! use reqwest_tracing::{ReqwestOtelSpanBackend, TracingMiddleware};
//! use retrysafe::observe::AttemptNumber;
//! use retrysafe::reqwest::retry::RetryMiddleware;
//! use tracing::Span;
//!
//! /// reqwest-tracing's span of one attempt, with the resend count of a retry.
//! struct AttemptSpans;
//!
//! impl ReqwestOtelSpanBackend for AttemptSpans {
//!     fn on_request_start(request: &reqwest::Request, extensions: &mut Extensions) -> Span {
//!         let span = tracing::info_span!(
//!             "HTTP",
//!             http.request.method = %request.method(),
//!             url.full = %request.url(),
//!             http.request.resend_count = tracing::field::Empty,
//!         );
//!         if let Some(attempt) = AttemptNumber::of(extensions).filter(|a| a.resend_count() > 0) {
//!             span.record("http.request.resend_count", attempt.resend_count());
//!         }
//!         span
//!     }
//!
//!     fn on_request_end(
//!         span: &Span,
//!         outcome: &reqwest_middleware::Result<reqwest::Response>,
//!         _: &mut Extensions,
//!     ) {
//!         reqwest_tracing::default_on_request_end(span, outcome);
//!     }
//! }
//!
//! // A server that fails once with 503, then answers 200.
//! let hits = Arc::new(AtomicU32::new(0));
//! let app = axum::Router::new().route(
//!     "/items",
//!     axum::routing::get(move || {
//!         let n = hits.fetch_add(1, Ordering::SeqCst);
//!         async move { if n == 0 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK } }
//!     }),
//! );
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
//! let addr = listener.local_addr().unwrap();
//! tokio::spawn(async move { axum::serve(listener, app).await });
//!
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(RetryMiddleware::new().name("inventory"))
//!     // After the retry middleware: one span per attempt.
//!     .with(TracingMiddleware::<AttemptSpans>::new())
//!     .build();
//! let response = client.get(format!("http://{addr}/items")).send().await.unwrap();
//! assert_eq!(response.status(), 200);
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::ops::ControlFlow;
use std::time::Duration;

use http::{Extensions, HeaderMap, Method};
use reqwest::{Request, Response};
use reqwest_middleware::{Error, Middleware, Next, Result};
use retrysafe_core::__private::{
    Attempt, IdempotentIf, RequestHead, RetryCall, RetryCharged, RetryPolicy, Striped, Verdict,
    child_key_label,
};
use retrysafe_core::Deadline;
use retrysafe_core::budget::RetryBudget;
use retrysafe_core::classify::{Classifier, Failure};
use retrysafe_core::error::DeadlineExceeded;
use retrysafe_core::retry::{GiveUpEvent, RetryEvent};
use retrysafe_core::strategy::{GiveUp, RetryStrategy, RetryToken};
use retrysafe_core::wire::Convention;
use tokio::time::Instant;
use tracing::Instrument;

use crate::BoxFuture;
use crate::DeadlineMiddleware;
use crate::breaker::{CircuitBreakerMiddleware, Sent};

/// Retries failed requests that are safe to retry; see the [module docs](self).
///
/// A cheap `Clone` (one `Arc`); the builder methods mirror the tower `RetryLayer`'s.
#[derive(Clone)]
#[must_use]
pub struct RetryMiddleware {
    // Striped: every call keeps a reference to the policy (see `Striped`).
    policy: Striped<RetryPolicy>,
}

impl RetryMiddleware {
    /// A middleware with the
    /// [`StandardRetryStrategy`](retrysafe_core::strategy::StandardRetryStrategy) (3 attempts, full jitter, a ratio
    /// budget of its own, 10 s per attempt and 30 s overall without a deadline), the
    /// default classifier and the default [`Convention`].
    pub fn new() -> Self {
        RetryMiddleware {
            policy: Striped::new(RetryPolicy::new()),
        }
    }

    fn map(mut self, f: impl FnOnce(RetryPolicy) -> RetryPolicy) -> Self {
        self.policy = Striped::new(f(RetryPolicy::clone(&self.policy)));
        self
    }

    /// The middleware's name (default `default`): the `name` of its `retrysafe.call`
    /// spans, its hook events and its metrics (`retrysafe_client_attempts_total`,
    /// `retrysafe_client_retries_total`), whose handles are resolved when a
    /// `ClientMiddlewares` stack is applied, or at the middleware's first call.
    pub fn name(self, name: impl Into<retrysafe_core::observe::Name>) -> Self {
        self.map(|p| p.with_name(name))
    }

    /// The retry strategy (attempts, backoff, budget, default timeouts).
    pub fn strategy(self, strategy: impl RetryStrategy) -> Self {
        self.map(|p| p.with_strategy(strategy))
    }

    /// The classifier (default: the default classifier over this middleware's
    /// convention).
    pub fn classifier(self, classifier: impl Classifier) -> Self {
        self.map(|p| p.with_classifier(classifier))
    }

    /// The header names (also used by the default classifier).
    pub fn convention(self, convention: Convention) -> Self {
        self.map(|p| p.with_convention(convention))
    }

    /// Adds an `Idempotency-Key` to POST and PATCH requests that have none, the same
    /// on every attempt, which makes them safe to retry. Declare it only for a
    /// downstream that honours keys (an `IdempotencyLayer`). The key is random (128
    /// bits), or — inside a handler guarded by an `IdempotencyLayer` — the
    /// deterministic child key of the inbound record, labelled by method, authority
    /// and path, so a re-run of the handler repeats the same keys.
    pub fn generate_idempotency_keys(self) -> Self {
        self.map(RetryPolicy::with_generated_keys)
    }

    /// Makes this middleware the one retry point of the call chain: every attempt
    /// carries `retry-point: caller`, so the callee does not retry its own outbound
    /// calls.
    pub fn retry_point(self) -> Self {
        self.map(RetryPolicy::with_retry_point)
    }

    /// Declares requests safe to repeat when `f` says so, whatever their method. `f`
    /// sees the request head as [`http::request::Parts`] (method, URI, version,
    /// headers, and the reqwest-middleware `Extensions`).
    pub fn idempotent_if(
        self,
        f: impl Fn(&http::request::Parts) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.map(|p| p.with_idempotent_if(f))
    }

    /// Called before each retry.
    pub fn on_retry(self, f: impl Fn(&RetryEvent) + Send + Sync + 'static) -> Self {
        self.map(|p| p.with_on_retry(f))
    }

    /// Called when the middleware gives up on a retryable failure.
    pub fn on_give_up(self, f: impl Fn(&GiveUpEvent) + Send + Sync + 'static) -> Self {
        self.map(|p| p.with_on_give_up(f))
    }
}

impl RetryMiddleware {
    /// The name given with [`name`](Self::name).
    pub(crate) fn name_of(&self) -> &retrysafe_core::observe::Name {
        self.policy.name()
    }

    /// The middleware with `budget` given to every call whose request carries none.
    pub(crate) fn with_budget(self, budget: RetryBudget) -> Self {
        self.map(|p| p.with_budget(budget).without_charge_mark())
    }

    /// Resolves the metric handles (else at the first call).
    pub(crate) fn resolve_metrics(&self) {
        self.policy.resolve_metrics();
    }

    /// The header names its calls write.
    pub(crate) fn names(&self) -> &Convention {
        self.policy.convention()
    }
}

impl Default for RetryMiddleware {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for RetryMiddleware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryMiddleware")
            .field("policy", &self.policy)
            .finish()
    }
}

impl Middleware for RetryMiddleware {
    // Written out as `async_trait` expands it: the call is begun here, and the boxed
    // future is the retry loop itself (see `RetryMiddleware::call`).
    fn handle<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        request: Request,
        extensions: &'life1 mut Extensions,
        next: Next<'life2>,
    ) -> BoxFuture<'async_trait, Result<Response>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        self.call(request, extensions, Below::Next(next), None, None)
    }
}

/// Where a retry sends each attempt: the next middleware, or — in the fused form of
/// [`ClientMiddlewares`](crate::ClientMiddlewares) — a breaker and then the next.
pub(crate) enum Below<'a> {
    /// The middleware below, as it is.
    Next(Next<'a>),
    /// Through the breaker, in the same hop; with `true` when the breaker reads timeout
    /// headers by the names the planner writes them with, so it takes the planner's word.
    Breaker(&'a CircuitBreakerMiddleware, Next<'a>, bool),
}

impl<'a> Below<'a> {
    /// The middleware below (after the breaker, if any).
    fn next(&self) -> Next<'a> {
        match self {
            Below::Next(next) | Below::Breaker(_, next, _) => next.clone(),
        }
    }
}

impl RetryMiddleware {
    /// One call, begun at once: its attempts go to `below`; `within` is a deadline of
    /// the caller's own (the fused form's) and the clock reading it was made from; the
    /// deadline is tightened by those in the extensions. `deadline`, the fused form's
    /// deadline middleware, is told when the call ends past its deadline.
    ///
    /// The future is the retry loop, boxed once, in the call's `retrysafe.call` span
    /// when that one is enabled: the planner's call, its token and the request (every
    /// attempt sends a copy of it) are made here, and the loop keeps across an attempt
    /// only the call under way (boxed by the middleware below) and what classifying it
    /// needs.
    pub(crate) fn call<'a>(
        &'a self,
        mut request: Request,
        extensions: &'a mut Extensions,
        below: Below<'a>,
        within: Option<(Deadline, Instant)>,
        deadline: Option<&'a DeadlineMiddleware>,
    ) -> BoxFuture<'a, Result<Response>> {
        let (call, token) = RetryPolicy::begin_within(
            &self.policy,
            &mut Head {
                request: &mut request,
                extensions: &mut *extensions,
            },
            within,
        );
        let now = within.map(|(_, now)| now);
        let span = call.span().cloned();
        let call = Call {
            call,
            below,
            extensions,
            deadline,
        };
        let attempts = run(call, token, Some(request), now);
        match span {
            Some(span) => Box::pin(attempts.instrument(span)),
            None => Box::pin(attempts),
        }
    }
}

/// What a call's retry loop works with besides its request and token.
struct Call<'a> {
    call: RetryCall,
    below: Below<'a>,
    extensions: &'a mut Extensions,
    deadline: Option<&'a DeadlineMiddleware>,
}

/// The retry loop of one call on `template` (`None` once a request whose body cannot be
/// copied was sent: a stream is sent once); `now` is the clock reading the caller made
/// its deadline from, if it made one (the first attempt's check and header need no
/// other).
///
/// (A function returning an `async` block, not an `async fn`: an `async fn` keeps a
/// second copy of its arguments in its future.)
#[allow(
    clippy::manual_async_fn,
    reason = "an `async fn` keeps its arguments twice in its (boxed) future"
)]
fn run(
    mut c: Call<'_>,
    mut token: RetryToken,
    mut template: Option<Request>,
    now: Option<Instant>,
) -> impl Future<Output = Result<Response>> + Send + '_ {
    async move {
        // One clock read for the check and the first attempt's timeout header and the
        // breaker's timing (none without a deadline).
        let mut left = c.call.read_time_left(now);
        if RetryCall::too_late_with(left.1) {
            return c.ended(Err(deadline_exceeded()));
        }
        // Every attempt starts from the caller's extensions as they were: what one
        // attempt's middleware add (and the retry mark) must not leak into the next, nor
        // into the caller's (they may be reused for another call).
        let base = c.extensions.clone();
        // The last real response while a retry is pending.
        let mut last: Option<Response> = None;
        loop {
            if token.attempt() >= 2 {
                c.extensions.clone_from(&base);
            }
            // (Made in a block of its own: the request sent is not kept across the wait.)
            let result = {
                // A copy of the request; the request itself when it cannot be copied
                // (then it is sent once).
                let attempt = match template.as_ref().and_then(Request::try_clone) {
                    Some(copy) => copy,
                    None => match template.take() {
                        Some(request) if token.attempt() == 1 => request,
                        // (Unreachable: a retry needs a request that can be copied.)
                        _ => return c.ended(Err(deadline_exceeded())),
                    },
                };
                c.attempt(attempt, &token, left)
            }
            .await;
            token = match c.decided(result, token, template.is_some(), &mut last) {
                ControlFlow::Break(answer) => return answer,
                ControlFlow::Continue(next) => next,
            };
            if !token.delay().is_zero() {
                tokio::time::sleep(token.delay()).await;
            }
            if c.call.too_late() {
                let answer = out_of_time(&c.call, &token, last);
                return c.ended(answer);
            }
            // One clock read for the timeout header and the breaker's timing.
            left = c.call.read_time_left(None);
        }
    }
}

impl Call<'_> {
    /// Makes the attempt of `token`, sent with the time `left` at a reading, bounded
    /// by the call: `None` when it timed out. The breaker's work and the call of the
    /// middleware below are done here, so the future holds the attempt under way and
    /// its permit, not the request.
    fn attempt(
        &mut self,
        mut attempt: Request,
        token: &RetryToken,
        (at, left): (Option<Instant>, Option<Duration>),
    ) -> impl Future<Output = Option<Result<Response>>> + Send + '_ {
        // Also puts the attempt's `AttemptNumber` in the extensions.
        let timeout =
            self.call
                .prepare_attempt_with(attempt.headers_mut(), self.extensions, token, left);
        let admitted = match &self.below {
            Below::Breaker(breaker, _, same_names) => {
                let sent = same_names.then_some(Sent {
                    grpc: self.call.is_grpc(),
                    timeout,
                    at,
                });
                breaker
                    .admit(&attempt, self.extensions, sent)
                    .map(|admitted| Some((*breaker, admitted)))
            }
            Below::Next(_) => Ok(None),
        };
        let until = self.call.attempt_until();
        let mut sent =
            admitted.map(|admitted| (admitted, self.below.next().run(attempt, self.extensions)));
        async move {
            // Awaited where it lies (a move of it is a copy).
            let Ok((admitted, sent)) = &mut sent else {
                return sent.err().map(Err);
            };
            let result = match until {
                Some(until) => tokio::time::timeout_at(until, sent).await.ok(),
                None => Some(sent.await),
            };
            // A timed-out attempt is dropped with its permit, as the breaker's future
            // would be.
            if let (Some((breaker, admitted)), Some(result)) = (admitted.take(), &result) {
                breaker.settle(admitted, result);
            }
            result
        }
    }

    /// The attempt of `token` is over with `result` (`None`: it timed out): the answer,
    /// or the token of the retry to make. `last` is the last real response, kept while
    /// a retry is pending; `replayable`, whether the request can be sent again.
    fn decided(
        &mut self,
        result: Option<Result<Response>>,
        token: RetryToken,
        replayable: bool,
        last: &mut Option<Response>,
    ) -> ControlFlow<Result<Response>, RetryToken> {
        self.extensions.remove::<RetryCharged>();
        let outcome = match &result {
            Some(Ok(response)) => Attempt::response(response.status(), response.headers()),
            Some(Err(error)) => Attempt::Failure(failure_of(error)),
            None => Attempt::TimedOut,
        };
        let previous = last.as_ref().map(Response::status);
        match self.call.decide(outcome, token, replayable, previous) {
            Verdict::Success | Verdict::Final => ControlFlow::Break(self.ended(as_is(result))),
            Verdict::GiveUp(_) => {
                let answer = match result {
                    Some(Ok(response)) => Ok(given_up(&self.call, response)),
                    other => match last.take() {
                        Some(response) => Ok(given_up(&self.call, response)),
                        None => as_is(other),
                    },
                };
                ControlFlow::Break(self.ended(answer))
            }
            Verdict::Retry(next) => {
                if let Some(Ok(response)) = result {
                    *last = Some(response);
                }
                ControlFlow::Continue(next)
            }
        }
    }

    /// The call ends with `answer`: a deadline that passed is recorded in the inherited
    /// context and reported to the fused form's deadline middleware.
    fn ended(&self, answer: Result<Response>) -> Result<Response> {
        if let Err(Error::Middleware(e)) = &answer
            && e.is::<DeadlineExceeded>()
        {
            self.call.deadline_expired();
            if let Some(deadline) = self.deadline {
                deadline.report_expired();
            }
        }
        answer
    }
}

/// Too little time left after the wait for the attempt of `token`: gives up with the
/// `last` real response.
fn out_of_time(call: &RetryCall, token: &RetryToken, last: Option<Response>) -> Result<Response> {
    let attempts = token.attempt() - 1;
    call.give_up(
        GiveUp::NotEnoughTime,
        attempts,
        last.as_ref().map(Response::status),
    );
    match last {
        Some(response) => Ok(given_up(call, response)),
        None => Err(deadline_exceeded()),
    }
}

/// The outcome as it is: the response, the error, or — for a time-out —
/// [`DeadlineExceeded`].
fn as_is(result: Option<Result<Response>>) -> Result<Response> {
    result.unwrap_or_else(|| Err(deadline_exceeded()))
}

fn given_up(call: &RetryCall, mut response: Response) -> Response {
    call.mark_given_up(response.headers_mut());
    response
}

fn deadline_exceeded() -> Error {
    Error::Middleware(anyhow::Error::new(DeadlineExceeded::new()))
}

/// What kind of transport failure `error` is, for the classifier: a failed connect
/// (nothing was sent: retryable for any request), a time-out, a request or body error
/// (the connection closed before a response: retryable for safe requests), and — in a
/// middleware's error — retrysafe's own local refusals (never retried) or the
/// `std::io::Error` kinds of [`Failure::of`].
///
/// ```
/// use std::time::Duration;
/// use retrysafe::classify::Failure;
/// use retrysafe::error::CircuitOpen;
/// use retrysafe::reqwest::retry::failure_of;
///
/// let open = reqwest_middleware::Error::middleware(CircuitOpen::new(Duration::from_secs(1)));
/// assert_eq!(failure_of(&open), Failure::Local);
/// let refused = reqwest_middleware::Error::middleware(std::io::Error::from(
///     std::io::ErrorKind::ConnectionRefused,
/// ));
/// assert_eq!(failure_of(&refused), Failure::ConnectFailed);
/// ```
pub fn failure_of(error: &Error) -> Failure {
    match error {
        Error::Reqwest(e) => reqwest_failure(e),
        // A middleware's payload: a local refusal of ours, an I/O error, or a reqwest
        // error it wrapped (read the same way as one passed on as it is).
        Error::Middleware(e) => Failure::of(e.as_ref(), |inner| {
            inner.downcast_ref::<reqwest::Error>().map(reqwest_failure)
        }),
    }
}

fn reqwest_failure(e: &reqwest::Error) -> Failure {
    if e.is_connect() {
        Failure::ConnectFailed
    } else if e.is_timeout() {
        Failure::Timeout
    } else if e.is_request() || e.is_body() {
        Failure::NoResponse
    } else {
        Failure::of(e, |_| None)
    }
}

/// A reqwest request and the reqwest-middleware extensions, as the planner reads them.
struct Head<'a> {
    request: &'a mut Request,
    extensions: &'a mut Extensions,
}

impl RequestHead for Head<'_> {
    fn method(&self) -> &Method {
        self.request.method()
    }

    fn headers(&self) -> &HeaderMap {
        self.request.headers()
    }

    fn headers_mut(&mut self) -> &mut HeaderMap {
        self.request.headers_mut()
    }

    fn extensions(&self) -> &Extensions {
        self.extensions
    }

    fn child_key_label(&self) -> String {
        let url = self.request.url();
        child_key_label(self.request.method(), url.authority(), url.path())
    }

    fn satisfies(&mut self, predicate: &IdempotentIf) -> bool {
        // Only when the user gave a predicate: a copy of the head as `Parts`, with the
        // extensions lent for the call.
        let (mut parts, ()) = http::Request::new(()).into_parts();
        parts.method = self.request.method().clone();
        parts.uri = self.request.url().as_str().parse().unwrap_or_default();
        parts.version = self.request.version();
        parts.headers = self.request.headers().clone();
        parts.extensions = std::mem::take(self.extensions);
        let yes = predicate(&parts);
        *self.extensions = parts.extensions;
        yes
    }
}
