//! The part both idempotency layers share: which requests are guarded and how (the
//! [`Guard`]), and the [`Backend`] trait for what runs a guarded request.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::header::AUTHORIZATION;
use http::request::Parts;
use http::{HeaderMap, Method, Request, Response};
use http_body::Body;
use retrysafe_core::__private::Validate;
use retrysafe_core::__private::protocol::Policy;
use retrysafe_core::idempotency::Decision;
use retrysafe_core::idempotency::{
    Fingerprint, Fingerprinter, HeaderFilter, IdempotencyContext, IdempotencyEvent, Principal,
    RecordId, Scope, StoredResponse,
};
use retrysafe_core::observe::Name;
use retrysafe_core::observe::handles::Lazy;
use retrysafe_core::wire::{Convention, DO_NOT_RETRY_VALUE, IdempotencyKey, encode_retry_after};
use retrysafe_core::{CallContext, ConfigError, Deadline};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tower_service::Service;
use tracing::Span;

use super::blocks::{self, CapturedBody};
use super::body::{RequestBody, ResponseBody};
use super::event::{EventHook, EventKind, UnknownReason};
use super::observe::{self, Metrics, RoundTrips, StoreOp};
use super::problem::{Problem, ProblemKind, Responder};
use super::slots::{self, Slot, Slots};

type Res<B> = Response<ResponseBody<B>>;

/// A user's rule from request head to scope.
pub(crate) type ScopeFn = Arc<dyn Fn(&Parts) -> Option<Scope> + Send + Sync>;

#[derive(Clone)]
pub(crate) enum ScopeRule {
    Principal,
    Global,
    AuthorizationHash,
    Custom(ScopeFn),
}

impl fmt::Debug for ScopeRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScopeRule::Principal => "Principal",
            ScopeRule::Global => "Global",
            ScopeRule::AuthorizationHash => "AuthorizationHash",
            ScopeRule::Custom(_) => "Custom",
        })
    }
}

/// The options of the guard, set by the layer's builder methods.
#[derive(Clone)]
pub(crate) struct GuardConfig {
    pub(crate) convention: Convention,
    pub(crate) methods: Vec<Method>,
    pub(crate) guard_grpc: bool,
    pub(crate) require_key: bool,
    pub(crate) scope: ScopeRule,
    pub(crate) fingerprinter: Fingerprinter,
    pub(crate) header_filter: HeaderFilter,
    pub(crate) max_request_body: usize,
    /// How long a guarded request's body may take to arrive once its slot is taken.
    pub(crate) request_body_timeout: Duration,
    pub(crate) max_stored_response: usize,
    pub(crate) retention: Duration,
    /// How many of the in-flight slots one scope may hold; `None`: the default share
    /// of the bound ([`slots::default_share`]).
    pub(crate) max_in_flight_per_scope: Option<usize>,
    /// The in-flight policy, the `retry-after` hints and whether the backend rolls a
    /// failed handler back ([`Backend::ROLLS_BACK`]).
    pub(crate) policy: Policy,
    pub(crate) responder: Option<Responder>,
    pub(crate) on_event: Option<EventHook>,
    /// The layer's name in events, spans and metrics.
    pub(crate) name: Name,
    /// The metric handles, resolved under `name` by `build` or when the layer makes its
    /// service, whichever comes first (a renamed layer starts afresh).
    pub(crate) metrics: Lazy<Metrics>,
    /// The settings a setter refused, reported by `build`.
    pub(crate) checks: Validate,
}

pub(crate) const DEFAULT_MAX_IN_FLIGHT: usize = 1024;
/// The default [`GuardConfig::request_body_timeout`]: 30 s (1 MiB at 35 kB/s).
pub(crate) const DEFAULT_REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(30);
const MIB: usize = 1024 * 1024;

