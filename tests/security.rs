//! Security tests of the server side, over real TCP: an axum server on 127.0.0.1:0 with
//! the `IdempotencyLayer` (and the `EdgeLayer`, `RetryBudgetLayer` and `PropagateLayer`
//! where they matter), driven by reqwest, hyper, and raw `TcpStream`s for clients that
//! send malformed requests, disconnect, or never read.
//!
//! Cases: no cross-tenant replay; no scope, no guarding; key floods
//! bounded by the `MemoryStore`'s limits; forged convention headers neutralised by the
//! `EdgeLayer`; detached handler work bounded under a flood of disconnecting clients;
//! oversize headers and bodies; CR/LF, non-ASCII and control bytes in keys; keys of
//! maximum length; a client that sends a key and never reads the response.
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

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request as AxumRequest, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response as AxumResponse};
use axum::routing::{get, post};
use axum::{Extension, Router};
use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use retrysafe::memory::MemoryStore;
use retrysafe_core::CallContext;
use retrysafe_core::backoff::{Backoff, Jitter};
use retrysafe_core::budget::{BudgetSnapshot, RatioConfig, RetryBudget};
use retrysafe_core::idempotency::Scope;
use retrysafe_core::strategy::StandardRetryStrategy;
use retrysafe_core::wire::{parse_grpc_timeout, parse_request_timeout_ms};
use retrysafe_tower::budget::RetryBudgetLayer;
use retrysafe_tower::edge::EdgeLayer;
use retrysafe_tower::idempotency::{IdempotencyLayer, Principal, ProblemKind};
use retrysafe_tower::propagate::PropagateLayer;
use retrysafe_tower::retry::{ReplayBody, RetryLayer, RetryService};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tower::{Layer, ServiceExt};

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

// ---------------------------------------------------------------------------------
// Cross-tenant replay
// ---------------------------------------------------------------------------------

