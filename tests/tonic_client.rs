//! The recommended client stack on a tonic `Channel`, wrapped by a generated
//! client (`grpc.health.v1` from tonic-health), against real tonic servers on loopback —
//! the gRPC twin of `client_stack.rs`:
//!
//! `DeadlineLayer` → `RetryLayer` → `RetryBudgetLayer` → `CircuitBreakerLayer` → the one
//! adapter line (`ReplayBody<tonic::body::Body>` into `tonic::body::Body`) → `Channel`,
//! every layer answering its local failures as synthesised gRPC statuses — and the same
//! tests again on `ClientLayers::grpc()`, which a generated client takes directly.
//!
//! A scripted `Health` server answers each call with the next step of its script
//! (Trailers-Only statuses, as tonic sends a failed unary call) and records the
//! convention headers of every attempt. Retries follow gRFC A6: `UNAVAILABLE` is retried,
//! `RESOURCE_EXHAUSTED` only with a pushback, a negative pushback never, and a status in
//! the trailers of a stream never. Local failures reach the generated client with the
//! right code — `DEADLINE_EXCEEDED` or `UNAVAILABLE`, never `UNKNOWN`. No timing
//! assertions: only counts, codes, headers and orderings.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub
)]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::{self, BoxStream};
use http::{Request, Response};
use retrysafe::answer::GrpcStatusLayer;
use retrysafe::breaker::ResponseBody;
use retrysafe::breaker::{BreakerConfig, CircuitBreaker, SlidingWindow, State};
use retrysafe::budget::RatioConfig;
use retrysafe::retry::Idempotent;
use retrysafe::retry::{Backoff, Jitter};
use retrysafe::wire::parse_grpc_timeout;
use retrysafe::{
    CircuitBreakerLayer, ClientLayers, DeadlineLayer, ReplayBody, RetryBudget, RetryBudgetLayer,
    RetryLayer, StandardRetryStrategy,
};
use retrysafe_test_support::observe::Recorder;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tonic::body::Body as GrpcBody;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tower::{Layer, ServiceBuilder};

use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::Form;
use tower::util::{BoxCloneSyncService, MapRequestLayer};

/// The client stack as one cloneable type, for `HealthClient::new`. Its error is a
/// `tonic::Status` (the outermost `map_err`, which is what the generated client makes of
/// any error anyway): with `BoxError` inside a boxed service, a generated client's call
/// cannot be awaited where `Send` is required — in a tonic handler, or a spawned task —
/// because of rustc's "implementation of `From` is not general enough" limitation
/// (rust-lang/rust#64552).
type Stack = BoxCloneSyncService<Request<GrpcBody>, Response<ResponseBody<GrpcBody>>, Status>;
type Client = HealthClient<Stack>;

// ---------------------------------------------------------------------------------------
// The scripted server
// ---------------------------------------------------------------------------------------

/// What the server does with one call.
#[derive(Debug, Clone)]
enum Step {
    /// Answers with this serving status.
    Serve(ServingStatus),
    /// Fails with `code` (Trailers-Only), with this `grpc-retry-pushback-ms`, if any.
    Fail(Code, Option<&'static str>),
    /// Waits until the script is released, then answers SERVING.
    Hang,
}

/// The convention headers one attempt carried, as the server saw them.
#[derive(Debug, Clone)]
struct Seen {
    method: &'static str,
    previous_attempts: Option<String>,
    retry_attempt: Option<String>,
    grpc_timeout: Option<Duration>,
}

#[derive(Debug, Default)]
struct Script {
    steps: Mutex<VecDeque<Step>>,
    seen: Mutex<Vec<Seen>>,
    arrived: Notify,
    release: Notify,
}

impl Script {
    fn new(steps: impl IntoIterator<Item = Step>) -> Arc<Self> {
        Arc::new(Script {
            steps: Mutex::new(steps.into_iter().collect()),
            ..Script::default()
        })
    }

    /// Records an attempt and takes its step (SERVING once the script is spent).
    fn next(&self, method: &'static str, metadata: &MetadataMap) -> Step {
        let text = |name: &str| metadata.get(name).map(|v| v.to_str().unwrap().to_owned());
        self.seen.lock().unwrap().push(Seen {
            method,
            previous_attempts: text("grpc-previous-rpc-attempts"),
            retry_attempt: text("retry-attempt"),
            grpc_timeout: text("grpc-timeout").map(|t| parse_grpc_timeout(t.as_bytes()).unwrap()),
        });
        self.steps
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or(Step::Serve(ServingStatus::Serving))
    }

