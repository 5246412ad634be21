//! Drives the `jitter` example as an outside user would: builds and runs the binary,
//! parses its last stdout line as JSON, and checks the published ordering of
//! "Exponential Backoff and Jitter", the SVG chart, and that a seed fixes the output.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    clippy::print_stdout,
    clippy::disallowed_methods
)]

use std::path::{Path, PathBuf};
use std::process::Command;

use retrysafe_test_support::example::example_binary;
use serde_json::Value;

const STRATEGIES: [&str; 5] = ["no_backoff", "exponential", "full", "equal", "decorrelated"];

/// The `jitter` example's binary.
fn binary() -> PathBuf {
    example_binary("jitter")
}

/// What one run printed.
#[derive(Debug)]
struct Run {
    stdout: String,
    json: Value,
    svg: PathBuf,
}

/// Runs the example with `args` and parses its output.
fn run(args: &[&str]) -> Run {
    let output = Command::new(binary())
        .args(args)
        .output()
        .expect("run the jitter example");
    let stdout = String::from_utf8(output.stdout).unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "jitter {args:?} failed: {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    let last = stdout.lines().last().expect("some output");
    let json: Value = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("last line {last:?} is not JSON: {e}"));
    let svg = stdout
        .lines()
        .find_map(|line| line.strip_prefix("wrote "))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("no `wrote PATH` line in:\n{stdout}"));
    Run { stdout, json, svg }
}

fn figure(json: &Value, section: &str, key: &str) -> u64 {
    json[section][key]
        .as_u64()
        .unwrap_or_else(|| panic!("{section}.{key} is not an integer in {json}"))
}

fn assert_svg(path: &Path) {
    let svg = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read the chart {}: {e}", path.display()));
    assert!(
        svg.starts_with("<svg") || svg.starts_with("<?xml"),
        "{} is not an SVG: {:?}",
        path.display(),
        &svg[..svg.len().min(80)]
    );
    assert!(svg.trim_end().ends_with("</svg>"), "truncated chart");
    // Two panels, one line per strategy each.
    assert_eq!(
        svg.matches(r#"stroke-width="2""#).count(),
        10,
        "one polyline per strategy and panel"
    );
    for label in [
        "no backoff",
        "full jitter",
        "equal jitter",
        "decorrelated jitter",
    ] {
        assert!(svg.contains(label), "legend lacks {label:?}");
    }
}

#[test]
fn default_run_reproduces_the_published_ordering() {
    let Run { stdout, json, svg } = run(&[]);
    println!("{stdout}");

    let object = json.as_object().expect("a JSON object");
    let mut keys: Vec<&str> = object.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["calls", "clients", "time_ms"]);
    assert_eq!(json["clients"], 100);
    for section in ["calls", "time_ms"] {
        let mut keys: Vec<&str> = json[section]
            .as_object()
            .unwrap_or_else(|| panic!("{section} is not an object"))
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        let mut expected = STRATEGIES;
        expected.sort_unstable();
        assert_eq!(keys, expected, "keys of {section}");
        for key in STRATEGIES {
            assert!(figure(&json, section, key) > 0, "{section}.{key} is zero");
        }
    }

    let calls = |key| figure(&json, "calls", key);
    // Every client writes once, so there are at least as many calls as clients.
    for key in STRATEGIES {
        assert!(calls(key) >= 100, "{key}: {} calls", calls(key));
    }
    // Exponential backoff without jitter does about twice the work of full jitter.
    assert!(
        calls("exponential") * 2 >= calls("full") * 3,
        "exponential {} < 1.5 x full {}",
        calls("exponential"),
        calls("full")
    );
    // Without jitter, backing off or not, clients collide far more.
    for worst in ["no_backoff", "exponential"] {
        for best in ["full", "decorrelated"] {
            assert!(
                calls(worst) > calls(best),
                "{worst} {} <= {best} {}",
                calls(worst),
                calls(best)
            );
        }
    }
    // Exponential without jitter keeps the clients in lockstep: slowest to finish.
    let time = |key| figure(&json, "time_ms", key);
    for other in ["full", "equal", "decorrelated"] {
        assert!(
            time("exponential") > time(other),
            "time: exponential vs {other}"
        );
    }

    // Two tables (calls, time), each with a row of five figures per client count.
    let rows: Vec<Vec<u64>> = stdout
        .lines()
        .map(|line| line.split_whitespace().map(str::parse).collect())
        .filter_map(Result::ok)
        .filter(|row: &Vec<u64>| row.len() == 1 + STRATEGIES.len())
        .collect();
    let expected: Vec<u64> = (10..=190).step_by(10).collect();
    let counts: Vec<u64> = rows.iter().map(|row| row[0]).collect();
    assert_eq!(counts, [expected.clone(), expected].concat(), "table rows");
    let at_100 = rows.iter().find(|row| row[0] == 100).unwrap();
    for (i, key) in STRATEGIES.iter().enumerate() {
        assert_eq!(at_100[1 + i], calls(key), "table and JSON agree on {key}");
    }
    assert_svg(&svg);
}

#[test]
fn the_same_seed_prints_the_same_figures() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("jitter_cli");
    let first_svg = dir.join("first.svg");
    let second_svg = dir.join("second.svg");
    let _ = std::fs::remove_file(&first_svg);
    let _ = std::fs::remove_file(&second_svg);

    let first = run(&[
        "--seed",
        "42",
        "--runs",
        "3",
        "--out",
        first_svg.to_str().unwrap(),
    ]);
    let second = run(&[
        "--seed",
        "42",
        "--runs",
        "3",
        "--out",
        second_svg.to_str().unwrap(),
    ]);
    assert_eq!(first.svg, first_svg);
    assert_eq!(second.svg, second_svg);
    assert_eq!(first.json, second.json);
    assert_eq!(
        first.stdout.lines().last(),
        second.stdout.lines().last(),
        "the JSON line, byte for byte"
    );
    let table = |stdout: &str| {
        stdout
            .lines()
            .filter(|line| !line.starts_with("wrote "))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(table(&first.stdout), table(&second.stdout));
    assert_svg(&first_svg);
    assert_eq!(
        std::fs::read(&first_svg).unwrap(),
        std::fs::read(&second_svg).unwrap(),
        "the same seed draws the same chart"
    );

    // Another seed draws other runs.
    let other = run(&[
        "--seed",
        "43",
        "--runs",
        "3",
        "--out",
        dir.join("other.svg").to_str().unwrap(),
    ]);
    assert_ne!(first.json, other.json, "the seed is not used");
}

#[test]
fn bad_arguments_are_refused() {
    for args in [
        &["--seed", "x"][..],
        &["--runs", "0"],
        &["--seed"],
        &["--colour", "blue"],
    ] {
        let output = Command::new(binary()).args(args).output().unwrap();
        assert_eq!(output.status.code(), Some(2), "jitter {args:?}");
        assert!(output.stdout.is_empty(), "jitter {args:?} printed results");
        assert!(
            !output.stderr.is_empty(),
            "jitter {args:?} explained nothing"
        );
    }
}
