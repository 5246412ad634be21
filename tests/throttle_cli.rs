//! Drives the `throttle` example as an outside user would: builds and runs the binary
//! (a short run), parses its last stdout line as JSON and checks its keys and the
//! direction of its figures (the 10b targets are checked on the full
//! `cargo run --release --example throttle`, in BENCHMARKS.md).
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    clippy::print_stdout
)]

use retrysafe_test_support::example::example_binary;
use std::process::Command;

const KEYS: [&str; 8] = [
    "accepted_rps_plain",
    "accepted_rps_throttled",
    "backend_rps_plain",
    "backend_rps_throttled",
    "capacity_rps",
    "client_rejected_rps",
    "k",
    "offered_rps",
];

#[test]
fn a_short_run_prints_the_documented_json() {
    let output = Command::new(example_binary("throttle"))
        .args(["--secs", "4", "--capacity", "100", "--seed", "3"])
        .output()
        .unwrap();
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    println!("{stdout}");
    let json: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let mut keys: Vec<&str> = json
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(keys, KEYS);
    let f = |k: &str| json[k].as_f64().unwrap();
    assert_eq!(f("capacity_rps"), 100.0);
    assert_eq!(f("k"), 2.0);
    assert!(f("client_rejected_rps") > 0.0);
    assert!(f("backend_rps_throttled") < f("backend_rps_plain"));
}

#[test]
fn bad_arguments_are_refused() {
    for args in [&["--secs", "0"][..], &["--capacity"], &["--colour", "blue"]] {
        let output = Command::new(example_binary("throttle"))
            .args(args)
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(2), "throttle {args:?}");
        assert!(output.stdout.is_empty());
    }
}
