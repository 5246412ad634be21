//! One TCP proxy for every test and bench that must break, hold, count or move the
//! connections between a client and a loopback server.
//!
//! A [`FaultProxy`] listens on `127.0.0.1:0` and forwards each connection it accepts
//! to its upstream. It runs in one of two framings, chosen when it starts:
//!
//! - [`FaultProxy::tcp`] copies bytes both ways (a store's connection: Redis,
//!   PostgreSQL), optionally through a [`Tap`] that reads what each client sends
//!   ([`postgres::PgProxy`] counts PostgreSQL round trips that way);
//! - [`FaultProxy::start`] understands just enough HTTP/1.1 to find where each request
//!   and each response ends, and injects a [`Fault`] **per request**, drawn from a
//!   weighted [`FaultMix`] by a seeded RNG.
//!
//! Either way, at any time:
//!
//! | mode | call | what clients see |
//! |---|---|---|
//! | cut | [`cut`](FaultProxy::cut) / [`restore`](FaultProxy::restore) | every connection closed; new ones accepted and closed at once (a server that went away), until restored |
//! | shut down | [`shut_down`](FaultProxy::shut_down) | every connection closed and the listener gone: the port refuses connections, for good |
//! | stall | [`stall`](FaultProxy::stall) | every byte read (either way) held until the stall ends: a server or network that stopped answering |
//! | switch | [`switch`](FaultProxy::switch) | connections made afterwards go to the new upstream (a failover); open ones stay |
//! | count | [`stats`](FaultProxy::stats) | nothing: connections, bytes each way, requests and faults are counted |
//!
//! The faults of the fault mode:
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
//! The fault mode chooses per request, also on keep-alive connections: a pooled client
//! connection carries many requests, and a per-connection choice would be too coarse (a
//! "pass" connection would carry hundreds of clean requests). A fault that breaks the
//! connection ends it; `pass` and `delay` keep it open for the next request. Each
//! connection draws from a stream of its own, derived from the seed and the
//! connection's accept number. A message the proxy cannot frame (neither
//! `content-length` nor `chunked` on a request with a body, or over 4 MiB) makes it
//! fall back to a plain byte copy for the rest of that connection (counted as
//! `unframed`).

mod fault;
mod http;
pub mod postgres;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use fault::{Fault, FaultMix, ProxyConfig};

/// Reads what each client sends, as the proxy forwards it (one tap per connection).
pub trait Tap: Send + 'static {
    /// The next bytes the client sent, in order.
    fn feed(&mut self, bytes: &[u8]);
}

/// Makes the [`Tap`] of each new connection.
pub type MakeTap = Arc<dyn Fn() -> Box<dyn Tap> + Send + Sync>;

/// A running proxy; its listener closes when dropped (connections in progress end on
/// their own: each is bounded by its peers, or by `black_hole_hold` in the fault mode).
#[derive(Debug)]
pub struct FaultProxy {
    /// Where clients connect.
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// A snapshot of what a [`FaultProxy`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Client connections accepted and forwarded (not those refused while cut).
    pub connections: u64,
    /// Bytes read from clients.
    pub bytes_up: u64,
    /// Bytes read from the upstream.
    pub bytes_down: u64,
    /// Requests read, in the fault mode (each got one fault).
    pub requests: u64,
    /// Requests per fault, indexed like [`Fault::ALL`].
    pub faults: [u64; 9],
    /// Upstream connections that could not be opened.
    pub upstream_connect_failures: u64,
    /// Connections of the fault mode that fell back to a plain copy.
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
        self.bytes_up += other.bytes_up;
        self.bytes_down += other.bytes_down;
        self.requests += other.requests;
        for (a, b) in self.faults.iter_mut().zip(other.faults) {
            *a += b;
        }
        self.upstream_connect_failures += other.upstream_connect_failures;
        self.unframed += other.unframed;
    }
}

impl FaultProxy {
    /// The fault mode: a proxy on `127.0.0.1:0` in front of the HTTP/1.1 server at
    /// `upstream` (on loopback), breaking requests as `config` says.
    pub async fn start(upstream: SocketAddr, config: ProxyConfig) -> std::io::Result<FaultProxy> {
        assert!(
            upstream.ip().is_loopback(),
            "the fault proxy is for loopback upstreams only"
        );
        FaultProxy::listen(upstream, Framing::Http(config), None).await
    }

