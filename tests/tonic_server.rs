//! The server side of the convention in a tonic `Server`: `PropagateLayer` and the server
//! `DeadlineLayer` in `Server::layer`, against real tonic servers on loopback.
//!
//! - The inbound `grpc-timeout` reaches the outbound tonic calls the handler makes (the
//!   downstream sees what is left, less the margin).
//! - The server `DeadlineLayer` answers a malformed `grpc-timeout` with
//!   `INVALID_ARGUMENT` and enforces the deadline with `DEADLINE_EXCEEDED`; tonic's own
//!   `grpc-timeout` handling (outside every `Server::layer`) answers `CANCELLED`, and is
//!   the backstop when `Server::timeout` is the shorter bound.
//! - When the handler's own outbound call gave up, its gRPC error goes out marked
//!   `do-not-retry: 1`: in the head of a Trailers-Only answer, and in the trailers of a
//!   stream — so the caller does not retry again.
//!
//! Wire-level checks use a raw HTTP/2 client (hyper), so that no client-side timer of a
//! tonic `Channel` races the server's answer. No timing assertions: only codes, headers
//! and counts.
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

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use futures_util::stream::{self, BoxStream};
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::rt::TokioExecutor;
use retrysafe::answer::GrpcStatusLayer;
use retrysafe::breaker::ResponseBody;
use retrysafe::retry::{Backoff, Jitter};
use retrysafe::wire::parse_grpc_timeout;
use retrysafe::{
    CallContext, CircuitBreakerLayer, DeadlineLayer, PropagateLayer, ReplayBody, RetryBudget,
    RetryBudgetLayer, RetryLayer, StandardRetryStrategy,
};
use tokio::net::TcpListener;
use tonic::body::Body as GrpcBody;
use tonic::metadata::MetadataMap;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tower::ServiceBuilder;
use tower::util::{BoxCloneSyncService, MapRequestLayer};

/// The client stack as one cloneable type, for `HealthClient::new`. Its error is a
/// `tonic::Status` (the outermost `map_err`, which is what the generated client makes of
/// any error anyway): with `BoxError` inside a boxed service, a generated client's call
/// cannot be awaited where `Send` is required — in a tonic handler, or a spawned task —
/// because of rustc's "implementation of `From` is not general enough" limitation
/// (rust-lang/rust#64552).
type Stack = BoxCloneSyncService<Request<GrpcBody>, Response<ResponseBody<GrpcBody>>, Status>;
type Outbound = HealthClient<Stack>;

// ---------------------------------------------------------------------------------------
// Servers
// ---------------------------------------------------------------------------------------

fn answer(status: ServingStatus) -> HealthCheckResponse {
    HealthCheckResponse {
        status: status.into(),
    }
}

fn grpc_timeout(metadata: &MetadataMap) -> Option<Duration> {
    metadata
        .get("grpc-timeout")
        .map(|v| parse_grpc_timeout(v.as_bytes()).unwrap())
}

/// What a server saw: one entry per call, its inbound `grpc-timeout`.
#[derive(Debug, Default)]
struct Log {
    timeouts: Mutex<Vec<Option<Duration>>>,
}

impl Log {
    fn record(&self, metadata: &MetadataMap) {
        self.timeouts.lock().unwrap().push(grpc_timeout(metadata));
    }

    fn calls(&self) -> usize {
        self.timeouts.lock().unwrap().len()
    }

    fn timeouts(&self) -> Vec<Option<Duration>> {
        self.timeouts.lock().unwrap().clone()
    }
}

/// A leaf: answers SERVING, or `UNAVAILABLE` on every call when `failing`.
struct Leaf {
    log: Arc<Log>,
    failing: bool,
}

#[tonic::async_trait]
impl Health for Leaf {
    async fn check(
        &self,
        request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<HealthCheckResponse>, Status> {
        self.log.record(request.metadata());
        if self.failing {
            return Err(Status::unavailable("the leaf is down"));
        }
        Ok(tonic::Response::new(answer(ServingStatus::Serving)))
    }

    type WatchStream = BoxStream<'static, Result<HealthCheckResponse, Status>>;

    async fn watch(
        &self,
        _request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("not here"))
    }
}

