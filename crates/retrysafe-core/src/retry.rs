//! What the hooks of a retrying client see: a [`RetryEvent`] before each retry, a
//! [`GiveUpEvent`] when it gives up on a retryable failure.
//!
//! The retry planner — everything a retrying client decides for one logical request,
//! sans IO, driven alike by the tower `RetryLayer` and the reqwest `RetryMiddleware` —
//! lives here too, as plumbing for those crates rather than API.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{Extensions, HeaderMap, HeaderValue, Method, StatusCode};
use tokio::time::Instant;

use crate::budget::RetryBudget;
use crate::classify::{
    Classification, Classifier, DefaultClassifier, DelayHint, Failure, FaultSide, RequestFacts,
    is_grpc,
};
use crate::deadline::ExpiryObserver;
use crate::hedge::{HedgeCopy, HedgeRace};
use crate::idempotency::Token;
use crate::observe::handles::{Counter, Lazy};
use crate::observe::{AttemptNumber, Name, names};
use crate::strategy::{
    GiveUp, Idempotent, MIN_ATTEMPT_TIME, NoRetry, RetryCharged, RetryStrategy, RetryToken,
    StandardRetryStrategy,
};
use crate::stripe::{Local, Striped};
use crate::wire::{
    Convention, DO_NOT_RETRY_VALUE, IdempotencyKey, RETRY_POINT_CALLER, encode_grpc_timeout,
    encode_request_timeout_ms, encode_retry_attempt, parse_grpc_timeout, parse_request_timeout_ms,
};
use crate::{CallContext, Deadline};

/// A retry about to happen, as the `on_retry` hook sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RetryEvent {
    /// The name of the retrying layer or middleware.
    pub name: Name,
    /// The 1-based number of the attempt about to be made (2 for the first retry).
    pub attempt: u32,
    /// The delay before it.
    pub delay: Duration,
    /// The failed attempt's status, if it got a response.
    pub status: Option<StatusCode>,
    /// The classification of the failed attempt.
    pub classification: Classification,
}

/// Giving up on a retryable failure, as the `on_give_up` hook sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct GiveUpEvent {
    /// The name of the retrying layer or middleware.
    pub name: Name,
    /// The attempts made.
    pub attempts: u32,
    /// Why it gave up.
    pub reason: GiveUp,
    /// The last attempt's status, if it got a response.
    pub status: Option<StatusCode>,
}

/// A predicate declaring requests idempotent whatever their method
/// ([`RetryPolicy::with_idempotent_if`]).
#[doc(hidden)]
pub type IdempotentIf = dyn Fn(&http::request::Parts) -> bool + Send + Sync;

type Hook<E> = Arc<dyn Fn(&E) + Send + Sync>;

/// The head of an outbound request as the planner reads and edits it: implemented for
/// [`http::request::Parts`] here, and by each adapter for its own request type.
#[doc(hidden)]
pub trait RequestHead {
    /// The method.
    fn method(&self) -> &Method;

    /// The headers.
    fn headers(&self) -> &HeaderMap;

    /// The headers, to add an `Idempotency-Key` or `retry-point`.
    fn headers_mut(&mut self) -> &mut HeaderMap;

    /// The extensions: [`Deadline`], [`NoRetry`], [`Idempotent`], [`RetryBudget`], a
    /// hand-carried [`CallContext`].
    fn extensions(&self) -> &Extensions;

    /// The label of a deterministic child key (see [`child_key_label`]).
    fn child_key_label(&self) -> String;

    /// Whether `predicate` declares this request idempotent. Called only when the
    /// policy has one.
    fn satisfies(&mut self, predicate: &IdempotentIf) -> bool;
}

impl RequestHead for http::request::Parts {
    fn method(&self) -> &Method {
        &self.method
    }

    fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    fn headers_mut(&mut self) -> &mut HeaderMap {
        &mut self.headers
    }

    fn extensions(&self) -> &Extensions {
        &self.extensions
    }

    fn child_key_label(&self) -> String {
        let authority = self.uri.authority().map_or("", |a| a.as_str());
        child_key_label(&self.method, authority, self.uri.path())
    }

    fn satisfies(&mut self, predicate: &IdempotentIf) -> bool {
        predicate(self)
    }
}

/// The label of the child key of an outbound call made inside a guarded handler:
/// method, authority and path (`POST api.local:8080/payments`).
///
/// ```
/// use http::Method;
/// use retrysafe_core::retry::child_key_label;
/// assert_eq!(child_key_label(&Method::POST, "api:80", "/pay"), "POST api:80/pay");
/// ```
#[doc(hidden)]
pub fn child_key_label(method: &Method, authority: &str, path: &str) -> String {
    format!("{method} {authority}{path}")
}

