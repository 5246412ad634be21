//! The circuit breaker against real axum servers on loopback: a failing server
//! opens the breaker, which then fails fast without reaching it (counted by the
//! server); half-open probes close it on recovery or reopen it; only the callee's own
//! faults count; transport errors, dropped probes and slow calls are recorded like the
//! tower layer records them. No timing assertions: waits only ever let *more* time pass
//! than a breaker needs; the deadline's effect on a 504 is checked on tokio's paused
//! clock.
//!
//! The behavioural tests run on both forms of the client stack (`both_forms!`: the
//! separate `RetryMiddleware` → `CircuitBreakerMiddleware`, and the fused
//! `ClientMiddlewares`); where the breaker alone is tested, the retry makes one attempt
//! per call. Single-form, `CircuitBreakerMiddleware` alone:
//! - `a_504_is_neutral_only_when_the_deadline_sent_was_spent`: a `request-timeout-ms`
//!   the caller writes straight to the breaker (in a stack the retry rewrites it on
//!   every attempt; that case runs on both forms as
//!   `a_504_when_the_deadline_each_attempt_carried_was_spent_is_neutral`);
//! - `configuration_errors_name_the_field`, `fits_client_builder_and_is_send_and_sync`:
//!   the standalone middleware's configuration and fit.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub
)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State as AxumState;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use http::Extensions;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use retrysafe_core::breaker::{BreakerConfig, CircuitBreaker, SlidingWindow, State, StateChange};
use retrysafe_core::budget::RetryBudget;
use retrysafe_core::error::CircuitOpen;
use retrysafe_core::strategy::StandardRetryStrategy;
use retrysafe_reqwest::error::{find, is_circuit_open};
use retrysafe_reqwest::{CircuitBreakerMiddleware, RetryMiddleware};
use retrysafe_tower::breaker::KeyedBreakers;
use tokio::net::TcpListener;

use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::Form;
use retrysafe_test_support::forms::reqwest::{Stack, budget_counts};

/// What the test server answers, and how many requests reached it.
#[derive(Default)]
struct Server {
    hits: AtomicUsize,
    /// The status it answers (200 when 0).
    status: AtomicU16,
    /// Milliseconds it waits before answering; `u64::MAX`: it never answers.
    delay_ms: AtomicU64,
    /// Marks its answers `do-not-retry: 1` (a dependency of it failed).
    marked: std::sync::atomic::AtomicBool,
}

