//! [`LocalCluster`]: a Redis Cluster of `redis-server` processes on loopback ports.

use std::fmt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;

use super::local::{
    LocalError, Workdir, check_tools, cli, error, free_ports, info_field, on_fresh_ports, signal,
    start_server, wait_until,
};

/// A Redis Cluster of 3 primaries and 3 replicas (one each), `redis-server` processes
/// on loopback ports of their own, made with `redis-cli --cluster create` in a
/// temporary directory; stopped (SIGKILL) and removed when dropped, or when the test
/// process exits (a watchdog shell does it for a cluster that is never dropped, such as
/// [`shared`](Self::shared)'s).
///
/// Nodes run with `cluster-node-timeout` 1000 ms, `cluster-replica-validity-factor 0`
/// (a replica may always be promoted), `cluster-require-full-coverage no`,
/// `maxmemory-policy noeviction` and no persistence. Needs `redis-server` and
/// `redis-cli` (Redis 7; Debian package `redis-server`) on the `PATH`: without them
/// making one fails, saying so.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use retrysafe_redis::RedisStore;
/// use retrysafe_test_support::redis_nodes::LocalCluster;
///
/// let cluster = LocalCluster::start()?;
/// assert_eq!(cluster.urls().len(), 6);
/// let store = RedisStore::options().connect_cluster(cluster.urls()).await?;
/// # let _ = store;
/// # Ok(()) }
/// ```
pub struct LocalCluster {
    nodes: Vec<Node>,
    /// Dropped after the nodes were killed.
    dir: Workdir,
}

struct Node {
    port: u16,
    bus: u16,
    child: Option<Child>,
}

impl fmt::Debug for LocalCluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalCluster")
            .field("dir", &self.dir)
            .field("ports", &self.ports())
            .finish_non_exhaustive()
    }
}

impl LocalCluster {
    /// Starts six nodes, makes them a cluster of three primaries with one replica each,
    /// and returns once every node reports `cluster_state:ok` and every replica is in
    /// sync with its primary.
    pub fn start() -> Result<LocalCluster, LocalError> {
        check_tools()?;
        on_fresh_ports(LocalCluster::start_once)
    }

    /// [`start`](Self::start) on ports picked once.
    fn start_once() -> Result<LocalCluster, LocalError> {
        let mut cluster = LocalCluster {
            nodes: Vec::new(),
            dir: Workdir::new("cluster")?,
        };
        let ports = free_ports(12)?;
        for pair in ports.chunks_exact(2) {
            if let [port, bus] = *pair {
                cluster.nodes.push(Node {
                    port,
                    bus,
                    child: None,
                });
            }
        }
        for i in 0..cluster.nodes.len() {
            cluster.spawn(i)?;
        }
        cluster.create()?;
        cluster.wait_healthy()?;
        Ok(cluster)
    }

