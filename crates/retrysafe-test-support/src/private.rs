//! Private servers for the tests that must stop, restart or shift the clock of their
//! store: a `redis-server` and a PostgreSQL cluster of their own, on ports and in
//! temporary directories of their own.

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use retrysafe_core::idempotency::Token;

/// A free TCP port on 127.0.0.1 (bound, read, released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A fresh directory under the temporary directory, removed by [`Scratch`]'s drop.
#[derive(Debug)]
pub struct Scratch(PathBuf);

impl Scratch {
    /// A fresh directory whose name says `what` it holds.
    pub fn new(what: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "retrysafe-private-{what}-{}",
            &Token::random().to_hex()[..12]
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Waits until `port` accepts a connection.
pub async fn wait_for_port(port: u16, what: &str) {
    let started = Instant::now();
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{what} did not listen on port {port}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A private `redis-server` with an append-only file fsynced on every write, on a port
/// of its own; killed (SIGKILL) when dropped.
#[derive(Debug)]
pub struct PrivateRedis {
    /// Its port on 127.0.0.1.
    pub port: u16,
    dir: Scratch,
    child: Option<Child>,
    /// Extra environment of the server process (an `LD_PRELOAD` that shifts its clock).
    env: Vec<(String, String)>,
}

impl PrivateRedis {
    /// Starts a server and waits until it answers.
    pub async fn start() -> PrivateRedis {
        PrivateRedis::start_with(Vec::new()).await
    }

    /// Like [`start`](Self::start), with extra environment for the server process.
    pub async fn start_with(env: Vec<(String, String)>) -> PrivateRedis {
        let mut redis = PrivateRedis {
            port: free_port(),
            dir: Scratch::new("redis"),
            child: None,
            env,
        };
        redis.spawn().await;
        redis
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server on its port and directory (replaying its AOF) and waits until
    /// it answers PING.
    pub async fn spawn(&mut self) {
        let port = self.port.to_string();
        // `STORE_FAULTS_REDIS_AOF=no` runs without persistence, to see what a restart
        // then loses (the test fails: durability requires persistence).
        let aof = match std::env::var("STORE_FAULTS_REDIS_AOF").as_deref() {
            Ok("no") => "no",
            _ => "yes",
        };
        let child = Command::new("redis-server")
            .args(["--port", port.as_str(), "--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(["--appendonly", aof, "--appendfsync", "always", "--save", ""])
            .args(["--maxmemory-policy", "noeviction", "--protected-mode", "no"])
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server (is it installed?)");
        self.child = Some(child);
        wait_for_port(self.port, "redis-server").await;
        let client = retrysafe_redis::redis::Client::open(self.url()).unwrap();
        let started = Instant::now();
        loop {
            // PING fails with LOADING while the AOF is replayed.
            if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
                let pong: Result<String, _> = retrysafe_redis::redis::cmd("PING")
                    .query_async(&mut conn)
                    .await;
                if pong.is_ok() {
                    return;
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "redis-server not ready"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL: no shutdown save; what the AOF has is what survives.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The uid and gid of user `postgres`, from /etc/passwd.
pub fn postgres_ids() -> (u32, u32) {
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    let line = passwd
        .lines()
        .find(|l| l.starts_with("postgres:"))
        .expect("a postgres user (initdb and pg_ctl run as it)");
    let fields: Vec<&str> = line.split(':').collect();
    (fields[2].parse().unwrap(), fields[3].parse().unwrap())
}

/// The directory of `initdb` and `pg_ctl`: `PG_BIN`, or the first of /usr/local/bin and
/// /usr/lib/postgresql/*/bin that has them.
pub fn pg_bin() -> PathBuf {
    if let Some(dir) = std::env::var_os("PG_BIN") {
        return PathBuf::from(dir);
    }
    let mut candidates = vec![PathBuf::from("/usr/local/bin")];
    if let Ok(versions) = std::fs::read_dir("/usr/lib/postgresql") {
        candidates.extend(versions.flatten().map(|v| v.path().join("bin")));
    }
    candidates
        .into_iter()
        .find(|d| d.join("pg_ctl").exists() && d.join("initdb").exists())
        .expect("initdb and pg_ctl (set PG_BIN to their directory)")
}

/// A private PostgreSQL cluster (initdb into a temporary directory, as user
/// `postgres`) on a port of its own; stopped and removed when dropped.
#[derive(Debug)]
pub struct PrivatePg {
    /// Its port on 127.0.0.1.
    pub port: u16,
    dir: Scratch,
    ids: (u32, u32),
    bin: PathBuf,
    /// Extra environment of the server processes (`LD_PRELOAD` of libfaketime, say).
    env: Vec<(String, String)>,
}

impl PrivatePg {
    /// Makes a cluster, starts it and waits until it accepts connections.
    pub async fn start() -> PrivatePg {
        PrivatePg::start_with(Vec::new()).await
    }

    /// Like [`start`](Self::start), with extra environment for the server processes.
    pub async fn start_with(env: Vec<(String, String)>) -> PrivatePg {
        let dir = Scratch::new("pg");
        let ids = postgres_ids();
        std::os::unix::fs::chown(dir.path(), Some(ids.0), Some(ids.1)).unwrap();
        let pg = PrivatePg {
            port: free_port(),
            dir,
            ids,
            bin: pg_bin(),
            env,
        };
        pg.run(
            "initdb",
            &[
                "-D",
                &pg.data(),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ],
        )
        .await;
        pg.start_server().await;
        pg
    }

    /// Its data directory.
    pub fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Runs `program args` as user `postgres` in the cluster's directory, to success.
    pub async fn run(&self, program: &str, args: &[&str]) {
        let output = tokio::process::Command::new(self.bin.join(program))
            .args(args)
            .current_dir(self.dir.path())
            .uid(self.ids.0)
            .gid(self.ids.1)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap();
        assert!(
            output.status.success(),
            "{program} {args:?}: {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// Starts the server on its port and data directory, and waits for its port.
    pub async fn start_server(&self) {
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} \
             -c max_connections=60 -c shared_buffers=16MB -c fsync=on",
            self.port,
            self.dir.path().display()
        );
        let log = self.dir.path().join("log").display().to_string();
        self.run(
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-l",
                &log,
                "-w",
                "-t",
                "60",
                "-o",
                &options,
                "start",
            ],
        )
        .await;
    }

    /// `pg_ctl -m immediate stop`: every server process quits at once, without a
    /// checkpoint; the next start runs crash recovery.
    pub async fn stop_immediate(&self) {
        self.run(
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "-w", "stop"],
        )
        .await;
    }
}

impl PrivatePg {
    /// A streaming standby of this cluster (`pg_basebackup -R -X stream`), started on a
    /// port and in a directory of its own; stopped and removed when dropped.
    pub async fn standby(&self) -> PrivatePg {
        let dir = Scratch::new("pg-standby");
        std::os::unix::fs::chown(dir.path(), Some(self.ids.0), Some(self.ids.1)).unwrap();
        // pg_basebackup beside this cluster's pg_ctl, or in a Debian package's directory.
        let mut dirs = vec![self.bin.clone()];
        if let Ok(versions) = std::fs::read_dir("/usr/lib/postgresql") {
            dirs.extend(versions.flatten().map(|v| v.path().join("bin")));
        }
        let bin = dirs
            .into_iter()
            .find(|d| d.join("pg_basebackup").exists() && d.join("pg_ctl").exists())
            .expect("pg_basebackup (set PG_BIN to the directory of pg_ctl and pg_basebackup)");
        let standby = PrivatePg {
            port: free_port(),
            dir,
            ids: self.ids,
            bin,
            env: self.env.clone(),
        };
        let primary = self.port.to_string();
        standby
            .run(
                "pg_basebackup",
                &[
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &primary,
                    "-U",
                    "postgres",
                    "-D",
                    &standby.data(),
                    "-R",
                    "-X",
                    "stream",
                    "--no-sync",
                ],
            )
            .await;
        standby.start_server().await;
        standby
    }

    /// `pg_ctl promote`: a standby becomes a primary (returns once it accepts writes).
    pub async fn promote(&self) {
        self.run("pg_ctl", &["-D", &self.data(), "-w", "-t", "60", "promote"])
            .await;
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        let _ = Command::new(self.bin.join("pg_ctl"))
            .args(["-D", &self.data(), "-m", "immediate", "-w", "stop"])
            .current_dir(self.dir.path())
            .uid(self.ids.0)
            .gid(self.ids.1)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}