/// The configuration of retries, shared by every call (see [`RetryCall`]).
///
/// A cheap `Clone` (reference-counted parts). Adapters keep one behind an `Arc` and
/// start each call with [`RetryPolicy::begin`].
///
/// ```
/// use retrysafe_core::retry::RetryPolicy;
/// use retrysafe::wire::Convention;
///
/// let policy = RetryPolicy::new()
///     .with_convention(Convention::default())
///     .with_generated_keys()
///     .with_retry_point();
/// assert!(policy.generates_keys());
/// assert!(policy.is_retry_point());
/// assert_eq!(policy.convention().idempotency_key(), "idempotency-key");
/// ```
#[derive(Clone)]
#[doc(hidden)]
pub struct RetryPolicy {
    strategy: Arc<dyn RetryStrategy>,
    classifier: Arc<dyn Classifier>,
    convention: Convention,
    generate_keys: bool,
    retry_point: bool,
    idempotent_if: Option<Arc<IdempotentIf>>,
    on_retry: Option<Hook<RetryEvent>>,
    on_give_up: Option<Hook<GiveUpEvent>>,
    /// The budget of calls whose request carries none (else the strategy's own).
    budget: Option<RetryBudget>,
    /// Whether attempts carry the [`RetryCharged`] mark (for a budget layer below).
    charge_mark: bool,
    name: Name,
    /// The metric handles of `name`, resolved once the layer is built
    /// ([`resolve_metrics`](Self::resolve_metrics)), or on first use.
    metrics: Lazy<RetryMetrics>,
    /// Reports calls that ran out of time, for a stack with a deadline of its own.
    expiry: Option<ExpiryObserver>,
}

/// The counters of a retrying client, resolved once per name.
#[derive(Debug, Clone, Default)]
struct RetryMetrics {
    /// `attempts_total` by outcome.
    success: Counter,
    failure: Counter,
    rejected: Counter,
    error: Counter,
    /// `retries_total` by reason.
    retry_status: Counter,
    retry_error: Counter,
    retry_pushback: Counter,
}

impl RetryMetrics {
    fn new(name: &Name) -> Self {
        let attempt = |outcome| {
            Counter::new(
                names::CLIENT_ATTEMPTS_TOTAL,
                name,
                Some(("outcome", outcome)),
            )
        };
        let retry =
            |reason| Counter::new(names::CLIENT_RETRIES_TOTAL, name, Some(("reason", reason)));
        RetryMetrics {
            success: attempt("success"),
            failure: attempt("failure"),
            rejected: attempt("rejected"),
            error: attempt("error"),
            retry_status: retry("status"),
            retry_error: retry("error"),
            retry_pushback: retry("pushback"),
        }
    }

    /// The counter of attempts with `outcome`.
    fn attempts(&self, outcome: AttemptOutcome) -> &Counter {
        match outcome {
            AttemptOutcome::Success => &self.success,
            AttemptOutcome::Failure => &self.failure,
            AttemptOutcome::Rejected => &self.rejected,
            AttemptOutcome::Error => &self.error,
        }
    }
}