    /// One cluster per test process, started on first use and stopped when the
    /// process exits: for tests that only use it (not those that kill nodes).
    ///
    /// # Panics
    ///
    /// When the cluster cannot be started (the message says why: a missing
    /// `redis-server` or `redis-cli`, say). A test that needs it fails; it never skips.
    pub fn shared() -> &'static LocalCluster {
        static SHARED: OnceLock<LocalCluster> = OnceLock::new();
        SHARED.get_or_init(|| {
            LocalCluster::start().unwrap_or_else(|e| {
                #[allow(clippy::panic)]
                {
                    panic!("cannot start a local Redis Cluster: {e}")
                }
            })
        })
    }

    /// The URL of every node, `redis://127.0.0.1:PORT`.
    pub fn urls(&self) -> Vec<String> {
        self.ports()
            .into_iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// The port of every node, in the order they were made.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// The ports of the nodes that are primaries now and that own slots (of those that
    /// answer).
    pub fn primaries(&self) -> Result<Vec<u16>, LocalError> {
        let mut out = Vec::new();
        for node in self.nodes.iter().filter(|n| n.child.is_some()) {
            // A node that does not answer (paused, say) is not counted.
            let Ok(role) = cli(node.port, &["ROLE"]) else {
                continue;
            };
            if role.lines().next() == Some("master") && !out.contains(&node.port) {
                out.push(node.port);
            }
        }
        Ok(out)
    }

    /// Kills the node on `port` (SIGKILL: no shutdown, no save), as a crash would.
    pub fn kill(&mut self, port: u16) -> Result<(), LocalError> {
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.port == port)
            .ok_or_else(|| error(format!("no node on port {port}")))?;
        if let Some(mut child) = node.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        Ok(())
    }

    /// Stops the node on `port` (SIGSTOP): its connections stay open and it answers
    /// nothing until [`resume`](Self::resume)d, as a frozen process or a lost network
    /// would. A stopped primary is failed over to its replica after the node timeout.
    pub fn pause(&self, port: u16) -> Result<(), LocalError> {
        signal(self.child(port)?, "-STOP")
    }

    /// Resumes a node stopped by [`pause`](Self::pause) (SIGCONT); a primary failed
    /// over meanwhile rejoins as a replica.
    pub fn resume(&self, port: u16) -> Result<(), LocalError> {
        signal(self.child(port)?, "-CONT")
    }

    /// The port of the replica of the primary on `port`, as the replicas say (`ROLE`).
    pub fn replica_of(&self, primary: u16) -> Option<u16> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some() && n.port != primary)
            .find(|n| {
                cli(n.port, &["ROLE"]).is_ok_and(|role| {
                    let mut lines = role.lines();
                    lines.next() == Some("slave")
                        && lines.nth(1).and_then(|p| p.trim().parse().ok()) == Some(primary)
                })
            })
            .map(|n| n.port)
    }

    /// For a test's failure message, each node as it answers now (`; ` between
    /// them): its port, its role and its `cluster_state`, or that it does not answer
    /// (within 5 s) or was killed.
    pub fn status(&self) -> String {
        self.nodes
            .iter()
            .map(|n| {
                if n.child.is_none() {
                    return format!("{}: killed", n.port);
                }
                let role = cli(n.port, &["ROLE"]);
                let info = cli(n.port, &["CLUSTER", "INFO"]);
                match (role, info) {
                    (Ok(role), Ok(info)) => format!(
                        "{}: {}, cluster_state:{}",
                        n.port,
                        role.lines().next().unwrap_or("?"),
                        info_field(&info, "cluster_state").unwrap_or("?")
                    ),
                    _ => format!("{}: no answer", n.port),
                }
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    fn child(&self, port: u16) -> Result<&Child, LocalError> {
        self.nodes
            .iter()
            .find(|n| n.port == port)
            .and_then(|n| n.child.as_ref())
            .ok_or_else(|| error(format!("no live node on port {port}")))
    }

    /// Starts the node on `port` again (after [`kill`](Self::kill)): it rejoins the
    /// cluster, as a replica once another node was promoted in its place. Returns once
    /// the cluster is healthy again (see [`wait_healthy`](Self::wait_healthy)).
    pub fn restart(&mut self, port: u16) -> Result<(), LocalError> {
        let i = self
            .nodes
            .iter()
            .position(|n| n.port == port)
            .ok_or_else(|| error(format!("no node on port {port}")))?;
        self.spawn(i)?;
        self.wait_healthy()
    }

    /// Moves `slots` hash slots from the primary on port `from` to the primary on port
    /// `to` with `redis-cli --cluster reshard` (keys migrate with `MIGRATE`; clients see
    /// `ASK` and then `MOVED`), and returns once every node agrees on the result.
    pub fn reshard(&self, from: u16, to: u16, slots: u16) -> Result<(), LocalError> {
        let id = |port: u16| cli(port, &["CLUSTER", "MYID"]).map(|s| s.trim().to_owned());
        let (from_id, to_id) = (id(from)?, id(to)?);
        let entry = format!("127.0.0.1:{from}");
        let slots = slots.to_string();
        let out = Command::new("redis-cli")
            .args(["--cluster", "reshard", &entry, "--cluster-from", &from_id])
            .args([
                "--cluster-to",
                &to_id,
                "--cluster-slots",
                &slots,
                "--cluster-yes",
            ])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| error(format!("cannot run redis-cli: {e}")))?;
        if !out.status.success() {
            return Err(error(format!(
                "redis-cli --cluster reshard failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        wait_until("the nodes to agree on the slots", &self.dir, || {
            cli(from, &["--cluster", "check", &entry]).is_ok()
        })
    }

    /// Waits until every live node reports `cluster_state:ok`, the cluster has three
    /// primaries, and every primary has a replica in sync (`ROLE` lists it).
    pub fn wait_healthy(&self) -> Result<(), LocalError> {
        wait_until("the cluster to be healthy", &self.dir, || {
            let live: Vec<u16> = self
                .nodes
                .iter()
                .filter(|n| n.child.is_some())
                .map(|n| n.port)
                .collect();
            for port in &live {
                let info = cli(*port, &["CLUSTER", "INFO"]).unwrap_or_default();
                if !info.contains("cluster_state:ok") {
                    return false;
                }
            }
            let Ok(primaries) = self.primaries() else {
                return false;
            };
            let synced = primaries.iter().all(|p| {
                cli(*p, &["INFO", "replication"])
                    .is_ok_and(|i| i.contains("connected_slaves:1") && i.contains("state=online"))
            });
            primaries.len() == 3 && synced
        })
    }

    /// Waits until a node other than `old` is a primary for the slots `old` served:
    /// the cluster counts three primaries among its live nodes, all `cluster_state:ok`.
    pub fn wait_promoted(&self, old: u16) -> Result<(), LocalError> {
        wait_until("a replica to be promoted", &self.dir, || {
            let Ok(primaries) = self.primaries() else {
                return false;
            };
            let ok = primaries.iter().all(|p| {
                cli(*p, &["CLUSTER", "INFO"]).is_ok_and(|i| i.contains("cluster_state:ok"))
            });
            ok && primaries.len() == 3 && !primaries.contains(&old)
        })
    }

    /// Starts node `i` and waits until it answers `PING`.
    fn spawn(&mut self, i: usize) -> Result<(), LocalError> {
        let dir = self.dir.to_path_buf();
        let node = self
            .nodes
            .get_mut(i)
            .ok_or_else(|| error(format!("no node {i}")))?;
        let (port, bus) = (node.port.to_string(), node.bus.to_string());
        let mut command = Command::new("redis-server");
        command
            .args(["--port", &port, "--cluster-port", &bus])
            .args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ])
            .args(["--cluster-node-timeout", "1000"])
            .args(["--cluster-replica-validity-factor", "0"])
            .args(["--cluster-require-full-coverage", "no"]);
        node.child = Some(start_server(command, &dir, node.port)?);
        Ok(())
    }

    fn create(&self) -> Result<(), LocalError> {
        let mut args = vec!["--cluster".to_owned(), "create".to_owned()];
        args.extend(self.ports().iter().map(|p| format!("127.0.0.1:{p}")));
        args.extend(["--cluster-replicas", "1", "--cluster-yes"].map(str::to_owned));
        let out = Command::new("redis-cli")
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| error(format!("cannot run redis-cli: {e}")))?;
        if !out.status.success() {
            return Err(error(format!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(())
    }

    /// The directory of the nodes' data and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}
