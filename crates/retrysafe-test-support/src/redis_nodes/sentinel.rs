//! [`LocalSentinel`]: a primary, two replicas and three sentinels, `redis-server`
//! processes on loopback ports.

use std::fmt;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::OnceLock;

use super::local::{
    LocalError, Workdir, check_tools, cli, error, free_ports, info_field, on_fresh_ports, signal,
    start_server, wait_until,
};

/// How many sentinels must agree that the primary is down before one fails it over.
const QUORUM: usize = 2;

/// A service that Redis Sentinel watches, all on 127.0.0.1: a primary and two replicas
/// (`redis-server` processes on ports of their own, without persistence,
/// `maxmemory-policy noeviction`) and three sentinels (`redis-server CONF --sentinel`,
/// quorum 2, `down-after-milliseconds` 1000, `failover-timeout` 2000), in a temporary
/// directory; stopped (SIGKILL) and removed when dropped, or when the test process
/// exits (a watchdog shell).
///
/// Needs `redis-server` and `redis-cli` (Redis 7; Debian package
/// `redis-server`) on the `PATH`: without them making one fails, saying so.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use retrysafe_redis::RedisStore;
/// use retrysafe_test_support::redis_nodes::LocalSentinel;
///
/// let setup = LocalSentinel::start()?;
/// let store = RedisStore::options().connect_sentinel(setup.sentinel_urls(), setup.service()).await?;
/// let old = setup.primary()?;
/// # let mut setup = setup;
/// setup.kill(old)?; // the sentinels promote a replica; the store follows
/// setup.wait_promoted(old)?;
/// # let _ = store;
/// # Ok(()) }
/// ```
pub struct LocalSentinel {
    service: String,
    /// The data nodes: the first starts as the primary, the others as its replicas.
    nodes: Vec<Process>,
    sentinels: Vec<Process>,
    /// Dropped after the servers were killed.
    dir: Workdir,
}

/// One `redis-server` (a data node or a sentinel) and its port.
struct Process {
    port: u16,
    child: Option<Child>,
}

impl fmt::Debug for LocalSentinel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalSentinel")
            .field("dir", &self.dir)
            .field("service", &self.service)
            .field("nodes", &self.node_ports())
            .field("sentinels", &self.sentinel_ports())
            .finish_non_exhaustive()
    }
}

impl LocalSentinel {
    /// Starts the primary and its two replicas, then the three sentinels, and returns
    /// once both replicas are in sync and every sentinel knows them and the other two
    /// sentinels (see [`wait_healthy`](Self::wait_healthy)).
    pub fn start() -> Result<LocalSentinel, LocalError> {
        check_tools()?;
        on_fresh_ports(LocalSentinel::start_once)
    }

    /// [`start`](Self::start) on ports picked once.
    fn start_once() -> Result<LocalSentinel, LocalError> {
        let ports = free_ports(6)?;
        let process = |port: &u16| Process {
            port: *port,
            child: None,
        };
        let (nodes, sentinels) = ports.split_at(3);
        let mut setup = LocalSentinel {
            service: "retrysafe".to_owned(),
            nodes: nodes.iter().map(process).collect(),
            sentinels: sentinels.iter().map(process).collect(),
            dir: Workdir::new("sentinel")?,
        };
        let first = setup.nodes.first().map(|n| n.port).unwrap_or_default();
        for port in setup.node_ports() {
            setup.spawn_node(port, Some(first).filter(|&p| p != port))?;
        }
        for i in 0..setup.sentinels.len() {
            setup.spawn_sentinel(i)?;
        }
        setup.wait_healthy()?;
        Ok(setup)
    }

