//! Middleware that stops calling a downstream that keeps failing: a circuit breaker
//! refuses calls at once while the downstream recovers, instead of sending more.
//!
//! [`CircuitBreakerMiddleware`] drives the same sans-IO state machine as the tower
//! `CircuitBreakerLayer`, [`retrysafe_core::breaker::CircuitBreaker`] (closed, open,
//! half-open; forced open and disabled), with the same classification:
//!
//! - Before each call it asks the breaker for a permit. A refused call fails at once,
//!   without reaching the network, with
//!   `reqwest_middleware::Error::Middleware(anyhow::Error::new(`[`CircuitOpen`]`))`,
//!   which carries the time until the next probe; [`is_circuit_open`] and
//!   [`find`] look for it. A retry middleware above treats it as a local failure and
//!   never retries it.
//! - An admitted call runs the rest of the chain; its response head, or its transport
//!   error, is classified by the [`DefaultClassifier`] (or yours) and its
//!   [breaker outcome](retrysafe_core::classify::Classification::breaker_outcome) is
//!   recorded on the permit. Only the callee's own faults count: a response marked
//!   `do-not-retry` because a *dependency* failed, a 504 that came when the deadline
//!   the request carried (`request-timeout-ms`, sent by a retry middleware above) was
//!   spent, and refusals of middleware below are neutral; 4xx are successes. With
//!   [`slow_call_duration`](retrysafe_core::breaker::BreakerConfig::slow_call_duration)
//!   set, the call is timed from sending to the response head.
//! - The response head decides: the body is passed through untouched (reqwest does not
//!   read gRPC trailers, so a gRPC status that arrives after the head is not seen).
//! - A call whose future is dropped before its response (a retry middleware's attempt
//!   timeout, a caller giving up) drops its permit: a half-open probe then counts as a
//!   failure, a call of a closed breaker as nothing.
//! - State changes call
//!   [`BreakerConfig::on_state_change`](retrysafe_core::breaker::BreakerConfig::on_state_change)
//!   and emit `tracing` events (`warn` on opening); a refusal emits a `debug` event.
//!
//! One middleware guards one downstream with one breaker (a shared handle: clone it
//! into every client of that downstream). The bounded map of one breaker per
//! authority, `KeyedBreakers`, lives in `retrysafe-tower`; for several downstreams,
//! build one client per downstream here.
//!
//! Put it below the retry middleware, so that every attempt passes the breaker:
//! `DeadlineMiddleware` → `RetryMiddleware` → `CircuitBreakerMiddleware` → reqwest.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use retrysafe::breaker::{BreakerConfig, CircuitBreaker, State};
//! use retrysafe::reqwest::CircuitBreakerMiddleware;
//! use retrysafe::reqwest::error::is_circuit_open;
//!
//! // A port nothing listens on: every connection is refused.
//! let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
//! let url = format!("http://127.0.0.1:{port}/");
//!
//! // Opens at 50 % failures of at least 2 calls.
//! let config = BreakerConfig::default().with_minimum_calls(2).build().unwrap();
//! let breaker = CircuitBreaker::new(config);
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(CircuitBreakerMiddleware::new(breaker.clone()))
//!     .build();
//!
//! for _ in 0..2 {
//!     let error = client.get(&url).send().await.unwrap_err();
//!     assert!(error.is_connect()); // the callee's failure, counted
//! }
//! assert_eq!(breaker.state(), State::Open);
//! // Open: refused at once, nothing sent.
//! let error = client.get(&url).send().await.unwrap_err();
//! assert!(is_circuit_open(&error));
//! # }
//! ```
//!
//! [`CircuitOpen`]: retrysafe_core::error::CircuitOpen
//! [`is_circuit_open`]: crate::error::is_circuit_open
//! [`find`]: crate::error::find

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::Extensions;
use http::uri::Authority;
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};
use retrysafe_core::__private::BreakerFacts;
use retrysafe_core::breaker::{BreakerConfig, CircuitBreaker, Permit};
use retrysafe_core::classify::{Classifier, DefaultClassifier};
use retrysafe_core::wire::Convention;
use retrysafe_tower::breaker::KeyedBreakers;
use tokio::time::Instant;

use crate::BoxFuture;
use crate::error::local;
use crate::retry::failure_of;

