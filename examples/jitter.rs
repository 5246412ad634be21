//! "Exponential Backoff and Jitter" (Marc Brooker, AWS Architecture Blog, 2015), re-run
//! on retrysafe's own backoff: `cargo run --example jitter -- [--seed N] [--out PATH]
//! [--runs N]`.
//!
//! The setup is the post's simulator: `N` clients each want to write one row once. The
//! row is guarded by optimistic concurrency control: an attempt reads the row's
//! version, then writes conditionally on that version; the write fails when another
//! client wrote in between (a conflict), and the client backs off and tries again,
//! until it succeeds. Every message crosses a network of latency |N(10 ms, 2 ms)|.
//! The delays come from [`Backoff::delay`] exactly as the `RetryLayer`'s standard
//! strategy calls it: one seeded [`RetryRng`] per client, as the strategy gives each
//! request its own, `n` the retries already made, the previous delay fed back for decorrelated jitter. Base
//! 5 ms, cap 2 s; strategies: no backoff, exponential without jitter, full, equal and
//! decorrelated jitter.
//!
//! It runs as a discrete-event simulation in virtual time (a priority queue of events
//! in virtual nanoseconds, nothing sleeps), seeded, so the same seed prints the same
//! figures. For 10 to 190 clients it prints the mean number of calls (conditional
//! writes, as the post's simulator counts them; each comes with one read) and the mean
//! time until every client has written, writes an SVG chart of both, and prints as its
//! last line the figures at 100 clients as JSON.
#![allow(clippy::print_stdout)]

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use retrysafe::ConfigError;
use retrysafe::retry::{Backoff, Jitter, RetryRng};

/// The first backoff step.
const BASE: Duration = Duration::from_millis(5);
/// The largest backoff.
const CAP: Duration = Duration::from_secs(2);
/// Mean and standard deviation of one message's network latency, in milliseconds.
const NET_MEAN_MS: f64 = 10.0;
const NET_SD_MS: f64 = 2.0;
/// Client counts simulated: 10, 20, …, 190.
const CLIENTS: [usize; 19] = [
    10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180, 190,
];
/// The client count of the JSON line.
const JSON_CLIENTS: usize = 100;
/// Seeded runs averaged per point.
const DEFAULT_RUNS: u32 = 10;
/// The default seed.
const DEFAULT_SEED: u64 = 2015;

/// How a client waits after a conflict.
#[derive(Debug, Clone, Copy)]
enum Strategy {
    /// Retry at once.
    NoBackoff,
    /// retrysafe's backoff with this jitter.
    Backoff(Jitter),
}

/// The strategies compared: JSON key, label, strategy, chart colour.
const STRATEGIES: [(&str, &str, Strategy, &str); 5] = [
    ("no_backoff", "no backoff", Strategy::NoBackoff, "#7f7f7f"),
    (
        "exponential",
        "exponential, no jitter",
        Strategy::Backoff(Jitter::None),
        "#d62728",
    ),
    (
        "full",
        "full jitter",
        Strategy::Backoff(Jitter::Full),
        "#1f77b4",
    ),
    (
        "equal",
        "equal jitter",
        Strategy::Backoff(Jitter::Equal),
        "#ff7f0e",
    ),
    (
        "decorrelated",
        "decorrelated jitter",
        Strategy::Backoff(Jitter::Decorrelated),
        "#2ca02c",
    ),
];

/// What travels on the simulated network; `usize` is the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Message {
    /// A read arriving at the server.
    Read(usize),
    /// The server's answer to a read: the row's version.
    ReadReply(usize, u64),
    /// A write, conditional on the version read, arriving at the server.
    Write(usize, u64),
    /// The server's answer to a write: whether it was applied.
    WriteReply(usize, bool),
}

/// One client: the retry state `RetryLayer` keeps per logical request.
#[derive(Debug)]
struct Client {
    retries: u32,
    previous: Duration,
    rng: RetryRng,
}

/// The figures of one run, or a sum or mean of runs.
#[derive(Debug, Clone, Copy, Default)]
struct Outcome {
    /// Conditional writes made.
    calls: u64,
    /// Virtual time until the last client learned that its write succeeded.
    time: Duration,
}

/// The network: every message takes |N(10, 2)| ms, drawn from its own seeded stream.
#[derive(Debug)]
struct Network {
    rng: RetryRng,
}

impl Network {
    fn latency(&mut self) -> Duration {
        // Box–Muller; `1 - unit()` is in (0, 1], so the logarithm is finite.
        let u1 = 1.0 - self.rng.unit();
        let u2 = self.rng.unit();
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        let ms = (NET_MEAN_MS + NET_SD_MS * z).abs();
        Duration::try_from_secs_f64(ms / 1000.0).unwrap_or(Duration::ZERO)
    }
}

