//! The retry against real axum servers on loopback (a scripted server records
//! every request it gets): what is retried and what is not (503, `do-not-retry`, POST
//! with and without a key, generated and child keys, a streaming body, a refused
//! connection, a local refusal from below), giving up (the last response marked), the
//! deadline (`request-timeout-ms` on every attempt, `retry-after` past it, an expired
//! one), per-request overrides in the reqwest-middleware `Extensions`, the inherited
//! `CallContext`, and that the middleware fits `ClientBuilder::with` and is `Send`.
//! Exact delays and headers are checked on tokio's paused clock against a stub at the
//! end of the middleware chain (no network there, so the clock can be paused). No
//! timing assertions on real time.
//!
//! The behavioural tests run on both forms of the client stack (`both_forms!`: the
//! separate `RetryMiddleware` → `CircuitBreakerMiddleware`, and the fused
//! `ClientMiddlewares`, with the same strategy, budget and breaker). Single-form,
//! `RetryMiddleware` alone:
//! - `the_middleware_fits_the_client_builder_and_its_future_is_send`: the standalone
//!   middleware's `Default`, `Clone`, `Debug` and fit in `ClientBuilder::with`;
//! - `the_fused_middlewares_one_future_fits_the_allocators_thread_cache`: the size of
//!   the one future `ClientMiddlewares` boxes per call;
//! - `each_attempt_starts_from_the_callers_extensions_and_nothing_leaks_back`: also
//!   checks the `RetryCharged` mark each attempt carries for a budget middleware below
//!   the separate retry, which the fused form (no such middleware below) does not add;
//!   the rest of it runs on both forms as
//!   `no_attempt_sees_another_attempts_extensions_and_nothing_leaks_back`.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub
)]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Request as AxumRequest, State};
use axum::response::{IntoResponse, Response as AxumResponse};
use http::{Extensions, HeaderMap, Method};
use reqwest::{Body, Request, Response};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use retrysafe_core::budget::{RatioConfig, RetryBudget};
use retrysafe_core::error::{CircuitOpen, DeadlineExceeded};
use retrysafe_core::idempotency::{IdempotencyContext, Principal, Scope, Token};
use retrysafe_core::retry::{GiveUpEvent, RetryEvent, child_key_label};
use retrysafe_core::strategy::{GiveUp, Idempotent, NoRetry, StandardRetryStrategy};
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_core::{CallContext, Deadline};
use retrysafe_reqwest::retry::RetryMiddleware;
use tokio::net::TcpListener;
use tokio::time::Instant;

mod support;
use support::{Form, Stack, both_forms, budget_counts};

// ---------------------------------------------------------------------------------------
// A scripted server
// ---------------------------------------------------------------------------------------

/// One answer of the scripted server: a status and headers.
type Reply = (u16, Vec<(&'static str, &'static str)>);

/// What the server got.
#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    headers: HeaderMap,
    body: Bytes,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
}

#[derive(Clone, Default)]
struct Script {
    replies: Arc<Mutex<VecDeque<Reply>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Script {
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

async fn scripted(State(script): State<Script>, request: AxumRequest) -> AxumResponse {
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    script.seen.lock().unwrap().push(Seen {
        method: parts.method,
        headers: parts.headers,
        body,
    });
    // The last reply repeats.
    let (status, headers) = {
        let mut replies = script.replies.lock().unwrap();
        if replies.len() > 1 {
            replies.pop_front().unwrap()
        } else {
            replies.front().cloned().unwrap_or((200, vec![]))
        }
    };
    let mut response = (
        http::StatusCode::from_u16(status).unwrap(),
        format!("status {status}"),
    )
        .into_response();
    for (name, value) in headers {
        response
            .headers_mut()
            .insert(name, http::HeaderValue::from_static(value));
    }
    response
}

fn router(replies: Vec<Reply>) -> (axum::Router, Script) {
    let script = Script {
        replies: Arc::new(Mutex::new(replies.into())),
        seen: Arc::default(),
    };
    let app = axum::Router::new()
        .fallback(scripted)
        .with_state(script.clone());
    (app, script)
}

/// Starts a scripted server; its base URL and what it records.
async fn serve(replies: Vec<Reply>) -> (String, Script) {
    let (app, script) = router(replies);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), script)
}

fn s(status: u16) -> Reply {
    (status, vec![])
}

// ---------------------------------------------------------------------------------------
// Clients, hooks and helpers
// ---------------------------------------------------------------------------------------

