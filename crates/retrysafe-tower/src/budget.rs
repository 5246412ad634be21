//! Middleware that enforces a retry budget on every attempt marked as a retry, whoever
//! made it.
//!
//! A [`RetryLayer`](crate::retry::RetryLayer) charges its own retries to its strategy's
//! budget and tags its attempts ([`RetryCharged`]); a [`RetryBudgetLayer`] below it skips
//! those. Every other request that passes it counts: a first attempt deposits once, and
//! a request marked as a retry — by a `retry-attempt` header of 2 or more, as sent by
//! code that is not ours or by a caller on another host — withdraws one retry, or is
//! refused:
//!
//! - on a client ([`RetryBudgetLayer::new`]): the error [`BudgetExhausted`] (or a
//!   synthesised gRPC `UNAVAILABLE` with [`grpc_statuses`](RetryBudgetLayer::grpc_statuses));
//! - on a server's inbound path ([`RetryBudgetLayer::server`]): a 503 problem+json (or
//!   gRPC `UNAVAILABLE`) with `do-not-retry: 1`, so callers' retries cannot overload it.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use http::{Request, Response};
//! use retrysafe_core::budget::{RatioConfig, RetryBudget};
//! use retrysafe_core::error::BudgetExhausted;
//! use retrysafe_tower::budget::RetryBudgetLayer;
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! // A budget with no floor and no deposits yet: no retry is affordable.
//! let mut config = RatioConfig::default();
//! config.min_per_sec = 0;
//! let budget = RetryBudget::ratio_with(config).unwrap();
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

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use pin_project_lite::pin_project;
use retrysafe_core::budget::{RetryBudget, RetryCost};
use retrysafe_core::classify::is_grpc;
use retrysafe_core::error::BudgetExhausted;
use retrysafe_core::strategy::RetryCharged;
use retrysafe_core::wire::{Convention, parse_retry_attempt};
use tower_layer::Layer;
use tower_service::Service;

use crate::local::{AsError, AsGrpcStatus, AsProblem, BoxError, LocalFailure};

#[derive(Debug)]
struct Config {
    budget: RetryBudget,
    convention: Convention,
}

/// Enforces a [`RetryBudget`] on attempts marked as retries; see the [module
/// docs](self).
#[must_use]
pub struct RetryBudgetLayer<M = AsError> {
    config: Arc<Config>,
    _local: PhantomData<fn() -> M>,
}

impl RetryBudgetLayer {
    /// A client-side layer charging `budget` (refusals are [`BudgetExhausted`] errors).
    pub fn new(budget: RetryBudget) -> Self {
        RetryBudgetLayer {
            config: Arc::new(Config {
                budget,
                convention: Convention::default(),
            }),
            _local: PhantomData,
        }
    }
}

impl<M> RetryBudgetLayer<M> {
    /// The header names.
    pub fn convention(self, convention: Convention) -> Self {
        RetryBudgetLayer {
            config: Arc::new(Config {
                budget: self.config.budget.clone(),
                convention,
            }),
            _local: PhantomData,
        }
    }

    /// Refusals of gRPC requests become synthesised `UNAVAILABLE` statuses with
    /// `do-not-retry: 1` (needs a response body with `Default`).
    pub fn grpc_statuses(self) -> RetryBudgetLayer<AsGrpcStatus> {
        RetryBudgetLayer {
            config: self.config,
            _local: PhantomData,
        }
    }

    /// For a server's inbound path: refusals are 503 problem+json responses (gRPC:
    /// `UNAVAILABLE`) with `do-not-retry: 1`.
    pub fn server(self) -> RetryBudgetLayer<AsProblem> {
        RetryBudgetLayer {
            config: self.config,
            _local: PhantomData,
        }
    }
}

impl<M> Clone for RetryBudgetLayer<M> {
    fn clone(&self) -> Self {
        RetryBudgetLayer {
            config: self.config.clone(),
            _local: PhantomData,
        }
    }
}

impl<M> fmt::Debug for RetryBudgetLayer<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBudgetLayer")
            .field("config", &self.config)
            .finish()
    }
}

impl<S, M> Layer<S> for RetryBudgetLayer<M> {
    type Service = EnforceBudget<S, M>;

    fn layer(&self, inner: S) -> Self::Service {
        EnforceBudget {
            inner,
            config: self.config.clone(),
            _local: PhantomData,
        }
    }
}

/// The service of a [`RetryBudgetLayer`].
pub struct EnforceBudget<S, M> {
    inner: S,
    config: Arc<Config>,
    _local: PhantomData<fn() -> M>,
}

impl<S: Clone, M> Clone for EnforceBudget<S, M> {
    fn clone(&self) -> Self {
        EnforceBudget {
            inner: self.inner.clone(),
            config: self.config.clone(),
            _local: PhantomData,
        }
    }
}

impl<S: fmt::Debug, M> fmt::Debug for EnforceBudget<S, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EnforceBudget")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
}

impl<S, M, ReqB, ResB> Service<Request<ReqB>> for EnforceBudget<S, M>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
    M: LocalFailure<ResB>,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, M>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        if !RetryCharged::covers(&self.config.budget, request.extensions()) {
            let config = &self.config;
            let retry = request
                .headers()
                .get(config.convention.retry_attempt())
                .and_then(|v| parse_retry_attempt(v.as_bytes()))
                .is_some_and(|n| n >= 2);
            if !retry {
                config.budget.deposit();
            } else if !config.budget.withdraw(RetryCost::Failure) {
                tracing::debug!("retry refused by the budget");
                return ResponseFuture {
                    kind: Kind::Refused {
                        grpc: is_grpc(request.headers()),
                        convention: Some(config.convention.clone()),
                    },
                    _local: PhantomData,
                };
            }
        }
        ResponseFuture {
            kind: Kind::Inner {
                future: self.inner.call(request),
            },
            _local: PhantomData,
        }
    }
}

pin_project! {
    /// The response future of [`EnforceBudget`].
    pub struct ResponseFuture<F, M> {
        #[pin]
        kind: Kind<F>,
        _local: PhantomData<fn() -> M>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F> {
        Inner { #[pin] future: F },
        Refused { grpc: bool, convention: Option<Convention> },
    }
}

impl<F, M, ResB, E> Future for ResponseFuture<F, M>
where
    F: Future<Output = Result<Response<ResB>, E>>,
    E: Into<BoxError>,
    M: LocalFailure<ResB>,
{
    type Output = Result<Response<ResB>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Inner { future } => future.poll(cx).map_err(Into::into),
            KindProj::Refused { grpc, convention } => {
                let convention = convention.take().unwrap_or_default();
                Poll::Ready(M::answer(
                    *grpc,
                    Box::new(BudgetExhausted::new()),
                    &convention,
                ))
            }
        }
    }
}

impl<F, M> fmt::Debug for ResponseFuture<F, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
