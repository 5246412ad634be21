//! One send of a row, and what its answer means for the row.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::poll_fn;
use http::{HeaderMap, Request, Response, StatusCode};
use retrysafe_core::error::BoxError;
use retrysafe_core::wire::{RetryAfter, parse_retry_after};
use tower_service::Service;

use super::Message;
use super::publisher::DynPublisher;

/// What one send came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// 2xx, or a confirmed publish.
    Succeeded(Option<u16>),
    /// A final answer: the row is `rejected`.
    Rejected(u16),
    /// Try again, no sooner than `min_delay`.
    Retry {
        status: Option<u16>,
        error: Option<String>,
        min_delay: Duration,
    },
}

impl Verdict {
    pub(crate) fn failed(error: impl std::fmt::Display) -> Self {
        Verdict::Retry {
            status: None,
            error: Some(error.to_string()),
            min_delay: Duration::ZERO,
        }
    }
}

/// Classifies an HTTP answer to an outbox send. The request always carries an
/// `Idempotency-Key`, so every answer that says "not now" is safe to retry: 408,
/// 409 with `retry-after` (the request is in flight downstream), 425, 429 and every
/// 5xx (a 500 too, and one marked `do-not-retry`: the relay retries at its own pace,
/// for as long as the dead-letter age allows). 2xx succeeds; any other answer is final.
pub(crate) fn classify(status: StatusCode, headers: &HeaderMap) -> Verdict {
    let code = status.as_u16();
    if status.is_success() {
        return Verdict::Succeeded(Some(code));
    }
    let retry_after = headers
        .get(http::header::RETRY_AFTER)
        .and_then(|v| parse_retry_after(v.as_bytes()));
    let retryable = match code {
        408 | 425 | 429 => true,
        409 => retry_after.is_some(),
        _ => status.is_server_error(),
    };
    if !retryable {
        return Verdict::Rejected(code);
    }
    let min_delay = match retry_after {
        Some(RetryAfter::Delay(d)) => d,
        _ => Duration::ZERO,
    };
    Verdict::Retry {
        status: Some(code),
        error: None,
        min_delay,
    }
}

/// A boxed send.
pub(crate) type SendFuture = Pin<Box<dyn Future<Output = Verdict> + Send + 'static>>;

/// The relay's HTTP client, type-erased.
pub(crate) trait DynHttp: Send + Sync + 'static {
    fn send(&self, request: Request<Bytes>) -> SendFuture;
}

/// A user's tower client stack.
pub(crate) struct HttpClient<S, B> {
    pub(crate) service: S,
    pub(crate) body: std::marker::PhantomData<fn() -> B>,
}

impl<S, B, RB> DynHttp for HttpClient<S, B>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: From<Bytes> + Send + 'static,
    RB: Send + 'static,
{
    fn send(&self, request: Request<Bytes>) -> SendFuture {
        let mut service = self.service.clone();
        let request = request.map(B::from);
        Box::pin(async move {
            if let Err(e) = poll_fn(|cx| service.poll_ready(cx)).await {
                return Verdict::failed(e.into());
            }
            match service.call(request).await {
                Ok(response) => classify(response.status(), response.headers()),
                Err(e) => Verdict::failed(e.into()),
            }
        })
    }
}

/// Publishes a message and classifies the result.
pub(crate) async fn publish(
    publisher: Option<Arc<dyn DynPublisher>>,
    key: String,
    message: Message,
) -> Verdict {
    let Some(publisher) = publisher else {
        return Verdict::failed("the relay has no publisher for messages");
    };
    match publisher.publish_boxed(&key, &message).await {
        Ok(()) => Verdict::Succeeded(None),
        Err(e) => Verdict::failed(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(code: u16, retry_after: Option<&'static str>) -> Verdict {
        let mut h = HeaderMap::new();
        if let Some(v) = retry_after {
            h.insert(http::header::RETRY_AFTER, http::HeaderValue::from_static(v));
        }
        classify(
            StatusCode::from_u16(code).unwrap_or(StatusCode::IM_A_TEAPOT),
            &h,
        )
    }

    #[test]
    fn answers_are_classified() {
        assert_eq!(verdict(201, None), Verdict::Succeeded(Some(201)));
        assert_eq!(verdict(422, None), Verdict::Rejected(422));
        assert_eq!(verdict(409, None), Verdict::Rejected(409));
        assert_eq!(verdict(302, None), Verdict::Rejected(302));
        for code in [408, 425, 429, 500, 502, 503, 504] {
            assert!(
                matches!(verdict(code, None), Verdict::Retry { .. }),
                "{code}"
            );
        }
        assert_eq!(
            verdict(409, Some("2")),
            Verdict::Retry {
                status: Some(409),
                error: None,
                min_delay: Duration::from_secs(2)
            }
        );
    }
}