impl GuardConfig {
    pub(crate) fn new(rolls_back: bool) -> Self {
        GuardConfig {
            convention: Convention::default(),
            methods: vec![Method::POST, Method::PATCH],
            guard_grpc: false,
            require_key: false,
            scope: ScopeRule::Principal,
            fingerprinter: Fingerprinter::default(),
            header_filter: HeaderFilter::default(),
            max_request_body: MIB,
            request_body_timeout: DEFAULT_REQUEST_BODY_TIMEOUT,
            max_stored_response: MIB,
            retention: Duration::from_secs(24 * 60 * 60),
            max_in_flight_per_scope: None,
            policy: Policy::new().rolls_back(rolls_back),
            responder: None,
            on_event: None,
            name: Name::default(),
            metrics: Lazy::default(),
            checks: Validate::new(),
        }
    }

    /// The metric handles, resolved in the current recorder the first time.
    #[inline]
    pub(crate) fn metrics(&self) -> &Metrics {
        self.metrics.get(|| Metrics::resolve(&self.name))
    }
}

/// Runtime state shared by every clone of a layer and its services.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) slots: Slots,
    pub(crate) tracker: TaskTracker,
    pub(crate) scope_warned: AtomicBool,
}

impl Shared {
    pub(crate) fn new(max_in_flight: usize, tracker: TaskTracker) -> Self {
        Shared {
            slots: Slots::new(max_in_flight),
            tracker,
            scope_warned: AtomicBool::new(false),
        }
    }
}

/// The rules an idempotency layer guards requests by — the methods guarded, the key,
/// the scope, the fingerprint, the limits, the in-flight policy, the problem answers and
/// the events — with the state every clone of the layer shares (the bound of requests
/// in flight and the tracked tasks).
///
/// Set with the builder methods of [`IdempotencyLayer`](super::IdempotencyLayer),
/// whatever its [`Backend`]; a backend gets it with every request it runs, to answer as
/// the layer does.
#[derive(Clone)]
pub struct Guard {
    pub(crate) config: Arc<GuardConfig>,
    pub(crate) shared: Arc<Shared>,
}

impl fmt::Debug for Guard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("Guard")
            .field("methods", &c.methods)
            .field("guard_grpc", &c.guard_grpc)
            .field("require_key", &c.require_key)
            .field("scope", &c.scope)
            .field("max_request_body", &c.max_request_body)
            .field("request_body_timeout", &c.request_body_timeout)
            .field("max_stored_response", &c.max_stored_response)
            .field("retention", &c.retention)
            .field("policy", &c.policy)
            .finish_non_exhaustive()
    }
}

impl Guard {
    /// The header names in use.
    pub fn convention(&self) -> &Convention {
        &self.config.convention
    }

    /// How long a completed record is kept.
    pub fn retention(&self) -> Duration {
        self.config.retention
    }

    /// Whether the scope comes from the `Principal` extension (the default rule), which
    /// only an authentication layer can insert.
    pub(crate) fn scoped_by_principal(&self) -> bool {
        matches!(self.config.scope, ScopeRule::Principal)
    }

    /// Whether the request is guarded at all: a guarded method, and not gRPC unless
    /// gRPC is guarded too.
    pub(crate) fn guards(&self, parts: &Parts) -> bool {
        let c = &self.config;
        c.methods.contains(&parts.method) && (c.guard_grpc || !blocks::is_grpc(&parts.headers))
    }

    /// A slot of the in-flight bound for a request of `scope` (none: a request without
    /// a key), within the scope's fair share; `None` when the bound is full or the scope
    /// holds its share.
    pub(crate) fn slot(&self, scope: Option<&Scope>) -> Option<Slot> {
        let slots = &self.shared.slots;
        let share = self
            .config
            .max_in_flight_per_scope
            .unwrap_or_else(|| slots::default_share(slots.bound()));
        slots.acquire(scope, share)
    }

    /// The request's key (see [`blocks::idempotency_key`]).
    pub(crate) fn key(&self, headers: &HeaderMap) -> Result<Option<IdempotencyKey>, Problem> {
        blocks::idempotency_key(headers, &self.config.convention, self.config.require_key)
    }

    /// The request's scope by the configured rule; `None` refuses to guard.
    pub(crate) fn scope(&self, parts: &Parts) -> Option<Scope> {
        match &self.config.scope {
            ScopeRule::Principal => parts.extensions.get::<Principal>().map(Scope::from),
            ScopeRule::Global => Some(Scope::global()),
            ScopeRule::AuthorizationHash => parts
                .headers
                .get(AUTHORIZATION)
                .map(|v| Scope::from_authorization(v.as_bytes())),
            ScopeRule::Custom(f) => f(parts),
        }
    }

