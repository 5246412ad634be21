//! A payments API made safe to retry with the `IdempotencyLayer`, on an in-memory,
//! Redis or PostgreSQL backend.
//!
//! ```text
//! cargo run --example payments -- [--listen ADDR]
//!                                 [--store memory | redis://… | redis+sentinel://… | postgres://…]
//!                                 [--replicated-writes N:MS]
//!                                 [--lease-ms N] [--ttl-ms N] [--in-flight conflict|wait]
//!                                 [--max-execution-ms N] [--memory-bytes N]
//!                                 [--reconcile-ms N] [--metrics-listen ADDR] [--test-hooks]
//! ```
//!
//! Prints `listening on http://ADDR` once ready (ADDR is the address bound: the real
//! port when asked for port 0). Then, for example:
//!
//! ```text
//! curl -i -X POST localhost:3000/payments -H 'idempotency-key: order-1' \
//!      -H 'content-type: application/json' -d '{"account":"acme","amount_cents":1250}'
//! curl 'localhost:3000/payments?account=acme'
//! ```
//!
//! Send the POST twice: the second answer is the first one replayed
//! (`idempotent-replayed: true`) and the ledger holds one payment.
//!
//! With `--store redis://HOST:PORT` the idempotency records (a `RedisStore`) and the
//! ledger live in Redis; with `--store postgres://USER@HOST:PORT/DB` each payment is
//! inserted in the same transaction as its idempotency key (the `TxIdempotencyLayer`).
//! A Redis URL may name a node of a Redis Cluster: the store and the ledger then use
//! the cluster client (each payment in the hash slot of its idempotency record, so both
//! live on one node). With `--store redis+sentinel://HOST:PORT[,HOST:PORT…]/SERVICE`
//! the store and the ledger use the primary that Redis Sentinel names for SERVICE, and
//! follow it across failovers with no restart. A `redis://` URL of a read-only replica
//! is refused. `--replicated-writes N:MS` (Redis stores only) makes every claim, commit
//! point and completion wait until N replicas have it, for at most MS milliseconds
//! (`RedisStoreOptions::replicated_writes`): fewer acknowledged writes are lost on a failover.
//! Several instances on one Redis (or Redis Cluster, or Sentinel service) or one
//! PostgreSQL database behave as one. Two
//! environment variables keep instances apart: `PAYMENTS_REDIS_PREFIX` (the prefix of
//! every Redis key, default `payments:`) and `PAYMENTS_PG_SCHEMA` (the schema of the
//! tables, default none: the connection's `search_path`). See `app.rs` for the routes and
//! the test hooks `x-simulate-delay-ms`, `x-simulate-delay-after-ms` and
//! `x-simulate-fail`. One more test hook, `PAYMENTS_PG_MODE=plain`, runs PostgreSQL
//! without the transaction: the `IdempotencyLayer` over a `PostgresStore`, each payment
//! written on its own after the handler's commit point (as with Redis), so that tests can
//! compare the two modes; the default, `transactional`, is the mode described above.
//!
//! With `--metrics-listen ADDR`, the metrics of the layer, the store and the reconciler
//! (all named `payments`; see `retrysafe::observe`) are served as Prometheus text at
//! `GET /metrics` on ADDR, for example
//! `retrysafe_idempotency_requests_total{name="payments",decision="replay"} 1`.
#![allow(clippy::print_stdout)]

mod app;

use std::ffi::OsString;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use app::RedisConn;
use retrysafe::postgres::{PostgresStore, PostgresStoreError, SweeperHandle};
use retrysafe::redis::redis;
use retrysafe::redis::{RedisStore, RedisStoreError, RedisStoreOptions, SentinelConnection};
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