/// The outcome label of an attempt.
#[derive(Clone, Copy)]
enum AttemptOutcome {
    Success,
    Failure,
    Rejected,
    Error,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl RetryPolicy {
    /// The [`StandardRetryStrategy`] (3 attempts, full jitter, a ratio budget of its own,
    /// 10 s per attempt and 30 s overall without a deadline), the [`DefaultClassifier`]
    /// and the default [`Convention`]; no keys generated, not the retry point.
    pub fn new() -> Self {
        RetryPolicy {
            strategy: Arc::new(StandardRetryStrategy::new()),
            classifier: Arc::new(DefaultClassifier::default()),
            convention: Convention::default(),
            generate_keys: false,
            retry_point: false,
            idempotent_if: None,
            on_retry: None,
            on_give_up: None,
            budget: None,
            charge_mark: true,
            name: Name::default(),
            metrics: Lazy::default(),
            expiry: None,
        }
    }

    /// Reports the calls that end with a
    /// [`DeadlineExceeded`](crate::error::DeadlineExceeded) error to `observer` (a fused
    /// stack's deadline).
    #[must_use]
    pub fn with_expiry_observer(mut self, observer: ExpiryObserver) -> Self {
        self.expiry = Some(observer);
        self
    }

    /// The name of the calls' span, hook events and metrics (default `default`).
    #[must_use]
    pub fn with_name(mut self, name: impl Into<Name>) -> Self {
        self.name = name.into();
        self.metrics = Lazy::default();
        self
    }

    /// Resolves the metric handles now, against the recorder installed now (else at the
    /// first call): for an adapter, when its layer or stack is built. Those of the
    /// budget given with [`with_budget`](Self::with_budget) and of the expiry observer
    /// too.
    pub fn resolve_metrics(&self) {
        let _ = self.metrics();
        if let Some(budget) = &self.budget {
            budget.resolve_metrics();
        }
        if let Some(expiry) = &self.expiry {
            expiry.resolve_metrics();
        }
    }

    #[inline]
    fn metrics(&self) -> &RetryMetrics {
        self.metrics.get(|| RetryMetrics::new(&self.name))
    }

    /// The name given with [`with_name`](Self::with_name).
    pub fn name(&self) -> &Name {
        &self.name
    }

    /// The budget charged by calls whose request carries no [`RetryBudget`] extension,
    /// instead of the strategy's own (a stack that is given its budget once).
    #[must_use]
    pub fn with_budget(mut self, budget: RetryBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Attempts no longer carry the [`RetryCharged`] mark: for a stack with no separate
    /// budget layer below to read it (the mark's insert is a request's first extension
    /// allocation more often than not).
    #[must_use]
    pub fn without_charge_mark(mut self) -> Self {
        self.charge_mark = false;
        self
    }

    /// The budget given with [`with_budget`](Self::with_budget), if any.
    pub fn budget(&self) -> Option<&RetryBudget> {
        self.budget.as_ref()
    }

    /// The retry strategy (attempts, backoff, budget, default timeouts).
    #[must_use]
    pub fn with_strategy(mut self, strategy: impl RetryStrategy) -> Self {
        self.strategy = Arc::new(strategy);
        self
    }

    /// The classifier (default: [`DefaultClassifier`] over this policy's convention).
    #[must_use]
    pub fn with_classifier(mut self, classifier: impl Classifier) -> Self {
        self.classifier = Arc::new(classifier);
        self
    }

    /// The header names; also resets the classifier to the [`DefaultClassifier`] over
    /// them (set a custom classifier after this).
    #[must_use]
    pub fn with_convention(mut self, convention: Convention) -> Self {
        self.classifier = Arc::new(DefaultClassifier::new(convention.clone()));
        self.convention = convention;
        self
    }

    /// Adds an `Idempotency-Key` to POST and PATCH requests that have none: random (128
    /// bits), or the deterministic child key of an inherited
    /// [`IdempotencyContext`](crate::idempotency::IdempotencyContext).
    #[must_use]
    pub fn with_generated_keys(mut self) -> Self {
        self.generate_keys = true;
        self
    }

    /// Sends `retry-point: caller` on every attempt: nothing below retries.
    #[must_use]
    pub fn with_retry_point(mut self) -> Self {
        self.retry_point = true;
        self
    }

    /// Declares requests safe to repeat when `f` says so, whatever their method.
    #[must_use]
    pub fn with_idempotent_if(
        mut self,
        f: impl Fn(&http::request::Parts) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.idempotent_if = Some(Arc::new(f));
        self
    }

    /// Called before each retry.
    #[must_use]
    pub fn with_on_retry(mut self, f: impl Fn(&RetryEvent) + Send + Sync + 'static) -> Self {
        self.on_retry = Some(Arc::new(f));
        self
    }

    /// Called when a call gives up on a retryable failure.
    #[must_use]
    pub fn with_on_give_up(mut self, f: impl Fn(&GiveUpEvent) + Send + Sync + 'static) -> Self {
        self.on_give_up = Some(Arc::new(f));
        self
    }

    /// The retry strategy.
    pub fn strategy(&self) -> &dyn RetryStrategy {
        &*self.strategy
    }

    /// The classifier.
    pub fn classifier(&self) -> &dyn Classifier {
        &*self.classifier
    }

    /// The header names.
    pub fn convention(&self) -> &Convention {
        &self.convention
    }

    /// Whether keys are generated for POST and PATCH.
    pub fn generates_keys(&self) -> bool {
        self.generate_keys
    }

    /// Whether calls make themselves the retry point.
    pub fn is_retry_point(&self) -> bool {
        self.retry_point
    }

    /// Starts a call: reads `head`, adds the key and `retry-point` headers it needs
    /// (these belong to every attempt), settles the deadline, and acquires the first
    /// token (the request's one deposit into the budget: the [`RetryBudget`]
    /// extension's, or the strategy's).
    ///
    /// The policy is shared as a [`Striped`]: every call keeps a reference to it, counted
    /// on the calling thread's stripe, so threads starting calls at the same time do not
    /// contend on one reference count.
    pub fn begin<H: RequestHead + ?Sized>(
        policy: &Striped<Self>,
        head: &mut H,
    ) -> (RetryCall, RetryToken) {
        Self::begin_within(policy, head, None)
    }

    /// [`begin`](Self::begin) for a call that also has a deadline of its own (a fused
    /// stack's, which need not travel in the request's extensions), `within`: the
    /// deadline and the reading of tokio's clock it was made from. The call's deadline
    /// is the soonest of it and those `begin` reads; the budget counts the request at
    /// that reading ([`RetryStrategy::acquire_initial_retry_token_at`]).
    pub fn begin_within<H: RequestHead + ?Sized>(
        policy: &Striped<Self>,
        head: &mut H,
        within: Option<(Deadline, Instant)>,
    ) -> (RetryCall, RetryToken) {
        let this: &Self = policy;
        let context = CallContext::inherited(head.extensions());
        let mut facts = this.facts_of(head);
        let no_retry = head.extensions().get::<NoRetry>().is_some();
        if !no_retry {
            this.add_key(head, context.as_ref(), &mut facts);
        }
        let caller_is_retry_point = context
            .as_ref()
            .is_some_and(CallContext::caller_is_retry_point);
        // This call is the retry point, or an upstream caller is: either way, nothing
        // below may retry this request's calls.
        if this.retry_point || caller_is_retry_point {
            head.headers_mut()
                .insert(this.convention.retry_point().clone(), RETRY_POINT_CALLER);
        }
        let own = within.map(|(deadline, _)| deadline);
        let deadline = match (this.deadline_of(head, context.as_ref(), facts.grpc), own) {
            (Some(d), own) => Some(d.tighten(own)),
            (None, own) => own,
        };
        // Every attempt carries the deadline header when there is a deadline.
        facts.deadline_sent = deadline.is_some();

        let budget = head
            .extensions()
            .get::<RetryBudget>()
            .or(this.budget.as_ref())
            .cloned();
        // A hedge's copy: its request made the deposit, and the hedge was withdrawn.
        let hedge = head.extensions().get::<HedgeCopy>().copied();
        let mut token = match hedge {
            Some(hedge) => RetryToken::hedge(hedge.budget),
            None => match within {
                // The clock reading the caller's deadline was made from is the call's
                // start: the budget counts the request there (one clock read less).
                Some((_, now)) => this.strategy.acquire_initial_retry_token_at(budget, now),
                None => this.strategy.acquire_initial_retry_token(budget),
            },
        };
        // The first copy of a hedged request: the hedging layer above need not deposit.
        if hedge.is_none()
            && token.budget_id().is_some()
            && let Some(race) = head.extensions().get::<HedgeRace>()
        {
            race.claim_deposit();
        }
        let passthrough = no_retry || caller_is_retry_point || hedge.is_some();
        if passthrough {
            token.limit_attempts(1);
        }
        // A request numbered already (a hedge's copy) keeps counting from its number.
        let attempt_base = AttemptNumber::of(head.extensions()).map_or(0, |n| n.get() - 1);
        let span = call_span(&this.name);
        let call = RetryCall {
            policy: policy.local(),
            facts,
            context,
            passthrough,
            deadline,
            started: None,
            attempt_base,
            span,
        };
        (call, token)
    }

    /// What the classifier is told about the request (but its deadline).
    fn facts_of<H: RequestHead + ?Sized>(&self, head: &mut H) -> RequestFacts {
        // (Not `RequestFacts::of`: the deadline headers are read once, by `deadline_of`.)
        let mut facts = RequestFacts::UNSAFE;
        facts.has_key = head
            .headers()
            .contains_key(self.convention.idempotency_key());
        facts.safe = head.method().is_idempotent() || facts.has_key;
        facts.grpc = is_grpc(head.headers());
        if head.extensions().get::<Idempotent>().is_some()
            || self
                .idempotent_if
                .as_ref()
                .is_some_and(|f| head.satisfies(&**f))
        {
            facts.safe = true;
        }
        facts
    }

    /// Adds a generated `Idempotency-Key` to a POST or PATCH that has none, when
    /// configured to.
    fn add_key<H: RequestHead + ?Sized>(
        &self,
        head: &mut H,
        context: Option<&CallContext>,
        facts: &mut RequestFacts,
    ) {
        if !self.generate_keys
            || facts.has_key
            || (head.method() != Method::POST && head.method() != Method::PATCH)
        {
            return;
        }
        let key = match context.and_then(CallContext::idempotency) {
            Some(idem) => Some(idem.next_child_key(&head.child_key_label())),
            None => random_key(),
        };
        if let Some(key) = key {
            head.headers_mut().insert(
                self.convention.idempotency_key().clone(),
                key.to_header_value(),
            );
            facts.has_key = true;
            facts.safe = true;
        }
    }

    /// The deadline: the request's, the inherited one, and a timeout header the caller
    /// already set, whichever is soonest.
    fn deadline_of<H: RequestHead + ?Sized>(
        &self,
        head: &H,
        context: Option<&CallContext>,
        grpc: bool,
    ) -> Option<Deadline> {
        let mut deadline = head.extensions().get::<Deadline>().copied();
        if let Some(inherited) = context.and_then(CallContext::deadline) {
            deadline = Some(inherited.tighten(deadline));
        }
        if let Some(d) = header_deadline(head.headers(), grpc, &self.convention) {
            deadline = Some(d.tighten(deadline));
        }
        deadline
    }
}

impl fmt::Debug for RetryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryPolicy")
            .field("name", &self.name)
            .field("strategy", &self.strategy)
            .field("classifier", &self.classifier)
            .field("generate_keys", &self.generate_keys)
            .field("retry_point", &self.retry_point)
            .finish_non_exhaustive()
    }
}

