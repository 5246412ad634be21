//! Drives the `outbox` example as an outside user would: a short run against the real
//! PostgreSQL and RabbitMQ, in which the relay and the consumer each crash at least
//! once (as its human-readable output counts); its last stdout line is the JSON of the
//! contract, with no duplicate and nothing missing.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    clippy::disallowed_methods
)]

use std::process::Command;

use retrysafe_test_support::example::example_binary;
use serde_json::Value;

const KEYS: [&str; 9] = [
    "orders",
    "downstream_effects",
    "consumer_effects",
    "http_sends",
    "amqp_deliveries",
    "duplicates",
    "missing_downstream",
    "missing_consumer",
    "dead_letters",
];

fn run(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let output = Command::new(example_binary("outbox"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run the outbox example");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The crash counts of the human-readable output, from its line
/// `relay: R crashes between send and mark; consumer: C crashes between commit and ack`.
fn crashes(stdout: &str) -> (u64, u64) {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("relay: "))
        .unwrap_or_else(|| panic!("no line of crash counts in {stdout}"));
    let count = |label: &str| {
        line.split(label)
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {label} count in {line}"))
    };
    (count("relay: "), count("consumer: "))
}

#[test]
fn a_short_run_with_crashes_has_no_duplicates_and_misses_nothing() {
    let (code, stdout, stderr) = run(&["--orders", "30"], &[("OUTBOX_SEED", "11")]);
    assert_eq!(code, Some(0), "stderr: {stderr}");
    let (relay_crashes, consumer_crashes) = crashes(&stdout);
    assert!(relay_crashes >= 1, "the relay never crashed: {stdout}");
    assert!(
        consumer_crashes >= 1,
        "the consumer never crashed: {stdout}"
    );
    let last = stdout.lines().last().expect("some output");
    let json: Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {last}"));
    let keys: Vec<&str> = json
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let mut expected = KEYS.to_vec();
    expected.sort_unstable();
    assert_eq!(keys, expected);
    let n = |k: &str| {
        json[k]
            .as_u64()
            .unwrap_or_else(|| panic!("{k} is not a count: {last}"))
    };
    assert_eq!(n("orders"), 30);
    assert_eq!(n("duplicates"), 0);
    assert_eq!(n("downstream_effects"), 30);
    assert_eq!(n("consumer_effects"), 30);
    assert_eq!(n("missing_downstream"), 0);
    assert_eq!(n("missing_consumer"), 0);
    assert_eq!(n("dead_letters"), 0);
    // Every effect took at least one send; crashes add resends, never effects.
    assert!(n("http_sends") >= 30);
    assert!(n("amqp_deliveries") >= 30);
}

#[test]
fn bad_arguments_are_a_usage_error() {
    let (code, stdout, stderr) = run(&["--orders", "0"], &[]);
    assert_eq!(code, Some(2));
    assert!(stdout.is_empty());
    assert!(stderr.contains("usage: outbox"), "{stderr}");
    let (code, _, stderr) = run(&["--frobnicate"], &[]);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("unknown argument --frobnicate"), "{stderr}");
}