const USAGE: &str = "\
usage: payments [--listen ADDR]
                [--store memory | redis://... | redis+sentinel://... | postgres://...]
                [--replicated-writes N:MS] [--lease-ms N] [--ttl-ms N] [--in-flight conflict|wait]
                [--max-execution-ms N] [--memory-bytes N]
                [--reconcile-ms N] [--metrics-listen ADDR] [--test-hooks]

  --listen ADDR        address to listen on (default 127.0.0.1:3000; port 0 picks one)
  --store STORE        where idempotency records and payments live: `memory` (default),
                       a redis:// URL (RedisStore and a Redis ledger; a node of a Redis
                       Cluster finds the cluster; a read-only replica is refused),
                       redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE (the primary
                       Redis Sentinel names, followed across failovers), or a
                       postgres:// URL (key and payment in one PostgreSQL transaction);
                       instances sharing one Redis or database behave as one
  --replicated-writes N:MS
                       Redis stores only: each claim, commit point and completion waits
                       until N replicas have it, at most MS milliseconds (else 503)
  --lease-ms N         lease of a claim in milliseconds (default 5000); with postgres,
                       how long an idle transaction keeps its key (a vanished holder's)
  --ttl-ms N           how long completed keys are kept, in milliseconds (default 24 h)
  --in-flight MODE     a copy of a request still in progress: `conflict` answers 409
                       (default), `wait` waits up to 5 s for the original's answer
  --max-execution-ms N how long a handler may run, in milliseconds (default 10000); a
                       handler still running then is cancelled (memory and redis stores)
  --memory-bytes N     byte budget of the in-memory store (--store memory only)
  --reconcile-ms N     run the reconciler every N milliseconds: it resolves keys left
                       pending by a crashed holder from the ledger (0 = off; default
                       1000 for redis and postgres stores, off for memory)
  --metrics-listen ADDR
                       serve the metrics (layer, store, reconciler) as Prometheus text
                       at GET /metrics on ADDR
  --test-hooks         honour the test hook headers `x-simulate-crash: after-commit-point
                       | after-effect`, which aborts the process at that point, and
                       `x-simulate-failure: before-commit-point`, which answers 503
                       before the commit point (no payment; a retry runs again)

endpoints:
  POST /payments          JSON {\"account\": string, \"amount_cents\": integer}; the header
                          `idempotency-key` is required; answers 201 with
                          {\"id\", \"account\", \"amount_cents\"} and records one payment
  GET /payments?account=A answers {\"count\", \"total_cents\"} of account A's payments
  Both read `request-timeout-ms` (or `grpc-timeout`): a malformed value is answered
  400, no time left 504.

principal (whose keys a request's key is checked against):
  `authorization: Bearer TOKEN` is principal TOKEN; a request without the header is
  the anonymous principal. Keys of different principals never meet.

environment:
  PAYMENTS_REDIS_PREFIX   prefix of every Redis key (default `payments:`)
  PAYMENTS_PG_SCHEMA      PostgreSQL schema of the tables (default: the search_path)
  PAYMENTS_PG_MODE        `transactional` (default: key and payment in one transaction)
                          or `plain` (a test hook: a PostgresStore, payment on its own)

exit codes: 0 after ctrl-c, 1 on a runtime error or an unavailable store, 2 on bad arguments";

/// How often the reconciler runs with Redis and PostgreSQL unless `--reconcile-ms`
/// says otherwise.
const DEFAULT_RECONCILE: Duration = Duration::from_secs(1);

/// The default prefix of the Redis keys (`PAYMENTS_REDIS_PREFIX`).
const DEFAULT_REDIS_PREFIX: &str = "payments:";

/// The idempotency store asked for, with its URL.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Store {
    Memory,
    Redis(String),
    /// `redis+sentinel://HOST:PORT[,HOST:PORT…]/SERVICE`.
    RedisSentinel(Box<Sentinel>),
    Postgres(String),
}

/// A Redis Sentinel service: the sentinels' URLs and the service whose primary they
/// name.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Sentinel {
    sentinels: Vec<String>,
    service: String,
}

impl Store {
    fn is_redis(&self) -> bool {
        matches!(self, Store::Redis(_) | Store::RedisSentinel(_))
    }
}

/// `redis+sentinel://HOST:PORT[,HOST:PORT…]/SERVICE`.
fn parse_sentinel(url: &str) -> Result<Store, String> {
    let bad = |why: &str| {
        format!(
            "--store {url:?}: {why} (expected redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE)"
        )
    };
    let rest = url.strip_prefix("redis+sentinel://").unwrap_or(url);
    let (hosts, service) = rest
        .split_once('/')
        .ok_or_else(|| bad("no /SERVICE after the sentinels"))?;
    if service.is_empty() || service.contains(['/', '?', '#']) {
        return Err(bad("the service name must follow the last /, alone"));
    }
    if hosts.contains('@') {
        return Err(bad("credentials are not supported here"));
    }
    let sentinels = hosts
        .split(',')
        .map(|host_port| match host_port.rsplit_once(':') {
            Some((host, port))
                if !host.is_empty()
                    && !port.is_empty()
                    && port.bytes().all(|b| b.is_ascii_digit())
                    && port.parse::<u16>().is_ok_and(|p| p > 0) =>
            {
                Ok(format!("redis://{host_port}"))
            }
            _ => Err(bad(&format!("{host_port:?} is not HOST:PORT"))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Store::RedisSentinel(Box::new(Sentinel {
        sentinels,
        service: service.to_owned(),
    })))
}

/// `--replicated-writes N:MS`: replicas, then a timeout in milliseconds, both positive
/// whole numbers written in digits.
fn replicated_writes(value: &str) -> Result<(u32, Duration), String> {
    let bad = || {
        format!(
            "--replicated-writes must be N:MS, the replicas then a timeout in milliseconds, \
             both positive whole numbers (for example 1:500), not {value:?}"
        )
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let (n, ms) = value.split_once(':').ok_or_else(bad)?;
    if !digits(n) || !digits(ms) {
        return Err(bad());
    }
    let n = n.parse::<u32>().ok().filter(|&n| n > 0).ok_or_else(bad)?;
    let ms = ms
        .parse::<u64>()
        .ok()
        .filter(|&ms| ms > 0)
        .ok_or_else(bad)?;
    Ok((n, Duration::from_millis(ms)))
}

#[derive(Debug)]
struct Args {
    listen: String,
    metrics_listen: Option<String>,
    store: Store,
    /// `--replicated-writes`: replicas and timeout, for a Redis store.
    replicated_writes: Option<(u32, Duration)>,
    options: app::Options,
}

/// What the command line asks for.
#[derive(Debug)]
enum Command {
    Run(Args),
    Help,
}

fn parse_args(args: impl IntoIterator<Item = OsString>) -> Result<Command, String> {
    let mut listen = None;
    let mut store = None;
    let mut lease = None;
    let mut ttl = None;
    let mut in_flight = None;
    let mut max_execution = None;
    let mut memory_bytes = None;
    let mut reconcile = None;
    let mut metrics_listen = None;
    let mut replicated = None;
    let mut test_hooks = false;

    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let arg = arg
            .into_string()
            .map_err(|a| format!("argument {a:?} is not valid UTF-8"))?;
        if arg == "-h" || arg == "--help" {
            return Ok(Command::Help);
        }
        if arg == "--test-hooks" {
            if test_hooks {
                return Err("--test-hooks is given twice".to_owned());
            }
            test_hooks = true;
            continue;
        }
        // `--flag value` or `--flag=value`.
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => {
                (flag.to_owned(), Some(value.to_owned()))
            }
            _ => (arg, None),
        };
        let slot = match flag.as_str() {
            "--listen" => &mut listen,
            "--store" => &mut store,
            "--lease-ms" => &mut lease,
            "--ttl-ms" => &mut ttl,
            "--in-flight" => &mut in_flight,
            "--max-execution-ms" => &mut max_execution,
            "--memory-bytes" => &mut memory_bytes,
            "--reconcile-ms" => &mut reconcile,
            "--metrics-listen" => &mut metrics_listen,
            "--replicated-writes" => &mut replicated,
            other if other.starts_with('-') => return Err(format!("unknown option {other}")),
            other => return Err(format!("unexpected argument {other:?}")),
        };
        let value = match inline {
            Some(v) => v,
            None => args
                .next()
                .ok_or_else(|| format!("{flag} needs a value"))?
                .into_string()
                .map_err(|v| format!("the value of {flag}, {v:?}, is not valid UTF-8"))?,
        };
        if slot.replace(value).is_some() {
            return Err(format!("{flag} is given twice"));
        }
    }

    let store = match store.as_deref() {
        None | Some("memory") => Store::Memory,
        Some(s) if s.starts_with("redis://") || s.starts_with("rediss://") => {
            // A URL that does not parse is a mistake in the command line, not an outage.
            redis::IntoConnectionInfo::into_connection_info(s)
                .map_err(|e| format!("--store: invalid Redis URL {:?}: {e}", redact(s)))?;
            Store::Redis(s.to_owned())
        }
        Some(s) if s.starts_with("redis+sentinel://") => parse_sentinel(s)?,
        Some(s) if s.starts_with("postgres://") || s.starts_with("postgresql://") => {
            <retrysafe::postgres::sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(
                s,
            )
            .map_err(|e| format!("--store: invalid PostgreSQL URL {:?}: {e}", redact(s)))?;
            Store::Postgres(s.to_owned())
        }
        Some(other) => {
            return Err(format!(
                "--store must be `memory`, a redis:// URL, a redis+sentinel:// URL or a \
                 postgres:// URL, not {other:?}"
            ));
        }
    };
    let replicated_writes = match replicated {
        None => None,
        Some(_) if !store.is_redis() => {
            return Err(
                "--replicated-writes is for Redis stores (redis:// or redis+sentinel://)"
                    .to_owned(),
            );
        }
        Some(v) => Some(replicated_writes(&v)?),
    };
    let listen = listen.unwrap_or_else(|| "127.0.0.1:3000".to_owned());
    if listen.is_empty() {
        return Err("--listen needs an address such as 127.0.0.1:3000".to_owned());
    }
    if metrics_listen.as_deref() == Some("") {
        return Err("--metrics-listen needs an address such as 127.0.0.1:9000".to_owned());
    }
    let wait_for_in_flight = match in_flight.as_deref() {
        None | Some("conflict") => false,
        Some("wait") => true,
        Some(other) => {
            return Err(format!(
                "--in-flight must be `conflict` or `wait`, not {other:?}"
            ));
        }
    };
    let memory_bytes = match memory_bytes {
        None => None,
        Some(_) if !matches!(store, Store::Memory) => {
            return Err("--memory-bytes is for --store memory".to_owned());
        }
        Some(v) => match v.parse::<u64>() {
            Ok(n) if n > 0 => Some(n),
            _ => {
                return Err(format!(
                    "--memory-bytes must be a positive whole number of bytes, not {v:?}"
                ));
            }
        },
    };
    let reconcile = match reconcile {
        None if store == Store::Memory => None,
        None => Some(DEFAULT_RECONCILE),
        Some(v) => match v.parse::<u64>() {
            Ok(0) => None,
            Ok(n) => Some(Duration::from_millis(n)),
            Err(_) => {
                return Err(format!(
                    "--reconcile-ms must be a whole number of milliseconds (0 = off), not {v:?}"
                ));
            }
        },
    };
    Ok(Command::Run(Args {
        listen,
        metrics_listen,
        store,
        replicated_writes,
        options: app::Options {
            lease: lease.map(|v| millis("--lease-ms", &v)).transpose()?,
            retention: ttl.map(|v| millis("--ttl-ms", &v)).transpose()?,
            wait_for_in_flight,
            max_execution: max_execution
                .map(|v| millis("--max-execution-ms", &v))
                .transpose()?,
            memory_bytes,
            reconcile,
            test_hooks,
        },
    }))
}

fn millis(flag: &str, value: &str) -> Result<Duration, String> {
    match value.parse::<u64>() {
        Ok(n) if n > 0 => Ok(Duration::from_millis(n)),
        _ => Err(format!(
            "{flag} must be a positive whole number of milliseconds, not {value:?}"
        )),
    }
}

fn usage_error(message: &str) -> ExitCode {
    eprintln!("error: {message}\n\n{USAGE}");
    ExitCode::from(2)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args(std::env::args_os().skip(1)) {
        Ok(Command::Run(args)) => args,
        Ok(Command::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => return usage_error(&message),
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();

    // Before any layer, store or reconciler is built: they resolve their metric
    // handles in the recorder installed when they are built.
    if let Some(addr) = &args.metrics_listen
        && let Err(message) = serve_metrics(addr).await
    {
        eprintln!("error: {message}");
        return ExitCode::FAILURE;
    }

    let mut sweeper = None;
    let backend = match &args.store {
        Store::Memory => Ok(app::Backend::Memory),
        Store::Redis(url) => {
            connect_redis(
                url,
                &env_or("PAYMENTS_REDIS_PREFIX", DEFAULT_REDIS_PREFIX),
                args.options.key_window(),
                args.replicated_writes,
            )
            .await
        }
        Store::RedisSentinel(sentinel) => {
            connect_sentinel(
                sentinel,
                &env_or("PAYMENTS_REDIS_PREFIX", DEFAULT_REDIS_PREFIX),
                args.options.key_window(),
                args.replicated_writes,
            )
            .await
        }
        Store::Postgres(url) => {
            let schema = std::env::var("PAYMENTS_PG_SCHEMA")
                .ok()
                .filter(|s| !s.is_empty());
            match env_or("PAYMENTS_PG_MODE", "transactional").as_str() {
                mode @ ("transactional" | "plain") => connect_postgres(
                    url,
                    schema,
                    mode == "transactional",
                    args.options.key_window(),
                )
                .await
                .map(|(backend, s)| {
                    sweeper = Some(s);
                    backend
                }),
                other => Err(format!(
                    "PAYMENTS_PG_MODE must be `transactional` or `plain`, not {other:?}"
                )),
            }
        }
    };
    let backend = match backend {
        Ok(backend) => backend,
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::FAILURE;
        }
    };

    let app = match app::router_on(backend, &args.options) {
        Ok(app) => app,
        Err(e) => return usage_error(&format!("invalid configuration: {e}")),
    };
    let listener = match TcpListener::bind(args.listen.as_str()).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: cannot listen on {}: {e}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    let addr = match listener.local_addr() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: cannot read the bound address: {e}");
            return ExitCode::FAILURE;
        }
    };

    let mut stdout = std::io::stdout().lock();
    let ready = writeln!(stdout, "listening on http://{addr}").and_then(|()| stdout.flush());
    drop(stdout);
    if let Err(e) = ready {
        eprintln!("error: cannot write to stdout: {e}");
        return ExitCode::FAILURE;
    }

    let served = app::serve(listener, app.router, app.shutdown, shutdown_signal()).await;
    if let Some(reconciler) = app.reconciler {
        reconciler.shutdown().await;
    }
    if let Some(sweeper) = sweeper {
        sweeper.stop().await;
    }
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: server failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The buckets of `retrysafe_idempotency_store_seconds`: store round trips, from an
/// in-memory call (microseconds) to a timed-out one (the store timeout, 1 s).
const STORE_SECONDS_BUCKETS: [f64; 12] = [
    0.000_01, 0.000_05, 0.000_1, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.1, 0.25, 1.0,
];

/// Installs the Prometheus recorder and serves its text at `GET /metrics` on `addr`.
///
/// Histogram buckets, and no idle timeout: the exporter drops a series that was not
/// updated for that long from its registry, and never registers it again for the
/// handles retrysafe resolved once, at build time, which then record into a series no
/// longer rendered. No mask is safe (histograms only loses a quiet store operation's,
/// `release` say; counters and gauges, a decision that is rare or a breaker long
/// closed), nor is any length: a longer timeout only loses quieter series. The test
/// `an_idle_timeout_would_lose_series_whose_handles_are_held` shows it.
async fn serve_metrics(addr: &str) -> Result<(), String> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    use retrysafe::observe::names;

    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr} for metrics: {e}"))?;
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(names::IDEMPOTENCY_STORE_SECONDS.to_owned()),
            &STORE_SECONDS_BUCKETS,
        )
        .map_err(|e| format!("cannot configure the metrics: {e}"))?
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    // Histograms are drained into their buckets by the upkeep (the exporter's own
    // listener, which is not built in, would run it).
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    let router = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let handle = handle.clone();
            async move { handle.render() }
        }),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(error = %e, "the metrics listener failed");
        }
    });
    Ok(())
}