/// The call's `retrysafe.call` span, boxed, when enabled: a disabled span adds a word
/// to every call's future, not the span's five.
#[inline]
fn call_span(name: &Name) -> Option<Box<tracing::Span>> {
    // Neither a subscriber nor, through tracing's `log` feature, a logger could take
    // it: not made at all (a disabled span still formats its fields for `log`, and
    // logs its drop).
    if !tracing::level_enabled!(tracing::Level::INFO) && log::max_level() < log::LevelFilter::Info {
        return None;
    }
    let span = tracing::info_span!(
        "retrysafe.call",
        name = %name,
        attempts = tracing::field::Empty,
        give_up = tracing::field::Empty,
        budget = tracing::field::Empty,
        breaker = tracing::field::Empty,
        deadline = tracing::field::Empty,
    );
    (!span.is_disabled()).then(|| Box::new(span))
}

/// A random 128-bit key (32 hex digits, always valid).
fn random_key() -> Option<IdempotencyKey> {
    IdempotencyKey::new(&Token::random().to_hex()).ok()
}

fn header_deadline(headers: &HeaderMap, grpc: bool, convention: &Convention) -> Option<Deadline> {
    let timeout = if grpc {
        headers
            .get(convention.grpc_timeout())
            .and_then(|v| parse_grpc_timeout(v.as_bytes()).ok())
    } else {
        headers
            .get(convention.request_timeout_ms())
            .and_then(|v| parse_request_timeout_ms(v.as_bytes()).ok())
    };
    timeout.map(Deadline::after)
}