/// What the middle tier does with a call.
#[derive(Debug, Clone, Copy)]
enum Mode {
    /// Asks the leaf through its outbound client, and answers with what it got — as a
    /// fresh status of its own (no metadata of the leaf's).
    Forward,
    /// Fails with `UNAVAILABLE` on its own, without asking anyone.
    FailAlone,
    /// Never answers (the deadline is what ends the call).
    Hang,
}

/// A middle tier whose handler makes outbound tonic calls to a leaf.
struct Middle {
    log: Arc<Log>,
    leaf: Outbound,
    mode: Mode,
}

#[tonic::async_trait]
impl Health for Middle {
    async fn check(
        &self,
        request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<HealthCheckResponse>, Status> {
        self.log.record(request.metadata());
        match self.mode {
            Mode::Forward => ask(self.leaf.clone(), request.into_inner())
                .await
                .map(tonic::Response::new),
            Mode::FailAlone => Err(Status::unavailable("the middle tier failed alone")),
            Mode::Hang => std::future::pending().await,
        }
    }

    type WatchStream = BoxStream<'static, Result<HealthCheckResponse, Status>>;

    /// Headers and one SERVING message first; then, while the stream is being produced,
    /// one outbound call to the leaf — whose failure ends the stream with a status in
    /// the trailers.
    async fn watch(
        &self,
        request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, Status> {
        self.log.record(request.metadata());
        let first = stream::once(async { Ok(answer(ServingStatus::Serving)) });
        let then = stream::once(ask(self.leaf.clone(), HealthCheckRequest::default()));
        Ok(tonic::Response::new(first.chain(then).boxed()))
    }
}

/// Asks the leaf; its failure becomes a fresh status of the middle tier's (no metadata
/// of the leaf's).
fn ask(
    mut leaf: Outbound,
    request: HealthCheckRequest,
) -> BoxFuture<'static, Result<HealthCheckResponse, Status>> {
    Box::pin(async move {
        match leaf.check(request).await {
            Ok(response) => Ok(response.into_inner()),
            Err(status) => Err(Status::new(
                status.code(),
                format!("leaf: {}", status.message()),
            )),
        }
    })
}

async fn listener() -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    (listener, addr)
}

async fn serve_leaf(failing: bool) -> (SocketAddr, Arc<Log>) {
    let (listener, addr) = listener().await;
    let log = Arc::new(Log::default());
    let leaf = Leaf {
        log: log.clone(),
        failing,
    };
    let router = Server::builder().add_service(HealthServer::new(leaf));
    tokio::spawn(router.serve_with_incoming(TcpIncoming::from(listener)));
    (addr, log)
}

/// Which server layer the middle tier runs.
#[derive(Debug, Clone, Copy)]
enum Layers {
    Propagate,
    ServerDeadline,
}

/// Serves `middle` behind `layers`; `timeout` is tonic's own `Server::timeout`.
async fn serve_middle(middle: Middle, layers: Layers, timeout: Option<Duration>) -> SocketAddr {
    let (listener, addr) = listener().await;
    let mut builder = Server::builder();
    if let Some(t) = timeout {
        builder = builder.timeout(t);
    }
    let service = HealthServer::new(middle);
    match layers {
        Layers::Propagate => {
            let router = builder.layer(PropagateLayer::new()).add_service(service);
            tokio::spawn(router.serve_with_incoming(TcpIncoming::from(listener)));
        }
        Layers::ServerDeadline => {
            // With a budget on the inbound path too: both server layers fit
            // `Server::layer` as they are.
            let router = builder
                .layer(DeadlineLayer::server())
                .layer(RetryBudgetLayer::new(RetryBudget::default()).server())
                .add_service(service);
            tokio::spawn(router.serve_with_incoming(TcpIncoming::from(listener)));
        }
    }
    addr
}

// ---------------------------------------------------------------------------------------
// Clients
// ---------------------------------------------------------------------------------------

fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy()
}

