//! The defaults compose: with every default on the server (lease, `max_execution`, the
//! reconciler) and a client that follows `retry-after` for the default client's 30 s, a
//! key whose holder crashed past its commit point reaches a definite answer in time.
//!
//! `payments` is run as shipped (no timing flag; `--test-hooks` only adds the crash
//! header) on Redis and PostgreSQL, twice on one store: instance A crashes with one key
//! after its commit point (no payment made) and with another after its effect (payment
//! made, answer lost); instance B then serves the copies. The first key must end in a
//! fresh run (the resolver finds no payment), the second in the replay of the first
//! payment, each within 30 s of its crash and with one payment in the ledger.
// This test drives real child processes on the wall clock, so it uses std's clock and
// sleeps on purpose.
#![allow(
    clippy::disallowed_methods,
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    missing_docs
)]

use std::time::{Duration, Instant};

use http::StatusCode;
use retrysafe_test_support::payments::{Answer, Api, PgSpace, RedisSpace, Server};
use retrysafe_test_support::services::redis_url;

/// The default client's overall time.
const CLIENT_TIME: Duration = Duration::from_secs(30);

/// Sends the copy of `key` until the answer is definite (not 409 `request-in-flight`
/// or 503), following each `retry-after`, as the default client does within its time;
/// the definite answer and when it came.
async fn follow(api: &Api, key: &str, account: &str, crashed: Instant) -> (Answer, Duration) {
    loop {
        let answer = api.pay(key, account, 700, &[]).await;
        let waiting = answer.status == StatusCode::CONFLICT
            || answer.status == StatusCode::SERVICE_UNAVAILABLE;
        if !waiting {
            return (answer, crashed.elapsed());
        }
        let retry_after: u64 = answer
            .headers
            .get("retry-after")
            .unwrap_or_else(|| panic!("{key}: a come-back answer without retry-after: {answer:?}"))
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let wait = Duration::from_secs(retry_after);
        assert!(
            crashed.elapsed() + wait < CLIENT_TIME,
            "{key}: told to come back after {wait:?} at {:?} after the crash, past the \
             client's time: {answer:?}",
            crashed.elapsed()
        );
        tokio::time::sleep(wait).await;
    }
}

/// Crashes a fresh instance (started with `start`) on `key` at `point`; when it died.
async fn crash(
    start: &dyn Fn(&[&str]) -> Server,
    key: &str,
    account: &str,
    point: &str,
) -> Instant {
    let mut doomed = start(&["--test-hooks"]);
    let api = Api::new(&doomed);
    let sent = api
        .try_pay(key, account, 700, &[("x-simulate-crash", point)])
        .await;
    assert!(sent.is_err(), "{point}: the instance answered: {sent:?}");
    let crashed = Instant::now();
    for _ in 0..100 {
        if !doomed.is_running() {
            return crashed;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{point}: the instance is still running");
}

async fn crashed_holders_resolve_in_time(
    name: &str,
    start: &dyn Fn(&[&str]) -> Server,
    transactional: bool,
) {
    let before = crash(start, "dc-before", "acct-dc", "after-commit-point").await;
    let after = crash(start, "dc-after", "acct-dc", "after-effect").await;

    let survivor = start(&[]);
    let api = Api::new(&survivor);
    let ((ran, ran_at), (replayed, replayed_at)) = tokio::join!(
        follow(&api, "dc-before", "acct-dc", before),
        follow(&api, "dc-after", "acct-dc", after)
    );
    println!(
        "{name}: definite answers {ran_at:.1?} and {replayed_at:.1?} after the crashes \
         (the client's time: {CLIENT_TIME:?})"
    );

    // No payment before the crash: the copy ran it, once.
    ran.assert_created("acct-dc", 700);
    assert!(!ran.replayed(), "{name}: {ran:?}");
    assert!(ran_at < CLIENT_TIME, "{name}: {ran_at:?}");
    // A payment made, its answer lost: replayed (or, transactional, rolled back with
    // the crash and run again).
    replayed.assert_created("acct-dc", 700);
    assert_eq!(replayed.replayed(), !transactional, "{name}: {replayed:?}");
    assert!(replayed_at < CLIENT_TIME, "{name}: {replayed_at:?}");
    assert_eq!(
        api.totals("acct-dc").await,
        (2, 1400),
        "{name}: one payment per key"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis() {
    let space = RedisSpace::new().await;
    let url = redis_url();
    let env = space.env();
    let start = |args: &[&str]| {
        let mut all = vec!["--store", url.as_str()];
        all.extend_from_slice(args);
        Server::start_with(&all, &env)
    };
    crashed_holders_resolve_in_time("redis", &start, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_plain() {
    let space = PgSpace::new().await;
    let url = PgSpace::url_named("defaults-compose");
    let mut env = space.env().to_vec();
    env.push(("PAYMENTS_PG_MODE", "plain"));
    let start = |args: &[&str]| {
        let mut all = vec!["--store", url.as_str()];
        all.extend_from_slice(args);
        Server::start_with(&all, &env)
    };
    crashed_holders_resolve_in_time("postgres (plain)", &start, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_transactional() {
    let space = PgSpace::new().await;
    let url = PgSpace::url_named("defaults-compose-tx");
    let env = space.env();
    let start = |args: &[&str]| {
        let mut all = vec!["--store", url.as_str()];
        all.extend_from_slice(args);
        Server::start_with(&all, &env)
    };
    crashed_holders_resolve_in_time("postgres (transactional)", &start, true).await;
}
