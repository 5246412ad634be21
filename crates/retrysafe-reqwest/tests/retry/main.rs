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

mod deadlines;
mod fit;
mod giving_up;
mod overrides;
mod what_is_retried;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Request as AxumRequest, State};
use axum::response::{IntoResponse, Response as AxumResponse};
use http::{Extensions, HeaderMap, Method};
use reqwest::{Request, Response};
use reqwest_middleware::{ClientWithMiddleware, Middleware, Next};
use retrysafe_core::budget::{RatioConfig, RetryBudget};
use retrysafe_core::retry::{GiveUpEvent, RetryEvent};
use retrysafe_core::strategy::StandardRetryStrategy;
use retrysafe_reqwest::retry::RetryMiddleware;
use retrysafe_test_support::forms::Form;
use retrysafe_test_support::forms::reqwest::Stack;
use tokio::net::TcpListener;

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
