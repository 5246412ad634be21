//! The performance target "`IdempotencyLayer` with `MemoryStore` ≥ 0.90× the bare server"
//! over loopback HTTP (keep-alive), measured in throughput.
//!
//! The **server runs in a child process** (this binary, re-run with
//! `IDEM_LOOPBACK_SERVE=1`) on a multi-thread tokio runtime with
//! `IDEM_LOOPBACK_WORKERS` workers (default 2, the cores of the machines here), so the
//! load driver does not share a runtime (or a run queue) with the server; the OS still
//! shares the cores between them. The child serves the same axum app twice, on two
//! ports: `bare` (an authentication layer inserting a `Principal`, then a POST handler
//! answering 201 with a 100-byte JSON body) and `guarded` (the same with
//! `IdempotencyLayer::new(MemoryStore::new())` between them).
//!
//! The driver (a current-thread runtime: one core at most) opens `C` hyper HTTP/1.1
//! keep-alive connections (`TCP_NODELAY`) and sends a fixed number of POSTs with a
//! 64-byte JSON body and an `idempotency-key` per connection, one at a time, for each
//! case:
//!
//! - `bare`: a new key per request, to the bare server;
//! - `first`: a new key per request, to the guarded server (claim, handler, complete);
//! - `replay`: every connection repeats its own completed key (the handler never runs).
//!
//! Every answer is checked (201, the handler's body, `idempotent-replayed` as due).
//! Each round runs every case at 1 and at `C` connections, in an order that rotates
//! every round, after a short untimed warm-up on the same connections. The report gives
//! per-case medians and quartiles of the rounds' throughputs and of the per-round ratios
//! to `bare`, with the load average and the CPU share other processes used.
//!
//! `IDEM_LOOPBACK_CALLGRIND=bare|first|replay` (or the hand guard's `hand`,
//! `hand_replay`, or the floor's `floor`, `floor_replay`,
//! `store`, `store_replay`: see `retrysafe_test_support::bench::idem_floor`) with
//! `IDEM_LOOPBACK_CALLS=N` instead runs one process (server runtime as above, the
//! client on the main thread) sending N requests on one connection after one warm-up
//! request, for `valgrind --tool=callgrind`: (instructions for N − instructions for 0)
//! / N is the cost of one request through client, loopback and server (see
//! `scripts/bench-idempotency-loopback`).
//!
//! `IDEM_LOOPBACK_SERVE=routes` serves one server with routes of the same handler,
//! `/bare`, `/guarded`, `/hand` (the guard a user would write with
//! `axum::middleware::from_fn`), `/axum_idempotent` (that crate with its moka session
//! store) and the floor's, for an outside load generator: `wrk`, driven by
//! `scripts/bench-idempotency-capacity`, which measures the server's CPU time per
//! request. `IDEM_LOOPBACK_STORE_MIB` sets the guarded store's byte budget in every
//! mode (with `IDEM_LOOPBACK_STORE_MIB=1`, `first` under callgrind runs with the store
//! shrinking records to tombstones and dropping tombstones).
//!
//! Settings: `IDEM_LOOPBACK_ROUNDS` (12), `IDEM_LOOPBACK_CONNS` (32),
//! `IDEM_LOOPBACK_REQUESTS` (per connection at `C` connections, 300),
//! `IDEM_LOOPBACK_SINGLE` (requests at 1 connection, 3000), `IDEM_LOOPBACK_WORKERS` (2).
//!
//! `cargo bench --bench idempotency_loopback`
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::cast_possible_truncation,
    missing_docs,
    unreachable_pub
)]

use std::error::Error;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::header::{CONTENT_TYPE, HOST, HeaderName};
use axum::http::{Request, StatusCode};
use axum::routing::{MethodRouter, post};
use axum::serve::ListenerExt;
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use retrysafe::idempotency::{IdempotencyLayer, MemoryStore, Principal};
use retrysafe_test_support::bench::hand_guard::{HandStore, hand_guard};
use retrysafe_test_support::bench::http1::{Sender, open_http};
use retrysafe_test_support::bench::idem_floor;
use retrysafe_test_support::bench::load::*;
use retrysafe_test_support::bench::recorder;
use ruts::store::moka::MokaStore;
use ruts::{CookieOptions, SessionLayer};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::util::MapRequestLayer;
use tower_cookies::CookieManagerLayer;