    /// The layer's answer of `kind`, with the `retry-after` and `do-not-retry` its case
    /// requires (see [`Policy::problem`]).
    pub fn problem_of<B>(&self, kind: ProblemKind, detail: &'static str) -> Res<B> {
        self.problem(self.config.policy.problem(kind, detail))
    }

    /// The answer to `problem`: the configured responder's (or the default RFC 9457
    /// one), with the `do-not-retry` and `retry-after` headers the problem carries and
    /// the [`Problem`] as a response extension. Every problem answer of the layer (and
    /// of the transactional layer) is written here.
    pub fn problem<B>(&self, problem: Problem) -> Res<B> {
        let config = &self.config;
        let res = match &config.responder {
            Some(f) => f(&problem),
            None => problem.to_response(),
        };
        let (mut parts, body) = res.into_parts();
        if problem.do_not_retry() {
            parts
                .headers
                .insert(config.convention.do_not_retry().clone(), DO_NOT_RETRY_VALUE);
        }
        if let Some(d) = problem.retry_after_hint() {
            parts.headers.insert(
                config.convention.retry_after().clone(),
                encode_retry_after(d),
            );
        }
        parts.extensions.insert(problem);
        Response::from_parts(parts, ResponseBody::full(body, None))
    }

    /// Reports `kind` for `record` (`None` before the key and scope are known): a
    /// `tracing` event, and the `on_event` hook.
    pub fn emit(&self, kind: EventKind, record: Option<&RecordId>) {
        let name = &self.config.name;
        tracing::debug!(
            target: "retrysafe::idempotency",
            name = name.as_str(),
            event = kind.as_str(),
            record = ?record,
        );
        if let Some(f) = &self.config.on_event {
            f(&IdempotencyEvent::new(kind, record.copied(), name.clone()));
        }
    }

    /// Counts a guarded request's `decision` and records it on its `span`.
    pub fn decided(&self, decision: Decision, span: &Span) {
        self.config.metrics().decided(decision);
        span.record("decision", decision.as_str());
    }

    /// Counts a record that became `outcome_unknown` for `reason`.
    pub fn became_unknown(&self, reason: UnknownReason) {
        self.config.metrics().unknown(reason);
    }

    /// The layer's name.
    pub fn name(&self) -> &Name {
        &self.config.name
    }

    /// The `retrysafe.idempotency` span of a guarded request of `scope` with `key`.
    pub(crate) fn span(&self, scope: &Scope, key: &IdempotencyKey) -> Span {
        observe::request_span(&self.config.name, scope, key)
    }

    /// Reports a guarded request refused before any claim (`Invalid`, or `Unavailable`
    /// for the layer's bound), with its record when its key and scope are known.
    pub(crate) fn refused(
        &self,
        decision: Decision,
        request: Option<(&Scope, &IdempotencyKey)>,
        span: &Span,
    ) {
        self.decided(decision, span);
        let kind = if decision == Decision::Unavailable {
            EventKind::Unavailable
        } else {
            EventKind::Invalid
        };
        let record = request.map(|(scope, key)| RecordId::new(scope, key));
        self.emit(kind, record.as_ref());
    }

    /// A store round trip of `op` for the request counted by `trips` is done.
    pub fn round_trip(&self, trips: &mut RoundTrips, op: StoreOp, started: Option<Instant>) {
        trips.done(self.config.metrics(), op, started);
    }

    /// The store round trips of a request with `span`, counted and timed as its span
    /// and the metrics need.
    pub fn round_trips(&self, span: Span) -> RoundTrips {
        RoundTrips::new(span, self.config.metrics())
    }

    /// The protocol's settings for this layer.
    pub fn policy(&self) -> &Policy {
        &self.config.policy
    }

    /// The replay of a stored response, marked `idempotent-replayed: true`.
    pub fn replay<B>(&self, stored: &StoredResponse) -> Res<B> {
        blocks::replay_response(&self.config.convention, stored)
    }