    /// A proxy on `127.0.0.1:0` that copies bytes to and from `upstream`, whatever the
    /// protocol; it breaks nothing until told to (cut, stall, switch).
    pub async fn tcp(upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        FaultProxy::listen(upstream, Framing::Bytes, None).await
    }

    /// Like [`tcp`](Self::tcp), with a [`Tap`] made by `make_tap` reading what each
    /// client sends.
    pub async fn tcp_with_tap(
        upstream: SocketAddr,
        make_tap: impl Fn() -> Box<dyn Tap> + Send + Sync + 'static,
    ) -> std::io::Result<FaultProxy> {
        FaultProxy::listen(upstream, Framing::Bytes, Some(Arc::new(make_tap))).await
    }

    async fn listen(
        upstream: SocketAddr,
        framing: Framing,
        make_tap: Option<MakeTap>,
    ) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream: Mutex::new(upstream),
            switches: watch::Sender::new(Switches::default()),
            counters: Counters::default(),
            framing,
            make_tap,
        });
        let accept = tokio::spawn(accept(listener, Arc::clone(&shared)));
        Ok(FaultProxy {
            addr,
            shared,
            accept,
        })
    }

    /// What the proxy did so far.
    pub fn stats(&self) -> ProxyStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::SeqCst);
        let mut faults = [0u64; 9];
        for (out, n) in faults.iter_mut().zip(&c.faults) {
            *out = get(n);
        }
        ProxyStats {
            connections: get(&c.connections),
            bytes_up: get(&c.bytes_up),
            bytes_down: get(&c.bytes_down),
            requests: get(&c.requests),
            faults,
            upstream_connect_failures: get(&c.upstream_connect_failures),
            unframed: get(&c.unframed),
        }
    }

    /// Closes every connection and closes new ones at once, until
    /// [`restore`](Self::restore).
    pub fn cut(&self) {
        self.shared.switches.send_modify(|s| s.cut = true);
    }

    /// Lets connections through again after [`cut`](Self::cut).
    pub fn restore(&self) {
        self.shared.switches.send_modify(|s| s.cut = false);
    }

    /// Closes the listener and every connection, for good: the port refuses
    /// connections from now on.
    pub fn shut_down(&self) {
        self.shared.switches.send_modify(|s| s.shut = true);
    }

    /// Holds (`true`) every byte read from either side until called with `false`, which
    /// delivers what was held.
    pub fn stall(&self, stalled: bool) {
        self.shared.switches.send_modify(|s| s.stalled = stalled);
    }

    /// Sends the connections made from now on to `upstream`.
    pub fn switch(&self, upstream: SocketAddr) {
        *self.shared.upstream.lock().unwrap() = upstream;
    }
}

/// The proxy's state, shared by its accept loop and its connections.
struct Shared {
    upstream: Mutex<SocketAddr>,
    switches: watch::Sender<Switches>,
    counters: Counters,
    framing: Framing,
    make_tap: Option<MakeTap>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("upstream", &self.upstream)
            .field("switches", &*self.switches.borrow())
            .field("framing", &self.framing)
            .field("tapped", &self.make_tap.is_some())
            .finish_non_exhaustive()
    }
}

impl Shared {
    fn upstream(&self) -> SocketAddr {
        *self.upstream.lock().unwrap()
    }

