//! The `retrysafe-conformance` command as users run it: its output format and exit
//! status against a correct server and a broken one, `--json`, what is skipped without
//! a ledger, an endpoint that cannot be reached, `--list`, `--help` and usage errors.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    clippy::print_stdout
)]

mod support;

use std::process::Output;

use retrysafe_conformance::RULES;
use support::{Breakage, retrysafe_stack};

async fn run(args: &[String]) -> Output {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_retrysafe-conformance"))
        .args(args)
        .output()
        .await
        .unwrap();
    println!("{}", String::from_utf8_lossy(&output.stdout));
    output
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).unwrap()
}

/// Every line but the last is `PASS|FAIL|SKIP <id> <title> [wire-convention#<section>]:
/// <detail>`, one per rule in order; the last is the summary. The verdicts, in order.
fn verdicts(text: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), RULES.len() + 1, "{text}");
    let mut seen = Vec::new();
    for (line, rule) in lines.iter().zip(RULES) {
        let (verdict, rest) = line.split_once(' ').unwrap();
        assert!(["PASS", "FAIL", "SKIP"].contains(&verdict), "{line}");
        let (id, rest) = rest.split_once(' ').unwrap();
        assert_eq!(id, rule.id);
        let head = format!("{} [wire-convention#{}]: ", rule.title, rule.section);
        let detail = rest.strip_prefix(&head).unwrap_or_else(|| panic!("{line}"));
        assert!(!detail.is_empty(), "{line}");
        seen.push((verdict.to_owned(), id.to_owned()));
    }
    let count = |v: &str| seen.iter().filter(|(verdict, _)| verdict == v).count();
    assert_eq!(
        *lines.last().unwrap(),
        format!(
            "conformance: {} passed, {} failed, {} skipped",
            count("PASS"),
            count("FAIL"),
            count("SKIP")
        )
    );
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conforming_server_passes_with_exit_status_0() {
    let server = retrysafe_stack(None).await;
    let output = run(&server.args()).await;
    assert_eq!(output.status.code(), Some(0));
    let verdicts = verdicts(&stdout(&output));
    assert!(verdicts.iter().all(|(v, _)| v == "PASS"), "{verdicts:?}");
    assert!(output.stderr.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_server_fails_with_exit_status_1_and_names_the_rule() {
    let server = retrysafe_stack(Some(Breakage::UnmarkedReplays)).await;
    let output = run(&server.args()).await;
    assert_eq!(output.status.code(), Some(1));
    let text = stdout(&output);
    let failed: Vec<String> = verdicts(&text)
        .into_iter()
        .filter(|(v, _)| v == "FAIL")
        .map(|(_, id)| id)
        .collect();
    assert_eq!(failed, ["replay.marked"]);
    assert!(text.ends_with(&format!(
        "conformance: {} passed, 1 failed, 0 skipped\n",
        RULES.len() - 1
    )));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_is_one_document_with_every_rule() {
    let server = retrysafe_stack(Some(Breakage::UnmarkedReplays)).await;
    let mut args = server.args();
    args.push("--json".to_owned());
    let output = run(&args).await;
    assert_eq!(output.status.code(), Some(1));
    let text = stdout(&output);
    assert_eq!(text.lines().count(), 1);
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rules = json["rules"].as_array().unwrap();
    assert_eq!(rules.len(), RULES.len());
    for (entry, rule) in rules.iter().zip(RULES) {
        assert_eq!(entry["id"], rule.id);
        assert_eq!(entry["title"], rule.title);
        assert_eq!(entry["section"], rule.section_ref());
        assert!(entry["detail"].as_str().is_some_and(|d| !d.is_empty()));
    }
    let marked = rules.iter().find(|r| r["id"] == "replay.marked").unwrap();
    assert_eq!(marked["verdict"], "fail");
    assert_eq!(
        (&json["passed"], &json["failed"], &json["skipped"]),
        (
            &serde_json::json!(RULES.len() - 1),
            &serde_json::json!(1),
            &serde_json::json!(0)
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_ledger_effects_are_not_counted_and_say_so() {
    let server = retrysafe_stack(None).await;
    let args: Vec<String> = server.args().into_iter().take(6).collect();
    assert!(!args.iter().any(|a| a == "--ledger-url"));
    let output = run(&args).await;
    assert_eq!(output.status.code(), Some(0));
    let text = stdout(&output);
    let skipped: Vec<String> = verdicts(&text)
        .into_iter()
        .filter(|(v, _)| v == "SKIP")
        .map(|(_, id)| id)
        .collect();
    assert_eq!(skipped, ["ledger.counts-effects", "lost-reply.mid-request"]);
    assert!(text.contains("give --ledger-url"), "{text}");
    assert!(
        text.contains("effects not counted (no --ledger-url)"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_that_does_not_count_the_endpoint_fails_and_stops_counting() {
    let server = retrysafe_stack(None).await;
    let elsewhere = retrysafe_stack(None).await;
    let mut args = server.args();
    let ledger = args.iter().position(|a| a == "--ledger-url").unwrap() + 1;
    // Another server's ledger: it never moves.
    args[ledger] = format!("{}/count", elsewhere.base);
    let output = run(&args).await;
    let text = stdout(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    let failed: Vec<String> = verdicts(&text)
        .into_iter()
        .filter(|(v, _)| v == "FAIL")
        .map(|(_, id)| id)
        .collect();
    assert_eq!(failed, ["ledger.counts-effects"]);
    let line = text.lines().nth(1).unwrap();
    assert!(line.contains("went from 0 to 0"), "{line}");
    assert!(
        text.contains("effects not counted (the ledger does not count this endpoint's effects"),
        "{text}"
    );

    // One that does not answer a count at all.
    args[ledger] = format!("{}/nowhere", server.base);
    let output = run(&args).await;
    let text = stdout(&output);
    let line = text.lines().nth(1).unwrap();
    assert!(line.starts_with("FAIL ledger.counts-effects"), "{line}");
    assert!(line.contains("answered 404"), "{line}");
}

#[tokio::test]
async fn an_endpoint_that_cannot_be_reached_fails_the_setup_and_skips_the_rest() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/payments", listener.local_addr().unwrap());
    drop(listener);
    let output = run(&["--url".to_owned(), url]).await;
    assert_eq!(output.status.code(), Some(1));
    let text = stdout(&output);
    let verdicts = verdicts(&text);
    assert_eq!(
        verdicts[0],
        ("FAIL".to_owned(), "setup.first-request".to_owned())
    );
    assert!(
        text.lines().next().unwrap().contains("cannot connect"),
        "{text}"
    );
    assert!(
        verdicts[1..].iter().all(|(v, _)| v == "SKIP"),
        "{verdicts:?}"
    );
}

#[tokio::test]
async fn list_and_help_print_and_exit_0() {
    let list = run(&["--list".to_owned()]).await;
    assert_eq!(list.status.code(), Some(0));
    let text = stdout(&list);
    assert_eq!(text.lines().count(), RULES.len());
    assert!(
        text.lines()
            .next()
            .unwrap()
            .starts_with("setup.first-request ")
    );
    let help = run(&["--help".to_owned()]).await;
    assert_eq!(help.status.code(), Some(0));
    assert!(stdout(&help).starts_with("usage: retrysafe-conformance --url URL"));
}

#[tokio::test]
async fn usage_errors_exit_2_with_the_usage_on_stderr() {
    for args in [
        &[][..],
        &["--url", "https://api.example/payments"],
        &["--url", "http://127.0.0.1:1/p", "--body", "{not json"],
        &[
            "--url",
            "http://127.0.0.1:1/p",
            "--header",
            "Idempotency-Key: mine",
        ],
        &["--url", "http://127.0.0.1:1/p", "--verbose"],
    ] {
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        let output = run(&args).await;
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(output.stdout.is_empty());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.starts_with("error: "), "{stderr}");
        assert!(stderr.contains("usage: retrysafe-conformance"), "{stderr}");
    }
}
