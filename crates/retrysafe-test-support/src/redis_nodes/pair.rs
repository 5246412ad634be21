//! [`LocalReplicaPair`]: a primary and its replica, `redis-server` processes on
//! loopback ports.

use std::fmt;
use std::process::{Child, Command};

use super::local::{
    LocalError, Workdir, check_tools, cli, error, free_ports, info_field, on_fresh_ports, signal,
    start_server, wait_until,
};

/// A `redis-server` primary with one replica, both on 127.0.0.1 (without persistence,
/// `maxmemory-policy noeviction`), in a temporary directory; stopped (SIGKILL) and
/// removed when dropped, or when the test process exits (a watchdog shell). For tests
/// of replica-acknowledged writes: the replica can be stopped (SIGSTOP: its link stays
/// up, it acknowledges nothing) and resumed.
///
/// Needs `redis-server` and `redis-cli` (Redis 7; Debian package `redis-server`) on the
/// `PATH`: without them making one fails, saying so.
///
/// ```no_run
/// use retrysafe_test_support::redis_nodes::LocalReplicaPair;
///
/// let pair = LocalReplicaPair::start()?;
/// pair.stop_replica()?; // a write waiting for the replica's acknowledgement waits
/// pair.resume_replica()?; // caught up
/// # let _ = pair.url();
/// # Ok::<(), retrysafe_test_support::redis_nodes::LocalError>(())
/// ```
pub struct LocalReplicaPair {
    primary: u16,
    replica: u16,
    /// The primary's and the replica's processes.
    children: Vec<Child>,
    /// Dropped after the servers were killed.
    dir: Workdir,
}

impl fmt::Debug for LocalReplicaPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalReplicaPair")
            .field("dir", &self.dir)
            .field("primary", &self.primary)
            .field("replica", &self.replica)
            .finish_non_exhaustive()
    }
}

impl LocalReplicaPair {
    /// Starts the primary, then its replica, and returns once the replica is in sync.
    pub fn start() -> Result<LocalReplicaPair, LocalError> {
        check_tools()?;
        on_fresh_ports(LocalReplicaPair::start_once)
    }

    /// [`start`](Self::start) on ports picked once.
    fn start_once() -> Result<LocalReplicaPair, LocalError> {
        let ports = free_ports(2)?;
        let mut pair = LocalReplicaPair {
            primary: ports[0],
            replica: ports[1],
            children: Vec::new(),
            dir: Workdir::new("pair")?,
        };
        pair.children.push(start_server(
            Command::new("redis-server"),
            &pair.dir,
            pair.primary,
        )?);
        let mut replica = Command::new("redis-server");
        replica.args(["--replicaof", "127.0.0.1", &pair.primary.to_string()]);
        pair.children
            .push(start_server(replica, &pair.dir, pair.replica)?);
        pair.wait_in_sync()?;
        Ok(pair)
    }

    /// The primary's URL, `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.primary)
    }

    /// The replica's URL.
    pub fn replica_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.replica)
    }

    /// The ports of the primary and of the replica, as they were started.
    pub fn ports(&self) -> (u16, u16) {
        (self.primary, self.replica)
    }

    /// Stops the replica (SIGSTOP): the primary keeps its link, but no write is
    /// acknowledged until it is [resumed](Self::resume_replica).
    pub fn stop_replica(&self) -> Result<(), LocalError> {
        signal(self.replica_process()?, "-STOP")
    }

    /// Resumes a stopped replica (SIGCONT) and returns once it has every write
    /// ([`wait_in_sync`](Self::wait_in_sync)).
    pub fn resume_replica(&self) -> Result<(), LocalError> {
        signal(self.replica_process()?, "-CONT")?;
        self.wait_in_sync()
    }

    /// Waits until the replica is linked and has acknowledged every write the primary
    /// took (its acknowledged offset is the primary's replication offset).
    pub fn wait_in_sync(&self) -> Result<(), LocalError> {
        wait_until("the replica to be in sync", &self.dir, || {
            cli(self.primary, &["INFO", "replication"]).is_ok_and(|info| {
                let offset = info_field(&info, "master_repl_offset");
                // slave0:ip=127.0.0.1,port=P,state=online,offset=N,lag=0
                let acked = info_field(&info, "slave0").and_then(|link| {
                    link.contains("state=online")
                        .then(|| link.split(',').find_map(|f| f.strip_prefix("offset=")))
                        .flatten()
                });
                offset.is_some() && offset == acked
            })
        })
    }

    fn replica_process(&self) -> Result<&Child, LocalError> {
        self.children
            .get(1)
            .ok_or_else(|| error("the replica was not started"))
    }
}

impl Drop for LocalReplicaPair {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
