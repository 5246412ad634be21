//! The `payments` example driven as an outside user would: the binary, a running
//! server, an HTTP client with the example's routes, isolated Redis and PostgreSQL
//! namespaces with direct readers of what the example wrote ([`RedisSpace`],
//! [`PgSpace`]), and the audits of crash and outage runs ([`audit`]).

pub mod audit;
mod postgres;
mod redis;

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use retrysafe_core::idempotency::{Principal, RecordId, Scope};
use retrysafe_core::wire::IdempotencyKey;
use serde_json::{Value, json};

pub use postgres::PgSpace;
pub use redis::RedisSpace;

/// The principal of requests without an `Authorization` header (the example's
/// `app::ANONYMOUS`).
pub const ANONYMOUS: &str = "anonymous client";

/// The `payments` example's binary.
pub fn binary() -> PathBuf {
    crate::example::example_binary("payments")
}

/// A running `payments` process, killed when dropped.
#[derive(Debug)]
pub struct Server {
    child: Child,
    /// `http://ADDR` of its ready line.
    pub base: String,
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
    pub fn start(args: &[&str]) -> Server {
        Server::start_with(args, &[])
    }

    /// Like [`start`](Self::start), with extra environment variables.
    pub fn start_with(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(binary())
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
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
                server.stderr()
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

    /// Kills the process with SIGKILL (on Unix) and waits for it: no graceful shutdown,
    /// no drain, nothing of it runs after this returns.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        let status = self.child.wait().unwrap();
        assert!(!status.success(), "killed, yet {status:?}");
    }

    /// Whether the process is still running (it has not exited or been killed).
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the process wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
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

/// Runs `payments ARGS` to its exit (killed after 30 s): its status and stderr.
pub fn run_to_exit(args: &[&str], env: &[(&str, &str)]) -> (ExitStatus, String) {
    let mut child = Command::new(binary())
        .args(args)
        .envs(env.iter().copied())
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
        if started.elapsed() > Duration::from_secs(30) {
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

/// An HTTP answer, read whole.
#[derive(Debug)]
pub struct Answer {
    /// Its status.
    pub status: StatusCode,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its body.
    pub body: Bytes,
}

impl Answer {
    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// Whether the answer is a replay (`idempotent-replayed: true`).
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// A `status` problem+json answer with a `type`; returns the type.
    pub fn assert_problem(&self, status: u16) -> String {
        assert_eq!(self.status.as_u16(), status, "{self:?}");
        let ct = self.headers.get("content-type").unwrap().to_str().unwrap();
        assert!(ct.starts_with("application/problem+json"), "{self:?}");
        let ty = self.json()["type"].as_str().unwrap().to_owned();
        assert!(!ty.is_empty(), "{self:?}");
        ty
    }

    /// A `status` problem whose type ends with `slug`.
    pub fn assert_problem_type(&self, status: u16, slug: &str) {
        let ty = self.assert_problem(status);
        assert!(ty.ends_with(&format!(":{slug}")), "{slug}: {self:?}");
    }

    /// A 503 problem with a `retry-after`.
    pub fn assert_unavailable(&self) {
        self.assert_problem(503);
        assert!(self.headers.contains_key("retry-after"), "{self:?}");
    }

    /// A 201 for `account` / `amount`; returns the payment id.
    pub fn assert_created(&self, account: &str, amount: i64) -> String {
        assert_eq!(self.status, StatusCode::CREATED, "{self:?}");
        let v = self.json();
        assert_eq!(v["account"], account, "{self:?}");
        assert_eq!(v["amount_cents"], amount, "{self:?}");
        let id = v["id"].as_str().unwrap();
        assert!(!id.is_empty(), "{self:?}");
        id.to_owned()
    }
}

/// A client of the example's routes.
#[derive(Debug, Clone)]
pub struct Api {
    /// The HTTP client (40 s timeout).
    pub http: reqwest::Client,
    /// `http://ADDR` of the server.
    pub base: String,
}

impl Api {
    /// A client of `server`.
    pub fn new(server: &Server) -> Api {
        Api {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(40))
                .build()
                .unwrap(),
            base: server.base.clone(),
        }
    }

    /// Sends `req` and reads the whole answer.
    pub async fn try_send(&self, req: reqwest::RequestBuilder) -> reqwest::Result<Answer> {
        let res = req.send().await?;
        Ok(Answer {
            status: res.status(),
            headers: res.headers().clone(),
            body: res.bytes().await?,
        })
    }

    /// Like [`try_send`](Self::try_send); a transport error fails the test.
    pub async fn send(&self, req: reqwest::RequestBuilder) -> Answer {
        self.try_send(req).await.unwrap()
    }

    /// `POST /payments`, to be completed.
    pub fn post(&self) -> reqwest::RequestBuilder {
        self.http.post(format!("{}/payments", self.base))
    }

    fn payment(
        &self,
        key: &str,
        account: &str,
        amount: i64,
        extra: &[(&str, &str)],
    ) -> reqwest::RequestBuilder {
        let mut req = self
            .post()
            .header("idempotency-key", key)
            .json(&json!({ "account": account, "amount_cents": amount }));
        for (name, value) in extra {
            req = req.header(*name, *value);
        }
        req
    }

    /// `POST /payments` with `key`, a JSON payment and extra headers.
    pub async fn pay(
        &self,
        key: &str,
        account: &str,
        amount: i64,
        extra: &[(&str, &str)],
    ) -> Answer {
        self.send(self.payment(key, account, amount, extra)).await
    }

    /// Like [`pay`](Self::pay), for a request whose server may die under it.
    pub async fn try_pay(
        &self,
        key: &str,
        account: &str,
        amount: i64,
        extra: &[(&str, &str)],
    ) -> reqwest::Result<Answer> {
        self.try_send(self.payment(key, account, amount, extra))
            .await
    }

    /// `copies` identical payments sent at once, each delayed by the server for
    /// `delay_ms` before its effect.
    pub async fn pay_concurrently(
        &self,
        copies: usize,
        key: &str,
        account: &str,
        amount: i64,
        delay_ms: &str,
    ) -> Vec<Answer> {
        pay_split(
            std::slice::from_ref(self),
            copies,
            key,
            account,
            amount,
            delay_ms,
        )
        .await
    }

    /// `GET /payments?account=A`.
    pub async fn try_totals(&self, account: &str) -> Answer {
        self.send(
            self.http
                .get(format!("{}/payments", self.base))
                .query(&[("account", account)]),
        )
        .await
    }

    /// `GET /payments?account=A`: (count, total_cents).
    pub async fn totals(&self, account: &str) -> (u64, i64) {
        let res = self.try_totals(account).await;
        assert_eq!(res.status, StatusCode::OK, "{res:?}");
        let v = res.json();
        (
            v["count"].as_u64().unwrap(),
            v["total_cents"].as_i64().unwrap(),
        )
    }
}

/// `copies` identical payments sent at once, spread in turn over `apis` (one server
/// each), each delayed by the server for `delay_ms` before its effect.
pub async fn pay_split(
    apis: &[Api],
    copies: usize,
    key: &str,
    account: &str,
    amount: i64,
    delay_ms: &str,
) -> Vec<Answer> {
    let sends = (0..copies).map(|i| {
        let api = apis[i % apis.len()].clone();
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

/// The record id the example gives `key` of an anonymous client.
pub fn record_id(key: &str) -> RecordId {
    RecordId::new(
        &Scope::from(&Principal::new(ANONYMOUS)),
        &IdempotencyKey::new(key).unwrap(),
    )
}