impl Server {
    fn answer(&self, status: u16) {
        self.status.store(status, Ordering::SeqCst);
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

async fn handler(AxumState(server): AxumState<Arc<Server>>) -> (StatusCode, HeaderMap, String) {
    server.hits.fetch_add(1, Ordering::SeqCst);
    match server.delay_ms.load(Ordering::SeqCst) {
        0 => {}
        u64::MAX => std::future::pending::<()>().await,
        ms => tokio::time::sleep(Duration::from_millis(ms)).await,
    }
    let status = match server.status.load(Ordering::SeqCst) {
        0 => StatusCode::OK,
        code => StatusCode::from_u16(code).unwrap(),
    };
    let mut headers = HeaderMap::new();
    if server.marked.load(Ordering::SeqCst) {
        headers.insert("do-not-retry", "1".parse().unwrap());
    }
    (status, headers, "answer".to_owned())
}

async fn serve() -> (Arc<Server>, String) {
    let server = Arc::new(Server::default());
    let app = Router::new()
        .route("/", get(handler))
        .with_state(server.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (server, format!("http://{addr}/"))
}

/// A count window of the last 10 calls, opening at 50 % failures of at least 4 calls,
/// open for `open` (then doubling), with `probes` half-open probes.
fn config(open: Duration, probes: u32) -> BreakerConfig {
    let mut config = BreakerConfig::default();
    config = config.with_window(SlidingWindow::count(10, 10));
    config = config.with_minimum_calls(4);
    config = config.with_open_duration(open);
    config = config.with_max_open_duration(open * 8);
    config = config.with_half_open_probes(probes);
    config
}

/// The client stack with `breaker`, making one attempt per call: what the breaker sees
/// is what the caller sees.
fn client(form: Form, breaker: &CircuitBreaker) -> ClientWithMiddleware {
    one_attempt()
        .breaker(CircuitBreakerMiddleware::new(breaker.clone()))
        .client(form)
}

/// A stack whose retry makes one attempt per call.
fn one_attempt() -> Stack {
    Stack::new().strategy(StandardRetryStrategy::new().max_attempts(1))
}

both_forms! {
    #[tokio::test]
    async fn opens_after_failures_then_fails_fast_without_reaching_the_server(form) {
        let (server, url) = serve().await;
        server.answer(503);
        let breaker = CircuitBreaker::new(config(Duration::from_secs(600), 3));
        let client = client(form, &breaker);

        for n in 1..=4 {
            // The breaker passes the server's answers through while closed.
            let response = client.get(&url).send().await.unwrap();
            assert_eq!(response.status(), 503);
            assert_eq!(response.text().await.unwrap(), "answer");
            assert_eq!(server.hits(), n);
        }
        assert_eq!(breaker.state(), State::Open);

        for _ in 0..10 {
            let error = client.get(&url).send().await.unwrap_err();
            assert!(is_circuit_open(&error), "{error:?}");
            let open = find::<CircuitOpen>(&error).unwrap();
            assert!(open.retry_in() > Duration::ZERO);
            assert!(open.retry_in() <= Duration::from_secs(600));
            assert_eq!(error.to_string(), open.to_string());
        }
        // Nothing reached the server while open.
        assert_eq!(server.hits(), 4);
    }
}

both_forms! {
    /// Per authority: one failing host opens its own breaker only; calls to another host
    /// (another port on loopback) still reach it. The map can be shared with the tower layer.
    #[tokio::test]
    async fn per_authority_breakers_stop_only_the_failing_host(form) {
        let (failing, failing_url) = serve().await;
        let (healthy, healthy_url) = serve().await;
        failing.answer(503);
        healthy.answer(200);
        let keyed = KeyedBreakers::per_authority(config(Duration::from_secs(600), 3));
        let middleware = CircuitBreakerMiddleware::keyed(keyed.clone());
        let client = one_attempt().breaker(middleware.clone()).client(form);

        for _ in 0..4 {
            assert_eq!(client.get(&failing_url).send().await.unwrap().status(), 503);
        }
        let error = client.get(&failing_url).send().await.unwrap_err();
        assert!(is_circuit_open(&error), "{error:?}");
        assert_eq!(failing.hits(), 4);
        for _ in 0..6 {
            assert_eq!(client.get(&healthy_url).send().await.unwrap().status(), 200);
        }
        assert_eq!(healthy.hits(), 6);

        // The middleware's breaker for a host is the shared map's, keyed as the tower
        // layer keys it (the URI's authority).
        let url = reqwest::Url::parse(&failing_url).unwrap();
        let authority = format!("{}:{}", url.host_str().unwrap(), url.port().unwrap());
        let shared = keyed.breaker(&Some(authority.parse().unwrap()));
        assert!(shared.same_breaker(&middleware.breaker_for(&url)));
        assert_eq!(shared.state(), State::Open);
        let healthy_url = reqwest::Url::parse(&healthy_url).unwrap();
        assert_eq!(middleware.breaker_for(&healthy_url).state(), State::Closed);
        // The constructor from a configuration builds such a map of its own.
        let own = CircuitBreakerMiddleware::per_authority(config(Duration::from_secs(1), 1));
        assert!(!own.breaker_for(&url).same_breaker(&shared));
    }
}

both_forms! {
    #[tokio::test]
    async fn half_open_probes_reopen_on_failure_and_close_on_recovery(form) {
        let (server, url) = serve().await;
        server.answer(502);
        let open = Duration::from_millis(50);
        let breaker = CircuitBreaker::new(config(open, 2));
        let client = client(form, &breaker);

        for _ in 0..4 {
            assert_eq!(client.get(&url).send().await.unwrap().status(), 502);
        }
        assert_eq!(breaker.state(), State::Open);

        // After the open duration one probe goes through, fails, and reopens the breaker
        // (for twice as long); the next call is refused without reaching the server.
        tokio::time::sleep(open * 2).await;
        assert_eq!(client.get(&url).send().await.unwrap().status(), 502);
        assert_eq!(server.hits(), 5);
        assert_eq!(breaker.state(), State::Open);
        assert!(is_circuit_open(&client.get(&url).send().await.unwrap_err()));
        assert_eq!(server.hits(), 5);

        // The server recovers: after the (doubled) open duration both probes succeed and
        // close the breaker, with an empty window.
        server.answer(200);
        tokio::time::sleep(open * 4).await;
        for n in 6..=7 {
            assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
            assert_eq!(server.hits(), n);
        }
        assert_eq!(breaker.state(), State::Closed);
        assert_eq!(breaker.window().calls(), 0);
        assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
        assert_eq!(server.hits(), 8);
    }
}

both_forms! {
    #[tokio::test]
    async fn only_the_callees_own_faults_count(form) {
        let (server, url) = serve().await;
        let breaker = CircuitBreaker::new(config(Duration::from_secs(600), 3));
        let client = client(form, &breaker);

        // A dependency of the server failed (it marked its 503s `do-not-retry`): neutral.
        server.answer(503);
        server.marked.store(true, Ordering::SeqCst);
        for _ in 0..10 {
            assert_eq!(client.get(&url).send().await.unwrap().status(), 503);
        }
        assert_eq!(breaker.state(), State::Closed);
        assert_eq!(breaker.window().calls(), 0);

        // Client errors are the callee answering as it should: successes.
        server.marked.store(false, Ordering::SeqCst);
        server.answer(404);
        for _ in 0..10 {
            assert_eq!(client.get(&url).send().await.unwrap().status(), 404);
        }
        assert_eq!(breaker.state(), State::Closed);
        let window = breaker.window();
        assert_eq!(window.calls(), 10);
        assert_eq!(window.failures, 0);
    }
}

#[tokio::test]
async fn a_504_is_neutral_only_when_the_deadline_sent_was_spent() {
    let (server, url) = serve().await;
    server.answer(504);
    let breaker = CircuitBreaker::new(config(Duration::from_secs(600), 3));
    // The breaker alone: the caller writes the header (a retry above rewrites it).
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(CircuitBreakerMiddleware::new(breaker.clone()))
        .build();

    // The server gave up on the 100 ms it was given (it answers after 100 ms): the
    // caller's deadline at work, neutral.
    server.delay_ms.store(100, Ordering::SeqCst);
    for _ in 0..4 {
        let response = client
            .get(&url)
            .header("request-timeout-ms", "100")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 504);
    }
    assert_eq!(breaker.state(), State::Closed);
    assert_eq!(breaker.window().calls(), 0);

    // A 504 long before the 10 minutes it was given is the callee's own timeout.
    server.delay_ms.store(0, Ordering::SeqCst);
    for _ in 0..4 {
        let response = client
            .get(&url)
            .header("request-timeout-ms", "600000")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 504);
    }
    assert_eq!(breaker.state(), State::Open);
}

both_forms! {
    #[tokio::test]
    async fn refused_connections_count_as_failures(form) {
        // A port nothing listens on.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}/");
        let breaker = CircuitBreaker::new(config(Duration::from_secs(600), 3));
        let client = client(form, &breaker);

        for _ in 0..4 {
            let error = client.get(&url).send().await.unwrap_err();
            assert!(error.is_connect(), "{error:?}");
            assert!(!is_circuit_open(&error));
        }
        assert_eq!(breaker.state(), State::Open);
        let error = client.get(&url).send().await.unwrap_err();
        assert!(is_circuit_open(&error));
        assert!(!error.is_connect());
    }
}

both_forms! {
    #[tokio::test]
    async fn a_dropped_probe_counts_as_a_failure(form) {
        let (server, url) = serve().await;
        server.answer(500);
        let open = Duration::from_millis(50);
        let breaker = CircuitBreaker::new(config(open, 1));
        let client = client(form, &breaker);
        for _ in 0..4 {
            assert_eq!(client.get(&url).send().await.unwrap().status(), 500);
        }
        assert_eq!(breaker.state(), State::Open);

        // The server now hangs; the only probe's caller gives up and drops the call.
        server.delay_ms.store(u64::MAX, Ordering::SeqCst);
        tokio::time::sleep(open * 2).await;
        let reached = async {
            while server.hits() < 5 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        };
        tokio::select! {
            result = client.get(&url).send() => panic!("the hanging server answered: {result:?}"),
            () = reached => {} // the probe reached the server: give up on it (drop it)
        }
        assert_eq!(server.hits(), 5);
        // The dropped permit reopened the breaker: the next call is refused.
        assert_eq!(breaker.state(), State::Open);
        assert!(is_circuit_open(&client.get(&url).send().await.unwrap_err()));
        assert_eq!(server.hits(), 5);
    }
}

both_forms! {
    #[tokio::test]
    async fn slow_calls_are_timed_to_the_response_head(form) {
        let (server, url) = serve().await;
        // Every answer takes at least 50 ms: slower than the 5 ms slow-call duration.
        server.delay_ms.store(50, Ordering::SeqCst);
        let mut config = config(Duration::from_secs(600), 3);
        config = config.with_slow_call_duration(Duration::from_millis(5));
        config = config.with_slow_call_rate_threshold(50.0);
        let breaker = CircuitBreaker::new(config);
        let client = client(form, &breaker);

        for _ in 0..4 {
            assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
        }
        assert_eq!(breaker.state(), State::Open);
        assert!(is_circuit_open(&client.get(&url).send().await.unwrap_err()));
        assert_eq!(server.hits(), 4);
    }
}

both_forms! {
    #[tokio::test]
    async fn state_changes_reach_the_configured_hook(form) {
        let (server, url) = serve().await;
        server.answer(503);
        let seen: Arc<Mutex<Vec<(State, State)>>> = Arc::default();
        let mut config = config(Duration::from_secs(600), 3);
        let log = seen.clone();
        config = config.with_on_state_change(move |change: StateChange| {
            log.lock().unwrap().push((change.from, change.to));
        });
        let middleware = CircuitBreakerMiddleware::with_config(config);
        let breaker = middleware.breaker_for(&reqwest::Url::parse(&url).unwrap());
        let client = one_attempt().breaker(middleware.clone()).client(form);

        for _ in 0..4 {
            client.get(&url).send().await.unwrap();
        }
        // Clones of the middleware share the breaker.
        let again = middleware.breaker_for(&reqwest::Url::parse(&url).unwrap());
        assert!(again.same_breaker(&breaker));
        assert_eq!(breaker.state(), State::Open);
        breaker.reset();
        assert_eq!(
            *seen.lock().unwrap(),
            [(State::Closed, State::Open), (State::Open, State::Closed)]
        );
    }
}

#[test]
fn configuration_errors_name_the_field() {
    let mut config = BreakerConfig::default();
    config = config.with_minimum_calls(0);
    let error = config.build().unwrap_err();
    assert_eq!(error.field(), "minimum_calls");
}

#[test]
fn fits_client_builder_and_is_send_and_sync() {
    fn send_sync<T: Send + Sync + 'static>(_: &T) {}
    let middleware = CircuitBreakerMiddleware::default()
        .convention(retrysafe_core::wire::Convention::default())
        .classifier(retrysafe_core::classify::DefaultClassifier::default().retry_500(true));
    send_sync(&middleware);
    assert!(format!("{middleware:?}").starts_with("CircuitBreakerMiddleware"));
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build();
    // The request future of a client with the middleware can be spawned.
    let future = client.get("http://127.0.0.1:9/").send();
    fn send_future<F: std::future::Future + Send>(_: &F) {}
    send_future(&future);
}

both_forms! {
    #[tokio::test]
    async fn below_the_retry_middleware_every_attempt_passes_the_breaker_and_open_stops_retries(form) {
        let (server, url) = serve().await;
        server.answer(503);
        let breaker = CircuitBreaker::new(config(Duration::from_secs(600), 3));
        let client = Stack::new()
            .breaker(CircuitBreakerMiddleware::new(breaker.clone()))
            .client(form);

        // Three attempts (the standard strategy's), each counted by the breaker; the retry
        // middleware gives up with the last answer, marked for the layers above.
        let response = client.get(&url).send().await.unwrap();
        assert_eq!(response.status(), 503);
        assert_eq!(response.headers()["do-not-retry"], "1");
        assert_eq!(server.hits(), 3);
        assert_eq!(breaker.window().failures, 3);

        // The fourth failure opens the breaker: the retry after it is refused by the
        // breaker (a refusal is never retried), and the retry middleware answers with the
        // last real response.
        let response = client.get(&url).send().await.unwrap();
        assert_eq!(response.status(), 503);
        assert_eq!(response.headers()["do-not-retry"], "1");
        assert_eq!(server.hits(), 4);
        assert_eq!(breaker.state(), State::Open);
        // Open: the first attempt is refused, nothing is sent, nothing is retried.
        let error = client.get(&url).send().await.unwrap_err();
        assert!(is_circuit_open(&error), "{error:?}");
        assert_eq!(server.hits(), 4);
    }
}

both_forms! {
    #[tokio::test]
    async fn a_breaker_in_the_request_extensions_overrides_the_middlewares(form) {
        let (server, url) = serve().await;
        server.answer(503);
        let own = CircuitBreaker::new(config(Duration::from_secs(600), 3));
        let chosen = CircuitBreaker::new(config(Duration::from_secs(600), 3));
        let client = client(form, &own);
        for _ in 0..4 {
            let response = client
                .get(&url)
                .with_extension(chosen.clone())
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 503);
        }
        // Counted on the chosen breaker only.
        assert_eq!(chosen.state(), State::Open);
        assert_eq!(own.state(), State::Closed);
        assert_eq!(own.window().calls(), 0);
        let error = client
            .get(&url)
            .with_extension(chosen.clone())
            .send()
            .await
            .unwrap_err();
        assert!(is_circuit_open(&error));
        // Without the extension: the middleware's own breaker, still closed.
        assert_eq!(client.get(&url).send().await.unwrap().status(), 503);
        assert_eq!(server.hits(), 5);
    }
}

