//! Drives the `retry_storm` example as an outside user would: builds and runs the
//! binary (a short run: its rates are flags), parses its last stdout line as JSON, and
//! checks the amplification figures: about 81 calls to D per request for the naive
//! stack, at most 3 for retrysafe at the start of an outage, and success rates at 10 %
//! failures. The full-length run (`cargo run --release --example retry_storm`) is
//! recorded in `BENCHMARKS.md`.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    clippy::disallowed_methods
)]

use std::path::PathBuf;
use std::process::Command;

use retrysafe_test_support::example::example_binary;
use serde_json::Value;

/// The `retry_storm` example's binary.
fn binary() -> PathBuf {
    example_binary("retry_storm")
}

#[test]
fn a_short_storm_reports_bounded_amplification() {
    let output = Command::new(binary())
        .args([
            "--rate",
            "100",
            "--secs",
            "6",
            "--naive",
            "3",
            "--requests",
            "300",
        ])
        .output()
        .expect("run the retry_storm example");
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(
        output.status.success(),
        "retry_storm failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let last = stdout.lines().last().expect("some output");
    let json: Value = serde_json::from_str(last).expect("the last line is JSON");
    let keys: Vec<&str> = json
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    for key in [
        "naive_outage",
        "retrysafe_outage_first",
        "retrysafe_outage_steady",
        "naive_success_10pct",
        "retrysafe_success_10pct",
    ] {
        assert!(keys.contains(&key), "missing {key} in {last}");
    }
    let f = |k: &str| json[k].as_f64().unwrap();
    // Naive: three attempts at each of four hops.
    assert!(f("naive_outage") > 27.0, "{last}");
    assert!(f("naive_outage") <= 81.0, "{last}");
    // retrysafe: only the hop next to D retries, within its budget.
    assert!(f("retrysafe_outage_first") >= 1.0, "{last}");
    assert!(f("retrysafe_outage_first") <= 3.0, "{last}");
    assert!(f("retrysafe_outage_steady") >= 1.0, "{last}");
    assert!(f("retrysafe_outage_steady") <= 3.0, "{last}");
    assert!(
        f("retrysafe_outage_steady") < f("naive_outage") / 10.0,
        "{last}"
    );
    // Three attempts at one point absorb 10 % failures.
    assert!(f("retrysafe_success_10pct") >= 0.99, "{last}");
    assert!(f("naive_success_10pct") >= 0.99, "{last}");
    // The readable table names its windows.
    assert!(stdout.contains("first 100 requests"), "{stdout}");
    assert!(stdout.contains("steady"), "{stdout}");
}

#[test]
fn a_bad_flag_is_a_usage_error() {
    let output = Command::new(binary())
        .args(["--rate", "fast"])
        .output()
        .expect("run the retry_storm example");
    assert_eq!(output.status.code(), Some(2));
    assert!(output.stdout.is_empty());
    assert!(String::from_utf8_lossy(&output.stderr).contains("usage"));
}
