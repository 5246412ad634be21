//! Drives the `chaos` example as an outside user would: builds and runs the binary,
//! parses its last stdout line as JSON and checks the documented keys, that every
//! payment was made once through the injected lost replies and errors, and that bad
//! arguments are refused.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    clippy::print_stdout
)]

use std::process::Command;

use retrysafe_test_support::example::{assert_non_utf8_argument_is_a_usage_error, example_binary};

const KEYS: [&str; 6] = [
    "duplicates",
    "effects",
    "errors_injected",
    "lost_replies_injected",
    "requests",
    "succeeded",
];

#[test]
fn a_run_prints_the_documented_json_with_no_duplicates() {
    let output = Command::new(example_binary("chaos"))
        .args(["--requests", "300", "--seed", "7"])
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
    let n = |k: &str| json[k].as_u64().unwrap_or_else(|| panic!("{k}: {json}"));
    assert_eq!(n("requests"), 300);
    assert_eq!(n("duplicates"), 0);
    // About 30 % of some 450 attempts lose their reply, 5 % are answered 503.
    assert!(n("lost_replies_injected") > 60, "{json}");
    assert!(n("errors_injected") > 5, "{json}");
    // A lost reply is retried with the same key and answered by the replay.
    assert!(n("succeeded") >= 290, "{json}");
    // Every request that succeeded paid once; one that failed may have paid (its last
    // reply lost) or not.
    assert!(n("effects") >= n("succeeded"), "{json}");
    assert!(n("effects") <= n("requests"), "{json}");
}

#[test]
fn bad_arguments_are_refused() {
    for args in [
        &["--requests", "0"][..],
        &["--requests"],
        &["--seed", "-1"],
        &["--colour", "blue"],
    ] {
        let output = Command::new(example_binary("chaos"))
            .args(args)
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(2), "chaos {args:?}");
        assert!(output.stdout.is_empty());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("usage: chaos"), "{stderr}");
    }
    assert_non_utf8_argument_is_a_usage_error("chaos");
}
