//! The latency a guard adds at a fixed offered rate, against real Redis and PostgreSQL
//! over loopback, beside the stores' own round trip (`cargo bench --bench
//! stores_latency`, or `scripts/bench-store-latency`).
//!
//! An open-loop driver offers `LATENCY_RATE` requests per second (default 500) for
//! `LATENCY_SECS` (10) to each case: a schedule of send times `i / rate` apart, taken
//! by `LATENCY_CONNS` (16) hyper HTTP/1.1 keep-alive connections, each sending the next
//! due request as soon as it is free. A request's latency runs from the moment the
//! driver issues it (not its scheduled time: the timer wakes up to a millisecond late)
//! to its answer read whole, so a stall also delays the requests queued behind it for
//! a free connection. Every request is a first one (a new `Idempotency-Key`: claim,
//! handler, complete), and every answer is checked (201, the handler's body, not a
//! replay); a run with a wrong answer is reported and left out.
//!
//! Cases, each an axum app of `retrysafe_test_support::bench::stores` served in this
//! process (a tokio runtime of 2 workers, shared with the driver): `bare` (the same
//! handler unguarded), `memory`, `redis`, `postgres` (an
//! `IdempotencyLayer` over each store) and `postgres-tx` (the transactional layer);
//! and the stores' own round trip at the same rate: Redis `PING` on a connection of
//! the redis case's type, PostgreSQL `SELECT 1` on the postgres case's pool. Each of
//! `LATENCY_ROUNDS` (3) rounds runs every case once, in an order that rotates every
//! round, after `LATENCY_WARMUP_MS` (500) of the same load.
//!
//! The report gives, per case, p50 and p99 of each round (median and range over the
//! rounds) and, for the guarded cases, the same round's p50 and p99 less bare's.
//! Redis keys live under a prefix and PostgreSQL tables in a schema of the run's own,
//! both removed at the end (see `retrysafe_test_support::bench::stores`).
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout, // the bench's output is its tables
    clippy::cast_possible_truncation,
    clippy::cast_precision_loss,
    clippy::cast_sign_loss,
    missing_docs
)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use retrysafe_postgres::sqlx::PgPool;
use retrysafe_redis::redis::aio::ConnectionManager;
use retrysafe_test_support::bench::http1::open_http;
use retrysafe_test_support::bench::load::loadavg;
use retrysafe_test_support::bench::stores::*;
use tokio::sync::{Mutex, mpsc};
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};

/// Like `stores::run`, whose settings this bench does not use: on 2 runtime workers,
/// the environment described first and removed last.
fn main() -> Res<()> {
    let offered = Offered::from_env()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let env = Env::setup().await?;
        println!(
            "# Store benchmarks: latency at a fixed offered rate (`benches/stores_latency.rs`)\n"
        );
        let result = match env.describe().await {
            Ok(described) => {
                println!("{described}\n");
                match Servers::start(&env).await {
                    Ok(servers) => rounds(&offered, &servers, &env).await,
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        };
        println!("\nload average at the end: {}", loadavg());
        env.cleanup().await;
        result
    })
}

struct Offered {
    rate: u64,
    secs: Duration,
    conns: usize,
    rounds: usize,
    warmup: Duration,
}

impl Offered {
    fn from_env() -> Res<Self> {
        let offered = Offered {
            rate: env_u64("LATENCY_RATE", 500)?,
            secs: Duration::from_secs(env_u64("LATENCY_SECS", 10)?),
            conns: env_usize("LATENCY_CONNS", 16)?,
            rounds: env_usize("LATENCY_ROUNDS", 3)?,
            warmup: Duration::from_millis(env_u64("LATENCY_WARMUP_MS", 500)?),
        };
        if offered.rate == 0 || offered.secs.is_zero() || offered.conns == 0 || offered.rounds == 0
        {
            return Err("LATENCY_RATE, _SECS, _CONNS and _ROUNDS must be > 0".into());
        }
        Ok(offered)
    }
}

#[derive(Clone)]
enum Op {
    Http(SocketAddr),
    RedisPing(ConnectionManager),
    PgSelect1(PgPool),
}

/// What one of the driver's connections holds.
enum Conn {
    Http(retrysafe_test_support::bench::http1::Sender),
    Shared,
}

impl Op {
    async fn open(&self) -> Res<Conn> {
        match self {
            Op::Http(addr) => Ok(Conn::Http(open_http(*addr).await?)),
            Op::RedisPing(_) | Op::PgSelect1(_) => Ok(Conn::Shared),
        }
    }

    async fn call(&self, conn: &mut Conn, keys: &AtomicU64) -> Result<(), String> {
        match (self, conn) {
            (Op::Http(_), Conn::Http(sender)) => {
                let answer = post_once(sender, "/payments", &fresh_key(keys))
                    .await
                    .map_err(|e| e.to_string())?;
                check(&answer, Expect::Ran, RESPONSE_JSON.as_bytes())
            }
            (Op::RedisPing(conn), _) => redis_ping(conn).await,
            (Op::PgSelect1(pool), _) => pg_select_1(pool).await,
            (Op::Http(_), Conn::Shared) => Err("no HTTP connection".to_owned()),
        }
    }
}

/// One run's latencies in µs, sorted, and its wrong answers.
struct Run {
    micros: Vec<u64>,
    errors: Vec<String>,
}

impl Run {
    fn quantile(&self, q: f64) -> f64 {
        let at = ((self.micros.len() - 1) as f64 * q).round() as usize;
        self.micros[at] as f64
    }
}

