//! Soak run: a bounded run of mixed load through the fault-injecting proxy
//! (`retrysafe_test_support::proxy`) on the memory and Redis stores at once, in one
//! process.
//!
//! Two in-process axum servers guarded by an `IdempotencyLayer` — one over a
//! `MemoryStore` bounded by `SOAK_MEMORY_MAX_BYTES` (default 16 MiB), one over a
//! `RedisStore` (Redis at `REDIS_URL`, keys under a random prefix with a 30 s retention,
//! deleted at the end) — each behind its own fault proxy (`FaultMix::standard()`: 17.5 %
//! of requests reset, cut, half-closed or black-holed, 10 % delayed), each driven by
//! `SOAK_CONCURRENCY` workers (default 32) through the retrysafe client stack
//! (deadline 10 s → retry, 4 attempts → budget → breaker → 1 s per attempt → hyper).
//! Each worker loops over a mix of operations, with keys set by the client:
//!
//! - 70 % a new logical request (a fresh key, sent once through the stack);
//! - 20 % a duplicate resend: the same key and body as one of the last 2 000 logical
//!   requests of that store, sent again (a replay, or the stored outcome);
//! - 10 % concurrent copies: a fresh key sent three times at once.
//!
//! The handler counts its effects per logical request (one byte each, so the counting
//! itself does not grow the process much), fails 1 % of calls with a transient 503
//! marked `NoEffect` and 0.3 % with a 500 after its effect (`outcome_unknown`).
//! Samples every `SOAK_SAMPLE_SECS` (default 60) print the process's RSS
//! (`/proc/self/status` `VmRSS`), the memory store's weighed bytes and records, and
//! the counts so far, on stderr. At the end one JSON line per store and one for the
//! process on stdout. Fails (exit code 1) if any logical request has two effects, if
//! succeeded ≤ effects ≤ logical does not hold, or if the memory store ever weighed
//! more than its `max_bytes`.
//!
//! `SOAK_SECS` (default 600), `SOAK_SEED` (printed). Run with `scripts/soak`.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::cast_possible_truncation,
    missing_docs,
    unreachable_pub
)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response as AxumResponse};
use axum::routing::post;
use axum::{Extension, Json, Router};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use retrysafe::idempotency::IdempotencyContext;
use retrysafe::idempotency::{IdempotencyEvent, IdempotencyLayer, MemoryStore, NoEffect, Shutdown};
use retrysafe_redis::RedisStore;
use retrysafe_redis::redis::{self, aio::ConnectionManager};
use retrysafe_test_support::client_stack::{Stack, StackCounts, client_stack, error_kind};
use retrysafe_test_support::proxy::{FaultMix, FaultProxy, ProxyConfig};
use retrysafe_test_support::rng::{SplitMix64, seed_from_env};
use serde::Deserialize;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tower::ServiceExt;

const TRANSIENT_PER_MILLE: u64 = 10;
const FAIL_AFTER_EFFECT_PER_MILLE: u64 = 3;
const PAD: usize = 300;
/// Duplicate resends pick among this many latest logical requests of a store.
const RESEND_WINDOW: u64 = 2000;
/// Copies sent at once by a "concurrent copies" operation.
const COPIES: usize = 3;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------
// The server

#[derive(Debug, Default)]
struct Events {
    by_kind: Mutex<BTreeMap<&'static str, u64>>,
    reconcile: AtomicU64,
}

impl Events {
    fn count(&self, e: &IdempotencyEvent) {
        *self
            .by_kind
            .lock()
            .unwrap()
            .entry(e.kind.as_str())
            .or_default() += 1;
    }

    fn get(&self, name: &str) -> u64 {
        self.by_kind.lock().unwrap().get(name).copied().unwrap_or(0)
    }

    fn json(&self) -> String {
        let fields: Vec<String> = self
            .by_kind
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| format!("\"{k}\":{v}"))
            .chain(std::iter::once(format!(
                "\"reconcile_hook\":{}",
                self.reconcile.load(Ordering::Relaxed)
            )))
            .collect();
        format!("{{{}}}", fields.join(","))
    }
}

