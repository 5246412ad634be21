//! Drives the `payments` example as an outside user would: starts the binary, reads the
//! `listening on http://ADDR` line, and talks HTTP to it.
// This test drives a real child process on the wall clock (reading its stdout from a
// thread, waiting for it to exit), so it uses std's clock and sleeps on purpose.
#![allow(
    clippy::disallowed_methods,
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use serde_json::{Value, json};

/// The example binary, built once per test run (cargo does nothing when it is fresh).
fn binary() -> PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY
        .get_or_init(|| {
            let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
            let target = std::env::var_os("CARGO_TARGET_DIR")
                .map_or_else(|| root.join("target"), PathBuf::from);
            let path = target
                .join("debug")
                .join("examples")
                .join(format!("payments{}", std::env::consts::EXE_SUFFIX));
            // `cargo test --test payments_cli` does not build examples: build it here,
            // also when it exists, so that a stale binary is never tested.
            let status = Command::new(env!("CARGO"))
                .args(["build", "--quiet", "--example", "payments"])
                .current_dir(&root)
                .status()
                .expect("run cargo build");
            assert!(status.success(), "cargo build --example payments failed");
            assert!(path.exists(), "no example binary at {}", path.display());
            path
        })
        .clone()
}

/// A running `payments` process, killed when dropped.
struct Server {
    child: Child,
    base: String,
    stderr: Arc<Mutex<String>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `payments --listen 127.0.0.1:0 ARGS` and waits for its ready line.
    fn start(args: &[&str]) -> Server {
        let mut child = Command::new(binary())
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the payments example");
        let stderr = Arc::new(Mutex::new(String::new()));
        drain(child.stderr.take().unwrap(), Arc::clone(&stderr));

        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let mut server = Server {
            child,
            base: String::new(),
            stderr,
        };
        let line = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_default();
        let Some(addr) = line.trim_end().strip_prefix("listening on http://") else {
            std::thread::sleep(Duration::from_millis(200));
            panic!(
                "no ready line: stdout {line:?}, exit {:?}, stderr:\n{}",
                server.child.try_wait(),
                server.stderr.lock().unwrap()
            );
        };
        let port = addr.rsplit(':').next().unwrap();
        assert_ne!(
            port, "0",
            "the ready line must show the port actually bound"
        );
        assert!(addr.starts_with("127.0.0.1:"), "ready line {line:?}");
        server.base = format!("http://{addr}");
        server
    }
}

fn drain(mut from: impl Read + Send + 'static, into: Arc<Mutex<String>>) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 {
                break;
            }
            into.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
}

/// Runs `payments ARGS` to its exit (killed after 20 s): its status and stderr.
fn run_to_exit(args: &[&str]) -> (ExitStatus, String) {
    let mut child = Command::new(binary())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the payments example");
    let stderr = Arc::new(Mutex::new(String::new()));
    drain(child.stderr.take().unwrap(), Arc::clone(&stderr));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("payments {args:?} did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // Let the reader thread see the end of the pipe.
    std::thread::sleep(Duration::from_millis(50));
    let text = stderr.lock().unwrap().clone();
    (status, text)
}

#[derive(Debug)]
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// A `status` problem+json answer with a `type`.
    fn assert_problem(&self, status: u16) {
        assert_eq!(self.status.as_u16(), status, "{self:?}");
        let ct = self.headers.get("content-type").unwrap().to_str().unwrap();
        assert!(ct.starts_with("application/problem+json"), "{self:?}");
        assert!(self.json()["type"].is_string(), "{self:?}");
    }

    /// A 201 for `account` / `amount`; returns the payment id.
    fn assert_created(&self, account: &str, amount: i64) -> String {
        assert_eq!(self.status, StatusCode::CREATED, "{self:?}");
        let v = self.json();
        assert_eq!(v["account"], account, "{self:?}");
        assert_eq!(v["amount_cents"], amount, "{self:?}");
        let id = v["id"].as_str().unwrap();
        assert!(!id.is_empty(), "{self:?}");
        id.to_owned()
    }
}

