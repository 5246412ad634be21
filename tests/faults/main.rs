//! Logical POSTs with generated keys through the client stack, a fault-injecting proxy
//! and an axum server with an `IdempotencyLayer`, once per store: memory, Redis,
//! PostgreSQL (`PostgresStore`) and PostgreSQL's transactional layer.
//!
//! Client stack, outermost first: `DeadlineLayer` (10 s per logical request) →
//! `RetryLayer` (generated keys, 4 attempts, full-jitter backoff 5–200 ms, a ratio
//! budget) → `RetryBudgetLayer` (the same budget) → `CircuitBreakerLayer` (defaults —
//! time window 30 s, 50 % failures — but at least 100 calls, not 20; in the
//! `redis_pair` run, 100 % failures) → a 1 s per-attempt timeout (answered as an
//! `io::ErrorKind::TimedOut` error, which the classifier treats as an attempt timeout;
//! under a `DeadlineLayer` the retry layer's own attempt timeout is the whole deadline,
//! so this is what cuts a black-holed attempt short) → hyper-util's pooled client
//! (keep-alive). Between client and server, the fault proxy
//! (`retrysafe_test_support::proxy`) picks a fault per request (`FaultMix::standard()`:
//! 17.5 % of requests reset, cut, half-closed or black-holed, 10 % delayed). The
//! handler also fails 1 % of calls with a transient 503 marked `NoEffect` (no effect; a
//! retry runs again) and 0.3 % with a 500 after its effect (an `outcome_unknown` record
//! with the plain stores; a rollback with the transactional layer).
//!
//! The handler counts effects per idempotency key (with the transactional layer: rows
//! inserted in the request's transaction) and notes which keys each logical request
//! (an id in the body) arrived with. Invariants: every logical request arrives with one
//! key on all its attempts; no key has two effects; every logical request the client
//! saw succeed has exactly one effect; succeeded ≤ effects ≤ logical requests; with the
//! transactional layer, the keys with a committed record are exactly the keys with an
//! effect. One JSON summary line per store is printed (`--nocapture` to see it).
//!
//! Two more runs exercise what the others cannot:
//!
//! - `redis_default`: the library's default configuration, where handlers declare no
//!   commit point (a holder's expired lease is never taken over, only made unknown);
//! - `redis_pair`: two server instances, each on its own runtime, accept from one
//!   listening socket; one of them is crashed (its runtime dropped at once: nothing of it
//!   runs again, no release, no completion) and restarted every 0.15–0.4 s, while
//!   handlers wait up to 100 ms before their commit point. Leases are 300 ms and
//!   handlers declare their commit point, so the copies of a crashed holder's
//!   requests take over its claims (the run must report takeovers > 0); every instance
//!   runs a reconciler whose resolver reads the effects, so a claim left past its commit
//!   point, and a 500 after the effect, end completed with the effect's answer.
//!
//! `FAULT_POSTS` (default 2000 per store in the normal suite; 10000 for the figures of
//! RELIABILITY.md), `FAULT_SEED` (printed), `FAULT_CONCURRENCY` (default 64).
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::cast_possible_truncation,
    missing_docs,
    unreachable_pub
)]

mod client;
mod each_fault;
mod runs;
mod server;

use retrysafe_test_support::rng::env_number;

/// Transient 503s marked `NoEffect`, per mille of handler calls.
const TRANSIENT_PER_MILLE: u64 = 10;
/// 500s after the effect (outcome unknown), per mille of handler calls.
const FAIL_AFTER_EFFECT_PER_MILLE: u64 = 3;
/// Padding in each request and response body, so a cut can land mid-body.
const PAD: usize = 300;

fn posts() -> u64 {
    env_number("FAULT_POSTS", 2000)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Memory,
    Redis,
    Postgres,
    PostgresTx,
    /// Redis, handlers declaring no commit point (the library's default).
    RedisDefault,
    /// Redis, two instances, one crashed and restarted again and again.
    RedisPair,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Memory => "memory",
            Mode::Redis => "redis",
            Mode::Postgres => "postgres",
            Mode::PostgresTx => "postgres_tx",
            Mode::RedisDefault => "redis_default",
            Mode::RedisPair => "redis_pair",
        }
    }

    fn index(self) -> u64 {
        match self {
            Mode::Memory => 1,
            Mode::Redis => 2,
            Mode::Postgres => 3,
            Mode::PostgresTx => 4,
            Mode::RedisDefault => 5,
            Mode::RedisPair => 6,
        }
    }
}
