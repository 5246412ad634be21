//! Drives the `fetch` example as an outside user would: builds the binary, runs it
//! against real axum servers on loopback (and once against `python3 -m http.server`),
//! and checks its stdout (the body), its one JSON line on stderr, its exit code, and
//! what the server saw: retries of safe requests only, a POST retried only with a key
//! (generated or given, the same on every attempt), a deadline failure, bad arguments.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub
)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State as AxumState;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::routing::any;
use retrysafe_test_support::example::{assert_non_utf8_argument_is_a_usage_error, example_binary};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpListener;
use tokio::process::Command;

/// The `fetch` example's binary.
fn binary() -> PathBuf {
    example_binary("fetch")
}

/// One run of the example.
#[derive(Debug)]
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    /// The last stderr line, as JSON (`Null` when it is not JSON).
    json: Value,
}

impl Run {
    fn status(&self) -> Option<u64> {
        self.json["status"].as_u64()
    }

    fn attempts(&self) -> u64 {
        self.json["attempts"].as_u64().unwrap()
    }

    fn key(&self) -> Option<&str> {
        self.json["idempotency_key"].as_str()
    }

    fn error(&self) -> Option<&str> {
        self.json["error"].as_str()
    }

    /// The JSON line has exactly the documented fields and types.
    fn assert_report_shape(&self) {
        let object = self.json.as_object().unwrap_or_else(|| panic!("{self:?}"));
        let mut keys: Vec<&str> = object.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "attempts",
                "elapsed_ms",
                "error",
                "idempotency_key",
                "status"
            ],
            "{self:?}"
        );
        assert!(self.json["status"].is_u64() || self.json["status"].is_null());
        assert!(self.json["attempts"].is_u64());
        assert!(self.json["elapsed_ms"].is_u64());
        assert!(self.json["idempotency_key"].is_string() || self.json["idempotency_key"].is_null());
        assert!(self.json["error"].is_string() || self.json["error"].is_null());
    }
}

async fn run(args: &[&str]) -> Run {
    let binary = tokio::task::spawn_blocking(binary).await.unwrap();
    let output = Command::new(binary)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .expect("run the fetch example");
    let stdout = String::from_utf8(output.stdout).unwrap();
    let stderr = String::from_utf8(output.stderr).unwrap();
    let json = stderr
        .lines()
        .last()
        .and_then(|line| serde_json::from_str(line).ok())
        .unwrap_or(Value::Null);
    let run = Run {
        code: output.status.code(),
        stdout,
        stderr,
        json,
    };
    if run.code != Some(2) {
        run.assert_report_shape();
        // One JSON line, nothing else on stderr.
        assert_eq!(run.stderr.lines().count(), 1, "{run:?}");
    }
    run
}

/// A request as the server saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    path: String,
    headers: HeaderMap,
    body: Bytes,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
}

#[derive(Default)]
struct Server {
    seen: Mutex<Vec<Seen>>,
}

