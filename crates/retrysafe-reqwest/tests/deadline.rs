//! The deadline against real axum servers on loopback: a slow server fails the call
//! with `DeadlineExceeded`; every attempt carries the soonest deadline (the stack's own,
//! one already in the extensions, or the inherited one); a call with no time left never
//! leaves; with `bound_body` a stalled response body ends with `DeadlineExceeded`.
//! No timing assertions: only orderings (a deadline is never later than configured).
//!
//! The behavioural tests run on both forms of the client stack (`both_forms!`: the
//! separate `DeadlineMiddleware` → `RetryMiddleware` → `CircuitBreakerMiddleware`, and
//! the fused `ClientMiddlewares`). Single-form, `DeadlineMiddleware` alone:
//! - `the_middleware_below_sees_the_soonest_deadline`: the `Deadline` extension a
//!   middleware below reads, which the fused form does not put there (its documented
//!   difference; both forms send it as `request-timeout-ms`, checked on both);
//! - `bound_body_ends_a_stalled_body_with_deadline_exceeded`:
//!   `DeadlineMiddleware::bound_body`, which `ClientMiddlewares` does not offer;
//! - `configuration_is_validated`, `fits_client_builder_and_is_send_and_sync`: the
//!   standalone middleware's builder and fit.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub
)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State as AxumState;
use axum::routing::get;
use futures_util::StreamExt;
use http::Extensions;
use reqwest_middleware::{ClientBuilder, Middleware, Next};
use retrysafe_core::budget::RetryBudget;
use retrysafe_core::error::DeadlineExceeded;
use retrysafe_core::{CallContext, Deadline, DeadlineExpiry};
use retrysafe_reqwest::DeadlineMiddleware;
use retrysafe_reqwest::error::{find, find_in, is_deadline_exceeded};
use tokio::net::TcpListener;

use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::reqwest::{Stack, budget_counts};

#[derive(Default)]
struct Server {
    hits: AtomicUsize,
    /// The `request-timeout-ms` values `/told` was sent, in milliseconds.
    told: Mutex<Vec<Option<u64>>>,
}

/// Routes: `/fast` answers at once, `/slow` after 10 minutes, `/stall` sends its head
/// and five of the 100 body bytes it announced, then nothing; `/told` records the
/// `request-timeout-ms` it was sent and answers 503 the first time, then 200.
async fn serve() -> (Arc<Server>, String) {
    let server = Arc::new(Server::default());
    let app = Router::new()
        .route(
            "/fast",
            get(|AxumState(s): AxumState<Arc<Server>>| async move {
                s.hits.fetch_add(1, Ordering::SeqCst);
                "fast"
            }),
        )
        .route(
            "/slow",
            get(|AxumState(s): AxumState<Arc<Server>>| async move {
                s.hits.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(600)).await;
                "slow"
            }),
        )
        .route(
            "/stall",
            get(|AxumState(s): AxumState<Arc<Server>>| async move {
                s.hits.fetch_add(1, Ordering::SeqCst);
                let chunks = futures_util::stream::iter([Ok::<_, std::io::Error>("hello")])
                    .chain(futures_util::stream::pending());
                axum::response::Response::builder()
                    .header("content-length", "100")
                    .body(Body::from_stream(chunks))
                    .unwrap()
            }),
        )
        .route(
            "/told",
            get(
                |AxumState(s): AxumState<Arc<Server>>, headers: http::HeaderMap| async move {
                    let told = headers
                        .get("request-timeout-ms")
                        .map(|v| v.to_str().unwrap().parse().unwrap());
                    s.told.lock().unwrap().push(told);
                    match s.hits.fetch_add(1, Ordering::SeqCst) {
                        0 => http::StatusCode::SERVICE_UNAVAILABLE,
                        _ => http::StatusCode::OK,
                    }
                },
            ),
        )
        .with_state(server.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (server, format!("http://{addr}"))
}

/// A middleware below the deadline: records the `Deadline` it is given (the time left
/// then) and the `request-timeout-ms` the request carries, and whether it was called at
/// all.
#[derive(Clone, Default)]
struct Probe {
    seen: Arc<Mutex<Vec<Option<Duration>>>>,
    told: Arc<Mutex<Vec<Option<u64>>>>,
}

#[async_trait::async_trait]
impl Middleware for Probe {
    async fn handle(
        &self,
        request: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let left = extensions.get::<Deadline>().map(|d| d.remaining());
        self.seen.lock().unwrap().push(left);
        let told = request
            .headers()
            .get("request-timeout-ms")
            .map(|v| v.to_str().unwrap().parse().unwrap());
        self.told.lock().unwrap().push(told);
        next.run(request, extensions).await
    }
}