/// The standard client stack over a channel to `addr`: deadline 5 s (or less, inherited), 3
/// attempts with a 1–5 ms backoff, the Health methods declared idempotent.
fn outbound(addr: SocketAddr) -> Outbound {
    let backoff = Backoff::new(
        Duration::from_millis(1),
        Duration::from_millis(5),
        Jitter::Full,
    );
    let budget = RetryBudget::ratio();
    let strategy = StandardRetryStrategy::new()
        .backoff(backoff)
        .budget(budget.clone())
        .seed(3);
    let svc = ServiceBuilder::new()
        .map_err(Status::from_error)
        .layer(GrpcStatusLayer::new())
        .layer(DeadlineLayer::new(Duration::from_secs(5)))
        .layer(
            RetryLayer::new()
                .strategy(strategy)
                .idempotent_if(|parts| parts.uri.path().starts_with("/grpc.health.v1.Health/")),
        )
        .layer(RetryBudgetLayer::new(budget))
        .layer(CircuitBreakerLayer::default())
        .layer(MapRequestLayer::new(|r: Request<ReplayBody<GrpcBody>>| {
            r.map(GrpcBody::new)
        }))
        .service(channel(addr));
    HealthClient::new(BoxCloneSyncService::new(svc))
}

/// A middle tier forwarding to a leaf (failing or not), behind `layers`.
async fn chain(leaf_failing: bool, layers: Layers, mode: Mode) -> (SocketAddr, Arc<Log>, Arc<Log>) {
    let (leaf_addr, leaf_log) = serve_leaf(leaf_failing).await;
    let middle_log = Arc::new(Log::default());
    let middle = Middle {
        log: middle_log.clone(),
        leaf: outbound(leaf_addr),
        mode,
    };
    let addr = serve_middle(middle, layers, None).await;
    (addr, middle_log, leaf_log)
}

fn do_not_retry(status: &Status) -> Option<&str> {
    status
        .metadata()
        .get("do-not-retry")
        .map(|v| v.to_str().unwrap())
}

