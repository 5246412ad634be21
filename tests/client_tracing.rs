//! The tracing recipe of `retrysafe::observe::AttemptNumber`, over real loopback HTTP
//! against an axum server that answers 503 once, then 200: one `retrysafe.call` span
//! per call (attempts = 2), and below it the transport's own span per attempt —
//! tower-http's `TraceLayer` under the `RetryLayer` or `ClientLayers`, reqwest-tracing's
//! `TracingMiddleware` after the retry middleware — recording
//! `http.request.resend_count` on the retry only (OpenTelemetry: set when the request
//! was resent).
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub,
    dead_code
)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use http::{Extensions, Request, StatusCode};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use reqwest_tracing::{ReqwestOtelSpanBackend, TracingMiddleware};
use retrysafe::observe::AttemptNumber;
use retrysafe::reqwest::{ClientMiddlewares, RetryMiddleware};
use retrysafe::retry::{Backoff, Jitter};
use retrysafe::{ClientLayers, ReplayBody, RetryLayer, StandardRetryStrategy};
use tokio::net::TcpListener;
use tower::{Layer, ServiceBuilder, ServiceExt};
use tower_http::trace::TraceLayer;
use tracing::Span;
use tracing_subscriber::layer::SubscriberExt;

use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::Form;
use retrysafe_test_support::observe::Spans;

