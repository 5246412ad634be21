//! A payments API made safe to retry with the `IdempotencyLayer`.
//!
//! ```text
//! cargo run --example payments -- [--listen ADDR] [--store memory | redis://… | postgres://…]
//!                                 [--lease-ms N] [--ttl-ms N] [--in-flight conflict|wait]
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
//! (`idempotent-replayed: true`) and the ledger holds one payment. See `app.rs` for the
//! routes and the test hooks `x-simulate-delay-ms` and `x-simulate-fail`.
#![allow(clippy::print_stdout)]

mod app;

use std::ffi::OsString;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

const USAGE: &str = "\
usage: payments [--listen ADDR] [--store memory | redis://... | postgres://...]
                [--lease-ms N] [--ttl-ms N] [--in-flight conflict|wait]

  --listen ADDR        address to listen on (default 127.0.0.1:3000; port 0 picks one)
  --store STORE        idempotency store (default memory; redis and postgres: not yet)
  --lease-ms N         lease of a claim in milliseconds (default 10000)
  --ttl-ms N           how long completed keys are kept, in milliseconds (default 24 h)
  --in-flight MODE     a copy of a request still in progress: `conflict` answers 409
                       (default), `wait` waits up to 5 s for the original's answer

exit codes: 0 after ctrl-c, 1 on a runtime error or an unavailable store, 2 on bad arguments";

/// The idempotency store asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Store {
    Memory,
    Redis,
    Postgres,
}

#[derive(Debug)]
struct Args {
    listen: String,
    store: Store,
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

    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let arg = arg
            .into_string()
            .map_err(|a| format!("argument {a:?} is not valid UTF-8"))?;
        if arg == "-h" || arg == "--help" {
            return Ok(Command::Help);
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
        Some(s) if s.starts_with("redis://") || s.starts_with("rediss://") => Store::Redis,
        Some(s) if s.starts_with("postgres://") || s.starts_with("postgresql://") => {
            Store::Postgres
        }
        Some(other) => {
            return Err(format!(
                "--store must be `memory`, a redis:// URL or a postgres:// URL, not {other:?}"
            ));
        }
    };
    let listen = listen.unwrap_or_else(|| "127.0.0.1:3000".to_owned());
    if listen.is_empty() {
        return Err("--listen needs an address such as 127.0.0.1:3000".to_owned());
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
    Ok(Command::Run(Args {
        listen,
        store,
        options: app::Options {
            lease: lease.map(|v| millis("--lease-ms", &v)).transpose()?,
            retention: ttl.map(|v| millis("--ttl-ms", &v)).transpose()?,
            wait_for_in_flight,
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
    match args.store {
        Store::Memory => {}
        Store::Redis | Store::Postgres => {
            let name = if args.store == Store::Redis {
                "redis"
            } else {
                "postgres"
            };
            eprintln!("error: the {name} store is not implemented yet (only --store memory)");
            return ExitCode::FAILURE;
        }
    }

    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();

    let (router, shutdown) = match app::router(&args.options) {
        Ok(r) => r,
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

    match app::serve(listener, router, shutdown, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: server failed: {e}");
            ExitCode::FAILURE
        }
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
