//! Lost replies, injected: `cargo run --release --example chaos -- --requests N --seed S`.
//!
//! An axum payments service guarded by an `IdempotencyLayer` records each payment in
//! a ledger, by idempotency key. A client sends N payments (default 1000, 16 at a time)
//! through the standard retrysafe client stack, `ClientLayers`, which gives each POST a
//! generated `Idempotency-Key` (the same on every attempt) — and below it a
//! `FaultLayer`, seeded with S (default 1), stands for a bad network: about 30 % of the
//! attempts reach the service, which pays, and then lose their reply on the way back;
//! 5 % are answered 503 before they leave. The client retries both; the service
//! replays what it already did.
//!
//! It prints what happened, and its last stdout line is JSON: `requests`,
//! `lost_replies_injected`, `errors_injected`, `succeeded` (requests answered 201),
//! `effects` (payments in the ledger) and `duplicates` (payments beyond the first for
//! one key). The program fails unless `duplicates` is 0.
#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex, PoisonError};

use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use retrysafe::breaker::{BreakerConfig, CircuitBreakerLayer};
use retrysafe::budget::RatioConfig;
use retrysafe::chaos::{FaultLayer, FaultStats};
use retrysafe::idempotency::{IdempotencyContext, IdempotencyLayer, Principal};
use retrysafe::server::ServerLayers;
use retrysafe::{ClientLayers, RetryBudget, RetryLayer, StandardRetryStrategy};
use tower::{ServiceBuilder, ServiceExt};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Requests in flight at once.
const CONCURRENCY: usize = 16;

#[derive(Debug, Clone, Copy)]
struct Options {
    requests: u32,
    seed: u64,
}

const USAGE: &str = "usage: chaos [--requests N] [--seed S]";

impl Options {
    fn parse() -> Result<Self, String> {
        let mut options = Options {
            requests: 1000,
            seed: 1,
        };
        let args = std::env::args_os()
            .skip(1)
            .map(|a| {
                a.into_string()
                    .map_err(|a| format!("argument {a:?} is not valid UTF-8"))
            })
            .collect::<Result<Vec<String>, String>>()?;
        let mut args = args.into_iter();
        while let Some(flag) = args.next() {
            let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let n = value
                .parse::<u64>()
                .map_err(|_| format!("{flag}: not a number: {value}"))?;
            match flag.as_str() {
                "--requests" => {
                    options.requests = u32::try_from(n)
                        .ok()
                        .filter(|n| (1..=1_000_000).contains(n))
                        .ok_or_else(|| format!("--requests: from 1 to 1000000, not {value}"))?;
                }
                "--seed" => options.seed = n,
                other => return Err(format!("unknown option {other}")),
            }
        }
        Ok(options)
    }
}

/// Payments recorded, by idempotency key.
type Ledger = Arc<Mutex<HashMap<String, u32>>>;

async fn pay(
    State(ledger): State<Ledger>,
    Extension(ctx): Extension<IdempotencyContext>,
) -> StatusCode {
    // Until here a retry may take over the claim of a copy that died.
    if ctx.commit_point().await.is_err() {
        return StatusCode::SERVICE_UNAVAILABLE;
    }
    let key = ctx.key().as_str().to_owned();
    *ledger
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .entry(key)
        .or_default() += 1;
    StatusCode::CREATED
}

/// Serves the payments service on a free loopback port: its base URL.
async fn serve(ledger: Ledger) -> Result<String, BoxError> {
    // Your authentication goes here: the principal is the scope of its keys.
    let auth = axum::middleware::map_request(|mut req: Request<Body>| async move {
        req.extensions_mut().insert(Principal::new("chaos-client"));
        req
    });
    let guard = IdempotencyLayer::in_memory().handlers_declare_commit_point();
    let layers = ServerLayers::new(guard).authentication(auth).build()?;
    let app = Router::new()
        .route("/payments", post(pay))
        .with_state(ledger)
        .layer(layers);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(base)
}

