//! A gRPC health probe (`grpc.health.v1.Health/Check`, service `""`) through retrysafe's
//! tonic client stack:
//!
//! ```text
//! cargo run --example health_probe -- http://HOST:PORT [--deadline-ms N] [--max-attempts N]
//! ```
//!
//! The stack is the recommended one on a tonic `Channel`, assembled by
//! `ClientLayers::grpc()` and wrapped by the generated `HealthClient`: the deadline (the
//! whole probe, default 5000 ms) → retry (the standard strategy: default 3 attempts
//! counting the first, full jitter from 50 ms, `UNAVAILABLE` retried,
//! `RESOURCE_EXHAUSTED` only with a pushback) → budget → breaker → `Channel`, fused into
//! one service, with the body adapter inside. Local failures are answered as gRPC
//! statuses (`DEADLINE_EXCEEDED`, `UNAVAILABLE`). A `Check` is a read, so the call
//! carries the [`Idempotent`](retrysafe::retry::Idempotent) extension, which
//! makes it safe to retry although gRPC sends it as a POST.
//!
//! It prints one JSON line on stdout:
//!
//! ```text
//! {"status": "SERVING", "attempts": 1, "elapsed_ms": 3, "error": null}
//! ```
//!
//! - `status`: the serving status by its enum name (`SERVING`, `NOT_SERVING`, `UNKNOWN`,
//!   `SERVICE_UNKNOWN`), or `null` when none was obtained;
//! - `attempts`: the attempts actually handed to the transport, counted below the
//!   retry layer, the budget and the breaker (a call they refused is not counted);
//! - `elapsed_ms`: the time the probe took, in whole milliseconds;
//! - `error`: `null`, or the gRPC code in lowercase words, a colon and the status
//!   message, such as `"unavailable: tcp connect error"` or
//!   `"deadline exceeded: deadline exceeded"`.
//!
//! Exit code: 0 when a serving status was obtained (whichever it is: the probe worked,
//! the JSON says what the server reported), 1 when none was (the JSON's `error` says
//! why), 2 for bad arguments (a usage message on stderr, nothing on stdout).
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use http::Request;
use retrysafe::retry::Idempotent;
use retrysafe::{ClientLayers, RetryLayer, StandardRetryStrategy};
use serde::Serialize;
use tokio::time::Instant;
use tonic::Code;
use tonic::body::Body as GrpcBody;
use tonic::transport::Endpoint;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tower::Layer;
use tower::util::MapRequest;

/// The whole probe's deadline when `--deadline-ms` is not given.
const DEFAULT_DEADLINE_MS: u64 = 5_000;
/// Attempts (counting the first) when `--max-attempts` is not given: the standard
/// strategy's.
const DEFAULT_MAX_ATTEMPTS: u32 = 3;
const USAGE: &str = "usage: health_probe http://HOST:PORT [--deadline-ms N] [--max-attempts N]";

/// The command line.
#[derive(Debug)]
struct Args {
    endpoint: Endpoint,
    deadline: Duration,
    max_attempts: u32,
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut url = None;
    let mut deadline_ms = DEFAULT_DEADLINE_MS;
    let mut max_attempts = DEFAULT_MAX_ATTEMPTS;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--deadline-ms" => deadline_ms = number(&arg, args.next())?,
            "--max-attempts" => max_attempts = number(&arg, args.next())?,
            flag if flag.starts_with("--") => return Err(format!("unknown flag {flag}")),
            _ if url.is_none() => url = Some(arg),
            _ => return Err(format!("unexpected argument {arg}")),
        }
    }
    let url = url.ok_or("missing the server URL")?;
    let endpoint = Endpoint::from_shared(url.clone()).map_err(|e| format!("bad URL {url}: {e}"))?;
    let uri = endpoint.uri();
    if uri.scheme_str() != Some("http") || uri.host().is_none() {
        return Err(format!("bad URL {url}: expected http://HOST:PORT"));
    }
    if deadline_ms == 0 {
        return Err("--deadline-ms must be greater than zero".to_owned());
    }
    if !(1..=100).contains(&max_attempts) {
        return Err("--max-attempts must be between 1 and 100".to_owned());
    }
    Ok(Args {
        endpoint,
        deadline: Duration::from_millis(deadline_ms),
        max_attempts,
    })
}

