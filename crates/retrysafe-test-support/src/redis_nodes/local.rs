//! What the local Redis setups share: free loopback ports, `redis-cli`, waiting for a
//! condition, and a watchdog that kills the servers when the test process exits.

use std::fmt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How long to wait, at most, for a node to listen or for the cluster to settle.
const SETTLE: Duration = Duration::from_secs(60);

/// The pause between two looks at a node or the cluster.
const POLL: Duration = Duration::from_millis(50);

/// Why a local Redis setup ([`LocalCluster`](super::LocalCluster),
/// [`LocalSentinel`](super::LocalSentinel)) could not be made or changed: the message
/// says what, and where the servers' logs are.
#[derive(Debug)]
#[non_exhaustive]
pub struct LocalError(String);

impl fmt::Display for LocalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LocalError {}

pub(crate) fn error(what: impl Into<String>) -> LocalError {
    LocalError(what.into())
}

/// Calls `done` every [`POLL`] until it says so, for at most [`SETTLE`].
pub(crate) fn wait_until(
    what: &str,
    dir: &Path,
    mut done: impl FnMut() -> bool,
) -> Result<(), LocalError> {
    // tokio's clock, which is std's outside a runtime with a paused clock.
    let started = tokio::time::Instant::now();
    while started.elapsed() < SETTLE {
        if done() {
            return Ok(());
        }
        // Synchronous on purpose: `LocalCluster::shared` makes its cluster in a static
        // initializer, outside any runtime.
        #[allow(clippy::disallowed_methods)]
        std::thread::sleep(POLL);
    }
    Err(error(format!(
        "timed out after {SETTLE:?} waiting for {what} (logs in {})",
        dir.display()
    )))
}

/// Fails, saying what to install, when `redis-server` or `redis-cli` cannot be run.
pub(crate) fn check_tools() -> Result<(), LocalError> {
    for tool in ["redis-server", "redis-cli"] {
        let ran = Command::new(tool)
            .arg("--version")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !ran.is_ok_and(|s| s.success()) {
            return Err(error(format!(
                "{tool} is not installed (or not on the PATH): a local Redis Cluster or Sentinel \
                 setup needs redis-server and redis-cli 7 (Debian package redis-server)"
            )));
        }
    }
    Ok(())
}

/// A shell that waits for this process to exit, then kills every node whose pid file
/// is in `dir` and removes `dir`.
pub(crate) fn watchdog(dir: &Path) -> Result<Child, LocalError> {
    let script = format!(
        "while kill -0 {pid} 2>/dev/null; do sleep 1; done; \
         for f in '{dir}'/*.pid; do [ -f \"$f\" ] && kill -9 \"$(cat \"$f\")\" 2>/dev/null; done; \
         rm -rf '{dir}'",
        pid = std::process::id(),
        dir = dir.display()
    );
    Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| {
            error(format!(
                "cannot start the watchdog shell of the local servers: {e}"
            ))
        })
}

/// `n` distinct free TCP ports on 127.0.0.1 (all bound at once, read, released).
pub(crate) fn free_ports(n: usize) -> Result<Vec<u16>, LocalError> {
    let listeners = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| error(format!("no free port: {e}")))?;
    listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| error(format!("no free port: {e}")))
}

/// `redis-cli -p port args…`: its output, or why it failed (also when it has no answer
/// within 5 s: a node may be frozen on purpose).
pub(crate) fn cli(port: u16, args: &[&str]) -> Result<String, LocalError> {
    let out = Command::new("timeout")
        .args(["5", "redis-cli", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map_err(|e| error(format!("cannot run timeout redis-cli: {e}")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(error(format!("redis-cli -p {port} {args:?} failed")))
    }
}

/// Starts `command` (a `redis-server` with its own arguments) on 127.0.0.1:`port`,
/// without persistence, with `maxmemory-policy noeviction`, its data and log in
/// `dir/<port>`, its pid in `dir/<port>.pid` (for the [`watchdog`]); returns once it
/// answers `PING`, or fails with the end of its log when it exits first.
pub(crate) fn start_server(
    mut command: Command,
    dir: &Path,
    port: u16,
) -> Result<Child, LocalError> {
    let data = dir.join(port.to_string());
    std::fs::create_dir_all(&data).map_err(|e| error(format!("{}: {e}", data.display())))?;
    let log = data.join("redis.log");
    let mut child = command
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--appendonly", "no", "--save", ""])
        .args(["--maxmemory-policy", "noeviction", "--protected-mode", "no"])
        .arg("--dir")
        .arg(&data)
        .arg("--logfile")
        .arg(&log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| error(format!("cannot start redis-server: {e}")))?;
    let pid_file = dir.join(format!("{port}.pid"));
    std::fs::write(&pid_file, child.id().to_string())
        .map_err(|e| error(format!("{}: {e}", pid_file.display())))?;
    let mut exited = None;
    let up = wait_until("redis-server to answer PING", dir, || {
        if let Ok(Some(status)) = child.try_wait() {
            exited = Some(status);
            return true;
        }
        cli(port, &["PING"]).is_ok_and(|r| r.trim() == "PONG")
    });
    if let Some(status) = exited {
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        return Err(error(format!(
            "redis-server on port {port} exited ({status}): {}",
            log.lines().rev().take(5).collect::<Vec<_>>().join(" / ")
        )));
    }
    if let Err(e) = up {
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    Ok(child)
}

/// Sends `signal` (`-STOP`, `-CONT`) to `child` with `kill`.
pub(crate) fn signal(child: &Child, signal: &str) -> Result<(), LocalError> {
    let sent = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .map_err(|e| error(format!("cannot run kill: {e}")))?;
    if !sent.success() {
        return Err(error(format!("kill {signal} {} failed", child.id())));
    }
    Ok(())
}
