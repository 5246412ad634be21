//! Latency and throughput of the idempotency stores over loopback HTTP, next to the
//! bare app and to one store round trip measured in the same run, against real Redis
//! and PostgreSQL servers (`cargo bench --bench stores_load`).
//!
//! **Latency and throughput**, `STORE_BENCH_ROUNDS` alternated rounds (the order of
//! the cases rotates each round). In each round: every case with 1 client for
//! `STORE_BENCH_LATENCY_SECS` (the clean latency), then with `STORE_BENCH_CLIENTS`
//! clients for `STORE_BENCH_SECS` (throughput), each after `STORE_BENCH_WARMUP_MS`
//! of warm-up. The store's own round trip is measured as more cases of the same
//! phase: Redis `PING` on the redis case's connection type, PostgreSQL `SELECT 1` on
//! the postgres case's pool, and, since every PostgreSQL write waits for a WAL
//! flush, one autocommit `INSERT` on that pool (a round trip with a durable commit).
//!
//! Each guarded case runs as `first` (a new key for every request: claim, handler,
//! complete) and `replay` (every client repeats its own completed key, which the
//! client stores again in the warm-up should the MemoryStore have evicted it). Clients
//! are hyper HTTP/1.1 connections (keep-alive, `TCP_NODELAY`), one per client, in the
//! same process and tokio runtime (2 worker threads; `STORE_BENCH_WORKERS=1` runs
//! everything on one current-thread runtime) as the servers. Every answer is checked
//! (status, body, `idempotent-replayed`); a wrong one counts as an error and is shown.
//!
//! Redis keys live under a random 10-character prefix (as long as the default
//! `retrysafe:`), PostgreSQL tables in a schema `rsbench_<unix time>_<random>`; both are
//! removed at the end (schemas left by a crashed run are dropped after an hour; Redis
//! keys expire after the 1 h retention the bench configures). The cases and the app:
//! `retrysafe_test_support::bench::stores`.
//!
//! With Redis at `REDIS_URL` (default `redis://127.0.0.1:6379`) and PostgreSQL at
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`):
//! `scripts/bench-stores` runs the three store benches (`stores_bytes`,
//! `stores_round_trips`, `stores_load`) in that order.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout, // the bench's output is its tables
    missing_docs
)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use retrysafe::idempotency::MemoryStore;
use retrysafe_postgres::sqlx::{self, PgPool};
use retrysafe_redis::redis::aio::ConnectionManager;
use retrysafe_test_support::bench::http1::{Sender, open_http};
use retrysafe_test_support::bench::load::*;
use retrysafe_test_support::bench::stores;
use retrysafe_test_support::bench::stores::*;
use tokio::task::JoinSet;
use tokio::time::Instant;

fn main() -> Res<()> {
    stores::run(
        "latency and throughput (`benches/stores_load.rs`)",
        async |settings, env| {
            let servers = Servers::start(env).await?;
            load_rounds(settings, &servers).await
        },
    )
}

/// The CPU readings that count this process, `redis-server` and `postgres` as ours.
fn cpu_ticks() -> Option<Ticks> {
    ticks_named(&["redis-server", "postgres"])
}

/// The share of the machine's CPUs that other processes used since `since` (from
/// [`cpu_ticks`]), in percent.
fn foreign_cpu(since: Option<Ticks>) -> String {
    let share = others(since, cpu_ticks(), 0);
    if share.is_nan() {
        "?".to_owned()
    } else {
        format!("{share:.0} %")
    }
}

/// The time of day, UTC, `hh:mm:ss`.
fn utc_time() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        % 86_400;
    format!("{:02}:{:02}:{:02}", secs / 3600, secs / 60 % 60, secs % 60)
}

#[derive(Clone)]
enum Op {
    /// A POST through one of the servers.
    Http {
        addr: SocketAddr,
        replay: bool,
        tag: &'static str,
    },
    /// Redis `PING` on a connection of the redis case's type.
    RedisPing(ConnectionManager),
    /// PostgreSQL `SELECT 1` on the postgres case's pool.
    PgSelect1(PgPool),
    /// PostgreSQL: one autocommit `INSERT` (one durable commit) on the postgres case's
    /// pool; the SQL.
    PgInsert(PgPool, Arc<str>),
}

enum Conn {
    Http(Sender),
    Shared,
}

impl Op {
    async fn open(&self) -> Res<Conn> {
        match self {
            Op::Http { addr, .. } => Ok(Conn::Http(open_http(*addr).await?)),
            Op::RedisPing(_) | Op::PgSelect1(_) | Op::PgInsert(..) => Ok(Conn::Shared),
        }
    }

    async fn call(&self, conn: &mut Conn, client: usize, keys: &AtomicU64) -> Result<(), String> {
        match (self, conn) {
            (Op::Http { replay, tag, .. }, Conn::Http(sender)) => {
                let (key, expect) = if *replay {
                    (replay_key(tag, client), Expect::Replayed)
                } else {
                    (fresh_key(keys), Expect::Ran)
                };
                let answer = post_once(sender, "/payments", &key)
                    .await
                    .map_err(|e| e.to_string())?;
                check(&answer, expect, RESPONSE_JSON.as_bytes())
            }
            (Op::RedisPing(conn), _) => redis_ping(conn).await,
            (Op::PgSelect1(pool), _) => pg_select_1(pool).await,
            (Op::PgInsert(pool, sql), _) => {
                let insert = sqlx::query(sql).execute(pool);
                match tokio::time::timeout(REQUEST_TIMEOUT, insert).await {
                    Ok(Ok(done)) if done.rows_affected() == 1 => Ok(()),
                    Ok(Ok(done)) => Err(format!("INSERT affected {}", done.rows_affected())),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("INSERT timed out".to_owned()),
                }
            }
            (Op::Http { .. }, Conn::Shared) => Err("no HTTP connection".to_owned()),
        }
    }
}

struct Case {
    name: &'static str,
    op: Op,
    /// The cases whose p50 this case's overhead is expressed in.
    probes: &'static [&'static str],
}

const BARE: &str = "bare";
const REDIS_PING: &str = "redis PING";
const PG_SELECT1: &str = "postgres SELECT 1";
const PG_INSERT: &str = "postgres INSERT";
const REDIS_PROBES: &[&str] = &[REDIS_PING];
const PG_PROBES: &[&str] = &[PG_SELECT1, PG_INSERT];

fn cases(servers: &Servers) -> Vec<Case> {
    let http = |name, addr, replay, tag, probes| Case {
        name,
        op: Op::Http { addr, replay, tag },
        probes,
    };
    let pool = servers.postgres_store.pool().clone();
    vec![
        http(BARE, servers.bare, false, "bare", &[]),
        http("memory first", servers.memory, false, "memory", &[]),
        http("memory replay", servers.memory, true, "memory", &[]),
        http("redis first", servers.redis, false, "redis", REDIS_PROBES),
        http("redis replay", servers.redis, true, "redis", REDIS_PROBES),
        http("postgres first", servers.postgres, false, "pg", PG_PROBES),
        http("postgres replay", servers.postgres, true, "pg", PG_PROBES),
        http("postgres-tx first", servers.tx, false, "tx", PG_PROBES),
        http("postgres-tx replay", servers.tx, true, "tx", PG_PROBES),
        Case {
            name: REDIS_PING,
            op: Op::RedisPing(servers.redis_store.connection().clone()),
            probes: &[],
        },
        Case {
            name: PG_SELECT1,
            op: Op::PgSelect1(pool.clone()),
            probes: &[],
        },
        Case {
            name: PG_INSERT,
            op: Op::PgInsert(pool, Arc::from(servers.probe_insert.as_str())),
            probes: &[],
        },
    ]
}

#[derive(Debug, Clone, Default)]
struct Summary {
    ops: u64,
    errors: u64,
    first_error: Option<String>,
    rps: f64,
    p50_us: f64,
    p99_us: f64,
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The value at quantile `permille` / 1000 of sorted `v` (nearest rank), in µs.
fn quantile_us(v: &[u64], permille: usize) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = (permille * v.len()).div_ceil(1000).clamp(1, v.len());
    v[rank - 1] as f64 / 1_000.0
}

/// `clients` closed-loop clients run `op` for `warmup + measure`; the requests that
/// complete within the measured window count (throughput, latency quantiles). Errors
/// are counted at any time.
async fn drive(
    op: &Op,
    clients: usize,
    warmup: Duration,
    measure: Duration,
    keys: &Arc<AtomicU64>,
) -> Res<Summary> {
    let mut conns = Vec::with_capacity(clients);
    for _ in 0..clients {
        conns.push(op.open().await?);
    }
    let start = Instant::now() + warmup;
    let end = start + measure;
    let mut set = JoinSet::new();
    for (client, mut conn) in conns.into_iter().enumerate() {
        let op = op.clone();
        let keys = Arc::clone(keys);
        set.spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0u64;
            let mut first_error = None;
            // A replay client's key, stored again if it is gone (the MemoryStore evicts
            // under its byte bound during the `first` runs); in the warm-up.
            if let (
                Op::Http {
                    replay: true, tag, ..
                },
                Conn::Http(sender),
            ) = (&op, &mut conn)
            {
                let primed = match post_once(sender, "/payments", &replay_key(tag, client)).await {
                    Ok(answer) => check(&answer, Expect::Either, RESPONSE_JSON.as_bytes()),
                    Err(e) => Err(e.to_string()),
                };
                if let Err(e) = primed {
                    errors += 1;
                    first_error = Some(format!("priming the replay key: {e}"));
                }
            }
            loop {
                let t0 = Instant::now();
                if t0 >= end {
                    break;
                }
                let result = op.call(&mut conn, client, &keys).await;
                let t1 = Instant::now();
                match result {
                    Ok(()) => {
                        if t1 >= start && t1 < end {
                            latencies.push(nanos(t1 - t0));
                        }
                    }
                    Err(e) => {
                        errors += 1;
                        first_error.get_or_insert(e);
                        let closed = matches!(&conn, Conn::Http(s) if s.is_closed());
                        if closed {
                            match op.open().await {
                                Ok(c) => conn = c,
                                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                            }
                        }
                    }
                }
            }
            (latencies, errors, first_error)
        });
    }
    let mut all = Vec::new();
    let mut summary = Summary::default();
    while let Some(done) = set.join_next().await {
        let (latencies, errors, first_error) = done?;
        all.extend(latencies);
        summary.errors += errors;
        if summary.first_error.is_none() {
            summary.first_error = first_error;
        }
    }
    all.sort_unstable();
    summary.ops = u64::try_from(all.len())?;
    summary.rps = all.len() as f64 / measure.as_secs_f64();
    summary.p50_us = quantile_us(&all, 500);
    summary.p99_us = quantile_us(&all, 990);
    Ok(summary)
}

struct PhaseResults {
    title: String,
    clients: usize,
    /// Per case name, one summary per round.
    by_case: HashMap<&'static str, Vec<Summary>>,
    loads: Vec<String>,
}

async fn load_rounds(settings: &Settings, servers: &Servers) -> Res<()> {
    eprintln!("phase 3: latency and throughput");
    let cases = cases(servers);
    let keys = Arc::new(AtomicU64::new(0));
    // Every client's replay key, completed once.
    for case in &cases {
        if let Op::Http {
            addr,
            replay: true,
            tag,
        } = &case.op
        {
            let mut sender = open_http(*addr).await?;
            for client in 0..settings.clients {
                let key = replay_key(tag, client);
                let answer = post_once(&mut sender, "/payments", &key).await?;
                check(&answer, Expect::Either, RESPONSE_JSON.as_bytes())
                    .map_err(|e| format!("{}: {e}", case.name))?;
            }
        }
    }
    let mut phases = [
        PhaseResults {
            title: format!(
                "1 client, {} s per case and round: latency",
                settings.latency_secs.as_secs()
            ),
            clients: 1,
            by_case: HashMap::new(),
            loads: Vec::new(),
        },
        PhaseResults {
            title: format!(
                "{} clients, {} s per case and round: throughput",
                settings.clients,
                settings.secs.as_secs()
            ),
            clients: settings.clients,
            by_case: HashMap::new(),
            loads: Vec::new(),
        },
    ];
    for round in 0..settings.rounds {
        for phase in &mut phases {
            let load = loadavg();
            let time = utc_time();
            eprintln!(
                "round {} of {} at {time} UTC, {}: load {load}",
                round + 1,
                settings.rounds,
                phase.title
            );
            let ticks = cpu_ticks();
            let measure = if phase.clients == 1 {
                settings.latency_secs
            } else {
                settings.secs
            };
            for i in 0..cases.len() {
                let case = &cases[(i + round) % cases.len()];
                let summary =
                    drive(&case.op, phase.clients, settings.warmup, measure, &keys).await?;
                eprintln!(
                    "  {:<20} {:>9.0} req/s  p50 {:>8.1} µs  p99 {:>8.1} µs  errors {}",
                    case.name, summary.rps, summary.p50_us, summary.p99_us, summary.errors
                );
                phase.by_case.entry(case.name).or_default().push(summary);
            }
            let foreign = foreign_cpu(ticks);
            eprintln!("  other processes used {foreign} of the CPUs");
            phase
                .loads
                .push(format!("load {load}, other processes {foreign}"));
        }
    }
    for phase in &phases {
        print_phase(phase, &cases);
    }
    println!(
        "\nThe memory case's store after the run: {} records cached ({} bytes by its \
         weigher, bound {}), {} in flight, {} evicted before their retention ended (the \
         `first` runs fill it to its bound; the replay runs store their keys again when \
         evicted, in the warm-up).",
        servers.memory_store.cached_len(),
        servers.memory_store.cached_bytes(),
        MemoryStore::DEFAULT_MAX_BYTES,
        servers.memory_store.in_flight_len(),
        servers.memory_evicted.load(Ordering::Relaxed),
    );
    Ok(())
}

fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if s.is_empty() {
        return f64::NAN;
    }
    s.sort_by(f64::total_cmp);
    let mid = s.len() / 2;
    if s.len() % 2 == 1 {
        s[mid]
    } else {
        (s[mid - 1] + s[mid]) / 2.0
    }
}

/// (max − min) / median, in percent.
fn spread(v: &[f64]) -> f64 {
    let max = v.iter().copied().fold(f64::MIN, f64::max);
    let min = v.iter().copied().fold(f64::MAX, f64::min);
    (max - min) / median(v) * 100.0
}

fn joined(v: &[f64], decimals: usize) -> String {
    v.iter()
        .map(|x| format!("{x:.decimals$}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

fn print_phase(phase: &PhaseResults, cases: &[Case]) {
    let get = |name: &str| phase.by_case.get(name).cloned().unwrap_or_default();
    let bare = get(BARE);
    println!("\n## {}\n", phase.title);
    println!(
        "Per round: load average (1/5/15 min) at the start (the bench itself keeps \
         about 3 threads busy), and the share of the CPUs that processes other than the \
         bench, `redis-server` and `postgres` used during the round: {}\n",
        phase.loads.join("; ")
    );
    println!(
        "| case | req/s (per round) | median | spread | ratio to `bare` (per round) | p50 µs \
         (per round) | p99 µs (per round) | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for case in cases {
        let runs = get(case.name);
        let rps: Vec<f64> = runs.iter().map(|s| s.rps).collect();
        let ratio: Vec<f64> = runs.iter().zip(&bare).map(|(s, b)| s.rps / b.rps).collect();
        let p50: Vec<f64> = runs.iter().map(|s| s.p50_us).collect();
        let p99: Vec<f64> = runs.iter().map(|s| s.p99_us).collect();
        let errors: u64 = runs.iter().map(|s| s.errors).sum();
        let first_error = runs
            .iter()
            .find_map(|s| s.first_error.clone())
            .map(|e| format!(" (first: {e})"))
            .unwrap_or_default();
        let ratio = if case.name == BARE || !matches!(case.op, Op::Http { .. }) {
            "—".to_owned()
        } else {
            joined(&ratio, 3)
        };
        println!(
            "| {} | {} | {:.0} | {:.1} % | {} | {} | {} | {errors}{first_error} |",
            case.name,
            joined(&rps, 0),
            median(&rps),
            spread(&rps),
            ratio,
            joined(&p50, 1),
            joined(&p99, 1),
        );
    }
    println!(
        "\nOverhead in store round trips: (p50 of the case − p50 of `bare`, same round) / \
         p50 of the probe (same phase, same round). `{REDIS_PING}` and `{PG_SELECT1}` are \
         one round trip; `{PG_INSERT}` is one autocommit insert: a round trip with a \
         durable commit.\n"
    );
    println!(
        "| case | p50 − `bare` p50, µs (per round) | probe | probe p50, µs (per round) | \
         multiple (per round) | median multiple |"
    );
    println!("|---|---|---|---|---|---|");
    for case in cases {
        if !matches!(case.op, Op::Http { .. }) || case.name == BARE {
            continue;
        }
        let runs = get(case.name);
        let over: Vec<f64> = runs
            .iter()
            .zip(&bare)
            .map(|(s, b)| s.p50_us - b.p50_us)
            .collect();
        if case.probes.is_empty() {
            println!("| {} | {} | — | — | — | — |", case.name, joined(&over, 1));
        }
        for probe in case.probes {
            let rtt: Vec<f64> = get(probe).iter().map(|s| s.p50_us).collect();
            let multiple: Vec<f64> = over.iter().zip(&rtt).map(|(o, r)| o / r).collect();
            println!(
                "| {} | {} | {probe} | {} | {} | {:.2} |",
                case.name,
                joined(&over, 1),
                joined(&rtt, 1),
                joined(&multiple, 2),
                median(&multiple),
            );
        }
    }
}
