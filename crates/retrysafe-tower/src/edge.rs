//! Middleware for the public edge: removes (or clamps) inbound convention headers from
//! untrusted clients.
//!
//! Inbound convention headers are only honoured from trusted peers. At the edge,
//! [`EdgeLayer`] removes `retry-point`, `retry-attempt`, `grpc-previous-rpc-attempts`,
//! `request-timeout-ms` and `grpc-timeout`, so no outsider can drain a shared retry
//! budget with a forged `retry-attempt` or switch off internal retries with
//! `retry-point: caller`. With [`clamp_deadlines`](EdgeLayer::clamp_deadlines), deadline
//! headers are kept but clamped to a maximum (a malformed one is removed).
//!
//! Order: `TraceLayer` → `EdgeLayer` → authentication → `PropagateLayer` → ….
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use std::time::Duration;
//! use http::Request;
//! use retrysafe::EdgeLayer;
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! let svc = ServiceBuilder::new()
//!     .layer(EdgeLayer::new().clamp_deadlines(Duration::from_secs(5)))
//!     .service(tower::service_fn(|req: Request<()>| async move {
//!         Ok::<_, std::convert::Infallible>(req.headers().clone())
//!     }));
//!
//! let forged = Request::get("/")
//!     .header("retry-attempt", "3")
//!     .header("retry-point", "caller")
//!     .header("request-timeout-ms", "3600000")
//!     .body(())
//!     .unwrap();
//! let seen = svc.oneshot(forged).await.unwrap();
//! assert!(seen.get("retry-attempt").is_none());
//! assert!(seen.get("retry-point").is_none());
//! assert_eq!(seen["request-timeout-ms"], "5000");
//! # }
//! ```

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderMap, Request};
use retrysafe_core::__private::Validate;
use retrysafe_core::ConfigError;
use retrysafe_core::wire::{
    Convention, encode_grpc_timeout, encode_request_timeout_ms, parse_grpc_timeout,
    parse_request_timeout_ms,
};
use tower_layer::Layer;
use tower_service::Service;

#[derive(Debug, Clone, Default)]
struct Config {
    convention: Convention,
    clamp: Option<Duration>,
}

/// Strips or clamps inbound convention headers; see the [module docs](self).
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct EdgeLayer {
    config: Arc<Config>,
}

impl EdgeLayer {
    /// Removes every inbound convention header.
    pub fn new() -> Self {
        Self::default()
    }

    /// The header names.
    pub fn convention(mut self, convention: Convention) -> Self {
        Arc::make_mut(&mut self.config).convention = convention;
        self
    }

    /// Keeps deadline headers, clamped to `max` (greater than zero, at most 30 days);
    /// a malformed one is removed. The other headers are still removed.
    pub fn clamp_deadlines(mut self, max: Duration) -> Self {
        Arc::make_mut(&mut self.config).clamp = Some(max);
        self
    }

    /// Checks the settings: the error names every one out of range.
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        if let Some(max) = self.config.clamp {
            v.timeout(max, "deadline clamp");
        }
        v.finish(self)
    }
}

impl<S> Layer<S> for EdgeLayer {
    type Service = EdgeService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        EdgeService {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service of an [`EdgeLayer`].
#[derive(Debug, Clone)]
pub struct EdgeService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> EdgeService<S> {
    define_inner_service_accessors!();
}

impl<S, B> Service<Request<B>> for EdgeService<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let config = &*self.config;
        let headers = request.headers_mut();
        match config.clamp {
            None => config.convention.strip_inbound(headers),
            Some(max) => {
                let c = &config.convention;
                let ms = clamped(headers, c.request_timeout_ms(), max, |v| {
                    parse_request_timeout_ms(v).ok()
                });
                let grpc = clamped(headers, c.grpc_timeout(), max, |v| {
                    parse_grpc_timeout(v).ok()
                });
                c.strip_inbound(headers);
                if let Some(t) = ms {
                    headers.insert(c.request_timeout_ms().clone(), encode_request_timeout_ms(t));
                }
                if let Some(t) = grpc {
                    headers.insert(c.grpc_timeout().clone(), encode_grpc_timeout(t));
                }
            }
        }
        self.inner.call(request)
    }
}

fn clamped(
    headers: &HeaderMap,
    name: &http::HeaderName,
    max: Duration,
    parse: impl Fn(&[u8]) -> Option<Duration>,
) -> Option<Duration> {
    // A repeated header is ambiguous: treated as malformed.
    let mut values = headers.get_all(name).iter();
    let first = values.next()?;
    if values.next().is_some() {
        return None;
    }
    parse(first.as_bytes()).map(|t| t.min(max))
}