fn number<T: std::str::FromStr>(flag: &str, value: Option<String>) -> Result<T, String> {
    let value = value.ok_or_else(|| format!("{flag} needs a value"))?;
    value
        .parse()
        .map_err(|_| format!("{flag}: not a number: {value}"))
}

/// A gRPC code in lowercase words, as the `error` field starts.
fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid argument",
        Code::DeadlineExceeded => "deadline exceeded",
        Code::NotFound => "not found",
        Code::AlreadyExists => "already exists",
        Code::PermissionDenied => "permission denied",
        Code::ResourceExhausted => "resource exhausted",
        Code::FailedPrecondition => "failed precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out of range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data loss",
        Code::Unauthenticated => "unauthenticated",
    }
}

/// What the probe found.
struct Outcome {
    status: Option<&'static str>,
    error: Option<String>,
    attempts: u32,
    elapsed: Duration,
}

/// One `Check` through the client stack.
async fn probe(args: Args) -> Result<Outcome, retrysafe::ConfigError> {
    // Attempts handed to the transport: counted below every layer that may refuse one.
    let sent = Arc::new(AtomicU32::new(0));
    let counter = sent.clone();
    let strategy = StandardRetryStrategy::new()
        .max_attempts(args.max_attempts)
        .build()?;
    let layers = ClientLayers::new()
        .deadline(args.deadline)
        .retry(RetryLayer::new().strategy(strategy))
        .build()?;
    let transport = MapRequest::new(args.endpoint.connect_lazy(), move |r: Request<GrpcBody>| {
        counter.fetch_add(1, Ordering::Relaxed);
        r
    });
    let stack = layers.grpc().layer(transport);
    let mut client = HealthClient::new(stack);

    let mut request = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    // A read: safe to repeat, although gRPC sends it as a POST.
    request.extensions_mut().insert(Idempotent);

    let started = Instant::now();
    let result = client.check(request).await;
    let elapsed = started.elapsed();
    let (status, error) = match result {
        Ok(response) => (Some(status_name(response.into_inner().status())), None),
        Err(status) => {
            let name = code_name(status.code());
            let error = if status.message().is_empty() {
                name.to_owned()
            } else {
                format!("{name}: {}", status.message())
            };
            (None, Some(error))
        }
    };
    Ok(Outcome {
        status,
        error,
        attempts: sent.load(Ordering::Relaxed),
        elapsed,
    })
}

/// The JSON line, in the documented field order.
#[derive(Debug, Serialize)]
struct Line<'a> {
    status: Option<&'static str>,
    attempts: u32,
    elapsed_ms: u64,
    error: Option<&'a str>,
}

fn status_name(status: ServingStatus) -> &'static str {
    status.as_str_name()
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = match std::env::args_os()
        .skip(1)
        .map(|a| {
            a.into_string()
                .map_err(|a| format!("argument {a:?} is not valid UTF-8"))
        })
        .collect::<Result<Vec<String>, String>>()
        .and_then(|args| parse_args(args.into_iter()))
    {
        Ok(args) => args,
        Err(message) => {
            eprintln!("health_probe: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let outcome = match probe(args).await {
        Ok(outcome) => outcome,
        Err(e) => {
            eprintln!("health_probe: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let line = Line {
        status: outcome.status,
        attempts: outcome.attempts,
        elapsed_ms: u64::try_from(outcome.elapsed.as_millis()).unwrap_or(u64::MAX),
        error: outcome.error.as_deref(),
    };
    let line = match serde_json::to_string(&line) {
        Ok(line) => line,
        Err(e) => {
            eprintln!("health_probe: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("{line}");
    if outcome.status.is_some() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