type BoxError = Box<dyn Error + Send + Sync>;
type Res<T> = Result<T, BoxError>;

/// The handler's answer: 100 bytes of JSON.
const RESPONSE_JSON: &str = r#"{"id":"pay_0123456789abcde","status":"accepted","amount":1000,"currency":"EUR","created":1767225600}"#;
/// A 64-byte request body.
const REQUEST_JSON: &str = r#"{"amount":1000,"currency":"EUR","reference":"order-00000000042"}"#;
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Untimed requests per connection before each timed case.
const WARMUP_PER_CONN: usize = 20;

fn main() -> Res<()> {
    recorder::install_if_asked();
    let workers = env_usize("IDEM_LOOPBACK_WORKERS", 2)?;
    match std::env::var("IDEM_LOOPBACK_SERVE").as_deref() {
        Ok("routes") => return serve_routes(workers),
        Ok(_) => return serve_child(workers),
        Err(_) => {}
    }
    if let Ok(case) = std::env::var("IDEM_LOOPBACK_CALLGRIND") {
        return callgrind(&case, env_usize("IDEM_LOOPBACK_CALLS", 0)?, workers);
    }
    drive(workers)
}

fn env_usize(name: &str, default: usize) -> Res<usize> {
    match std::env::var(name) {
        Ok(v) => Ok(v.parse().map_err(|e| format!("{name}={v}: {e}"))?),
        Err(_) => Ok(default),
    }
}

// ---------------------------------------------------------------------------------------
// The server
// ---------------------------------------------------------------------------------------

async fn create() -> (StatusCode, [(HeaderName, &'static str); 1], &'static str) {
    (
        StatusCode::CREATED,
        [(CONTENT_TYPE, "application/json")],
        RESPONSE_JSON,
    )
}

/// The same answer, from a handler that reads the request body first (as a handler
/// that parses its JSON would).
async fn create_reading(
    body: Bytes,
) -> (StatusCode, [(HeaderName, &'static str); 1], &'static str) {
    std::hint::black_box(body);
    create().await
}

/// The POST handler: `create`, or `create_reading` with `IDEM_LOOPBACK_READ_BODY`.
fn handler() -> MethodRouter {
    if std::env::var_os("IDEM_LOOPBACK_READ_BODY").is_some() {
        post(create_reading)
    } else {
        post(create)
    }
}

fn router(layer: Option<IdempotencyLayer>) -> Router {
    let routes = Router::new().route("/payments", handler());
    let routes = match layer {
        Some(layer) => routes.layer(layer),
        None => routes,
    };
    authenticated(routes)
}

/// The authentication layer of both servers: inserts the one tenant's `Principal`.
fn authenticated(routes: Router) -> Router {
    let principal = Principal::new("tenant-1");
    routes.layer(MapRequestLayer::new(move |mut req: Request<Body>| {
        req.extensions_mut().insert(principal.clone());
        req
    }))
}

async fn serve(router: Router) -> Res<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(addr)
}

fn server_runtime(workers: usize) -> Res<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()?)
}

/// Starts both servers on `runtime`; returns (bare, guarded).
fn start_servers(runtime: &tokio::runtime::Runtime) -> Res<(SocketAddr, SocketAddr)> {
    runtime.block_on(async {
        let bare = serve(router(None)).await?;
        let guarded = serve(router(Some(IdempotencyLayer::new(store()?)))).await?;
        Ok((bare, guarded))
    })
}

/// The floor's byte budget in MiB: `IDEM_LOOPBACK_STORE_MIB`, else the MemoryStore's
/// default (64).
fn store_mib() -> Res<usize> {
    Ok(match std::env::var("IDEM_LOOPBACK_STORE_MIB") {
        Ok(mib) => mib.parse()?,
        Err(_) => 64,
    })
}

/// The guarded server's store: `IDEM_LOOPBACK_STORE_MIB` sets its byte budget (default:
/// the MemoryStore's).
fn store() -> Res<MemoryStore> {
    Ok(match std::env::var("IDEM_LOOPBACK_STORE_MIB") {
        Ok(mib) => MemoryStore::new()
            .max_bytes(mib.parse::<u64>()? * 1024 * 1024)
            .build()?,
        Err(_) => MemoryStore::new(),
    })
}

/// One server with routes of the same handler: `/bare`, `/guarded` (behind
/// `IdempotencyLayer::new(MemoryStore::new())`), `/hand` (behind the hand-written guard),
/// `/axum_idempotent` (behind axum-idempotent) and the floor's, all behind the
/// authentication layer. For an outside load generator
/// (`scripts/bench-idempotency-capacity`): prints the address and the server's pid,
/// then runs until stdin closes.
fn serve_routes(workers: usize) -> Res<()> {
    let runtime = server_runtime(workers)?;
    let addr = runtime.block_on(async {
        let routes = Router::new()
            .route("/bare", handler())
            .route("/guarded", handler().layer(IdempotencyLayer::new(store()?)))
            .route("/hand", hand_route())
            .route("/axum_idempotent", axum_idempotent_route())
            .route("/floor", floor_route(false)?)
            .route("/floor_store", floor_route(true)?);
        serve(authenticated(routes)).await
    })?;
    println!("{addr} {}", std::process::id());
    std::io::stdout().flush()?;
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    Ok(())
}

/// The child: serve, print the two addresses, run until stdin closes (the driver died
/// or finished).
fn serve_child(workers: usize) -> Res<()> {
    let runtime = server_runtime(workers)?;
    let (bare, guarded) = start_servers(&runtime)?;
    println!("{bare} {guarded}");
    std::io::stdout().flush()?;
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The client
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Case {
    Bare,
    First,
    Replay,
}

impl Case {
    const ALL: [Case; 3] = [Case::Bare, Case::First, Case::Replay];

    fn name(self) -> &'static str {
        match self {
            Case::Bare => "bare",
            Case::First => "first",
            Case::Replay => "replay",
        }
    }

    fn parse(s: &str) -> Res<Case> {
        Case::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| format!("unknown case {s}: bare, first or replay").into())
    }
}