/// What one attempt produced, as [`RetryCall::decide`] reads it.
#[derive(Debug, Clone, Copy)]
#[doc(hidden)]
pub enum Attempt<'a> {
    /// A response head (for gRPC, with a Trailers-Only status when there is one).
    Response {
        /// The status.
        status: StatusCode,
        /// The headers.
        headers: &'a HeaderMap,
    },
    /// No response: a transport failure, or a local refusal from below
    /// ([`Failure::Local`]), as the adapter recognised it.
    Failure(Failure),
    /// The attempt ran past [`RetryCall::attempt_until`].
    TimedOut,
}

impl<'a> Attempt<'a> {
    /// A response head.
    pub fn response(status: StatusCode, headers: &'a HeaderMap) -> Self {
        Attempt::Response { status, headers }
    }

    fn status(&self) -> Option<StatusCode> {
        match self {
            Attempt::Response { status, .. } => Some(*status),
            Attempt::Failure(_) | Attempt::TimedOut => None,
        }
    }
}

/// What to do after an attempt ([`RetryCall::decide`]).
///
/// "The outcome as it is" means: a response, unmarked; a failure, its error; a time-out,
/// a [`DeadlineExceeded`](crate::error::DeadlineExceeded).
#[derive(Debug)]
#[must_use]
#[doc(hidden)]
pub enum Verdict {
    /// A success (recorded with the strategy): answer with the outcome as it is.
    Success,
    /// Retry: wait the token's [`delay`](RetryToken::delay), then make its attempt. A
    /// response outcome becomes the last real response, kept for a later give-up.
    Retry(RetryToken),
    /// Not retryable (or only one attempt allowed): answer with the outcome as it is.
    Final,
    /// Gave up on a retryable failure (the hook was called, the inherited context
    /// marked): answer with the last real response — this outcome's, or else the one
    /// kept from an earlier attempt — marked with [`RetryCall::mark_given_up`]; with no
    /// response at all, with the outcome as it is.
    GiveUp(GiveUp),
}

/// The state of one logical request across its attempts.
///
/// The retry planner: everything a retrying client decides for one logical request,
/// sans IO, so the tower `RetryLayer` and the reqwest `RetryMiddleware` drive the same
/// code and differ only in how they send, wait and answer.
///
/// A [`RetryPolicy`] is the configuration (strategy, classifier, header convention, key
/// generation, retry point, what counts as idempotent, hooks), shared behind an `Arc`.
/// [`RetryPolicy::begin`] starts a [`RetryCall`] for one request: it reads the
/// [`RequestHead`] (method, headers, extensions), adds an `Idempotency-Key` and
/// `retry-point: caller` where configured, settles the deadline (the soonest of the
/// [`Deadline`] extension, the inherited [`CallContext`] and a timeout header already on
/// the request) and acquires the first [`RetryToken`] from the strategy. Then, for each
/// attempt, the adapter:
///
/// 1. refuses to start it when [`too_late`](Self::too_late) (less than
///    `MIN_ATTEMPT_TIME`, 1 ms, left);
/// 2. sets the per-attempt headers with [`prepare_attempt`](Self::prepare_attempt)
///    (`retry-attempt`, `grpc-previous-rpc-attempts`, the time left as
///    `request-timeout-ms` or `grpc-timeout`, the [`RetryCharged`] mark);
/// 3. bounds it by [`attempt_until`](Self::attempt_until);
/// 4. hands what came back to [`decide`](Self::decide), which classifies it,
///    records a success, refreshes the token, calls the hooks, and answers with a
///    [`Verdict`];
/// 5. on [`Verdict::Retry`], waits the token's [`delay`](RetryToken::delay) and starts
///    again at 1; when the wait leaves too little time, it calls
///    [`give_up`](Self::give_up) with [`GiveUp::NotEnoughTime`].
///
/// Giving up on a retryable failure answers with the last real response marked
/// `do-not-retry: 1` ([`mark_given_up`](Self::mark_given_up)) and records
/// `downstream_gave_up` in the inherited context, so no layer above retries again.
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// use http::{HeaderMap, Request, StatusCode};
/// use retrysafe_core::retry::{Verdict, Attempt, RetryPolicy};
/// use retrysafe::StandardRetryStrategy;
/// use retrysafe_core::__private::Striped;
///
/// let policy = Striped::new(RetryPolicy::new().with_strategy(StandardRetryStrategy::new().seed(1)));
/// let (mut head, ()) = Request::get("http://api/items").body(()).unwrap().into_parts();
/// let (mut call, mut token) = RetryPolicy::begin(&policy, &mut head);
///
/// // An "inner service" that answers 503 twice, then 200.
/// let answers = [StatusCode::SERVICE_UNAVAILABLE, StatusCode::SERVICE_UNAVAILABLE, StatusCode::OK];
/// let mut sent = Vec::new();
/// let status = loop {
///     assert!(!call.too_late());
///     let mut attempt = head.clone();
///     call.prepare_attempt(&mut attempt.headers, &mut attempt.extensions, &token);
///     sent.push(attempt.headers.get("retry-attempt").cloned());
///     let status = answers[sent.len() - 1];
///     let headers = HeaderMap::new();
///     match call.decide(Attempt::response(status, &headers), token, true, None) {
///         Verdict::Retry(next) => {
///             tokio::time::sleep(next.delay()).await;
///             token = next;
///         }
///         Verdict::Success | Verdict::Final | Verdict::GiveUp(_) => break status,
///     }
/// };
/// assert_eq!(status, StatusCode::OK);
/// assert_eq!(sent, [None, Some("2".parse().unwrap()), Some("3".parse().unwrap())]);
/// # }
/// ```
#[doc(hidden)]
pub struct RetryCall {
    policy: Local<RetryPolicy>,
    facts: RequestFacts,
    context: Option<CallContext>,
    /// Make one attempt and pass its answer through unmarked (`NoRetry`, or the caller
    /// is the retry point).
    passthrough: bool,
    deadline: Option<Deadline>,
    /// When the call started, taken lazily, for the default overall timeout.
    started: Option<Instant>,
    /// The attempts numbered before this call's first ([`AttemptNumber`]).
    attempt_base: u32,
    /// The `retrysafe.call` span, when enabled.
    span: Option<Box<tracing::Span>>,
}