fn strategy() -> StandardRetryStrategy {
    StandardRetryStrategy::new().seed(3)
}

fn middleware() -> RetryMiddleware {
    RetryMiddleware::new().strategy(strategy())
}

/// The client stack around `middleware`, with the seeded strategy.
fn stack(middleware: RetryMiddleware) -> Stack {
    Stack::new().strategy(strategy()).retry(middleware)
}

fn client(form: Form, middleware: RetryMiddleware) -> ClientWithMiddleware {
    stack(middleware).client(form)
}

type Events<E> = Arc<Mutex<Vec<E>>>;

fn hooked(
    middleware: RetryMiddleware,
) -> (RetryMiddleware, Events<RetryEvent>, Events<GiveUpEvent>) {
    let retries: Events<RetryEvent> = Arc::default();
    let give_ups: Events<GiveUpEvent> = Arc::default();
    let (r, g) = (retries.clone(), give_ups.clone());
    let middleware = middleware
        .on_retry(move |e| r.lock().unwrap().push(e.clone()))
        .on_give_up(move |e| g.lock().unwrap().push(e.clone()));
    (middleware, retries, give_ups)
}

fn events<E: Clone>(events: &Events<E>) -> Vec<E> {
    events.lock().unwrap().clone()
}

fn marked(response: &Response) -> bool {
    response
        .headers()
        .get("do-not-retry")
        .is_some_and(|v| v == "1")
}

fn empty_budget() -> RetryBudget {
    let mut config = RatioConfig::default();
    config = config.with_min_per_sec(0);
    config = config.with_retry_ratio(0.0);
    RetryBudget::ratio_with(config)
}

/// Counts the attempts that pass it, below the retry middleware.
struct Count(Arc<AtomicU32>);

#[async_trait::async_trait]
impl Middleware for Count {
    async fn handle(
        &self,
        req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        self.0.fetch_add(1, Ordering::SeqCst);
        next.run(req, extensions).await
    }
}

fn counted(form: Form, middleware: RetryMiddleware) -> (ClientWithMiddleware, Arc<AtomicU32>) {
    let count = Arc::new(AtomicU32::new(0));
    let client = stack(middleware).below(Count(count.clone())).client(form);
    (client, count)
}

fn middleware_error<E: std::error::Error + Send + Sync + 'static>(
    error: &reqwest_middleware::Error,
) -> Option<&E> {
    match error {
        reqwest_middleware::Error::Middleware(e) => e.downcast_ref::<E>(),
        reqwest_middleware::Error::Reqwest(_) => None,
    }
}

// ---------------------------------------------------------------------------------------
// What is retried
// ---------------------------------------------------------------------------------------

both_forms! {
    #[tokio::test]
    async fn a_503_then_200_is_retried_with_retry_attempt_2(form) {
        let (url, script) = serve(vec![s(503), s(200)]).await;
        let (middleware, retries, give_ups) = hooked(middleware());
        let budget = RetryBudget::ratio();
        let response = stack(middleware)
            .budget(budget.clone())
            .client(form)
            .get(format!("{url}/items"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert!(!marked(&response));
        assert_eq!(response.text().await.unwrap(), "status 200");
        let seen = script.seen();
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0].header("retry-attempt"), None);
        assert_eq!(seen[1].header("retry-attempt"), Some("2"));
        // No deadline: no timeout header (the default timeouts stay local).
        assert_eq!(seen[0].header("request-timeout-ms"), None);
        let retries = events(&retries);
        assert_eq!(retries.len(), 1);
        assert_eq!(retries[0].attempt, 2);
        assert_eq!(
            retries[0].status,
            Some(http::StatusCode::SERVICE_UNAVAILABLE)
        );
        assert!(give_ups.lock().unwrap().is_empty());
        // One deposit for the call, one withdrawal for its retry.
        assert_eq!(budget_counts(&budget), (1, 1));
    }
}

both_forms! {
    #[tokio::test]
    async fn a_do_not_retry_or_replayed_reply_is_not_retried_and_recorded_in_the_context(form) {
        for header in [("do-not-retry", "1"), ("idempotent-replayed", "true")] {
            let (url, script) = serve(vec![(503, vec![header]), s(200)]).await;
            let client = client(form, middleware());
            let ctx = CallContext::new();
            // The context is inherited through the task-local scope, as inside a handler.
            let response = ctx
                .clone()
                .scope(async { client.get(format!("{url}/items")).send().await })
                .await
                .unwrap();
            assert_eq!(response.status(), 503);
            assert_eq!(script.seen().len(), 1);
            assert!(ctx.downstream_gave_up());
        }
    }
}