/// The environment variable `name`, or `default` when it is unset or empty.
fn env_or(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_owned())
}

/// Connects to Redis and checks its configuration (a read-only replica is refused):
/// the idempotency records go under `{prefix}idem:`, the ledger under
/// `{prefix}{ledger}:`. When the server is a node of a Redis Cluster
/// (`cluster_enabled:1`), both go through the cluster client instead, the node being
/// the first the client asks, and each payment goes in the slot of its record. With
/// `replicated`, the store waits for replicas (`replicated_writes`). The error is the
/// message.
async fn connect_redis(
    url: &str,
    prefix: &str,
    key_window: Duration,
    replicated: Option<(u32, Duration)>,
) -> Result<app::Backend, String> {
    let shown = redact(url);
    // `connect` refuses a maxmemory-policy other than noeviction (or one it cannot read).
    let connected = RedisStore::connect(url).await.map_err(|e| match e {
        RedisStoreError::Unreachable { cause, .. } => {
            format!("cannot connect to the redis store at {shown}: {cause}")
        }
        RedisStoreError::Store(e) => format!("cannot connect to the redis store at {shown}: {e}"),
        e => format!("cannot use the redis store at {shown}: {e}"),
    })?;
    let mut conn = connected.connection().clone();
    let info: String = redis::cmd("INFO")
        .arg("cluster")
        .query_async(&mut conn)
        .await
        .map_err(|e| format!("cannot use the redis store at {shown}: {e}"))?;
    let options = with_replicas(
        RedisStore::options()
            .key_prefix(format!("{prefix}idem:"))
            // Checked by `connect` above, on the same node.
            .skip_config_check(),
        replicated,
    );
    let (backend, store_check) = if info.lines().any(|l| l.trim() == "cluster_enabled:1") {
        // A response timeout bounds every wait of the cluster client, its slot refresh's
        // included (see `RedisStore::options().connect_cluster`).
        let client = redis::cluster::ClusterClient::builder([url])
            .connection_timeout(Duration::from_secs(1))
            .response_timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| format!("cannot use the redis cluster at {shown}: {e}"))?;
        let conn = tokio::time::timeout(Duration::from_secs(5), client.get_async_connection())
            .await
            .map_err(|_| format!("cannot connect to the redis cluster at {shown}: timed out"))?
            .map_err(|e| format!("cannot connect to the redis cluster at {shown}: {e}"))?;
        let store = options
            .per_slot_index()
            .build(conn.clone())
            .await
            .map_err(|e| format!("invalid redis store settings: {e}"))?;
        let check = store.check_config().await;
        let ledger = app::Ledger::redis(RedisConn::Cluster(conn), prefix, key_window);
        (app::Backend::RedisCluster { store, ledger }, check)
    } else {
        let store = options
            .build(conn.clone())
            .await
            .map_err(|e| format!("invalid redis store settings: {e}"))?;
        let check = store.check_config().await;
        let ledger = app::Ledger::redis(RedisConn::Server(conn), prefix, key_window);
        (app::Backend::Redis { store, ledger }, check)
    };
    persistence_warning(&shown, store_check)?;
    Ok(backend)
}

