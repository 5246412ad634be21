//! What the local Redis setups share: free loopback ports, `redis-cli`, waiting for a
//! condition, and a watchdog that kills the servers when the test process exits.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How long to wait, at most, for a node to listen or for the cluster to settle.
const SETTLE: Duration = Duration::from_secs(60);

/// The pause between two looks at a node or the cluster.
const POLL: Duration = Duration::from_millis(50);

/// How many times [`on_fresh_ports`] makes a setup before it gives up.
const ATTEMPTS: u32 = 5;

/// Why a local Redis setup ([`LocalCluster`](super::LocalCluster),
/// [`LocalSentinel`](super::LocalSentinel)) could not be made or changed: the message
/// says what, and where the servers' logs are.
#[derive(Debug)]
#[non_exhaustive]
pub struct LocalError {
    message: String,
    /// A port picked free was taken by another process before a server bound it.
    taken: bool,
}

impl fmt::Display for LocalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for LocalError {}

pub(crate) fn error(what: impl Into<String>) -> LocalError {
    LocalError {
        message: what.into(),
        taken: false,
    }
}

/// Makes a setup with `make`, again (on the fresh ports it picks) while it fails
/// because a port it picked was taken first: a port is free when it is picked, but
/// another test of the process may bind it before `redis-server` does.
pub(crate) fn on_fresh_ports<T>(
    mut make: impl FnMut() -> Result<T, LocalError>,
) -> Result<T, LocalError> {
    let mut attempt = 1;
    loop {
        match make() {
            Err(e) if e.taken && attempt < ATTEMPTS => attempt += 1,
            made => return made,
        }
    }
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

/// A setup's temporary directory (its servers' data, configurations, logs and pid
/// files) and a watchdog shell that waits for this process to exit, then kills every
/// server whose pid file is in it and removes it: a setup that is never dropped (a
/// shared one, in a static) leaves nothing behind. Dropped, it stops the watchdog and
/// removes the directory; the setup kills its servers first.
pub(crate) struct Workdir {
    path: PathBuf,
    watchdog: Option<Child>,
}

impl Workdir {
    /// A fresh directory `retrysafe-<what>-<pid>-<random>` under the temporary
    /// directory, and its watchdog.
    pub(crate) fn new(what: &str) -> Result<Workdir, LocalError> {
        let path = std::env::temp_dir().join(format!(
            "retrysafe-{what}-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&path).map_err(|e| error(format!("{}: {e}", path.display())))?;
        // The path the kernel reports as a server's working directory (no symlink).
        let path =
            std::fs::canonicalize(&path).map_err(|e| error(format!("{}: {e}", path.display())))?;
        let mut dir = Workdir {
            path,
            watchdog: None,
        };
        let watchdog = Command::new("sh")
            .args(["-c", &watchdog_script(std::process::id(), &dir.path)])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                error(format!(
                    "cannot start the watchdog shell of the local servers: {e}"
                ))
            })?;
        dir.watchdog = Some(watchdog);
        Ok(dir)
    }
}

/// The watchdog of `dir`: waits for the process `watched` to exit, then kills every
/// server with a pid file in `dir` and removes it. A pid file may outlive its server
/// (one killed as a crash would be, one that failed to start) and pids are reused (the
/// kernel's `pid_max` may be as low as 32768), so a pid is killed only while its
/// process still runs in that server's own directory (`<dir>/<port>`, its `--dir`),
/// never another process given the pid since.
fn watchdog_script(watched: u32, dir: &Path) -> String {
    format!(
        "while kill -0 {watched} 2>/dev/null; do sleep 1; done; \
         for f in '{dir}'/*.pid; do \
           [ -f \"$f\" ] || continue; p=$(cat \"$f\"); \
           [ \"$(readlink /proc/\"$p\"/cwd 2>/dev/null)\" = \"${{f%.pid}}\" ] && kill -9 \"$p\" 2>/dev/null; \
         done; \
         rm -rf '{dir}'",
        dir = dir.display()
    )
}

impl std::ops::Deref for Workdir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.path
    }
}

impl fmt::Debug for Workdir {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.path.fmt(f)
    }
}