/// Offers `rate` calls of `op` per second for `secs` on `conns` connections.
async fn offer(op: &Op, offered: &Offered, secs: Duration, keys: &Arc<AtomicU64>) -> Res<Run> {
    let total = (offered.rate as f64 * secs.as_secs_f64()).round() as usize;
    let (tx, rx) = mpsc::channel::<Instant>(total.max(1));
    let rx = Arc::new(Mutex::new(rx));
    let mut workers = JoinSet::new();
    for _ in 0..offered.conns {
        let mut conn = op.open().await?;
        let (op, rx, keys) = (op.clone(), Arc::clone(&rx), Arc::clone(keys));
        workers.spawn(async move {
            let (mut micros, mut errors) = (Vec::new(), Vec::new());
            loop {
                let Some(issued) = rx.lock().await.recv().await else {
                    break;
                };
                match op.call(&mut conn, &keys).await {
                    Ok(()) => micros.push(issued.elapsed().as_micros() as u64),
                    Err(e) => errors.push(e),
                }
            }
            (micros, errors)
        });
    }
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / offered.rate as f64));
    ticks.set_missed_tick_behavior(MissedTickBehavior::Burst);
    for _ in 0..total {
        ticks.tick().await;
        tx.send(Instant::now())
            .await
            .map_err(|_| "the workers stopped")?;
    }
    drop(tx);
    let mut run = Run {
        micros: Vec::with_capacity(total),
        errors: Vec::new(),
    };
    while let Some(done) = workers.join_next().await {
        let (micros, errors) = done?;
        run.micros.extend(micros);
        run.errors.extend(errors);
    }
    run.micros.sort_unstable();
    if run.micros.is_empty() {
        run.errors.push("no answer".to_owned());
    }
    Ok(run)
}

const BARE: &str = "bare";

async fn rounds(offered: &Offered, servers: &Servers, env: &Env) -> Res<()> {
    let cases: Vec<(&str, Op)> = vec![
        (BARE, Op::Http(servers.bare)),
        ("memory", Op::Http(servers.memory)),
        ("redis", Op::Http(servers.redis)),
        ("postgres", Op::Http(servers.postgres)),
        ("postgres-tx", Op::Http(servers.tx)),
        ("redis PING", Op::RedisPing(env.redis.clone())),
        (
            "postgres SELECT 1",
            Op::PgSelect1(servers.postgres_store.pool().clone()),
        ),
    ];
    println!(
        "offered: {} requests/s for {} s per case and round, {} connections, {} rounds, {} ms of warm-up\n",
        offered.rate,
        offered.secs.as_secs_f64(),
        offered.conns,
        offered.rounds,
        offered.warmup.as_millis()
    );
    let keys = Arc::new(AtomicU64::new(0));
    // per case: (p50, p99) per round; None for a round with a wrong answer.
    let mut results: Vec<Vec<Option<(f64, f64)>>> = vec![Vec::new(); cases.len()];
    for round in 0..offered.rounds {
        let mut line = format!("round {} (load average {}):", round + 1, loadavg());
        for k in 0..cases.len() {
            let i = (k + round) % cases.len();
            let (name, op) = &cases[i];
            offer(op, offered, offered.warmup, &keys).await?;
            let run = offer(op, offered, offered.secs, &keys).await?;
            if run.errors.is_empty() {
                let (p50, p99) = (run.quantile(0.50), run.quantile(0.99));
                line.push_str(&format!(" {name} {p50:.0}/{p99:.0} µs;"));
                results[i].push(Some((p50, p99)));
            } else {
                line.push_str(&format!(
                    " {name}: {} wrong answers, left out (first: {});",
                    run.errors.len(),
                    run.errors[0]
                ));
                results[i].push(None);
            }
        }
        println!("{line}");
    }
    report(&cases, &results);
    Ok(())
}

/// "median (min–max)" of `v`, in µs or ms.
fn spread(v: &[f64]) -> String {
    if v.is_empty() {
        return "—".to_owned();
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let median = if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    };
    let ms = |us: f64| format!("{:.2}", us / 1000.0);
    format!("{} ({}–{})", ms(median), ms(s[0]), ms(s[n - 1]))
}

fn report(cases: &[(&str, Op)], results: &[Vec<Option<(f64, f64)>>]) {
    println!(
        "\n| case | p50, ms | p99, ms | added p50 over bare, ms | added p99 over bare, ms | rounds |"
    );
    println!("|---|---|---|---|---|---|");
    let bare = &results[0];
    for (i, (name, op)) in cases.iter().enumerate() {
        let ok: Vec<(f64, f64)> = results[i].iter().flatten().copied().collect();
        let p50: Vec<f64> = ok.iter().map(|r| r.0).collect();
        let p99: Vec<f64> = ok.iter().map(|r| r.1).collect();
        let (added50, added99): (Vec<f64>, Vec<f64>) = if matches!(op, Op::Http(_)) && i > 0 {
            results[i]
                .iter()
                .zip(bare)
                .filter_map(|(c, b)| Some((c.as_ref()?, b.as_ref()?)))
                .map(|(c, b)| (c.0 - b.0, c.1 - b.1))
                .unzip()
        } else {
            (Vec::new(), Vec::new())
        };
        println!(
            "| {name} | {} | {} | {} | {} | {} |",
            spread(&p50),
            spread(&p99),
            spread(&added50),
            spread(&added99),
            ok.len()
        );
    }
    println!("\nmedian (min–max) over rounds; \"added\" is the same round's figure less bare's.");
}
