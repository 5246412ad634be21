//! The chain example (axum → reqwest → axum with an `IdempotencyLayer` → tonic → tonic
//! server), run as users run it: one retry point (the tier facing the fault), deadlines
//! shrinking hop by hop across HTTP and gRPC, and child keys that keep a re-run parent
//! from repeating its downstream effect.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use std::process::Command;

use retrysafe_test_support::example::example_binary;
use serde_json::Value;

#[test]
fn one_retry_point_shrinking_deadlines_and_no_duplicate_downstream_effect() {
    let output = Command::new(example_binary("chain"))
        .output()
        .expect("run the chain example");
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();

    // Re-run: B's first run failed after calling C; A retried with the same key, B ran
    // again, and its call to C carried the same child key: one effect at C.
    let rerun = &json["rerun"];
    assert_eq!(rerun["status"], 201, "{json}");
    assert_eq!(rerun["b_requests"], 2, "{json}");
    assert_eq!(rerun["b_runs"], 2, "{json}");
    assert_eq!(rerun["c_calls"], 2, "{json}");
    assert_eq!(rerun["c_distinct_keys"], 1, "{json}");
    assert_eq!(rerun["c_effects"], 1, "{json}");

    // Deadlines shrink hop by hop: the client's 3000 ms, less A's 10 ms margin (and
    // the time spent) on the way to B, less B's on the way to C, over gRPC.
    let deadline = |tier: &str| rerun["deadline_ms"][tier].as_u64().unwrap();
    assert_eq!(deadline("a"), 3000);
    assert!(deadline("b") <= 2990, "{json}");
    assert!(deadline("b") > 0);
    assert!(deadline("c") + 10 <= deadline("b"), "{json}");
    assert!(deadline("c") > 0);

    // Outage: only B, which faces C, retries (3 attempts); its 503 is marked, so A does
    // not retry it and the client is told not to either.
    let outage = &json["outage"];
    let requests = outage["requests"].as_u64().unwrap();
    assert_eq!(outage["b_requests"].as_u64().unwrap(), requests, "{json}");
    assert_eq!(outage["c_calls"].as_u64().unwrap(), 3 * requests, "{json}");
    assert_eq!(outage["statuses"], serde_json::json!([503]), "{json}");
    assert_eq!(outage["marked"], true, "{json}");
}
