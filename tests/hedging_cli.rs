//! Drives the `hedging` example as an outside user would: builds and runs the binary
//! (a short run: fewer requests, a higher rate), parses its last stdout line as JSON
//! and checks its keys and what a short run can show (the 10b targets are checked on
//! the full `cargo run --release --example hedging`, in BENCHMARKS.md).
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    clippy::print_stdout
)]

use retrysafe_test_support::example::example_binary;
use std::process::Command;

const KEYS: [&str; 11] = [
    "budget_refusals",
    "extra_load_fixed_delay_overload",
    "extra_load_hedged",
    "extra_load_hedged_overload",
    "extra_load_tower",
    "extra_load_tower_overload",
    "hedges_sent",
    "p99_hedged_ms",
    "p99_hedged_overload_ms",
    "p99_plain_ms",
    "p99_tower_ms",
];

#[test]
fn a_short_run_prints_the_documented_json() {
    let output = Command::new(example_binary("hedging"))
        .args(["--requests", "1500", "--rate", "1500", "--seed", "3"])
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
    assert!(f("p99_plain_ms") >= 90.0, "2 % of answers take 100 ms");
    assert!(f("hedges_sent") > 0.0);
    assert!(
        f("budget_refusals") > 0.0,
        "the fixed 5 ms delay meets the budget"
    );
    assert!(
        f("extra_load_fixed_delay_overload") <= 0.6,
        "bounded by the budget"
    );
}

#[test]
fn bad_arguments_are_refused() {
    for args in [&["--requests", "0"][..], &["--rate"], &["--colour", "blue"]] {
        let output = Command::new(example_binary("hedging"))
            .args(args)
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(2), "hedging {args:?}");
        assert!(output.stdout.is_empty());
    }
}
