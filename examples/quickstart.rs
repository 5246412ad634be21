//! retrysafe in one command: `cargo run --example quickstart`.
//!
//! Starts the payments server of the `payments` example in process (in-memory store,
//! `127.0.0.1:0`), then sends it real HTTP requests the way retrying clients do:
//! duplicates one after another, many copies at once, a key reused for another
//! request, a transient failure and its retry, and a batch of logical requests each
//! sent one to three times, some failing transiently or losing their response on the
//! way back. Last, it drives a batch of POSTs *without* keys through the retrysafe
//! client stack — a `RetryLayer` that generates an idempotency key per logical request,
//! the same on every attempt — while the server fails some of them transiently (503
//! marked `NoEffect`) and loses the response of others after committing their effect
//! (the connection is closed without an answer). It then reads the ledger through
//! `GET /payments` and prints logical requests, attempts, effects and what happened; the
//! last line, `duplicates: N`, counts payments recorded more than once per logical
//! request (the program fails unless it is 0).
#![allow(clippy::print_stdout)]

#[path = "payments/app.rs"]
// `serve`: this demo serves through its chaos layer; `RedisConn`: for the payments binary.
#[allow(dead_code, unused_imports)]
mod app;

use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitCode;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use std::collections::HashSet;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::{TokioExecutor, TokioIo};
use retrysafe::{ReplayBody, RetryLayer, StandardRetryStrategy};
use serde::Deserialize;
use serde_json::json;
use tower::{ServiceBuilder, ServiceExt};

/// Logical requests in the batch.
const BATCH: u64 = 200;
/// Copies sent at once of one request in the concurrency demo.
const CONCURRENT_COPIES: usize = 25;
/// Accounts the batch spreads over.
const BATCH_ACCOUNTS: u64 = 8;
/// Logical requests sent through the client stack.
const STACK_BATCH: u64 = 200;
/// Accounts the client-stack batch spreads over.
const STACK_ACCOUNTS: u64 = 4;
/// The request header that asks the chaos layer for a failure: `fail-once` or
/// `lose-once` (per idempotency key).
const CHAOS: &str = "x-quickstart-chaos";

type Error = Box<dyn std::error::Error + Send + Sync>;

/// One answer, as a client sees it.
#[derive(Debug)]
struct Answer {
    status: u16,
    replayed: bool,
    body: bytes::Bytes,
}

#[derive(Debug, Deserialize)]
struct Created {
    id: String,
}

#[derive(Debug, Deserialize)]
struct Totals {
    count: u64,
    total_cents: i64,
}

/// A logical request: one key, one payment.
#[derive(Debug, Clone)]
struct Payment {
    key: String,
    account: String,
    amount_cents: i64,
}

/// What the client saw.
#[derive(Debug, Default)]
struct Tally {
    logical: AtomicU64,
    attempts: AtomicU64,
    replays: AtomicU64,
    conflicts: AtomicU64,
    mismatches: AtomicU64,
    simulated_failures: AtomicU64,
    lost_responses: AtomicU64,
    /// Key → (payment id, amount) of every key that got a 201.
    succeeded: Mutex<BTreeMap<String, (String, i64)>>,
}

struct Client {
    http: reqwest::Client,
    base: String,
    tally: Tally,
}

impl Client {
    /// Sends one copy of `payment` (one attempt).
    async fn send(&self, payment: &Payment, headers: &[(&str, &str)]) -> Result<Answer, Error> {
        self.attempt(payment, headers, None)
            .await?
            .ok_or_else(|| "the request timed out".into())
    }

    /// Sends one copy of `payment` whose response is lost: the client gives up after
    /// 50 ms while the server still works on it (200 ms), and drops the connection. The
    /// server finishes anyway: the payment is recorded and its answer stored.
    async fn send_and_lose(&self, payment: &Payment) -> Result<(), Error> {
        let headers = [("x-simulate-delay-ms", "200")];
        self.attempt(payment, &headers, Some(Duration::from_millis(50)))
            .await?;
        Ok(())
    }