#[derive(Debug)]
struct AppState {
    /// Effects per logical request id (saturating at 255).
    effects: Mutex<Vec<u8>>,
    rng: Mutex<SplitMix64>,
    handler_calls: AtomicU64,
    transient: AtomicU64,
    fail_after_effect: AtomicU64,
}

#[derive(Debug, Deserialize)]
struct Pay {
    id: u64,
    #[allow(dead_code, reason = "padding: only its size matters")]
    pad: String,
}

fn problem(status: StatusCode, slug: &str) -> AxumResponse {
    let body = json!({
        "type": format!("urn:retrysafe-soak:{slug}"),
        "title": slug,
        "status": status.as_u16(),
    });
    (
        status,
        [("content-type", "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

async fn pay(
    State(st): State<Arc<AppState>>,
    ctx: Option<Extension<IdempotencyContext>>,
    Json(p): Json<Pay>,
) -> AxumResponse {
    st.handler_calls.fetch_add(1, Ordering::Relaxed);
    let Some(Extension(ctx)) = ctx else {
        return problem(StatusCode::INTERNAL_SERVER_ERROR, "not-guarded");
    };
    let roll = st.rng.lock().unwrap().below(1000);
    if roll < TRANSIENT_PER_MILLE {
        st.transient.fetch_add(1, Ordering::Relaxed);
        let mut res = problem(StatusCode::SERVICE_UNAVAILABLE, "transient");
        res.extensions_mut().insert(NoEffect);
        return res;
    }
    if ctx.commit_point().await.is_err() {
        let mut res = problem(StatusCode::SERVICE_UNAVAILABLE, "commit-point-failed");
        res.extensions_mut().insert(NoEffect);
        return res;
    }
    {
        let mut effects = st.effects.lock().unwrap();
        let i = p.id as usize;
        if effects.len() <= i {
            effects.resize(i + 1, 0);
        }
        effects[i] = effects[i].saturating_add(1);
    }
    if roll < TRANSIENT_PER_MILLE + FAIL_AFTER_EFFECT_PER_MILLE {
        st.fail_after_effect.fetch_add(1, Ordering::Relaxed);
        return problem(StatusCode::INTERNAL_SERVER_ERROR, "failed-after-effect");
    }
    let body = json!({ "id": p.id, "pad": "r".repeat(PAD) });
    (StatusCode::CREATED, Json(body)).into_response()
}

struct ServerSide {
    addr: SocketAddr,
    state: Arc<AppState>,
    events: Arc<Events>,
    shutdown: Shutdown,
}

fn serve(
    layer: IdempotencyLayer,
    seed: u64,
    events: &Arc<Events>,
) -> (Router, Arc<AppState>, Shutdown) {
    let ev = Arc::clone(events);
    let ev2 = Arc::clone(events);
    let layer = layer
        .global_scope()
        .require_key()
        .handlers_declare_commit_point()
        .in_flight_retry_after(Duration::from_millis(200))
        .on_event(move |e| ev.count(e))
        .on_outcome_unknown(move |_| {
            ev2.reconcile.fetch_add(1, Ordering::Relaxed);
        });
    let shutdown = layer.shutdown_handle();
    let state = Arc::new(AppState {
        effects: Mutex::new(Vec::new()),
        rng: Mutex::new(SplitMix64::new(seed ^ 0x5E4E)),
        handler_calls: AtomicU64::new(0),
        transient: AtomicU64::new(0),
        fail_after_effect: AtomicU64::new(0),
    });
    let router = Router::new()
        .route("/pay", post(pay))
        .with_state(Arc::clone(&state))
        .layer(layer);
    (router, state, shutdown)
}

async fn start(layer: IdempotencyLayer, seed: u64) -> ServerSide {
    let events = Arc::new(Events::default());
    let (router, state, shutdown) = serve(layer, seed, &events);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    ServerSide {
        addr,
        state,
        events,
        shutdown,
    }
}

// ---------------------------------------------------------------------------------
// The client

#[derive(Debug, Default)]
struct ClientCounts {
    /// What the client stack counts (attempts, retries, breaker openings, give-ups).
    stack: Arc<StackCounts>,
    /// Operation → outcome label → count.
    outcomes: Mutex<BTreeMap<(&'static str, String), u64>>,
    logical: AtomicU64,
    /// Logical requests (new or copies) that got a 201 at least once.
    succeeded: AtomicU64,
    /// Duplicate resends answered with a replayed 201.
    replays_seen: AtomicU64,
}

/// One call through the stack with `key`: an outcome label, and whether it was a 201.
async fn send(stack: Stack, base: &str, store: &str, id: u64) -> (String, bool) {
    let body = json!({ "id": id, "pad": "q".repeat(PAD) }).to_string();
    let request = Request::post(format!("{base}/pay"))
        .header("content-type", "application/json")
        .header("idempotency-key", format!("soak-{store}-{id}"))
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let call = async {
        let response = match stack.oneshot(request).await {
            Ok(r) => r,
            Err(e) => return (format!("error_{}", error_kind(&e)), false),
        };
        let status = response.status();
        let replayed = response.headers().contains_key("idempotent-replayed");
        match response.into_body().collect().await {
            Err(_) => ("body_error".to_owned(), false),
            Ok(_) if status == StatusCode::CREATED && replayed => ("201_replayed".to_owned(), true),
            Ok(_) if status == StatusCode::CREATED => ("201".to_owned(), true),
            Ok(_) => (format!("status_{}", status.as_u16()), false),
        }
    };
    tokio::time::timeout(Duration::from_secs(60), call)
        .await
        .unwrap_or_else(|_| ("stuck".to_owned(), false))
}

struct Driver {
    stack: Stack,
    base: String,
    store: &'static str,
    next_id: AtomicU64,
    counts: Arc<ClientCounts>,
}

impl Driver {
    fn note(&self, op: &'static str, label: String) {
        *self
            .counts
            .outcomes
            .lock()
            .unwrap()
            .entry((op, label))
            .or_default() += 1;
    }

    async fn worker(self: Arc<Self>, mut rng: SplitMix64, stop: Arc<AtomicBool>) {
        while !stop.load(Ordering::Relaxed) {
            let roll = rng.below(100);
            if roll < 20 && self.next_id.load(Ordering::Relaxed) > 0 {
                // A duplicate resend of a recent logical request.
                let top = self.next_id.load(Ordering::Relaxed);
                let id = top - 1 - rng.below(top.min(RESEND_WINDOW));
                let (label, _) = send(self.stack.clone(), &self.base, self.store, id).await;
                if label == "201_replayed" {
                    self.counts.replays_seen.fetch_add(1, Ordering::Relaxed);
                }
                self.note("resend", label);
            } else if roll < 30 {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                self.counts.logical.fetch_add(1, Ordering::Relaxed);
                let copies =
                    (0..COPIES).map(|_| send(self.stack.clone(), &self.base, self.store, id));
                let answers = futures_util::future::join_all(copies).await;
                let ok = answers.iter().any(|(_, ok)| *ok);
                if ok {
                    self.counts.succeeded.fetch_add(1, Ordering::Relaxed);
                }
                for (label, _) in answers {
                    self.note("copies", label);
                }
            } else {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                self.counts.logical.fetch_add(1, Ordering::Relaxed);
                let (label, ok) = send(self.stack.clone(), &self.base, self.store, id).await;
                if ok {
                    self.counts.succeeded.fetch_add(1, Ordering::Relaxed);
                }
                self.note("new", label);
            }
        }
    }
}

fn effects_summary(state: &AppState) -> (u64, u64) {
    let effects = state.effects.lock().unwrap();
    let total: u64 = effects.iter().map(|n| u64::from(*n)).sum();
    let duplicates = effects.iter().filter(|n| **n > 1).count() as u64;
    (total, duplicates)
}

async fn run() -> bool {
    let secs = env_u64("SOAK_SECS", 600);
    let sample_every = env_u64("SOAK_SAMPLE_SECS", 60).max(1);
    let concurrency = env_u64("SOAK_CONCURRENCY", 32);
    let max_bytes = env_u64("SOAK_MEMORY_MAX_BYTES", 16 << 20);
    let seed = seed_from_env("SOAK_SEED", "soak");
    let started = Instant::now();
    let rss_start = rss_kib();
    eprintln!(
        "soak: {secs} s, {concurrency} workers per store, memory store max_bytes {max_bytes}, \
         RSS at start {rss_start} KiB"
    );

    // The memory store, bounded.
    let evicted = Arc::new(AtomicU64::new(0));
    let ev = Arc::clone(&evicted);
    let memory_store = MemoryStore::new()
        .max_bytes(max_bytes)
        .on_evicted(move |_| {
            ev.fetch_add(1, Ordering::Relaxed);
        })
        .build()
        .unwrap();
    let memory = start(IdempotencyLayer::new(memory_store.clone()), seed ^ 1).await;

    // The Redis store, with a short retention so Redis does not grow for 10 minutes.
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let client = redis::Client::open(url.as_str()).unwrap();
    let conn = tokio::time::timeout(Duration::from_secs(10), ConnectionManager::new(client))
        .await
        .unwrap_or_else(|_| panic!("timed out connecting to Redis at {url}"))
        .unwrap_or_else(|e| panic!("cannot reach Redis at REDIS_URL={url}: {e}"));
    let nonce = SplitMix64::new(seed ^ u64::from(std::process::id())).next_u64();
    let prefix = format!("soak:{nonce:016x}:");
    let redis_store = RedisStore::options()
        .key_prefix(prefix.clone())
        .call_timeout(Duration::from_secs(2))
        .build(conn.clone())
        .await
        .unwrap();
    let redis_layer = IdempotencyLayer::new(redis_store)
        .retention(Duration::from_secs(30))
        .build()
        .unwrap();
    let redis_side = start(redis_layer, seed ^ 2).await;

    let stop = Arc::new(AtomicBool::new(false));
    let mut proxies = Vec::new();
    let mut drivers = Vec::new();
    let mut workers = Vec::new();
    for (i, (name, side)) in [("memory", &memory), ("redis", &redis_side)]
        .into_iter()
        .enumerate()
    {
        let pseed = seed ^ (0x100 + i as u64);
        let proxy = FaultProxy::start(side.addr, ProxyConfig::new(FaultMix::standard(), pseed))
            .await
            .unwrap();
        let counts = Arc::new(ClientCounts::default());
        let driver = Arc::new(Driver {
            stack: client_stack(pseed, &counts.stack),
            base: format!("http://{}", proxy.addr),
            store: name,
            next_id: AtomicU64::new(0),
            counts,
        });
        for w in 0..concurrency {
            let rng = SplitMix64::new(pseed ^ (w + 1).wrapping_mul(0x9E37_79B9));
            workers.push(tokio::spawn(
                Arc::clone(&driver).worker(rng, Arc::clone(&stop)),
            ));
        }
        proxies.push(proxy);
        drivers.push(driver);
    }

    let mut rss_samples = vec![rss_start];
    let mut max_cached = 0u64;
    let mut over_bound = false;
    let end = started + Duration::from_secs(secs);
    loop {
        let now = Instant::now();
        if now >= end {
            break;
        }
        let next = (now + Duration::from_secs(sample_every)).min(end);
        // Check the memory store's bound often; print a sample every `sample_every`.
        while Instant::now() < next {
            tokio::time::sleep(Duration::from_millis(500).min(next - Instant::now())).await;
            let cached = memory_store.cached_bytes();
            max_cached = max_cached.max(cached);
            if cached > max_bytes {
                over_bound = true;
            }
        }
        let rss = rss_kib();
        rss_samples.push(rss);
        let (m_eff, m_dup) = effects_summary(&memory.state);
        let (r_eff, r_dup) = effects_summary(&redis_side.state);
        eprintln!(
            "t={:>4}s rss={rss} KiB memory: logical={} effects={m_eff} dup={m_dup} \
             cached_bytes={} cached_len={} evicted={} | redis: logical={} effects={r_eff} dup={r_dup}",
            started.elapsed().as_secs(),
            drivers[0].counts.logical.load(Ordering::Relaxed),
            memory_store.cached_bytes(),
            memory_store.cached_len(),
            evicted.load(Ordering::Relaxed),
            drivers[1].counts.logical.load(Ordering::Relaxed),
        );
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    for side in [&memory, &redis_side] {
        let _ = tokio::time::timeout(Duration::from_secs(60), side.shutdown.clone().drain()).await;
    }
    let rss_end = rss_kib();

    // Clean Redis up.
    {
        let mut conn = conn.clone();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}*"))
            .query_async(&mut conn)
            .await
            .unwrap_or_default();
        for batch in keys.chunks(1000) {
            let _: redis::RedisResult<i64> =
                redis::cmd("DEL").arg(batch).query_async(&mut conn).await;
        }
    }

    let mut ok = true;
    for ((driver, side), proxy) in drivers.iter().zip([&memory, &redis_side]).zip(&proxies) {
        let c = &driver.counts;
        let logical = c.logical.load(Ordering::Relaxed);
        let succeeded = c.succeeded.load(Ordering::Relaxed);
        let (effects, duplicates) = effects_summary(&side.state);
        let holds = duplicates == 0 && succeeded <= effects && effects <= logical;
        ok &= holds;
        let outcomes: Vec<String> = c
            .outcomes
            .lock()
            .unwrap()
            .iter()
            .map(|((op, label), n)| format!("\"{op}:{label}\":{n}"))
            .collect();
        let give_ups: Vec<String> = c
            .stack
            .give_ups
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| format!("\"{k}\":{v}"))
            .collect();
        let stats = proxy.stats();
        let extra = if driver.store == "memory" {
            format!(
                ",\"max_bytes\":{max_bytes},\"max_cached_bytes\":{max_cached},\
                 \"cached_bytes_end\":{},\"cached_len_end\":{},\"evicted\":{}",
                memory_store.cached_bytes(),
                memory_store.cached_len(),
                evicted.load(Ordering::Relaxed)
            )
        } else {
            String::new()
        };
        println!(
            "{{\"store\":\"{}\",\"secs\":{secs},\"logical\":{logical},\"succeeded\":{succeeded},\
             \"success_rate\":{:.4},\"effects\":{effects},\"duplicates\":{duplicates},\
             \"invariants_hold\":{holds},\"attempts\":{},\"retries\":{},\"replays_seen\":{},\
             \"outcome_unknown\":{},\"takeover\":{},\"completion_lost\":{},\"breaker_opened\":{},\
             \"give_ups\":{{{}}},\"outcomes\":{{{}}},\"server\":{{\"handler_calls\":{},\
             \"transient_503\":{},\"fail_after_effect_500\":{},\"events\":{}}},\
             \"proxy\":{{\"connections\":{},\"requests\":{},\"faults\":{}}}{extra}}}",
            driver.store,
            succeeded as f64 / logical.max(1) as f64,
            c.stack.attempts.load(Ordering::Relaxed),
            c.stack.retries.load(Ordering::Relaxed),
            c.replays_seen.load(Ordering::Relaxed),
            side.events.get("outcome_unknown"),
            side.events.get("takeover"),
            side.events.get("completion_lost"),
            c.stack.breaker_opened.load(Ordering::Relaxed),
            give_ups.join(","),
            outcomes.join(","),
            side.state.handler_calls.load(Ordering::Relaxed),
            side.state.transient.load(Ordering::Relaxed),
            side.state.fail_after_effect.load(Ordering::Relaxed),
            side.events.json(),
            stats.connections,
            stats.requests,
            stats.faults_json(),
        );
    }
    if over_bound {
        ok = false;
    }
    let samples: Vec<String> = rss_samples.iter().map(u64::to_string).collect();
    println!(
        "{{\"process\":\"soak\",\"seed\":{seed},\"secs\":{secs},\"rss_start_kib\":{rss_start},\
         \"rss_end_kib\":{rss_end},\"rss_samples_kib\":[{}],\"memory_store_within_max_bytes\":{},\
         \"ok\":{ok}}}",
        samples.join(","),
        !over_bound,
    );
    ok
}

fn main() -> ExitCode {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    if runtime.block_on(run()) {
        ExitCode::SUCCESS
    } else {
        eprintln!("soak: FAILED (see the JSON lines above)");
        ExitCode::FAILURE
    }
}
