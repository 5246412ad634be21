//! What the `IdempotencyLayer` (with the `MemoryStore`) costs per request, in process.
//!
//! An axum `Router` with one trivial POST handler (201, a ~100-byte JSON body) is driven
//! with `ServiceExt::oneshot` on a current-thread tokio runtime; every iteration sends a
//! request with an `idempotency-key` and reads the whole response body, as a server
//! would. The same authentication layer (a `MapRequest` that inserts a `Principal`) sits
//! in front of every case, so only the `IdempotencyLayer` differs from `bare`. No network,
//! no HTTP parsing: see `BENCHMARKS.md` for what that means for the ratios.
//!
//! Group `idempotency` (64-byte request bodies):
//! - `bare`: the router without the layer;
//! - `first`: a fresh key per iteration: claim → handler → capture → complete. A fresh
//!   `MemoryStore` (defaults) and router are built outside the timed part for every
//!   criterion batch and every 16 384 requests within one, and checked afterwards to
//!   hold one record per request: each store grows from empty to at most 16 384
//!   records and never evicts;
//! - `replay`: one key completed in setup; every iteration gets the stored response;
//! - `mismatch`: one key completed in setup; every iteration sends another body → 422.
//!
//! Group `idempotency_body_size`: `bare` and `first` with request bodies of 64 B, 4 KiB,
//! 64 KiB and 1 MiB, sent in frames of at most 16 KiB (as a body arrives from hyper), so
//! the layer's buffering copies and its SHA-256 fingerprint covers every byte.
//!
//! Every case is checked once in setup (status, `idempotent-replayed`, body) so the bench
//! cannot silently measure an error path.
//!
//! `cargo bench --bench idempotency -- --warm-up-time 1 --measurement-time 3`
//!
//! Instructions per request (exact, unlike time on a shared machine):
//! `BENCH=idempotency scripts/bench-callgrind` (`IDEMPOTENCY_BENCH_CASE=bare|first|replay
//! IDEMPOTENCY_BENCH_CALLS=n`).
#![allow(clippy::unwrap_used, clippy::panic, missing_docs)]