    /// One setup per test process, started on first use and stopped when the process
    /// exits: for tests that only use it (not those that kill or pause nodes).
    ///
    /// # Panics
    ///
    /// When the setup cannot be started (the message says why: a missing
    /// `redis-server`, say). A test that needs it fails; it never skips.
    pub fn shared() -> &'static LocalSentinel {
        static SHARED: OnceLock<LocalSentinel> = OnceLock::new();
        SHARED.get_or_init(|| {
            LocalSentinel::start().unwrap_or_else(|e| {
                #[allow(clippy::panic)]
                {
                    panic!("cannot start a local Redis Sentinel setup: {e}")
                }
            })
        })
    }

    /// The name of the service the sentinels watch (`sentinel monitor NAME …`).
    pub fn service(&self) -> &str {
        &self.service
    }

    /// The URL of every sentinel, `redis://127.0.0.1:PORT`.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinel_ports()
            .into_iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// The ports of the sentinels.
    pub fn sentinel_ports(&self) -> Vec<u16> {
        self.sentinels.iter().map(|s| s.port).collect()
    }

    /// The ports of the data nodes (the primary and its replicas, in the order they
    /// were made: the first was the primary at the start).
    pub fn node_ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// The port of the primary, as the first sentinel that answers names it.
    pub fn primary(&self) -> Result<u16, LocalError> {
        self.sentinels
            .iter()
            .filter(|s| s.child.is_some())
            .find_map(|s| self.named_primary(s.port))
            .ok_or_else(|| error("no sentinel names a primary"))
    }

    /// The ports of the live data nodes that are replicas now (`ROLE`).
    pub fn replicas(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .filter(|n| role(n.port).as_deref() == Some("slave"))
            .map(|n| n.port)
            .collect()
    }

    /// Kills the data node on `port` (SIGKILL: no shutdown, no save), as a crash would.
    pub fn kill(&mut self, port: u16) -> Result<(), LocalError> {
        let node = self.node_mut(port)?;
        if let Some(mut child) = node.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        Ok(())
    }

    /// Stops the data node on `port` (SIGSTOP): its connections stay open and it
    /// answers nothing, copies nothing, until [`resume`](Self::resume)d. A replica so
    /// held falls behind its primary.
    pub fn pause(&self, port: u16) -> Result<(), LocalError> {
        self.signal(port, "-STOP")
    }

    /// Holds the replicas behind their primary: stops them ([`pause`](Self::pause))
    /// and makes the primary close their replication links (`CLIENT KILL TYPE
    /// replica`), so that nothing the primary takes from then on reaches them, as
    /// happens to an asynchronous replica that fell behind. [`resume`](Self::resume)
    /// each (returned) to let it reconnect and catch up, if its primary is still there.
    pub fn hold_replicas_behind(&self) -> Result<Vec<u16>, LocalError> {
        let primary = self.primary()?;
        let replicas = self.replicas();
        for replica in &replicas {
            self.pause(*replica)?;
        }
        cli(primary, &["CLIENT", "KILL", "TYPE", "replica"])?;
        Ok(replicas)
    }

    /// Resumes a data node stopped by [`pause`](Self::pause) (SIGCONT).
    pub fn resume(&self, port: u16) -> Result<(), LocalError> {
        self.signal(port, "-CONT")
    }

    /// Starts the data node on `port` again (after [`kill`](Self::kill)), empty, as a
    /// replica of the primary the sentinels name now, and returns once the setup is
    /// healthy again ([`wait_healthy`](Self::wait_healthy)).
    pub fn restart(&mut self, port: u16) -> Result<(), LocalError> {
        let primary = self.primary()?;
        self.node_mut(port)?;
        self.spawn_node(port, Some(primary))?;
        self.wait_healthy()
    }

    /// Waits until every live sentinel names a primary other than `old` and that node
    /// says it is one.
    pub fn wait_promoted(&self, old: u16) -> Result<(), LocalError> {
        wait_until("a replica to be promoted", &self.dir, || {
            let named: Vec<Option<u16>> = self
                .sentinels
                .iter()
                .filter(|s| s.child.is_some())
                .map(|s| self.named_primary(s.port))
                .collect();
            match named.first() {
                Some(Some(new)) => {
                    *new != old
                        && named.iter().all(|n| *n == Some(*new))
                        && role(*new).as_deref() == Some("master")
                }
                _ => false,
            }
        })
    }

    /// Waits until the sentinels agree on the primary, it says it is one and has every
    /// other live data node as a replica in sync, and each sentinel knows those replicas
    /// and the other sentinels and sees the primary up.
    pub fn wait_healthy(&self) -> Result<(), LocalError> {
        let live_nodes = self.nodes.iter().filter(|n| n.child.is_some()).count();
        let live_sentinels = self.sentinels.iter().filter(|s| s.child.is_some()).count();
        wait_until("the Sentinel setup to be healthy", &self.dir, || {
            let Ok(primary) = self.primary() else {
                return false;
            };
            let replicas = live_nodes - 1;
            let in_sync = cli(primary, &["INFO", "replication"]).is_ok_and(|info| {
                info.contains("role:master")
                    && info.contains(&format!("connected_slaves:{replicas}"))
                    && info.matches("state=online").count() == replicas
            });
            in_sync
                && self
                    .sentinels
                    .iter()
                    .filter(|s| s.child.is_some())
                    .all(|s| {
                        let Ok(master) = cli(s.port, &["SENTINEL", "MASTER", &self.service]) else {
                            return false;
                        };
                        self.named_primary(s.port) == Some(primary)
                            && field(&master, "flags").as_deref() == Some("master")
                            && field(&master, "num-slaves") == Some(replicas.to_string())
                            && field(&master, "num-other-sentinels")
                                == Some((live_sentinels - 1).to_string())
                    })
        })
    }

    /// The directory of the servers' data, configurations and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The primary that the sentinel on `port` names, if it answers.
    fn named_primary(&self, port: u16) -> Option<u16> {
        let reply = cli(
            port,
            &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", &self.service],
        )
        .ok()?;
        reply.lines().nth(1)?.trim().parse().ok()
    }

    fn node_mut(&mut self, port: u16) -> Result<&mut Process, LocalError> {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .ok_or_else(|| error(format!("no data node on port {port}")))
    }

    fn signal(&self, port: u16, sig: &str) -> Result<(), LocalError> {
        let child = self
            .nodes
            .iter()
            .find(|n| n.port == port)
            .and_then(|n| n.child.as_ref())
            .ok_or_else(|| error(format!("no live data node on port {port}")))?;
        signal(child, sig)
    }

    /// Starts the data node on `port`: a replica of the node on port `primary`, or
    /// a primary.
    fn spawn_node(&mut self, port: u16, primary: Option<u16>) -> Result<(), LocalError> {
        let mut command = Command::new("redis-server");
        if let Some(primary) = primary {
            command.args(["--replicaof", "127.0.0.1", &primary.to_string()]);
        }
        let child = start_server(command, &self.dir, port)?;
        self.node_mut(port)?.child = Some(child);
        Ok(())
    }

    /// Starts sentinel `i`, watching the first data node (the primary at the start).
    fn spawn_sentinel(&mut self, i: usize) -> Result<(), LocalError> {
        let primary = self
            .nodes
            .first()
            .map(|n| n.port)
            .ok_or_else(|| error("no data node"))?;
        let sentinel = self
            .sentinels
            .get_mut(i)
            .ok_or_else(|| error(format!("no sentinel {i}")))?;
        let service = &self.service;
        // A sentinel rewrites its configuration file with what it learns: one each.
        let conf = self.dir.join(format!("sentinel-{}.conf", sentinel.port));
        let text = format!(
            "sentinel monitor {service} 127.0.0.1 {primary} {QUORUM}\n\
             sentinel down-after-milliseconds {service} 1000\n\
             sentinel failover-timeout {service} 2000\n\
             sentinel parallel-syncs {service} 2\n"
        );
        std::fs::write(&conf, text).map_err(|e| error(format!("{}: {e}", conf.display())))?;
        let mut command = Command::new("redis-server");
        command.arg(&conf).arg("--sentinel");
        sentinel.child = Some(start_server(command, &self.dir, sentinel.port)?);
        Ok(())
    }
}

impl Drop for LocalSentinel {
    fn drop(&mut self) {
        for process in self.sentinels.iter_mut().chain(&mut self.nodes) {
            if let Some(mut child) = process.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// `role` of `INFO replication` on the node on `port` (`master`, `slave`), if it
/// answers.
fn role(port: u16) -> Option<String> {
    let info = cli(port, &["INFO", "replication"]).ok()?;
    info_field(&info, "role").map(str::to_owned)
}

/// The value after `name` in a flat reply of names and values, one per line, as
/// `redis-cli` prints `SENTINEL MASTER`.
fn field(reply: &str, name: &str) -> Option<String> {
    let mut lines = reply.lines().map(str::trim);
    while let Some(line) = lines.next() {
        if line == name {
            return lines.next().map(str::to_owned);
        }
    }
    None
}