impl Probe {
    fn seen(&self) -> Vec<Option<Duration>> {
        self.seen.lock().unwrap().clone()
    }

    /// The `request-timeout-ms` of every request, in milliseconds.
    fn told(&self) -> Vec<u64> {
        let told = self.told.lock().unwrap();
        told.iter()
            .map(|t| t.expect("request-timeout-ms sent"))
            .collect()
    }
}

/// Counts the expiries its hook is called for.
fn expiries() -> (
    Arc<AtomicUsize>,
    impl Fn(&DeadlineExpiry) + Send + Sync + 'static,
) {
    let count = Arc::new(AtomicUsize::new(0));
    let counted = count.clone();
    (count, move |_: &DeadlineExpiry| {
        counted.fetch_add(1, Ordering::SeqCst);
    })
}

fn client(deadline: DeadlineMiddleware, probe: &Probe) -> reqwest_middleware::ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(deadline)
        .with(probe.clone())
        .build()
}

both_forms! {
    #[tokio::test]
    async fn a_slow_server_fails_the_call_with_deadline_exceeded(form) {
        let (server, base) = serve().await;
        let (expired, on_expiry) = expiries();
        let client = Stack::new()
            .deadline(Duration::from_millis(200))
            .on_expiry(on_expiry)
            .client(form);

        let error = client.get(format!("{base}/slow")).send().await.unwrap_err();
        assert!(is_deadline_exceeded(&error), "{error:?}");
        assert!(find::<DeadlineExceeded>(&error).is_some());
        assert_eq!(error.to_string(), "deadline exceeded");
        assert_eq!(server.hits.load(Ordering::SeqCst), 1);
        // Counted once, however many layers saw it.
        assert_eq!(expired.load(Ordering::SeqCst), 1);

        // A fast answer passes through untouched.
        let response = client.get(format!("{base}/fast")).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.text().await.unwrap(), "fast");
        assert_eq!(server.hits.load(Ordering::SeqCst), 2);
        assert_eq!(expired.load(Ordering::SeqCst), 1);
    }
}

/// Four calls to `url`, each with another deadline besides the client's own (60 s): its
/// own alone, a sooner one per request (5 s), a later one per request (1 h), and an
/// inherited one (2 s).
async fn send_with_four_deadlines(client: &reqwest_middleware::ClientWithMiddleware, url: &str) {
    // Its own.
    client.get(url).send().await.unwrap();
    // A sooner one set per request.
    client
        .get(url)
        .with_extension(Deadline::after(Duration::from_secs(5)))
        .send()
        .await
        .unwrap();
    // A later one per request: ours is sooner.
    client
        .get(url)
        .with_extension(Deadline::after(Duration::from_secs(3600)))
        .send()
        .await
        .unwrap();
    // The inherited one, of the inbound request being served.
    CallContext::new()
        .with_deadline(Deadline::after(Duration::from_secs(2)))
        .scope(async { client.get(url).send().await.unwrap() })
        .await;
}

#[tokio::test]
async fn the_middleware_below_sees_the_soonest_deadline() {
    let (_server, base) = serve().await;
    let probe = Probe::default();
    let timeout = Duration::from_secs(60);
    let client = client(DeadlineMiddleware::new(timeout), &probe);
    let url = format!("{base}/fast");

    send_with_four_deadlines(&client, &url).await;

    let seen: Vec<Duration> = probe.seen().into_iter().map(Option::unwrap).collect();
    assert_eq!(seen.len(), 4);
    assert!(
        seen[0] <= timeout && seen[0] > Duration::from_secs(5),
        "{seen:?}"
    );
    assert!(seen[1] <= Duration::from_secs(5), "{seen:?}");
    assert!(
        seen[2] <= timeout && seen[2] > Duration::from_secs(5),
        "{seen:?}"
    );
    assert!(seen[3] <= Duration::from_secs(2), "{seen:?}");
}