#[derive(Clone)]
struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    fn new(server: &Server) -> Api {
        Api {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(15))
                .build()
                .unwrap(),
            base: server.base.clone(),
        }
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Answer {
        let res = req.send().await.unwrap();
        Answer {
            status: res.status(),
            headers: res.headers().clone(),
            body: res.bytes().await.unwrap(),
        }
    }

    fn post(&self) -> reqwest::RequestBuilder {
        self.http.post(format!("{}/payments", self.base))
    }

    /// `POST /payments` with `key`, a JSON payment and extra headers.
    async fn pay(&self, key: &str, account: &str, amount: i64, extra: &[(&str, &str)]) -> Answer {
        let mut req = self
            .post()
            .header("idempotency-key", key)
            .json(&json!({ "account": account, "amount_cents": amount }));
        for (name, value) in extra {
            req = req.header(*name, *value);
        }
        self.send(req).await
    }

    /// `copies` identical payments sent at once, each delayed by the server for
    /// `delay_ms` before its effect.
    async fn pay_concurrently(
        &self,
        copies: usize,
        key: &str,
        account: &str,
        amount: i64,
        delay_ms: &str,
    ) -> Vec<Answer> {
        let sends = (0..copies).map(|_| {
            let api = self.clone();
            let (key, account, delay) = (key.to_owned(), account.to_owned(), delay_ms.to_owned());
            tokio::spawn(async move {
                api.pay(
                    &key,
                    &account,
                    amount,
                    &[("x-simulate-delay-ms", delay.as_str())],
                )
                .await
            })
        });
        futures_util::future::join_all(sends)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect()
    }

    /// `GET /payments?account=A`: (count, total_cents).
    async fn totals(&self, account: &str) -> (u64, i64) {
        let res = self
            .send(
                self.http
                    .get(format!("{}/payments", self.base))
                    .query(&[("account", account)]),
            )
            .await;
        assert_eq!(res.status, StatusCode::OK, "{res:?}");
        let v = res.json();
        (
            v["count"].as_u64().unwrap(),
            v["total_cents"].as_i64().unwrap(),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_replay_and_bad_input_is_refused() {
    let server = Server::start(&[]);
    let api = Api::new(&server);

    // Duplicates: the first answer, replayed, and one payment.
    let first = api.pay("dup-1", "acct-dup", 1250, &[]).await;
    first.assert_created("acct-dup", 1250);
    assert!(!first.replayed());
    let again = api.pay("dup-1", "acct-dup", 1250, &[]).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.headers["idempotent-replayed"], "true", "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(api.totals("acct-dup").await, (1, 1250));

    // The same key with another body: 422, do-not-retry, nothing recorded.
    let changed = api.pay("dup-1", "acct-dup", 9999, &[]).await;
    changed.assert_problem(422);
    assert_eq!(changed.headers["do-not-retry"], "1");
    assert_eq!(api.totals("acct-dup").await, (1, 1250));

    // Missing key.
    let no_key = api
        .send(
            api.post()
                .json(&json!({ "account": "acct-dup", "amount_cents": 1 })),
        )
        .await;
    no_key.assert_problem(400);

    // Key length: 255 characters are fine, 256 are not.
    let k255 = "k".repeat(255);
    api.pay(&k255, "acct-keys", 7, &[])
        .await
        .assert_created("acct-keys", 7);
    let k256 = "k".repeat(256);
    api.pay(&k256, "acct-keys", 7, &[])
        .await
        .assert_problem(400);

    // A non-ASCII key, as raw bytes.
    let non_ascii = api
        .send(
            api.post()
                .header(
                    "idempotency-key",
                    HeaderValue::from_bytes(b"caf\xc3\xa9-1").unwrap(),
                )
                .json(&json!({ "account": "acct-keys", "amount_cents": 7 })),
        )
        .await;
    non_ascii.assert_problem(400);
    assert_eq!(api.totals("acct-keys").await, (1, 7));

    // Bodies over 1 MiB (under and over axum's own 2 MB default): 413 from the layer.
    for size in [1024 * 1024 + 1, 3 * 512 * 1024, 2 * 1024 * 1024] {
        let big = api
            .send(
                api.post()
                    .header("idempotency-key", format!("big-{size}"))
                    .header("content-type", "application/json")
                    .body(vec![b' '; size]),
            )
            .await;
        big.assert_problem(413);
    }

    // Malformed JSON: a 4xx answer, stored like any other, with no payment.
    let malformed = api
        .send(
            api.post()
                .header("idempotency-key", "malformed-1")
                .header("content-type", "application/json")
                .body("{\"account\": "),
        )
        .await;
    assert!(
        matches!(malformed.status.as_u16(), 400 | 422),
        "{malformed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_have_one_effect() {
    let server = Server::start(&[]);
    let api = Api::new(&server);

    let answers = api
        .pay_concurrently(30, "concurrent-1", "acct-concurrent", 990, "600")
        .await;

    let created: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED)
        .collect();
    assert!(!created.is_empty(), "no 201 among {answers:?}");
    assert_eq!(
        created.iter().filter(|a| !a.replayed()).count(),
        1,
        "exactly one copy runs"
    );
    for a in &created {
        assert_eq!(a.body, created[0].body, "every 201 is the same answer");
    }
    for a in answers.iter().filter(|a| a.status != StatusCode::CREATED) {
        a.assert_problem(409);
        assert!(a.headers.contains_key("retry-after"), "{a:?}");
    }
    assert_eq!(api.totals("acct-concurrent").await, (1, 990));

    let later = api.pay("concurrent-1", "acct-concurrent", 990, &[]).await;
    assert!(later.replayed(), "{later:?}");
    assert_eq!(later.body, created[0].body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_failure_then_clean_retry_runs_once() {
    let server = Server::start(&[]);
    let api = Api::new(&server);

    let failed = api
        .pay("fail-1", "acct-fail", 4200, &[("x-simulate-fail", "500")])
        .await;
    failed.assert_problem(500);
    assert_eq!(api.totals("acct-fail").await, (0, 0));

    let retry = api.pay("fail-1", "acct-fail", 4200, &[]).await;
    retry.assert_created("acct-fail", 4200);
    assert!(!retry.replayed(), "{retry:?}");
    assert_eq!(api.totals("acct-fail").await, (1, 4200));

    let again = api.pay("fail-1", "acct-fail", 4200, &[]).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, retry.body);
    assert_eq!(api.totals("acct-fail").await, (1, 4200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_principal_has_its_own_keys() {
    let server = Server::start(&[]);
    let api = Api::new(&server);

    let alice = api
        .pay(
            "shared-key",
            "acct-auth",
            100,
            &[("authorization", "Bearer alice")],
        )
        .await;
    let bob = api
        .pay(
            "shared-key",
            "acct-auth",
            100,
            &[("authorization", "Bearer bob")],
        )
        .await;
    let alice_id = alice.assert_created("acct-auth", 100);
    let bob_id = bob.assert_created("acct-auth", 100);
    assert!(!alice.replayed() && !bob.replayed());
    assert_ne!(alice_id, bob_id);
    assert_eq!(api.totals("acct-auth").await, (2, 200));

    // Each principal's retry replays its own answer.
    let alice_again = api
        .pay(
            "shared-key",
            "acct-auth",
            100,
            &[("authorization", "Bearer alice")],
        )
        .await;
    assert!(alice_again.replayed());
    assert_eq!(alice_again.body, alice.body);
    assert_eq!(api.totals("acct-auth").await, (2, 200));

    // A malformed Authorization header is refused before anything is recorded.
    let malformed = api
        .pay(
            "shared-key",
            "acct-auth",
            100,
            &[("authorization", "Basic")],
        )
        .await;
    malformed.assert_problem(401);
    assert_eq!(api.totals("acct-auth").await, (2, 200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_new_again_after_the_ttl() {
    let server = Server::start(&["--ttl-ms", "1000"]);
    let api = Api::new(&server);

    let first = api.pay("ttl-1", "acct-ttl", 50, &[]).await;
    let first_id = first.assert_created("acct-ttl", 50);
    assert!(api.pay("ttl-1", "acct-ttl", 50, &[]).await.replayed());

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let later = api.pay("ttl-1", "acct-ttl", 50, &[]).await;
    let later_id = later.assert_created("acct-ttl", 50);
    assert!(!later.replayed(), "{later:?}");
    assert_ne!(first_id, later_id);
    assert_eq!(api.totals("acct-ttl").await, (2, 100));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_wait_gives_every_copy_the_answer() {
    let server = Server::start(&["--in-flight", "wait"]);
    let api = Api::new(&server);

    let answers = api
        .pay_concurrently(10, "wait-1", "acct-wait", 300, "500")
        .await;
    for a in &answers {
        a.assert_created("acct-wait", 300);
        assert_eq!(a.body, answers[0].body, "every copy gets the same answer");
    }
    assert_eq!(answers.iter().filter(|a| !a.replayed()).count(), 1);
    assert_eq!(api.totals("acct-wait").await, (1, 300));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_lease_is_renewed_while_the_handler_runs() {
    let server = Server::start(&["--lease-ms", "200"]);
    let api = Api::new(&server);

    let slow = {
        let api = api.clone();
        tokio::spawn(async move {
            api.pay(
                "lease-1",
                "acct-lease",
                10,
                &[("x-simulate-delay-ms", "800")],
            )
            .await
        })
    };
    // Well past the first lease: the holder renewed it, so a copy is a conflict, not a
    // takeover.
    tokio::time::sleep(Duration::from_millis(500)).await;
    api.pay("lease-1", "acct-lease", 10, &[])
        .await
        .assert_problem(409);
    slow.await.unwrap().assert_created("acct-lease", 10);
    assert_eq!(api.totals("acct-lease").await, (1, 10));
}

#[test]
fn unavailable_stores_and_bad_arguments_exit_non_zero() {
    for (store, name) in [
        ("redis://127.0.0.1:6379", "redis"),
        ("postgres://localhost/payments", "postgres"),
    ] {
        let (status, stderr) = run_to_exit(&["--listen", "127.0.0.1:0", "--store", store]);
        assert!(!status.success(), "--store {store}: {status:?}");
        assert!(
            stderr.contains("not implemented yet") && stderr.contains(name),
            "--store {store}: {stderr:?}"
        );
    }
    for bad in [
        &["--bogus"][..],
        &["--listen"],
        &["--lease-ms", "soon"],
        &["--ttl-ms", "0"],
        &["--in-flight", "sometimes"],
        &["--store", "mysql://x"],
    ] {
        let (status, stderr) = run_to_exit(bad);
        assert_eq!(status.code(), Some(2), "{bad:?}: {stderr}");
        assert!(stderr.starts_with("error: "), "{bad:?}: {stderr}");
    }
}
