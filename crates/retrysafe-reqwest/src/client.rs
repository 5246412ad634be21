//! Middleware in the standard client order, given in one call: [`ClientMiddlewares`].
//!
//! The reqwest twin of the tower `ClientLayers`: the deadline, the retry (which charges
//! the budget, given once) and the breaker in the standard order — `DeadlineMiddleware`
//! → `RetryMiddleware` → `CircuitBreakerMiddleware` → reqwest — fused into one
//! middleware added to a `reqwest_middleware` [`ClientBuilder`]: one hop, one boxed
//! future and one timer per attempt, where the three separate middleware make three of
//! each. Breakers per host come from [`per_authority`](ClientMiddlewares::per_authority).
//!
//! One difference from the separate middleware: the deadline is handed to the retry
//! directly, not put in the reqwest-middleware extensions, so a middleware added after
//! these does not find a [`Deadline`](retrysafe_core::Deadline) there; every attempt
//! carries the time left in `request-timeout-ms`.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use std::time::Duration;
//! use axum::http::{HeaderMap, StatusCode};
//! use retrysafe::breaker::BreakerConfig;
//! use retrysafe::RetryBudget;
//! use retrysafe::reqwest::ClientMiddlewares;
//!
//! // Busy on the first request; every attempt carries the time left.
//! let hits = Arc::new(AtomicUsize::new(0));
//! let seen = hits.clone();
//! let app = axum::Router::new().route(
//!     "/items",
//!     axum::routing::get(move |headers: HeaderMap| async move {
//!         assert!(headers.contains_key("request-timeout-ms"));
//!         match seen.fetch_add(1, Ordering::SeqCst) {
//!             0 => StatusCode::SERVICE_UNAVAILABLE,
//!             _ => StatusCode::OK,
//!         }
//!     }),
//! );
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
//! let url = format!("http://{}/items", listener.local_addr().unwrap());
//! tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
//!
//! let budget = RetryBudget::ratio();
//! let client = ClientMiddlewares::new()
//!     .deadline(Duration::from_secs(2))
//!     .budget(budget.clone())
//!     .per_authority(BreakerConfig::default())
//!     .build()
//!     .unwrap()
//!     .client(reqwest::Client::new());
//!
//! assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
//! assert_eq!(hits.load(Ordering::SeqCst), 2);
//!
//! // Every bad setting is named.
//! let error = ClientMiddlewares::new().deadline(Duration::ZERO).build().unwrap_err();
//! assert_eq!(error.fields().collect::<Vec<_>>(), ["deadline"]);
//! # }
//! ```

use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use retrysafe_core::__private::Validate;
use retrysafe_core::ConfigError;
use retrysafe_core::breaker::BreakerConfig;
use retrysafe_core::budget::RetryBudget;
use retrysafe_core::observe::Name;

use crate::BoxFuture;
use crate::retry::Below;
use crate::{CircuitBreakerMiddleware, DeadlineMiddleware, RetryMiddleware};

/// The deadline, retry and breaker middleware in the standard order, with the budget
/// given once; see the [module docs](self).
#[derive(Clone, Debug)]
#[must_use]
pub struct ClientMiddlewares {
    deadline: Option<Duration>,
    /// The deadline middleware as far as it is set apart from its timeout (its hook).
    expiry: DeadlineMiddleware,
    retry: RetryMiddleware,
    budget: RetryBudget,
    breaker: CircuitBreakerMiddleware,
    name: Name,
    /// Whether the budget and the breaker are the stack's own (not given): then
    /// [`name`](Self::name) names them too.
    own_budget: bool,
    own_breaker: bool,
}

impl ClientMiddlewares {
    /// The standard order with the defaults of each piece: no deadline of its own (the
    /// inherited one, else the strategy's default timeouts), [`RetryMiddleware::new`],
    /// a [`RetryBudget::ratio`] of its own and [`CircuitBreakerMiddleware::default`].
    pub fn new() -> Self {
        ClientMiddlewares {
            deadline: None,
            expiry: DeadlineMiddleware::new(Duration::MAX),
            retry: RetryMiddleware::new(),
            budget: RetryBudget::ratio(),
            breaker: CircuitBreakerMiddleware::default(),
            name: Name::default(),
            own_budget: true,
            own_breaker: true,
        }
    }

    /// The stack's name (default `default`): the `name` of its deadline middleware, and
    /// by default of its other parts — the retry middleware unless it was named, the
    /// budget and the breaker unless they were given. Metric handles are resolved when
    /// the stack is applied ([`apply`](Self::apply), [`client`](Self::client)).
    pub fn name(mut self, name: impl Into<Name>) -> Self {
        let name = name.into();
        if self.own_budget {
            self.budget = self.budget.with_name(name.clone());
        }
        if self.own_breaker {
            self.breaker = CircuitBreakerMiddleware::with_config(
                BreakerConfig::default().with_name(name.clone()),
            );
        }
        if self.retry.name_of() == &Name::default() {
            self.retry = self.retry.name(name.clone());
        }
        self.name = name;
        self
    }

