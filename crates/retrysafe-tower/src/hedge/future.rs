use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderValue, Request, Response};
use pin_project_lite::pin_project;
use retrysafe_core::__private::{HedgeCopy, HedgeRace, RetryCharged};
use retrysafe_core::Deadline;
use retrysafe_core::budget::{RetryBudget, RetryCost};
use retrysafe_core::classify::{Classification, Failure, FaultSide, RequestFacts, RetrySafety};
use retrysafe_core::wire::encode_retry_attempt;
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use super::layer::{Config, Counts, HedgeOutcome};
use crate::BoxError;
use crate::retry::{ReplayBody, failure_of};
use retrysafe_core::observe::AttemptNumber;

/// The least time left on the deadline for a hedge to start.
const MIN_HEDGE_TIME: Duration = Duration::from_millis(1);
/// How long to wait again when a hedge is due but the body is still streaming.
const BODY_RECHECK: Duration = Duration::from_millis(1);

type Answer<R> = Result<Response<R>, BoxError>;

/// What a copy of a hedged request is made from.
pub(super) struct Copyable<B> {
    pub(super) template: http::request::Parts,
    pub(super) body: ReplayBody<B>,
    pub(super) facts: RequestFacts,
    pub(super) deadline: Option<Deadline>,
}

pin_project! {
    /// The response future of [`HedgeService`](super::HedgeService).
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<ReplayBody<B>>>,
    {
        // The first copy, until it answers.
        #[pin]
        primary: Option<S::Future>,
        // When the next hedge is due.
        #[pin]
        timer: Option<Sleep>,
        // Only for a request that may be hedged.
        hedging: Option<Box<Hedging<S, B>>>,
    }
}

/// The state of a request that may be hedged.
struct Hedging<S: Service<Request<ReplayBody<B>>>, B> {
    config: Arc<Config>,
    /// A clone of the inner service, for the next hedge.
    service: S,
    request: Copyable<B>,
    delay: Duration,
    started: Instant,
    /// Hedges in flight (boxed: only calls that hedge make them).
    hedges: Vec<Pin<Box<S::Future>>>,
    sent: u32,
    /// A hedge is paid for and waits for the service's readiness.
    readying: bool,
    /// An answer that was not acceptable, kept for when no copy is left, and whether it
    /// was the first copy's (preferred).
    kept: Option<(Result<S::Response, BoxError>, bool)>,
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>>,
{
    /// A call that is not hedged.
    pub(super) fn plain(primary: S::Future) -> Self {
        ResponseFuture {
            primary: Some(primary),
            timer: None,
            hedging: None,
        }
    }

    /// A call that may be hedged, after the configured delay (none when the latency
    /// window has too few samples yet).
    pub(super) fn hedged(
        primary: S::Future,
        service: S,
        request: Copyable<B>,
        config: &Arc<Config>,
    ) -> Self {
        // Without a delay yet (too few latencies known), no hedge, but the latency of
        // the call still counts.
        let delay = config.delay.delay();
        let started = Instant::now();
        ResponseFuture {
            primary: Some(primary),
            timer: delay.map(|delay| tokio::time::sleep_until(started + delay)),
            hedging: Some(Box::new(Hedging {
                config: Arc::clone(config),
                service,
                request,
                delay: delay.unwrap_or_default(),
                started,
                hedges: Vec::new(),
                sent: 0,
                readying: false,
                kept: None,
            })),
        }
    }
}

impl<S, B, R> Future for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>> + Clone,
    S::Error: Into<BoxError>,
{
    type Output = Answer<R>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            if let Some(future) = this.primary.as_mut().as_pin_mut()
                && let Poll::Ready(result) = future.poll(cx)
            {
                this.primary.set(None);
                let result = result.map_err(Into::into);
                let Some(hedging) = this.hedging.as_mut() else {
                    return Poll::Ready(result);
                };
                hedging.record_latency();
                if let Some(answer) = hedging.judge(result, true) {
                    hedging.config.hedges(HedgeOutcome::Lost, hedging.sent);
                    hedging.deposit_unless_made();
                    return Poll::Ready(answer);
                }
            }
            let primary_running = this.primary.is_some();
            let Some(hedging) = this.hedging.as_mut() else {
                return match primary_running {
                    true => Poll::Pending,
                    false => Poll::Ready(Err(polled_after_completion())),
                };
            };
            if let Some(answer) = hedging.poll_hedges(cx, primary_running) {
                hedging.deposit_unless_made();
                return Poll::Ready(answer);
            }
            if !primary_running && hedging.hedges.is_empty() && !hedging.readying {
                hedging.config.hedges(HedgeOutcome::Lost, hedging.sent);
                hedging.deposit_unless_made();
                return Poll::Ready(hedging.give_kept());
            }
            if !hedging.poll_schedule(this.timer.as_mut(), cx) {
                return Poll::Pending;
            }
        }
    }
}