    fn calls(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

fn answer(status: ServingStatus) -> HealthCheckResponse {
    HealthCheckResponse {
        status: status.into(),
    }
}

fn failure(code: Code, pushback: Option<&'static str>) -> Status {
    let mut status = Status::new(code, format!("scripted {code:?}"));
    if let Some(ms) = pushback {
        status
            .metadata_mut()
            .insert("grpc-retry-pushback-ms", MetadataValue::from_static(ms));
    }
    status
}

struct Scripted(Arc<Script>);

#[tonic::async_trait]
impl Health for Scripted {
    async fn check(
        &self,
        request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<HealthCheckResponse>, Status> {
        match self.0.next("check", request.metadata()) {
            Step::Serve(status) => Ok(tonic::Response::new(answer(status))),
            Step::Fail(code, pushback) => Err(failure(code, pushback)),
            Step::Hang => {
                self.0.arrived.notify_one();
                self.0.release.notified().await;
                Ok(tonic::Response::new(answer(ServingStatus::Serving)))
            }
        }
    }

    type WatchStream = BoxStream<'static, Result<HealthCheckResponse, Status>>;

    /// Headers and one SERVING message first, then `UNAVAILABLE` in the trailers.
    async fn watch(
        &self,
        request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, Status> {
        self.0.next("watch", request.metadata());
        let items = vec![
            Ok(answer(ServingStatus::Serving)),
            Err(Status::unavailable("the stream broke")),
        ];
        Ok(tonic::Response::new(stream::iter(items).boxed()))
    }
}

/// Serves `script` on 127.0.0.1:0; at most `limit` concurrent calls per connection.
async fn serve(script: &Arc<Script>, limit: Option<usize>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut builder = Server::builder();
    if let Some(n) = limit {
        builder = builder.concurrency_limit_per_connection(n);
    }
    let router = builder.add_service(HealthServer::new(Scripted(script.clone())));
    tokio::spawn(router.serve_with_incoming(TcpIncoming::from(listener)));
    addr
}

fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy()
}

// ---------------------------------------------------------------------------------------
// The client stack
// ---------------------------------------------------------------------------------------

/// How a test builds its stack.
struct Config {
    form: Form,
    deadline: Duration,
    /// Declares the read-only Health methods idempotent (`idempotent_if`).
    idempotent_if: bool,
    strategy_budget: RetryBudget,
    layer_budget: RetryBudget,
    breaker: CircuitBreaker,
    /// Receives the delay of every retry.
    delays: Arc<Mutex<Vec<Duration>>>,
}

impl Config {
    fn new(form: Form) -> Self {
        let budget = RetryBudget::ratio();
        Config {
            form,
            deadline: Duration::from_secs(5),
            idempotent_if: true,
            strategy_budget: budget.clone(),
            layer_budget: budget,
            breaker: breaker(10),
            delays: Arc::default(),
        }
    }
}

/// A count window of the last 10 calls, opening at 50 % failures of `minimum_calls`,
/// open for a minute (no half-open probe during a test).
fn breaker(minimum_calls: u32) -> CircuitBreaker {
    let mut config = BreakerConfig::default();
    config = config.with_window(SlidingWindow::count(10, 10));
    config = config.with_minimum_calls(minimum_calls);
    config = config.with_open_duration(Duration::from_secs(60));
    config = config.with_max_open_duration(Duration::from_secs(60));
    CircuitBreaker::new(config)
}

/// A budget that never affords a retry.
fn empty_budget() -> RetryBudget {
    let mut config = RatioConfig::default();
    config = config.with_min_per_sec(0);
    config = config.with_retry_ratio(0.0);
    RetryBudget::ratio_with(config)
}

fn is_health_method(parts: &http::request::Parts) -> bool {
    parts.uri.path().starts_with("/grpc.health.v1.Health/")
}

/// The standard client stack over `channel`: 3 attempts with a 1–5 ms seeded backoff.
fn stack(channel: Channel, config: &Config) -> Stack {
    let backoff = Backoff::new(
        Duration::from_millis(1),
        Duration::from_millis(5),
        Jitter::Full,
    );
    let strategy = StandardRetryStrategy::new()
        .backoff(backoff)
        .budget(config.strategy_budget.clone())
        .seed(6);
    let delays = config.delays.clone();
    let mut retry = RetryLayer::new()
        .strategy(strategy)
        .on_retry(move |event| delays.lock().unwrap().push(event.delay));
    if config.idempotent_if {
        retry = retry.idempotent_if(is_health_method);
    }
    if config.form == Form::Fused {
        // The budget given once: the two budgets of the separate form are one here.
        let layers = ClientLayers::new()
            .deadline(config.deadline)
            .retry(retry)
            .budget(config.layer_budget.clone())
            .breaker(CircuitBreakerLayer::new(config.breaker.clone()));
        return BoxCloneSyncService::new(layers.grpc().layer(channel));
    }
    let svc = ServiceBuilder::new()
        .map_err(Status::from_error)
        // The one place local failures become gRPC statuses.
        .layer(GrpcStatusLayer::new())
        .layer(DeadlineLayer::new(config.deadline))
        .layer(retry)
        .layer(RetryBudgetLayer::new(config.layer_budget.clone()))
        .layer(CircuitBreakerLayer::new(config.breaker.clone()))
        // The one adapter line: `Channel` takes only `tonic::body::Body`.
        .layer(MapRequestLayer::new(|r: Request<ReplayBody<GrpcBody>>| {
            r.map(GrpcBody::new)
        }))
        .service(channel);
    BoxCloneSyncService::new(svc)
}

fn client(addr: SocketAddr, config: &Config) -> Client {
    HealthClient::new(stack(channel(addr), config))
}

fn check_request() -> HealthCheckRequest {
    HealthCheckRequest {
        service: String::new(),
    }
}

async fn check(client: &mut Client) -> Result<ServingStatus, Status> {
    let response = client.check(check_request()).await?;
    Ok(response.into_inner().status())
}

fn do_not_retry(status: &Status) -> Option<&str> {
    status
        .metadata()
        .get("do-not-retry")
        .map(|v| v.to_str().unwrap())
}

// ---------------------------------------------------------------------------------------
// Retries (gRFC A6)
// ---------------------------------------------------------------------------------------

async fn unavailable_then_ok_is_retried_with_the_attempt_headers(form: Form) {
    let script = Script::new([Step::Fail(Code::Unavailable, None)]);
    let addr = serve(&script, None).await;
    let mut client = client(addr, &Config::new(form));

    assert_eq!(check(&mut client).await.unwrap(), ServingStatus::Serving);

    let seen = script.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(seen.iter().all(|s| s.method == "check"));
    assert_eq!(seen[0].previous_attempts, None);
    assert_eq!(seen[0].retry_attempt, None);
    assert_eq!(seen[1].previous_attempts.as_deref(), Some("1"));
    assert_eq!(seen[1].retry_attempt.as_deref(), Some("2"));
}

async fn a_check_is_sent_once_unless_declared_idempotent(form: Form) {
    // gRPC calls are POSTs: not safe to repeat by default.
    let script = Script::new([Step::Fail(Code::Unavailable, None)]);
    let addr = serve(&script, None).await;
    let undeclared = Config {
        idempotent_if: false,
        ..Config::new(form)
    };
    let mut plain = client(addr, &undeclared);
    let status = check(&mut plain).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(status.message(), "scripted Unavailable");
    assert_eq!(script.calls(), 1);

    // The `Idempotent` request extension declares one call safe: it travels from the
    // tonic request into the http request the stack sees.
    let script = Script::new([Step::Fail(Code::Unavailable, None)]);
    let addr = serve(&script, None).await;
    let mut plain = client(addr, &undeclared);
    let mut request = tonic::Request::new(check_request());
    request.extensions_mut().insert(Idempotent);
    let response = plain.check(request).await.unwrap();
    assert_eq!(response.into_inner().status(), ServingStatus::Serving);
    assert_eq!(script.calls(), 2);
}

async fn resource_exhausted_is_retried_only_with_a_pushback_which_is_the_delay(form: Form) {
    let script = Script::new([Step::Fail(Code::ResourceExhausted, None)]);
    let addr = serve(&script, None).await;
    let config = Config::new(form);
    let mut client_a = client(addr, &config);
    let status = check(&mut client_a).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(script.calls(), 1);
    assert!(config.delays.lock().unwrap().is_empty());

    let script = Script::new([Step::Fail(Code::ResourceExhausted, Some("7"))]);
    let addr = serve(&script, None).await;
    let config = Config::new(form);
    let mut client_b = client(addr, &config);
    assert_eq!(check(&mut client_b).await.unwrap(), ServingStatus::Serving);
    assert_eq!(script.calls(), 2);
    // gRFC A6: the pushback is the delay itself, not a minimum.
    assert_eq!(*config.delays.lock().unwrap(), [Duration::from_millis(7)]);
}

async fn a_negative_pushback_is_never_retried(form: Form) {
    for code in [Code::Unavailable, Code::ResourceExhausted] {
        let script = Script::new([Step::Fail(code, Some("-1"))]);
        let addr = serve(&script, None).await;
        let mut client = client(addr, &Config::new(form));
        let status = check(&mut client).await.unwrap_err();
        assert_eq!(status.code(), code);
        assert_eq!(
            script.calls(),
            1,
            "{code:?} with a negative pushback was retried"
        );
    }
}

async fn a_status_in_the_trailers_of_a_stream_is_never_retried(form: Form) {
    let script = Script::new([]);
    let addr = serve(&script, None).await;
    let mut client = client(addr, &Config::new(form));

    let mut stream = client.watch(check_request()).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.status(), ServingStatus::Serving);
    // The status comes after the headers and a message: past the commit point.
    let status = stream.message().await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(status.message(), "the stream broke");
    assert!(stream.message().await.unwrap().is_none());
    let seen = script.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].method, "watch");
}

// ---------------------------------------------------------------------------------------
// Deadlines
// ---------------------------------------------------------------------------------------

async fn grpc_timeout_is_sent_on_every_attempt_and_shrinks(form: Form) {
    let script = Script::new([
        Step::Fail(Code::Unavailable, None),
        Step::Fail(Code::Unavailable, None),
    ]);
    let addr = serve(&script, None).await;
    let deadline = Duration::from_secs(5);
    let mut client = client(
        addr,
        &Config {
            deadline,
            ..Config::new(form)
        },
    );

    assert_eq!(check(&mut client).await.unwrap(), ServingStatus::Serving);

    let timeouts: Vec<Duration> = script
        .seen()
        .iter()
        .map(|s| s.grpc_timeout.expect("every attempt carries grpc-timeout"))
        .collect();
    assert_eq!(timeouts.len(), 3);
    assert!(timeouts[0] <= deadline, "{timeouts:?}");
    assert!(timeouts[0] > timeouts[1], "{timeouts:?}");
    assert!(timeouts[1] > timeouts[2], "{timeouts:?}");
    assert!(timeouts[2] > Duration::ZERO, "{timeouts:?}");
}

async fn a_deadline_that_runs_out_is_deadline_exceeded_for_the_generated_client(form: Form) {
    // One call at a time per connection: a first call (without a deadline, so tonic's
    // own timer never runs) holds the server, and the next waits for it past its
    // deadline, however slow the machine.
    let script = Script::new([Step::Hang]);
    let addr = serve(&script, Some(1)).await;
    let channel = channel(addr);
    let mut blocker = HealthClient::new(channel.clone());
    let held = tokio::spawn(async move { blocker.check(check_request()).await });
    script.arrived.notified().await;

    let config = Config {
        deadline: Duration::from_millis(300),
        ..Config::new(form)
    };
    let mut client = HealthClient::new(stack(channel, &config));
    let status = check(&mut client).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert_eq!(do_not_retry(&status), Some("1"));
    assert_eq!(status.message(), "deadline exceeded");
    // Only the first call reached the handler.
    assert_eq!(script.calls(), 1);

    script.release.notify_one();
    let response = held.await.unwrap().unwrap();
    assert_eq!(response.into_inner().status(), ServingStatus::Serving);
}

// ---------------------------------------------------------------------------------------
// Breaker and budget: local failures as statuses, never UNKNOWN
// ---------------------------------------------------------------------------------------

async fn an_open_breaker_is_unavailable_without_reaching_the_server(form: Form) {
    let script = Script::new(std::iter::repeat_n(
        Step::Fail(Code::Unavailable, None),
        100,
    ));
    let addr = serve(&script, None).await;
    let cb = breaker(4);
    let config = Config {
        breaker: cb.clone(),
        ..Config::new(form)
    };
    let mut client = client(addr, &config);

    for _ in 0..10 {
        if cb.state() == State::Open {
            break;
        }
        let status = check(&mut client).await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        // Given up (or refused): no layer above retries it.
        assert_eq!(do_not_retry(&status), Some("1"));
    }
    assert_eq!(cb.state(), State::Open);

    let before = script.calls();
    let status = check(&mut client).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("circuit open"), "{status:?}");
    assert_eq!(do_not_retry(&status), Some("1"));
    assert_eq!(script.calls(), before, "an open breaker let a call through");
}