both_forms! {
    #[tokio::test]
    async fn a_post_without_a_key_is_sent_once_and_with_a_key_retried_with_that_key(form) {
        let (url, script) = serve(vec![s(503), s(201)]).await;
        let response = client(form, middleware())
            .post(format!("{url}/orders"))
            .body("order")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        assert!(!marked(&response));
        assert_eq!(script.seen().len(), 1);

        let (url, script) = serve(vec![s(503), s(503), s(201)]).await;
        let response = client(form, middleware())
            .post(format!("{url}/orders"))
            .header("idempotency-key", "order-42")
            .body("order")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        let seen = script.seen();
        assert_eq!(seen.len(), 3);
        for s in &seen {
            assert_eq!(s.method, Method::POST);
            assert_eq!(s.header("idempotency-key"), Some("order-42"));
            // The buffered body is sent again, byte for byte.
            assert_eq!(&s.body[..], b"order");
        }
    }
}

both_forms! {
    #[tokio::test]
    async fn generated_keys_are_added_to_post_and_patch_and_kept_across_attempts(form) {
        let (url, script) = serve(vec![s(503), s(503), s(201)]).await;
        let client = client(form, middleware().generate_idempotency_keys());
        let response = client
            .post(format!("{url}/orders"))
            .body("x")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        let seen = script.seen();
        assert_eq!(seen.len(), 3);
        let key = seen[0].header("idempotency-key").unwrap().to_owned();
        assert_eq!(key.len(), 32);
        assert!(key.bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(
            seen.iter()
                .all(|s| s.header("idempotency-key") == Some(&key))
        );

        // PATCH gets one, GET does not, and a key the caller set is kept.
        let (url, script) = serve(vec![s(200)]).await;
        client.patch(format!("{url}/o/1")).send().await.unwrap();
        client.get(format!("{url}/o/1")).send().await.unwrap();
        client
            .post(format!("{url}/o"))
            .header("idempotency-key", "mine")
            .send()
            .await
            .unwrap();
        let seen = script.seen();
        assert!(seen[0].header("idempotency-key").is_some_and(|k| k != key));
        assert_eq!(seen[1].header("idempotency-key"), None);
        assert_eq!(seen[2].header("idempotency-key"), Some("mine"));
    }
}

both_forms! {
    #[tokio::test]
    async fn keys_inside_a_guarded_handler_are_the_child_keys_of_the_record(form) {
        let (url, script) = serve(vec![s(503), s(201)]).await;
        let authority = url.trim_start_matches("http://").to_owned();
        let scope = Scope::from(&Principal::new("alice"));
        let inbound = IdempotencyKey::new("order-7").unwrap();
        let expected = IdempotencyContext::detached(scope, inbound.clone(), Token::random());
        let child = expected.next_child_key(&child_key_label(&Method::POST, &authority, "/ledger"));

        // The handler runs with its own claim token: the same child key.
        let record = IdempotencyContext::detached(scope, inbound, Token::random());
        let ctx = CallContext::new().with_idempotency(record);
        let client = client(form, middleware().generate_idempotency_keys());
        let response = ctx
            .scope(async { client.post(format!("{url}/ledger")).send().await })
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        let seen = script.seen();
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0].header("idempotency-key"), Some(child.as_str()));
        assert_eq!(seen[1].header("idempotency-key"), Some(child.as_str()));
    }
}

both_forms! {
    #[tokio::test]
    async fn a_streaming_body_is_sent_once_even_on_a_503(form) {
        let (url, script) = serve(vec![s(503), s(201)]).await;
        let (middleware, retries, give_ups) = hooked(middleware());
        let response = client(form, middleware)
            .post(format!("{url}/upload"))
            .header("idempotency-key", "upload-1")
            .body(Body::wrap("streamed".to_owned()))
            .send()
            .await
            .unwrap();
        // Not an error, not marked: the answer as it came.
        assert_eq!(response.status(), 503);
        assert!(!marked(&response));
        let seen = script.seen();
        assert_eq!(seen.len(), 1);
        assert_eq!(&seen[0].body[..], b"streamed");
        assert!(retries.lock().unwrap().is_empty() && give_ups.lock().unwrap().is_empty());
    }
}