/// A raw gRPC call over HTTP/2 (no tonic client, so no client-side timer): `Check` with
/// an empty request and these extra headers. Returns the response head and trailers.
async fn raw_check(
    addr: SocketAddr,
    headers: &[(&str, &str)],
) -> (http::response::Parts, HeaderMap) {
    let client = HttpClient::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let mut request = Request::post(format!("http://{addr}/grpc.health.v1.Health/Check"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    // One uncompressed message of zero bytes: an empty HealthCheckRequest.
    let body = Full::new(Bytes::from_static(&[0, 0, 0, 0, 0]));
    let response = client.request(request.body(body).unwrap()).await.unwrap();
    let (head, body) = response.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned().unwrap_or_default();
    (head, trailers)
}

// ---------------------------------------------------------------------------------------
// The inbound deadline reaches the handler's outbound calls
// ---------------------------------------------------------------------------------------

async fn inbound_timeout_reaches_the_leaf(layers: Layers) {
    let (addr, middle_log, leaf_log) = chain(false, layers, Mode::Forward).await;
    let mut client = HealthClient::new(channel(addr));
    let mut request = tonic::Request::new(HealthCheckRequest::default());
    request.set_timeout(Duration::from_secs(2));
    let response = client.check(request).await.unwrap();
    assert_eq!(response.into_inner().status(), ServingStatus::Serving);

    let inbound = middle_log.timeouts()[0].expect("the middle tier got a grpc-timeout");
    let outbound = leaf_log.timeouts()[0].expect("the leaf got a grpc-timeout");
    assert!(inbound <= Duration::from_secs(2), "{inbound:?}");
    // What was left, less the 10 ms margin: never more.
    assert!(
        outbound + Duration::from_millis(10) <= inbound,
        "{outbound:?} after {inbound:?}"
    );
    assert!(outbound > Duration::ZERO);
}

#[tokio::test]
async fn propagate_layer_hands_the_inbound_grpc_timeout_to_outbound_tonic_calls() {
    inbound_timeout_reaches_the_leaf(Layers::Propagate).await;
}

#[tokio::test]
async fn server_deadline_layer_hands_the_inbound_grpc_timeout_to_outbound_tonic_calls() {
    inbound_timeout_reaches_the_leaf(Layers::ServerDeadline).await;
}

// ---------------------------------------------------------------------------------------
// The server DeadlineLayer, and tonic's own grpc-timeout handling
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_malformed_grpc_timeout_is_invalid_argument() {
    let (addr, middle_log, _) = chain(false, Layers::ServerDeadline, Mode::Forward).await;
    // Values tonic's own parser ignores (no unit, 9 digits, an unknown unit) reach the
    // layer, which refuses them before the handler runs; so is a sign, which tonic's
    // parser would accept as a 5 s timeout but the gRPC spec does not allow.
    for value in ["soon", "123456789S", "10x", "+5S"] {
        let (head, trailers) = raw_check(addr, &[("grpc-timeout", value)]).await;
        assert_eq!(head.status, http::StatusCode::OK);
        // Trailers-Only: the status is in the head.
        assert_eq!(head.headers["grpc-status"], "3", "{value}: {head:?}");
        assert!(trailers.is_empty());
    }
    assert_eq!(middle_log.calls(), 0);

    // Through a tonic client, too: the generated client sees INVALID_ARGUMENT.
    let mut client = HealthClient::new(channel(addr));
    let mut request = tonic::Request::new(HealthCheckRequest::default());
    request
        .metadata_mut()
        .insert("grpc-timeout", "soon".parse().unwrap());
    let status = client.check(request).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("grpc-timeout"), "{status:?}");
    assert_eq!(middle_log.calls(), 0);
}

#[tokio::test]
async fn the_server_deadline_layer_enforces_the_inbound_deadline() {
    // tonic's own timer would fire 10 ms later (at the inbound timeout, and its
    // `Server::timeout` is longer still): ours answers first, DEADLINE_EXCEEDED marked
    // do-not-retry.
    let (leaf_addr, _) = serve_leaf(false).await;
    let middle = Middle {
        log: Arc::default(),
        leaf: outbound(leaf_addr),
        mode: Mode::Hang,
    };
    let addr = serve_middle(
        middle,
        Layers::ServerDeadline,
        Some(Duration::from_secs(60)),
    )
    .await;
    let (head, _) = raw_check(addr, &[("grpc-timeout", "200m")]).await;
    assert_eq!(head.headers["grpc-status"], "4", "{head:?}");
    assert_eq!(head.headers["do-not-retry"], "1", "{head:?}");
}

#[tokio::test]
async fn tonic_server_timeout_answers_cancelled_when_it_is_the_shorter_bound() {
    // `Server::timeout` of 100 ms against an inbound 10 s: tonic's own timer — outside
    // every `Server::layer` — ends the call first, with CANCELLED ("Timeout expired"),
    // unmarked. Without any grpc-timeout it bounds the call alone (the layer leaves such
    // calls unbounded).
    let (leaf_addr, _) = serve_leaf(false).await;
    let middle = Middle {
        log: Arc::default(),
        leaf: outbound(leaf_addr),
        mode: Mode::Hang,
    };
    let addr = serve_middle(
        middle,
        Layers::ServerDeadline,
        Some(Duration::from_millis(100)),
    )
    .await;
    for headers in [&[("grpc-timeout", "10S")][..], &[][..]] {
        let (head, _) = raw_check(addr, headers).await;
        assert_eq!(head.headers["grpc-status"], "1", "{head:?}");
        assert_eq!(
            head.headers["grpc-message"], "Timeout%20expired",
            "{head:?}"
        );
        assert!(!head.headers.contains_key("do-not-retry"), "{head:?}");
    }
}

// ---------------------------------------------------------------------------------------
// do-not-retry on gRPC errors when the handler's downstream gave up
// ---------------------------------------------------------------------------------------

async fn a_failure_after_the_leaf_gave_up_is_not_retried_again(layers: Layers) {
    let (addr, middle_log, leaf_log) = chain(true, layers, Mode::Forward).await;
    // The caller runs the same retrying stack.
    let mut client = outbound(addr);
    let status = client
        .check(HealthCheckRequest::default())
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(status.message(), "leaf: the leaf is down");
    // Trailers-Only: the marker is in the head, which the client reads as metadata.
    assert_eq!(do_not_retry(&status), Some("1"));
    // Retries happened at one layer only: three attempts at the leaf, one call to the
    // middle tier.
    assert_eq!(leaf_log.calls(), 3);
    assert_eq!(middle_log.calls(), 1);
}

#[tokio::test]
async fn propagate_layer_marks_a_trailers_only_error_when_the_handlers_call_gave_up() {
    a_failure_after_the_leaf_gave_up_is_not_retried_again(Layers::Propagate).await;
}

#[tokio::test]
async fn server_deadline_layer_marks_a_trailers_only_error_when_the_handlers_call_gave_up() {
    a_failure_after_the_leaf_gave_up_is_not_retried_again(Layers::ServerDeadline).await;
}

#[tokio::test]
async fn a_failure_of_the_handlers_own_is_unmarked_and_retried_by_the_caller() {
    let (addr, middle_log, leaf_log) = chain(false, Layers::Propagate, Mode::FailAlone).await;
    let mut client = outbound(addr);
    let status = client
        .check(HealthCheckRequest::default())
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(status.message(), "the middle tier failed alone");
    // The middle tier marked nothing (its own failure, no call of its gave up): the
    // caller's retry layer made its three attempts.
    assert_eq!(middle_log.calls(), 3);
    assert_eq!(leaf_log.calls(), 0);
}

#[tokio::test]
async fn do_not_retry_travels_in_the_trailers_of_a_stream_whose_call_gave_up() {
    trailers_of_a_stream_whose_call_gave_up(Layers::Propagate).await;
}

#[tokio::test]
async fn server_deadline_layer_marks_the_trailers_of_a_stream_whose_call_gave_up() {
    trailers_of_a_stream_whose_call_gave_up(Layers::ServerDeadline).await;
}

async fn trailers_of_a_stream_whose_call_gave_up(layers: Layers) {
    let (addr, middle_log, leaf_log) = chain(true, layers, Mode::Forward).await;
    let mut client = HealthClient::new(channel(addr));
    let mut request = tonic::Request::new(HealthCheckRequest::default());
    // Shorter than the outbound stack's own 5 s: only an inherited deadline explains a
    // shorter grpc-timeout at the leaf.
    request.set_timeout(Duration::from_secs(2));
    let mut stream = client.watch(request).await.unwrap().into_inner();

    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.status(), ServingStatus::Serving);
    let status = stream.message().await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(status.message(), "leaf: the leaf is down");
    // The status came in the trailers; so did the marker.
    assert_eq!(do_not_retry(&status), Some("1"));
    assert_eq!(middle_log.calls(), 1);
    // The call made while the stream was produced inherited the inbound context: it
    // retried (three attempts), and got the inbound deadline less the margin.
    let timeouts = leaf_log.timeouts();
    assert_eq!(timeouts.len(), 3);
    let inbound = middle_log.timeouts()[0].unwrap();
    for t in timeouts {
        assert!(t.unwrap() + Duration::from_millis(10) <= inbound);
    }
}

