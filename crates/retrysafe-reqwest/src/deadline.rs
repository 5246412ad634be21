//! Middleware that bounds a whole call by a deadline.
//!
//! [`DeadlineMiddleware`] does for a reqwest-middleware client what the tower
//! `DeadlineLayer` does for a tower client. Put it outermost:
//! `DeadlineMiddleware` → `RetryMiddleware` → `CircuitBreakerMiddleware` → reqwest.
//! For each call it:
//!
//! - puts a [`Deadline`] into the reqwest-middleware [`Extensions`] for the middleware
//!   below: the soonest of now plus its timeout, a `Deadline` already in the
//!   extensions (set by a middleware above, or per request with
//!   `RequestBuilder::with_extension`), and the deadline inherited from the inbound
//!   request being served ([`CallContext::inherited`]). Deadlines only shrink. A retry
//!   middleware below reads it: it never starts an attempt the deadline cannot cover,
//!   and sends the time left as `request-timeout-ms` on every attempt;
//! - fails at once with [`DeadlineExceeded`] when no time is left, without calling the
//!   middleware below;
//! - bounds everything below — retries, backoff sleeps, connecting, sending, and waiting
//!   for the response head — with [`tokio::time::timeout_at`]: when the deadline passes
//!   first, the call below is dropped and the call fails with [`DeadlineExceeded`]. A
//!   response head that is ready is never dropped for the timer (the call is polled
//!   first).
//!
//! The error is `reqwest_middleware::Error::Middleware(anyhow::Error::new(`[`DeadlineExceeded`]`))`;
//! [`is_deadline_exceeded`](crate::error::is_deadline_exceeded) finds it.
//!
//! **What is bounded.** By default, the call up to the response head: the body is read
//! after the middleware returned, and is the caller's to bound. With
//! [`bound_body`](DeadlineMiddleware::bound_body) the deadline bounds the response body
//! too: a body still streaming when it passes ends with an error whose chain holds
//! [`DeadlineExceeded`] (find it with [`find_in`](crate::error::find_in) on the
//! `reqwest::Error` that reading the body returns).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::time::Duration;
//! use retrysafe::Deadline;
//! use retrysafe::reqwest::DeadlineMiddleware;
//! use retrysafe::reqwest::error::is_deadline_exceeded;
//!
//! /// Stands for a slow network: sees the deadline, then waits for a second.
//! struct Slow;
//! #[async_trait::async_trait]
//! impl reqwest_middleware::Middleware for Slow {
//!     async fn handle(
//!         &self,
//!         request: reqwest::Request,
//!         extensions: &mut http::Extensions,
//!         next: reqwest_middleware::Next<'_>,
//!     ) -> reqwest_middleware::Result<reqwest::Response> {
//!         let deadline = extensions.get::<Deadline>().copied().unwrap();
//!         assert_eq!(deadline.remaining(), Duration::from_millis(100));
//!         tokio::time::sleep(Duration::from_secs(1)).await;
//!         next.run(request, extensions).await
//!     }
//! }
//!
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(DeadlineMiddleware::new(Duration::from_millis(100)))
//!     .with(Slow)
//!     .build();
//! let error = client.get("http://127.0.0.1:9/").send().await.unwrap_err();
//! assert!(is_deadline_exceeded(&error));
//! # }
//! ```
//!
//! [`CallContext::inherited`]: retrysafe_core::CallContext::inherited
//! [`DeadlineExceeded`]: retrysafe_core::error::DeadlineExceeded

use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response, ResponseBuilderExt};
use reqwest_middleware::{Middleware, Next};
use retrysafe_core::__private::{ExpiryObserver, Validate};
use retrysafe_core::DeadlineExpiry;
use retrysafe_core::error::DeadlineExceeded;
use retrysafe_core::observe::Name;
use retrysafe_core::{ConfigError, Deadline};
use tokio::time::Instant;

use retrysafe_tower::deadline::DeadlineBody;

use crate::BoxFuture;
use crate::error::local;

/// Bounds a whole call by a deadline; see the [module docs](self).
#[derive(Debug, Clone)]
#[must_use]
pub struct DeadlineMiddleware {
    timeout: Duration,
    bound_body: bool,
    expiry: ExpiryObserver,
}

impl DeadlineMiddleware {
    /// A middleware giving each call at most `timeout` (greater than zero, at most 30
    /// days, checked by [`build`](Self::build); a longer one is used as 30 days), or less
    /// when the extensions or the inherited context have a sooner deadline.
    pub fn new(timeout: Duration) -> Self {
        DeadlineMiddleware {
            timeout,
            bound_body: false,
            expiry: ExpiryObserver::new(Name::default()),
        }
    }