/// Finds the primary of a Redis Sentinel service (`sentinels`, `service`), connects to
/// it and checks it as [`connect_redis`] does; the store and the ledger share the
/// connection, which follows the primary across failovers. The error is the message.
async fn connect_sentinel(
    Sentinel { sentinels, service }: &Sentinel,
    prefix: &str,
    key_window: Duration,
    replicated: Option<(u32, Duration)>,
) -> Result<app::Backend, String> {
    let shown = format!(
        "the primary of {service} (sentinels {})",
        sentinels.join(", ")
    );
    let found = tokio::time::timeout(
        Duration::from_secs(5),
        SentinelConnection::connect(sentinels.iter().map(String::as_str), service, None),
    )
    .await
    .map_err(|_| format!("cannot find {shown}: no answer within 5 s"))?;
    let conn = found.map_err(|e| format!("cannot find {shown}: {e}"))?;
    let store = with_replicas(
        RedisStore::options().key_prefix(format!("{prefix}idem:")),
        replicated,
    )
    .build(conn.clone())
    .await
    .map_err(|e| match e {
        RedisStoreError::Store(e) => format!("cannot connect to {shown}: {e}"),
        e => format!("cannot use {shown}: {e}"),
    })?;
    persistence_warning(&shown, store.check_config().await)?;
    let ledger = app::Ledger::redis(RedisConn::Sentinel(conn), prefix, key_window);
    Ok(app::Backend::RedisSentinel { store, ledger })
}

