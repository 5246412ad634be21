//! failsafe's futures-aware breaker as a tower `Service` (failsafe ships none):
//! readiness is the inner service's, and `call` wraps the inner future in
//! `CircuitBreaker::call`.

use std::task::{Context, Poll};

use tower::Service;

/// The inner service behind failsafe's `breaker`.
#[derive(Clone, Debug)]
pub struct Failsafe<S, B> {
    /// The service called.
    pub inner: S,
    /// failsafe's breaker.
    pub breaker: B,
}

impl<S, B, R> Service<R> for Failsafe<S, B>
where
    S: Service<R>,
    B: failsafe::futures::CircuitBreaker,
{
    type Response = S::Response;
    type Error = failsafe::Error<S::Error>;
    type Future = failsafe::futures::ResponseFuture<
        S::Future,
        B::FailurePolicy,
        B::Instrument,
        failsafe::Any,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(failsafe::Error::Inner)
    }

    fn call(&mut self, request: R) -> Self::Future {
        self.breaker.call(self.inner.call(request))
    }
}
