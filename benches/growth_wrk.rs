//! Costs that grow with work: the ceiling of the machine for a bare axum server,
//! measured with `wrk` next to our own load driver.
//!
//! **`wrk`**: a child process (`GROWTH_MODE=serve`, multi-thread runtime with
//! `GROWTH_WORKERS` = 2 workers) serves the bare app of
//! `benches/idempotency_loopback.rs` (an authentication layer inserting a `Principal`,
//! then POST `/payments` answering 201 with a 100-byte JSON body). Each round runs, for
//! each connection count of `GROWTH_WRK_CONNS` ("32 1"), `wrk -t1 -c<C> -d<D>s
//! --latency` (POST with the same 64-byte JSON body and headers) and this binary's
//! own driver (the bare case of `benches/idempotency_loopback.rs`: a current-thread
//! runtime, C hyper HTTP/1.1 keep-alive connections, one request at a time per
//! connection, every answer checked) for the same D seconds, against the same server
//! process; which of the two goes first alternates every round. Settings:
//! `GROWTH_WRK_ROUNDS` (3), `GROWTH_WRK_SECS` (10), `GROWTH_WRK_CONNS`, `GROWTH_WRK`
//! (the wrk binary, `wrk`).
//!
//! `scripts/bench-growth wrk`, or `cargo bench --bench growth_wrk` (`wrk` installed).
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout, // the rounds modes print their tables
    clippy::cast_possible_truncation,
    missing_docs,
    unreachable_pub
)]

use std::error::Error;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body as AxumBody;
use axum::http::HeaderName;
use axum::http::header::{CONTENT_TYPE, HOST};
use axum::routing::post;
use axum::serve::ListenerExt;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use http_body_util::Full;
use retrysafe::idempotency::Principal;
use retrysafe_test_support::bench::http1::{Sender, open_http};
use retrysafe_test_support::bench::load::*;
use retrysafe_test_support::bench::report::{env_or, grouped, median, min_max};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::util::MapRequestLayer;

type BoxError = Box<dyn Error + Send + Sync>;
type Res<T> = Result<T, BoxError>;

fn main() -> Res<()> {
    match std::env::var("GROWTH_MODE").as_deref() {
        Ok("serve") => serve_child(),
        _ => run(),
    }
}

/// The handler's answer: 100 bytes of JSON (as in `benches/idempotency_loopback.rs`).
const RESPONSE_JSON: &str = r#"{"id":"pay_0123456789abcde","status":"accepted","amount":1000,"currency":"EUR","created":1767225600}"#;
/// A 64-byte request body.
const REQUEST_JSON: &str = r#"{"amount":1000,"currency":"EUR","reference":"order-00000000042"}"#;
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// Untimed requests per connection before the timed part (as the loopback bench).
const WARMUP_PER_CONN: usize = 20;

async fn create() -> (StatusCode, [(HeaderName, &'static str); 1], &'static str) {
    (
        StatusCode::CREATED,
        [(CONTENT_TYPE, "application/json")],
        RESPONSE_JSON,
    )
}

/// The bare app of `benches/idempotency_loopback.rs`.
fn router() -> Router {
    let principal = Principal::new("tenant-1");
    Router::new()
        .route("/payments", post(create))
        .layer(MapRequestLayer::new(move |mut req: Request<AxumBody>| {
            req.extensions_mut().insert(principal.clone());
            req
        }))
}

/// The child: serve the bare app, print its address, run until stdin closes.
fn serve_child() -> Res<()> {
    let workers: usize = env_or("GROWTH_WORKERS", 2)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()?;
    let addr = runtime.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        tokio::spawn(async move {
            let _ = axum::serve(listener, router()).await;
        });
        Ok::<_, BoxError>(addr)
    })?;
    println!("{addr}");
    std::io::stdout().flush()?;
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    Ok(())
}

struct ServerChild {
    child: Child,
    addr: SocketAddr,
}

