//! A fault-injecting HTTP/1.1 TCP proxy for tests and load drivers (loopback only).
//!
//! [`FaultProxy::start`] listens on `127.0.0.1:0` and forwards to one upstream. It
//! understands just enough HTTP/1.1 to find where each request and each response ends
//! (`content-length` or `chunked` bodies, bodiless statuses), so it chooses a fault
//! **per request**, also on keep-alive connections: a pooled client connection carries
//! many requests, and a per-connection choice would be too coarse (a "pass" connection
//! would carry hundreds of clean requests). A fault that breaks the connection ends it;
//! `pass` and `delay` keep it open for the next request. A message it cannot frame
//! (neither `content-length` nor `chunked` on a request with a body, or over 4 MiB)
//! makes it fall back to a plain byte copy for the rest of that connection (counted as
//! `unframed`).
//!
//! The faults ([`Fault`]), drawn from a weighted [`FaultMix`] by a seeded RNG (one
//! stream per connection, derived from the seed and the connection's accept number):
//!
//! | fault | what the proxy does | did the server see the request? |
//! |---|---|---|
//! | `pass` | forwards both ways | yes |
//! | `delay` | sleeps up to `max_delay` before forwarding the request, before forwarding the response, or both | yes |
//! | `reset_before_request` | reads the request, then resets the client (RST: `SO_LINGER` 0, then close) | no |
//! | `reset_after_request` | forwards the request, then resets the client at once and closes the upstream connection | yes (it may or may not commit) |
//! | `lose_response` | forwards the request, waits for the whole response, then resets the client instead of forwarding it | yes (it answered) |
//! | `cut_mid_body` | forwards a random strict prefix of the response (anywhere in the head or the body), then resets the client | yes (it answered) |
//! | `half_close_client` | forwards the request, then shuts down its write side toward the client (the client reads EOF where the response should be); drains the response | yes |
//! | `half_close_server` | forwards the request, then shuts down its write side toward the server (the server reads EOF after the request), forwards whatever comes back, and closes | yes |
//! | `black_hole` | reads the request, never forwards it, never answers, keeps the client socket open (until the client closes it, or `black_hole_hold`) | no |
//!
//! Every connection and fault is counted ([`ProxyStats`]).
// Test support: panics on broken invariants of the test itself are fine, and the
// slicing below is bounds-checked by the framing logic.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    dead_code,
    unreachable_pub,
    missing_docs
)]

pub mod client;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The largest message the proxy frames; a larger one makes it fall back to a copy.
const MAX_MESSAGE: usize = 4 << 20;

/// One fault, chosen per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    Pass,
    Delay,
    ResetBeforeRequest,
    ResetAfterRequest,
    LoseResponse,
    CutMidBody,
    HalfCloseClient,
    HalfCloseServer,
    BlackHole,
}

impl Fault {
    /// Every fault, in a fixed order (the index of [`ProxyStats::faults`]).
    pub const ALL: [Fault; 9] = [
        Fault::Pass,
        Fault::Delay,
        Fault::ResetBeforeRequest,
        Fault::ResetAfterRequest,
        Fault::LoseResponse,
        Fault::CutMidBody,
        Fault::HalfCloseClient,
        Fault::HalfCloseServer,
        Fault::BlackHole,
    ];

    /// The snake_case name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Fault::Pass => "pass",
            Fault::Delay => "delay",
            Fault::ResetBeforeRequest => "reset_before_request",
            Fault::ResetAfterRequest => "reset_after_request",
            Fault::LoseResponse => "lose_response",
            Fault::CutMidBody => "cut_mid_body",
            Fault::HalfCloseClient => "half_close_client",
            Fault::HalfCloseServer => "half_close_server",
            Fault::BlackHole => "black_hole",
        }
    }

    fn index(self) -> usize {
        Fault::ALL.iter().position(|f| *f == self).unwrap()
    }
}

/// Weights of the faults; a request gets fault `f` with probability
/// `weight(f) / sum of weights`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultMix {
    weights: [u32; 9],
}

impl FaultMix {
    /// Every request passes.
    pub fn none() -> FaultMix {
        FaultMix::none_but(Fault::Pass, 1)
    }