async fn a_budget_layer_that_refuses_a_retry_is_unavailable(form: Form) {
    // The budget layer holds a budget of its own, empty: it refuses the retry the
    // retry layer charged to another budget (a synthesised UNAVAILABLE). The retry
    // layer then gives up with the server's real answer before it, marked, as it does
    // when the refusal is an error.
    let script = Script::new([Step::Fail(Code::Unavailable, None)]);
    let addr = serve(&script, None).await;
    let config = Config {
        layer_budget: empty_budget(),
        ..Config::new(form)
    };
    let mut first = client(addr, &config);

    let status = check(&mut first).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(status.message(), "scripted Unavailable");
    assert_eq!(do_not_retry(&status), Some("1"));
    assert_eq!(script.calls(), 1);

    // On a first attempt (nothing real before it) the refusal itself is the answer.
    let script = Script::new([]);
    let addr = serve(&script, None).await;
    let mut second = client(addr, &config);
    let mut request = tonic::Request::new(check_request());
    request
        .metadata_mut()
        .insert("retry-attempt", "2".parse().unwrap());
    let status = second.check(request).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("budget"), "{status:?}");
    assert_eq!(do_not_retry(&status), Some("1"));
    assert_eq!(script.calls(), 0);
}

async fn an_exhausted_shared_budget_returns_the_last_answer_marked(form: Form) {
    // One budget for the retry layer and the budget layer, empty: the retry layer does
    // not retry, and returns the server's own answer marked do-not-retry.
    let script = Script::new([Step::Fail(Code::Unavailable, None)]);
    let addr = serve(&script, None).await;
    let budget = empty_budget();
    let config = Config {
        strategy_budget: budget.clone(),
        layer_budget: budget,
        ..Config::new(form)
    };
    let mut client = client(addr, &config);

    let status = check(&mut client).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(status.message(), "scripted Unavailable");
    assert_eq!(do_not_retry(&status), Some("1"));
    assert_eq!(script.calls(), 1);
}