use std::convert::Infallible;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::http::header::{CONTENT_TYPE, HeaderName};
use axum::http::{Request, Response, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use http_body_util::BodyExt;
use retrysafe::idempotency::{IdempotencyLayer, MemoryStore, Principal};
use tokio::runtime::Runtime;
use tower::ServiceExt;
use tower::util::MapRequestLayer;

/// The handler's answer: 100 bytes of JSON.
const RESPONSE_JSON: &str = r#"{"id":"pay_0123456789abcde","status":"accepted","amount":1000,"currency":"EUR","created":1767225600}"#;

/// A 64-byte request body.
const REQUEST_JSON: &str = r#"{"amount":1000,"currency":"EUR","reference":"order-00000000042"}"#;

/// Another 64-byte request body, for `mismatch`.
const OTHER_JSON: &str = r#"{"amount":9999,"currency":"EUR","reference":"order-00000000042"}"#;

/// The largest frame of a streamed request body (hyper hands a body over in frames of
/// a few KiB to a few hundred KiB, depending on its read buffer).
const FRAME: usize = 16 * 1024;

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

async fn create() -> (StatusCode, [(HeaderName, &'static str); 1], &'static str) {
    (
        StatusCode::CREATED,
        [(CONTENT_TYPE, "application/json")],
        RESPONSE_JSON,
    )
}

/// The routes, with the authentication layer outermost and, if given, the
/// `IdempotencyLayer` inside it.
fn router(idempotency: Option<IdempotencyLayer>) -> Router {
    let routes = Router::new().route("/payments", post(create));
    let routes = match idempotency {
        Some(layer) => routes.layer(layer),
        None => routes,
    };
    let principal = Principal::new("tenant-1");
    routes.layer(MapRequestLayer::new(move |mut req: Request<Body>| {
        req.extensions_mut().insert(principal.clone());
        req
    }))
}

/// A router guarded by an `IdempotencyLayer` over a fresh `MemoryStore` (returned too).
fn guarded() -> (Router, MemoryStore) {
    let store = MemoryStore::new();
    (router(Some(IdempotencyLayer::new(store.clone()))), store)
}

/// A request body: `data` in frames of at most [`FRAME`] bytes (one frame when small).
fn body(data: &Bytes) -> Body {
    if data.len() <= FRAME {
        return Body::from(data.clone());
    }
    let frames: Vec<Result<Bytes, Infallible>> =
        data.chunks(FRAME).map(|c| Ok(data.slice_ref(c))).collect();
    Body::from_stream(futures_util::stream::iter(frames))
}

fn request(key: &str, data: &Bytes) -> Request<Body> {
    Request::post("/payments")
        .header(IDEMPOTENCY_KEY, key)
        .header(CONTENT_TYPE, "application/json")
        .body(body(data))
        .unwrap()
}

/// Sends one request and reads the whole response body.
async fn send(app: &Router, req: Request<Body>) -> (Response<()>, Bytes) {
    let res = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = res.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (Response::from_parts(parts, ()), body)
}

/// Keys that are new every time (`first`); used for `bare` too, so both build the same
/// requests.
fn fresh_key(counter: &AtomicU64) -> String {
    format!("k-{}", counter.fetch_add(1, Ordering::Relaxed))
}

fn check(res: &(Response<()>, Bytes), status: StatusCode, replayed: bool, case: &str) {
    let (head, body) = res;
    assert_eq!(head.status(), status, "{case}: status (body {body:?})");
    assert_eq!(
        head.headers().get(&REPLAYED).is_some_and(|v| v == "true"),
        replayed,
        "{case}: idempotent-replayed"
    );
    if status == StatusCode::CREATED {
        assert_eq!(body, RESPONSE_JSON.as_bytes(), "{case}: body");
    }
}

/// The most requests one `MemoryStore` takes in `first` before the bench starts a fresh
/// one (outside the timed part): 16 384 records of about 0.7 KB stay far below the
/// store's default 64 MiB, so nothing is evicted, however many iterations criterion asks
/// for (its warm-up doubles them up to hundreds of thousands).
const RECORDS_PER_STORE: u64 = 16 * 1024;

/// Runs `iters` requests with fresh keys, against a fresh guarded router every
/// [`RECORDS_PER_STORE`] requests, and times only the requests; checks that every
/// request stored its record.
async fn first_batch(iters: u64, counter: &AtomicU64, data: &Bytes) -> Duration {
    let mut elapsed = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(RECORDS_PER_STORE);
        left -= n;
        let (app, store) = guarded();
        let start = Instant::now();
        for _ in 0..n {
            black_box(send(&app, request(&fresh_key(counter), data)).await);
        }
        elapsed += start.elapsed();
        assert_eq!(store.in_flight_len(), 0, "first: claims left in flight");
        assert_eq!(store.cached_len(), n, "first: one record per request");
    }
    elapsed
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn cases(c: &mut Criterion) {
    let rt = runtime();
    let counter = AtomicU64::new(0);
    let request_body = Bytes::from_static(REQUEST_JSON.as_bytes());
    let other_body = Bytes::from_static(OTHER_JSON.as_bytes());
    assert_eq!((request_body.len(), other_body.len()), (64, 64));
    assert_eq!(RESPONSE_JSON.len(), 100);

    let bare = router(None);
    let (replaying, _store) = guarded();
    rt.block_on(async {
        let res = send(&bare, request(&fresh_key(&counter), &request_body)).await;
        check(&res, StatusCode::CREATED, false, "bare");
        let (app, store) = guarded();
        let res = send(&app, request(&fresh_key(&counter), &request_body)).await;
        check(&res, StatusCode::CREATED, false, "first");
        assert_eq!(store.cached_len(), 1, "first: record stored");

        let res = send(&replaying, request("completed", &request_body)).await;
        check(&res, StatusCode::CREATED, false, "replay setup");
        let res = send(&replaying, request("completed", &request_body)).await;
        check(&res, StatusCode::CREATED, true, "replay");
        let res = send(&replaying, request("completed", &other_body)).await;
        check(&res, StatusCode::UNPROCESSABLE_ENTITY, false, "mismatch");
    });

    let mut group = c.benchmark_group("idempotency");
    group.bench_function("bare", |b| {
        b.to_async(&rt)
            .iter(|| send(&bare, request(&fresh_key(&counter), &request_body)));
    });
    group.bench_function("first", |b| {
        b.to_async(&rt)
            .iter_custom(|iters| first_batch(iters, &counter, &request_body));
    });
    group.bench_function("replay", |b| {
        b.to_async(&rt)
            .iter(|| send(&replaying, request("completed", &request_body)));
    });
    group.bench_function("mismatch", |b| {
        b.to_async(&rt)
            .iter(|| send(&replaying, request("completed", &other_body)));
    });
    group.finish();
}

fn body_sizes(c: &mut Criterion) {
    let rt = runtime();
    let counter = AtomicU64::new(0);
    let bare = router(None);

    let mut group = c.benchmark_group("idempotency_body_size");
    for (label, size) in [
        ("64B", 64),
        ("4KiB", 4 << 10),
        ("64KiB", 64 << 10),
        ("1MiB", 1 << 20),
    ] {
        // JSON-ish bytes; the content does not matter to the layer.
        let data = Bytes::from(REQUEST_JSON.bytes().cycle().take(size).collect::<Vec<u8>>());
        rt.block_on(async {
            let res = send(&bare, request(&fresh_key(&counter), &data)).await;
            check(&res, StatusCode::CREATED, false, "bare");
            let (app, _store) = guarded();
            let key = fresh_key(&counter);
            let res = send(&app, request(&key, &data)).await;
            check(&res, StatusCode::CREATED, false, "first");
            let res = send(&app, request(&key, &data)).await;
            check(&res, StatusCode::CREATED, true, "first, its replay");
        });
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::new("bare", label), &data, |b, data| {
            b.to_async(&rt)
                .iter(|| send(&bare, request(&fresh_key(&counter), data)));
        });
        group.bench_with_input(BenchmarkId::new("first", label), &data, |b, data| {
            b.to_async(&rt)
                .iter_custom(|iters| first_batch(iters, &counter, data));
        });
    }
    group.finish();
}

criterion_group!(benches, cases, body_sizes);

/// `IDEMPOTENCY_BENCH_CASE=name IDEMPOTENCY_BENCH_CALLS=n` sends `n` requests of one
/// case (`bare`, `first`, `replay`) and exits, for `valgrind --tool=callgrind`, which
/// counts instructions, not time. Otherwise the criterion benches.
fn main() {
    if let (Ok(name), Ok(calls)) = (
        std::env::var("IDEMPOTENCY_BENCH_CASE"),
        std::env::var("IDEMPOTENCY_BENCH_CALLS"),
    ) {
        let calls: u64 = calls.parse().unwrap();
        let rt = runtime();
        let counter = AtomicU64::new(0);
        let body = Bytes::from_static(REQUEST_JSON.as_bytes());
        rt.block_on(async {
            let (app, _store) = guarded();
            let res = send(&app, request("completed", &body)).await;
            check(&res, StatusCode::CREATED, false, "replay setup");
            let app = match name.as_str() {
                "bare" => router(None),
                "first" | "replay" => app,
                other => panic!("unknown case {other}"),
            };
            for _ in 0..calls {
                let key = if name == "replay" {
                    "completed".to_owned()
                } else {
                    fresh_key(&counter)
                };
                black_box(send(&app, request(&key, &body)).await);
            }
        });
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