/// Sends one POST with `key` and checks the answer: 201 with the handler's body,
/// `idempotent-replayed: true` iff `replayed` is `Some(true)` (`None`: either).
async fn post_checked(sender: &mut Sender, key: &str, replayed: Option<bool>) -> Res<()> {
    let req = Request::post("/payments")
        .header(HOST, "127.0.0.1")
        .header(IDEMPOTENCY_KEY, key)
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from_static(REQUEST_JSON.as_bytes())))?;
    let exchange = async {
        sender.ready().await?;
        let res = sender.send_request(req).await?;
        let (parts, body) = res.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok::<_, BoxError>((parts, body))
    };
    let (parts, body) = tokio::time::timeout(REQUEST_TIMEOUT, exchange)
        .await
        .map_err(|_| "request timed out")??;
    if parts.status != StatusCode::CREATED || body != RESPONSE_JSON.as_bytes() {
        return Err(format!(
            "key {key}: status {}, body {:?}",
            parts.status,
            String::from_utf8_lossy(&body)
        )
        .into());
    }
    let was = parts.headers.get(&REPLAYED).is_some_and(|v| v == "true");
    if let Some(due) = replayed
        && due != was
    {
        return Err(format!("key {key}: replayed {was}, expected {due}").into());
    }
    Ok(())
}

/// Unique keys across the whole run (and across runs of the same server).
static KEYS: AtomicU64 = AtomicU64::new(0);

fn fresh_key() -> String {
    format!(
        "f-{}-{:012}",
        std::process::id(),
        KEYS.fetch_add(1, Ordering::Relaxed)
    )
}

fn replay_key(conn: usize) -> String {
    format!("r-{}-{conn}", std::process::id())
}

/// One connection's requests of `case`.
async fn requests(sender: &mut Sender, case: Case, conn: usize, n: usize) -> Res<()> {
    for _ in 0..n {
        match case {
            Case::Bare => post_checked(sender, &fresh_key(), None).await?,
            Case::First => post_checked(sender, &fresh_key(), Some(false)).await?,
            Case::Replay => post_checked(sender, &replay_key(conn), Some(true)).await?,
        }
    }
    Ok(())
}