    /// [`replay`](Self::replay) of a response the caller owns: moved, not copied.
    pub(crate) fn replay_owned<B>(&self, stored: StoredResponse) -> Res<B> {
        blocks::replay_owned(&self.config.convention, stored)
    }

    /// Collects a handler's response to store it: the body up to the storable limit
    /// and until `until` (see [`blocks::capture_response_body`]); the stored form keeps
    /// the headers the filter lets through. `None` when the body failed, or panicked,
    /// while it was collected.
    pub async fn capture<B>(&self, response: Response<B>, until: Instant) -> Option<Captured<B>>
    where
        B: Body<Data = Bytes>,
    {
        let config = &self.config;
        let (head, body) = response.into_parts();
        let captured = AssertUnwindSafe(blocks::capture_response_body(
            body,
            config.max_stored_response,
            until,
        ))
        .catch_unwind()
        .await
        .unwrap_or(CapturedBody::Failed);
        match captured {
            CapturedBody::Whole { data, trailers } => Some(Captured {
                stored: Some(StoredResponse::capture(
                    head.status,
                    &head.headers,
                    data.clone(),
                    trailers.as_ref(),
                    &config.header_filter,
                )),
                response: Response::from_parts(head, ResponseBody::full(data, trailers)),
            }),
            CapturedBody::TooLarge(rest) => Some(Captured {
                stored: None,
                response: Response::from_parts(head, rest),
            }),
            CapturedBody::Failed => None,
        }
    }
}

/// A handler's response as [`Guard::capture`] collected it.
#[derive(Debug)]
pub struct Captured<B> {
    /// The response as it is stored; `None` when it was too large (or too slow) to
    /// store, in which case [`response`](Self::response) streams the rest of the body.
    pub stored: Option<StoredResponse>,
    /// The response to send.
    pub response: Res<B>,
}

/// A guarded request with a key, buffered and fingerprinted, as a [`Backend`] gets it.
#[derive(Debug)]
#[non_exhaustive]
pub struct GuardedRequest {
    /// The request head.
    pub parts: Parts,
    /// The buffered body.
    pub body: Bytes,
    /// The idempotency key.
    pub key: IdempotencyKey,
    /// The scope.
    pub scope: Scope,
    /// The fingerprint of method, path, query, the configured headers and the body.
    pub fingerprint: Fingerprint,
    /// The request's `retrysafe.idempotency` span (disabled unless a subscriber wants
    /// it).
    pub span: Span,
}

impl GuardedRequest {
    /// The record key: scope and idempotency key.
    pub fn record_id(&self) -> RecordId {
        RecordId::new(&self.scope, &self.key)
    }

    /// The request's [`Deadline`], if it has one.
    pub fn deadline(&self) -> Option<Deadline> {
        self.parts.extensions.get::<Deadline>().copied()
    }

    /// The request for the inner service, and the call context to scope its call with:
    /// the inherited [`CallContext`] now carrying the record's [`IdempotencyContext`]
    /// (made by `ctx` from scope and key), so outbound client layers derive child keys
    /// from the record. Both are request extensions too.
    pub fn into_request<B>(
        self: Box<Self>,
        ctx: impl FnOnce(Scope, IdempotencyKey) -> IdempotencyContext,
    ) -> (Request<RequestBody<B>>, CallContext) {
        let GuardedRequest {
            mut parts,
            body,
            key,
            scope,
            ..
        } = *self;
        let ctx = ctx(scope, key);
        let context = CallContext::inherited(&parts.extensions)
            .unwrap_or_default()
            .with_idempotency(ctx.clone());
        parts.extensions.insert(ctx);
        parts.extensions.insert(context.clone());
        (
            Request::from_parts(parts, RequestBody::buffered(body)),
            context,
        )
    }
}

/// The inner service of a guarded request, as a [`Backend`] gets it: called once, with
/// the request it is to run. (The layer's service passes its inner service wrapped in
/// one; backends only call it.)
pub trait Handler: Send + 'static {
    /// The body of the requests the layer receives (the service gets it as a
    /// [`RequestBody`]).
    type ReqBody: Body<Data = Bytes> + Send + 'static;
    /// The body of the service's responses.
    type ResBody: Body<Data = Bytes> + Send + 'static;
    /// The service's error.
    type Error: Send + 'static;

    /// Calls the service with `request`.
    fn call(
        self,
        request: Request<RequestBody<Self::ReqBody>>,
    ) -> impl Future<Output = Result<Response<Self::ResBody>, Self::Error>> + Send + 'static;
}