impl ServerChild {
    fn start(workers: usize) -> Res<Self> {
        let mut child = Command::new(std::env::current_exe()?)
            .env("GROWTH_MODE", "serve")
            .env("GROWTH_WORKERS", workers.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        match line.trim().parse() {
            Ok(addr) => Ok(ServerChild { child, addr }),
            Err(_) => {
                let _ = child.kill();
                Err(format!("server child said {line:?}").into())
            }
        }
    }
}

impl Drop for ServerChild {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// What one run saw.
#[derive(Clone, Copy, Default)]
struct Run {
    rps: f64,
    /// p50, p75, p90, p99 in µs.
    latency: [f64; 4],
    other: f64,
}

// ---- wrk ----

fn wrk_script() -> Res<std::path::PathBuf> {
    let path = std::env::temp_dir().join(format!("growth-wrk-{}.lua", std::process::id()));
    // The same request as the driver's: POST, the 64-byte JSON body, content-type,
    // and an idempotency key of the same length as the driver's keys (the bare
    // server ignores it).
    let key = format!("f-{}-{:012}", std::process::id(), 0);
    std::fs::write(
        &path,
        format!(
            "wrk.method = \"POST\"\nwrk.body = '{REQUEST_JSON}'\n\
             wrk.headers[\"Content-Type\"] = \"application/json\"\n\
             wrk.headers[\"Idempotency-Key\"] = \"{key}\"\n"
        ),
    )?;
    Ok(path)
}

/// `450.00us`, `1.20ms`, `2.00s` in µs.
fn duration_us(s: &str) -> Option<f64> {
    let split = s.find(|c: char| c.is_ascii_alphabetic())?;
    let (n, unit) = s.split_at(split);
    let n: f64 = n.parse().ok()?;
    Some(match unit {
        "us" => n,
        "ms" => n * 1e3,
        "s" => n * 1e6,
        "m" => n * 60e6,
        _ => return None,
    })
}

fn parse_wrk(out: &str) -> Res<(f64, [f64; 4])> {
    if out.contains("Non-2xx") || out.contains("Socket errors") {
        return Err(format!("wrk saw errors:\n{out}").into());
    }
    let mut rps = None;
    let mut latency = [f64::NAN; 4];
    for line in out.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words[..] {
            ["Requests/sec:", n] => rps = n.parse().ok(),
            [p, d] if p.ends_with('%') => {
                let i = match p {
                    "50%" => 0,
                    "75%" => 1,
                    "90%" => 2,
                    "99%" => 3,
                    _ => continue,
                };
                latency[i] = duration_us(d).ok_or_else(|| format!("latency {d:?}"))?;
            }
            _ => {}
        }
    }
    Ok((
        rps.ok_or_else(|| format!("no Requests/sec in:\n{out}"))?,
        latency,
    ))
}

fn run_wrk(
    wrk: &str,
    script: &std::path::Path,
    addr: SocketAddr,
    conns: usize,
    secs: u64,
    server: u32,
) -> Res<Run> {
    let me = std::process::id();
    let before = ticks(&[me, server]);
    let mut child = Command::new(wrk)
        .args([
            "-t1",
            &format!("-c{conns}"),
            &format!("-d{secs}s"),
            "--latency",
        ])
        .arg("-s")
        .arg(script)
        .arg(format!("http://{addr}/payments"))
        .stdout(Stdio::piped())
        .spawn()?;
    // wrk's own CPU time, sampled while it runs (it is not in the ticks once it has
    // exited); the last sample misses at most 100 ms of it.
    let pid = child.id();
    let mut wrk_ticks = 0;
    while child.try_wait()?.is_none() {
        if let Some(t) = process_ticks(pid) {
            wrk_ticks = t;
        }
        pause(Duration::from_millis(100));
    }
    let after = ticks(&[me, server]);
    let mut out = String::new();
    child
        .stdout
        .take()
        .ok_or("no stdout")?
        .read_to_string(&mut out)?;
    let (rps, latency) = parse_wrk(&out)?;
    Ok(Run {
        rps,
        latency,
        other: others(before, after, wrk_ticks),
    })
}

// ---- our driver: the bare case of benches/idempotency_loopback.rs ----

static KEYS: AtomicU64 = AtomicU64::new(0);

fn fresh_key() -> String {
    format!(
        "f-{}-{:012}",
        std::process::id(),
        KEYS.fetch_add(1, Ordering::Relaxed)
    )
}

/// One POST with a new key, answer checked (201 and the handler's body), as
/// `post_checked` of the loopback bench does for its bare case.
async fn post_one(sender: &mut Sender) -> Res<()> {
    let key = fresh_key();
    let req = Request::post("/payments")
        .header(HOST, "127.0.0.1")
        .header(IDEMPOTENCY_KEY, &key)
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from_static(REQUEST_JSON.as_bytes())))?;
    sender.ready().await?;
    let res = sender.send_request(req).await?;
    let (parts, body) = res.into_parts();
    let body = body.collect().await?.to_bytes();
    if parts.status != StatusCode::CREATED || body != RESPONSE_JSON.as_bytes() {
        return Err(format!("key {key}: status {}", parts.status).into());
    }
    Ok(())
}

async fn drive(addr: SocketAddr, conns: usize, secs: u64) -> Res<(usize, f64, Vec<u32>)> {
    let mut senders = Vec::with_capacity(conns);
    for _ in 0..conns {
        senders.push(open_http(addr).await?);
    }
    let mut set = JoinSet::new();
    for mut sender in senders.drain(..) {
        set.spawn(async move {
            for _ in 0..WARMUP_PER_CONN {
                post_one(&mut sender).await?;
            }
            Ok::<_, BoxError>(sender)
        });
    }
    while let Some(s) = set.join_next().await {
        senders.push(s??);
    }
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let mut set = JoinSet::new();
    for mut sender in senders {
        set.spawn(async move {
            let mut latencies: Vec<u32> = Vec::with_capacity(1 << 16);
            loop {
                let t0 = Instant::now();
                if t0 >= deadline {
                    return Ok::<_, BoxError>(latencies);
                }
                post_one(&mut sender).await?;
                latencies.push(t0.elapsed().as_nanos().min(u128::from(u32::MAX)) as u32);
            }
        });
    }
    let mut all = Vec::new();
    while let Some(done) = set.join_next().await {
        all.extend(done??);
    }
    let secs = started.elapsed().as_secs_f64();
    Ok((all.len(), secs, all))
}

