//! The `payments` example speaks the server side of the convention, driven as an outside
//! user would on every store (memory, Redis, PostgreSQL transactional and plain): the
//! inbound deadline (`request-timeout-ms`, `grpc-timeout`) is read before anything is
//! claimed or run, and with `--test-hooks` a failure before the commit point
//! (`x-simulate-failure: before-commit-point`) leaves the key free for the retry.
// This test drives real child processes on the wall clock, so it uses std's clock on
// purpose.
#![allow(
    clippy::disallowed_methods,
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use retrysafe_test_support::payments::{Api, PgSpace, RedisSpace, Server};
use retrysafe_test_support::services::redis_url;

/// One store the example runs on, with the namespace that keeps the test apart.
enum Store {
    Memory,
    Redis(RedisSpace),
    Postgres(PgSpace),
    PostgresPlain(PgSpace),
}

impl Store {
    async fn all() -> Vec<Store> {
        vec![
            Store::Memory,
            Store::Redis(RedisSpace::new().await),
            Store::Postgres(PgSpace::new().await),
            Store::PostgresPlain(PgSpace::new().await),
        ]
    }

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
            Store::Postgres(p) => (PgSpace::url_named("payments-convention"), p.env().to_vec()),
            Store::PostgresPlain(p) => {
                let mut env = p.env().to_vec();
                env.push(("PAYMENTS_PG_MODE", "plain"));
                (PgSpace::url_named("payments-convention"), env)
            }
        };
        env.retain(|(_, v)| !v.is_empty());
        let mut all = vec!["--store", url.as_str()];
        all.extend_from_slice(args);
        Server::start_with(&all, &env)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbound_deadline_is_read_before_anything_runs() {
    for store in Store::all().await {
        let name = store.name();
        let server = store.start(&[]);
        let api = Api::new(&server);

        for bad in ["abc", "-5", "1.5", ""] {
            let answer = api
                .pay("dl-bad", "acct-dl", 100, &[("request-timeout-ms", bad)])
                .await;
            answer.assert_problem_type(400, "timeout-invalid");
            assert!(!answer.replayed(), "{name} {bad:?}");
        }
        let answer = api
            .pay("dl-zero", "acct-dl", 100, &[("request-timeout-ms", "0")])
            .await;
        answer.assert_problem_type(504, "deadline-exceeded");
        assert_eq!(answer.headers["do-not-retry"], "1", "{name}");
        let grpc = api
            .send(
                api.post()
                    .header("idempotency-key", "dl-grpc")
                    .header("content-type", "application/grpc")
                    .header("grpc-timeout", "soon")
                    .body(Vec::<u8>::new()),
            )
            .await;
        assert_eq!(grpc.headers["grpc-status"], "3", "{name}: INVALID_ARGUMENT");
        assert_eq!(
            api.totals("acct-dl").await,
            (0, 0),
            "{name}: no handler ran"
        );

        // Nothing was claimed for the refused copies: the same keys run now.
        for key in ["dl-bad", "dl-zero"] {
            api.pay(key, "acct-dl", 100, &[("request-timeout-ms", "10000")])
                .await
                .assert_created("acct-dl", 100);
        }
        assert_eq!(api.totals("acct-dl").await, (2, 200), "{name}");
        let totals = api
            .send(
                api.http
                    .get(format!("{}/payments", api.base))
                    .query(&[("account", "acct-dl")])
                    .header("request-timeout-ms", "x"),
            )
            .await;
        totals.assert_problem_type(400, "timeout-invalid");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_before_the_commit_point_leaves_the_key_to_the_retry() {
    for store in Store::all().await {
        let name = store.name();
        let server = store.start(&["--test-hooks"]);
        let api = Api::new(&server);

        let failed = api
            .pay(
                "early-1",
                "acct-early",
                250,
                &[("x-simulate-failure", "before-commit-point")],
            )
            .await;
        failed.assert_problem(503);
        assert!(
            !failed.headers.contains_key("do-not-retry"),
            "{name}: nothing happened, a retry is safe: {failed:?}"
        );
        assert_eq!(api.totals("acct-early").await, (0, 0), "{name}");

        let retry = api.pay("early-1", "acct-early", 250, &[]).await;
        retry.assert_created("acct-early", 250);
        assert!(!retry.replayed(), "{name}: the retry ran");
        let again = api.pay("early-1", "acct-early", 250, &[]).await;
        assert!(again.replayed(), "{name}");
        assert_eq!(api.totals("acct-early").await, (1, 250), "{name}");

        // A value it does not know is refused; without --test-hooks the header is
        // ignored.
        api.pay(
            "early-2",
            "acct-early",
            1,
            &[("x-simulate-failure", "later")],
        )
        .await
        .assert_problem(400);
    }
    let plain = Server::start(&[]);
    Api::new(&plain)
        .pay(
            "early-3",
            "acct-early",
            5,
            &[("x-simulate-failure", "before-commit-point")],
        )
        .await
        .assert_created("acct-early", 5);
}

#[test]
fn help_lists_the_endpoints_and_the_principal() {
    let out = std::process::Command::new(retrysafe_test_support::payments::binary())
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let usage = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "POST /payments",
        "GET /payments?account=A",
        "idempotency-key",
        "authorization: Bearer TOKEN",
        "request-timeout-ms",
        "x-simulate-failure: before-commit-point",
    ] {
        assert!(usage.contains(needle), "{needle}: {usage}");
    }
}

#[test]
fn startup_errors_name_what_and_where() {
    // A store that is down: said at once, once, with the address (not a pool timeout,
    // not the cause three times).
    for (store, name) in [
        ("postgres://postgres@127.0.0.1:1/test", "postgres"),
        ("redis://127.0.0.1:1", "redis"),
    ] {
        let (status, stderr) =
            retrysafe_test_support::payments::run_to_exit(&["--store", store], &[]);
        assert_eq!(status.code(), Some(1), "{stderr}");
        assert_eq!(
            stderr.trim_end(),
            format!("error: cannot connect to the {name} store at {store}: connection refused"),
        );
    }
    // A URL that does not parse is a mistake in the command line: exit 2, named.
    for (store, what) in [
        ("redis://127.0.0.1:99999", "invalid Redis URL"),
        (
            "postgres://127.0.0.1/test?sslmode=bogus",
            "invalid PostgreSQL URL",
        ),
    ] {
        let (status, stderr) =
            retrysafe_test_support::payments::run_to_exit(&["--store", store], &[]);
        assert_eq!(status.code(), Some(2), "{stderr}");
        assert!(
            stderr.starts_with(&format!("error: --store: {what}")),
            "{stderr}"
        );
    }
}
