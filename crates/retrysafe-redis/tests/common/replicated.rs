//! A primary and its replica: two `redis-server` processes on loopback ports of their
//! own, for tests of replica-acknowledged writes. The replica can be stopped (SIGSTOP:
//! its link stays up, it acknowledges nothing) and resumed (SIGCONT).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use retrysafe_core::idempotency::Token;
use retrysafe_test_support::private::free_port;

/// The pause between two looks at a server.
const POLL: Duration = Duration::from_millis(20);

/// How many looks, at most, before a server that does not answer fails the test.
const LOOKS: u32 = 1500;

/// How many times a pair is started on fresh ports before the test fails.
const ATTEMPTS: u32 = 5;

/// A `redis-server` primary with one replica, both on 127.0.0.1, without persistence;
/// killed (SIGKILL) and their directory removed when dropped.
pub(crate) struct PrimaryWithReplica {
    primary: u16,
    replica: u16,
    dir: PathBuf,
    children: Vec<Child>,
}

impl PrimaryWithReplica {
    /// Starts both and returns once the replica is in sync.
    ///
    /// A port is free when it is picked, but another test of the process may take it
    /// before `redis-server` binds it: then that test's server answers on it, and
    /// both are started again on other ports.
    pub(crate) async fn start() -> PrimaryWithReplica {
        for _ in 0..ATTEMPTS {
            let dir = std::env::temp_dir().join(format!(
                "retrysafe-replicated-{}",
                &Token::random().to_hex()[..12]
            ));
            std::fs::create_dir_all(&dir).unwrap();
            let mut pair = PrimaryWithReplica {
                primary: free_port(),
                replica: free_port(),
                dir,
                children: Vec::new(),
            };
            if pair.primary != pair.replica
                && pair.spawn(pair.primary, None).await
                && pair.spawn(pair.replica, Some(pair.primary)).await
            {
                pair.wait_in_sync().await;
                return pair;
            }
        }
        panic!("no two free ports for a primary and its replica in {ATTEMPTS} attempts");
    }

    /// The primary's URL.
    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.primary)
    }

    /// The replica's URL.
    pub(crate) fn replica_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.replica)
    }

    /// The ports of the primary and of the replica, as they were started.
    pub(crate) fn ports(&self) -> (u16, u16) {
        (self.primary, self.replica)
    }

    /// Stops the replica (SIGSTOP): the primary keeps its link, but no write is
    /// acknowledged until it is [resumed](Self::resume_replica).
    pub(crate) fn stop_replica(&self) {
        self.signal("-STOP");
    }

    /// Resumes a stopped replica (SIGCONT) and waits until it has every write.
    pub(crate) async fn resume_replica(&self) {
        self.signal("-CONT");
        self.wait_in_sync().await;
    }

    /// Waits until a write on the primary is acknowledged by the replica (`WAIT 1`).
    pub(crate) async fn wait_in_sync(&self) {
        let client = redis::Client::open(self.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        for _ in 0..LOOKS {
            let _: () = redis::cmd("SET")
                .arg("retrysafe-test:sync")
                .arg(1)
                .query_async(&mut conn)
                .await
                .unwrap();
            let acked: u64 = redis::cmd("WAIT")
                .arg(1)
                .arg(100)
                .query_async(&mut conn)
                .await
                .unwrap();
            if acked >= 1 {
                return;
            }
            tokio::time::sleep(POLL).await;
        }
        panic!("the replica on port {} never caught up", self.replica);
    }

    fn signal(&self, signal: &str) {
        let pid = self.children.get(1).map(Child::id).unwrap();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {signal} {pid}");
    }

    /// Starts a server on `port` (a replica of `primary`, if given) and waits until it
    /// answers; whether the server answering is the one started (not another
    /// test's, which took the port first).
    async fn spawn(&mut self, port: u16, primary: Option<u16>) -> bool {
        let data = self.dir.join(port.to_string());
        std::fs::create_dir_all(&data).unwrap();
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--appendonly", "no", "--save", ""])
            .args(["--maxmemory-policy", "noeviction", "--protected-mode", "no"])
            .arg("--dir")
            .arg(&data);
        if let Some(primary) = primary {
            cmd.args(["--replicaof", "127.0.0.1", &primary.to_string()]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start redis-server (is it installed?): {e}"));
        let pid = child.id();
        self.children.push(child);
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
        for _ in 0..LOOKS {
            if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
                let info: redis::RedisResult<String> = redis::cmd("INFO")
                    .arg("server")
                    .query_async(&mut conn)
                    .await;
                if let Ok(info) = info {
                    return info
                        .lines()
                        .any(|l| l.trim() == format!("process_id:{pid}"));
                }
            }
            tokio::time::sleep(POLL).await;
        }
        panic!("redis-server on port {port} did not answer");
    }
}

impl Drop for PrimaryWithReplica {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