/// `conns` connections to `addr`, warmed up, then `per_conn` requests each; returns
/// requests per second of the timed part.
async fn run_case(addr: SocketAddr, case: Case, conns: usize, per_conn: usize) -> Res<f64> {
    let mut senders = Vec::with_capacity(conns);
    for conn in 0..conns {
        let mut sender = open_http(addr).await?;
        if case == Case::Replay {
            // Completes the key, or replays it; the `first` runs may have evicted it.
            post_checked(&mut sender, &replay_key(conn), None).await?;
        }
        senders.push(sender);
    }
    let mut set = JoinSet::new();
    for (conn, mut sender) in senders.drain(..).enumerate() {
        set.spawn(async move {
            requests(&mut sender, case, conn, WARMUP_PER_CONN).await?;
            Ok::<_, BoxError>(sender)
        });
    }
    while let Some(s) = set.join_next().await {
        senders.push(s??);
    }
    // Connection order does not matter for the timed part; keep each sender's key.
    let started = Instant::now();
    let mut set = JoinSet::new();
    for (conn, mut sender) in senders.into_iter().enumerate() {
        set.spawn(async move { requests(&mut sender, case, conn, per_conn).await });
    }
    while let Some(done) = set.join_next().await {
        done??;
    }
    let secs = started.elapsed().as_secs_f64();
    Ok((conns * per_conn) as f64 / secs)
}

// ---------------------------------------------------------------------------------------
// Machine load
// ---------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------
// The driver
// ---------------------------------------------------------------------------------------

struct ServerChild {
    child: Child,
    bare: SocketAddr,
    guarded: SocketAddr,
}