async fn nothing_listening_is_unavailable_not_unknown(form: Form) {
    // A port with nothing behind it: bound, then closed.
    let addr = {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        listener.local_addr().unwrap()
    };
    let mut client = client(addr, &Config::new(form));
    let status = check(&mut client).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
}

#[test]
fn tonics_transport_errors_are_recognised() {
    use retrysafe::classify::Failure;
    use retrysafe::retry::failure_of;
    let refused = tonic::ConnectError(Box::new(std::io::Error::from(
        std::io::ErrorKind::ConnectionRefused,
    )));
    assert_eq!(failure_of(&refused), Failure::ConnectFailed);
    // Whatever the connect step's cause (here: name resolution). Through a real
    // `Channel`, see health_probe_cli's refused-connection test.
    let any = tonic::ConnectError(Box::new(std::io::Error::other("dns")));
    assert_eq!(failure_of(&any), Failure::ConnectFailed);
    assert_eq!(failure_of(&tonic::TimeoutExpired(())), Failure::Timeout);
}

both_forms!(unavailable_then_ok_is_retried_with_the_attempt_headers);
both_forms!(a_check_is_sent_once_unless_declared_idempotent);
both_forms!(resource_exhausted_is_retried_only_with_a_pushback_which_is_the_delay);
both_forms!(a_negative_pushback_is_never_retried);
both_forms!(a_status_in_the_trailers_of_a_stream_is_never_retried);
both_forms!(grpc_timeout_is_sent_on_every_attempt_and_shrinks);
both_forms!(a_deadline_that_runs_out_is_deadline_exceeded_for_the_generated_client);
both_forms!(an_open_breaker_is_unavailable_without_reaching_the_server);
// Two budgets (the retry layer's and the budget layer's) exist in the separate form only.
mod a_budget_layer_that_refuses_a_retry_is_unavailable {
    #[tokio::test]
    async fn separate() {
        super::a_budget_layer_that_refuses_a_retry_is_unavailable(super::Form::Separate).await;
    }
}
both_forms!(an_exhausted_shared_budget_returns_the_last_answer_marked);
both_forms!(nothing_listening_is_unavailable_not_unknown);