impl RetryCall {
    /// The policy that began this call.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// What the classifier is told about the request.
    pub fn facts(&self) -> &RequestFacts {
        &self.facts
    }

    /// Whether the request is a gRPC request.
    pub fn is_grpc(&self) -> bool {
        self.facts.grpc
    }

    /// The call's deadline, if it has one.
    pub fn deadline(&self) -> Option<Deadline> {
        self.deadline
    }

    /// The inherited context, if any.
    pub fn context(&self) -> Option<&CallContext> {
        self.context.as_ref()
    }

    /// The call's `retrysafe.call` span (INFO): enter it while the call's attempts are
    /// made and polled, so the layers below record their verdicts on it.
    /// `None` when the span is disabled (no subscriber wants it).
    pub fn span(&self) -> Option<&tracing::Span> {
        self.span.as_deref()
    }

    /// The call ended with a [`DeadlineExceeded`](crate::error::DeadlineExceeded)
    /// error: recorded on the call's span (`deadline`), which a deadline layer above
    /// cannot reach, and reported to the policy's expiry observer, if it has one.
    #[cold]
    pub fn deadline_expired(&self) {
        // A hedge's copy (numbered past the first): the call it copies reports.
        if self.attempt_base > 0 {
            return;
        }
        self.record("deadline", &"exceeded");
        if let Some(observer) = &self.policy.expiry {
            observer.expired();
        }
    }

    /// Records `value` as the span's `field` (nothing when the span is disabled).
    fn record(&self, field: &str, value: &dyn tracing::Value) {
        if let Some(span) = &self.span {
            span.record(field, value);
        }
    }

    /// Whether the deadline leaves too little time to start an attempt (less than
    /// `MIN_ATTEMPT_TIME`, 1 ms). Checked before every attempt, after any wait.
    pub fn too_late(&self) -> bool {
        Self::too_late_with(self.time_left())
    }

    /// The time left before the deadline (`None` without one): one clock read, to pass
    /// to [`too_late_with`](Self::too_late_with) and
    /// [`prepare_attempt_with`](Self::prepare_attempt_with) when an adapter does both.
    pub fn time_left(&self) -> Option<Duration> {
        self.deadline.map(Deadline::remaining)
    }

    /// [`time_left`](Self::time_left) with the clock reading it was computed from, for an
    /// adapter that also times the attempt from it: the reading `now` the caller just
    /// made, else one read of its own (none without a deadline).
    pub fn read_time_left(&self, now: Option<Instant>) -> (Option<Instant>, Option<Duration>) {
        match self.deadline {
            Some(deadline) => {
                let now = now.unwrap_or_else(Instant::now);
                (
                    Some(now),
                    Some(deadline.instant().saturating_duration_since(now)),
                )
            }
            None => (now, None),
        }
    }

    /// [`too_late`](Self::too_late) with the time left read once by
    /// [`time_left`](Self::time_left).
    pub fn too_late_with(left: Option<Duration>) -> bool {
        left.is_some_and(|left| left < MIN_ATTEMPT_TIME)
    }

    /// Sets the per-attempt headers of the attempt of `token`: on every attempt its
    /// [`AttemptNumber`] extension (recorded as the call span's `attempts`); on attempts
    /// 2 and later `retry-attempt` (and `grpc-previous-rpc-attempts`); on every attempt
    /// of a budgeted token, the [`RetryCharged`] extension; with a deadline, the time
    /// left (or the strategy's attempt bound under a deadline, if shorter) as
    /// `request-timeout-ms` (or `grpc-timeout`), rounded down.
    pub fn prepare_attempt(
        &self,
        headers: &mut HeaderMap,
        extensions: &mut Extensions,
        token: &RetryToken,
    ) {
        self.prepare_attempt_with(headers, extensions, token, self.time_left());
    }