    /// Only `fault`, with weight `w` (then add others with [`with`](Self::with)).
    pub fn none_but(fault: Fault, w: u32) -> FaultMix {
        FaultMix { weights: [0; 9] }.with(fault, w)
    }

    /// Sets the weight of `fault`.
    pub fn with(mut self, fault: Fault, w: u32) -> FaultMix {
        self.weights[fault.index()] = w;
        self
    }

    /// The default mix, in per mille: 700 pass, 100 delay, and 25 each of the seven
    /// breaking faults (175 ‰ of requests broken one way or another).
    pub fn standard() -> FaultMix {
        FaultMix {
            weights: [700, 100, 25, 25, 25, 25, 25, 25, 25],
        }
    }

    /// The weight of `fault`.
    pub fn weight(&self, fault: Fault) -> u32 {
        self.weights[fault.index()]
    }

    fn pick(&self, rng: &mut SplitMix64) -> Fault {
        let total: u64 = self.weights.iter().map(|w| u64::from(*w)).sum();
        if total == 0 {
            return Fault::Pass;
        }
        let mut roll = rng.below(total);
        for (fault, w) in Fault::ALL.iter().zip(self.weights) {
            if roll < u64::from(w) {
                return *fault;
            }
            roll -= u64::from(w);
        }
        Fault::Pass
    }
}

/// How a [`FaultProxy`] behaves.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub mix: FaultMix,
    /// The seed of the fault choices.
    pub seed: u64,
    /// The longest `delay` (uniform from 0).
    pub max_delay: Duration,
    /// How long a black-holed connection is held at most.
    pub black_hole_hold: Duration,
}

impl ProxyConfig {
    pub fn new(mix: FaultMix, seed: u64) -> ProxyConfig {
        ProxyConfig {
            mix,
            seed,
            max_delay: Duration::from_millis(50),
            black_hole_hold: Duration::from_secs(30),
        }
    }
}

/// A seed from the environment variable `var` when set (decimal or `0x` hex), else a
/// fresh one from the wall clock; printed either way so a run can be repeated.
pub fn seed_from_env(var: &str) -> u64 {
    let seed = std::env::var(var)
        .ok()
        .and_then(|v| {
            let v = v.trim();
            match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).ok(),
                None => v.parse().ok(),
            }
        })
        .unwrap_or_else(|| {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            SplitMix64::new(nanos ^ u64::from(std::process::id())).next_u64()
        });
    eprintln!("{var}={seed} (set {var} to repeat this run)");
    seed
}

/// A small seeded RNG (SplitMix64): no dependency, good enough to pick faults.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`; the modulo bias is irrelevant here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// True with probability `per_mille / 1000`.
    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }

    fn duration_up_to(&mut self, max: Duration) -> Duration {
        let micros = max.as_micros() as u64;
        Duration::from_micros(self.below(micros + 1))
    }
}

/// Counters of a [`FaultProxy`].
#[derive(Debug, Default)]
struct Counters {
    connections: AtomicU64,
    requests: AtomicU64,
    faults: [AtomicU64; 9],
    upstream_connect_failures: AtomicU64,
    unframed: AtomicU64,
}

/// A snapshot of what a [`FaultProxy`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Client connections accepted.
    pub connections: u64,
    /// Requests read (each got one fault).
    pub requests: u64,
    /// Requests per fault, indexed like [`Fault::ALL`].
    pub faults: [u64; 9],
    /// Upstream connections that could not be opened.
    pub upstream_connect_failures: u64,
    /// Connections that fell back to a plain copy.
    pub unframed: u64,
}

impl ProxyStats {
    /// Requests that got `fault`.
    pub fn count(&self, fault: Fault) -> u64 {
        self.faults[fault.index()]
    }

    /// The per-fault counts as a JSON object `{"pass": n, …}`.
    pub fn faults_json(&self) -> String {
        let fields: Vec<String> = Fault::ALL
            .iter()
            .map(|f| format!("\"{}\":{}", f.name(), self.count(*f)))
            .collect();
        format!("{{{}}}", fields.join(","))
    }

    /// Adds `other`'s counts to this one.
    pub fn add(&mut self, other: &ProxyStats) {
        self.connections += other.connections;
        self.requests += other.requests;
        for (a, b) in self.faults.iter_mut().zip(other.faults) {
            *a += b;
        }
        self.upstream_connect_failures += other.upstream_connect_failures;
        self.unframed += other.unframed;
    }
}