    /// Sends `payment` until it is not in flight any more (409).
    async fn send_until_done(&self, payment: &Payment) -> Result<Answer, Error> {
        for _ in 0..100 {
            let answer = self.send(payment, &[]).await?;
            if answer.status != 409 {
                return Ok(answer);
            }
            // A real client waits the `retry-after` (1 s); this demo is in a hurry.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!("key {} stayed in flight", payment.key).into())
    }

    /// One attempt; `None` when it timed out.
    async fn attempt(
        &self,
        payment: &Payment,
        headers: &[(&str, &str)],
        timeout: Option<Duration>,
    ) -> Result<Option<Answer>, Error> {
        self.tally.attempts.fetch_add(1, Ordering::Relaxed);
        let mut req = self
            .http
            .post(format!("{}/payments", self.base))
            .header("idempotency-key", &payment.key)
            .json(&json!({ "account": payment.account, "amount_cents": payment.amount_cents }));
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        if let Some(timeout) = timeout {
            req = req.timeout(timeout);
        }
        let res = match req.send().await {
            Ok(res) => res,
            Err(e) if e.is_timeout() => {
                self.tally.lost_responses.fetch_add(1, Ordering::Relaxed);
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        };
        let status = res.status().as_u16();
        let replayed = res
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true");
        let body = res.bytes().await?;
        let answer = Answer {
            status,
            replayed,
            body,
        };
        self.count(payment, &answer)?;
        Ok(Some(answer))
    }

    fn count(&self, payment: &Payment, answer: &Answer) -> Result<(), Error> {
        let t = &self.tally;
        match answer.status {
            201 => {
                if answer.replayed {
                    t.replays.fetch_add(1, Ordering::Relaxed);
                }
                let created: Created = serde_json::from_slice(&answer.body)?;
                let mut succeeded = t.succeeded.lock().map_err(|_| "poisoned")?;
                let entry = succeeded
                    .entry(payment.key.clone())
                    .or_insert_with(|| (created.id.clone(), payment.amount_cents));
                if entry.0 != created.id {
                    return Err(format!(
                        "key {} answered payment {} and then payment {}",
                        payment.key, entry.0, created.id
                    )
                    .into());
                }
            }
            409 => {
                t.conflicts.fetch_add(1, Ordering::Relaxed);
            }
            422 => {
                t.mismatches.fetch_add(1, Ordering::Relaxed);
            }
            500 => {
                t.simulated_failures.fetch_add(1, Ordering::Relaxed);
            }
            other => {
                return Err(format!("unexpected status {other} for key {}", payment.key).into());
            }
        }
        Ok(())
    }

    async fn totals(&self, account: &str) -> Result<Totals, Error> {
        let res = self
            .http
            .get(format!("{}/payments", self.base))
            .query(&[("account", account)])
            .send()
            .await?
            .error_for_status()?;
        Ok(res.json().await?)
    }

    fn logical(&self, n: u64) {
        self.tally.logical.fetch_add(n, Ordering::Relaxed);
    }
}

fn expect(ok: bool, what: &str) -> Result<(), Error> {
    if ok { Ok(()) } else { Err(what.into()) }
}

/// The same request three times, one after another: one effect, two replays.
async fn sequential_duplicates(client: &Client) -> Result<(), Error> {
    client.logical(1);
    let p = Payment {
        key: "quickstart-sequential".to_owned(),
        account: "acct-sequential".to_owned(),
        amount_cents: 1250,
    };
    let first = client.send(&p, &[]).await?;
    expect(
        first.status == 201 && !first.replayed,
        "the first copy should run",
    )?;
    for _ in 0..2 {
        let again = client.send(&p, &[]).await?;
        expect(
            again.status == 201 && again.replayed && again.body == first.body,
            "a duplicate should be the first answer, replayed",
        )?;
    }
    println!("sequential duplicates: 1 request sent 3 times -> 201, then 2 identical replays");
    Ok(())
}

/// Many copies of one slow request at once: one runs, the others get 409 (in flight);
/// a later retry gets the replay.
async fn concurrent_duplicates(client: &Client) -> Result<(), Error> {
    client.logical(1);
    let p = Payment {
        key: "quickstart-concurrent".to_owned(),
        account: "acct-concurrent".to_owned(),
        amount_cents: 990,
    };
    let copies = (0..CONCURRENT_COPIES).map(|_| client.send(&p, &[("x-simulate-delay-ms", "300")]));
    let answers = futures_util::future::join_all(copies).await;
    let mut created = 0;
    let mut conflicts = 0;
    for answer in answers {
        match answer?.status {
            201 => created += 1,
            409 => conflicts += 1,
            other => return Err(format!("unexpected status {other} for a concurrent copy").into()),
        }
    }
    let retry = client.send(&p, &[]).await?;
    expect(
        retry.status == 201 && retry.replayed,
        "the retry should be a replay",
    )?;
    println!(
        "concurrent duplicates: {CONCURRENT_COPIES} copies at once -> {created} x 201, \
         {conflicts} x 409 (in flight); a retry -> replay"
    );
    Ok(())
}

/// The key of the first demo reused for another amount: 422, nothing recorded.
async fn mismatch(client: &Client) -> Result<(), Error> {
    client.logical(1);
    let p = Payment {
        key: "quickstart-sequential".to_owned(),
        account: "acct-sequential".to_owned(),
        amount_cents: 99_999,
    };
    let answer = client.send(&p, &[]).await?;
    expect(
        answer.status == 422,
        "a reused key should be refused with 422",
    )?;
    println!("mismatch: a used key sent with another amount -> 422 (do-not-retry)");
    Ok(())
}

/// A transient failure (500, marked `NoEffect`) then a clean retry with the same key.
async fn transient_failure(client: &Client) -> Result<(), Error> {
    client.logical(1);
    let p = Payment {
        key: "quickstart-transient".to_owned(),
        account: "acct-transient".to_owned(),
        amount_cents: 4200,
    };
    let failed = client.send(&p, &[("x-simulate-fail", "500")]).await?;
    expect(
        failed.status == 500,
        "the simulated failure should answer 500",
    )?;
    let retry = client.send(&p, &[]).await?;
    expect(
        retry.status == 201 && !retry.replayed,
        "the retry should run",
    )?;
    println!("transient failure: 500 (no effect) -> the retry with the same key runs: 201");
    Ok(())
}

/// A response lost on the way back: the client gave up, the server finished.
async fn lost_response(client: &Client) -> Result<(), Error> {
    client.logical(1);
    let p = Payment {
        key: "quickstart-lost".to_owned(),
        account: "acct-lost".to_owned(),
        amount_cents: 3100,
    };
    client.send_and_lose(&p).await?;
    let retry = client.send_until_done(&p).await?;
    expect(retry.status == 201, "the retry should succeed")?;
    let outcome = if retry.replayed {
        "the replay"
    } else {
        "a first run (the lost copy never reached the server)"
    };
    println!("lost response: the client gives up, the server finishes -> the retry gets {outcome}");
    Ok(())
}

/// `BATCH` logical requests, 32 at a time, each sent 1 to 3 times; every 10th fails
/// transiently first, and every 10th loses its first response.
async fn batch(client: &Client) -> Result<(), Error> {
    client.logical(BATCH);
    let runs = futures_util::stream::iter(0..BATCH)
        .map(|i| async move {
            let p = Payment {
                key: format!("quickstart-batch-{i}"),
                account: format!("acct-batch-{}", i % BATCH_ACCOUNTS),
                amount_cents: 100 + i64::try_from(i).unwrap_or(0),
            };
            match i % 10 {
                3 => client
                    .send(&p, &[("x-simulate-fail", "500")])
                    .await
                    .map(drop)?,
                7 => client.send_and_lose(&p).await?,
                _ => {}
            }
            // A small deterministic spread of 1, 2 or 3 copies.
            let copies = 1 + (i.wrapping_mul(2_654_435_761) >> 7) % 3;
            for _ in 0..copies {
                let answer = client.send_until_done(&p).await?;
                expect(answer.status == 201, "a batch request should succeed")?;
            }
            Ok::<(), Error>(())
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await;
    for run in runs {
        run?;
    }
    println!(
        "batch: {BATCH} requests sent 1-3 times each; every 10th fails transiently first, \
         every 10th loses its first response"
    );
    Ok(())
}

/// What the server side of the demo did on purpose.
#[derive(Debug, Default)]
struct Chaos {
    /// (mode, key) pairs already seen: each fault happens once per key.
    seen: Mutex<HashSet<(String, String)>>,
    failed: AtomicU64,
    lost: AtomicU64,
}

impl Chaos {
    /// Whether `request` asks for a fault that has not happened yet for its key.
    fn first(&self, request: &http::Request<hyper::body::Incoming>, mode: &str) -> bool {
        let asked = request.headers().get(CHAOS).is_some_and(|v| v == mode);
        let key = request.headers().get("idempotency-key");
        match (asked, key.and_then(|k| k.to_str().ok())) {
            (true, Some(key)) => self
                .seen
                .lock()
                .map(|mut seen| seen.insert((mode.to_owned(), key.to_owned())))
                .unwrap_or(false),
            _ => false,
        }
    }

    /// Serves one request: `fail-once` turns the first copy into a 503 marked
    /// `NoEffect` (the app's `x-simulate-fail` hook: nothing recorded); `lose-once` runs
    /// the first copy to completion — the payment is recorded and its answer stored —
    /// and then closes the connection without answering.
    async fn serve(
        &self,
        router: axum::Router,
        mut request: http::Request<hyper::body::Incoming>,
    ) -> Result<axum::response::Response, std::io::Error> {
        if self.first(&request, "fail-once") {
            self.failed.fetch_add(1, Ordering::Relaxed);
            request
                .headers_mut()
                .insert("x-simulate-fail", http::HeaderValue::from_static("503"));
        }
        let lose = self.first(&request, "lose-once");
        let response = match router.oneshot(request.map(axum::body::Body::new)).await {
            Ok(response) => response,
            Err(never) => match never {},
        };
        if lose {
            self.lost.fetch_add(1, Ordering::Relaxed);
            // An error from the service makes hyper close the connection unanswered.
            return Err(std::io::Error::other("a lost response (simulated)"));
        }
        Ok(response)
    }
}

/// Serves `router` behind the chaos layer with hyper's connection API (so a response
/// can really be lost) until `stopped`, then drains the guarded requests.
async fn serve_with_chaos(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    shutdown: retrysafe::idempotency::Shutdown,
    chaos: Arc<Chaos>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) -> Result<(), Error> {
    loop {
        let (stream, _) = tokio::select! {
            _ = &mut stopped => break,
            accepted = listener.accept() => accepted?,
        };
        let (router, chaos) = (router.clone(), chaos.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let (router, chaos) = (router.clone(), chaos.clone());
                async move { chaos.serve(router, request).await }
            });
            // A closed connection is an expected end here.
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
    shutdown.drain().await;
    Ok(())
}

/// `STACK_BATCH` POSTs without keys through the client stack: a `RetryLayer` that
/// generates one key per logical request (the same on every attempt), over hyper's
/// client. Every 10th request's first copy fails with a 503 (no effect), every 10th
/// loses its response after the effect: the layer retries both, with the same key.
async fn client_stack(client: &Client, chaos: &Chaos) -> Result<(), Error> {
    client.logical(STACK_BATCH);
    let attempts = Arc::new(AtomicU64::new(0));
    let counted = attempts.clone();
    let stack = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .generate_idempotency_keys()
                .strategy(StandardRetryStrategy::new().seed(7)),
        )
        .map_request(move |request: http::Request<ReplayBody<Full<Bytes>>>| {
            counted.fetch_add(1, Ordering::Relaxed);
            request
        })
        .service(HyperClient::builder(TokioExecutor::new()).build_http());

    let runs = futures_util::stream::iter(0..STACK_BATCH)
        .map(|i| {
            let stack = stack.clone();
            async move {
                let account = format!("acct-stack-{}", i % STACK_ACCOUNTS);
                let amount_cents = 500 + i64::try_from(i).unwrap_or(0);
                let body = json!({ "account": account, "amount_cents": amount_cents });
                let mut request = http::Request::post(format!("{}/payments", client.base))
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body.to_string())))?;
                let chaos = match i % 10 {
                    3 => Some("fail-once"),
                    7 => Some("lose-once"),
                    _ => None,
                };
                if let Some(mode) = chaos {
                    request
                        .headers_mut()
                        .insert(CHAOS, http::HeaderValue::from_static(mode));
                }
                let response = stack.oneshot(request).await?;
                let status = response.status().as_u16();
                let replayed = response.headers().contains_key("idempotent-replayed");
                let body = response.into_body().collect().await?.to_bytes();
                expect(status == 201, "a client-stack request should succeed")?;
                let created: Created = serde_json::from_slice(&body)?;
                let mut succeeded = client.tally.succeeded.lock().map_err(|_| "poisoned")?;
                succeeded.insert(format!("client-stack-{i}"), (created.id, amount_cents));
                if replayed {
                    client.tally.replays.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<(), Error>(())
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await;
    for run in runs {
        run?;
    }
    let attempts = attempts.load(Ordering::Relaxed);
    let t = &client.tally;
    t.attempts.fetch_add(attempts, Ordering::Relaxed);
    t.simulated_failures
        .fetch_add(chaos.failed.load(Ordering::Relaxed), Ordering::Relaxed);
    t.lost_responses
        .fetch_add(chaos.lost.load(Ordering::Relaxed), Ordering::Relaxed);
    println!(
        "client stack: {STACK_BATCH} POSTs without keys through RetryLayer (generated keys) \
         -> {STACK_BATCH} x 201 in {attempts} attempts; {} transient 503s and {} lost \
         responses absorbed by retries with the same key",
        chaos.failed.load(Ordering::Relaxed),
        chaos.lost.load(Ordering::Relaxed),
    );
    Ok(())
}

async fn run() -> Result<bool, Error> {
    let (router, shutdown) = app::router(&app::Options::default())?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let chaos = Arc::new(Chaos::default());
    let server = tokio::spawn(serve_with_chaos(
        listener,
        router,
        shutdown,
        chaos.clone(),
        stopped,
    ));
    println!("payments server on http://{addr} (in-memory store)");

    let client = Client {
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()?,
        base: format!("http://{addr}"),
        tally: Tally::default(),
    };
    sequential_duplicates(&client).await?;
    concurrent_duplicates(&client).await?;
    mismatch(&client).await?;
    transient_failure(&client).await?;
    lost_response(&client).await?;
    batch(&client).await?;
    client_stack(&client, &chaos).await?;

    // The ledger, through the API.
    let mut accounts: BTreeSet<String> = [
        "acct-sequential",
        "acct-concurrent",
        "acct-transient",
        "acct-lost",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    accounts.extend((0..BATCH_ACCOUNTS).map(|i| format!("acct-batch-{i}")));
    accounts.extend((0..STACK_ACCOUNTS).map(|i| format!("acct-stack-{i}")));
    let (mut effects, mut total_cents) = (0u64, 0i64);
    for account in &accounts {
        let t = client.totals(account).await?;
        effects += t.count;
        total_cents += t.total_cents;
    }

    let tally = &client.tally;
    let (keys, expected_cents) = {
        let succeeded = tally.succeeded.lock().map_err(|_| "poisoned")?;
        let cents: i64 = succeeded.values().map(|(_, cents)| cents).sum();
        (succeeded.len() as u64, cents)
    };
    let duplicates = effects.saturating_sub(keys);

    println!();
    println!(
        "logical requests: {}",
        tally.logical.load(Ordering::Relaxed)
    );
    println!("attempts: {}", tally.attempts.load(Ordering::Relaxed));
    println!("effects: {effects}");
    println!("replays: {}", tally.replays.load(Ordering::Relaxed));
    println!("conflicts: {}", tally.conflicts.load(Ordering::Relaxed));
    println!("mismatches: {}", tally.mismatches.load(Ordering::Relaxed));
    println!(
        "transient failures: {}",
        tally.simulated_failures.load(Ordering::Relaxed)
    );
    println!(
        "lost responses: {}",
        tally.lost_responses.load(Ordering::Relaxed)
    );
    println!("duplicates: {duplicates}");

    drop(client);
    let _ = stop.send(());
    server.await??;

    let mut ok = duplicates == 0;
    if effects < keys {
        eprintln!("error: {keys} keys succeeded but only {effects} payments were recorded");
        ok = false;
    }
    if effects == keys && total_cents != expected_cents {
        eprintln!("error: the ledger holds {total_cents} cents, the answers say {expected_cents}");
        ok = false;
    }
    Ok(ok)
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,tower_http=off")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run().await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