impl<S, B, R> Hedging<S, B>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>> + Clone,
    S::Error: Into<BoxError>,
{
    /// Polls the hedges in flight: the first acceptable answer, if any came.
    fn poll_hedges(&mut self, cx: &mut Context<'_>, primary_running: bool) -> Option<Answer<R>> {
        let mut index = 0;
        while let Some(hedge) = self.hedges.get_mut(index) {
            let Poll::Ready(result) = hedge.as_mut().poll(cx) else {
                index += 1;
                continue;
            };
            drop(self.hedges.swap_remove(index));
            if let Some(answer) = self.judge(result.map_err(Into::into), false) {
                Counts::add(&self.config.counts.won);
                self.config.hedges(HedgeOutcome::Won, 1);
                self.config.hedges(HedgeOutcome::Lost, self.sent - 1);
                if primary_running {
                    // The first copy is cancelled: its latency is at least this.
                    self.record_latency();
                }
                return Some(answer);
            }
        }
        None
    }

    /// `Some(answer)` when `result` is acceptable (an answer a retry layer would not
    /// retry); otherwise keeps it, the first copy's in preference.
    fn judge(&mut self, result: Answer<R>, primary: bool) -> Option<Answer<R>> {
        let facts = &self.request.facts;
        let classifier = &self.config.classifier;
        let classification = match &result {
            Ok(response) => {
                classifier.classify_response(response.status(), response.headers(), facts)
            }
            // A hedge refused by a layer below (its breaker, a budget) never happened: it
            // does not end the call.
            Err(error) => match failure_of(&**error) {
                Failure::Local if !primary => {
                    Classification::failure(RetrySafety::Maybe, FaultSide::Dependency)
                }
                failure => classifier.classify_failure(failure, facts),
            },
        };
        if !classification.is_retryable(facts) {
            self.settle();
            return Some(result);
        }
        if primary || self.kept.as_ref().is_none_or(|(_, p)| !p) {
            self.kept = Some((result, primary));
        }
        None
    }

    /// Every copy answered, none acceptably: the first copy's answer, or the latest.
    fn give_kept(&mut self) -> Answer<R> {
        self.kept
            .take()
            .map_or_else(|| Err(polled_after_completion()), |(answer, _)| answer)
    }

    /// An answer won: the copies still in flight are cancelled by the hedge, not by the
    /// caller (their breakers count them as nothing).
    fn settle(&self) {
        if let Some(race) = self.request.template.extensions.get::<HedgeRace>() {
            race.settle();
        }
    }

    /// Adds the time since the call started to the latency window.
    fn record_latency(&self) {
        self.config.delay.record(self.started.elapsed());
    }

    /// Sends the next hedge when it is due, the service is ready and the budget pays
    /// for it; `true` when something changed that the caller must look at again (a
    /// hedge sent, the timer set again, or a hedge that waited for readiness given up
    /// while no copy may be left).
    fn poll_schedule(&mut self, mut timer: Pin<&mut Option<Sleep>>, cx: &mut Context<'_>) -> bool {
        if !self.readying {
            let Some(sleep) = timer.as_mut().as_pin_mut() else {
                return false;
            };
            if sleep.poll(cx).is_pending() {
                return false;
            }
            match self.hedge_due() {
                Due::Now => self.readying = true,
                Due::Later(at) => {
                    timer.set(Some(tokio::time::sleep_until(at)));
                    return true;
                }
                Due::Never => {
                    timer.set(None);
                    return false;
                }
            }
        }
        let ready = self.service.poll_ready(cx);
        if ready.is_pending() {
            return false;
        }
        self.readying = false;
        // Paid for only once it can leave: a hedge that waited for readiness while
        // another copy answered costs nothing.
        if matches!(ready, Poll::Ready(Err(_))) || !self.pay() {
            // No hedge through a failed service, nor past the budget or the deadline;
            // the copies in flight go on.
            timer.set(None);
            return true;
        }
        self.send_hedge();
        match self.sent < self.config.max_hedges {
            true => timer.set(Some(tokio::time::sleep_until(Instant::now() + self.delay))),
            false => timer.set(None),
        }
        true
    }

    /// The timer fired: whether a hedge may be sent now (once the service is ready).
    fn hedge_due(&mut self) -> Due {
        if self.sent >= self.config.max_hedges {
            return Due::Never;
        }
        if !self.request.body.is_buffered() {
            if self.request.body.is_replayable() {
                return Due::Later(Instant::now() + BODY_RECHECK);
            }
            return Due::Never;
        }
        if !self.time_left() {
            return Due::Never;
        }
        Due::Now
    }

    /// Whether the deadline leaves time for a hedge.
    fn time_left(&self) -> bool {
        self.request
            .deadline
            .is_none_or(|d| d.remaining() >= MIN_HEDGE_TIME + MIN_HEDGE_TIME)
    }

    /// Pays for the hedge about to be sent: `false` when the deadline has come too
    /// close meanwhile or the budget refuses it (a refusal is counted).
    fn pay(&mut self) -> bool {
        if !self.time_left() {
            return false;
        }
        // The request's own deposit comes first, when no layer below made it.
        self.deposit_unless_made();
        if !self.budget().withdraw(RetryCost::Failure) {
            Counts::add(&self.config.counts.refused);
            self.config.hedges(HedgeOutcome::Refused, 1);
            tracing::debug!(name = %self.config.name, "hedge refused by the retry budget");
            return false;
        }
        true
    }

    /// Makes the request's one deposit into the budget unless a retrying layer below
    /// (or this one, earlier) made it: a hedging layer on its own funds its hedges
    /// with the requests it may hedge, as a retrying layer does its retries.
    fn deposit_unless_made(&self) {
        if let Some(race) = self.request.template.extensions.get::<HedgeRace>()
            && race.claim_deposit()
        {
            self.budget().deposit();
        }
    }

    /// The budget of the request (the layer's, unless the request brought one).
    fn budget(&self) -> &RetryBudget {
        self.request
            .template
            .extensions
            .get::<RetryBudget>()
            .unwrap_or(&self.config.budget)
    }

    /// Sends one more copy on the ready service.
    fn send_hedge(&mut self) {
        self.readying = false;
        self.sent += 1;
        let attempt = self.sent + 1;
        let budget = self.budget().id();
        let convention = &self.config.convention;
        let mut parts = self.request.template.clone();
        parts.headers.insert(
            convention.retry_attempt().clone(),
            encode_retry_attempt(attempt),
        );
        if self.request.facts.grpc {
            parts.headers.insert(
                convention.grpc_previous_rpc_attempts().clone(),
                HeaderValue::from(attempt - 1),
            );
        }
        parts.extensions.insert(HedgeCopy::new(Some(budget)));
        parts.extensions.insert(AttemptNumber::new(attempt));
        parts.extensions.insert(RetryCharged::new(attempt, budget));
        let clone = self.service.clone();
        let mut service = std::mem::replace(&mut self.service, clone);
        let request = Request::from_parts(parts, self.request.body.clone());
        self.hedges.push(Box::pin(service.call(request)));
        Counts::add(&self.config.counts.sent);
        tracing::debug!(name = %self.config.name, attempt, "hedge sent");
    }
}

/// What the hedge timer's firing leads to.
enum Due {
    /// Send once the service is ready (and the budget pays).
    Now,
    /// Not yet (the body is still streaming): look again then.
    Later(Instant),
    /// No more hedges for this call.
    Never,
}

fn polled_after_completion() -> BoxError {
    "hedge future polled after completion".into()
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("hedging", &self.hedging.is_some())
            .finish_non_exhaustive()
    }
}