both_forms! {
    /// What the single-form test above checks of the `Deadline` extension, as every
    /// attempt tells the server: `request-timeout-ms`.
    #[tokio::test]
    async fn every_attempt_carries_the_soonest_deadline(form) {
        let (_server, base) = serve().await;
        let probe = Probe::default();
        let timeout = Duration::from_secs(60);
        let client = Stack::new().deadline(timeout).below(probe.clone()).client(form);
        let url = format!("{base}/fast");

        send_with_four_deadlines(&client, &url).await;

        let told = probe.told();
        assert_eq!(told.len(), 4);
        assert!(told[0] <= 60_000 && told[0] > 5_000, "{told:?}");
        assert!(told[1] <= 5_000, "{told:?}");
        assert!(told[2] <= 60_000 && told[2] > 5_000, "{told:?}");
        assert!(told[3] <= 2_000, "{told:?}");
    }

    #[tokio::test]
    async fn with_the_retry_every_attempt_tells_the_server_the_time_left(form) {
        let (server, base) = serve().await;
        let probe = Probe::default();
        let client = Stack::new()
            .deadline(Duration::from_millis(5_000))
            .below(probe.clone())
            .client(form);

        let response = client.get(format!("{base}/told")).send().await.unwrap();
        assert_eq!(response.status(), 200);
        let told: Vec<u64> = server
            .told
            .lock()
            .unwrap()
            .iter()
            .map(|t| t.expect("request-timeout-ms sent"))
            .collect();
        assert_eq!(told.len(), 2);
        // Never more than the deadline, and less on the retry than on the first attempt.
        assert!(told[0] <= 5_000, "{told:?}");
        assert!(told[1] <= told[0], "{told:?}");
        // Each attempt passed the middleware below with it.
        assert_eq!(probe.told(), told);
    }

    /// A call whose deadline has passed fails before the retry starts: nothing below
    /// is called, nothing is deposited into the budget, and the expiry is counted once.
    #[tokio::test]
    async fn no_time_left_fails_at_once_without_calling_below(form) {
        let (server, base) = serve().await;
        let probe = Probe::default();
        let (expired, on_expiry) = expiries();
        let budget = RetryBudget::ratio();
        let client = Stack::new()
            .deadline(Duration::from_secs(60))
            .on_expiry(on_expiry)
            .budget(budget.clone())
            .below(probe.clone())
            .client(form);

        let spent = Deadline::after(Duration::ZERO);
        let error = client
            .get(format!("{base}/fast"))
            .with_extension(spent)
            .send()
            .await
            .unwrap_err();
        assert!(is_deadline_exceeded(&error));

        let inherited = CallContext::new().with_deadline(spent);
        let error = inherited
            .scope(async { client.get(format!("{base}/fast")).send().await })
            .await
            .unwrap_err();
        assert!(is_deadline_exceeded(&error));

        assert!(probe.seen().is_empty());
        assert_eq!(server.hits.load(Ordering::SeqCst), 0);
        assert_eq!(expired.load(Ordering::SeqCst), 2);
        assert_eq!(budget_counts(&budget), (0, 0));
    }
}

#[tokio::test]
async fn bound_body_ends_a_stalled_body_with_deadline_exceeded() {
    let (_server, base) = serve().await;
    let probe = Probe::default();
    let url = format!("{base}/stall");

    let bounded = client(
        DeadlineMiddleware::new(Duration::from_millis(300)).bound_body(),
        &probe,
    );
    let response = bounded.get(&url).send().await.unwrap();
    assert_eq!(response.status(), 200);
    // The rebuilt response keeps its URL, headers and size hint.
    assert_eq!(response.url().as_str(), url);
    assert_eq!(response.headers()["content-length"], "100");
    assert_eq!(response.content_length(), Some(100));
    let error = response.bytes().await.unwrap_err();
    assert!(find_in::<DeadlineExceeded>(&error).is_some(), "{error:?}");

    // A body that ends in time is read whole.
    let response = bounded.get(format!("{base}/fast")).send().await.unwrap();
    assert_eq!(response.text().await.unwrap(), "fast");

    // Without `bound_body` the deadline stops at the head: the body is the caller's.
    let unbounded = client(DeadlineMiddleware::new(Duration::from_millis(300)), &probe);
    let response = unbounded.get(&url).send().await.unwrap();
    let read = tokio::time::timeout(Duration::from_secs(1), response.bytes()).await;
    assert!(read.is_err(), "the stalled body ended: {read:?}");
}

#[test]
fn configuration_is_validated() {
    assert_eq!(
        DeadlineMiddleware::new(Duration::ZERO)
            .build()
            .unwrap_err()
            .field(),
        "timeout"
    );
    assert_eq!(
        DeadlineMiddleware::new(Duration::from_secs(31 * 24 * 3600))
            .build()
            .unwrap_err()
            .field(),
        "timeout"
    );
    let middleware = DeadlineMiddleware::new(Duration::from_secs(2));
    assert_eq!(middleware.timeout(), Duration::from_secs(2));
}

#[test]
fn fits_client_builder_and_is_send_and_sync() {
    fn send_sync<T: Send + Sync + 'static>(_: &T) {}
    let middleware = DeadlineMiddleware::new(Duration::from_secs(1)).bound_body();
    send_sync(&middleware);
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build();
    let future = client.get("http://127.0.0.1:9/").send();
    fn send_future<F: std::future::Future + Send>(_: &F) {}
    send_future(&future);
}
