//! Middleware that enforces a retry budget on every attempt marked as a retry, whoever
//! made it.
//!
//! A [`RetryLayer`](crate::retry::RetryLayer) charges its own retries to its strategy's
//! budget and tags its attempts with a request extension (which travels through a
//! `Buffer` or a spawn); a [`RetryBudgetLayer`] below it that holds the same budget skips
//! those. Every other request that passes it counts: a first attempt deposits once, and
//! a request marked as a retry — by a `retry-attempt` header of 2 or more, as sent by
//! code that is not ours or by a caller on another host — withdraws one retry, or is
//! refused:
//!
//! - on a client ([`RetryBudgetLayer::new`]): the error [`BudgetExhausted`] (for gRPC, a
//!   [`GrpcStatusLayer`](crate::answer::GrpcStatusLayer) above the stack turns it into a
//!   synthesised `UNAVAILABLE`);
//! - on a server's inbound path ([`RetryBudgetLayer::server`]): a 503 problem+json (or
//!   gRPC `UNAVAILABLE`) with `do-not-retry: 1`, so callers' retries cannot overload it.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use http::{HeaderMap, HeaderName, Request, Response};
//! use retrysafe::budget::RatioConfig;
//! use retrysafe::RetryBudget;
//! use retrysafe::error::BudgetExhausted;
//! use retrysafe::RetryBudgetLayer;
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! // A budget with no floor and no deposits yet: no retry is affordable.
//! let budget = RetryBudget::ratio_with(RatioConfig::default().with_min_per_sec(0));
//! let svc = ServiceBuilder::new()
//!     .layer(RetryBudgetLayer::new(budget))
//!     .service(tower::service_fn(|_req: Request<()>| async {
//!         Ok::<_, std::convert::Infallible>(Response::new(()))
//!     }));
//!
//! let retry = Request::get("/").header("retry-attempt", "2").body(()).unwrap();
//! let err = svc.oneshot(retry).await.unwrap_err();
//! assert!(err.is::<BudgetExhausted>());
//! # }
//! ```

pub use retrysafe_core::budget::{
    BudgetRefusal, BudgetSnapshot, RatioConfig, RetryBudget, RetryCost, TokenBucketConfig,
};
pub use retrysafe_core::error::BudgetExhausted;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::{HeaderMap, HeaderName, Request, Response};
use pin_project_lite::pin_project;
use retrysafe_core::__private::{RetryCharged, is_grpc};
use retrysafe_core::wire::{Convention, parse_retry_attempt};
use tower_layer::Layer;
use tower_service::Service;

use crate::BoxError;
use crate::answer::{LocalBody, problem};

#[derive(Debug)]
struct Config {
    budget: RetryBudget,
    convention: Convention,
}

/// Enforces a [`RetryBudget`] on attempts marked as retries; see the [module
/// docs](self).
///
/// Its refusals are the budget's: they carry the budget's name
/// ([`RetryBudget::with_name`]), count in `retrysafe_budget_refusals_total` and call
/// the budget's [`on_refusal`](RetryBudget::with_on_refusal) hook.
#[must_use]
pub struct RetryBudgetLayer {
    config: Arc<Config>,
}

impl RetryBudgetLayer {
    /// A client-side layer charging `budget` (refusals are [`BudgetExhausted`] errors).
    pub fn new(budget: RetryBudget) -> Self {
        RetryBudgetLayer {
            config: Arc::new(Config {
                budget,
                convention: Convention::default(),
            }),
        }
    }
}

impl RetryBudgetLayer {
    /// The header names.
    pub fn convention(self, convention: Convention) -> Self {
        RetryBudgetLayer {
            config: Arc::new(Config {
                budget: self.config.budget.clone(),
                convention,
            }),
        }
    }

    /// For a server's inbound path: refusals are 503 problem+json responses (gRPC:
    /// `UNAVAILABLE`) with `do-not-retry: 1`; see [`ServerRetryBudgetLayer`].
    pub fn server(self) -> ServerRetryBudgetLayer {
        ServerRetryBudgetLayer {
            config: self.config,
        }
    }
}

/// The server form of the [`RetryBudgetLayer`], made by [`RetryBudgetLayer::server`]:
/// enforces the budget on a server's inbound path, answering refusals with a 503
/// problem+json (gRPC: `UNAVAILABLE`) marked `do-not-retry: 1`.
#[derive(Clone)]
#[must_use]
pub struct ServerRetryBudgetLayer {
    config: Arc<Config>,
}

impl ServerRetryBudgetLayer {
    /// The header names.
    pub fn convention(self, convention: Convention) -> Self {
        ServerRetryBudgetLayer {
            config: Arc::new(Config {
                budget: self.config.budget.clone(),
                convention,
            }),
        }
    }
}

impl fmt::Debug for ServerRetryBudgetLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerRetryBudgetLayer")
            .field("config", &self.config)
            .finish()
    }
}

impl Clone for RetryBudgetLayer {
    fn clone(&self) -> Self {
        RetryBudgetLayer {
            config: self.config.clone(),
        }
    }
}

impl fmt::Debug for RetryBudgetLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBudgetLayer")
            .field("config", &self.config)
            .finish()
    }
}

impl<S> Layer<S> for RetryBudgetLayer {
    type Service = RetryBudgetService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        self.config.budget.resolve_metrics();
        RetryBudgetService::new(inner, &self.config)
    }
}