fn run_driver(addr: SocketAddr, conns: usize, secs: u64, server: u32) -> Res<Run> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let pids = [std::process::id(), server];
    let before = ticks(&pids);
    let (n, took, mut lat) = runtime.block_on(drive(addr, conns, secs))?;
    let after = ticks(&pids);
    lat.sort_unstable();
    let at = |q: f64| {
        let i = ((lat.len() as f64 * q).ceil() as usize).clamp(1, lat.len()) - 1;
        f64::from(lat[i]) / 1e3
    };
    Ok(Run {
        rps: n as f64 / took,
        latency: [at(0.50), at(0.75), at(0.90), at(0.99)],
        other: others(before, after, 0),
    })
}

fn run() -> Res<()> {
    let rounds: usize = env_or("GROWTH_WRK_ROUNDS", 3)?;
    let secs: u64 = env_or("GROWTH_WRK_SECS", 10)?;
    let workers: usize = env_or("GROWTH_WORKERS", 2)?;
    let wrk = std::env::var("GROWTH_WRK").unwrap_or_else(|_| "wrk".to_owned());
    let conns: Vec<usize> = std::env::var("GROWTH_WRK_CONNS")
        .unwrap_or_else(|_| "32 1".to_owned())
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let version = Command::new(&wrk)
        .arg("-v")
        .output()
        .map_err(|e| format!("{wrk}: {e} (apt-get install -y wrk)"))?;
    let version = String::from_utf8_lossy(&version.stdout)
        .lines()
        .next()
        .map(str::to_owned);
    let script = wrk_script()?;
    let server = ServerChild::start(workers)?;
    let spid = server.child.id();
    eprintln!(
        "server: child pid {spid} ({workers} workers) at {}; {}; load average {}",
        server.addr,
        version.as_deref().unwrap_or("wrk ?"),
        loadavg()
    );
    // runs[conns][tool] (tool 0 = wrk, 1 = driver)
    let mut runs = vec![[Vec::new(), Vec::new()]; conns.len()];
    for round in 0..rounds {
        for (ci, &c) in conns.iter().enumerate() {
            for k in 0..2 {
                let tool = (k + round) % 2;
                let load = loadavg();
                let r = if tool == 0 {
                    run_wrk(&wrk, &script, server.addr, c, secs, spid)?
                } else {
                    run_driver(server.addr, c, secs, spid)?
                };
                eprintln!(
                    "round {} conns {c:2} {:6}: {:.0} req/s, \
                     p50/75/90/99 {:.0}/{:.0}/{:.0}/{:.0} µs; \
                     load average {load}, other processes {:.0} %",
                    round + 1,
                    ["wrk", "driver"][tool],
                    r.rps,
                    r.latency[0],
                    r.latency[1],
                    r.latency[2],
                    r.latency[3],
                    r.other
                );
                runs[ci][tool].push(r);
            }
        }
    }
    drop(server);
    let _ = std::fs::remove_file(&script);

    println!(
        "\n{rounds} rounds of {secs} s per tool and connection count; load average now {}\n",
        loadavg()
    );
    println!(
        "| conns | load driver | req/s median (min–max) | p50 µs | p75 µs | p90 µs | p99 µs | \
         driver ÷ wrk, per round | other processes % |"
    );
    println!("|---:|---|---|---|---|---|---|---|---|");
    for (ci, &c) in conns.iter().enumerate() {
        for tool in 0..2 {
            let v = &runs[ci][tool];
            let rps: Vec<f64> = v.iter().map(|r| r.rps).collect();
            let (lo, hi) = min_max(&rps);
            let lat = |i: usize| {
                let l: Vec<f64> = v.iter().map(|r| r.latency[i]).collect();
                let (a, b) = min_max(&l);
                format!("{:.0} ({a:.0}–{b:.0})", median(&l))
            };
            let ratio = if tool == 1 {
                let r: Vec<f64> = runs[ci][1]
                    .iter()
                    .zip(&runs[ci][0])
                    .map(|(d, w)| d.rps / w.rps)
                    .collect();
                let (a, b) = min_max(&r);
                format!("{:.3} ({a:.3}–{b:.3})", median(&r))
            } else {
                "—".to_owned()
            };
            let other: Vec<String> = v.iter().map(|r| format!("{:.0}", r.other)).collect();
            println!(
                "| {c} | {} | {} ({}–{}) | {} | {} | {} | {} | {ratio} | {} |",
                ["`wrk -t1`", "our driver"][tool],
                grouped(median(&rps)),
                grouped(lo),
                grouped(hi),
                lat(0),
                lat(1),
                lat(2),
                lat(3),
                other.join(" / ")
            );
        }
    }
    Ok(())
}