    /// [`prepare_attempt`](Self::prepare_attempt) with the time left read by
    /// [`time_left`](Self::time_left) (so a check and the headers share one clock read).
    ///
    /// Returns the time the attempt's timeout header was written from (the time left,
    /// or the attempt bound if shorter), so that a breaker the stack drives itself need
    /// not parse the header again ([`BreakerFacts::sent`](crate::classify::BreakerFacts::sent));
    /// `None` when no timeout header was written.
    pub fn prepare_attempt_with(
        &self,
        headers: &mut HeaderMap,
        extensions: &mut Extensions,
        token: &RetryToken,
        left: Option<Duration>,
    ) -> Option<Duration> {
        let convention = &self.policy.convention;
        let attempt = token.attempt();
        let number = self.attempt_base.saturating_add(attempt);
        // Absent means the first attempt: inserting it there would allocate the
        // extensions' map of most requests (about 700 instructions per call).
        if number >= 2 || extensions.get::<AttemptNumber>().is_some() {
            extensions.insert(AttemptNumber::new(number));
        }
        self.record("attempts", &number);
        if attempt >= 2 {
            headers.insert(
                convention.retry_attempt().clone(),
                encode_retry_attempt(attempt),
            );
            if self.facts.grpc {
                headers.insert(
                    convention.grpc_previous_rpc_attempts().clone(),
                    HeaderValue::from(attempt - 1),
                );
            }
        }
        if let Some(budget) = token.budget_id().filter(|_| self.policy.charge_mark) {
            extensions.insert(RetryCharged { attempt, budget });
        }
        // An attempt bounded more tightly than the deadline says so downstream.
        let cap = self.attempt_cap();
        let left = left.map(|l| cap.map_or(l, |c| l.min(c)))?;
        if self.facts.grpc {
            headers.insert(convention.grpc_timeout().clone(), encode_grpc_timeout(left));
        } else {
            headers.insert(
                convention.request_timeout_ms().clone(),
                encode_request_timeout_ms(left),
            );
        }
        Some(left)
    }

    /// The strategy's bound on each attempt under a deadline, for a call that may be
    /// retried at all (a safe request, not limited to one attempt): cutting an attempt
    /// that can never be repeated would only turn a slow answer into an unknown outcome.
    fn attempt_cap(&self) -> Option<Duration> {
        if self.passthrough || !self.facts.safe {
            return None;
        }
        self.policy.strategy.attempt_timeout_under_deadline()
    }

    /// When the whole call must end: the deadline, or the strategy's default overall
    /// timeout counted from the first time this is asked.
    pub fn overall_until(&mut self) -> Option<Instant> {
        if let Some(d) = self.deadline {
            return Some(d.instant());
        }
        let overall = self.policy.strategy.default_timeouts().1?;
        Some(*self.started.get_or_insert_with(Instant::now) + overall)
    }

    /// When the current attempt must end: the deadline (or sooner, by the strategy's
    /// [attempt bound under a deadline](crate::strategy::RetryStrategy::attempt_timeout_under_deadline)),
    /// or the strategy's default attempt timeout from now, bounded by the overall one.
    pub fn attempt_until(&mut self) -> Option<Instant> {
        if let Some(d) = self.deadline {
            let cap = self.attempt_cap();
            return Some(cap.map_or(d.instant(), |c| d.instant().min(Instant::now() + c)));
        }
        let attempt = self
            .policy
            .strategy
            .default_timeouts()
            .0
            .map(|t| Instant::now() + t);
        match (attempt, self.overall_until()) {
            (Some(a), Some(o)) => Some(a.min(o)),
            (a, o) => a.or(o),
        }
    }

    /// After the attempt of `token`: classifies `outcome`, records a success, refreshes
    /// the token, calls the hooks, and says what to do. `replayable` is whether the
    /// request can be sent again (its body could be kept); `last` is the status of the
    /// last real response kept from an earlier attempt, if any.
    pub fn decide(
        &mut self,
        outcome: Attempt<'_>,
        token: RetryToken,
        replayable: bool,
        last: Option<StatusCode>,
    ) -> Verdict {
        let classification = self.classify(outcome);
        if classification.is_success() {
            self.count_attempt(AttemptOutcome::Success);
            self.policy.strategy.record_success(&token);
            return Verdict::Success;
        }
        if classification.marked {
            // Downstream already retried, or answered for good.
            if let Some(context) = &self.context {
                context.mark_downstream_gave_up();
            }
        }
        let attempts = token.attempt();
        let status = outcome.status();
        let failed = match outcome {
            Attempt::Response { .. } => AttemptOutcome::Failure,
            Attempt::Failure(_) | Attempt::TimedOut => AttemptOutcome::Error,
        };
        match self.refresh(token, &classification, replayable) {
            Ok(next) => {
                self.count_attempt(failed);
                self.retrying(&next, status, &classification);
                Verdict::Retry(next)
            }
            Err(GiveUp::NotRetryable) => {
                self.count_attempt(match failed {
                    AttemptOutcome::Failure => AttemptOutcome::Rejected,
                    other => other,
                });
                self.not_retryable(outcome, &classification, attempts, last)
            }
            Err(reason) => {
                self.count_attempt(failed);
                if reason == GiveUp::BudgetExhausted {
                    self.record("budget", &"refused");
                }
                self.give_up(reason, attempts, status.or(last));
                Verdict::GiveUp(reason)
            }
        }
    }