impl<S> Layer<S> for ServerRetryBudgetLayer {
    type Service = ServerRetryBudgetService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ServerRetryBudgetService {
            inner,
            config: self.config.clone(),
        }
    }
}

/// Charges `config`'s budget for `request` unless a `RetryLayer` already did: `None`
/// when admitted, `Some(grpc)` when refused.
fn refuse<B>(config: &Config, request: &Request<B>) -> Option<bool> {
    if RetryCharged::covers(&config.budget, request.extensions()) {
        return None;
    }
    let admitted = charge(
        &config.budget,
        config.convention.retry_attempt(),
        request.headers(),
    );
    (!admitted).then(|| is_grpc(request.headers()))
}

/// Charges `budget` for an attempt with `headers`, as the budget layer does: a deposit
/// for a first attempt, a withdrawal for a retry (`retry_attempt` 2 or more). Whether
/// the attempt is admitted.
pub(crate) fn charge(
    budget: &RetryBudget,
    retry_attempt: &HeaderName,
    headers: &HeaderMap,
) -> bool {
    let retry = headers
        .get(retry_attempt)
        .and_then(|v| parse_retry_attempt(v.as_bytes()))
        .is_some_and(|n| n >= 2);
    if !retry {
        budget.deposit();
        true
    } else if budget.withdraw(RetryCost::Failure) {
        true
    } else {
        tracing::debug!(name = %budget.name(), "retry refused by the budget");
        tracing::Span::current().record("budget", "refused");
        false
    }
}

/// The service of a client-side [`RetryBudgetLayer`]: a refusal is a local failure, the
/// error [`BudgetExhausted`].
#[derive(Clone, Debug)]
pub struct RetryBudgetService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> RetryBudgetService<S> {
    fn new(inner: S, config: &Arc<Config>) -> Self {
        RetryBudgetService {
            inner,
            config: config.clone(),
        }
    }

    define_inner_service_accessors!();
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for RetryBudgetService<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        let kind = match refuse(&self.config, &request) {
            None => Kind::Inner {
                future: self.inner.call(request),
            },
            Some(grpc) => Kind::Refused {
                grpc,
                config: self.config.clone(),
            },
        };
        ResponseFuture { kind }
    }
}

pin_project! {
    /// The response future of [`RetryBudgetService`].
    pub struct ResponseFuture<F> {
        #[pin]
        kind: Kind<F>,
        }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F> {
        Inner { #[pin] future: F },
        // The layer's config (an `Arc`: the future stays small), for its convention.
        Refused { grpc: bool, config: Arc<Config> },
        // Answered: a poll after completion is `Pending` (the inner future is gone).
        Done,
    }
}

impl<F, ResB, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<ResB>, E>>,
    E: Into<BoxError>,
{
    type Output = Result<Response<ResB>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut kind = self.project().kind;
        let output = match kind.as_mut().project() {
            KindProj::Inner { future } => ready!(future.poll(cx)).map_err(Into::into),
            KindProj::Refused { .. } => Err(Box::new(BudgetExhausted::new()) as BoxError),
            KindProj::Done => return Poll::Pending,
        };
        kind.set(Kind::Done);
        Poll::Ready(output)
    }
}

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

/// The service of a [`ServerRetryBudgetLayer`] ([`RetryBudgetLayer::server`]): a
/// refusal is a 503 problem+json (gRPC: `UNAVAILABLE`) with `do-not-retry: 1`. The inner
/// service's error type is kept and its body wrapped in a [`LocalBody`], so it fits
/// axum's `Router::layer` and `route_layer` (which need `Infallible`) and tonic's
/// `Server::layer` alike.
#[derive(Clone, Debug)]
pub struct ServerRetryBudgetService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> ServerRetryBudgetService<S> {
    define_inner_service_accessors!();
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for ServerRetryBudgetService<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
{
    type Response = Response<LocalBody<ResB>>;
    type Error = S::Error;
    type Future = ServerResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        let kind = match refuse(&self.config, &request) {
            None => Kind::Inner {
                future: self.inner.call(request),
            },
            Some(grpc) => Kind::Refused {
                grpc,
                config: self.config.clone(),
            },
        };
        ServerResponseFuture { kind }
    }
}

pin_project! {
    /// The response future of [`ServerRetryBudgetService`].
    pub struct ServerResponseFuture<F> {
        #[pin]
        kind: Kind<F>,
    }
}

impl<F, ResB, E> Future for ServerResponseFuture<F>
where
    F: Future<Output = Result<Response<ResB>, E>>,
{
    type Output = Result<Response<LocalBody<ResB>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut kind = self.project().kind;
        let output = match kind.as_mut().project() {
            KindProj::Inner { future } => {
                ready!(future.poll(cx)).map(|response| response.map(LocalBody::inner))
            }
            KindProj::Refused { grpc, config } => {
                let answer = problem(*grpc, &BudgetExhausted::new(), &config.convention);
                // A `BudgetExhausted` is answered with a response, always.
                Ok(answer.unwrap_or_else(|| {
                    let mut response = Response::new(LocalBody::default());
                    *response.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
                    response
                }))
            }
            KindProj::Done => return Poll::Pending,
        };
        kind.set(Kind::Done);
        Poll::Ready(output)
    }
}

impl<F> fmt::Debug for ServerResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerResponseFuture")
            .finish_non_exhaustive()
    }
}
