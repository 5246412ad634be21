//! The fused client stack's way through the breaker (see [`Guarded`]).

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use http::{HeaderName, Request, Response};
use retrysafe_core::__private::{BreakerFacts, HedgeRace, Local, Striped};
use retrysafe_core::breaker::CircuitBreaker;
use retrysafe_core::budget::RetryBudget;
use retrysafe_core::error::BudgetExhausted;
use retrysafe_core::wire::Convention;
use tower_service::Service;

use super::body::ResponseBody;
use super::future::{Call, ResponseFuture};
use super::layer::{Breakers, Config};
use super::service::refused;
use crate::BoxError;
use crate::retry::{Attempts, ReplayBody, Sent};

/// The fused client stack's attempts through the breaker: the breaker is chosen once per
/// call, and each attempt hands it what the retry planner knows already (gRPC or not, the
/// timeout its header carries, the clock reading it was computed from) instead of the
/// breaker reading the attempt's headers and the clock again.
pub(crate) struct Guarded<S> {
    /// The transport to clone for each attempt but a plain call's first (which the
    /// stack's service makes on its own instance, so a call that is not retried clones
    /// nothing; every copy of a hedged request clones): a copy shared with that service
    /// and never polled, behind a lock so that a transport that is `Send` but not `Sync`
    /// keeps the future `Send` (locked only to clone).
    transport: Transport<S>,
    config: Local<Config>,
    /// The breaker of the call: the request's own, the layer's one, or its key's.
    breaker: CircuitBreaker,
    timed: bool,
    /// The breaker reads timeout headers by the names the planner writes them with:
    /// the planner's word is as good as a parse.
    same_names: bool,
    /// The stack's budget and the planner's `retry-attempt` header name, when the
    /// request carries a budget of its own: the planner charges that one, and each
    /// attempt is charged to the stack's too, as a budget layer below the retry layer
    /// charges attempts counted in another budget (boxed: the rare case).
    besides: Option<Box<(RetryBudget, HeaderName)>>,
}

/// The transport of a fused stack, shared by its service and its calls' futures.
pub(crate) type Transport<S> = Arc<Mutex<S>>;

/// The budget a fused stack's attempts go through, as a budget layer below the retry
/// would: the stack's, and the `retry-attempt` header name that marks a retry.
#[derive(Clone, Copy)]
pub(crate) struct StackBudget<'a> {
    pub(crate) budget: &'a RetryBudget,
    pub(crate) retry_attempt: &'a HeaderName,
}

impl<S> Guarded<S> {
    /// Whether a breaker of `config` reads timeout headers by the names the planner
    /// writes them with (`names`): checked once per service, not per call.
    pub(crate) fn same_names(config: &Config, names: &Convention) -> bool {
        config.convention.same_timeout_names(names)
    }

    /// The attempts of one call of the request with head `parts` on `transport`, guarded by
    /// the breakers of `config`; `same_names` as [`same_names`](Self::same_names) says.
    /// With `stack`, a request that carries a budget other than the stack's has each
    /// attempt charged to the stack's as well (the planner charges the request's).
    pub(crate) fn new(
        transport: &Transport<S>,
        config: &Striped<Config>,
        parts: &http::request::Parts,
        same_names: bool,
        stack: Option<StackBudget<'_>>,
    ) -> Self {
        let breaker = match (parts.extensions.get::<CircuitBreaker>(), &config.breakers) {
            (Some(breaker), _) | (None, Breakers::One(breaker)) => breaker.clone(),
            (None, Breakers::Keyed(select)) => select.select(parts),
        };
        let besides = match (stack, parts.extensions.get::<RetryBudget>()) {
            (Some(stack), Some(own)) if own.id() != stack.budget.id() => Some(Box::new((
                stack.budget.clone(),
                stack.retry_attempt.clone(),
            ))),
            _ => None,
        };
        Guarded {
            besides,
            transport: Arc::clone(transport),
            timed: breaker.config().slow_call_duration().is_some(),
            same_names,
            config: config.local(),
            breaker,
        }
    }
}

impl<S, ReqB, ResB> Attempts<ReqB> for Guarded<S>
where
    S: Service<Request<ReplayBody<ReqB>>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = BoxError;
    type Future = ResponseFuture<S, ReplayBody<ReqB>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // As the breaker service: readiness is awaited in the attempt, once admitted.
        Poll::Ready(Ok(()))
    }

    /// An attempt on a clone of the transport (a retry, or a hedge's copy).
    fn attempt(&mut self, request: Request<ReplayBody<ReqB>>, sent: Sent) -> Self::Future {
        let mut service = self.fresh();
        self.attempt_on(&mut service, request, sent)
    }
}

impl<S: Clone> Guarded<S> {
    /// A clone of the shared transport (never polled).
    fn fresh(&self) -> S {
        clone_of(&self.transport)
    }
}

/// A clone of the shared `transport` (locked only for the clone).
pub(crate) fn clone_of<S: Clone>(transport: &Transport<S>) -> S {
    transport
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
}

impl<S> Guarded<S> {
    /// An attempt on `service` (the stack service's own instance for a call's first
    /// attempt: called in place when it is ready, and replaced by a clone of the shared
    /// transport when it moves into the future or fails its readiness). Inlined into its
    /// two callers: out of line, its request and its future were each copied once more
    /// (counted: + 80 per call).
    #[inline(always)]
    pub(crate) fn attempt_on<ReqB, ResB>(
        &mut self,
        service: &mut S,
        request: Request<ReplayBody<ReqB>>,
        sent: Sent,
    ) -> ResponseFuture<S, ReplayBody<ReqB>>
    where
        S: Service<Request<ReplayBody<ReqB>>, Response = Response<ResB>> + Clone,
        S::Error: Into<BoxError>,
    {
        // The stack's budget, as a budget layer above the breaker: a refused retry
        // never reaches the breaker.
        if let Some(besides) = &self.besides {
            let (budget, retry_attempt) = &**besides;
            if !crate::budget::charge(budget, retry_attempt, request.headers()) {
                return ResponseFuture::failed(Box::new(BudgetExhausted::new()));
            }
        }
        match self.breaker.try_acquire() {
            Ok(mut permit) => {
                // A copy of a hedged request: cancelled by the race, it counts as nothing.
                if let Some(race) = request.extensions().get::<HedgeRace>() {
                    permit.in_race(race.clone());
                }
                let facts = if self.same_names {
                    BreakerFacts::sent(sent.grpc, sent.timeout)
                } else {
                    BreakerFacts::of(request.headers(), &self.config.convention)
                };
                let call = Call::new(permit, facts, self.config.clone(), self.timed);
                let transport = &self.transport;
                ResponseFuture::admitted(service, request, call, sent.at, || clone_of(transport))
            }
            Err(open) => refused(open),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for Guarded<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guarded")
            .field("transport", &self.transport)
            .field("breaker", &self.breaker)
            .finish_non_exhaustive()
    }
}
