//! An order service whose effects reach two other systems through the transactional
//! outbox, with the relay and the consumer crashing and restarting along the way.
//!
//! ```text
//! cargo run --example outbox -- [--database URL] [--amqp URL] [--orders N]
//! ```
//!
//! - the **order service** (axum, behind the `TxIdempotencyLayer`): `POST /orders`
//!   inserts the order and, in the same transaction, enqueues an HTTP call to the
//!   downstream service and an AMQP event (`IdempotentTx::enqueue`); clients send
//!   some orders twice, as retries do;
//! - the **downstream service** (axum, behind an `IdempotencyLayer`) runs one effect per
//!   key;
//! - the **relay** (`OutboxRelay`) sends the calls through a hyper client and publishes
//!   the events to RabbitMQ (`AmqpPublisher`: persistent, mandatory, confirmed);
//! - the **consumer** (`Consumer::process`) records each event in PostgreSQL, in the
//!   transaction that records its id.
//!
//! The relay is crashed between a send and its mark, and the consumer between its
//! commit and its acknowledgement, each at points of a schedule of its own drawn from
//! the seed (`OUTBOX_SEED`, default 7): each crashes at least once in every run, and
//! about once in 25 sends or commits; `OUTBOX_CRASHES=0` turns the crashes off, for
//! measurements. Each is restarted, and the crashes are counted in the output. Half the
//! orders are placed while the relay is stopped (a backlog, drained at full speed: the
//! relay's throughput), half while it runs (the latency from commit to delivery).
//!
//! Everything lives in a schema and a queue of its own, removed at the end. The last
//! stdout line is JSON: `{"orders", "downstream_effects", "consumer_effects",
//! "http_sends", "amqp_deliveries", "duplicates", "missing_downstream",
//! "missing_consumer", "dead_letters"}`.
#![allow(clippy::print_stdout, clippy::unwrap_used)]

mod audit;
mod services;
mod workers;

use std::process::ExitCode;
use std::time::Duration;

const USAGE: &str = "\
usage: outbox [--database URL] [--amqp URL] [--orders N]

  --database URL   PostgreSQL (default $DATABASE_URL or postgres://postgres@127.0.0.1:5432/test)
  --amqp URL       RabbitMQ (default $AMQP_URL or amqp://guest:guest@127.0.0.1:5672/%2f)
  --orders N       orders to place (default 200)

environment: OUTBOX_SEED (default 7) seeds the crash schedules (the relay and the
consumer each crash at least once); OUTBOX_CRASHES=0 turns the crashes off.";

/// The parsed command line.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    /// The PostgreSQL URL.
    pub(crate) database: String,
    /// The RabbitMQ URL.
    pub(crate) amqp: String,
    /// Orders to place.
    pub(crate) orders: usize,
    /// Seeds the crash schedules.
    pub(crate) seed: u64,
    /// Whether the relay and the consumer crash.
    pub(crate) crashes: bool,
}

fn parse(args: Vec<std::ffi::OsString>) -> Result<Options, String> {
    let mut options = Options {
        database: std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
        amqp: std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned()),
        orders: 200,
        seed: std::env::var("OUTBOX_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(7),
        crashes: std::env::var("OUTBOX_CRASHES").map_or(true, |v| v != "0"),
    };
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let arg = arg
            .into_string()
            .map_err(|_| "an argument is not valid UTF-8".to_owned())?;
        let mut value = || {
            args.next()
                .and_then(|v| v.into_string().ok())
                .ok_or_else(|| format!("{arg} needs a value"))
        };
        match arg.as_str() {
            "--database" => options.database = value()?,
            "--amqp" => options.amqp = value()?,
            "--orders" => {
                options.orders = value()?
                    .parse()
                    .ok()
                    .filter(|n| (1..=100_000).contains(n))
                    .ok_or("--orders must be 1 to 100000")?;
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(options)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let options = match parse(args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match tokio::time::timeout(Duration::from_secs(600), workers::run(&options)).await {
        Ok(Ok(report)) => {
            report.print();
            ExitCode::SUCCESS
        }
        Ok(Err(e)) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
        Err(_) => {
            eprintln!("error: the run did not finish within 10 minutes");
            ExitCode::FAILURE
        }
    }
}
