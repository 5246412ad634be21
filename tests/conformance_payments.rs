//! The conformance checker against the `payments` example on every store (memory,
//! Redis, PostgreSQL transactional and plain), as real processes on loopback: every
//! rule passes, its effects counted through `GET /payments?account=A`. Each store runs
//! twice: with the handler at full speed, and slowed by the example's
//! `x-simulate-delay-ms` hook (outside the fingerprint) so that copies sent at once
//! find the first in flight: 409 `request-in-flight`, or with `--in-flight wait` a
//! wait and the replay.
// This test drives real child processes on the wall clock.
#![allow(
    clippy::disallowed_methods,
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    clippy::print_stdout
)]

use retrysafe_conformance::{Command, RULES, Report, Verdict, parse_args};
use retrysafe_test_support::payments::{PgSpace, RedisSpace, Server};
use retrysafe_test_support::services::redis_url;

/// One store the example runs on, with the namespace that keeps the test apart.
enum Store {
    Memory,
    Redis(RedisSpace),
    Postgres(PgSpace),
    PostgresPlain(PgSpace),
}

impl Store {
    fn name(&self) -> &'static str {
        match self {
            Store::Memory => "memory",
            Store::Redis(_) => "redis",
            Store::Postgres(_) => "postgres",
            Store::PostgresPlain(_) => "postgres (plain)",
        }
    }

    /// Starts the example on this store with `args`.
    fn start(&self, args: &[&str]) -> Server {
        let (url, mut env) = match self {
            Store::Memory => ("memory".to_owned(), vec![]),
            Store::Redis(r) => (redis_url(), r.env().to_vec()),
            Store::Postgres(p) => (PgSpace::url_named("payments-conformance"), p.env().to_vec()),
            Store::PostgresPlain(p) => {
                let mut env = p.env().to_vec();
                env.push(("PAYMENTS_PG_MODE", "plain"));
                (PgSpace::url_named("payments-conformance"), env)
            }
        };
        env.retain(|(_, v)| !v.is_empty());
        let mut all = vec!["--store", url.as_str()];
        all.extend_from_slice(args);
        Server::start_with(&all, &env)
    }
}

/// Runs the checker against `server`, for the payments of `account`, with `headers`.
async fn check(server: &Server, account: &str, headers: &[&str]) -> Report {
    let mut args = vec![
        "--url".to_owned(),
        format!("{}/payments", server.base),
        "--header".to_owned(),
        format!("authorization: Bearer {account}"),
        "--body".to_owned(),
        format!(r#"{{"account":"{account}","amount_cents":100}}"#),
        "--ledger-url".to_owned(),
        format!("{}/payments?account={account}", server.base),
    ];
    for header in headers {
        args.extend(["--header".to_owned(), (*header).to_owned()]);
    }
    let Command::Check(options) = parse_args(args.iter().map(Into::into)).unwrap() else {
        panic!("{args:?}");
    };
    retrysafe_conformance::check(&options).await
}

/// No rule fails; the fast run may skip `retry-after.syntax` (no copy met another in
/// flight), the slow run skips nothing — but a server that waits for copies in flight
/// instead of answering 409 never sends a `retry-after`.
fn assert_all_pass(name: &str, report: &Report, skips: &[&str]) {
    println!("{name}:\n{}", report.to_text());
    assert_eq!(
        report.ids(Verdict::Fail),
        Vec::<&str>::new(),
        "{name}:\n{}",
        report.to_text()
    );
    let skipped = report.ids(Verdict::Skip);
    assert!(
        skipped.iter().all(|id| skips.contains(id)),
        "{name}:\n{}",
        report.to_text()
    );
}

async fn check_store(store: Store, extra: &[&str]) {
    let name = store.name();
    let server = store.start(extra);
    let waits = extra.contains(&"wait");
    let fast = check(&server, &format!("conf-fast-{}", std::process::id()), &[]).await;
    assert_all_pass(&format!("{name} {extra:?}"), &fast, &["retry-after.syntax"]);
    let slow = check(
        &server,
        &format!("conf-slow-{}", std::process::id()),
        &["x-simulate-delay-ms: 100"],
    )
    .await;
    let name = format!("{name} {extra:?}, slow handler");
    assert_all_pass(
        &name,
        &slow,
        if waits { &["retry-after.syntax"] } else { &[] },
    );
    // The copies sent at once met the first in flight.
    let copies = &slow.outcome("concurrent.copies").unwrap().detail;
    let met = if waits {
        "7 replayed"
    } else {
        "409 request-in-flight"
    };
    assert!(copies.contains(met), "{name}: {copies}");
    assert!(slow.passed() >= RULES.len() - 1, "{name}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_on_the_memory_store_passes_every_rule() {
    check_store(Store::Memory, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_waiting_for_copies_in_flight_passes_every_rule() {
    check_store(Store::Memory, &["--in-flight", "wait"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_on_redis_passes_every_rule() {
    check_store(Store::Redis(RedisSpace::new().await), &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_on_postgres_transactional_passes_every_rule() {
    check_store(Store::Postgres(PgSpace::new().await), &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_on_postgres_plain_passes_every_rule() {
    check_store(Store::PostgresPlain(PgSpace::new().await), &[]).await;
}