/// An address nothing listens on (a listener bound, then closed).
async fn closed_port() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap()
}

both_forms! {
    #[tokio::test]
    async fn a_refused_connection_is_retried_even_for_a_post(form) {
        // Nothing listens on the first attempt; the server comes up before the retry.
        let addr = closed_port().await;
        let (app, script) = router(vec![s(201)]);
        let app = Mutex::new(Some(app));
        let bring_up = middleware().on_retry(move |_| {
            if let Some(app) = app.lock().unwrap().take() {
                let listener = std::net::TcpListener::bind(addr).unwrap();
                listener.set_nonblocking(true).unwrap();
                tokio::spawn(async move {
                    let listener = TcpListener::from_std(listener).unwrap();
                    axum::serve(listener, app).await.unwrap();
                });
            }
        });
        let response = client(form, bring_up)
            .post(format!("http://{addr}/orders"))
            .body("x")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        assert_eq!(script.seen().len(), 1);

        // Refused every time: attempts exhausted, reqwest's error passed on.
        let addr = closed_port().await;
        let (hooked_middleware, retries, give_ups) = hooked(middleware());
        let (client, count) = counted(form, hooked_middleware);
        let error = client
            .post(format!("http://{addr}/orders"))
            .send()
            .await
            .unwrap_err();
        match &error {
            reqwest_middleware::Error::Reqwest(e) => assert!(e.is_connect(), "{e:?}"),
            other @ reqwest_middleware::Error::Middleware(_) => {
                panic!("expected reqwest's connect error, got {other:?}")
            }
        }
        assert_eq!(count.load(Ordering::SeqCst), 3);
        assert_eq!(retries.lock().unwrap().len(), 2);
        let give_ups = events(&give_ups);
        assert_eq!(give_ups.len(), 1);
        assert_eq!(give_ups[0].attempts, 3);
        assert_eq!(give_ups[0].reason, GiveUp::AttemptsExhausted);
        assert_eq!(give_ups[0].status, None);
    }
}

/// A middleware below the retry that refuses every call, as an open breaker does.
struct Refuse(Arc<AtomicU32>);

#[async_trait::async_trait]
impl Middleware for Refuse {
    async fn handle(
        &self,
        _req: Request,
        _extensions: &mut Extensions,
        _next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Err(reqwest_middleware::Error::middleware(CircuitOpen::new(
            Duration::from_secs(5),
        )))
    }
}