/// A running proxy; its accept loop stops when dropped (connections in progress end
/// on their own: each is bounded by its peers or by `black_hole_hold`).
#[derive(Debug)]
pub struct FaultProxy {
    /// Where clients connect.
    pub addr: SocketAddr,
    counters: Arc<Counters>,
    accept: JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl FaultProxy {
    /// A proxy on `127.0.0.1:0` in front of `upstream`.
    pub async fn start(upstream: SocketAddr, config: ProxyConfig) -> std::io::Result<FaultProxy> {
        assert!(
            upstream.ip().is_loopback(),
            "the fault proxy is for loopback upstreams only"
        );
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let counters = Arc::new(Counters::default());
        let config = Arc::new(config);
        let c = Arc::clone(&counters);
        let accept = tokio::spawn(async move {
            let mut n: u64 = 0;
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    // Out of descriptors or similar: back off a little.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                };
                n += 1;
                c.connections.fetch_add(1, Ordering::Relaxed);
                let rng = SplitMix64::new(config.seed ^ n.wrapping_mul(0xA076_1D64_78BD_642F));
                let (config, c) = (Arc::clone(&config), Arc::clone(&c));
                tokio::spawn(async move {
                    let _ = client.set_nodelay(true);
                    Conn {
                        client: Some(client),
                        cbuf: Vec::new(),
                        server: None,
                        sbuf: Vec::new(),
                        upstream,
                        config,
                        counters: c,
                        rng,
                    }
                    .run()
                    .await;
                });
            }
        });
        Ok(FaultProxy {
            addr,
            counters,
            accept,
        })
    }

    /// What the proxy did so far.
    pub fn stats(&self) -> ProxyStats {
        let c = &self.counters;
        let mut faults = [0u64; 9];
        for (out, n) in faults.iter_mut().zip(&c.faults) {
            *out = n.load(Ordering::Relaxed);
        }
        ProxyStats {
            connections: c.connections.load(Ordering::Relaxed),
            requests: c.requests.load(Ordering::Relaxed),
            faults,
            upstream_connect_failures: c.upstream_connect_failures.load(Ordering::Relaxed),
            unframed: c.unframed.load(Ordering::Relaxed),
        }
    }
}

/// Resets `stream`: `SO_LINGER` 0, then close, so the peer gets an RST, not a FIN.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

/// Why a message could not be read.
enum ReadError {
    /// The connection ended or failed.
    Io,
    /// The proxy cannot find where the message ends.
    Unframed,
}

/// One proxied client connection.
struct Conn {
    /// `None` once reset.
    client: Option<TcpStream>,
    /// Bytes read from the client and not forwarded yet.
    cbuf: Vec<u8>,
    server: Option<TcpStream>,
    /// Bytes read from the server and not forwarded yet.
    sbuf: Vec<u8>,
    upstream: SocketAddr,
    config: Arc<ProxyConfig>,
    counters: Arc<Counters>,
    rng: SplitMix64,
}

impl Conn {
    async fn run(mut self) {
        loop {
            let request =
                match read_message(self.client.as_mut().unwrap(), &mut self.cbuf, None).await {
                    Ok(Some(m)) => m,
                    Ok(None) | Err(ReadError::Io) => return,
                    Err(ReadError::Unframed) => return self.copy_rest().await,
                };
            self.counters.requests.fetch_add(1, Ordering::Relaxed);
            let fault = self.config.mix.pick(&mut self.rng);
            self.counters.faults[fault.index()].fetch_add(1, Ordering::Relaxed);
            let keep_going = self.serve(request, fault).await;
            if !keep_going {
                return;
            }
        }
    }