    /// Counts one attempt's outcome.
    #[inline]
    fn count_attempt(&self, outcome: AttemptOutcome) {
        self.policy.metrics().attempts(outcome).increment();
    }

    /// What the classifier makes of `outcome`.
    fn classify(&self, outcome: Attempt<'_>) -> Classification {
        let classifier = &self.policy.classifier;
        match outcome {
            Attempt::Response { status, headers } => {
                classifier.classify_response(status, headers, &self.facts)
            }
            Attempt::Failure(failure) => classifier.classify_failure(failure, &self.facts),
            Attempt::TimedOut => classifier.classify_failure(Failure::Timeout, &self.facts),
        }
    }

    /// The token of the next attempt, or why there is none.
    fn refresh(
        &mut self,
        token: RetryToken,
        classification: &Classification,
        replayable: bool,
    ) -> Result<RetryToken, GiveUp> {
        if self.passthrough || !replayable {
            // One attempt only; or a body that cannot be sent again.
            return Err(GiveUp::NotRetryable);
        }
        let time_left = self
            .overall_until()
            .map(|at| at.saturating_duration_since(Instant::now()));
        self.policy
            .strategy
            .refresh_retry_token(token, classification, &self.facts, time_left)
    }

    /// A failure that is not retried, after `attempts` attempts.
    fn not_retryable(
        &self,
        outcome: Attempt<'_>,
        classification: &Classification,
        attempts: u32,
        last: Option<StatusCode>,
    ) -> Verdict {
        if let Attempt::Failure(Failure::Local) = outcome
            && last.is_some()
        {
            // A local refusal (a budget or breaker below refused a retry) after a real
            // response: that response, marked, is the answer.
            self.give_up(GiveUp::RefusedBelow, attempts, last);
            return Verdict::GiveUp(GiveUp::RefusedBelow);
        }
        // Retried, then a failure that is not retryable: this layer gave up after
        // retrying all the same, so the server above marks its own failure and its
        // caller does not retry again. (A client error is an answer, not a give-up.)
        if attempts >= 2
            && matches!(
                classification.fault,
                Some(FaultSide::Server | FaultSide::CallerDeadline)
            )
            && let Some(context) = &self.context
        {
            context.mark_downstream_gave_up();
        }
        Verdict::Final
    }

    /// Gives up on a retryable failure after `attempts` attempts: records
    /// `downstream_gave_up` in the inherited context, emits a `tracing` event and calls
    /// the `on_give_up` hook. `last` is the status of the last real response. The
    /// adapter then answers as [`Verdict::GiveUp`] says.
    pub fn give_up(&self, reason: GiveUp, attempts: u32, last: Option<StatusCode>) {
        if let Some(context) = &self.context {
            context.mark_downstream_gave_up();
        }
        tracing::debug!(attempts, %reason, status = last.map(|s| s.as_u16()), "giving up");
        self.record("give_up", &reason.as_str());
        if let Some(hook) = &self.policy.on_give_up {
            hook(&GiveUpEvent {
                name: self.policy.name.clone(),
                attempts,
                reason,
                status: last,
            });
        }
    }

    /// Marks the headers of the response a give-up answers with: `do-not-retry: 1`.
    pub fn mark_given_up(&self, headers: &mut HeaderMap) {
        headers.insert(
            self.policy.convention.do_not_retry().clone(),
            DO_NOT_RETRY_VALUE,
        );
    }

    fn retrying(
        &self,
        next: &RetryToken,
        status: Option<StatusCode>,
        classification: &Classification,
    ) {
        tracing::debug!(
            attempt = next.attempt(),
            delay_ms = u64::try_from(next.delay().as_millis()).unwrap_or(u64::MAX),
            status = status.map(|s| s.as_u16()),
            "retrying"
        );
        let metrics = self.policy.metrics();
        let reason = if !matches!(classification.delay, DelayHint::Backoff) {
            &metrics.retry_pushback
        } else if status.is_some() {
            &metrics.retry_status
        } else {
            &metrics.retry_error
        };
        reason.increment();
        if next.budget_id().is_some() {
            self.record("budget", &"granted");
        }
        if let Some(hook) = &self.policy.on_retry {
            hook(&RetryEvent {
                name: self.policy.name.clone(),
                attempt: next.attempt(),
                delay: next.delay(),
                status,
                classification: *classification,
            });
        }
    }
}

impl fmt::Debug for RetryCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryCall")
            .field("facts", &self.facts)
            .field("context", &self.context)
            .field("passthrough", &self.passthrough)
            .field("deadline", &self.deadline.map(Deadline::remaining))
            .finish_non_exhaustive()
    }
}
