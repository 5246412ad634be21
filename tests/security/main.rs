//! Security tests of the server side, over real TCP: an axum server on 127.0.0.1:0 with
//! the `IdempotencyLayer` (and the `EdgeLayer`, `RetryBudgetLayer` and `PropagateLayer`
//! where they matter), driven by reqwest, hyper, and raw `TcpStream`s for clients that
//! send malformed requests, disconnect, or never read.
//!
//! One module per attack: no replay across tenants (`cross_tenant`); no scope, no
//! guarding (`unscoped`); key floods bounded by the `MemoryStore`'s limits
//! (`key_flood`); forged convention headers neutralised by the `EdgeLayer`
//! (`forged_headers`); detached handler work bounded under a flood of disconnecting
//! clients (`disconnect_flood`); oversize headers and bodies (`oversize`); bodies
//! trickled byte by byte (`trickled_bodies`); CR/LF, non-ASCII and control bytes in
//! keys, and keys of maximum length (`malformed_keys`); a client that sends a key and
//! never reads the response (`never_reading`). This file holds the server under test
//! and the clients they share.
//!
//! No timing assertions: the tests wait for conditions (handlers parked at a gate, a
//! tracker drained) and assert counts and invariants. The flood keys come from a seeded
//! generator: the seed is printed, and `SECURITY_SEED=N` replays it.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    missing_docs,
    unreachable_pub
)]