    /// Serves one request with `fault`; whether the connection goes on.
    async fn serve(&mut self, request: Vec<u8>, fault: Fault) -> bool {
        match fault {
            Fault::ResetBeforeRequest => {
                self.reset_client();
                return false;
            }
            Fault::BlackHole => {
                self.black_hole().await;
                return false;
            }
            _ => {}
        }
        let (delay_request, delay_response) = if fault == Fault::Delay {
            match self.rng.below(3) {
                0 => (true, false),
                1 => (false, true),
                _ => (true, true),
            }
        } else {
            (false, false)
        };
        if delay_request {
            let d = self.rng.duration_up_to(self.config.max_delay);
            tokio::time::sleep(d).await;
        }
        if !self.forward_request(&request).await {
            return false;
        }
        match fault {
            Fault::ResetAfterRequest => {
                self.reset_client();
                self.server = None;
                false
            }
            Fault::HalfCloseClient => {
                let _ = self.client().shutdown().await;
                // Let the server finish and drain its answer; then close both.
                let _ = self.read_response(&request).await;
                false
            }
            Fault::HalfCloseServer => {
                if let Some(server) = self.server.as_mut() {
                    let _ = server.shutdown().await;
                }
                if let Some(response) = self.read_response(&request).await {
                    let _ = self.client().write_all(&response).await;
                    let _ = self.client().shutdown().await;
                }
                false
            }
            Fault::LoseResponse => {
                let _ = self.read_response(&request).await;
                self.reset_client();
                false
            }
            Fault::CutMidBody => {
                if let Some(response) = self.read_response(&request).await {
                    let len = response.len();
                    if len > 1 {
                        let cut = 1 + self.rng.below(len as u64 - 1) as usize;
                        let _ = self.client().write_all(&response[..cut]).await;
                        let _ = self.client().flush().await;
                    }
                }
                self.reset_client();
                false
            }
            Fault::Pass | Fault::Delay => {
                let Some(response) = self.read_response(&request).await else {
                    // The server closed without a (framable) answer: close as it did.
                    return false;
                };
                if delay_response {
                    let d = self.rng.duration_up_to(self.config.max_delay);
                    tokio::time::sleep(d).await;
                }
                if self.client().write_all(&response).await.is_err() {
                    return false;
                }
                !closes(&response)
            }
            Fault::ResetBeforeRequest | Fault::BlackHole => false,
        }
    }

    /// Resets the client connection; the `Conn` must end right after.
    fn reset_client(&mut self) {
        if let Some(client) = self.client.take() {
            reset(client);
        }
    }

    fn client(&mut self) -> &mut TcpStream {
        self.client
            .as_mut()
            .expect("the client connection was reset")
    }

    /// Connects upstream if needed and writes `request`; false when that failed (the
    /// client is then closed).
    async fn forward_request(&mut self, request: &[u8]) -> bool {
        if self.server.is_none() {
            match TcpStream::connect(self.upstream).await {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    self.server = Some(s);
                }
                Err(_) => {
                    self.counters
                        .upstream_connect_failures
                        .fetch_add(1, Ordering::Relaxed);
                    self.reset_client();
                    return false;
                }
            }
        }
        let server = self.server.as_mut().unwrap();
        server.write_all(request).await.is_ok()
    }

    /// The whole response to `request` from the server, `None` when the server closed
    /// or the response cannot be framed.
    async fn read_response(&mut self, request: &[u8]) -> Option<Vec<u8>> {
        let server = self.server.as_mut()?;
        let head_request = request.starts_with(b"HEAD ");
        match read_message(server, &mut self.sbuf, Some(head_request)).await {
            Ok(Some(m)) => Some(m),
            _ => None,
        }
    }

    /// Reads and drops what the client sends, never answering, until it closes or the
    /// hold time is over.
    async fn black_hole(&mut self) {
        let hold = self.config.black_hole_hold;
        let client = self.client();
        let _ = tokio::time::timeout(hold, async {
            let mut buf = [0u8; 4096];
            loop {
                match client.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        })
        .await;
    }

    /// Falls back to a plain copy for the rest of the connection.
    async fn copy_rest(mut self) {
        self.counters.unframed.fetch_add(1, Ordering::Relaxed);
        let mut server = match self.server.take() {
            Some(s) => s,
            None => match TcpStream::connect(self.upstream).await {
                Ok(s) => s,
                Err(_) => return,
            },
        };
        if server.write_all(&self.cbuf).await.is_err() {
            return;
        }
        let ahead = std::mem::take(&mut self.sbuf);
        if self.client().write_all(&ahead).await.is_err() {
            return;
        }
        if let Some(mut client) = self.client.take() {
            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
        }
    }
}