/// The cross-scope scenario, for callers identified by the header `as_caller(who)`.
async fn no_replay_across_scopes(
    addr: SocketAddr,
    fx: &Effects,
    as_caller: fn(&str) -> (&'static str, String),
) {
    let client = reqwest::Client::new();
    let send = |who: &'static str, key: &'static str, body: &'static str, hold: bool| {
        let client = client.clone();
        async move {
            let (name, value) = as_caller(who);
            let mut headers = vec![(name, value.as_str())];
            if hold {
                headers.push(("x-hold", "1"));
            }
            pay(&client, addr, Some(key), body, &headers).await
        }
    };

    // Same key, same body: A's effect, then B's own effect (never A's answer).
    let a1 = send("alice", "k-shared", "pay 100", false).await;
    assert_eq!(a1.status, 201);
    assert!(!a1.replayed());
    assert!(a1.text().contains("for alice"), "{}", a1.text());
    let b1 = send("bob", "k-shared", "pay 100", false).await;
    assert_eq!(b1.status, 201);
    assert!(!b1.replayed(), "a replay across scopes");
    assert!(b1.text().contains("for bob"), "{}", b1.text());
    assert_ne!(a1.body, b1.body);
    // Each replays its own.
    let a2 = send("alice", "k-shared", "pay 100", false).await;
    let b2 = send("bob", "k-shared", "pay 100", false).await;
    assert!(a2.replayed() && b2.replayed());
    assert_eq!(a2.body, a1.body);
    assert_eq!(b2.body, b1.body);
    assert_eq!(fx.runs(), 2);

    // Another body under the same key in a third scope: no 422 across scopes.
    let c1 = send("carol", "k-shared", "pay 999", false).await;
    assert_eq!(c1.status, 201, "{}", c1.text());
    assert!(!c1.replayed() && c1.text().contains("for carol"));
    assert_eq!(fx.runs(), 3);

    // A's copy in flight: B's same key is not a 409, it runs at once.
    let a_held = tokio::spawn(send("alice", "k-held", "pay 5", true));
    eventually("alice's handler parked", || fx.holding() == 1).await;
    let b3 = send("bob", "k-held", "pay 5", false).await;
    assert_eq!(b3.status, 201, "{}", b3.text());
    assert!(!b3.replayed() && b3.text().contains("for bob"));
    // While A's is still in flight, A's own duplicate is a 409 (the guard works).
    send("alice", "k-held", "pay 5", false)
        .await
        .assert_problem(ProblemKind::InFlight);
    fx.gate.open();
    let a3 = a_held.await.unwrap();
    assert_eq!(a3.status, 201);
    assert!(a3.text().contains("for alice"));
    assert_eq!(send("alice", "k-held", "pay 5", false).await.body, a3.body);
    assert_eq!(send("bob", "k-held", "pay 5", false).await.body, b3.body);
    assert_eq!(fx.runs(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_from_another_principal_is_never_replayed() {
    let fx = Effects::new();
    let addr = serve(app(IdempotencyLayer::in_memory(), true, &fx)).await;
    no_replay_across_scopes(addr, &fx, |who| ("authorization", format!("Bearer {who}"))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_from_another_tenant_is_never_replayed() {
    let fx = Effects::new();
    let layer = IdempotencyLayer::in_memory().scope_by(|parts| {
        parts
            .headers
            .get("x-tenant")
            .map(|v| Scope::new(v.as_bytes()))
    });
    let addr = serve(app(layer, false, &fx)).await;
    no_replay_across_scopes(addr, &fx, |who| ("x-tenant", who.to_owned())).await;
}

// ---------------------------------------------------------------------------------
// No scope, no guarding
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_scope_nothing_is_guarded_and_nothing_runs() {
    let client = reqwest::Client::new();
    let store = MemoryStore::new();

    // No authentication layer: no Principal.
    let fx = Effects::new();
    let addr = serve(app(IdempotencyLayer::new(store.clone()), false, &fx)).await;
    for _ in 0..3 {
        pay(&client, addr, Some("k"), "pay 1", &[])
            .await
            .assert_problem(ProblemKind::ScopeMissing);
    }
    // A forged bearer header is nothing without the authentication layer.
    pay(
        &client,
        addr,
        Some("k"),
        "pay 1",
        &[("authorization", "Bearer alice")],
    )
    .await
    .assert_problem(ProblemKind::ScopeMissing);
    assert_eq!(
        fx.started.load(Ordering::SeqCst),
        0,
        "the handler never ran"
    );
    assert_eq!(
        (store.in_flight_len(), store.cached_len()),
        (0, 0),
        "no record"
    );
    // Without a key the request is not guarded at all (the first row of the decision table).
    assert_eq!(pay(&client, addr, None, "pay 1", &[]).await.status, 201);
    assert_eq!(fx.runs(), 1);
    assert_eq!((store.in_flight_len(), store.cached_len()), (0, 0));

    // A scope_by rule that finds nothing answers the same.
    let fx = Effects::new();
    let layer = IdempotencyLayer::new(store.clone()).scope_by(|parts| {
        parts
            .headers
            .get("x-tenant")
            .map(|v| Scope::new(v.as_bytes()))
    });
    let addr = serve(app(layer, false, &fx)).await;
    pay(&client, addr, Some("k"), "pay 1", &[])
        .await
        .assert_problem(ProblemKind::ScopeMissing);
    assert_eq!(fx.started.load(Ordering::SeqCst), 0);
    assert_eq!((store.in_flight_len(), store.cached_len()), (0, 0));
    let ok = pay(&client, addr, Some("k"), "pay 1", &[("x-tenant", "t1")]).await;
    assert_eq!(ok.status, 201);
    assert_eq!((store.in_flight_len(), store.cached_len()), (0, 1));
}

// ---------------------------------------------------------------------------------
// Key floods against the MemoryStore's bounds
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_flood_stays_within_the_memory_store_bounds() {
    const MAP: usize = 16; // the store's in-flight bound
    const MAX_BYTES: u64 = 64 * 1024;
    const FLOOD: usize = 600;
    const BODY: usize = 1024;
    let mut rng = Rng(seed());

    let evicted = Arc::new(AtomicUsize::new(0));
    let store = {
        let evicted = Arc::clone(&evicted);
        MemoryStore::new()
            .max_in_flight(MAP)
            .max_bytes(MAX_BYTES)
            .on_evicted(move |_| {
                evicted.fetch_add(1, Ordering::SeqCst);
            })
            .build()
            .unwrap()
    };
    // The layer's own bound is above the store's, so the store's is the one flooded.
    let layer = IdempotencyLayer::new(store.clone())
        .max_in_flight(1024)
        .build()
        .unwrap();
    let fx = Effects::new();
    let addr = serve(app(layer, true, &fx)).await;
    let client = reqwest::Client::new();
    let bearer = [("authorization", "Bearer mallory")];
    let hold = [("authorization", "Bearer mallory"), ("x-hold", "1")];

    // Sample the cache's weight all along.
    let sampling = Arc::new(AtomicBool::new(true));
    let max_seen = Arc::new(AtomicU64::new(0));
    let samples = Arc::new(AtomicUsize::new(0));
    let sampler = tokio::spawn({
        let (store, sampling, max_seen, samples) = (
            store.clone(),
            Arc::clone(&sampling),
            Arc::clone(&max_seen),
            Arc::clone(&samples),
        );
        async move {
            while sampling.load(Ordering::SeqCst) {
                let bytes = store.cached_bytes();
                assert!(bytes <= MAX_BYTES, "cached_bytes {bytes} over {MAX_BYTES}");
                max_seen.fetch_max(bytes, Ordering::SeqCst);
                samples.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    });

    // Half the in-flight map held by parked handlers.
    let mut holders = Vec::new();
    let held: Vec<String> = (0..MAP)
        .map(|i| format!("held-{i}-{}", rng.key()))
        .collect();
    for key in &held[..MAP / 2] {
        let (client, key) = (client.clone(), key.clone());
        holders.push(tokio::spawn(async move {
            pay(&client, addr, Some(&key), "hold", &hold).await
        }));
    }
    eventually("the first holders parked", || fx.holding() == MAP / 2).await;
    assert_eq!(store.in_flight_len(), MAP / 2);

    // The flood: distinct keys that complete, four at a time, with duplicates of the
    // held keys mixed in.
    let mut flood: Vec<String> = (0..FLOOD).map(|i| format!("f{i}-{}", rng.key())).collect();
    flood.sort();
    flood.dedup();
    let big = BODY.to_string();
    let results: Vec<Answer> = futures_util::stream::iter(flood.iter().enumerate())
        .map(|(i, key)| {
            let (client, big, store) = (client.clone(), big.clone(), store.clone());
            let dup = held[(i / 50) % (MAP / 2)].clone();
            async move {
                let a = pay(
                    &client,
                    addr,
                    Some(key),
                    "flood",
                    &[bearer[0], ("x-big", &big)],
                )
                .await;
                let bytes = store.cached_bytes();
                assert!(bytes <= MAX_BYTES, "cached_bytes {bytes} over {MAX_BYTES}");
                if i % 50 == 0 {
                    // A duplicate of a held key: 409, never a second run.
                    pay(&client, addr, Some(&dup), "hold", &bearer)
                        .await
                        .assert_problem(ProblemKind::InFlight);
                }
                a
            }
        })
        .buffer_unordered(4)
        .collect()
        .await;
    for a in &results {
        assert_eq!(a.status, 201, "{}", a.text());
        assert!(!a.replayed());
        assert_eq!(a.body.len(), BODY);
    }
    assert_eq!(fx.runs(), flood.len(), "every flood key ran once");
    assert_eq!(fx.holding(), MAP / 2, "the held keys still run, once each");
    assert_eq!(
        store.in_flight_len(),
        MAP / 2,
        "no in-flight claim was evicted"
    );
    assert!(
        evicted.load(Ordering::SeqCst) > 0,
        "the flood evicted completed records"
    );

    // The other half of the map held too: the map is full.
    for key in &held[MAP / 2..] {
        let (client, key) = (client.clone(), key.clone());
        holders.push(tokio::spawn(async move {
            pay(&client, addr, Some(&key), "hold", &hold).await
        }));
    }
    eventually("all holders parked", || fx.holding() == MAP).await;
    assert_eq!(store.in_flight_len(), MAP);
    // New keys: 503 with retry-after, never an eviction of a claim.
    for _ in 0..20 {
        let a = pay(&client, addr, Some(&rng.key()), "new", &bearer).await;
        a.assert_problem(ProblemKind::Overloaded);
        assert!(a.headers.contains_key("retry-after"));
    }
    // Every held key is still in flight: its duplicates get 409 and do not run.
    for key in &held {
        pay(&client, addr, Some(key), "hold", &bearer)
            .await
            .assert_problem(ProblemKind::InFlight);
    }
    assert_eq!(store.in_flight_len(), MAP);
    assert_eq!(fx.started.load(Ordering::SeqCst), flood.len() + MAP);

    // The holders finish; each held key then replays its own response.
    fx.gate.open();
    let mut firsts = Vec::new();
    for h in holders {
        let a = h.await.unwrap();
        assert_eq!(a.status, 201);
        firsts.push(a.body);
    }
    for (key, first) in held.iter().zip(&firsts) {
        let again = pay(&client, addr, Some(key), "hold", &bearer).await;
        assert!(again.replayed(), "{key}: {}", again.text());
        assert_eq!(&again.body, first);
        assert!(again.text().contains(key.as_str()));
    }
    assert_eq!(fx.runs(), flood.len() + MAP, "no key ran twice");
    assert_eq!(store.in_flight_len(), 0);

    sampling.store(false, Ordering::SeqCst);
    sampler.await.unwrap();
    // Every completed record is still cached, or shrunk to a tombstone (its key never
    // runs again), or was reported evicted (a tombstone dropped past its share).
    let cached = store.cached_len() as usize;
    let tombstones = store.tombstones_len() as usize;
    let evicted = evicted.load(Ordering::SeqCst);
    assert_eq!(
        cached + tombstones + evicted,
        flood.len() + MAP,
        "cached {cached}, tombstones {tombstones}, evicted {evicted}"
    );
    eprintln!(
        "key flood: {} keys, {} samples, max cached_bytes {} of {MAX_BYTES}, {cached} cached, \
         {tombstones} tombstones, {evicted} evicted",
        flood.len(),
        samples.load(Ordering::SeqCst),
        max_seen.load(Ordering::SeqCst)
    );
}

/// A flood that fills the store's in-flight map cannot switch a `fail_open` layer to
/// unguarded execution: a full map is not an unavailable store, so new keys get 503
/// and nothing runs unguarded (a duplicate of a held key included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_in_flight_map_never_fails_open() {
    const MAP: usize = 4;
    let store = MemoryStore::new().max_in_flight(MAP).build().unwrap();
    let layer = IdempotencyLayer::new(store.clone()).fail_open();
    let fx = Effects::new();
    let addr = serve(app(layer, true, &fx)).await;
    let client = reqwest::Client::new();
    let bearer = [("authorization", "Bearer mallory")];
    let hold = [("authorization", "Bearer mallory"), ("x-hold", "1")];
    let mut holders = Vec::new();
    for i in 0..MAP {
        let client = client.clone();
        holders.push(tokio::spawn(async move {
            pay(&client, addr, Some(&format!("held-{i}")), "x", &hold).await
        }));
    }
    eventually("the map is full", || fx.holding() == MAP).await;
    for i in 0..20 {
        let a = pay(&client, addr, Some(&format!("new-{i}")), "x", &bearer).await;
        a.assert_problem(ProblemKind::Overloaded);
    }
    pay(&client, addr, Some("held-0"), "x", &bearer)
        .await
        .assert_problem(ProblemKind::InFlight);
    assert_eq!(
        fx.started.load(Ordering::SeqCst),
        MAP,
        "nothing ran unguarded"
    );
    fx.gate.open();
    for h in holders {
        assert_eq!(h.await.unwrap().status, 201);
    }
    assert_eq!(
        pay(&client, addr, Some("new-0"), "x", &bearer).await.status,
        201
    );
    assert_eq!(fx.runs(), MAP + 1);
}

// ---------------------------------------------------------------------------------
// Forged convention headers and the EdgeLayer
// ---------------------------------------------------------------------------------

type Outbound = RetryService<Client<HttpConnector, ReplayBody<Full<Bytes>>>>;

/// What the middle tier's handler saw.
#[derive(Debug, Clone)]
struct Seen {
    headers: HeaderMap,
    caller_is_retry_point: bool,
    deadline_ms: Option<u128>,
    /// Calls the downstream got for this request.
    downstream_calls: usize,
}

#[derive(Clone)]
struct Tier {
    client: Outbound,
    downstream: String,
    downstream_calls: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

async fn middle(State(tier): State<Tier>, headers: HeaderMap) -> AxumResponse {
    let ctx = CallContext::current().unwrap_or_default();
    let before = tier.downstream_calls.load(Ordering::SeqCst);
    let req = http::Request::get(&tier.downstream)
        .body(Full::default())
        .unwrap();
    let status = match tier.client.clone().oneshot(req).await {
        Ok(res) => res.status().as_u16(),
        Err(_) => 0,
    };
    tier.seen.lock().unwrap().push(Seen {
        headers,
        caller_is_retry_point: ctx.caller_is_retry_point(),
        deadline_ms: ctx.deadline().map(|d| d.remaining().as_millis()),
        downstream_calls: tier.downstream_calls.load(Ordering::SeqCst) - before,
    });
    (StatusCode::OK, format!("downstream {status}")).into_response()
}

/// A budget that affords no retry at all: any request charged as a retry is refused.
fn empty_budget() -> RetryBudget {
    let mut config = RatioConfig::default();
    config = config.with_min_per_sec(0);
    config = config.with_retry_ratio(0.0);
    RetryBudget::ratio_with(config)
}

fn withdrawals(budget: &RetryBudget) -> u64 {
    match budget.snapshot() {
        BudgetSnapshot::Ratio { withdrawals, .. } => withdrawals,
        other => panic!("not a ratio budget: {other:?}"),
    }
}

/// A middle tier (optionally behind `edge`) whose handler calls a downstream that
/// always answers 503, through a `RetryLayer` (3 attempts); its inbound path has a
/// server `RetryBudgetLayer` over `budget` and a `PropagateLayer`.
async fn tier(edge: Option<EdgeLayer>, budget: &RetryBudget) -> (SocketAddr, Tier) {
    let downstream_calls = Arc::new(AtomicUsize::new(0));
    let calls = Arc::clone(&downstream_calls);
    let downstream = serve(Router::new().route(
        "/",
        get(move || {
            calls.fetch_add(1, Ordering::SeqCst);
            async { StatusCode::SERVICE_UNAVAILABLE }
        }),
    ))
    .await;
    let backoff = Backoff::new(
        Duration::from_millis(1),
        Duration::from_millis(5),
        Jitter::Full,
    );
    let retry = RetryLayer::new().strategy(StandardRetryStrategy::new().backoff(backoff));
    let state = Tier {
        client: retry.layer(Client::builder(TokioExecutor::new()).build_http()),
        downstream: format!("http://{downstream}/"),
        downstream_calls,
        seen: Arc::new(Mutex::new(Vec::new())),
    };
    // `Router::layer` wraps what is there: the edge outermost, then the budget, then
    // the propagation of the (remaining) convention headers.
    let router = Router::new()
        .route("/", get(middle))
        .with_state(state.clone())
        .layer(PropagateLayer::new())
        .layer(RetryBudgetLayer::new(budget.clone()).server());
    let router = match edge {
        Some(edge) => router.layer(edge),
        None => router,
    };
    (serve(router).await, state)
}

async fn forged_get(
    client: &reqwest::Client,
    addr: SocketAddr,
    headers: &[(&str, &str)],
) -> Answer {
    let mut req = client.get(format!("http://{addr}/"));
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    answer(req.send().await.unwrap()).await
}

const CONVENTION: [&str; 5] = [
    "retry-attempt",
    "retry-point",
    "request-timeout-ms",
    "grpc-timeout",
    "grpc-previous-rpc-attempts",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_neutralises_forged_convention_headers() {
    let client = reqwest::Client::new();
    let forged: [[(&str, &str); 5]; 2] = [
        [
            ("retry-attempt", "2"),
            ("retry-point", "caller"),
            ("request-timeout-ms", "1"),
            ("grpc-timeout", "1n"),
            ("grpc-previous-rpc-attempts", "1"),
        ],
        [
            ("retry-attempt", "99999999999999999999"),
            ("retry-point", "caller"),
            ("request-timeout-ms", "99999999999999"),
            ("grpc-timeout", "99999999H"),
            ("grpc-previous-rpc-attempts", "4"),
        ],
    ];

    // Behind the edge (strip): nothing of it reaches the handler or its client.
    let budget = empty_budget();
    let (addr, state) = tier(Some(EdgeLayer::new()), &budget).await;
    for headers in &forged {
        let a = forged_get(&client, addr, headers).await;
        assert_eq!(a.status, 200, "charged as a retry: {}", a.text());
    }
    assert_eq!(
        withdrawals(&budget),
        0,
        "the inbound budget paid for no retry"
    );
    for seen in state.seen.lock().unwrap().iter() {
        for name in CONVENTION {
            assert!(
                seen.headers.get(name).is_none(),
                "{name} reached the handler"
            );
        }
        assert!(
            !seen.caller_is_retry_point,
            "retry-point reached the context"
        );
        assert_eq!(
            seen.deadline_ms, None,
            "a forged deadline reached the context"
        );
        assert_eq!(seen.downstream_calls, 3, "outbound calls still retry");
    }

    // Behind the edge (clamp to 2 s): deadlines kept, at most 2 s; the rest stripped.
    let budget = empty_budget();
    let edge = EdgeLayer::new().clamp_deadlines(Duration::from_secs(2));
    let (addr, state) = tier(Some(edge), &budget).await;
    let a = forged_get(&client, addr, &forged[1]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let malformed = [
        ("request-timeout-ms", "-5"),
        ("grpc-timeout", "1x"),
        ("retry-attempt", "2"),
    ];
    let b = forged_get(&client, addr, &malformed).await;
    assert_eq!(b.status, 200, "{}", b.text());
    assert_eq!(withdrawals(&budget), 0);
    {
        let seen = state.seen.lock().unwrap();
        let huge = &seen[0];
        let ms = parse_request_timeout_ms(huge.headers["request-timeout-ms"].as_bytes()).unwrap();
        let grpc = parse_grpc_timeout(huge.headers["grpc-timeout"].as_bytes()).unwrap();
        assert!(ms <= Duration::from_secs(2), "{ms:?}");
        assert!(grpc <= Duration::from_secs(2), "{grpc:?}");
        let left = huge.deadline_ms.expect("a clamped deadline is honoured");
        assert!(left <= 2000, "deadline {left} ms");
        for name in ["retry-attempt", "retry-point", "grpc-previous-rpc-attempts"] {
            assert!(
                huge.headers.get(name).is_none(),
                "{name} reached the handler"
            );
        }
        assert!(!huge.caller_is_retry_point);
        assert_eq!(huge.downstream_calls, 3);
        // A malformed deadline is removed, not passed on.
        let bad = &seen[1];
        for name in CONVENTION {
            assert!(
                bad.headers.get(name).is_none(),
                "{name} reached the handler"
            );
        }
        assert_eq!(bad.deadline_ms, None);
    }

    // Without the edge (a trusted peer) the same headers are honoured.
    let budget = empty_budget();
    let (addr, state) = tier(None, &budget).await;
    let a = forged_get(&client, addr, &forged[0]).await;
    a.assert_problem_status_503_do_not_retry();
    assert!(
        state.seen.lock().unwrap().is_empty(),
        "a refused retry reached the handler"
    );
    let trusted = [("retry-point", "caller"), ("request-timeout-ms", "5000")];
    let b = forged_get(&client, addr, &trusted).await;
    assert_eq!(b.status, 200, "{}", b.text());
    let seen = state.seen.lock().unwrap();
    assert!(seen[0].caller_is_retry_point);
    assert_eq!(seen[0].downstream_calls, 1, "the caller is the retry point");
    let left = seen[0].deadline_ms.expect("the deadline is honoured");
    assert!(left > 0 && left <= 5000, "deadline {left} ms");
}

impl Answer {
    /// The server budget's refusal: 503 with `do-not-retry: 1`.
    fn assert_problem_status_503_do_not_retry(&self) {
        assert_eq!(self.status, 503, "{}", self.text());
        assert_eq!(self.headers["do-not-retry"], "1");
    }
}

// ---------------------------------------------------------------------------------
// A flood of disconnecting clients
// ---------------------------------------------------------------------------------

/// How a flood client goes away.
#[derive(Clone, Copy, Debug)]
enum Hangup {
    /// HTTP/1.1 over a raw `TcpStream`: the connection is closed.
    CloseConnection,
    /// HTTP/2 over hyper, all streams on one connection: the response future is
    /// dropped, which resets the stream (`RST_STREAM`, the "rapid reset" pattern).
    ResetStream,
}

/// A client that is about to go away.
enum Leaving {
    Conn(TcpStream),
    Stream(tokio::task::JoinHandle<()>),
}

type H2 = Client<HttpConnector, Full<Bytes>>;

/// Sends a guarded POST with `key` whose handler parks, keeping it open until the
/// returned value is dropped (or aborted).
async fn park(addr: SocketAddr, key: &str, how: Hangup, h2: &H2) -> Leaving {
    match how {
        Hangup::CloseConnection => {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let line = format!("idempotency-key: {key}\r\nx-hold: 1");
            s.write_all(&raw_post("mallory", line.as_bytes(), b"pay 1"))
                .await
                .unwrap();
            Leaving::Conn(s)
        }
        Hangup::ResetStream => {
            let req = http::Request::post(format!("http://{addr}/pay"))
                .header("authorization", "Bearer mallory")
                .header("content-type", "text/plain")
                .header("idempotency-key", key)
                .header("x-hold", "1")
                .body(Full::new(Bytes::from_static(b"pay 1")))
                .unwrap();
            let h2 = h2.clone();
            Leaving::Stream(tokio::spawn(async move {
                let _ = h2.request(req).await;
            }))
        }
    }
}

fn leave(clients: Vec<Leaving>) {
    for c in clients {
        match c {
            Leaving::Conn(s) => drop(s),
            Leaving::Stream(task) => task.abort(),
        }
    }
}

/// Waves of clients send a guarded POST whose handler parks, then go away. The
/// detached work stays within `max_in_flight`, the excess gets 503, every detached
/// handler completes and stores its response, and the tracker drains.
async fn disconnect_flood(how: Hangup) {
    const MAX: usize = 4;
    const WAVE: usize = 40;
    let store = MemoryStore::new();
    // One scope (mallory) fills the whole bound: its fair share is the bound.
    let layer = IdempotencyLayer::new(store.clone())
        .max_in_flight(MAX)
        .max_in_flight_per_scope(MAX)
        .build()
        .unwrap();
    let shutdown = layer.shutdown_handle();
    let fx = Effects::new();
    let addr = serve(app(layer, true, &fx)).await;
    let client = reqwest::Client::new();
    let h2: H2 = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let bearer = [("authorization", "Bearer mallory")];
    let mut all_keys = Vec::new();
    let mut detached = 0;

    for wave in 0..3 {
        fx.gate.close();
        let started_before = fx.started.load(Ordering::SeqCst);
        let cancelled_before = fx.cancelled.load(Ordering::SeqCst);
        let refused_before = fx.answered_503.load(Ordering::SeqCst);
        let keys: Vec<String> = (0..WAVE).map(|i| format!("gone-{wave}-{i}")).collect();
        let mut clients = Vec::new();
        for key in &keys {
            clients.push(park(addr, key, how, &h2).await);
        }
        // The first MAX park; the rest are refused at once (503 overloaded).
        eventually("the bound's worth of handlers parked", || {
            fx.holding() == MAX
        })
        .await;
        eventually("the excess refused", || {
            fx.answered_503.load(Ordering::SeqCst) - refused_before == WAVE - MAX
        })
        .await;
        leave(clients);
        // The clients of the parked handlers are gone: hyper dropped their response
        // futures, and the guarded work went on detached.
        eventually("the abandoned requests seen by the server", || {
            fx.cancelled.load(Ordering::SeqCst) - cancelled_before == MAX
        })
        .await;
        assert_eq!(fx.started.load(Ordering::SeqCst) - started_before, MAX);
        assert_eq!(shutdown.in_flight(), MAX, "the detached tasks are tracked");
        // While they run, the bound holds for everyone else: 503 with retry-after.
        for i in 0..10 {
            let a = pay(
                &client,
                addr,
                Some(&format!("late-{wave}-{i}")),
                "pay 1",
                &bearer,
            )
            .await;
            a.assert_problem(ProblemKind::Overloaded);
            assert!(a.headers.contains_key("retry-after"));
        }
        assert_eq!(fx.holding(), MAX);
        // Release them: every detached handler completes and stores its response.
        fx.gate.open();
        tokio::time::timeout(Duration::from_secs(30), shutdown.clone().drain())
            .await
            .expect("the tracker drains");
        assert_eq!(shutdown.in_flight(), 0);
        assert_eq!(store.in_flight_len(), 0);
        detached += MAX;
        all_keys.extend(keys);
    }
    assert_eq!(
        fx.high_water.load(Ordering::SeqCst),
        MAX,
        "at most max_in_flight handlers at once"
    );
    assert_eq!(
        fx.started.load(Ordering::SeqCst),
        fx.finished.load(Ordering::SeqCst)
    );

    // A later retry of each key: the detached ones replay, the refused ones run now.
    let ran = fx.started_keys();
    let mut replays = 0;
    for key in &all_keys {
        let a = pay(&client, addr, Some(key), "pay 1", &bearer).await;
        assert_eq!(a.status, 201, "{key}: {}", a.text());
        if ran.contains(key) {
            assert!(a.replayed(), "{key} ran detached but did not replay");
            assert!(a.text().contains(key.as_str()));
            replays += 1;
        } else {
            assert!(!a.replayed());
        }
    }
    assert_eq!(replays, detached);
    assert_eq!(fx.runs(), all_keys.len(), "each key ran exactly once");
    eprintln!(
        "disconnect flood ({how:?}): {} clients gone, {detached} detached handlers (bound {MAX}), \
         high water {}",
        all_keys.len(),
        fx.high_water.load(Ordering::SeqCst)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detached_work_is_bounded_under_a_disconnect_flood() {
    disconnect_flood(Hangup::CloseConnection).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detached_work_is_bounded_under_an_h2_stream_reset_flood() {
    disconnect_flood(Hangup::ResetStream).await;
}

// ---------------------------------------------------------------------------------
// Oversize bodies and headers
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_bodies_are_refused_before_any_claim() {
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store.clone())
        .max_request_body(1024)
        .build()
        .unwrap();
    let fx = Effects::new();
    let addr = serve(app(layer, true, &fx)).await;
    let client = reqwest::Client::new();
    let bearer = [("authorization", "Bearer mallory")];
    let no_record = |store: &MemoryStore| (store.in_flight_len(), store.cached_len()) == (0, 0);

    // Declared length over the limit.
    pay(&client, addr, Some("big"), vec![b'x'; 4096], &bearer)
        .await
        .assert_problem(ProblemKind::BodyTooLarge);
    // Chunked, without a content-length.
    let mut chunked = b"POST /pay HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer mallory\r\n\
        idempotency-key: big\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        .to_vec();
    for _ in 0..8 {
        chunked.extend_from_slice(b"200\r\n");
        chunked.extend_from_slice(&[b'y'; 0x200]);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let r = raw(addr, &chunked).await;
    assert!(r.is_problem(ProblemKind::BodyTooLarge), "{}", r.text);
    // A huge declared length whose body never comes: answered after the bounded drain.
    let mut stalled = raw_post("mallory", b"idempotency-key: big", b"");
    let at = stalled
        .windows(17)
        .position(|w| w == b"content-length: 0")
        .unwrap();
    stalled.splice(at..at + 17, b"content-length: 1073741824".iter().copied());
    stalled.extend_from_slice(&[b'z'; 64 * 1024]);
    let r = raw(addr, &stalled).await;
    assert!(r.is_problem(ProblemKind::BodyTooLarge), "{}", r.text);
    assert_eq!(
        fx.started.load(Ordering::SeqCst),
        0,
        "the handler never ran"
    );
    assert!(no_record(&store));

    // The same key with a body within the limit is a new request.
    let ok = pay(&client, addr, Some("big"), vec![b'x'; 1024], &bearer).await;
    assert_eq!(ok.status, 201, "{}", ok.text());
    assert!(!ok.replayed());
    assert_eq!(fx.runs(), 1);
    healthy(&client, addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_headers_are_refused_and_the_server_keeps_serving() {
    let fx = Effects::new();
    let addr = serve(app(IdempotencyLayer::in_memory(), true, &fx)).await;
    let client = reqwest::Client::new();

    // Over hyper's HTTP/1 head limit (about 400 KiB) or its 100 headers: 431, or a
    // close; never the layer, never the handler.
    let huge = format!("x-junk: {}", "a".repeat(1 << 20));
    let huge_key = format!("idempotency-key: {}", "k".repeat(1 << 20));
    let many: Vec<String> = (0..500).map(|i| format!("x-h{i}: v")).collect();
    let many = format!("idempotency-key: many\r\n{}", many.join("\r\n"));
    for (what, line) in [
        ("a 1 MiB header", huge.as_bytes()),
        ("a 1 MiB key", huge_key.as_bytes()),
        ("500 headers", many.as_bytes()),
    ] {
        let r = raw(addr, &raw_post("mallory", line, b"x")).await;
        assert!(
            matches!(r.status, None | Some(431)),
            "{what}: {:?}",
            r.status
        );
        eprintln!("HTTP/1.1 with {what}: {:?}", r.status);
        healthy(&client, addr).await;
    }
    // The same over HTTP/2 (hyper's client, prior knowledge): refused by one side or
    // the other (hyper's server advertises a 16 KiB header list), never the handler.
    for (what, name, value) in [
        ("a 1 MiB header", "x-junk", "a".repeat(1 << 20)),
        ("a 1 MiB key", "idempotency-key", "k".repeat(1 << 20)),
        ("a 64 KiB key", "idempotency-key", "k".repeat(64 << 10)),
    ] {
        let h2: H2 = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http();
        let req = http::Request::post(format!("http://{addr}/pay"))
            .header("authorization", "Bearer mallory")
            .header(name, value)
            .body(Full::new(Bytes::from_static(b"x")))
            .unwrap();
        let outcome = match h2.request(req).await {
            Ok(res) => {
                assert!(
                    matches!(res.status().as_u16(), 400 | 431),
                    "{what}: {}",
                    res.status()
                );
                format!("{}", res.status())
            }
            Err(e) => {
                let mut chain = e.to_string();
                let mut source = std::error::Error::source(&e);
                while let Some(inner) = source {
                    chain = format!("{chain}: {inner}");
                    source = inner.source();
                }
                format!("error: {chain}")
            }
        };
        eprintln!("HTTP/2 with {what}: {outcome}");
        healthy(&client, addr).await;
    }
    // A key of 8 KiB, within hyper's limits: the layer's 400.
    let long_key = format!("idempotency-key: {}", "k".repeat(8192));
    let r = raw(addr, &raw_post("mallory", long_key.as_bytes(), b"x")).await;
    assert!(r.is_problem(ProblemKind::KeyInvalid), "{}", r.text);
    // The key twice.
    let r = raw(
        addr,
        &raw_post("mallory", b"idempotency-key: a\r\nidempotency-key: b", b"x"),
    )
    .await;
    assert!(r.is_problem(ProblemKind::KeyInvalid), "{}", r.text);

    assert_eq!(fx.started.load(Ordering::SeqCst), 0);
    healthy(&client, addr).await;
    let ok = pay(
        &client,
        addr,
        Some("after"),
        "x",
        &[("authorization", "Bearer mallory")],
    )
    .await;
    assert_eq!(ok.status, 201);
}

/// Opens `n` connections as `who` that send their head and one byte of a 100-byte
/// body, then hold it open.
async fn trickle(addr: SocketAddr, who: &str, n: usize) -> Vec<TcpStream> {
    let mut conns = Vec::new();
    for i in 0..n {
        let mut req = raw_post(who, format!("idempotency-key: slow-{i}").as_bytes(), b"");
        let at = req
            .windows(17)
            .position(|w| w == b"content-length: 0")
            .unwrap();
        req.splice(at..at + 17, b"content-length: 100".iter().copied());
        req.push(b'{');
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&req).await.unwrap();
        conns.push(s);
    }
    conns
}

/// `router` with a count of the trickled requests (keys `slow-…`) whose body the
/// server has begun to read. The layer reads a body only once it holds the request's
/// slot, so the count says how many trickled requests hold one: waiting for it before
/// probing keeps a probe from taking a slot a trickled request would have got (which
/// would answer that request 503 and leave a slot free for every later probe).
fn count_trickled_reads(router: Router) -> (Router, Arc<AtomicUsize>) {
    let reads = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&reads);
    let router = router.layer(axum::middleware::from_fn(
        move |req: AxumRequest, next: Next| {
            let trickled = req
                .headers()
                .get("idempotency-key")
                .is_some_and(|k| k.as_bytes().starts_with(b"slow-"));
            let req = if trickled {
                let count = Arc::clone(&count);
                let mut first = true;
                req.map(|body| {
                    axum::body::Body::new(http_body_util::BodyExt::map_frame(body, move |f| {
                        if std::mem::take(&mut first) {
                            count.fetch_add(1, Ordering::SeqCst);
                        }
                        f
                    }))
                })
            } else {
                req
            };
            next.run(req)
        },
    ));
    (router, reads)
}

/// Waits until `n` trickled requests hold their slots (see [`count_trickled_reads`]).
async fn trickled_hold(reads: &AtomicUsize, n: usize) {
    eventually("the trickled requests hold their slots", || {
        reads.load(Ordering::SeqCst) == n
    })
    .await;
}

/// Sends fresh keys as `who` until one gets `status` (the server frees the slots of
/// closed trickling connections concurrently with these).
async fn until_status(
    client: &reqwest::Client,
    addr: SocketAddr,
    who: &str,
    status: u16,
    tag: &str,
) -> usize {
    let bearer = format!("Bearer {who}");
    let auth = [("authorization", bearer.as_str())];
    for i in 0..2000 {
        let a = pay(client, addr, Some(&format!("{tag}-{i}")), "x", &auth).await;
        if a.status == status {
            return i;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("never got {status}");
}

/// Clients that declare a body and trickle it hold an in-flight slot while it is
/// read (the slot is taken before the body is buffered, to bound the memory of
/// buffered bodies): with `max_in_flight` of them, every other guarded request gets
/// 503 until they go away. An outer timeout (here a plain `tokio::time::timeout`
/// middleware; tower-http's `TimeoutLayer` or `RequestBodyTimeoutLayer` do the same)
/// drops them and frees the slots. No handler runs for a body that never arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_bodies_hold_in_flight_slots_until_an_outer_timeout() {
    const MAX: usize = 4;
    let client = reqwest::Client::new();
    let bearer = [("authorization", "Bearer mallory")];

    // No timeout: the slots are held for as long as the clients keep the connections.
    // One scope (mallory) fills the whole bound: its fair share is the bound (see
    // `a_trickling_scope_keeps_to_its_share` for the default share).
    let fx = Effects::new();
    let layer = IdempotencyLayer::in_memory()
        .max_in_flight(MAX)
        .max_in_flight_per_scope(MAX);
    let (router, reads) = count_trickled_reads(app(layer, true, &fx));
    let addr = serve(router).await;
    let conns = trickle(addr, "mallory", MAX).await;
    // Every slot is held: the next guarded request is refused.
    trickled_hold(&reads, MAX).await;
    let blocked = pay(&client, addr, Some("legit"), "x", &bearer).await;
    blocked.assert_problem(ProblemKind::Overloaded);
    drop(conns);
    until_status(&client, addr, "mallory", 201, "after").await;
    let legit = pay(&client, addr, Some("legit"), "x", &bearer).await;
    assert_eq!(legit.status, 201);

    // With an outer timeout the trickling requests are dropped and their slots freed.
    let fx = Effects::new();
    let layer = IdempotencyLayer::in_memory()
        .max_in_flight(MAX)
        .max_in_flight_per_scope(MAX);
    let timed_out = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&timed_out);
    let router = app(layer, true, &fx).layer(axum::middleware::from_fn(
        move |req: AxumRequest, next: Next| {
            let count = Arc::clone(&count);
            async move {
                match tokio::time::timeout(Duration::from_millis(300), next.run(req)).await {
                    Ok(res) => res,
                    Err(_) => {
                        count.fetch_add(1, Ordering::SeqCst);
                        StatusCode::REQUEST_TIMEOUT.into_response()
                    }
                }
            }
        },
    ));
    let addr = serve(router).await;
    let conns = trickle(addr, "mallory", MAX).await;
    eventually("the trickling requests timed out", || {
        timed_out.load(Ordering::SeqCst) == MAX
    })
    .await;
    let legit = pay(&client, addr, Some("legit"), "x", &bearer).await;
    assert_eq!(legit.status, 201, "{}", legit.text());
    drop(conns);
    let slow_ran = fx
        .started_keys()
        .iter()
        .filter(|k| k.starts_with("slow-"))
        .count();
    assert_eq!(slow_ran, 0, "no handler ran for a body that never arrived");
}

/// The bound is shared fairly between scopes: a scope that trickles its bodies holds
/// at most its share of the slots (3 of 4 by default), and gets 503 `overloaded` past
/// it, while other scopes are still served. Over real TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_scope_keeps_to_its_share() {
    const MAX: usize = 4;
    let fx = Effects::new();
    let layer = IdempotencyLayer::in_memory()
        .max_in_flight(MAX)
        .build()
        .unwrap();
    let (router, reads) = count_trickled_reads(app(layer, true, &fx));
    let addr = serve(router).await;
    let client = reqwest::Client::new();
    let mallory = [("authorization", "Bearer mallory")];
    let alice = [("authorization", "Bearer alice")];

    // Mallory trickles as many bodies as the bound has slots: she gets her share.
    let conns = trickle(addr, "mallory", MAX).await;
    // She holds her share: her next guarded request is refused.
    trickled_hold(&reads, MAX - 1).await;
    let blocked = pay(&client, addr, Some("m-legit"), "x", &mallory).await;
    blocked.assert_problem(ProblemKind::Overloaded);
    assert!(blocked.headers.contains_key("retry-after"));
    // The slot she cannot take serves everyone else, again and again.
    for i in 0..3 {
        let a = pay(&client, addr, Some(&format!("a-{i}")), "x", &alice).await;
        assert_eq!(a.status, 201, "{}", a.text());
    }
    drop(conns);
    until_status(&client, addr, "mallory", 201, "after").await;
    let legit = pay(&client, addr, Some("m-legit"), "x", &mallory).await;
    assert_eq!(legit.status, 201, "{}", legit.text());
    let slow_ran = fx
        .started_keys()
        .iter()
        .filter(|k| k.starts_with("slow-"))
        .count();
    assert_eq!(slow_ran, 0, "no handler ran for a body that never arrived");
}

/// The fix for trickled bodies: `request_body_timeout` answers 408 `body-timeout`
/// before any claim and frees the slot; nothing runs; the same key with a whole body is
/// new. Over real TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_bodies_time_out_and_free_their_slots() {
    const MAX: usize = 4;
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store.clone())
        .max_in_flight(MAX)
        .max_in_flight_per_scope(MAX)
        .request_body_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let fx = Effects::new();
    let addr = serve(app(layer, true, &fx)).await;
    let client = reqwest::Client::new();
    let bearer = [("authorization", "Bearer mallory")];
    let mut trickling = Vec::new();
    for i in 0..MAX {
        let mut req = raw_post(
            "mallory",
            format!("idempotency-key: slow-{i}").as_bytes(),
            b"",
        );
        let at = req
            .windows(17)
            .position(|w| w == b"content-length: 0")
            .unwrap();
        req.splice(at..at + 17, b"content-length: 100".iter().copied());
        req.push(b'{');
        trickling.push(tokio::spawn(async move { raw(addr, &req).await }));
    }
    for t in trickling {
        let r = t.await.unwrap();
        assert!(r.is_problem(ProblemKind::BodyTimeout), "{}", r.text);
        assert!(
            !r.text.contains("do-not-retry"),
            "a retry is safe: {}",
            r.text
        );
    }
    assert_eq!(
        (store.in_flight_len(), store.cached_len()),
        (0, 0),
        "no record"
    );
    // Every slot is free again.
    for i in 0..MAX + 1 {
        let a = pay(&client, addr, Some(&format!("legit-{i}")), "x", &bearer).await;
        assert_eq!(a.status, 201, "{}", a.text());
    }
    // The same key with its whole body is a new request.
    let a = pay(&client, addr, Some("slow-0"), "{}", &bearer).await;
    assert_eq!(a.status, 201, "{}", a.text());
    assert!(!a.replayed());
    assert_eq!(fx.runs(), MAX + 2);
}

/// The same on tokio's paused clock, exactly: a body that never ends gets the 408 at
/// the configured time (or the request's sooner deadline), and the slot is free.
#[tokio::test(start_paused = true)]
async fn a_body_that_never_arrives_times_out_on_the_paused_clock() {
    use axum::body::Body;
    let fx = Effects::new();
    let layer = IdempotencyLayer::in_memory()
        .max_in_flight(1)
        .request_body_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let router = app(layer, true, &fx);
    let never =
        || Body::from_stream(futures_util::stream::pending::<Result<Bytes, std::io::Error>>());
    let req = |key: &str, body: Body| {
        axum::http::Request::post("/pay")
            .header("authorization", "Bearer mallory")
            .header("idempotency-key", key)
            .body(body)
            .unwrap()
    };
    let start = tokio::time::Instant::now();
    let res = router.clone().oneshot(req("k", never())).await.unwrap();
    assert_eq!(res.status(), StatusCode::REQUEST_TIMEOUT);
    assert_eq!(start.elapsed(), Duration::from_secs(5));
    // The request's deadline, when sooner, bounds it instead.
    let mut early = req("k2", never());
    early
        .extensions_mut()
        .insert(retrysafe_core::Deadline::after(Duration::from_millis(700)));
    let start = tokio::time::Instant::now();
    let res = router.clone().oneshot(early).await.unwrap();
    assert_eq!(res.status(), StatusCode::REQUEST_TIMEOUT);
    assert_eq!(start.elapsed(), Duration::from_millis(700));
    // The single slot is free: a whole body runs.
    let res = router
        .clone()
        .oneshot(req("k", Body::from("x")))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(fx.runs(), 1);
    assert!(
        IdempotencyLayer::in_memory()
            .request_body_timeout(Duration::ZERO)
            .build()
            .is_err()
    );
}

// ---------------------------------------------------------------------------------
// Malformed keys
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_keys_are_refused_over_the_wire() {
    let fx = Effects::new();
    let addr = serve(app(IdempotencyLayer::in_memory(), true, &fx)).await;
    let client = reqwest::Client::new();

    // The http crate refuses to build these at all.
    for bad in [&b"a\r\nb"[..], b"a\rb", b"a\nb", b"a\0b"] {
        assert!(http::HeaderValue::from_bytes(bad).is_err());
    }
    // On the wire, hyper refuses what is not a header value (400, or a close); the
    // layer refuses what is one but not a key (400 key-invalid). Either way, nothing runs.
    let cases: [(&str, &[u8], bool); 10] = [
        ("CR", b"idempotency-key: ab\rcd", false),
        ("LF", b"idempotency-key: ab\ncd", false),
        (
            "CRLF then a continuation (obs-fold)",
            b"idempotency-key: ab\r\n cd",
            false,
        ),
        ("NUL", b"idempotency-key: ab\0cd", false),
        ("DEL", b"idempotency-key: ab\x7fcd", false),
        ("UTF-8", "idempotency-key: clé-1".as_bytes(), true),
        ("Latin-1", b"idempotency-key: cl\xe9", true),
        ("invalid UTF-8", b"idempotency-key: \xff\xfe", true),
        ("empty sf-string", b"idempotency-key: \"\"", true),
        (
            "256 characters",
            format!("idempotency-key: {}", "k".repeat(256))
                .leak()
                .as_bytes(),
            true,
        ),
    ];
    for (what, line, ours) in cases {
        let r = raw(addr, &raw_post("mallory", line, b"x")).await;
        if ours {
            assert!(r.is_problem(ProblemKind::KeyInvalid), "{what}: {}", r.text);
        } else {
            assert!(
                matches!(r.status, None | Some(400)),
                "{what}: {:?} {}",
                r.status,
                r.text
            );
        }
        eprintln!(
            "key with {what}: {}",
            match r.status {
                None => "connection closed".to_owned(),
                Some(s) if r.is_problem(ProblemKind::KeyInvalid) => format!("{s} key-invalid"),
                Some(s) => format!("{s} from hyper"),
            }
        );
    }
    assert_eq!(fx.started.load(Ordering::SeqCst), 0, "no malformed key ran");
    healthy(&client, addr).await;

    // A key of exactly 255 characters is accepted and replayed.
    let max = "k".repeat(255);
    let line = format!("idempotency-key: {max}");
    let first = raw(addr, &raw_post("mallory", line.as_bytes(), b"x")).await;
    assert_eq!(first.status, Some(201), "{}", first.text);
    let again = raw(addr, &raw_post("mallory", line.as_bytes(), b"x")).await;
    assert_eq!(again.status, Some(201));
    assert!(
        again.text.contains("idempotent-replayed: true"),
        "{}",
        again.text
    );
    // The sf-string and the bare form are one key; so is the bare form with spaces.
    let bearer = [("authorization", "Bearer mallory")];
    let a = pay(&client, addr, Some("abc"), "x", &bearer).await;
    assert!(!a.replayed());
    for form in [
        &b"idempotency-key: \"abc\""[..],
        b"idempotency-key:    abc   ",
    ] {
        let r = raw(addr, &raw_post("mallory", form, b"x")).await;
        assert_eq!(r.status, Some(201));
        assert!(r.text.contains("idempotent-replayed: true"), "{}", r.text);
    }
    assert_eq!(fx.runs(), 2);
}

/// An HPACK integer with a 7-bit prefix and the Huffman bit clear (RFC 7541 §5.1).
fn hpack_len(out: &mut Vec<u8>, n: usize) {
    if n < 127 {
        out.push(n as u8);
        return;
    }
    out.push(127);
    let mut n = n - 127;
    while n >= 128 {
        out.push((n % 128 + 128) as u8);
        n /= 128;
    }
    out.push(n as u8);
}

/// An HPACK literal header field without indexing, with a new name, raw bytes as they
/// are (RFC 7541 §6.2.2): what a hostile client can put on the wire.
fn hpack_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    hpack_len(out, name.len());
    out.extend_from_slice(name);
    hpack_len(out, value.len());
    out.extend_from_slice(value);
}

fn h2_frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = payload.len();
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// What the server did with one raw HTTP/2 request.
#[derive(Debug, PartialEq)]
enum H2Outcome {
    /// Response headers whose first field is an indexed `:status` (RFC 7541
    /// appendix A: 0x88 = 200 … 0x8e = 500), or `None` for another encoding (201).
    Headers(Option<u16>),
    /// `RST_STREAM` with this error code (1 = PROTOCOL_ERROR).
    Reset(u32),
    /// `GOAWAY` with this error code.
    GoAway(u32),
    /// Closed with neither.
    Closed,
}

/// Sends one POST on a new HTTP/2 connection (prior knowledge) with `key` as raw bytes
/// in the `idempotency-key` field, and reads frames until the server answers stream 1.
async fn h2_raw_post(addr: SocketAddr, key: &[u8]) -> H2Outcome {
    let mut block = Vec::new();
    for (name, value) in [
        (&b":method"[..], &b"POST"[..]),
        (b":scheme", b"http"),
        (b":path", b"/pay"),
        (b":authority", b"localhost"),
        (b"authorization", b"Bearer mallory"),
        (b"idempotency-key", key),
    ] {
        hpack_literal(&mut block, name, value);
    }
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    h2_frame(&mut out, 0x4, 0, 0, &[]); // SETTINGS
    h2_frame(&mut out, 0x1, 0x4 | 0x1, 1, &block); // HEADERS, END_HEADERS | END_STREAM
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&out).await.unwrap();
    let read = async {
        loop {
            let mut head = [0u8; 9];
            if s.read_exact(&mut head).await.is_err() {
                return H2Outcome::Closed;
            }
            let len =
                (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
            let (kind, flags) = (head[3], head[4]);
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            let mut payload = vec![0u8; len];
            if s.read_exact(&mut payload).await.is_err() {
                return H2Outcome::Closed;
            }
            let code = |at: usize| {
                u32::from_be_bytes([
                    payload[at],
                    payload[at + 1],
                    payload[at + 2],
                    payload[at + 3],
                ])
            };
            match (kind, stream) {
                (0x4, 0) if flags & 0x1 == 0 => {
                    // Acknowledge the server's SETTINGS.
                    let mut ack = Vec::new();
                    h2_frame(&mut ack, 0x4, 0x1, 0, &[]);
                    let _ = s.write_all(&ack).await;
                }
                (0x1, 1) => {
                    let status = match payload.first() {
                        Some(0x88) => Some(200),
                        Some(0x89) => Some(204),
                        Some(0x8a) => Some(206),
                        Some(0x8b) => Some(304),
                        Some(0x8c) => Some(400),
                        Some(0x8d) => Some(404),
                        Some(0x8e) => Some(500),
                        _ => None,
                    };
                    return H2Outcome::Headers(status);
                }
                (0x3, 1) => return H2Outcome::Reset(code(0)),
                (0x7, 0) => return H2Outcome::GoAway(code(4)),
                _ => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .expect("the server neither answered nor closed")
}

/// Over HTTP/2 a client is not bound by the `http` crate's builder: HPACK carries any
/// bytes. CR, LF, NUL and DEL in the key never reach the layer (h2 refuses the
/// field: the stream is reset, or the connection closed); non-ASCII reaches it and gets
/// its 400. Nothing runs, and the server keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_keys_over_h2_are_refused() {
    let fx = Effects::new();
    let addr = serve(app(IdempotencyLayer::in_memory(), true, &fx)).await;
    let client = reqwest::Client::new();
    // The harness works: a valid key runs once (201, not an indexed status).
    assert_eq!(h2_raw_post(addr, b"h2-ok").await, H2Outcome::Headers(None));
    assert_eq!(fx.runs(), 1);
    for (what, key, ours) in [
        ("CR LF", &b"ab\r\ncd"[..], false),
        ("CR LF and a header", b"ab\r\nx-injected: 1", false),
        ("LF", b"ab\ncd", false),
        ("NUL", b"ab\0cd", false),
        ("DEL", b"ab\x7fcd", false),
        ("UTF-8", "clé".as_bytes(), true),
        ("invalid UTF-8", b"\xff\xfe", true),
    ] {
        let outcome = h2_raw_post(addr, key).await;
        eprintln!("HTTP/2 key with {what}: {outcome:?}");
        if ours {
            assert_eq!(outcome, H2Outcome::Headers(Some(400)), "{what}");
        } else {
            assert!(
                matches!(
                    outcome,
                    H2Outcome::Reset(_)
                        | H2Outcome::GoAway(_)
                        | H2Outcome::Closed
                        | H2Outcome::Headers(Some(400))
                ),
                "{what}: {outcome:?}"
            );
        }
        healthy(&client, addr).await;
    }
    assert_eq!(fx.runs(), 1, "no malformed key ran");
}

// ---------------------------------------------------------------------------------
// A client that never reads its response
// ---------------------------------------------------------------------------------

/// Sends a guarded POST for a response of `size` bytes on a connection with a small
/// receive buffer, and never reads.
async fn never_reading(addr: SocketAddr, key: &str, size: usize) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(addr).await.unwrap();
    let line = format!("idempotency-key: {key}\r\nx-big: {size}");
    stream
        .write_all(&raw_post("mallory", line.as_bytes(), b"x"))
        .await
        .unwrap();
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_holds_no_slot() {
    // Bigger than the socket buffers on both sides (loopback autotuning tops out at a
    // few MiB), and storable.
    const SIZE: usize = 16 << 20;
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store.clone())
        .max_stored_response(32 << 20)
        .max_in_flight(1)
        .build()
        .unwrap();
    let shutdown = layer.shutdown_handle();
    let fx = Effects::new();
    let addr = serve(app(layer, true, &fx)).await;
    let client = reqwest::Client::new();
    let bearer = [("authorization", "Bearer mallory")];

    let mut stalled = never_reading(addr, "big-reply", SIZE).await;
    eventually("the handler ran and its record completed", || {
        fx.runs() == 1 && shutdown.in_flight() == 0 && store.in_flight_len() == 0
    })
    .await;
    assert_eq!(store.cached_len(), 1);
    // The slot (max_in_flight 1) is free although the response is still unread.
    let other = pay(&client, addr, Some("other"), "x", &bearer).await;
    assert_eq!(other.status, 201, "{}", other.text());
    // The same key from another client: the replay, whole.
    let again = pay(&client, addr, Some("big-reply"), "x", &bearer).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.body.len(), SIZE);
    assert_eq!(fx.runs(), 2);
    healthy(&client, addr).await;
    // The stalled connection still has its answer waiting: the first bytes are there.
    let mut head = [0u8; 12];
    stalled.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 201");
    drop(stalled);

    // A response over the storable limit (1 MiB by default): recorded as not stored
    // before it streams, so the slot is free as well, and the key never runs again.
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store.clone())
        .max_in_flight(1)
        .build()
        .unwrap();
    let shutdown = layer.shutdown_handle();
    let fx = Effects::new();
    let addr = serve(app(layer, true, &fx)).await;
    let stalled = never_reading(addr, "huge-reply", SIZE).await;
    eventually("the handler ran and its record completed", || {
        fx.runs() == 1 && shutdown.in_flight() == 0 && store.in_flight_len() == 0
    })
    .await;
    let again = pay(&client, addr, Some("huge-reply"), "x", &bearer).await;
    again.assert_problem(ProblemKind::ResponseNotStored);
    let other = pay(&client, addr, Some("other"), "x", &bearer).await;
    assert_eq!(other.status, 201);
    assert_eq!(fx.runs(), 2);
    drop(stalled);
}