both_forms! {
    #[tokio::test]
    async fn a_local_refusal_from_below_is_passed_on_not_retried(form) {
        let calls = Arc::new(AtomicU32::new(0));
        let client = stack(middleware())
            .below(Refuse(calls.clone()))
            .client(form);
        let error = client
            .get("http://127.0.0.1:9/never")
            .send()
            .await
            .unwrap_err();
        assert!(middleware_error::<CircuitOpen>(&error).is_some());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}

/// A middleware below the retry that wraps reqwest's errors with context.
struct Wrap;

#[async_trait::async_trait]
impl Middleware for Wrap {
    async fn handle(
        &self,
        req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        next.run(req, extensions).await.map_err(|e| match e {
            reqwest_middleware::Error::Reqwest(e) => reqwest_middleware::Error::Middleware(
                anyhow::Error::new(e).context("sending through Wrap"),
            ),
            other @ reqwest_middleware::Error::Middleware(_) => other,
        })
    }
}

both_forms! {
    #[tokio::test]
    async fn a_refused_connection_wrapped_by_a_middleware_below_is_still_retried(form) {
        let addr = closed_port().await;
        let count = Arc::new(AtomicU32::new(0));
        let client = stack(middleware())
            .below(Count(count.clone()))
            .below(Wrap)
            .client(form);
        let error = client
            .post(format!("http://{addr}/orders"))
            .send()
            .await
            .unwrap_err();
        assert!(error.is_middleware());
        assert_eq!(
            retrysafe_reqwest::retry::failure_of(&error),
            retrysafe_core::classify::Failure::ConnectFailed
        );
        // Nothing was sent: a POST without a key is retried, up to the attempt limit.
        assert_eq!(count.load(Ordering::SeqCst), 3);
    }
}

// ---------------------------------------------------------------------------------------
// Giving up
// ---------------------------------------------------------------------------------------

both_forms! {
    #[tokio::test]
    async fn giving_up_after_the_last_attempt_marks_the_last_response(form) {
        let (url, script) = serve(vec![(503, vec![("x-try", "last")])]).await;
        let (middleware, retries, give_ups) = hooked(middleware());
        let ctx = CallContext::new();
        let budget = RetryBudget::ratio();
        let client = stack(middleware).budget(budget.clone()).client(form);
        let response = ctx
            .clone()
            .scope(async { client.get(format!("{url}/items")).send().await })
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        assert!(marked(&response));
        assert_eq!(response.headers()["x-try"], "last");
        assert_eq!(response.text().await.unwrap(), "status 503");
        assert_eq!(script.seen().len(), 3);
        assert!(ctx.downstream_gave_up());
        assert_eq!(events(&retries).len(), 2);
        let give_ups = events(&give_ups);
        assert_eq!(give_ups.len(), 1);
        assert_eq!(give_ups[0].attempts, 3);
        assert_eq!(give_ups[0].reason, GiveUp::AttemptsExhausted);
        assert_eq!(
            give_ups[0].status,
            Some(http::StatusCode::SERVICE_UNAVAILABLE)
        );
        assert_eq!(budget_counts(&budget), (1, 2));
    }
}

both_forms! {
    #[tokio::test]
    async fn a_retry_after_longer_than_the_deadline_gives_up_without_a_second_attempt(form) {
        let (url, script) = serve(vec![(503, vec![("retry-after", "5")]), s(200)]).await;
        let (middleware, retries, give_ups) = hooked(middleware());
        let response = client(form, middleware)
            .get(format!("{url}/items"))
            .with_extension(Deadline::after(Duration::from_secs(2)))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        assert!(marked(&response));
        assert_eq!(script.seen().len(), 1);
        assert!(retries.lock().unwrap().is_empty());
        let give_ups = events(&give_ups);
        assert_eq!(give_ups[0].reason, GiveUp::NotEnoughTime);
        assert_eq!(give_ups[0].attempts, 1);
    }
}

// ---------------------------------------------------------------------------------------
// Deadlines
// ---------------------------------------------------------------------------------------

fn timeout_ms(seen: &Seen) -> u64 {
    seen.header("request-timeout-ms").unwrap().parse().unwrap()
}

both_forms! {
    #[tokio::test]
    async fn a_deadline_extension_becomes_a_request_timeout_header_on_every_attempt(form) {
        let (url, script) = serve(vec![s(503), s(503), s(200)]).await;
        let response = client(form, middleware())
            .get(format!("{url}/items"))
            .with_extension(Deadline::after(Duration::from_secs(10)))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let seen = script.seen();
        assert_eq!(seen.len(), 3);
        let left: Vec<u64> = seen.iter().map(timeout_ms).collect();
        // Never more than the deadline, never growing (exact values: the paused-clock test).
        assert!(left[0] <= 10_000);
        assert!(left[1] <= left[0] && left[2] <= left[1], "{left:?}");

        // An inherited deadline counts too.
        let (url, script) = serve(vec![s(200)]).await;
        let ctx = CallContext::new().with_deadline(Deadline::after(Duration::from_secs(3)));
        let client = client(form, middleware());
        ctx.scope(async { client.get(format!("{url}/items")).send().await })
            .await
            .unwrap();
        assert!(timeout_ms(&script.seen()[0]) <= 3_000);
    }
}

both_forms! {
    /// A black hole under a deadline: an explicit `attempt_timeout` cuts the attempt that
    /// never answers and leaves time for the retry, whose answer is the call's; the
    /// attempts' `request-timeout-ms` is the attempt's bound, not the deadline's.
    #[tokio::test]
    async fn an_explicit_attempt_timeout_cuts_a_black_hole_under_a_deadline(form) {
        let calls = Arc::new(AtomicU32::new(0));
        let headers = Arc::new(Mutex::new(Vec::new()));
        let app = {
            let (calls, headers) = (Arc::clone(&calls), Arc::clone(&headers));
            axum::Router::new().fallback(move |request: AxumRequest| {
                let (calls, headers) = (Arc::clone(&calls), Arc::clone(&headers));
                async move {
                    headers.lock().unwrap().push(request.headers().clone());
                    if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                        std::future::pending::<()>().await;
                    }
                    "answered"
                }
            })
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

        let response = Stack::new()
            .strategy(strategy().attempt_timeout(Duration::from_millis(300)))
            .client(form)
            .get(format!("http://{addr}/items"))
            .with_extension(Deadline::after(Duration::from_secs(30)))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.text().await.unwrap(), "answered");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        let headers = headers.lock().unwrap();
        for h in headers.iter() {
            let left: u64 = h["request-timeout-ms"].to_str().unwrap().parse().unwrap();
            assert!(left <= 300, "{left}");
        }
        assert_eq!(headers[1]["retry-attempt"], "2");
    }
}