/// The backoff of a strategy; `None` retries at once.
fn backoff_of(strategy: Strategy) -> Result<Option<Backoff>, ConfigError> {
    match strategy {
        Strategy::NoBackoff => Ok(None),
        Strategy::Backoff(jitter) => Backoff::new(BASE, CAP, jitter).build().map(Some),
    }
}

/// One run: `clients` clients, each writing the row once.
fn simulate(clients: usize, backoff: Option<Backoff>, seed: u64) -> Outcome {
    let mut net = Network {
        rng: RetryRng::seeded(seed),
    };
    let clients_seed = mix(seed, 0x6a69_7474_6572);
    let mut states: Vec<Client> = (0..clients as u64)
        .map(|n| Client {
            retries: 0,
            previous: Duration::ZERO,
            rng: RetryRng::seeded(mix(clients_seed, n)),
        })
        .collect();

    // Events ordered by virtual time, then by the order they were scheduled.
    let mut queue: BinaryHeap<Reverse<(Duration, u64, Message)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut send = |queue: &mut BinaryHeap<_>, at: Duration, message: Message| {
        queue.push(Reverse((at, seq, message)));
        seq += 1;
    };
    for client in 0..clients {
        send(&mut queue, net.latency(), Message::Read(client));
    }

    let mut version = 0u64;
    let mut outcome = Outcome::default();
    while let Some(Reverse((now, _, message))) = queue.pop() {
        outcome.time = now;
        match message {
            Message::Read(client) => {
                let at = now + net.latency();
                send(&mut queue, at, Message::ReadReply(client, version));
            }
            Message::ReadReply(client, seen) => {
                let at = now + net.latency();
                send(&mut queue, at, Message::Write(client, seen));
            }
            Message::Write(client, seen) => {
                outcome.calls += 1;
                let applied = seen == version;
                if applied {
                    version += 1;
                }
                let at = now + net.latency();
                send(&mut queue, at, Message::WriteReply(client, applied));
            }
            Message::WriteReply(_, true) => {}
            Message::WriteReply(client, false) => {
                let wait = match (backoff, states.get_mut(client)) {
                    (Some(backoff), Some(state)) => {
                        let delay =
                            backoff.delay(state.retries, state.previous, false, &mut state.rng);
                        state.retries += 1;
                        state.previous = delay;
                        delay
                    }
                    _ => Duration::ZERO,
                };
                let at = now + wait + net.latency();
                send(&mut queue, at, Message::Read(client));
            }
        }
    }
    outcome
}

/// The mean of `runs` seeded runs.
fn mean(clients: usize, backoff: Option<Backoff>, seed: u64, runs: u32) -> Outcome {
    let mut sum = Outcome::default();
    for run in 0..runs {
        // The same streams for every strategy (common random numbers).
        let run_seed = mix(mix(seed, clients as u64), u64::from(run));
        let one = simulate(clients, backoff, run_seed);
        sum.calls += one.calls;
        sum.time += one.time;
    }
    let runs = runs.max(1);
    Outcome {
        calls: (sum.calls + u64::from(runs) / 2) / u64::from(runs),
        time: sum.time / runs,
    }
}

/// A seed derived from two numbers (splitmix64 of their combination).
fn mix(a: u64, b: u64) -> u64 {
    let mut z = a
        .rotate_left(17)
        .wrapping_add(b)
        .wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Command-line options.
#[derive(Debug)]
struct Options {
    seed: u64,
    runs: u32,
    out: PathBuf,
}

const USAGE: &str = "usage: jitter [--seed N] [--runs N] [--out PATH]";

fn parse_args() -> Result<Options, String> {
    let mut options = Options {
        seed: DEFAULT_SEED,
        runs: DEFAULT_RUNS,
        out: default_out(),
    };
    let mut args = std::env::args_os()
        .skip(1)
        .map(|a| {
            a.into_string()
                .map_err(|a| format!("argument {a:?} is not valid UTF-8"))
        })
        .collect::<Result<Vec<String>, String>>()?
        .into_iter();
    while let Some(flag) = args.next() {
        if flag == "-h" || flag == "--help" {
            return Err(USAGE.to_owned());
        }
        let value = args
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        match flag.as_str() {
            "--seed" => {
                options.seed = value.parse().map_err(|e| format!("--seed {value}: {e}"))?;
            }
            "--runs" => {
                options.runs = value
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| format!("--runs {value}: expected a positive integer"))?;
            }
            "--out" => options.out = PathBuf::from(value),
            _ => return Err(format!("unknown argument {flag}\n{USAGE}")),
        }
    }
    Ok(options)
}