/// What a [`Backend`] answers for handler `H`: the layer's response, or the service's
/// error.
pub type Answer<H> = Result<Response<ResponseBody<<H as Handler>::ResBody>>, <H as Handler>::Error>;

/// A service `S` taking requests with bodies `B`, as a [`Handler`].
pub(crate) struct Inner<S, B> {
    service: S,
    body: PhantomData<fn(B)>,
}

impl<S, B> Inner<S, B> {
    pub(crate) fn new(service: S) -> Self {
        Inner {
            service,
            body: PhantomData,
        }
    }
}

impl<S, B, ResB> Handler for Inner<S, B>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
{
    type ReqBody = B;
    type ResBody = ResB;
    type Error = S::Error;

    fn call(
        mut self,
        request: Request<RequestBody<B>>,
    ) -> impl Future<Output = Result<Response<ResB>, S::Error>> + Send + 'static {
        self.service.call(request)
    }
}

/// What runs the guarded part of a request for an
/// [`IdempotencyLayer`](super::IdempotencyLayer): the layer's service
/// ([`IdempotencyService`](super::IdempotencyService)) does the rest — the methods, the key, the scope,
/// the body limit and the fingerprint, the bound of requests in flight and the tracked
/// task that calls the backend (polled in place, spawned if the response future is
/// dropped first), so that dropping the response future cancels nothing.
///
/// [`StoreBackend`](super::StoreBackend) runs the claim, handler and completion over an
/// [`IdempotencyStore`](retrysafe_core::store::IdempotencyStore); the transactional
/// layer of `retrysafe-postgres` runs the request in a PostgreSQL transaction that
/// also writes its key.
pub trait Backend: fmt::Debug + Send + Sync + 'static {
    /// Whether a request on a guarded method without a key is run by the backend (as
    /// [`Guarded::Unkeyed`], in the same detachable task, bounded like the others)
    /// instead of passing to the service untouched.
    const GUARDS_UNKEYED: bool = false;

    /// Whether the backend undoes a failed handler's effects (its transaction rolls
    /// back): a `handler-panicked` answer is then not marked `do-not-retry`.
    const ROLLS_BACK: bool = false;

    /// The settings of the backend that its setters refused, reported by the layer's
    /// `build`.
    fn refused(&self) -> Option<&ConfigError> {
        None
    }

    /// The settings of the backend that are refused together (each is fine alone),
    /// reported by the layer's `build`.
    fn conflicts(&self) -> Option<ConfigError> {
        None
    }

    /// Runs a guarded request: claims its key (or answers from the record found),
    /// calls the handler, and records what became of the call.
    fn run<H: Handler>(&self, call: Call<'_, H>) -> impl Future<Output = Answer<H>> + Send;
}

/// One request for a [`Backend`] to run.
#[derive(Debug)]
#[non_exhaustive]
pub struct Call<'a, H: Handler> {
    /// The layer's rules.
    pub guard: &'a Guard,
    /// The inner service.
    pub handler: H,
    /// The request.
    pub request: Guarded<H::ReqBody>,
}

/// A request a [`Backend`] runs.
#[derive(Debug)]
///
/// Boxed either way: the request is handed down through several futures, and each
/// would hold (and move) it whole.
pub enum Guarded<B> {
    /// With a key.
    Keyed(Box<GuardedRequest>),
    /// Without one, for a backend that [guards those](Backend::GUARDS_UNKEYED).
    Unkeyed(Box<Request<RequestBody<B>>>),
}

impl<H: Handler> Call<'_, H> {
    /// Calls the handler with `request` as it is: the request is not guarded.
    pub async fn unguarded(handler: H, request: Request<RequestBody<H::ReqBody>>) -> Answer<H> {
        Ok(handler.call(request).await?.map(ResponseBody::stream))
    }
}