both_forms! {
    #[tokio::test]
    async fn no_attempt_starts_when_the_deadline_has_passed(form) {
        let (url, script) = serve(vec![s(200)]).await;
        let error = client(form, middleware())
            .get(format!("{url}/items"))
            .with_extension(Deadline::after(Duration::ZERO))
            .send()
            .await
            .unwrap_err();
        assert!(middleware_error::<DeadlineExceeded>(&error).is_some());
        assert!(script.seen().is_empty());
    }
}

/// The end of the chain on the paused clock: records when each attempt came and what it
/// carried, and answers from a script without any I/O.
struct Stub {
    replies: Mutex<VecDeque<Reply>>,
    seen: Attempts,
}

/// When each attempt reached the stub, and its headers.
type Attempts = Arc<Mutex<Vec<(Instant, HeaderMap)>>>;

#[async_trait::async_trait]
impl Middleware for Stub {
    async fn handle(
        &self,
        req: Request,
        _extensions: &mut Extensions,
        _next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        self.seen
            .lock()
            .unwrap()
            .push((Instant::now(), req.headers().clone()));
        let (status, headers) = self
            .replies
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or((200, vec![]));
        let mut b = http::Response::builder().status(status);
        for (name, value) in headers {
            b = b.header(name, value);
        }
        Ok(Response::from(b.body("").unwrap()))
    }
}

fn stubbed(
    form: Form,
    middleware: RetryMiddleware,
    replies: Vec<Reply>,
) -> (ClientWithMiddleware, Attempts) {
    let seen = Arc::default();
    let client = stack(middleware)
        .below(Stub {
            replies: Mutex::new(replies.into()),
            seen: Arc::clone(&seen),
        })
        .client(form);
    (client, seen)
}

both_forms! {
    #[tokio::test(start_paused = true)]
    async fn retry_after_is_a_minimum_delay_and_the_time_left_shrinks_exactly(form) {
        let t0 = Instant::now();
        let (client, seen) = stubbed(
            form,
            middleware(),
            vec![
                (503, vec![("retry-after", "1")]),
                (503, vec![("retry-after", "2")]),
                s(200),
            ],
        );
        let response = client
            .get("http://api.local/items")
            .with_extension(Deadline::after(Duration::from_secs(5)))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let seen = seen.lock().unwrap();
        let at: Vec<Duration> = seen.iter().map(|(t, _)| *t - t0).collect();
        // The backoff is at most 50 ms and 100 ms here: `retry-after` decides, exactly.
        assert_eq!(
            at,
            [
                Duration::ZERO,
                Duration::from_secs(1),
                Duration::from_secs(3)
            ]
        );
        let left: Vec<&str> = seen
            .iter()
            .map(|(_, h)| h["request-timeout-ms"].to_str().unwrap())
            .collect();
        assert_eq!(left, ["5000", "4000", "2000"]);
        let attempts: Vec<Option<&str>> = seen
            .iter()
            .map(|(_, h)| h.get("retry-attempt").map(|v| v.to_str().unwrap()))
            .collect();
        assert_eq!(attempts, [None, Some("2"), Some("3")]);
    }
}

both_forms! {
    #[tokio::test(start_paused = true)]
    async fn a_retry_that_would_outlast_the_deadline_is_not_made(form) {
        // 3 s left after the first 503; retry-after 3 leaves no time for the attempt.
        let (middleware, _, give_ups) = hooked(middleware());
        let replies = vec![(503, vec![("retry-after", "3")]), s(200)];
        let (client, seen) = stubbed(form, middleware, replies);
        let response = client
            .get("http://api.local/items")
            .with_extension(Deadline::after(Duration::from_secs(3)))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        assert!(marked(&response));
        assert_eq!(seen.lock().unwrap().len(), 1);
        assert_eq!(events(&give_ups)[0].reason, GiveUp::NotEnoughTime);
    }
}

// ---------------------------------------------------------------------------------------
// Per-request overrides and the retry point
// ---------------------------------------------------------------------------------------