/// Whether a response says the connection closes after it (`connection: close`).
fn closes(message: &[u8]) -> bool {
    let Some(end) = find(message, b"\r\n\r\n", 0) else {
        return true;
    };
    header_lines(&message[..end]).any(|(name, value)| {
        name.eq_ignore_ascii_case("connection") && value.to_ascii_lowercase().contains("close")
    })
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if from >= hay.len() {
        return None;
    }
    hay[from..]
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}

/// The `name: value` lines of a head (without its first line).
fn header_lines(head: &[u8]) -> impl Iterator<Item = (String, String)> + '_ {
    head.split(|b| *b == b'\n').skip(1).filter_map(|line| {
        let line = std::str::from_utf8(line).ok()?.trim_end_matches('\r');
        let (name, value) = line.split_once(':')?;
        Some((name.trim().to_owned(), value.trim().to_owned()))
    })
}

/// Reads from `stream` into `buf` until it holds at least `len` bytes.
async fn fill(stream: &mut TcpStream, buf: &mut Vec<u8>, len: usize) -> Result<(), ReadError> {
    let mut chunk = [0u8; 16 * 1024];
    while buf.len() < len {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return Err(ReadError::Io),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    Ok(())
}

/// Reads until `needle` is in `buf` at or after `from`; its position.
async fn fill_until(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    needle: &[u8],
    from: usize,
) -> Result<usize, ReadError> {
    let mut chunk = [0u8; 16 * 1024];
    loop {
        if let Some(p) = find(buf, needle, from) {
            return Ok(p);
        }
        if buf.len() > MAX_MESSAGE {
            return Err(ReadError::Unframed);
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return Err(ReadError::Io),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Reads one whole HTTP/1.1 message from `stream` (with `buf` holding what was read
/// ahead) and returns its bytes; `Ok(None)` when the peer closed cleanly between
/// messages. `response` is `None` for a request, or `Some(to a HEAD request)`.
async fn read_message(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    response: Option<bool>,
) -> Result<Option<Vec<u8>>, ReadError> {
    if buf.is_empty() {
        let mut chunk = [0u8; 16 * 1024];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return Ok(None),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let head_end = fill_until(stream, buf, b"\r\n\r\n", 0).await? + 4;
    let head = &buf[..head_end];
    let status: Option<u16> = response.and_then(|_| {
        let line = head.split(|b| *b == b'\r').next()?;
        let line = std::str::from_utf8(line).ok()?;
        line.split(' ').nth(1)?.parse().ok()
    });
    let mut chunked = false;
    let mut length: Option<usize> = None;
    for (name, value) in header_lines(&head[..head_end - 4]) {
        if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.to_ascii_lowercase().contains("chunked");
        } else if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse().map_err(|_| ReadError::Unframed)?);
        }
    }
    let bodiless = match (response, status) {
        (Some(true), _) => true,
        (Some(false), Some(s)) => s < 200 || s == 204 || s == 304,
        _ => false,
    };
    let end = if bodiless {
        head_end
    } else if chunked {
        let mut pos = head_end;
        loop {
            let line_end = fill_until(stream, buf, b"\r\n", pos).await?;
            let line = std::str::from_utf8(&buf[pos..line_end]).map_err(|_| ReadError::Unframed)?;
            let size_hex = line.split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(size_hex, 16).map_err(|_| ReadError::Unframed)?;
            pos = line_end + 2;
            if size == 0 {
                // Trailers, up to an empty line.
                loop {
                    let e = fill_until(stream, buf, b"\r\n", pos).await?;
                    let empty = e == pos;
                    pos = e + 2;
                    if empty {
                        break;
                    }
                }
                break;
            }
            if pos + size > MAX_MESSAGE {
                return Err(ReadError::Unframed);
            }
            fill(stream, buf, pos + size + 2).await?;
            pos += size + 2;
        }
        pos
    } else if let Some(n) = length {
        if head_end + n > MAX_MESSAGE {
            return Err(ReadError::Unframed);
        }
        fill(stream, buf, head_end + n).await?;
        head_end + n
    } else if response.is_some() {
        // A response delimited by the end of the connection: not produced by the
        // servers under test; do not guess.
        return Err(ReadError::Unframed);
    } else {
        head_end
    };
    let rest = buf.split_off(end);
    let message = std::mem::replace(buf, rest);
    Ok(Some(message))
}
