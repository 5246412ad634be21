//! What else the machine is doing while a bench measures: the load average, and the
//! share of the CPUs that processes other than the bench's own used (`/proc`). A bench
//! reports it per round, and can wait for a quiet machine before measuring.

use std::time::Duration;

use tokio::time::Instant;

/// `/proc/loadavg`: the 1, 5 and 15 minute load averages.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".to_owned())
}

/// Clock ticks so far: all CPUs' busy time, all CPUs' total time (`/proc/stat`), and
/// the user + system time of the processes counted as the bench's own.
#[derive(Clone, Copy, Debug)]
pub struct Ticks {
    busy: u64,
    total: u64,
    ours: u64,
}

/// The user + system time of process `pid` (`/proc/<pid>/stat`), if it is there.
pub fn process_ticks(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command's closing parenthesis: state (field 3), …, utime (14), stime (15).
    let fields: Vec<&str> = text[text.rfind(')')? + 1..].split_whitespace().collect();
    let field = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok());
    Some(field(11)? + field(12)?)
}

/// The machine's busy and total ticks.
fn machine() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    // cpu  user nice system idle iowait irq softirq steal ...
    let cpu: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    let [user, nice, system, idle, iowait, irq, softirq, steal] = cpu[..] else {
        return None;
    };
    let busy = user + nice + system + irq + softirq + steal;
    Some((busy, busy + idle + iowait))
}

/// Ticks now, counting `pids` as ours (include `std::process::id()`; a process that is
/// gone counts 0).
pub fn ticks(pids: &[u32]) -> Option<Ticks> {
    let (busy, total) = machine()?;
    Some(Ticks {
        busy,
        total,
        ours: pids.iter().filter_map(|&p| process_ticks(p)).sum(),
    })
}

/// Ticks now, counting as ours this process and every process whose command is one of
/// `names` (the servers a bench drives, such as `redis-server` and `postgres`).
pub fn ticks_named(names: &[&str]) -> Option<Ticks> {
    let (busy, total) = machine()?;
    let me = std::process::id();
    let mut ours = 0;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(text) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (text.find('('), text.rfind(')')) else {
            continue;
        };
        if pid == me || names.contains(&&text[open + 1..close]) {
            ours += process_ticks(pid).unwrap_or(0);
        }
    }
    Some(Ticks { busy, total, ours })
}

/// The share of all CPUs, in percent, that processes other than ours used between two
/// readings; `extra` is CPU time of ours that the readings miss (a child that exited).
pub fn others(before: Option<Ticks>, after: Option<Ticks>, extra: u64) -> f64 {
    match (before, after) {
        (Some(a), Some(b)) if b.total > a.total => {
            let ours = (b.ours + extra).saturating_sub(a.ours);
            let foreign = (b.busy - a.busy).saturating_sub(ours);
            foreign as f64 * 100.0 / (b.total - a.total) as f64
        }
        _ => f64::NAN,
    }
}

/// Sleeps for `d` without `std::thread::sleep` (disallowed in this workspace).
pub fn pause(d: Duration) {
    let start = Instant::now();
    while let Some(left) = d.checked_sub(start.elapsed())
        && !left.is_zero()
    {
        std::thread::park_timeout(left);
    }
}

/// Waits (up to an hour) until processes other than this one use at most `max_other` %
/// of the CPUs over one second.
pub fn wait_for_quiet(max_other: f64) {
    let me = [std::process::id()];
    for waited in 0..3600 {
        let before = ticks(&me);
        pause(Duration::from_secs(1));
        let other = others(before, ticks(&me), 0);
        if other <= max_other {
            return;
        }
        if waited % 60 == 0 {
            eprintln!("waiting: other processes use {other:.0} % of the CPUs");
        }
    }
}
