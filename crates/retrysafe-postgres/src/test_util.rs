//! Test and bench support (feature `test-util`): a TCP proxy in front of PostgreSQL
//! that counts the client's round trips by frontend message, and can stop forwarding
//! ("freeze") to play a server that hangs.
//!
//! In the extended query protocol a client waits for the server at each `Sync` (and at
//! a simple `Query`): each is one round trip. A batch up to a `Sync` that holds an
//! `Execute` runs a statement; one that holds a `Parse` (and no `Execute`) prepares one;
//! an empty one is a ping (sqlx pings connections as they return to the pool).
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use retrysafe_postgres::sqlx::postgres::PgConnectOptions;
//! use retrysafe_postgres::test_util::WireProxy;
//!
//! let upstream: PgConnectOptions = "postgres://postgres@127.0.0.1:5432/test".parse().unwrap();
//! let proxy = WireProxy::start(&upstream).await?;
//! let options = proxy.connect_options(&upstream); // connect through the proxy
//! let before = proxy.seen();
//! // ... run the store ...
//! let trips = proxy.seen() - before;
//! println!("{} statements", trips.statements);
//! # Ok(()) }
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::postgres::{PgConnectOptions, PgSslMode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What a [`WireProxy`] saw the clients send, counted by round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Seen {
    /// Extended-protocol batches that executed a statement.
    pub statements: u64,
    /// Batches that only prepared a statement.
    pub prepares: u64,
    /// Empty batches (pings).
    pub pings: u64,
    /// Simple-protocol queries (`BEGIN`, `COMMIT` as sqlx sends them…).
    pub simple_queries: u64,
    /// Connections opened through the proxy.
    pub connections: u64,
}

impl Seen {
    /// All round trips: statements, prepares, pings and simple queries.
    #[must_use]
    pub fn round_trips(&self) -> u64 {
        self.statements + self.prepares + self.pings + self.simple_queries
    }
}

impl std::ops::Sub for Seen {
    type Output = Seen;
    fn sub(self, o: Seen) -> Seen {
        Seen {
            statements: self.statements.saturating_sub(o.statements),
            prepares: self.prepares.saturating_sub(o.prepares),
            pings: self.pings.saturating_sub(o.pings),
            simple_queries: self.simple_queries.saturating_sub(o.simple_queries),
            connections: self.connections.saturating_sub(o.connections),
        }
    }
}

#[derive(Debug, Default)]
struct Counts {
    statements: AtomicU64,
    prepares: AtomicU64,
    pings: AtomicU64,
    simple_queries: AtomicU64,
    connections: AtomicU64,
}

/// A TCP proxy on `127.0.0.1` in front of a PostgreSQL server that counts the client's
/// round trips ([`Seen`]) and can [`freeze`](Self::freeze). Stops when dropped.
#[derive(Debug)]
pub struct WireProxy {
    addr: SocketAddr,
    counts: Arc<Counts>,
    frozen: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for WireProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl WireProxy {
    /// Starts a proxy to the server of `upstream` (its host and port). A connection
    /// the upstream refuses is closed.
    pub async fn start(upstream: &PgConnectOptions) -> std::io::Result<WireProxy> {
        let target = format!("{}:{}", upstream.get_host(), upstream.get_port());
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let counts = Arc::new(Counts::default());
        let (frozen, frozen_rx) = watch::channel(false);
        let task = {
            let counts = Arc::clone(&counts);
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let Ok(server) = TcpStream::connect(&target).await else {
                        continue;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    counts.connections.fetch_add(1, Ordering::Relaxed);
                    tokio::spawn(pipe(client, server, Arc::clone(&counts), frozen_rx.clone()));
                }
            })
        };
        Ok(WireProxy {
            addr,
            counts,
            frozen,
            task,
        })
    }

    /// The proxy's address.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `upstream`'s options pointed at the proxy (TLS off, so the protocol can be read).
    #[must_use]
    pub fn connect_options(&self, upstream: &PgConnectOptions) -> PgConnectOptions {
        upstream
            .clone()
            .host("127.0.0.1")
            .port(self.addr.port())
            .ssl_mode(PgSslMode::Disable)
    }

    /// What the clients sent so far.
    #[must_use]
    pub fn seen(&self) -> Seen {
        let c = &self.counts;
        let get = |a: &AtomicU64| a.load(Ordering::SeqCst);
        Seen {
            statements: get(&c.statements),
            prepares: get(&c.prepares),
            pings: get(&c.pings),
            simple_queries: get(&c.simple_queries),
            connections: get(&c.connections),
        }
    }

    /// Stops (or resumes) forwarding client bytes to the server: a server that hangs.
    pub fn freeze(&self, frozen: bool) {
        self.frozen.send_replace(frozen);
    }
}

async fn pipe(
    client: TcpStream,
    server: TcpStream,
    counts: Arc<Counts>,
    mut frozen: watch::Receiver<bool>,
) {
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    let back = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut server_rx, &mut client_tx).await;
        let _ = client_tx.shutdown().await;
    });
    let mut parser = Parser::default();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match client_rx.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        // Frozen: hold the bytes until thawed.
        if frozen.wait_for(|f| !*f).await.is_err() {
            break;
        }
        let Some(read) = buf.get(..n) else { break };
        parser.feed(read, &counts);
        if server_tx.write_all(read).await.is_err() {
            break;
        }
    }
    let _ = server_tx.shutdown().await;
    let _ = back.await;
}

/// Splits the client's byte stream into frontend messages.
#[derive(Default)]
struct Parser {
    started: bool,
    pending: Vec<u8>,
    saw_execute: bool,
    saw_parse: bool,
}

/// The big-endian `u32` at `at` of `bytes`, as a length.
fn length_at(bytes: &[u8], at: usize) -> Option<usize> {
    let raw: [u8; 4] = bytes.get(at..at + 4)?.try_into().ok()?;
    usize::try_from(u32::from_be_bytes(raw)).ok()
}

impl Parser {
    fn feed(&mut self, bytes: &[u8], counts: &Counts) {
        self.pending.extend_from_slice(bytes);
        loop {
            if !self.started {
                // The startup packet: length, protocol version, parameters (no type).
                let Some(len) = length_at(&self.pending, 0) else {
                    return;
                };
                if self.pending.len() < len {
                    return;
                }
                self.pending.drain(..len);
                self.started = true;
                continue;
            }
            let (Some(&kind), Some(len)) = (self.pending.first(), length_at(&self.pending, 1))
            else {
                return;
            };
            if self.pending.len() < 1 + len {
                return;
            }
            self.pending.drain(..1 + len);
            match kind {
                b'P' => self.saw_parse = true,
                b'E' => self.saw_execute = true,
                b'Q' => {
                    counts.simple_queries.fetch_add(1, Ordering::SeqCst);
                }
                b'S' => {
                    let counter = if self.saw_execute {
                        &counts.statements
                    } else if self.saw_parse {
                        &counts.prepares
                    } else {
                        &counts.pings
                    };
                    counter.fetch_add(1, Ordering::SeqCst);
                    self.saw_execute = false;
                    self.saw_parse = false;
                }
                _ => {}
            }
        }
    }
}