/// `options` with `--replicated-writes`, if given.
fn with_replicas(
    options: RedisStoreOptions,
    replicated: Option<(u32, Duration)>,
) -> RedisStoreOptions {
    match replicated {
        Some((replicas, timeout)) => options.replicated_writes(replicas, timeout),
        None => options,
    }
}

/// Warns (on stderr) when the Redis at `shown` persists nothing; the error is the
/// message.
fn persistence_warning(
    shown: &str,
    check: Result<retrysafe::redis::ConfigReport, RedisStoreError>,
) -> Result<(), String> {
    match check {
        Ok(report) if report.persistent() == Some(false) => {
            eprintln!(
                "warning: {shown} persists nothing: a restart forgets every idempotency \
                 record and payment"
            );
            Ok(())
        }
        Ok(_) => Ok(()),
        Err(e) => Err(format!("cannot use the redis store at {shown}: {e}")),
    }
}

/// Connects to PostgreSQL, creates the tables if needed and starts the sweeper of
/// expired keys; `transactional` chooses the mode. The error is the message.
async fn connect_postgres(
    url: &str,
    schema: Option<String>,
    transactional: bool,
    key_window: Duration,
) -> Result<(app::Backend, SweeperHandle), String> {
    let shown = redact(url);
    let mut options = PostgresStore::options();
    if let Some(schema) = schema {
        options = options.schema(schema);
        options
            .migration_sql()
            .map_err(|e| format!("PAYMENTS_PG_SCHEMA is not a usable schema name: {e}"))?;
    }
    let store = options.connect(url).await.map_err(|e| match e {
        PostgresStoreError::Unreachable { cause, .. } => {
            format!("cannot connect to the postgres store at {shown}: {cause}")
        }
        e => format!("cannot connect to the postgres store at {shown}: {e}"),
    })?;
    store
        .migrate()
        .await
        .map_err(|e| format!("cannot create the idempotency table at {shown}: {e}"))?;
    let ledger = app::Ledger::postgres(&store, transactional, key_window)
        .await
        .map_err(|e| format!("cannot create the payments table at {shown}: {e}"))?;
    let sweeper = store
        .spawn_sweeper(SWEEP_EVERY, SWEEP_BATCH)
        .map_err(|e| format!("cannot start the sweeper: {e}"))?;
    let backend = if transactional {
        app::Backend::Postgres { store, ledger }
    } else {
        app::Backend::PostgresPlain { store, ledger }
    };
    Ok((backend, sweeper))
}

/// How often expired key rows are deleted, and how many per statement.
const SWEEP_EVERY: Duration = Duration::from_secs(60);
const SWEEP_BATCH: u32 = 1_000;

/// `url` with its password, if any, replaced by `***`, for messages.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
            let hidden = if userinfo.contains(':') { ":***" } else { "" };
            format!("{scheme}://{user}{hidden}@{host}{path}")
        }
        None => url.to_owned(),
    }
}

/// Ctrl-C (and SIGTERM on Unix).
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    tracing::info!("shutting down");
}
