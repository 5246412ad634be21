//! Clock steps: the store's own clock jumps forward and back, by less than the
//! retention, while guarded requests and their copies run. No key may run twice: at
//! worst a claim becomes a takeover (before its commit point, which fences the late
//! holder) or an unknown outcome.
//!
//! The store is a private server whose wall clock the test steps: a `redis-server` with
//! `tests/clock_steps/shift.c` preloaded (built here with `cc`; Debian's libfaketime
//! cannot be preloaded into Debian's redis-server: its initialisation recurses through
//! jemalloc's), and a PostgreSQL cluster under libfaketime (Debian package `faketime`,
//! which `scripts/test` installs), its offset re-read from a file on every call. The
//! steps cycle through +5 s, −5 s, +20 s, −20 s, +60 s and back to 0, one every 700 ms,
//! against 4 s leases (1 s store calls: a loaded machine must not turn the run into 503s)
//! and a 600 s retention.
//!
//! An in-process axum server guards a handler that counts its effects per key; each key
//! is sent three times at random moments over about 6 s, each copy resent on 409 and
//! 503. One summary line per store (`--nocapture` to see it).
#![allow(
    clippy::disallowed_methods,
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::cast_possible_truncation,
    missing_docs
)]

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use http::StatusCode;
use retrysafe::idempotency::IdempotencyContext;
use retrysafe::idempotency::{EventKind, IdempotencyLayer, IdempotencyStore, NoEffect};
use retrysafe_core::idempotency::Token;
use retrysafe_postgres::PostgresStore;
use retrysafe_redis::RedisStore;
use retrysafe_redis::redis::{self, aio::ConnectionManager};
use retrysafe_test_support::private::{PrivatePg, PrivateRedis, Scratch};
use retrysafe_test_support::rng::{SplitMix64, seed_from_env};
use serde::Deserialize;

/// Keys per store, each sent three times.
const KEYS: u64 = 300;
/// The steps of the store's clock, in milliseconds from the real time.
const STEPS_MS: [i64; 6] = [5_000, -5_000, 20_000, -20_000, 60_000, 0];
const STEP_EVERY: Duration = Duration::from_millis(700);

#[derive(Default)]
struct Counts {
    effects: Mutex<HashMap<String, u32>>,
    takeovers: AtomicU64,
    unknown: AtomicU64,
}

#[derive(Deserialize)]
struct Work {
    before_ms: u64,
    after_ms: u64,
}

async fn handler(
    State(counts): State<Arc<Counts>>,
    Extension(ctx): Extension<IdempotencyContext>,
    Json(work): Json<Work>,
) -> Response {
    tokio::time::sleep(Duration::from_millis(work.before_ms)).await;
    if ctx.commit_point().await.is_err() {
        let mut res = StatusCode::SERVICE_UNAVAILABLE.into_response();
        res.extensions_mut().insert(NoEffect);
        return res;
    }
    let key = ctx.key().as_str().to_owned();
    *counts
        .effects
        .lock()
        .unwrap()
        .entry(key.clone())
        .or_default() += 1;
    tokio::time::sleep(Duration::from_millis(work.after_ms)).await;
    (StatusCode::CREATED, key).into_response()
}

/// Serves the guarded handler over `store` on a fresh port.
async fn serve(store: impl IdempotencyStore, counts: &Arc<Counts>) -> String {
    let c = Arc::clone(counts);
    let layer = IdempotencyLayer::new(store)
        .global_scope()
        .require_key()
        .handlers_declare_commit_point()
        .lease(Duration::from_secs(4))
        .store_timeout(Duration::from_secs(1))
        .retention(Duration::from_secs(600))
        .in_flight_retry_after(Duration::from_millis(100))
        .on_event(move |e| match e.kind {
            EventKind::Takeover => {
                c.takeovers.fetch_add(1, Ordering::Relaxed);
            }
            EventKind::OutcomeUnknown => {
                c.unknown.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        })
        .build()
        .unwrap();
    let app = Router::new()
        .route("/work", post(handler))
        .with_state(Arc::clone(counts))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/work")
}

/// Steps the clock (writes each offset with `format`) until `stop` is set.
async fn step_clock(
    file: PathBuf,
    format: fn(i64) -> String,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    for ms in STEPS_MS.iter().cycle() {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        std::fs::write(&file, format(*ms)).unwrap();
        tokio::time::sleep(STEP_EVERY).await;
    }
    std::fs::write(&file, format(0)).unwrap();
}

/// Sends every key three times at random moments, each copy resent on 409 and 503.
async fn load(url: &str, seed: u64) -> BTreeMap<u16, u64> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let mut rng = SplitMix64::new(seed);
    let tag = &Token::random().to_hex()[..8];
    let mut copies = Vec::new();
    for k in 0..KEYS {
        let key = format!("clock-{tag}-{k}");
        let work =
            serde_json::json!({ "before_ms": rng.range(0, 300), "after_ms": rng.range(0, 100) });
        for _ in 0..3 {
            let start = Duration::from_millis(rng.range(0, 6_000));
            let (http, url, key, work) = (http.clone(), url.to_owned(), key.clone(), work.clone());
            copies.push(tokio::spawn(async move {
                tokio::time::sleep(start).await;
                let mut status = 0;
                for _ in 0..200 {
                    let sent = http
                        .post(&url)
                        .header("idempotency-key", &key)
                        .json(&work)
                        .send()
                        .await;
                    status = sent.map_or(0, |r| r.status().as_u16());
                    if !matches!(status, 409 | 503 | 0) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(150)).await;
                }
                status
            }));
        }
    }
    let mut statuses = BTreeMap::new();
    for copy in copies {
        *statuses.entry(copy.await.unwrap()).or_default() += 1;
    }
    statuses
}