/// Guards calls with a circuit breaker; see the [module docs](self).
///
/// A cheap `Clone`: clones share the breaker and the configuration.
#[derive(Clone)]
#[must_use]
pub struct CircuitBreakerMiddleware {
    config: Arc<Config>,
}

#[derive(Clone)]
struct Config {
    breakers: Breakers,
    classifier: Arc<dyn Classifier>,
    convention: Convention,
}

/// One breaker for every request, or one per authority of the request URL.
#[derive(Clone, Debug)]
enum Breakers {
    One(CircuitBreaker),
    PerAuthority(KeyedBreakers<Option<Authority>>),
}

impl Breakers {
    /// The breaker guarding a request to `url`.
    fn select(&self, url: &reqwest::Url) -> CircuitBreaker {
        match self {
            Breakers::One(breaker) => breaker.clone(),
            Breakers::PerAuthority(keyed) => keyed.breaker(&authority_of(url)),
        }
    }
}

/// The authority of `url` as an `http::Uri` of it has it (`host`, or `host:port` when
/// the URL names a port), so that breakers shared with the tower layer use the same
/// keys.
fn authority_of(url: &reqwest::Url) -> Option<Authority> {
    let host = url.host_str()?;
    match url.port() {
        Some(port) => Authority::try_from(format!("{host}:{port}")).ok(),
        None => Authority::try_from(host).ok(),
    }
}

impl CircuitBreakerMiddleware {
    /// A middleware guarding every request with `breaker`, a shared handle: clone it
    /// into every client of the same downstream so they open and close together.
    pub fn new(breaker: CircuitBreaker) -> Self {
        Self::with_breakers(Breakers::One(breaker))
    }

    /// A middleware with one breaker per authority (`host:port`) of the request URL,
    /// each configured by `config`, in a bounded map (see [`KeyedBreakers`]): one
    /// failing host does not stop calls to the others.
    pub fn per_authority(config: BreakerConfig) -> Self {
        Self::keyed(KeyedBreakers::per_authority(config))
    }

    /// A middleware over shared per-authority breakers, for example the map a tower
    /// `CircuitBreakerLayer::keyed` uses too: both open and close together per host.
    pub fn keyed(breakers: KeyedBreakers<Option<Authority>>) -> Self {
        Self::with_breakers(Breakers::PerAuthority(breakers))
    }

    fn with_breakers(breakers: Breakers) -> Self {
        let convention = Convention::default();
        CircuitBreakerMiddleware {
            config: Arc::new(Config {
                breakers,
                classifier: Arc::new(DefaultClassifier::new(convention.clone())),
                convention,
            }),
        }
    }

    /// A middleware with a breaker of its own, configured by `config` (checked by
    /// [`BreakerConfig::build`]). Clones of the middleware share it.
    pub fn with_config(config: BreakerConfig) -> Self {
        Self::new(CircuitBreaker::new(config))
    }

    /// Resolves the breaker's metric handles (a keyed map's are, when it is made).
    pub(crate) fn resolve_metrics(&self) {
        if let Breakers::One(breaker) = &self.config.breakers {
            breaker.resolve_metrics();
        }
    }

    fn map(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// The classifier deciding what counts as the callee's failure (default:
    /// [`DefaultClassifier`] over this middleware's convention).
    pub fn classifier(self, classifier: impl Classifier) -> Self {
        self.map(|c| c.classifier = Arc::new(classifier))
    }

    /// The header names (also used by the default classifier).
    pub fn convention(self, convention: Convention) -> Self {
        self.map(|c| {
            c.classifier = Arc::new(DefaultClassifier::new(convention.clone()));
            c.convention = convention;
        })
    }

    /// The breaker that guards requests to `url` (a handle on the shared state): the
    /// one breaker, or that authority's.
    pub fn breaker_for(&self, url: &reqwest::Url) -> CircuitBreaker {
        self.config.breakers.select(url)
    }
}

impl Default for CircuitBreakerMiddleware {
    /// A middleware with a breaker of its own with the default configuration
    /// ([`BreakerConfig::default`]).
    fn default() -> Self {
        Self::new(CircuitBreaker::default())
    }
}

impl fmt::Debug for CircuitBreakerMiddleware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreakerMiddleware")
            .field("breakers", &self.config.breakers)
            .field("classifier", &self.config.classifier)
            .field("convention", &self.config.convention)
            .finish()
    }
}

