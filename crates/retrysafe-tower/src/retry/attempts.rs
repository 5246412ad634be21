//! How the retry future makes each attempt: by calling a service, or — in the fused
//! client stack — through a breaker that is handed what the planner already knows.

use std::future::Future;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Request;
use tokio::time::Instant;
use tower_service::Service;

use super::body::ReplayBody;

/// What the retry future knows of an attempt as it sends it, for whoever makes it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sent {
    /// The clock reading the attempt's timeout header was computed from, if the clock
    /// was read for it (there is a deadline).
    pub(crate) at: Option<Instant>,
    /// The time the attempt's timeout header was written from, if it has one.
    pub(crate) timeout: Option<Duration>,
    /// A gRPC request.
    pub(crate) grpc: bool,
}

/// The maker of a retry future's attempts.
pub(crate) trait Attempts<B> {
    /// The response of an attempt.
    type Response;
    /// The error of an attempt.
    type Error;
    /// An attempt under way.
    type Future: Future<Output = Result<Self::Response, Self::Error>>;

    /// Whether the next attempt can be made (awaited before every retry).
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>>;

    /// Makes the attempt of `request`, described by `sent`.
    fn attempt(&mut self, request: Request<ReplayBody<B>>, sent: Sent) -> Self::Future;
}

/// Attempts made by calling a service (the [`RetryLayer`](super::RetryLayer)'s).
#[derive(Clone, Debug)]
pub(crate) struct Plain<S>(pub(crate) S);

impl<S, B> Attempts<B> for Plain<S>
where
    S: Service<Request<ReplayBody<B>>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn attempt(&mut self, request: Request<ReplayBody<B>>, _: Sent) -> Self::Future {
        self.0.call(request)
    }
}
