//! The load of the failover tests (`tests/redis_failover.rs`, `tests/pg_failover.rs`):
//! two app instances, each an axum server on a loopback port behind a fault proxy of its
//! own, and workers sending keyed POSTs through the fault runs' client stack
//! ([`client_stack_with`]: deadline, retry, budget and breaker over hyper; the breaker
//! opening only when every call fails) while the test fails the store over.
//!
//! Each logical request goes to one instance through the stack until it gets a final
//! answer (the stack retries what it may; a 409 in flight, a 503 or an error the stack
//! gave up on is tried again after a pause, as an application's own retry loop would);
//! a 201 is then sent again, as a client whose reply was lost would, to the other
//! instance, which must replay it. The handler counts its effects per key: a key with
//! two effects is a claim or completion that the store acknowledged and then lost.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::Full;
use retrysafe_tower::idempotency::{IdempotencyLayer, Principal};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tower::{Service, ServiceExt};

use crate::client_stack::{Stack, StackCounts, client_stack_with, error_kind};
use crate::proxy::{FaultMix, FaultProxy, ProxyConfig};

/// How long one logical request keeps trying before it is given up.
pub const PATIENCE: Duration = Duration::from_secs(40);

/// The pause before a logical request is tried again.
const PAUSE: Duration = Duration::from_millis(25);

/// How long the workers may take to stop: a worker finishes its logical request, which
/// takes at most twice [`PATIENCE`].
const STOPPING: Duration = Duration::from_secs(120);

/// Effects per idempotency key, across both instances.
pub type Effects = Arc<Mutex<HashMap<String, u32>>>;

/// The app of one instance: `POST /pay` counts an effect for its key, under `layer`, for
/// one tenant's principal.
pub fn app(layer: IdempotencyLayer, effects: &Effects) -> Router {
    let effects = Arc::clone(effects);
    Router::new()
        .route(
            "/pay",
            post(move |headers: HeaderMap| async move {
                let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                *effects.lock().unwrap().entry(key).or_insert(0) += 1;
                (StatusCode::CREATED, "paid")
            }),
        )
        .layer(layer)
        .layer(axum::middleware::map_request(
            |mut req: Request| async move {
                req.extensions_mut().insert(Principal::new("tenant-1"));
                req
            },
        ))
}

/// One instance served on a loopback port, behind a fault proxy (the standard mix).
#[derive(Debug)]
pub struct Front {
    /// Where the client stack sends it requests: the proxy.
    pub addr: SocketAddr,
    proxy: FaultProxy,
    server: JoinHandle<()>,
}

impl Front {
    /// Serves `app` behind a proxy whose faults are drawn with `seed`.
    pub async fn start(app: Router, seed: u64) -> Front {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        let proxy = FaultProxy::start(upstream, ProxyConfig::new(FaultMix::standard(), seed))
            .await
            .unwrap();
        Front {
            addr: proxy.addr,
            proxy,
            server,
        }
    }

    /// The faults the proxy injected, as JSON.
    pub fn faults_json(&self) -> String {
        self.proxy.stats().faults_json()
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// What the load saw.
#[derive(Debug, Default)]
pub struct Tally {
    logical: AtomicU64,
    created: AtomicU64,
    replayed_copies: AtomicU64,
    unknown: AtomicU64,
    unavailable: AtomicU64,
    stack_errors: Mutex<HashMap<&'static str, u64>>,
    given_up: AtomicU64,
}

impl Tally {
    /// Logical requests that got their 201.
    pub fn created(&self) -> u64 {
        self.created.load(Ordering::Relaxed)
    }

    /// The counts as JSON fields (no braces).
    pub fn json_fields(&self) -> String {
        let mut errors: Vec<_> = self
            .stack_errors
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| format!("\"{k}\": {v}"))
            .collect();
        errors.sort();
        format!(
            "\"logical\": {}, \"created\": {}, \"replayed_copies\": {}, \
             \"outcome_unknown\": {}, \"unavailable_answers\": {}, \"stack_errors\": {{{}}}, \
             \"given_up\": {}",
            self.logical.load(Ordering::Relaxed),
            self.created(),
            self.replayed_copies.load(Ordering::Relaxed),
            self.unknown.load(Ordering::Relaxed),
            self.unavailable.load(Ordering::Relaxed),
            errors.join(", "),
            self.given_up.load(Ordering::Relaxed),
        )
    }
}

/// What one worker awaits now, for the report of a worker that does not stop.
type Stage = Arc<Mutex<String>>;

/// Workers sending logical requests to two fronts until stopped.
#[derive(Debug)]
pub struct Load {
    stop: Arc<AtomicBool>,
    workers: Vec<(JoinHandle<()>, Stage)>,
    tally: Arc<Tally>,
    counts: Arc<StackCounts>,
}

impl Load {
    /// `concurrency` workers over one client stack (seeded with `seed`), keys named
    /// after `run`.
    pub fn start(fronts: [SocketAddr; 2], run: &str, concurrency: u64, seed: u64) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Tally::default());
        let counts = Arc::new(StackCounts::default());
        // The breaker opens only when every call fails: while a promoted primary waits
        // for a replica, `replicated_writes` refuses a third of the keys (503), and a
        // breaker open on that would keep the load this test measures from flowing.
        let stack = client_stack_with(seed, &counts, |c| c.with_failure_rate_threshold(100.0));
        let workers = (0..concurrency)
            .map(|n| {
                let stage = Stage::default();
                let worker = Worker {
                    fronts,
                    stack: stack.clone(),
                    run: run.to_owned(),
                    n,
                    stage: Arc::clone(&stage),
                    tally: Arc::clone(&tally),
                };
                (tokio::spawn(worker.run(Arc::clone(&stop))), stage)
            })
            .collect();
        Load {
            stop,
            workers,
            tally,
            counts,
        }
    }

    /// Stops the workers once their logical requests are done (failing, with what each
    /// awaits, when they do not stop within two minutes) and returns their tally.
    pub async fn stop(self) -> (Arc<Tally>, Arc<StackCounts>) {
        self.stop.store(true, Ordering::Relaxed);
        let mut workers = self.workers;
        let stopped = tokio::time::timeout(STOPPING, async {
            for (w, _) in &mut workers {
                w.await.unwrap();
            }
        })
        .await;
        if stopped.is_err() {
            let stuck: Vec<String> = workers
                .iter()
                .filter(|(w, _)| !w.is_finished())
                .map(|(_, stage)| stage.lock().unwrap().clone())
                .collect();
            panic!("workers still running {STOPPING:?} after the failovers: {stuck:?}");
        }
        (self.tally, self.counts)
    }
}