both_forms! {
    #[tokio::test]
    async fn no_retry_idempotent_and_budget_extensions_override_per_request(form) {
        let client = client(form, middleware());

        let (url, script) = serve(vec![s(503), s(200)]).await;
        let response = client
            .get(format!("{url}/a"))
            .with_extension(NoRetry)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        assert!(!marked(&response));
        assert_eq!(script.seen().len(), 1);

        let (url, script) = serve(vec![s(503), s(201)]).await;
        let response = client
            .post(format!("{url}/b"))
            .with_extension(Idempotent)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        assert_eq!(script.seen().len(), 2);

        // A budget that allows no retry: the 503 is the answer, marked.
        let (url, script) = serve(vec![s(503), s(200)]).await;
        let response = client
            .get(format!("{url}/c"))
            .with_extension(empty_budget())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        assert!(marked(&response));
        assert_eq!(script.seen().len(), 1);
    }
}

#[derive(Clone)]
struct ReadOnly;

both_forms! {
    #[tokio::test]
    async fn idempotent_if_sees_the_head_and_the_extensions(form) {
        let middleware = middleware().idempotent_if(|parts| {
            parts.uri.path().starts_with("/read/") || parts.extensions.get::<ReadOnly>().is_some()
        });
        let client = client(form, middleware);
        let (url, script) = serve(vec![s(503), s(200)]).await;
        let response = client.post(format!("{url}/read/x")).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(script.seen().len(), 2);

        // Declared by an extension the predicate reads; the extensions are still there
        // afterwards (the deadline in them becomes the header).
        let (url, script) = serve(vec![s(503), s(200)]).await;
        client
            .post(format!("{url}/write"))
            .with_extension(ReadOnly)
            .with_extension(Deadline::after(Duration::from_secs(4)))
            .send()
            .await
            .unwrap();
        let seen = script.seen();
        assert_eq!(seen.len(), 2);
        assert!(timeout_ms(&seen[1]) <= 4_000);

        let (url, script) = serve(vec![s(503), s(200)]).await;
        let response = client.post(format!("{url}/write")).send().await.unwrap();
        assert_eq!(response.status(), 503);
        assert_eq!(script.seen().len(), 1);
    }
}

both_forms! {
    #[tokio::test]
    async fn the_retry_point_is_sent_and_an_inherited_one_makes_one_attempt(form) {
        let (url, script) = serve(vec![s(503), s(200)]).await;
        client(form, middleware().retry_point())
            .get(format!("{url}/x"))
            .send()
            .await
            .unwrap();
        let seen = script.seen();
        assert_eq!(seen.len(), 2);
        assert!(
            seen.iter()
                .all(|s| s.header("retry-point") == Some("caller"))
        );

        let (url, script) = serve(vec![s(503), s(200)]).await;
        let ctx = CallContext::new().with_caller_is_retry_point(true);
        let client = client(form, middleware());
        let response = ctx
            .clone()
            .scope(async { client.get(format!("{url}/x")).send().await })
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        assert!(!marked(&response));
        assert!(!ctx.downstream_gave_up());
        let seen = script.seen();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].header("retry-point"), Some("caller"));
    }
}

// ---------------------------------------------------------------------------------------
// Fit
// ---------------------------------------------------------------------------------------

fn assert_send_sync<T: Send + Sync + 'static>(_: &T) {}

#[tokio::test]
async fn the_middleware_fits_the_client_builder_and_its_future_is_send() {
    let middleware = RetryMiddleware::default().generate_idempotency_keys();
    assert_send_sync(&middleware);
    let (url, script) = serve(vec![s(200)]).await;
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware.clone())
        .build();
    // `tokio::spawn` takes only `Send` futures.
    let response = tokio::spawn(client.get(format!("{url}/x")).send())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(script.seen().len(), 1);
    // The same middleware in a second client (a cheap clone).
    let other = ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build();
    assert_eq!(
        other.get(format!("{url}/y")).send().await.unwrap().status(),
        200
    );
    assert!(format!("{other:?}").contains("ClientWithMiddleware"));
}

/// A middleware above the stack that calls it, records the size of the future it
/// returns, and answers without awaiting it.
#[derive(Clone, Default)]
struct FutureSize(Arc<Mutex<Option<usize>>>);