impl Server {
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// Routes: `/flaky` answers 503 to its first request, then 200 (201 for a POST) with
/// `ok`; `/down` always 503; `/slow` answers after 10 minutes; `/echo` answers 200 with
/// the request's body. Every request is recorded.
async fn handler(
    AxumState(server): AxumState<Arc<Server>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, Bytes) {
    let path = uri.path().to_owned();
    let earlier = {
        let mut seen = server.seen.lock().unwrap();
        let earlier = seen.iter().filter(|s| s.path == path).count();
        seen.push(Seen {
            method: method.clone(),
            path: path.clone(),
            headers,
            body: body.clone(),
        });
        earlier
    };
    match path.as_str() {
        "/flaky" if earlier == 0 => (StatusCode::SERVICE_UNAVAILABLE, Bytes::from("busy")),
        "/flaky" if method == Method::POST => (StatusCode::CREATED, Bytes::from("ok")),
        "/flaky" => (StatusCode::OK, Bytes::from("ok")),
        "/down" => (StatusCode::SERVICE_UNAVAILABLE, Bytes::from("down")),
        "/slow" => {
            tokio::time::sleep(Duration::from_secs(600)).await;
            (StatusCode::OK, Bytes::from("late"))
        }
        "/echo" => (StatusCode::OK, body),
        _ => (StatusCode::NOT_FOUND, Bytes::from("no such route")),
    }
}

async fn serve() -> (Arc<Server>, String) {
    let server = Arc::new(Server::default());
    let app = Router::new()
        .route("/{*path}", any(handler))
        .with_state(server.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (server, format!("http://{addr}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_answered_503_then_200_is_retried_once() {
    let (server, base) = serve().await;
    let run = run(&[&format!("{base}/flaky")]).await;

    assert_eq!(run.code, Some(0), "{run:?}");
    assert_eq!(run.stdout, "ok");
    assert_eq!(run.status(), Some(200));
    assert_eq!(run.attempts(), 2);
    assert_eq!(run.key(), None);
    assert_eq!(run.error(), None);
    let seen = server.seen();
    assert_eq!(seen.len(), 2);
    assert!(seen.iter().all(|s| s.method == Method::GET));
    assert_eq!(seen[0].header("retry-attempt"), None);
    assert_eq!(seen[1].header("retry-attempt"), Some("2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_without_a_key_is_sent_once() {
    let (server, base) = serve().await;
    // `-d` without `-X` means POST, as in curl.
    let run = run(&[&format!("{base}/flaky"), "-d", "amount=5"]).await;

    // A response arrived: exit 0, whatever its status.
    assert_eq!(run.code, Some(0), "{run:?}");
    assert_eq!(run.status(), Some(503));
    assert_eq!(run.stdout, "busy");
    assert_eq!(run.attempts(), 1);
    assert_eq!(run.key(), None);
    let seen = server.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, Method::POST);
    assert_eq!(seen[0].body, "amount=5");
    assert_eq!(
        seen[0].header("content-type"),
        Some("application/x-www-form-urlencoded")
    );
    assert_eq!(seen[0].header("idempotency-key"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_with_auto_is_retried_with_the_same_generated_key() {
    let (server, base) = serve().await;
    let run = run(&[
        &format!("{base}/flaky"),
        "-X",
        "POST",
        "-d",
        r#"{"amount": 5}"#,
        "-H",
        "content-type: application/json",
        "--idempotency-key",
        "auto",
    ])
    .await;

    assert_eq!(run.code, Some(0), "{run:?}");
    assert_eq!(run.status(), Some(201));
    assert_eq!(run.stdout, "ok");
    assert_eq!(run.attempts(), 2);
    let seen = server.seen();
    assert_eq!(seen.len(), 2);
    let key = seen[0].header("idempotency-key").expect("a generated key");
    assert!(!key.is_empty());
    assert_eq!(seen[1].header("idempotency-key"), Some(key));
    assert_eq!(run.key(), Some(key));
    for s in &seen {
        assert_eq!(s.method, Method::POST);
        assert_eq!(s.body, r#"{"amount": 5}"#);
        assert_eq!(s.header("content-type"), Some("application/json"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_key_is_passed_through_and_makes_a_post_retryable() {
    let (server, base) = serve().await;
    let run = run(&[
        &format!("{base}/flaky"),
        "-d",
        "x",
        "--idempotency-key",
        "order-42-attempt",
        "-H",
        "x-trace: abc",
    ])
    .await;

    assert_eq!(run.code, Some(0), "{run:?}");
    assert_eq!(run.status(), Some(201));
    assert_eq!(run.attempts(), 2);
    assert_eq!(run.key(), Some("order-42-attempt"));
    let seen = server.seen();
    assert_eq!(seen.len(), 2);
    for s in &seen {
        assert_eq!(s.header("idempotency-key"), Some("order-42-attempt"));
        assert_eq!(s.header("x-trace"), Some("abc"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_attempts_bounds_retries_and_the_last_answer_is_printed() {
    let (server, base) = serve().await;
    let run = run(&[&format!("{base}/down"), "-X", "PUT", "--max-attempts", "4"]).await;

    assert_eq!(run.code, Some(0), "{run:?}");
    assert_eq!(run.status(), Some(503));
    assert_eq!(run.stdout, "down");
    assert_eq!(run.attempts(), 4);
    assert_eq!(server.seen().len(), 4);

    let run = self::run(&[&format!("{base}/down"), "--max-attempts", "1"]).await;
    assert_eq!(run.attempts(), 1);
    assert_eq!(server.seen().len(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_failure_exits_non_zero_and_names_the_deadline() {
    let (server, base) = serve().await;
    let run = run(&[&format!("{base}/slow"), "--deadline-ms", "300"]).await;

    assert_ne!(run.code, Some(0), "{run:?}");
    assert_ne!(run.code, Some(2), "{run:?}");
    assert_eq!(run.status(), None);
    assert!(run.error().unwrap().contains("deadline"), "{run:?}");
    assert_eq!(run.stdout, "");
    assert_eq!(run.attempts(), 1);
    // The server was told how long it had: never more than the deadline.
    let seen = server.seen();
    assert_eq!(seen.len(), 1);
    let told: u64 = seen[0]
        .header("request-timeout-ms")
        .expect("request-timeout-ms sent")
        .parse()
        .unwrap();
    assert!(told <= 300, "{told}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transport_failure_exits_non_zero() {
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let run = run(&[&format!("http://127.0.0.1:{port}/"), "--max-attempts", "2"]).await;
    assert_eq!(run.code, Some(1), "{run:?}");
    assert_eq!(run.status(), None);
    // A refused connection sent nothing, so it was retried.
    assert_eq!(run.attempts(), 2);
    assert!(run.error().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_print_the_usage_and_exit_2() {
    let (server, base) = serve().await;
    let url = format!("{base}/echo");
    let bad: [&[&str]; 11] = [
        &[],
        &["not a url"],
        &["ftp://127.0.0.1/file"],
        &[&url, "--frobnicate"],
        &[&url, "-X"],
        &[&url, "-X", "BAD METHOD"],
        &[&url, "-H", "no colon"],
        &[&url, "--deadline-ms", "soon"],
        &[&url, "--deadline-ms", "0"],
        &[&url, "--max-attempts", "0"],
        &[&url, "--idempotency-key", "has space\tand tab"],
    ];
    for args in bad {
        let run = run(args).await;
        assert_eq!(run.code, Some(2), "{args:?}: {run:?}");
        assert!(run.stderr.contains("usage: fetch URL"), "{args:?}: {run:?}");
        assert_eq!(run.stdout, "");
    }
    // Nothing was sent.
    assert!(server.seen().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetches_a_file_from_python_http_server() {
    let dir = std::env::temp_dir().join(format!("fetch-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("hello.txt"), "hello from a file\n").unwrap();

    let mut python = Command::new("python3")
        .args([
            "-u",
            "-m",
            "http.server",
            "0",
            "--bind",
            "127.0.0.1",
            "--directory",
        ])
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 on the PATH");
    // "Serving HTTP on 127.0.0.1 port 12345 (http://127.0.0.1:12345/) ..."
    let mut lines = BufReader::new(python.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("python http.server started")
        .unwrap()
        .unwrap();
    let port = line
        .split_whitespace()
        .skip_while(|word| *word != "port")
        .nth(1)
        .unwrap_or_else(|| panic!("no port in {line:?}"));

    let run = run(&[
        &format!("http://127.0.0.1:{port}/hello.txt"),
        "--deadline-ms",
        "20000",
    ])
    .await;
    let missing = self::run(&[&format!("http://127.0.0.1:{port}/missing.txt")]).await;

    python.kill().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();

    assert_eq!(run.code, Some(0), "{run:?}");
    assert_eq!(run.stdout, "hello from a file\n");
    assert_eq!(run.status(), Some(200));
    assert_eq!(run.attempts(), 1);
    assert_eq!(run.error(), None);
    // A 404 is a response: printed, exit 0, not retried.
    assert_eq!(missing.code, Some(0), "{missing:?}");
    assert_eq!(missing.status(), Some(404));
    assert_eq!(missing.attempts(), 1);
}

#[test]
fn a_non_utf8_argument_is_a_usage_error() {
    assert_non_utf8_argument_is_a_usage_error("fetch");
}
