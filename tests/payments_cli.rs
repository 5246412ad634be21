//! Drives the `payments` example as an outside user would: starts the binary, reads the
//! `listening on http://ADDR` line, and talks HTTP to it.
// This test drives a real child process on the wall clock (reading its stdout from a
// thread, waiting for it to exit), so it uses std's clock and sleeps on purpose.
#![allow(
    clippy::disallowed_methods,
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use std::time::{Duration, Instant};

use http::{HeaderValue, StatusCode};
use retrysafe_test_support::payments::{Answer, Api, Server, binary, run_to_exit};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_replay_and_bad_input_is_refused() {
    let server = Server::start(&[]);
    let api = Api::new(&server);

    // Duplicates: the first answer, replayed, and one payment.
    let first = api.pay("dup-1", "acct-dup", 1250, &[]).await;
    first.assert_created("acct-dup", 1250);
    assert!(!first.replayed());
    let again = api.pay("dup-1", "acct-dup", 1250, &[]).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.headers["idempotent-replayed"], "true", "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(api.totals("acct-dup").await, (1, 1250));

    // The same key with another body: 422, do-not-retry, nothing recorded.
    let changed = api.pay("dup-1", "acct-dup", 9999, &[]).await;
    changed.assert_problem(422);
    assert_eq!(changed.headers["do-not-retry"], "1");
    assert_eq!(api.totals("acct-dup").await, (1, 1250));

    // Missing key.
    let no_key = api
        .send(
            api.post()
                .json(&json!({ "account": "acct-dup", "amount_cents": 1 })),
        )
        .await;
    no_key.assert_problem(400);

    // Key length: 255 characters are fine, 256 are not.
    let k255 = "k".repeat(255);
    api.pay(&k255, "acct-keys", 7, &[])
        .await
        .assert_created("acct-keys", 7);
    let k256 = "k".repeat(256);
    api.pay(&k256, "acct-keys", 7, &[])
        .await
        .assert_problem(400);

    // A non-ASCII key, as raw bytes.
    let non_ascii = api
        .send(
            api.post()
                .header(
                    "idempotency-key",
                    HeaderValue::from_bytes(b"caf\xc3\xa9-1").unwrap(),
                )
                .json(&json!({ "account": "acct-keys", "amount_cents": 7 })),
        )
        .await;
    non_ascii.assert_problem(400);
    assert_eq!(api.totals("acct-keys").await, (1, 7));

    // Bodies over 1 MiB (under and over axum's own 2 MB default): 413 from the layer.
    for size in [1024 * 1024 + 1, 3 * 512 * 1024, 2 * 1024 * 1024] {
        let big = api
            .send(
                api.post()
                    .header("idempotency-key", format!("big-{size}"))
                    .header("content-type", "application/json")
                    .body(vec![b' '; size]),
            )
            .await;
        big.assert_problem(413);
    }

    // Malformed JSON: a 4xx answer, stored like any other, with no payment.
    let malformed = api
        .send(
            api.post()
                .header("idempotency-key", "malformed-1")
                .header("content-type", "application/json")
                .body("{\"account\": "),
        )
        .await;
    assert!(
        matches!(malformed.status.as_u16(), 400 | 422),
        "{malformed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_have_one_effect() {
    let server = Server::start(&[]);
    let api = Api::new(&server);

    let answers = api
        .pay_concurrently(30, "concurrent-1", "acct-concurrent", 990, "600")
        .await;

    let created: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED)
        .collect();
    assert!(!created.is_empty(), "no 201 among {answers:?}");
    assert_eq!(
        created.iter().filter(|a| !a.replayed()).count(),
        1,
        "exactly one copy runs"
    );
    for a in &created {
        assert_eq!(a.body, created[0].body, "every 201 is the same answer");
    }
    for a in answers.iter().filter(|a| a.status != StatusCode::CREATED) {
        a.assert_problem(409);
        assert!(a.headers.contains_key("retry-after"), "{a:?}");
    }
    assert_eq!(api.totals("acct-concurrent").await, (1, 990));

    let later = api.pay("concurrent-1", "acct-concurrent", 990, &[]).await;
    assert!(later.replayed(), "{later:?}");
    assert_eq!(later.body, created[0].body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_failure_then_clean_retry_runs_once() {
    let server = Server::start(&[]);
    let api = Api::new(&server);

    let failed = api
        .pay("fail-1", "acct-fail", 4200, &[("x-simulate-fail", "500")])
        .await;
    failed.assert_problem(500);
    assert_eq!(api.totals("acct-fail").await, (0, 0));

    let retry = api.pay("fail-1", "acct-fail", 4200, &[]).await;
    retry.assert_created("acct-fail", 4200);
    assert!(!retry.replayed(), "{retry:?}");
    assert_eq!(api.totals("acct-fail").await, (1, 4200));

    let again = api.pay("fail-1", "acct-fail", 4200, &[]).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, retry.body);
    assert_eq!(api.totals("acct-fail").await, (1, 4200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_delay_after_hook_waits_after_the_effect() {
    let server = Server::start(&[]);
    let api = Api::new(&server);

    let slow = {
        let api = api.clone();
        tokio::spawn(async move {
            api.pay(
                "after-1",
                "acct-after",
                75,
                &[("x-simulate-delay-after-ms", "30000")],
            )
            .await
        })
    };
    // The payment is recorded while its request is still in flight.
    let started = Instant::now();
    while api.totals("acct-after").await != (1, 75) {
        assert!(started.elapsed() < Duration::from_secs(20), "no payment");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    api.pay("after-1", "acct-after", 75, &[])
        .await
        .assert_problem(409);
    slow.abort();

    // Bad hook values are refused before anything happens.
    for (name, value) in [
        ("x-simulate-delay-after-ms", "soon"),
        ("x-simulate-delay-after-ms", "30001"),
        ("x-simulate-delay-ms", "-1"),
        ("x-simulate-fail", "404"),
    ] {
        let bad = api.pay("hook-1", "acct-hook", 1, &[(name, value)]).await;
        bad.assert_problem(400);
        assert!(
            bad.json()["type"]
                .as_str()
                .unwrap()
                .ends_with("invalid-test-hook")
        );
    }
    assert_eq!(api.totals("acct-hook").await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_principal_has_its_own_keys() {
    let server = Server::start(&[]);
    let api = Api::new(&server);

    let alice = api
        .pay(
            "shared-key",
            "acct-auth",
            100,
            &[("authorization", "Bearer alice")],
        )
        .await;
    let bob = api
        .pay(
            "shared-key",
            "acct-auth",
            100,
            &[("authorization", "Bearer bob")],
        )
        .await;
    let alice_id = alice.assert_created("acct-auth", 100);
    let bob_id = bob.assert_created("acct-auth", 100);
    assert!(!alice.replayed() && !bob.replayed());
    assert_ne!(alice_id, bob_id);
    assert_eq!(api.totals("acct-auth").await, (2, 200));

    // Each principal's retry replays its own answer.
    let alice_again = api
        .pay(
            "shared-key",
            "acct-auth",
            100,
            &[("authorization", "Bearer alice")],
        )
        .await;
    assert!(alice_again.replayed());
    assert_eq!(alice_again.body, alice.body);
    assert_eq!(api.totals("acct-auth").await, (2, 200));

    // A malformed Authorization header is refused before anything is recorded.
    let malformed = api
        .pay(
            "shared-key",
            "acct-auth",
            100,
            &[("authorization", "Basic")],
        )
        .await;
    malformed.assert_problem(401);
    assert_eq!(api.totals("acct-auth").await, (2, 200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_new_again_after_the_ttl() {
    let server = Server::start(&["--ttl-ms", "1000"]);
    let api = Api::new(&server);

    let first = api.pay("ttl-1", "acct-ttl", 50, &[]).await;
    let first_id = first.assert_created("acct-ttl", 50);
    assert!(api.pay("ttl-1", "acct-ttl", 50, &[]).await.replayed());

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let later = api.pay("ttl-1", "acct-ttl", 50, &[]).await;
    let later_id = later.assert_created("acct-ttl", 50);
    assert!(!later.replayed(), "{later:?}");
    assert_ne!(first_id, later_id);
    assert_eq!(api.totals("acct-ttl").await, (2, 100));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_wait_gives_every_copy_the_answer() {
    let server = Server::start(&["--in-flight", "wait"]);
    let api = Api::new(&server);

    let answers = api
        .pay_concurrently(10, "wait-1", "acct-wait", 300, "500")
        .await;
    for a in &answers {
        a.assert_created("acct-wait", 300);
        assert_eq!(a.body, answers[0].body, "every copy gets the same answer");
    }
    assert_eq!(answers.iter().filter(|a| !a.replayed()).count(), 1);
    assert_eq!(api.totals("acct-wait").await, (1, 300));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_lease_is_renewed_while_the_handler_runs() {
    let server = Server::start(&["--lease-ms", "200"]);
    let api = Api::new(&server);

    let slow = {
        let api = api.clone();
        tokio::spawn(async move {
            api.pay(
                "lease-1",
                "acct-lease",
                10,
                &[("x-simulate-delay-ms", "800")],
            )
            .await
        })
    };
    // Well past the first lease: the holder renewed it, so a copy is a conflict, not a
    // takeover.
    tokio::time::sleep(Duration::from_millis(500)).await;
    api.pay("lease-1", "acct-lease", 10, &[])
        .await
        .assert_problem(409);
    slow.await.unwrap().assert_created("acct-lease", 10);
    assert_eq!(api.totals("acct-lease").await, (1, 10));
}

// A handler past `--max-execution-ms` is cancelled before its effect (the payments
// handler declares its commit point just before recording the payment): the client
// gets a retryable 5xx, nothing is recorded, and the retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_past_max_execution_is_cancelled_before_its_effect() {
    let server = Server::start(&["--max-execution-ms", "300"]);
    let api = Api::new(&server);
    let slow = api
        .pay(
            "exec-1",
            "acct-exec",
            10,
            &[("x-simulate-delay-ms", "2000")],
        )
        .await;
    assert!(slow.status.is_server_error(), "{slow:?}");
    assert_eq!(api.totals("acct-exec").await, (0, 0));
    api.pay("exec-1", "acct-exec", 10, &[])
        .await
        .assert_created("acct-exec", 10);
    assert_eq!(api.totals("acct-exec").await, (1, 10));
}

// The in-memory store takes a byte budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_store_takes_a_byte_budget() {
    let server = Server::start(&["--memory-bytes", "1048576"]);
    let api = Api::new(&server);
    api.pay("bytes-1", "acct-bytes", 5, &[])
        .await
        .assert_created("acct-bytes", 5);
    assert!(api.pay("bytes-1", "acct-bytes", 5, &[]).await.replayed());
    assert_eq!(api.totals("acct-bytes").await, (1, 5));
}

#[test]
fn unreachable_stores_and_bad_arguments_exit_non_zero() {
    // Nothing listens on port 1: the store cannot be reached, and the process says so
    // (exit 1) instead of serving without its store.
    for (store, name) in [
        ("redis://127.0.0.1:1", "redis"),
        ("postgres://postgres@127.0.0.1:1/test", "postgres"),
    ] {
        let (status, stderr) = run_to_exit(&["--listen", "127.0.0.1:0", "--store", store], &[]);
        assert_eq!(status.code(), Some(1), "--store {store}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "error: cannot connect to the {name} store at {store}"
            )),
            "--store {store}: {stderr:?}"
        );
    }
    // A password in the URL is not echoed.
    let (status, stderr) = run_to_exit(
        &["--store", "postgres://alice:s3cret@127.0.0.1:1/test"],
        &[],
    );
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("postgres://alice:***@127.0.0.1:1/test"),
        "{stderr}"
    );
    assert!(!stderr.contains("s3cret"), "{stderr}");

    // A schema name that is not one is refused before connecting.
    let (status, stderr) = run_to_exit(
        &["--store", "postgres://postgres@127.0.0.1:1/test"],
        &[("PAYMENTS_PG_SCHEMA", "Bad-Name; DROP")],
    );
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("error: PAYMENTS_PG_SCHEMA"), "{stderr}");

    for bad in [
        &["--bogus"][..],
        &["--listen"],
        &["--lease-ms", "soon"],
        &["--ttl-ms", "0"],
        &["--in-flight", "sometimes"],
        &["--store", "mysql://x"],
        &["--max-execution-ms", "0"],
        &["--memory-bytes", "lots"],
        &["--memory-bytes", "0"],
        &["--store", "redis://127.0.0.1:1", "--memory-bytes", "4096"],
        &["--reconcile-ms", "often"],
        &["--reconcile-ms", "-1"],
        &["--test-hooks", "--test-hooks"],
    ] {
        let (status, stderr) = run_to_exit(bad, &[]);
        assert_eq!(status.code(), Some(2), "{bad:?}: {stderr}");
        assert!(stderr.starts_with("error: "), "{bad:?}: {stderr}");
    }
}

/// `--reconcile-ms` and `--test-hooks` are accepted with the memory store (a reconciler
/// over it resolves nothing a crash could leave: the store dies with the process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_store_takes_a_reconciler_and_the_test_hooks() {
    let server = Server::start(&["--reconcile-ms", "50", "--test-hooks"]);
    let api = Api::new(&server);
    let first = api.pay("rec-cli-1", "acme", 700, &[]).await;
    let id = first.assert_created("acme", 700);
    let again = api.pay("rec-cli-1", "acme", 700, &[]).await;
    assert_eq!(again.assert_created("acme", 700), id);
    assert!(again.replayed());
    let off = Server::start(&["--reconcile-ms", "0"]);
    Api::new(&off)
        .pay("rec-cli-2", "acme", 1, &[])
        .await
        .assert_created("acme", 1);
}

#[test]
fn help_names_the_stores_and_their_environment() {
    let out = std::process::Command::new(binary())
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let usage = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "redis://",
        "postgres://",
        "PAYMENTS_REDIS_PREFIX",
        "PAYMENTS_PG_SCHEMA",
        "--in-flight",
        "--reconcile-ms",
        "--metrics-listen",
        "--test-hooks",
        "x-simulate-crash",
    ] {
        assert!(usage.contains(needle), "{needle}: {usage}");
    }
    assert!(!usage.contains("not yet"), "{usage}");
}