#[async_trait::async_trait]
impl Middleware for FutureSize {
    async fn handle(
        &self,
        req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let future = next.run(req, extensions);
        *self.0.lock().unwrap() = Some(std::mem::size_of_val(&*future));
        drop(future);
        Err(reqwest_middleware::Error::middleware(
            std::io::Error::other("measured, not sent"),
        ))
    }
}

#[tokio::test]
async fn the_fused_middlewares_one_future_fits_the_allocators_thread_cache() {
    // The future the fused middleware returns is boxed once per call. glibc serves
    // blocks of up to 1 032 bytes from its per-thread cache; a larger one goes through
    // the arena, which costs a few hundred instructions more per call. The request is
    // kept once in that future (it was four times, in 3 928 bytes); see BENCHMARKS.md.
    let size = FutureSize::default();
    let builder = ClientBuilder::new(reqwest::Client::new()).with(size.clone());
    let client = retrysafe_reqwest::ClientMiddlewares::new()
        .deadline(Duration::from_secs(10))
        .build()
        .unwrap()
        .apply(builder)
        .build();
    let request = client.post("http://127.0.0.1:9/items").body("a body");
    assert!(request.send().await.is_err());
    let bytes = size.0.lock().unwrap().unwrap();
    assert!(
        bytes <= 1_032,
        "the fused middleware's future is {bytes} bytes"
    );
}

/// A middleware below the retry middleware that leaves a note in the extensions, and
/// records what each attempt saw there.
#[derive(Clone, Default)]
struct Scribble(Arc<Mutex<Vec<(bool, bool)>>>);

#[derive(Clone)]
struct Note;

#[async_trait::async_trait]
impl Middleware for Scribble {
    async fn handle(
        &self,
        request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        use retrysafe_core::strategy::RetryCharged;
        self.0.lock().unwrap().push((
            extensions.get::<Note>().is_some(),
            extensions.get::<RetryCharged>().is_some(),
        ));
        extensions.insert(Note);
        next.run(request, extensions).await
    }
}

#[tokio::test]
async fn each_attempt_starts_from_the_callers_extensions_and_nothing_leaks_back() {
    use retrysafe_core::strategy::RetryCharged;
    use retrysafe_reqwest::DeadlineMiddleware;
    let (url, script) = serve(vec![s(503), s(200), s(503), s(200)]).await;
    let scribble = Scribble::default();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(DeadlineMiddleware::new(Duration::from_millis(500)))
        .with(middleware())
        .with(scribble.clone())
        .build();
    let mut extensions = Extensions::new();
    let request = client.get(format!("{url}/a")).build().unwrap();
    let response = client
        .execute_with_extensions(request, &mut extensions)
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // The retry did not see the first attempt's note; each carried its retry mark.
    assert_eq!(*scribble.0.lock().unwrap(), [(false, true), (false, true)]);
    // The caller's extensions hold no deadline and no retry mark afterwards...
    assert!(extensions.get::<Deadline>().is_none());
    assert!(extensions.get::<RetryCharged>().is_none());
    // ...so reusing them after the first call's deadline has passed works.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let request = client.get(format!("{url}/b")).build().unwrap();
    let response = client
        .execute_with_extensions(request, &mut extensions)
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(script.seen().len(), 4);
}

both_forms! {
    #[tokio::test]
    async fn no_attempt_sees_another_attempts_extensions_and_nothing_leaks_back(form) {
        let (url, script) = serve(vec![s(503), s(200), s(503), s(200)]).await;
        let scribble = Scribble::default();
        let client = stack(middleware())
            .deadline(Duration::from_millis(500))
            .below(scribble.clone())
            .client(form);
        let mut extensions = Extensions::new();
        let request = client.get(format!("{url}/a")).build().unwrap();
        let response = client
            .execute_with_extensions(request, &mut extensions)
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        // The retry did not see the first attempt's note.
        let notes: Vec<bool> = scribble.0.lock().unwrap().iter().map(|s| s.0).collect();
        assert_eq!(notes, [false, false]);
        // The caller's extensions hold no deadline and no retry mark afterwards...
        assert!(extensions.get::<Deadline>().is_none());
        assert!(
            extensions
                .get::<retrysafe_core::strategy::RetryCharged>()
                .is_none()
        );
        // ...so reusing them after the first call's deadline has passed works.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let request = client.get(format!("{url}/b")).build().unwrap();
        let response = client
            .execute_with_extensions(request, &mut extensions)
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(script.seen().len(), 4);
    }
}
