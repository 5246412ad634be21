//! The service: decides in `call`.

use std::task::{Context, Poll};

use http::{Request, Response};
use retrysafe_core::__private::{BreakerFacts, HedgeRace, Striped};
use retrysafe_core::breaker::CircuitBreaker;
use retrysafe_core::error::CircuitOpen;
use tower_service::Service;

use super::body::ResponseBody;
use super::future::{Call, ResponseFuture};
use super::layer::{Breakers, Config};
use crate::BoxError;

/// The service of a [`CircuitBreakerLayer`](super::CircuitBreakerLayer).
///
/// [`poll_ready`](Service::poll_ready) is always ready and never polls the inner
/// service: [`call`](Service::call) asks the breaker, answers a refusal at once, and
/// otherwise calls a clone of the inner service at once when that is ready (polled with
/// a no-op waker), or returns a future that drives its readiness before calling it.
/// Hence `S: Clone` (wrap a service that is not in a `tower::buffer::Buffer`).
#[derive(Clone, Debug)]
pub struct CircuitBreakerService<S> {
    inner: S,
    config: Striped<Config>,
}

impl<S> CircuitBreakerService<S> {
    pub(crate) fn from_config(inner: S, config: Striped<Config>) -> Self {
        CircuitBreakerService { inner, config }
    }

    define_inner_service_accessors!();
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for CircuitBreakerService<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = BoxError;
    type Future = ResponseFuture<S, ReqB>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The breaker decides in `call`: polling the inner service here would make
        // callers wait on a downstream the breaker may be about to refuse.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        let config = &self.config;
        let timed = |b: &CircuitBreaker| b.config().slow_call_duration().is_some();
        // A breaker in the request's extensions overrides the layer's (per request).
        let chosen = request.extensions().get::<CircuitBreaker>();
        let (acquired, timed, request) = match (chosen, &config.breakers) {
            (Some(breaker), _) | (None, Breakers::One(breaker)) => {
                (breaker.try_acquire(), timed(breaker), request)
            }
            (None, Breakers::Keyed(select)) => {
                let (parts, body) = request.into_parts();
                let breaker = select.select(&parts);
                let request = Request::from_parts(parts, body);
                (breaker.try_acquire(), timed(&breaker), request)
            }
        };
        match acquired {
            Ok(mut permit) => {
                if let Some(race) = request.extensions().get::<HedgeRace>() {
                    permit.in_race(race.clone());
                }
                let facts = BreakerFacts::of(request.headers(), &config.convention);
                // A clone per call: this service keeps an instance never polled, so that
                // no call is made on one that failed its readiness.
                ResponseFuture::admitted(
                    &mut self.inner.clone(),
                    request,
                    Call::new(permit, facts, config.local(), timed),
                    None,
                    || self.inner.clone(),
                )
            }
            Err(open) => refused(open),
        }
    }
}

/// A refusal: logged, answered at once.
pub(crate) fn refused<S, ReqB>(open: CircuitOpen) -> ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    tracing::debug!(
        retry_in_ms = u64::try_from(open.retry_in().as_millis()).unwrap_or(u64::MAX),
        "request refused: circuit open"
    );
    ResponseFuture::refused(open)
}