struct Worker {
    fronts: [SocketAddr; 2],
    stack: Stack,
    run: String,
    n: u64,
    stage: Stage,
    tally: Arc<Tally>,
}

impl Worker {
    async fn run(mut self, stop: Arc<AtomicBool>) {
        let mut i = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let key = format!("{}-{}-{i}", self.run, self.n);
            let (first, other) = if i.is_multiple_of(2) { (0, 1) } else { (1, 0) };
            i += 1;
            self.tally.logical.fetch_add(1, Ordering::Relaxed);
            match self.final_status(first, &key).await {
                Some((StatusCode::CREATED, _)) => {
                    self.tally.created.fetch_add(1, Ordering::Relaxed);
                    // The reply was lost, say: the same request again, to the other one.
                    match self.final_status(other, &key).await {
                        Some((StatusCode::CREATED, true)) => {
                            self.tally.replayed_copies.fetch_add(1, Ordering::Relaxed);
                        }
                        Some((StatusCode::INTERNAL_SERVER_ERROR, _)) => {
                            self.tally.unknown.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {}
                    }
                }
                Some((StatusCode::INTERNAL_SERVER_ERROR, _)) => {
                    self.tally.unknown.fetch_add(1, Ordering::Relaxed);
                }
                Some(_) => {}
                None => {
                    self.tally.given_up.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// The final status of `key` at front `n` and whether it was a replay, or `None`
    /// when it got none within [`PATIENCE`].
    async fn final_status(&mut self, n: usize, key: &str) -> Option<(StatusCode, bool)> {
        let tries = PATIENCE.as_millis() / PAUSE.as_millis();
        let uri = format!("http://{}/pay", self.fronts[n]);
        for t in 0..tries {
            *self.stage.lock().unwrap() = format!("{key}: try {t} on instance {n}");
            let req = http::Request::post(uri.as_str())
                .header("idempotency-key", key)
                .body(Full::new(Bytes::from_static(b"pay 10")))
                .unwrap();
            let answer = match self.stack.ready().await {
                Ok(stack) => stack.call(req).await,
                Err(e) => Err(e),
            };
            match answer {
                Ok(res) => {
                    let replayed = res.headers().contains_key("idempotent-replayed");
                    match res.status() {
                        StatusCode::CONFLICT => {}
                        StatusCode::SERVICE_UNAVAILABLE => {
                            self.tally.unavailable.fetch_add(1, Ordering::Relaxed);
                        }
                        status => return Some((status, replayed)),
                    }
                }
                Err(e) => {
                    *self
                        .tally
                        .stack_errors
                        .lock()
                        .unwrap()
                        .entry(error_kind(&e))
                        .or_default() += 1;
                }
            }
            tokio::time::sleep(PAUSE).await;
        }
        None
    }
}

/// The keys with two effects or more.
pub fn duplicates(effects: &Effects) -> u64 {
    effects
        .lock()
        .unwrap()
        .values()
        .filter(|&&n| n >= 2)
        .count() as u64
}