impl ServerChild {
    fn start(workers: usize) -> Res<Self> {
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .env("IDEM_LOOPBACK_SERVE", "1")
            .env("IDEM_LOOPBACK_WORKERS", workers.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let mut addrs = line.split_whitespace().map(str::parse::<SocketAddr>);
        let (Some(Ok(bare)), Some(Ok(guarded))) = (addrs.next(), addrs.next()) else {
            let _ = child.kill();
            return Err(format!("server child said {line:?}").into());
        };
        Ok(ServerChild {
            child,
            bare,
            guarded,
        })
    }
}

impl Drop for ServerChild {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

fn quartiles(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let at = |q: f64| {
        let pos = q * (s.len() - 1) as f64;
        let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
        s[lo] + (s[hi] - s[lo]) * (pos - lo as f64)
    };
    (at(0.25), at(0.5), at(0.75))
}

fn drive(workers: usize) -> Res<()> {
    let rounds = env_usize("IDEM_LOOPBACK_ROUNDS", 12)?;
    let conns = env_usize("IDEM_LOOPBACK_CONNS", 32)?;
    let per_conn = env_usize("IDEM_LOOPBACK_REQUESTS", 300)?;
    let single = env_usize("IDEM_LOOPBACK_SINGLE", 3000)?;
    if rounds == 0 || conns == 0 || per_conn == 0 || single == 0 {
        return Err("IDEM_LOOPBACK_ROUNDS, _CONNS, _REQUESTS and _SINGLE must be > 0".into());
    }
    let server = ServerChild::start(workers)?;
    let pids = [std::process::id(), server.child.id()];
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    eprintln!(
        "server: child pid {} ({workers} workers), bare {} guarded {}; load average {}",
        server.child.id(),
        server.bare,
        server.guarded,
        loadavg()
    );
    let shapes = [(1, single), (conns, per_conn)];
    // results[shape][case]: req/s per round; ratios likewise (case / bare).
    let mut rps = vec![vec![Vec::new(); Case::ALL.len()]; shapes.len()];
    let mut foreign_pct = Vec::new();
    for round in 0..rounds {
        let load = loadavg();
        let c0 = ticks(&pids);
        for (s, &(c, n)) in shapes.iter().enumerate() {
            let mut line = format!("round {:2} conns {c:2}:", round + 1);
            for i in 0..Case::ALL.len() {
                let case = Case::ALL[(i + round) % Case::ALL.len()];
                let addr = if case == Case::Bare {
                    server.bare
                } else {
                    server.guarded
                };
                let r = runtime.block_on(run_case(addr, case, c, n))?;
                rps[s][case as usize].push(r);
                line.push_str(&format!(" {} {r:.0}", case.name()));
            }
            eprintln!("{line}");
        }
        let other = others(c0, ticks(&pids), 0);
        foreign_pct.push(other);
        eprintln!(
            "round {:2}: load average {load}, other processes {other:.0} %",
            round + 1
        );
    }
    println!(
        "\n{rounds} rounds, server {workers} workers; other processes' CPU share per round: {}",
        foreign_pct
            .iter()
            .map(|p| format!("{p:.0}"))
            .collect::<Vec<_>>()
            .join(" / ")
            + " %"
    );
    println!();
    println!("| conns | case | req/s median | IQR (q1–q3) | ratio to bare, median | ratio IQR |");
    println!("|---|---|---|---|---|---|");
    for (s, &(c, n)) in shapes.iter().enumerate() {
        for case in Case::ALL {
            let v = &rps[s][case as usize];
            let (q1, med, q3) = quartiles(v);
            let ratios: Vec<f64> = v
                .iter()
                .zip(&rps[s][Case::Bare as usize])
                .map(|(x, b)| x / b)
                .collect();
            let (r1, rm, r3) = quartiles(&ratios);
            println!(
                "| {c} ({} req) | {} | {med:.0} | {q1:.0}–{q3:.0} | {rm:.3} | {r1:.3}–{r3:.3} |",
                c * n,
                case.name()
            );
        }
    }
    drop(server);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Instruction counts
// ---------------------------------------------------------------------------------------

fn callgrind(case: &str, calls: usize, workers: usize) -> Res<()> {
    // The floor's cases (`floor`, `floor_replay`, `store`, `store_replay`) run the
    // `first` and `replay` requests against a server guarded by the floor instead.
    let (floor, case) = match case {
        "floor" => (Some(Some(false)), Case::First),
        "floor_replay" => (Some(Some(false)), Case::Replay),
        "store" => (Some(Some(true)), Case::First),
        "store_replay" => (Some(Some(true)), Case::Replay),
        "hand" => (Some(None), Case::First),
        "hand_replay" => (Some(None), Case::Replay),
        other => (None, Case::parse(other)?),
    };
    let server = server_runtime(workers)?;
    let addr = match floor {
        Some(Some(store)) => server.block_on(async { serve(floor_router(store)?).await })?,
        Some(None) => server.block_on(async {
            serve(authenticated(
                Router::new().route("/payments", hand_route()),
            ))
            .await
        })?,
        None => {
            let (bare, guarded) = start_servers(&server)?;
            if case == Case::Bare { bare } else { guarded }
        }
    };
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    client.block_on(async {
        let mut sender = open_http(addr).await?;
        post_checked(&mut sender, &replay_key(0), None).await?;
        requests(&mut sender, case, 0, calls).await
    })?;
    drop(client);
    server.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

/// The handler behind the floor's guard, at `/payments`.
fn floor_router(store: bool) -> Res<Router> {
    Ok(authenticated(
        Router::new().route("/payments", floor_route(store)?),
    ))
}

/// The handler behind the floor's guard: over its own map, or over a `MemoryStore`
/// (`store`).
fn floor_route(store: bool) -> Res<MethodRouter> {
    let layer = if store {
        idem_floor::FloorLayer::with_store(self::store()?)
    } else {
        idem_floor::FloorLayer::new(store_mib()? * 1024 * 1024)
    };
    Ok(handler().layer(layer))
}

/// The handler behind the guard a user would write with `axum::middleware::from_fn`
/// (`retrysafe_test_support::bench::hand_guard`).
fn hand_route() -> MethodRouter {
    handler().layer(axum::middleware::from_fn_with_state(
        HandStore::default(),
        hand_guard,
    ))
}

/// The handler behind axum-idempotent 0.6 set up as its README shows: `IdempotentLayer`
/// in direct-key mode on `Idempotency-Key` (required), responses kept 5 minutes, inside
/// ruts' `SessionLayer` over a `MokaStore` (its defaults: 10,000 sessions) and
/// tower-cookies' `CookieManagerLayer`; its replay header renamed to the one the load
/// generator checks.
///
/// What it does and does not do, by its README and source: best effort — two
/// concurrent copies both run the handler, a request without a session cookie is not
/// guarded; the key is not checked against the request (no 422 for another body); the
/// response (head and body) is serialized into the caller's session, so a key is
/// scoped by session, and every store sweeps that session's expired responses.
fn axum_idempotent_route() -> MethodRouter {
    let options = IdempotentOptions::default()
        .use_idempotency_key_header(Some("Idempotency-Key"), true)
        .expire_after(60 * 5)
        .replay_header_name("idempotent-replayed");
    let sessions = SessionLayer::new(Arc::new(MokaStore::builder().build()))
        .with_cookie_options(CookieOptions::build().name("session"));
    handler().layer(
        tower::ServiceBuilder::new()
            .layer(CookieManagerLayer::new())
            .layer(sessions)
            .layer(IdempotentLayer::<MokaStore>::new(options)),
    )
}