// ---------------------------------------------------------------------------------------
// Metrics of the gRPC form
// ---------------------------------------------------------------------------------------

/// `ClientLayers::name(…).grpc()` counts a retried check under the stack's name.
#[tokio::test]
async fn the_grpc_stack_counts_attempts_and_retries_under_its_name() {
    use retrysafe::observe::names;

    let script = Script::new([Step::Fail(Code::Unavailable, None)]);
    let addr = serve(&script, None).await;
    let recorder = Recorder::new();
    let mut client = recorder.build(|| {
        let strategy = StandardRetryStrategy::new()
            .backoff(Backoff::new(
                Duration::from_millis(1),
                Duration::from_millis(5),
                Jitter::Full,
            ))
            .seed(6);
        let layers = ClientLayers::new().name("health").retry(
            RetryLayer::new()
                .strategy(strategy)
                .idempotent_if(is_health_method),
        );
        let stack: Stack = BoxCloneSyncService::new(layers.grpc().layer(channel(addr)));
        HealthClient::new(stack)
    });

    assert_eq!(check(&mut client).await.unwrap(), ServingStatus::Serving);
    assert_eq!(script.calls(), 2);

    let m = recorder.read();
    let attempts = names::CLIENT_ATTEMPTS_TOTAL;
    assert_eq!(
        m.counter(attempts, &[("name", "health"), ("outcome", "failure")]),
        1
    );
    assert_eq!(
        m.counter(attempts, &[("name", "health"), ("outcome", "success")]),
        1
    );
    assert_eq!(m.total(attempts), 2);
    let retries = names::CLIENT_RETRIES_TOTAL;
    assert_eq!(
        m.counter(retries, &[("name", "health"), ("reason", "status")]),
        1
    );
    assert_eq!(m.total(retries), 1);
    assert_eq!(
        m.gauge(names::BREAKER_STATE, &[("name", "health")]),
        Some(0.0)
    );
}