/// The end of the chain on the paused clock: answers 504 after the delay it is set to
/// (in milliseconds), without any I/O; counts the attempts that reach it.
#[derive(Clone, Default)]
struct Late {
    delay_ms: Arc<AtomicU64>,
    hits: Arc<AtomicUsize>,
}

#[async_trait::async_trait]
impl Middleware for Late {
    async fn handle(
        &self,
        _request: reqwest::Request,
        _extensions: &mut Extensions,
        _next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        self.hits.fetch_add(1, Ordering::SeqCst);
        let delay = Duration::from_millis(self.delay_ms.load(Ordering::SeqCst));
        tokio::time::sleep(delay).await;
        let response = http::Response::builder().status(504).body("").unwrap();
        Ok(reqwest::Response::from(response))
    }
}

both_forms! {
    /// The deadline each attempt carries (`request-timeout-ms`, written by the retry from
    /// the stack's deadline) decides: a 504 that comes when it was spent is the caller's
    /// deadline at work, neutral; one that comes early is the callee's own timeout.
    #[tokio::test(start_paused = true)]
    async fn a_504_when_the_deadline_each_attempt_carried_was_spent_is_neutral(form) {
        let breaker = CircuitBreaker::new(config(Duration::from_secs(600), 3));
        let late = Late::default();
        let client = one_attempt()
            .deadline(Duration::from_secs(1))
            .breaker(CircuitBreakerMiddleware::new(breaker.clone()))
            .below(late.clone())
            .client(form);

        // 950 ms of the 1 000 sent: within the last tenth.
        late.delay_ms.store(950, Ordering::SeqCst);
        for _ in 0..4 {
            assert_eq!(client.get("http://api.local/").send().await.unwrap().status(), 504);
        }
        assert_eq!(breaker.state(), State::Closed);
        assert_eq!(breaker.window().calls(), 0);

        late.delay_ms.store(0, Ordering::SeqCst);
        for _ in 0..4 {
            assert_eq!(client.get("http://api.local/").send().await.unwrap().status(), 504);
        }
        assert_eq!(breaker.state(), State::Open);
        assert_eq!(late.hits.load(Ordering::SeqCst), 8);
    }

    /// A breaker's refusal is a local failure: the retry never retries it, nothing is
    /// withdrawn from the budget, nothing reaches the network; with breakers per host,
    /// only the open host's calls are refused.
    #[tokio::test]
    async fn a_refusal_of_the_breaker_is_never_retried(form) {
        let (server, url) = serve().await;
        let (other, other_url) = serve().await;
        let keyed = KeyedBreakers::per_authority(config(Duration::from_secs(600), 3));
        let authority = url.trim_start_matches("http://").trim_end_matches('/');
        keyed.breaker(&Some(authority.parse().unwrap())).force_open();
        let retries = Arc::new(AtomicUsize::new(0));
        let counted = retries.clone();
        let budget = RetryBudget::ratio();
        let client = Stack::new()
            .retry(RetryMiddleware::new().on_retry(move |_| {
                counted.fetch_add(1, Ordering::SeqCst);
            }))
            .budget(budget.clone())
            .breaker(CircuitBreakerMiddleware::keyed(keyed))
            .client(form);

        let error = client.get(&url).send().await.unwrap_err();
        assert!(is_circuit_open(&error), "{error:?}");
        assert_eq!(server.hits(), 0);
        assert_eq!(retries.load(Ordering::SeqCst), 0);
        assert_eq!(budget_counts(&budget), (1, 0));

        // Another host, its own breaker: closed.
        assert_eq!(client.get(&other_url).send().await.unwrap().status(), 200);
        assert_eq!(other.hits(), 1);
    }
}
