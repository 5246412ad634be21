//! The proxy in front of PostgreSQL, counting the client's round trips by frontend
//! message.
//!
//! In the extended query protocol a client waits for the server at each `Sync` (and at
//! a simple `Query`): each is one round trip. A batch up to a `Sync` that holds an
//! `Execute` runs a statement; one that holds a `Parse` (and no `Execute`) prepares one;
//! an empty one is a ping (sqlx pings connections as they return to the pool).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use retrysafe_postgres::sqlx::postgres::{PgConnectOptions, PgSslMode};

use super::{FaultProxy, Tap};

/// What the clients of a [`PgProxy`] sent, counted by round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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
}

/// A [`FaultProxy`] (bytes copied as they come) in front of a PostgreSQL server that
/// counts the client's round trips ([`Seen`]). Stops when dropped.
#[derive(Debug)]
pub struct PgProxy {
    proxy: FaultProxy,
    counts: Arc<Counts>,
}

impl PgProxy {
    /// Starts a proxy to the server of `upstream` (its host and port).
    pub async fn start(upstream: &PgConnectOptions) -> std::io::Result<PgProxy> {
        let target = format!("{}:{}", upstream.get_host(), upstream.get_port());
        let addr = tokio::net::lookup_host(&target)
            .await?
            .next()
            .ok_or_else(|| std::io::Error::other(format!("{target} resolves to nothing")))?;
        let counts = Arc::new(Counts::default());
        let tapped = Arc::clone(&counts);
        let proxy = FaultProxy::tcp_with_tap(addr, move || {
            Box::new(Parser {
                counts: Arc::clone(&tapped),
                started: false,
                pending: Vec::new(),
                saw_execute: false,
                saw_parse: false,
            })
        })
        .await?;
        Ok(PgProxy { proxy, counts })
    }

    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.proxy.addr
    }

    /// `upstream`'s options pointed at the proxy (TLS off, so the protocol can be read).
    pub fn connect_options(&self, upstream: &PgConnectOptions) -> PgConnectOptions {
        upstream
            .clone()
            .host("127.0.0.1")
            .port(self.proxy.addr.port())
            .ssl_mode(PgSslMode::Disable)
    }

    /// What the clients sent so far.
    pub fn seen(&self) -> Seen {
        let c = &self.counts;
        let get = |a: &AtomicU64| a.load(Ordering::SeqCst);
        Seen {
            statements: get(&c.statements),
            prepares: get(&c.prepares),
            pings: get(&c.pings),
            simple_queries: get(&c.simple_queries),
            connections: self.proxy.stats().connections,
        }
    }

    /// The proxy itself: to stall it (a server that hangs), cut it, or read its bytes.
    pub fn proxy(&self) -> &FaultProxy {
        &self.proxy
    }
}

/// Splits one client's byte stream into frontend messages.
struct Parser {
    counts: Arc<Counts>,
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

impl Tap for Parser {
    fn feed(&mut self, bytes: &[u8]) {
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
            self.count(kind);
        }
    }
}

impl Parser {
    fn count(&mut self, kind: u8) {
        let counts = &self.counts;
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