/// `$CARGO_TARGET_DIR/jitter.svg` when set, else `target/jitter.svg` of this workspace.
fn default_out() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(
            || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"),
            PathBuf::from,
        )
        .join("jitter.svg")
}

/// Results: one row per client count, one `Outcome` per strategy.
type Table = Vec<(usize, [Outcome; 5])>;

fn print_table(title: &str, table: &Table, value: impl Fn(&Outcome) -> u64) {
    println!("{title}");
    let mut header = format!("{:>7}", "clients");
    for (key, ..) in STRATEGIES {
        let _ = write!(header, " {key:>12}");
    }
    println!("{header}");
    for (clients, outcomes) in table {
        let mut line = format!("{clients:>7}");
        for outcome in outcomes {
            let _ = write!(line, " {:>12}", value(outcome));
        }
        println!("{line}");
    }
    println!();
}

/// A round step giving about five ticks up to `max`.
fn tick_step(max: u64) -> u64 {
    let rough = (max / 5).max(1);
    let mut magnitude = 1u64;
    while magnitude.saturating_mul(10) <= rough {
        magnitude *= 10;
    }
    [1, 2, 5, 10]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|&step| step >= rough)
        .unwrap_or(rough)
}

/// How a panel's y axis maps values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scale {
    Linear,
    /// Base 10, for values that span orders of magnitude.
    Log,
}

/// One chart panel at `(x0, y0)`, `w` × `h` pixels.
fn panel(
    svg: &mut String,
    (x0, y0, w, h): (f64, f64, f64, f64),
    (title, y_label, scale): (&str, &str, Scale),
    table: &Table,
    value: impl Fn(&Outcome) -> u64,
) {
    let (left, right, top, bottom) = (70.0, 20.0, 40.0, 50.0);
    let (px, py) = (x0 + left, y0 + top);
    let (pw, ph) = (w - left - right, h - top - bottom);
    let x_min = CLIENTS.first().copied().unwrap_or(0) as f64;
    let x_max = CLIENTS.last().copied().unwrap_or(1) as f64;
    let values = || {
        table
            .iter()
            .flat_map(|(_, outcomes)| outcomes.iter().map(&value))
    };
    let max = values().max().unwrap_or(1).max(1);
    let min = values().min().unwrap_or(1).max(1);
    // The y ticks, the lowest and the highest being the axis' ends.
    let ticks: Vec<u64> = match scale {
        Scale::Linear => {
            let step = tick_step(max);
            (0..=max.div_ceil(step)).map(|i| i * step).collect()
        }
        Scale::Log => {
            let mut low = 1u64;
            while low.saturating_mul(10) <= min {
                low *= 10;
            }
            let mut ticks = vec![low];
            while ticks.last().is_some_and(|&t| t < max) {
                ticks.push(ticks.last().map_or(1, |t| t.saturating_mul(10)));
            }
            if ticks.len() < 2 {
                ticks.push(low.saturating_mul(10));
            }
            ticks
        }
    };
    let transform = |y: u64| match scale {
        Scale::Linear => y as f64,
        Scale::Log => (y.max(1) as f64).log10(),
    };
    let y_low = transform(ticks.first().copied().unwrap_or(0));
    let y_high = transform(ticks.last().copied().unwrap_or(1));
    let x_at = |x: f64| px + (x - x_min) / (x_max - x_min) * pw;
    let y_at = |y: u64| py + ph - (transform(y) - y_low) / (y_high - y_low) * ph;

    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="16" font-weight="bold">{title}</text>"#,
        px + pw / 2.0,
        y0 + 24.0
    );
    // Grid and y ticks.
    for &y in &ticks {
        let yy = y_at(y);
        let _ = writeln!(
            svg,
            r##"<line x1="{px:.1}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#e0e0e0"/>"##,
            px + pw
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="11">{y}</text>"#,
            px - 6.0,
            yy + 4.0
        );
    }
    // x ticks.
    for clients in CLIENTS.iter().step_by(2) {
        let xx = x_at(*clients as f64);
        let _ = writeln!(
            svg,
            r##"<line x1="{xx:.1}" y1="{:.1}" x2="{xx:.1}" y2="{:.1}" stroke="#000"/>"##,
            py + ph,
            py + ph + 5.0
        );
        let _ = writeln!(
            svg,
            r#"<text x="{xx:.1}" y="{:.1}" text-anchor="middle" font-size="11">{clients}</text>"#,
            py + ph + 18.0
        );
    }
    // Axes and their labels.
    let _ = writeln!(
        svg,
        r##"<polyline points="{px:.1},{py:.1} {px:.1},{:.1} {:.1},{:.1}" fill="none" stroke="#000"/>"##,
        py + ph,
        px + pw,
        py + ph
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="13">clients</text>"#,
        px + pw / 2.0,
        py + ph + 38.0
    );
    let (lx, ly) = (x0 + 16.0, py + ph / 2.0);
    let _ = writeln!(
        svg,
        r#"<text x="{lx:.1}" y="{ly:.1}" text-anchor="middle" font-size="13" transform="rotate(-90 {lx:.1} {ly:.1})">{y_label}</text>"#
    );
    // One polyline per strategy.
    for (index, (_, _, _, colour)) in STRATEGIES.iter().enumerate() {
        let points: Vec<String> = table
            .iter()
            .filter_map(|(clients, outcomes)| {
                let outcome = outcomes.get(index)?;
                Some(format!(
                    "{:.1},{:.1}",
                    x_at(*clients as f64),
                    y_at(value(outcome))
                ))
            })
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#,
            points.join(" ")
        );
    }
}