/// What the client saw and what the ledger holds.
#[derive(Debug)]
struct Outcome {
    succeeded: u64,
    failed: u64,
    effects: u64,
    duplicates: u64,
    faults: FaultStats,
}

async fn run(options: Options) -> Result<Outcome, BoxError> {
    let ledger = Ledger::default();
    let base = serve(Arc::clone(&ledger)).await?;

    let faults = FaultLayer::new()
        .lost_replies(0.30)
        .error_answers(0.05, StatusCode::SERVICE_UNAVAILABLE)
        .seed(options.seed)
        .build()?;
    // A network this bad needs more retries than the default budget (20 % of
    // requests) allows: one retry per request on average, five attempts at most. And
    // the default breaker opens at 50 % failures, which 35 % faults reach by chance in
    // a window of 20 calls: this one opens at 80 %.
    let breaker = BreakerConfig::default().with_failure_rate_threshold(80.0);
    let budget = RetryBudget::ratio_with(RatioConfig::default().with_retry_ratio(1.0));
    let strategy = StandardRetryStrategy::new()
        .max_attempts(5)
        .seed(options.seed);
    let layers = ClientLayers::new()
        .retry(
            RetryLayer::new()
                .strategy(strategy)
                // The payments service honours Idempotency-Key: keys may be generated.
                .generate_idempotency_keys(),
        )
        .budget(budget)
        .breaker(CircuitBreakerLayer::with_config(breaker))
        .build()?;
    let client = ServiceBuilder::new()
        .layer(layers)
        .layer(faults.clone())
        .service(Client::builder(TokioExecutor::new()).build_http());

    let url = format!("{base}/payments");
    let answers: Vec<Result<StatusCode, BoxError>> =
        futures_util::stream::iter(0..options.requests)
            .map(|i| {
                let (client, url) = (client.clone(), url.clone());
                async move {
                    let body = format!(
                        r#"{{"account":"acct-{}","amount_cents":{}}}"#,
                        i % 10,
                        100 + i
                    );
                    let request = Request::post(url)
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from(body)))?;
                    Ok(client.oneshot(request).await?.status())
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
    let succeeded = answers
        .iter()
        .filter(|a| matches!(a, Ok(StatusCode::CREATED)))
        .count() as u64;

    let ledger = ledger.lock().unwrap_or_else(PoisonError::into_inner);
    Ok(Outcome {
        succeeded,
        failed: u64::from(options.requests) - succeeded,
        effects: ledger.values().map(|n| u64::from(*n)).sum(),
        duplicates: ledger
            .values()
            .map(|n| u64::from(n.saturating_sub(1)))
            .sum(),
        faults: faults.stats(),
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    let options = match Options::parse() {
        Ok(options) => options,
        Err(e) => {
            eprintln!("error: {e}");
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let outcome = match run(options).await {
        Ok(outcome) => outcome,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let f = outcome.faults;
    println!(
        "{} payments through ClientLayers (generated keys) -> FaultLayer (seed {}) -> \
         IdempotencyLayer",
        options.requests, options.seed
    );
    println!(
        "attempts: {}; injected: {} lost replies (the payment made, its answer dropped), \
         {} error answers (503, nothing sent)",
        f.calls, f.lost_replies, f.errors
    );
    println!(
        "answered 201: {}; failed after every attempt: {}",
        outcome.succeeded, outcome.failed
    );
    println!(
        "payments in the ledger: {}; duplicates: {}",
        outcome.effects, outcome.duplicates
    );
    let json = serde_json::json!({
        "requests": options.requests,
        "lost_replies_injected": f.lost_replies,
        "errors_injected": f.errors,
        "succeeded": outcome.succeeded,
        "effects": outcome.effects,
        "duplicates": outcome.duplicates,
    });
    println!("{json}");
    if outcome.duplicates == 0 {
        ExitCode::SUCCESS
    } else {
        eprintln!("error: {} payments were made twice", outcome.duplicates);
        ExitCode::FAILURE
    }
}
