//! Runs the small examples a user copies from (`axum_server`, `reqwest_client`,
//! `tonic_client`) as a user would, and checks that each terminates with exit code 0
//! and prints what its documentation promises.
// Test code: a failed expectation panics; the lines are indexed after their count is
// checked; the run's time limit is the machine's (std) clock, as for any child process.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::disallowed_methods,
    missing_docs
)]

use retrysafe_test_support::example::example_binary;
use std::process::Command;
use std::time::{Duration, Instant};

/// Runs example `name` (no arguments) and returns its stdout; fails the test unless it
/// exits 0 within a minute.
fn run(name: &str) -> String {
    let binary = example_binary(name);
    let mut child = Command::new(binary)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the example");
    let started = Instant::now();
    while child.try_wait().expect("poll the example").is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            child.kill().ok();
            panic!("example {name} did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child
        .wait_with_output()
        .expect("collect the example's output");
    let stdout = String::from_utf8(output.stdout).expect("UTF-8 stdout");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{name} exited with {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    stdout
}

#[test]
fn axum_server_replays_and_charges_once() {
    let stdout = run("axum_server");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{stdout}");
    assert_eq!(lines[0], "POST 10 EUR: 201 replayed=false charge 1: 10 EUR");
    assert_eq!(lines[1], "POST 10 EUR: 201 replayed=true charge 1: 10 EUR");
    // The same key for another request: a 422 problem, and no second charge.
    assert!(
        lines[2].starts_with("POST 99 EUR: 422 replayed=false {"),
        "{stdout}"
    );
    assert!(lines[2].contains("key-mismatch"), "{stdout}");
    assert_eq!(lines[3], "charges: 1");
}

#[test]
fn reqwest_client_retries_a_keyed_post_once() {
    let stdout = run("reqwest_client");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    assert_eq!(lines[0], "status: 201");
    let key = |line: &str| {
        let rest = line.split("idempotency-key=").nth(1).unwrap();
        rest.split(' ').next().unwrap().to_owned()
    };
    assert!(
        lines[1].starts_with("attempt 1: idempotency-key="),
        "{stdout}"
    );
    assert!(lines[1].ends_with(" retry-attempt=-"), "{stdout}");
    assert!(
        lines[2].starts_with("attempt 2: idempotency-key="),
        "{stdout}"
    );
    assert!(lines[2].ends_with(" retry-attempt=2"), "{stdout}");
    // A generated key, the same on both attempts.
    assert_ne!(key(lines[1]), "-");
    assert_eq!(key(lines[1]), key(lines[2]));
}

#[test]
fn tonic_client_gets_serving() {
    assert_eq!(run("tonic_client"), "status: SERVING\n");
}
