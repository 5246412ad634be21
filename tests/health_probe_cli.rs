//! Drives the `health_probe` example as an outside user would: builds the binary, runs
//! it against real tonic health servers on loopback, and checks its one JSON line on
//! stdout and its exit code — the stock `tonic-health` server (SERVING, NOT_SERVING), a
//! server failing `UNAVAILABLE` twice before answering (3 attempts), nothing listening,
//! a server too slow for the deadline, and bad arguments. No timing assertions: the
//! deadline case holds the server until the probe has given up.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub,
    clippy::disallowed_methods
)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures_util::stream::BoxStream;
use retrysafe_test_support::example::{assert_non_utf8_argument_is_a_usage_error, example_binary};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tonic::Status;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus as Reported;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

/// The `health_probe` example's binary.
fn binary() -> PathBuf {
    example_binary("health_probe")
}

/// Runs the probe with `args` (off the runtime's threads).
async fn run(args: Vec<String>) -> Output {
    let binary = binary();
    tokio::task::spawn_blocking(move || Command::new(binary).args(args).output().unwrap())
        .await
        .unwrap()
}

/// The probe's one stdout line, parsed, and its exit code.
async fn probe(addr: SocketAddr, extra: &[&str]) -> (Value, Option<i32>) {
    let mut args = vec![format!("http://{addr}")];
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    let output = run(args).await;
    let stdout = String::from_utf8(output.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "one line expected: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: Value = serde_json::from_str(lines[0]).expect("the line is JSON");
    let keys: Vec<&str> = json
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(keys.len(), 4, "{json}");
    for key in ["status", "attempts", "elapsed_ms", "error"] {
        assert!(keys.contains(&key), "missing {key}: {json}");
    }
    assert!(json["attempts"].is_u64(), "{json}");
    assert!(json["elapsed_ms"].is_u64(), "{json}");
    (json, output.status.code())
}

async fn listener() -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    (listener, addr)
}

/// The stock tonic-health server, reporting `status` for the service `""`.
async fn stock(status: Reported) -> SocketAddr {
    let (reporter, service) = tonic_health::server::health_reporter();
    reporter.set_service_status("", status).await;
    let (listener, addr) = listener().await;
    let router = Server::builder().add_service(service);
    tokio::spawn(async move {
        let _reporter = reporter; // keeps the status alive
        router
            .serve_with_incoming(TcpIncoming::from(listener))
            .await
            .unwrap();
    });
    addr
}

/// Fails `UNAVAILABLE` on its first `failures` calls, then answers SERVING; or, when
/// `hold` is set, holds every call until it is notified.
struct Scripted {
    calls: Arc<AtomicUsize>,
    failures: usize,
    hold: Option<Arc<Notify>>,
}

#[tonic::async_trait]
impl Health for Scripted {
    async fn check(
        &self,
        _request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<HealthCheckResponse>, Status> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if let Some(hold) = &self.hold {
            hold.notified().await;
        }
        if n < self.failures {
            return Err(Status::unavailable("warming up"));
        }
        Ok(tonic::Response::new(HealthCheckResponse {
            status: ServingStatus::Serving.into(),
        }))
    }

    type WatchStream = BoxStream<'static, Result<HealthCheckResponse, Status>>;

    async fn watch(
        &self,
        _request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("not here"))
    }
}

async fn scripted(failures: usize, hold: Option<Arc<Notify>>) -> (SocketAddr, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let service = Scripted {
        calls: calls.clone(),
        failures,
        hold,
    };
    let (listener, addr) = listener().await;
    let router = Server::builder().add_service(HealthServer::new(service));
    tokio::spawn(router.serve_with_incoming(TcpIncoming::from(listener)));
    (addr, calls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serving_is_reported_with_one_attempt_and_exit_0() {
    let addr = stock(Reported::Serving).await;
    let (json, code) = probe(addr, &[]).await;
    assert_eq!(json["status"], "SERVING", "{json}");
    assert_eq!(json["attempts"], 1, "{json}");
    assert!(json["error"].is_null(), "{json}");
    assert_eq!(code, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_serving_is_a_status_obtained_so_exit_0() {
    let addr = stock(Reported::NotServing).await;
    let (json, code) = probe(addr, &[]).await;
    assert_eq!(json["status"], "NOT_SERVING", "{json}");
    assert_eq!(json["attempts"], 1, "{json}");
    assert!(json["error"].is_null(), "{json}");
    assert_eq!(code, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unavailable_twice_then_serving_takes_three_attempts() {
    let (addr, calls) = scripted(2, None).await;
    let (json, code) = probe(addr, &[]).await;
    assert_eq!(json["status"], "SERVING", "{json}");
    assert_eq!(json["attempts"], 3, "{json}");
    assert!(json["error"].is_null(), "{json}");
    assert_eq!(code, Some(0));
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_attempts_bounds_the_retries() {
    let (addr, calls) = scripted(2, None).await;
    let (json, code) = probe(addr, &["--max-attempts", "2"]).await;
    assert!(json["status"].is_null(), "{json}");
    assert_eq!(json["attempts"], 2, "{json}");
    assert_eq!(json["error"], "unavailable: warming up", "{json}");
    assert_eq!(code, Some(1));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_listening_is_an_unavailable_error_and_a_failure_exit() {
    // A port with nothing behind it: bound, then closed.
    let addr = listener().await.1;
    let (json, code) = probe(addr, &[]).await;
    assert!(json["status"].is_null(), "{json}");
    let error = json["error"].as_str().unwrap();
    assert!(error.starts_with("unavailable: "), "{json}");
    // A refused connection is retried (nothing was sent): every attempt is made.
    assert_eq!(json["attempts"], 3, "{json}");
    assert_eq!(code, Some(1));
    let (json, _) = probe(addr, &["--max-attempts", "5"]).await;
    assert_eq!(json["attempts"], 5, "{json}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_slower_than_the_deadline_is_deadline_exceeded() {
    // The server holds the call until the probe has exited.
    let hold = Arc::new(Notify::new());
    let (addr, calls) = scripted(0, Some(hold.clone())).await;
    let (json, code) = probe(addr, &["--deadline-ms", "300"]).await;
    hold.notify_waiters();
    assert!(json["status"].is_null(), "{json}");
    let error = json["error"].as_str().unwrap();
    assert!(error.starts_with("deadline exceeded"), "{json}");
    assert_eq!(json["attempts"], 1, "{json}");
    assert_eq!(code, Some(1));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_are_a_usage_error() {
    for args in [
        vec![],
        vec!["ftp://127.0.0.1:1"],
        vec!["http://127.0.0.1:1", "--deadline-ms", "soon"],
        vec!["http://127.0.0.1:1", "--deadline-ms", "0"],
        vec!["http://127.0.0.1:1", "--max-attempts", "0"],
        vec!["http://127.0.0.1:1", "--max-attempts"],
        vec!["http://127.0.0.1:1", "--verbose"],
        vec!["http://127.0.0.1:1", "http://127.0.0.1:2"],
    ] {
        let output = run(args.iter().map(|s| (*s).to_owned()).collect()).await;
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(output.stdout.is_empty(), "{args:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("usage: health_probe"), "{args:?}: {stderr}");
    }
}

#[test]
fn a_non_utf8_argument_is_a_usage_error() {
    assert_non_utf8_argument_is_a_usage_error("health_probe");
}