mod cross_tenant;
mod disconnect_flood;
mod forged_headers;
mod key_flood;
mod malformed_keys;
mod never_reading;
mod oversize;
mod trickled_bodies;
mod unscoped;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request as AxumRequest, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response as AxumResponse};
use axum::routing::{get, post};
use axum::{Extension, Router};
use bytes::Bytes;
use retrysafe_tower::idempotency::{IdempotencyLayer, Principal, ProblemKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

// ---------------------------------------------------------------------------------
// The server under test
// ---------------------------------------------------------------------------------

/// A gate the handlers of requests marked `x-hold` wait at until the test opens it.
#[derive(Default)]
struct Gate {
    open: AtomicBool,
    notify: tokio::sync::Notify,
}

impl Gate {
    async fn wait(&self) {
        loop {
            // A `Notified` gets every `notify_waiters` from its creation on.
            let notified = self.notify.notified();
            if self.open.load(Ordering::SeqCst) {
                return;
            }
            notified.await;
        }
    }

    fn open(&self) {
        self.open.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    fn close(&self) {
        self.open.store(false, Ordering::SeqCst);
    }
}

/// What the handlers did.
#[derive(Default)]
struct Effects {
    /// Effects (handler runs past the gate).
    runs: AtomicUsize,
    /// Handlers waiting at the gate now.
    holding: AtomicUsize,
    /// Handlers running now, and the most ever at once.
    running: AtomicUsize,
    high_water: AtomicUsize,
    /// Handlers started and finished.
    started: AtomicUsize,
    finished: AtomicUsize,
    /// The key of every started handler.
    keys: Mutex<Vec<String>>,
    /// Response futures dropped before they finished (the client went away), seen by
    /// a layer outside the idempotency layer; and the 503 answers it saw.
    cancelled: AtomicUsize,
    answered_503: AtomicUsize,
    gate: Gate,
}

impl Effects {
    fn new() -> Arc<Effects> {
        Arc::new(Effects::default())
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn holding(&self) -> usize {
        self.holding.load(Ordering::SeqCst)
    }

    fn started_keys(&self) -> HashSet<String> {
        self.keys.lock().unwrap().iter().cloned().collect()
    }
}

/// Decrements a counter when dropped.
struct Dec<'a>(&'a AtomicUsize);

impl Drop for Dec<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The guarded handler: `x-hold` waits at the gate, `x-big: N` answers N bytes of `x`,
/// otherwise the body names the effect number, the caller and the key. Answers 201.
async fn handler(
    State(fx): State<Arc<Effects>>,
    principal: Option<Extension<Principal>>,
    headers: HeaderMap,
    body: Bytes,
) -> AxumResponse {
    let now = fx.running.fetch_add(1, Ordering::SeqCst) + 1;
    let _running = Dec(&fx.running);
    fx.high_water.fetch_max(now, Ordering::SeqCst);
    fx.started.fetch_add(1, Ordering::SeqCst);
    let text = |name: &str| {
        headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    let key = text("idempotency-key").unwrap_or_default();
    fx.keys.lock().unwrap().push(key.clone());
    if headers.contains_key("x-hold") {
        fx.holding.fetch_add(1, Ordering::SeqCst);
        let _holding = Dec(&fx.holding);
        fx.gate.wait().await;
    }
    let n = fx.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let who = principal
        .map(|Extension(p)| p.as_str().to_owned())
        .or_else(|| text("x-tenant"))
        .unwrap_or_else(|| "nobody".to_owned());
    let payload = match text("x-big").and_then(|v| v.parse::<usize>().ok()) {
        Some(size) => Bytes::from(vec![b'x'; size]),
        None => Bytes::from(format!(
            "effect {n} for {who} key {key}: {}",
            String::from_utf8_lossy(&body)
        )),
    };
    fx.finished.fetch_add(1, Ordering::SeqCst);
    (StatusCode::CREATED, payload).into_response()
}

/// Authentication: `authorization: Bearer T` → principal T; no header, no principal.
async fn bearer_auth(mut req: AxumRequest, next: Next) -> AxumResponse {
    let principal = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(Principal::new);
    if let Some(p) = principal {
        req.extensions_mut().insert(p);
    }
    next.run(req).await
}

/// Counts response futures dropped before they finished: the client went away.
async fn watch_cancel(
    State(fx): State<Arc<Effects>>,
    req: AxumRequest,
    next: Next,
) -> AxumResponse {
    struct Guard(Option<Arc<Effects>>);
    impl Drop for Guard {
        fn drop(&mut self) {
            if let Some(fx) = self.0.take() {
                fx.cancelled.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
    let mut guard = Guard(Some(fx));
    let res = next.run(req).await;
    if let Some(fx) = guard.0.take()
        && res.status() == StatusCode::SERVICE_UNAVAILABLE
    {
        fx.answered_503.fetch_add(1, Ordering::SeqCst);
    }
    res
}

/// `POST /pay` (and `GET /health`, unguarded) behind `layer`, with the bearer
/// authentication when `auth`.
fn app(layer: IdempotencyLayer, auth: bool, fx: &Arc<Effects>) -> Router {
    let router = Router::new()
        .route("/pay", post(handler))
        .route("/health", get(|| async { "ok" }))
        .with_state(Arc::clone(fx))
        .layer(layer);
    let router = if auth {
        router.layer(axum::middleware::from_fn(bearer_auth))
    } else {
        router
    };
    router.layer(axum::middleware::from_fn_with_state(
        Arc::clone(fx),
        watch_cancel,
    ))
}

async fn serve(app: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// Polls `check` every 5 ms until it holds; panics naming `what` after 30 s (a hang,
/// not a timing assertion).
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..6000 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("timed out waiting for: {what}");
}

/// The seed of this run's generated keys: `SECURITY_SEED`, or from the clock.
fn seed() -> u64 {
    let seed = std::env::var("SECURITY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("security: seed {seed} (replay with SECURITY_SEED={seed})");
    seed
}

/// splitmix64: enough randomness for keys, with no extra dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A key of 1 to 64 characters of 0x21–0x7E.
    fn key(&mut self) -> String {
        let len = 1 + (self.next() % 64) as usize;
        (0..len)
            .map(|_| char::from(0x21 + (self.next() % 94) as u8))
            .collect()
    }
}

// ---------------------------------------------------------------------------------
// Clients
// ---------------------------------------------------------------------------------

/// An answer read over reqwest.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Asserts an RFC 9457 problem of `kind` with the headers its case requires.
    fn assert_problem(&self, kind: ProblemKind) {
        assert_eq!(
            self.status,
            kind.status().as_u16(),
            "{kind}: {}",
            self.text()
        );
        assert_eq!(self.headers["content-type"], "application/problem+json");
        let v: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(v["type"], kind.type_uri(), "{}", self.text());
        assert_eq!(v["status"], kind.status().as_u16());
        assert_eq!(
            self.headers.get("do-not-retry").is_some(),
            kind.do_not_retry(),
            "do-not-retry on {kind}"
        );
        assert!(!self.replayed());
    }
}

async fn answer(res: reqwest::Response) -> Answer {
    let status = res.status().as_u16();
    let headers = res.headers().clone();
    let body = res.bytes().await.unwrap();
    Answer {
        status,
        headers,
        body,
    }
}

/// `POST /pay` with `key` and `body`, and extra headers.
async fn pay(
    client: &reqwest::Client,
    addr: SocketAddr,
    key: Option<&str>,
    body: impl Into<reqwest::Body>,
    headers: &[(&str, &str)],
) -> Answer {
    let mut req = client
        .post(format!("http://{addr}/pay"))
        .header("content-type", "text/plain")
        .body(body);
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    answer(req.send().await.unwrap()).await
}

async fn healthy(client: &reqwest::Client, addr: SocketAddr) {
    let res = client
        .get(format!("http://{addr}/health"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200, "the server keeps serving");
}

/// What a raw client read back: the status (none when the server closed without an
/// answer) and the whole text.
#[derive(Debug)]
struct Raw {
    status: Option<u16>,
    text: String,
}

impl Raw {
    fn is_problem(&self, kind: ProblemKind) -> bool {
        self.status == Some(kind.status().as_u16())
            && self.text.contains("application/problem+json")
            && self.text.contains(&kind.type_uri())
    }
}

/// Writes `request` on a new connection and reads until the server closes (or resets)
/// it. Write errors are tolerated: a server may answer and close before it read
/// everything.
async fn raw(addr: SocketAddr, request: &[u8]) -> Raw {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let _ = stream.write_all(request).await;
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), async {
        let mut chunk = [0u8; 8192];
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the server neither answered nor closed");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok());
    Raw { status, text }
}

/// A raw `POST /pay` as bearer `who`, with the header line `key_line` (bytes as
/// they are), `body`, and `Connection: close`.
fn raw_post(who: &str, key_line: &[u8], body: &[u8]) -> Vec<u8> {
    let mut req = format!(
        "POST /pay HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer {who}\r\n\
         content-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(key_line);
    req.extend_from_slice(b"\r\n\r\n");
    req.extend_from_slice(body);
    req
}