/// The chart: calls and time against clients, side by side, with one legend.
fn chart(table: &Table, seed: u64, runs: u32) -> String {
    let (width, height, panel_w, panel_h) = (1000.0, 500.0, 500.0, 420.0);
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif">"#
    );
    let _ = writeln!(
        svg,
        "<title>Exponential backoff and jitter: {} to {} clients on one OCC row, base 5 ms, cap 2 s, seed {seed}, mean of {runs} runs</title>",
        CLIENTS.first().copied().unwrap_or(0),
        CLIENTS.last().copied().unwrap_or(0),
    );
    let _ = writeln!(
        svg,
        r#"<rect width="{width}" height="{height}" fill="white"/>"#
    );
    panel(
        &mut svg,
        (0.0, 0.0, panel_w, panel_h),
        ("Work: calls", "calls (mean per run)", Scale::Linear),
        table,
        |o| o.calls,
    );
    panel(
        &mut svg,
        (panel_w, 0.0, panel_w, panel_h),
        ("Completion time", "milliseconds (log scale)", Scale::Log),
        table,
        |o| millis(o.time),
    );
    for (index, (_, label, _, colour)) in STRATEGIES.iter().enumerate() {
        let x = 70.0 + 185.0 * index as f64;
        let y = panel_h + 40.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{x:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{colour}" stroke-width="3"/>"#,
            x + 24.0
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" font-size="12">{label}</text>"#,
            x + 30.0,
            y + 4.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// The last line: the figures at 100 clients.
fn json_line(outcomes: &[Outcome; 5]) -> String {
    let field = |value: &dyn Fn(&Outcome) -> u64| {
        STRATEGIES
            .iter()
            .zip(outcomes)
            .map(|((key, ..), outcome)| format!("\"{key}\": {}", value(outcome)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "{{\"clients\": {JSON_CLIENTS}, \"calls\": {{{}}}, \"time_ms\": {{{}}}}}",
        field(&|o| o.calls),
        field(&|o| millis(o.time)),
    )
}

fn main() -> ExitCode {
    let options = match parse_args() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    println!(
        "{} to {} clients write one row under optimistic concurrency; base 5 ms, cap 2 s, \
         network |N(10, 2)| ms; seed {}, mean of {} runs per point",
        CLIENTS.first().copied().unwrap_or(0),
        CLIENTS.last().copied().unwrap_or(0),
        options.seed,
        options.runs
    );
    println!();

    let mut backoffs = [None; 5];
    for (slot, (_, _, strategy, _)) in backoffs.iter_mut().zip(STRATEGIES) {
        match backoff_of(strategy) {
            Ok(backoff) => *slot = backoff,
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let table: Table = CLIENTS
        .iter()
        .map(|&clients| {
            let outcomes =
                backoffs.map(|backoff| mean(clients, backoff, options.seed, options.runs));
            (clients, outcomes)
        })
        .collect();

    print_table("calls (conditional writes, mean per run)", &table, |o| {
        o.calls
    });
    print_table(
        "time until every client has written (virtual ms, mean per run)",
        &table,
        |o| millis(o.time),
    );

    let svg = chart(&table, options.seed, options.runs);
    if let Some(dir) = options.out.parent().filter(|d| !d.as_os_str().is_empty())
        && let Err(e) = std::fs::create_dir_all(dir)
    {
        eprintln!("cannot create {}: {e}", dir.display());
        return ExitCode::FAILURE;
    }
    if let Err(e) = std::fs::write(&options.out, svg) {
        eprintln!("cannot write {}: {e}", options.out.display());
        return ExitCode::FAILURE;
    }
    println!("wrote {}", options.out.display());

    let Some((_, at_json)) = table.iter().find(|(c, _)| *c == JSON_CLIENTS) else {
        eprintln!("no run at {JSON_CLIENTS} clients");
        return ExitCode::FAILURE;
    };
    println!("{}", json_line(at_json));
    ExitCode::SUCCESS
}