impl Drop for Workdir {
    fn drop(&mut self) {
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
        let _ = std::fs::remove_dir_all(&self.path);
    }
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
/// answers, or fails with the end of its log when it exits first. A server of another
/// process answering on `port` (which took it first) is an error that
/// [`on_fresh_ports`] makes the setup again for.
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
    let mut answering = None;
    let up = wait_until("redis-server to answer", dir, || {
        if let Ok(Some(status)) = child.try_wait() {
            exited = Some(status);
            return true;
        }
        answering = cli(port, &["INFO", "server"])
            .ok()
            .and_then(|info| info_field(&info, "process_id").map(str::to_owned));
        answering.is_some()
    });
    if let Some(status) = exited {
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        return Err(LocalError {
            message: format!(
                "redis-server on port {port} exited ({status}): {}",
                log.lines().rev().take(5).collect::<Vec<_>>().join(" / ")
            ),
            taken: log.contains("Address already in use"),
        });
    }
    let ours = child.id().to_string();
    if let Err(e) = up {
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    if answering.as_deref() != Some(ours.as_str()) {
        let _ = child.kill();
        let _ = child.wait();
        return Err(LocalError {
            message: format!(
                "port {port} is served by another process (pid {}), not the redis-server started on it",
                answering.unwrap_or_default()
            ),
            taken: true,
        });
    }
    Ok(child)
}

/// The value of `name` in an `INFO` reply (its `name:value` line).
pub fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':'))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The watchdog kills the processes that run in their server's directory and
    /// spares one whose pid file is stale (a process given the pid since runs
    /// elsewhere).
    #[test]
    fn the_watchdog_kills_its_servers_not_a_process_given_a_stale_pid() {
        use std::os::unix::process::ExitStatusExt;

        let dir = std::fs::canonicalize(std::env::temp_dir())
            .unwrap()
            .join(format!("retrysafe-watchdog-test-{}", std::process::id()));
        let elsewhere = dir.join("elsewhere");
        for d in [dir.join("1111"), elsewhere.clone()] {
            std::fs::create_dir_all(d).unwrap();
        }
        let sleep_in = |cwd: &Path| {
            Command::new("sleep")
                .arg("30")
                .current_dir(cwd)
                .spawn()
                .unwrap()
        };
        let mut server = sleep_in(&dir.join("1111"));
        let mut stranger = sleep_in(&elsewhere);
        std::fs::write(dir.join("1111.pid"), server.id().to_string()).unwrap();
        std::fs::write(dir.join("2222.pid"), stranger.id().to_string()).unwrap();
        // The watched process has exited: the watchdog acts at once.
        let mut gone = Command::new("true").spawn().unwrap();
        let watched = gone.id();
        gone.wait().unwrap();

        let status = Command::new("sh")
            .args(["-c", &watchdog_script(watched, &dir)])
            .status()
            .unwrap();
        assert!(status.success());
        assert_eq!(
            server.wait().unwrap().signal(),
            Some(9),
            "the server is killed"
        );
        assert!(
            stranger.try_wait().unwrap().is_none(),
            "the stranger still runs"
        );
        assert!(!dir.exists(), "the directory is removed");
        stranger.kill().unwrap();
        stranger.wait().unwrap();
    }

    #[test]
    fn a_port_served_by_another_process_is_taken_not_ours() {
        let pair = super::super::LocalReplicaPair::start().unwrap();
        let (primary, _) = pair.ports();
        let dir = std::env::temp_dir().join(format!("retrysafe-local-test-{}", std::process::id()));
        let e = start_server(Command::new("redis-server"), &dir, primary).unwrap_err();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(e.taken, "{e}");
        assert!(e.to_string().contains(&primary.to_string()), "{e}");
        // The pair's own primary still answers as itself.
        assert_eq!(cli(primary, &["PING"]).unwrap().trim(), "PONG");
    }

    #[test]
    fn a_setup_is_made_again_only_while_a_port_was_taken() {
        let taken = || LocalError {
            message: "taken".into(),
            taken: true,
        };
        let mut calls = 0;
        let made = on_fresh_ports(|| {
            calls += 1;
            if calls < 3 { Err(taken()) } else { Ok(calls) }
        });
        assert_eq!(made.unwrap(), 3);

        let mut calls = 0;
        let failed = on_fresh_ports(|| -> Result<(), _> {
            calls += 1;
            Err(error("no redis-server"))
        });
        assert_eq!(
            (failed.unwrap_err().to_string().as_str(), calls),
            ("no redis-server", 1)
        );

        let mut calls = 0;
        let failed = on_fresh_ports(|| -> Result<(), _> {
            calls += 1;
            Err(taken())
        });
        assert!(failed.unwrap_err().taken);
        assert_eq!(calls, ATTEMPTS);
    }

    #[test]
    fn info_fields_are_read_by_name() {
        let info =
            "# Server\r\nredis_version:7.0.15\r\nprocess_id:4242\r\nprocess_supervised:no\r\n";
        assert_eq!(info_field(info, "process_id"), Some("4242"));
        assert_eq!(info_field(info, "process"), None);
        assert_eq!(info_field(info, "missing"), None);
        assert_eq!(info_field("", "process_id"), None);
    }
}