/// A server answering 503 to its first request and 200 after.
async fn flaky() -> SocketAddr {
    let hits = Arc::new(AtomicUsize::new(0));
    let app = Router::new().route(
        "/items",
        get(move || {
            let n = hits.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    StatusCode::SERVICE_UNAVAILABLE
                } else {
                    StatusCode::OK
                }
            }
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

fn strategy() -> StandardRetryStrategy {
    StandardRetryStrategy::new()
        .backoff(Backoff::new(
            Duration::from_millis(1),
            Duration::from_millis(2),
            Jitter::Full,
        ))
        .seed(3)
}

/// The transport's per-attempt span, as the recipe makes it: `http.request.resend_count`
/// only on a resent request.
fn attempt_span(method: &http::Method, extensions: &Extensions) -> Span {
    let span = tracing::info_span!(
        "http.client",
        http.request.method = %method,
        http.request.resend_count = tracing::field::Empty,
    );
    if let Some(attempt) = AttemptNumber::of(extensions).filter(|a| a.resend_count() > 0) {
        span.record("http.request.resend_count", attempt.resend_count());
    }
    span
}

/// What every form must show: one call span of two attempts, named `api`, with no
/// resend count; two transport spans inside it, the second with resend count 1.
fn assert_spans(spans: &Spans) {
    let calls = spans.named("retrysafe.call");
    assert_eq!(calls.len(), 1, "{calls:?}");
    let call = &calls[0];
    assert_eq!(call.fields["name"], "api");
    assert_eq!(call.fields["attempts"], "2");
    assert!(!call.fields.contains_key("give_up"), "{call:?}");
    assert!(!call.fields.contains_key("http.request.resend_count"));

    let attempts = spans.named("http.client");
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert!(attempts.iter().all(|a| a.parent == Some("retrysafe.call")));
    assert_eq!(attempts[0].fields.get("http.request.resend_count"), None);
    assert_eq!(attempts[1].fields["http.request.resend_count"], "1");
}

async fn tower_http_trace_layer_below_the_retry_records_the_resend_count(form: Form) {
    let spans = Spans::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));
    let addr = flaky().await;

    // The transport's own span per attempt: tower-http's TraceLayer, *below* the retry.
    let transport = ServiceBuilder::new()
        .layer(TraceLayer::new_for_http().make_span_with(
            |request: &Request<ReplayBody<Full<Bytes>>>| {
                attempt_span(request.method(), request.extensions())
            },
        ))
        .service(Client::builder(TokioExecutor::new()).build_http());
    let request = Request::get(format!("http://{addr}/items"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let status = match form {
        Form::Separate => {
            let retry = RetryLayer::new().name("api").strategy(strategy());
            retry
                .layer(transport)
                .oneshot(request)
                .await
                .unwrap()
                .status()
        }
        Form::Fused => {
            let layers = ClientLayers::new()
                .name("api")
                .retry(RetryLayer::new().strategy(strategy()));
            layers
                .layer(transport)
                .oneshot(request)
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(status, StatusCode::OK);
    assert_spans(&spans);
}

both_forms!(tower_http_trace_layer_below_the_retry_records_the_resend_count);

/// reqwest-tracing's backend of the recipe: the attempt number is in the middleware
/// `Extensions` that the retry middleware above filled.
struct AttemptSpans;

impl ReqwestOtelSpanBackend for AttemptSpans {
    fn on_request_start(request: &reqwest::Request, extensions: &mut Extensions) -> Span {
        attempt_span(request.method(), extensions)
    }

    fn on_request_end(
        span: &Span,
        outcome: &reqwest_middleware::Result<reqwest::Response>,
        _: &mut Extensions,
    ) {
        reqwest_tracing::default_on_request_end(span, outcome);
    }
}

#[tokio::test]
async fn reqwest_tracing_after_the_retry_middleware_records_the_resend_count() {
    let spans = Spans::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));
    let addr = flaky().await;

    let client = ClientMiddlewares::new()
        .name("api")
        .retry(RetryMiddleware::new().strategy(strategy()))
        .apply(reqwest_middleware::ClientBuilder::new(
            reqwest::Client::new(),
        ))
        .with(TracingMiddleware::<AttemptSpans>::new())
        .build();
    let response = client
        .get(format!("http://{addr}/items"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_spans(&spans);
}

/// The verdicts of the budget and the breaker, recorded on the call's span as they
/// happen (no network: a transport answering 503).
async fn budget_and_breaker_verdicts_are_recorded_on_the_call_span(form: Form) {
    use retrysafe::breaker::{BreakerConfig, CircuitBreaker};
    use retrysafe::budget::RatioConfig;
    use retrysafe::{CircuitBreakerLayer, RetryBudget, RetryBudgetLayer};
    use tower::util::BoxCloneSyncService;

    let spans = Spans::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));
    let transport = tower::service_fn(|_: Request<ReplayBody<Full<Bytes>>>| async {
        let response = http::Response::builder()
            .status(503)
            .body(Full::new(Bytes::new()));
        Ok::<_, tower::BoxError>(response.unwrap())
    });
    let stack = |budget: RetryBudget, breaker: CircuitBreaker| match form {
        Form::Separate => BoxCloneSyncService::new(
            ServiceBuilder::new()
                .layer(
                    RetryLayer::new()
                        .name("api")
                        .strategy(strategy().budget(budget.clone())),
                )
                .layer(RetryBudgetLayer::new(budget))
                .layer(CircuitBreakerLayer::new(breaker))
                .service(transport),
        ),
        Form::Fused => BoxCloneSyncService::new(
            ClientLayers::new()
                .name("api")
                .retry(RetryLayer::new().strategy(strategy()))
                .budget(budget)
                .breaker(CircuitBreakerLayer::new(breaker))
                .layer(transport),
        ),
    };
    let get = || {
        Request::get("http://api.test/items")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };

    // A budget with nothing to spend: the retry is refused.
    let empty = RetryBudget::ratio_with(RatioConfig::default().with_min_per_sec(0));
    let client = stack(empty, CircuitBreaker::default());
    let response = client.oneshot(get()).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);

    // An open breaker: the call is refused before any attempt.
    let open = CircuitBreaker::new(BreakerConfig::default());
    open.force_open();
    let client = stack(RetryBudget::ratio(), open);
    client.oneshot(get()).await.unwrap_err();

    let calls = spans.named("retrysafe.call");
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(calls[0].fields["attempts"], "1");
    assert_eq!(calls[0].fields["budget"], "refused");
    assert_eq!(calls[0].fields["give_up"], "budget_exhausted");
    assert_eq!(calls[1].fields["breaker"], "rejected");
    assert!(!calls[1].fields.contains_key("give_up"), "{:?}", calls[1]);
}

both_forms!(budget_and_breaker_verdicts_are_recorded_on_the_call_span);

/// What a call out of time after one retry shows on its span: two attempts, the
/// budget's grant of the retry, and `deadline = exceeded`.
fn assert_cut_short(spans: &Spans) {
    let calls = spans.named("retrysafe.call");
    assert_eq!(calls.len(), 1, "{calls:?}");
    let call = &calls[0];
    assert_eq!(call.fields["name"], "api", "{call:?}");
    assert_eq!(call.fields["attempts"], "2", "{call:?}");
    assert_eq!(call.fields["budget"], "granted", "{call:?}");
    assert_eq!(call.fields["deadline"], "exceeded", "{call:?}");
}

/// The usual order, the deadline above the retry (no network: a transport failing
/// once, then answering too late), on the paused clock.
async fn a_deadline_above_the_retry_is_recorded_on_the_call_span(form: Form) {
    use retrysafe::breaker::CircuitBreaker;
    use retrysafe::error::{DeadlineExceeded, find};
    use retrysafe::{CircuitBreakerLayer, DeadlineLayer, RetryBudget, RetryBudgetLayer};
    use tower::util::BoxCloneSyncService;

    let spans = Spans::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));
    let calls = Arc::new(AtomicUsize::new(0));
    let transport = tower::service_fn(move |_: Request<ReplayBody<Full<Bytes>>>| {
        let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
        async move {
            if first {
                let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
                return Err(tower::BoxError::from(reset));
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            let response = http::Response::builder().body(Full::new(Bytes::new()));
            Ok(response.unwrap())
        }
    });
    let budget = RetryBudget::ratio();
    let timeout = Duration::from_millis(100);
    let client = match form {
        Form::Separate => BoxCloneSyncService::new(
            ServiceBuilder::new()
                .layer(DeadlineLayer::new(timeout).name("api"))
                .layer(
                    RetryLayer::new()
                        .name("api")
                        .strategy(strategy().budget(budget.clone())),
                )
                .layer(RetryBudgetLayer::new(budget))
                .layer(CircuitBreakerLayer::new(CircuitBreaker::default()))
                .service(transport),
        ),
        Form::Fused => BoxCloneSyncService::new(
            ClientLayers::new()
                .name("api")
                .deadline(timeout)
                .retry(RetryLayer::new().strategy(strategy()))
                .budget(budget)
                .layer(transport),
        ),
    };
    let request = Request::get("http://api.test/items")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let error = client.oneshot(request).await.unwrap_err();
    assert!(find::<DeadlineExceeded>(&*error).is_some(), "{error}");
    assert_cut_short(&spans);
}

both_forms!(
    a_deadline_above_the_retry_is_recorded_on_the_call_span,
    start_paused = true
);

#[tokio::test]
async fn a_deadline_middleware_above_the_retry_is_recorded_on_the_call_span() {
    let spans = Spans::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));
    // The first connection is closed unanswered; then every answer comes a second late.
    let app = Router::new().route(
        "/items",
        get(|| async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            StatusCode::OK
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        drop(listener.accept().await);
        axum::serve(listener, app).await
    });

    let client = ClientMiddlewares::new()
        .name("api")
        .deadline(Duration::from_millis(300))
        .retry(RetryMiddleware::new().strategy(strategy()))
        .client(reqwest::Client::new());
    let error = client
        .get(format!("http://{addr}/items"))
        .send()
        .await
        .unwrap_err();
    assert!(
        matches!(&error, reqwest_middleware::Error::Middleware(e)
            if e.is::<retrysafe::error::DeadlineExceeded>()),
        "{error:?}"
    );
    assert_cut_short(&spans);
}