#[tokio::test]
async fn the_context_is_a_request_extension_for_handlers_too() {
    // For code that spawns tasks and carries the context by hand.
    struct Peek(Arc<AtomicUsize>);

    #[tonic::async_trait]
    impl Health for Peek {
        async fn check(
            &self,
            request: tonic::Request<HealthCheckRequest>,
        ) -> Result<tonic::Response<HealthCheckResponse>, Status> {
            let ctx = request.extensions().get::<CallContext>().cloned().unwrap();
            let left = ctx.deadline().unwrap().remaining();
            assert!(left + Duration::from_millis(10) <= Duration::from_secs(3));
            let spawned = tokio::spawn(ctx.scope(async { CallContext::current().is_some() }));
            assert!(spawned.await.unwrap());
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(tonic::Response::new(answer(ServingStatus::Serving)))
        }

        type WatchStream = BoxStream<'static, Result<HealthCheckResponse, Status>>;

        async fn watch(
            &self,
            _request: tonic::Request<HealthCheckRequest>,
        ) -> Result<tonic::Response<Self::WatchStream>, Status> {
            Err(Status::unimplemented("not here"))
        }
    }

    let (listener, addr) = listener().await;
    let calls = Arc::new(AtomicUsize::new(0));
    let router = Server::builder()
        .layer(PropagateLayer::new())
        .add_service(HealthServer::new(Peek(calls.clone())));
    tokio::spawn(router.serve_with_incoming(TcpIncoming::from(listener)));

    let mut client = HealthClient::new(channel(addr));
    let mut request = tonic::Request::new(HealthCheckRequest::default());
    request.set_timeout(Duration::from_secs(3));
    client.check(request).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}