async fn run(name: &str, store: impl IdempotencyStore, file: PathBuf, format: fn(i64) -> String) {
    let counts = Arc::new(Counts::default());
    let url = serve(store, &counts).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stepper = tokio::spawn(step_clock(file, format, Arc::clone(&stop)));
    let seed = seed_from_env("CLOCK_STEPS_SEED", name);
    let statuses = load(&url, seed).await;
    stop.store(true, Ordering::Relaxed);
    stepper.await.unwrap();

    let effects = counts.effects.lock().unwrap().clone();
    let twice: Vec<_> = effects.iter().filter(|(_, n)| **n > 1).collect();
    let once = effects.values().filter(|n| **n == 1).count();
    println!(
        "{{\"store\":\"{name}\",\"seed\":{seed},\"keys\":{KEYS},\"keys_with_one_effect\":{once},\
         \"keys_with_two_or_more\":{},\"takeovers\":{},\"unknown\":{},\"final_statuses\":{:?}}}",
        twice.len(),
        counts.takeovers.load(Ordering::Relaxed),
        counts.unknown.load(Ordering::Relaxed),
        statuses,
    );
    assert!(
        twice.is_empty(),
        "{name}: keys that ran twice under clock steps: {twice:?}"
    );
    assert!(
        once as u64 >= KEYS / 4,
        "{name}: only {once} of {KEYS} keys ran at all: the load did not get through"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_clock_steps_make_no_duplicate() {
    let scratch = Scratch::new("clock-shift");
    let shim = scratch.path().join("shift.so");
    let source = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clock_steps/shift.c");
    let built = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&shim)
        .arg(source)
        .status()
        .expect("cc (gcc) builds the clock shifter");
    assert!(built.success(), "building {source}");
    let file = scratch.path().join("shift.ms");
    std::fs::write(&file, "0").unwrap();
    let env = vec![
        ("LD_PRELOAD".to_owned(), shim.display().to_string()),
        (
            "RETRYSAFE_CLOCK_SHIFT_FILE".to_owned(),
            file.display().to_string(),
        ),
    ];
    let redis = PrivateRedis::start_with(env).await;
    let conn = ConnectionManager::new(redis::Client::open(redis.url()).unwrap())
        .await
        .unwrap();
    let store = RedisStore::options()
        .key_prefix("clock:")
        .build(conn)
        .await
        .unwrap();
    run("redis", store, file, |ms| ms.to_string()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_clock_steps_make_no_duplicate() {
    let lib = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
    assert!(
        std::path::Path::new(lib).exists(),
        "{lib} is missing: install Debian's `faketime` (scripts/test does)"
    );
    let scratch = Scratch::new("faketime");
    let file = scratch.path().join("faketime.rc");
    std::fs::write(&file, "+0").unwrap();
    // The cluster runs as user `postgres`: let it read the file.
    let world_readable = std::os::unix::fs::PermissionsExt::from_mode(0o755);
    std::fs::set_permissions(scratch.path(), world_readable).unwrap();
    let env = vec![
        ("LD_PRELOAD".to_owned(), lib.to_owned()),
        (
            "FAKETIME_TIMESTAMP_FILE".to_owned(),
            file.display().to_string(),
        ),
        ("FAKETIME_NO_CACHE".to_owned(), "1".to_owned()),
    ];
    let pg = PrivatePg::start_with(env).await;
    let store = PostgresStore::options()
        .max_connections(16)
        .connect(&pg.url())
        .await
        .unwrap();
    store.migrate().await.unwrap();
    // libfaketime's relative offsets are in seconds.
    run("postgres", store, file, |ms| format!("{:+}", ms / 1000)).await;
}