    /// Bounds each whole call by `timeout` (greater than zero, at most 30 days, checked
    /// by [`build`](Self::build)), as a [`DeadlineMiddleware`] outermost.
    pub fn deadline(mut self, timeout: Duration) -> Self {
        self.deadline = Some(timeout);
        self
    }

    /// Calls `f` on every call that ends with a
    /// [`DeadlineExceeded`](retrysafe_core::error::DeadlineExceeded) error (with a
    /// [`deadline`](Self::deadline): see [`DeadlineMiddleware::on_expiry`]).
    pub fn on_expiry(
        mut self,
        f: impl Fn(&retrysafe_core::DeadlineExpiry) + Send + Sync + 'static,
    ) -> Self {
        self.expiry = self.expiry.on_expiry(f);
        self
    }

    /// The retry middleware: strategy, classifier, keys, hooks. Its strategy's own
    /// budget is not used: every call charges the [`budget`](Self::budget).
    pub fn retry(mut self, retry: RetryMiddleware) -> Self {
        // An unnamed retry middleware takes the stack's name.
        self.retry = if retry.name_of() == &Name::default() && self.name != Name::default() {
            retry.name(self.name.clone())
        } else {
            retry
        };
        self
    }

    /// The retry budget, given once (default: a [`RetryBudget::ratio`] of its own).
    /// Share one handle between every client of the same downstream.
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.budget = budget;
        self.own_budget = false;
        self
    }

    /// The breaker middleware.
    pub fn breaker(mut self, breaker: CircuitBreakerMiddleware) -> Self {
        self.breaker = breaker;
        self.own_breaker = false;
        self
    }

    /// One breaker per authority (`host:port`) of the request URL, each configured by
    /// `config` ([`CircuitBreakerMiddleware::per_authority`]).
    pub fn per_authority(self, config: BreakerConfig) -> Self {
        self.breaker(CircuitBreakerMiddleware::per_authority(config))
    }

    /// Checks the settings: the error names every one out of range.
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        if let Some(timeout) = self.deadline {
            v.timeout(timeout, "deadline");
        }
        v.finish(self)
    }

    /// Adds the middleware to `builder`, as one middleware: the deadline, the retry and
    /// the breaker run in one hop (see the [module docs](self)); a middleware added
    /// after it is called once per attempt, as one below a `CircuitBreakerMiddleware`
    /// would be.
    pub fn apply(self, builder: ClientBuilder) -> ClientBuilder {
        // Every handle is resolved here, against the recorder installed now.
        let deadline = self.deadline.map(|timeout| {
            let deadline = self.expiry.with_timeout(timeout).name(self.name);
            deadline.resolve_metrics();
            deadline
        });
        let retry = self.retry.with_budget(self.budget);
        retry.resolve_metrics();
        self.breaker.resolve_metrics();
        builder.with(Fused {
            same_names: self.breaker.same_names(retry.names()),
            deadline,
            retry,
            breaker: self.breaker,
        })
    }

    /// A client of `client` with the middleware (and no other).
    pub fn client(self, client: reqwest::Client) -> ClientWithMiddleware {
        self.apply(ClientBuilder::new(client)).build()
    }
}

impl Default for ClientMiddlewares {
    fn default() -> Self {
        Self::new()
    }
}

/// The middleware [`ClientMiddlewares`] adds: what `DeadlineMiddleware` →
/// `RetryMiddleware` → `CircuitBreakerMiddleware` do, in one hop. The deadline (the
/// soonest of its own, a [`Deadline`](retrysafe_core::Deadline) in the extensions and
/// the inherited one) goes to the retry planner directly, which bounds every attempt by
/// it and never waits past it; it is not put in the extensions, so a middleware added
/// after this one does not see it there (it reads the time left in
/// `request-timeout-ms`, as the server does).
#[derive(Clone, Debug)]
struct Fused {
    deadline: Option<DeadlineMiddleware>,
    retry: RetryMiddleware,
    breaker: CircuitBreakerMiddleware,
    /// The breaker takes the planner's word for the timeout headers it writes.
    same_names: bool,
}

impl Middleware for Fused {
    // Written out as `async_trait` expands it: the deadline is settled and the call
    // begun here, and the one boxed future is the retry loop's (see
    // `RetryMiddleware::call`).
    fn handle<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        request: Request,
        extensions: &'life1 mut Extensions,
        next: Next<'life2>,
    ) -> BoxFuture<'async_trait, reqwest_middleware::Result<Response>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        // As the separate `DeadlineMiddleware` does: a call with no time left fails here,
        // before the retry starts (and deposits into the budget).
        let within = match &self.deadline {
            Some(deadline) => match deadline.settle(extensions) {
                Ok(within) => Some(within),
                Err(expired) => return Box::pin(std::future::ready(Err(expired))),
            },
            None => None,
        };
        let below = Below::Breaker(&self.breaker, next, self.same_names);
        self.retry
            .call(request, extensions, below, within, self.deadline.as_ref())
    }
}
