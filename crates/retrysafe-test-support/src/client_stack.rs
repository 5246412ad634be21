//! The client stack that the fault runs (`tests/faults.rs`), the failover load
//! ([`failover`](crate::failover)) and the soak (`benches/soak.rs`) drive through the
//! [fault proxy](crate::proxy), and what it counts.
//!
//! `DeadlineLayer` (10 s) → `RetryLayer` generating idempotency keys (4 attempts, full
//! jitter 5–200 ms, a ratio budget) → `RetryBudgetLayer` (the same budget) →
//! `CircuitBreakerLayer` (defaults, but 100 calls before the rate counts) → a 1 s
//! timeout per attempt (below the breaker, so a black hole counts as a failure there) →
//! hyper's pooled client.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use retrysafe_core::backoff::{Backoff, Jitter};
use retrysafe_core::breaker::{BreakerConfig, CircuitBreaker, State as BreakerState};
use retrysafe_core::budget::RetryBudget;
use retrysafe_core::classify::Failure;
use retrysafe_core::error::{BudgetExhausted, CircuitOpen, DeadlineExceeded, find};
use retrysafe_core::strategy::StandardRetryStrategy;
use retrysafe_tower::breaker::{CircuitBreakerLayer, ResponseBody};
use retrysafe_tower::budget::RetryBudgetLayer;
use retrysafe_tower::deadline::DeadlineLayer;
use retrysafe_tower::retry::{RetryLayer, failure_of};
use tower::util::BoxCloneSyncService;
use tower::{BoxError, ServiceBuilder};

/// Each attempt's own timeout (below the breaker).
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(1);
/// The deadline of each logical request.
pub const DEADLINE: Duration = Duration::from_secs(10);

type ResponseFuture = hyper_util::client::legacy::ResponseFuture;

/// The stack, boxed.
pub type Stack =
    BoxCloneSyncService<Request<Full<Bytes>>, Response<ResponseBody<Incoming>>, BoxError>;

/// What the stack counts.
#[derive(Debug, Default)]
pub struct StackCounts {
    /// Attempts that reached the transport.
    pub attempts: AtomicU64,
    /// Retries (`on_retry`).
    pub retries: AtomicU64,
    /// Times the breaker opened.
    pub breaker_opened: AtomicU64,
    /// Give-ups by reason (`on_give_up`).
    pub give_ups: Mutex<BTreeMap<String, u64>>,
}

/// The stack, its jitter seeded with `seed`, counting into `counts`.
pub fn client_stack(seed: u64, counts: &Arc<StackCounts>) -> Stack {
    client_stack_with(seed, counts, |config| config)
}

/// The stack with its breaker's configuration changed by `tune`.
pub fn client_stack_with(
    seed: u64,
    counts: &Arc<StackCounts>,
    tune: impl FnOnce(BreakerConfig) -> BreakerConfig,
) -> Stack {
    let backoff = Backoff::new(
        Duration::from_millis(5),
        Duration::from_millis(200),
        Jitter::Full,
    );
    let budget = RetryBudget::ratio();
    let strategy = StandardRetryStrategy::new()
        .max_attempts(4)
        .backoff(backoff)
        .budget(budget.clone())
        .seed(seed);
    // The defaults (time window 30 s, 50 % failures), but at least 100 calls before
    // the rate counts: with 20 (the default), a cold start on a loaded machine (a burst
    // of attempt timeouts while pools connect) opened it once, and a driver that does
    // not pace then had every remaining request refused at once.
    let mut config = tune(BreakerConfig::default().with_minimum_calls(100));
    let c = Arc::clone(counts);
    config = config.with_on_state_change(move |change| {
        if change.to == BreakerState::Open {
            c.breaker_opened.fetch_add(1, Ordering::Relaxed);
        }
    });
    let breaker = CircuitBreaker::new(config);
    let (on_retry, on_give_up, counted) =
        (Arc::clone(counts), Arc::clone(counts), Arc::clone(counts));
    let http = Client::builder(TokioExecutor::new()).build_http();
    let svc = ServiceBuilder::new()
        .layer(DeadlineLayer::new(DEADLINE))
        .layer(
            RetryLayer::new()
                .generate_idempotency_keys()
                .strategy(strategy)
                .on_retry(move |_| {
                    on_retry.retries.fetch_add(1, Ordering::Relaxed);
                })
                .on_give_up(move |e| {
                    *on_give_up
                        .give_ups
                        .lock()
                        .unwrap()
                        .entry(format!("{:?}", e.reason))
                        .or_default() += 1;
                }),
        )
        .layer(RetryBudgetLayer::new(budget))
        .layer(CircuitBreakerLayer::new(breaker))
        .map_future(|fut: ResponseFuture| async move {
            match tokio::time::timeout(ATTEMPT_TIMEOUT, fut).await {
                Ok(r) => r.map_err(BoxError::from),
                Err(_) => Err(BoxError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "attempt timed out",
                ))),
            }
        })
        .map_request(move |r| {
            counted.attempts.fetch_add(1, Ordering::Relaxed);
            r
        })
        .service(http);
    BoxCloneSyncService::new(svc)
}

/// A short label of the error a logical request ended with.
pub fn error_kind(e: &BoxError) -> &'static str {
    if find::<CircuitOpen>(&**e).is_some() {
        return "circuit_open";
    }
    if find::<BudgetExhausted>(&**e).is_some() {
        return "budget_exhausted";
    }
    if find::<DeadlineExceeded>(&**e).is_some() {
        return "deadline_exceeded";
    }
    match failure_of(&**e) {
        Failure::ConnectFailed => "connect_failed",
        Failure::NoResponse => "no_response",
        Failure::Timeout => "timeout",
        _ => "other",
    }
}