// ---------------------------------------------------------------------------------------
// Throttle and hedge in the gRPC form
// ---------------------------------------------------------------------------------------

/// `ClientLayers` with a hedge, `.grpc()`: a check declared idempotent whose first copy
/// hangs is hedged; the hedge carries `grpc-previous-rpc-attempts: 1` and
/// `retry-attempt: 2`, and its answer reaches the generated client.
#[tokio::test]
async fn the_grpc_stack_hedges_a_hanging_check() {
    use retrysafe::HedgeLayer;

    let script = Script::new([Step::Hang]);
    let addr = serve(&script, None).await;
    let hedge = HedgeLayer::new().delay(Duration::from_millis(20));
    let layers = ClientLayers::new()
        .deadline(Duration::from_secs(5))
        .hedge(hedge.clone())
        .build()
        .unwrap();
    let stack: Stack = BoxCloneSyncService::new(layers.grpc().layer(channel(addr)));
    let mut client = HealthClient::new(stack);

    let mut request = tonic::Request::new(check_request());
    request.extensions_mut().insert(Idempotent);
    let response = client.check(request).await.unwrap();
    assert_eq!(response.into_inner().status(), ServingStatus::Serving);
    script.release.notify_one();

    let seen = script.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0].previous_attempts, None);
    assert_eq!(seen[1].previous_attempts.as_deref(), Some("1"));
    assert_eq!(seen[1].retry_attempt.as_deref(), Some("2"));
    assert_eq!((hedge.stats().sent, hedge.stats().won), (1, 1));
}

/// `ClientLayers` with a throttle, `.grpc()`: a server that answers every check with
/// `RESOURCE_EXHAUSTED` (not an accept) soon sees few calls; the generated client gets
/// each local rejection as `UNAVAILABLE` marked `do-not-retry`.
#[tokio::test]
async fn the_grpc_stack_throttles_a_refusing_server() {
    use retrysafe::AdaptiveThrottleLayer;

    let script = Script::new(std::iter::repeat_n(
        Step::Fail(Code::ResourceExhausted, None),
        100,
    ));
    let addr = serve(&script, None).await;
    let layers = ClientLayers::new()
        .throttle(AdaptiveThrottleLayer::new().seed(8))
        .build()
        .unwrap();
    let stack: Stack = BoxCloneSyncService::new(layers.grpc().layer(channel(addr)));
    let mut client = HealthClient::new(stack);

    let mut rejected = 0;
    for _ in 0..100 {
        let status = check(&mut client).await.unwrap_err();
        if status.code() == Code::Unavailable {
            assert_eq!(do_not_retry(&status), Some("1"), "{status:?}");
            rejected += 1;
        } else {
            assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        }
    }
    assert_eq!(script.calls() + rejected, 100);
    assert!(rejected > 80, "{rejected} of 100 rejected");
}