impl Middleware for CircuitBreakerMiddleware {
    // Written out as `async_trait` expands it: the breaker's work before the call is
    // done here, and the next middleware called at once, so the boxed future holds the
    // call under way and the permit, not a copy of the request.
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
        let admitted = match self.admit(&request, extensions, None) {
            Ok(admitted) => admitted,
            Err(refused) => return Box::pin(std::future::ready(Err(refused))),
        };
        let sent = next.run(request, extensions);
        Box::pin(async move {
            let result = sent.await;
            self.settle(admitted, &result);
            result
        })
    }
}

/// What the fused form's retry planner knows of an attempt as it sends it: the breaker
/// takes its word instead of reading the attempt's headers and the clock again.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sent {
    /// A gRPC request.
    pub(crate) grpc: bool,
    /// The time the attempt's timeout header was written from, if it has one.
    pub(crate) timeout: Option<Duration>,
    /// The clock reading that time was computed from, if the clock was read for it.
    pub(crate) at: Option<Instant>,
}

/// An attempt the breaker let through: its permit and what classifying its outcome
/// needs. Dropped unsettled (the attempt was cancelled, or timed out above the
/// breaker), its permit reports a cancelled probe as a failure and a call of a closed
/// breaker as nothing.
pub(crate) struct Admitted {
    permit: Permit,
    facts: BreakerFacts,
    /// Slow calls are tracked: the call is timed.
    timed: bool,
    started: Option<Instant>,
}

impl CircuitBreakerMiddleware {
    /// Whether this breaker reads timeout headers by the names `names` writes them
    /// with (then the planner's word is as good as a parse).
    pub(crate) fn same_names(&self, names: &Convention) -> bool {
        self.config.convention.same_timeout_names(names)
    }

    /// The breaker's side of one attempt before it is sent (the middleware's, also run
    /// by the fused form of [`ClientMiddlewares`](crate::ClientMiddlewares), which
    /// passes what its planner wrote as `sent`): the request's breaker chosen and a
    /// permit taken, or the refusal, [`CircuitOpen`](retrysafe_core::error::CircuitOpen).
    pub(crate) fn admit(
        &self,
        request: &Request,
        extensions: &Extensions,
        sent: Option<Sent>,
    ) -> reqwest_middleware::Result<Admitted> {
        let config = &self.config;
        // A breaker in the request's extensions overrides the middleware's (per request).
        let breaker = match extensions.get::<CircuitBreaker>() {
            Some(breaker) => breaker.clone(),
            None => config.breakers.select(request.url()),
        };
        let permit = match breaker.try_acquire() {
            Ok(permit) => permit,
            Err(open) => {
                tracing::debug!(
                    retry_in_ms = u64::try_from(open.retry_in().as_millis()).unwrap_or(u64::MAX),
                    "request refused: circuit open"
                );
                return Err(local(open));
            }
        };
        let facts = match sent {
            Some(sent) => BreakerFacts::sent(sent.grpc, sent.timeout),
            None => BreakerFacts::of(request.headers(), &config.convention),
        };
        let timed = breaker.config().slow_call_duration().is_some();
        let at = sent.and_then(|sent| sent.at);
        let started = (timed || facts.carries_deadline()).then(|| at.unwrap_or_else(Instant::now));
        Ok(Admitted {
            permit,
            facts,
            timed,
            started,
        })
    }

    /// Records the outcome of an attempt [`admit`](Self::admit)ted as `admitted`.
    pub(crate) fn settle(&self, admitted: Admitted, result: &reqwest_middleware::Result<Response>) {
        let Admitted {
            permit,
            facts,
            timed,
            started,
        } = admitted;
        let classifier = &self.config.classifier;
        let elapsed = started.map(|s| s.elapsed());
        let facts = facts.after(elapsed);
        let classification = match result {
            Ok(response) => {
                classifier.classify_response(response.status(), response.headers(), &facts)
            }
            Err(error) => classifier.classify_failure(failure_of(error), &facts),
        };
        let slowness = if timed { elapsed } else { None };
        permit.record(
            classification.breaker_outcome(),
            slowness.unwrap_or(Duration::ZERO),
        );
    }
}