    /// Opens a connection to the upstream (counting a failure).
    async fn connect(&self) -> Option<TcpStream> {
        match TcpStream::connect(self.upstream()).await {
            Ok(server) => {
                let _ = server.set_nodelay(true);
                Some(server)
            }
            Err(_) => {
                self.counters
                    .upstream_connect_failures
                    .fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }
}

/// The modes a test switches at run time, seen by every connection at once.
#[derive(Debug, Clone, Copy, Default)]
struct Switches {
    cut: bool,
    shut: bool,
    stalled: bool,
}

#[derive(Debug)]
enum Framing {
    /// Bytes copied as they come.
    Bytes,
    /// HTTP/1.1 messages, each request with a fault.
    Http(ProxyConfig),
}

#[derive(Debug, Default)]
struct Counters {
    connections: AtomicU64,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
    requests: AtomicU64,
    faults: [AtomicU64; 9],
    upstream_connect_failures: AtomicU64,
    unframed: AtomicU64,
}

async fn accept(listener: TcpListener, shared: Arc<Shared>) {
    let mut switches = shared.switches.subscribe();
    let mut n: u64 = 0;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = switches.wait_for(|s| s.shut) => return,
        };
        let Ok((client, _)) = accepted else {
            // Out of descriptors or similar: back off a little.
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        if shared.switches.borrow().cut {
            drop(client);
            continue;
        }
        n += 1;
        shared.counters.connections.fetch_add(1, Ordering::Relaxed);
        let _ = client.set_nodelay(true);
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            let mut closed = shared.switches.subscribe();
            tokio::select! {
                () = serve(client, n, &shared) => {}
                // Both sockets close here.
                _ = closed.wait_for(|s| s.cut || s.shut) => {}
            }
        });
    }
}

/// Serves the `n`th connection accepted.
async fn serve(client: TcpStream, n: u64, shared: &Arc<Shared>) {
    match &shared.framing {
        Framing::Bytes => {
            let Some(server) = shared.connect().await else {
                return;
            };
            copy_both_ways(client, server, shared, Vec::new(), Vec::new()).await;
        }
        Framing::Http(config) => http::Conn::new(client, n, config, shared).run().await,
    }
}

/// Which way bytes go.
#[derive(Debug, Clone, Copy)]
enum Way {
    /// From the client to the upstream.
    Up,
    /// From the upstream to the client.
    Down,
}

/// How a connection reads: it waits out a stall after each read, counts what it read
/// and feeds the client's bytes to the tap.
struct Reader {
    way: Way,
    shared: Arc<Shared>,
    switches: watch::Receiver<Switches>,
    tap: Option<Box<dyn Tap>>,
}

impl Reader {
    fn new(way: Way, shared: &Arc<Shared>) -> Reader {
        let tap = match way {
            Way::Up => shared.make_tap.as_ref().map(|make| make()),
            Way::Down => None,
        };
        Reader {
            way,
            shared: Arc::clone(shared),
            switches: shared.switches.subscribe(),
            tap,
        }
    }

    /// Reads some bytes into `chunk`: how many (0 at the end of the stream).
    async fn read(
        &mut self,
        from: &mut (impl AsyncRead + Unpin),
        chunk: &mut [u8],
    ) -> std::io::Result<usize> {
        let n = from.read(chunk).await?;
        if self.switches.wait_for(|s| !s.stalled).await.is_err() {
            return Err(std::io::ErrorKind::BrokenPipe.into());
        }
        let counter = match self.way {
            Way::Up => &self.shared.counters.bytes_up,
            Way::Down => &self.shared.counters.bytes_down,
        };
        counter.fetch_add(n as u64, Ordering::Relaxed);
        if let (Some(tap), Some(read)) = (self.tap.as_mut(), chunk.get(..n)) {
            tap.feed(read);
        }
        Ok(n)
    }
}

/// Copies both ways until both sides are done, after writing what was already read
/// ahead (`to_server`, `to_client`); the end of one side's stream is passed on to the
/// other as a half close.
async fn copy_both_ways(
    client: TcpStream,
    server: TcpStream,
    shared: &Arc<Shared>,
    to_server: Vec<u8>,
    to_client: Vec<u8>,
) {
    let (client_rx, client_tx) = client.into_split();
    let (server_rx, server_tx) = server.into_split();
    tokio::join!(
        pump(
            client_rx,
            server_tx,
            Reader::new(Way::Up, shared),
            to_server
        ),
        pump(
            server_rx,
            client_tx,
            Reader::new(Way::Down, shared),
            to_client
        ),
    );
}

async fn pump(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    mut reader: Reader,
    ahead: Vec<u8>,
) {
    if to.write_all(&ahead).await.is_ok() {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match reader.read(&mut from, &mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if to.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    }
    let _ = to.shutdown().await;
}