    /// The middleware's name (default `default`): the `name` of its expiry events and
    /// of `retrysafe_deadline_exceeded_total`, whose handle is resolved when a
    /// `ClientMiddlewares` stack is applied, or at the first expiry.
    pub fn name(mut self, name: impl Into<Name>) -> Self {
        self.expiry = self.expiry.renamed(name.into());
        self
    }

    /// The same middleware with another timeout.
    pub(crate) fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Resolves the expiry counter (else at the first expiry).
    pub(crate) fn resolve_metrics(&self) {
        self.expiry.resolve_metrics();
    }

    /// The deadline of a call: the soonest of ours, the one in `extensions` and the
    /// inherited one. When none of it is left, the expiry is counted and the call fails
    /// with [`DeadlineExceeded`] before anything below it runs (for the fused form of
    /// [`ClientMiddlewares`](crate::ClientMiddlewares) too: before the retry deposits
    /// into its budget). Returns it with the one clock reading it took.
    pub(crate) fn settle(
        &self,
        extensions: &Extensions,
    ) -> reqwest_middleware::Result<(Deadline, Instant)> {
        let now = Instant::now();
        let deadline = Deadline::after_from(self.timeout, now).tightened_by(extensions);
        if deadline.instant() <= now {
            // No call starts that cannot finish in time.
            self.expiry.expired();
            return Err(local(DeadlineExceeded::new()));
        }
        Ok((deadline, now))
    }

    /// Counts an expiry and calls the hook (for the fused form of
    /// [`ClientMiddlewares`](crate::ClientMiddlewares), which runs no `handle` of this).
    pub(crate) fn report_expired(&self) {
        self.expiry.expired();
    }

    /// Calls `f` on every call that ends with a [`DeadlineExceeded`] error (the
    /// deadline passed, here or in a middleware below).
    pub fn on_expiry(mut self, f: impl Fn(&DeadlineExpiry) + Send + Sync + 'static) -> Self {
        self.expiry = self.expiry.with_hook(f);
        self
    }

    /// Checks the settings: the error names every one out of range.
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        v.timeout(self.timeout, "timeout");
        v.finish(self)
    }

    /// The deadline also bounds the response body: a body still streaming when it
    /// passes ends with an error holding [`DeadlineExceeded`]. This rebuilds the
    /// response around a wrapped body (one allocation per call).
    pub fn bound_body(mut self) -> Self {
        self.bound_body = true;
        self
    }

    /// The timeout each call gets at most.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

impl Middleware for DeadlineMiddleware {
    // Written out as `async_trait` expands it, with the deadline settled here: the
    // boxed future holds the request once (the expansion of an `async fn` keeps its
    // arguments twice).
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
        let deadline = match self.settle(extensions) {
            Ok((deadline, _)) => deadline,
            Err(expired) => return Box::pin(std::future::ready(Err(expired))),
        };
        Box::pin(async move {
            // The middleware below see this call's deadline; the caller's extensions
            // get back what they held (they may be reused for another call).
            let before = extensions.insert(deadline);
            let result =
                tokio::time::timeout_at(deadline.instant(), next.run(request, extensions)).await;
            match before {
                Some(before) => extensions.insert(before),
                None => extensions.remove::<Deadline>(),
            };
            match result {
                Ok(Ok(response)) if self.bound_body => Ok(bound(response, deadline)),
                Ok(result) => {
                    if let Err(reqwest_middleware::Error::Middleware(e)) = &result
                        && e.is::<DeadlineExceeded>()
                    {
                        self.expiry.expired();
                    }
                    result
                }
                Err(_elapsed) => {
                    tracing::debug!("deadline exceeded before the response head");
                    self.expiry.expired();
                    Err(local(DeadlineExceeded::new()))
                }
            }
        })
    }
}

/// `response` with its body bounded by `deadline`.
fn bound(response: Response, deadline: Deadline) -> Response {
    let url = response.url().clone();
    let response: http::Response<reqwest::Body> = response.into();
    let (mut parts, body) = response.into_parts();
    // The conversion back reads the URL from an extension only reqwest can name.
    if let Ok(marker) = http::Response::builder().url(url).body(()) {
        parts.extensions.extend(marker.into_parts().0.extensions);
    }
    let body = reqwest::Body::wrap(DeadlineBody::new(body, deadline));
    Response::from(http::Response::from_parts(parts, body))
}
