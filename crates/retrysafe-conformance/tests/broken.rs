//! The checker against servers on loopback: two correct ones (retrysafe's own stack,
//! and a small guard written from the convention alone) pass every rule; each
//! deliberately broken one fails exactly the rules its defect breaks, and nothing
//! else, with a detail that says what was seen.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    clippy::print_stdout
)]

mod support;

use retrysafe_conformance::{Report, Verdict};
use support::{Breakage, Defects, Server, retrysafe_stack, small_guard};

/// Runs the checker against `server`; prints and returns its report.
async fn checked(server: &Server) -> Report {
    let report = server.check().await;
    println!("{}", report.to_text());
    report
}

/// Asserts that exactly `ids` failed, and that nothing was skipped.
fn assert_failed(report: &Report, ids: &[&str]) {
    assert_eq!(report.ids(Verdict::Fail), ids, "{}", report.to_text());
    assert_eq!(report.skipped(), 0, "{}", report.to_text());
}

fn detail<'r>(report: &'r Report, id: &str) -> &'r str {
    &report.outcome(id).unwrap().detail
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retrysafe_s_own_stack_passes_every_rule() {
    let server = retrysafe_stack(None).await;
    let report = checked(&server).await;
    assert_failed(&report, &[]);
    assert_eq!(report.passed(), retrysafe_conformance::RULES.len());
    // Copies at once met the first in flight: the 409 path was checked too.
    assert!(detail(&report, "concurrent.copies").contains("409 request-in-flight"));
    assert!(detail(&report, "retry-after.syntax").contains("retry-after values"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_written_from_the_convention_alone_passes_every_rule() {
    let server = small_guard(Defects::default(), true).await;
    assert_failed(&checked(&server).await, &[]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_without_the_marker_fail_replay_marked_only() {
    let server = retrysafe_stack(Some(Breakage::UnmarkedReplays)).await;
    let report = checked(&server).await;
    assert_failed(&report, &["replay.marked"]);
    assert!(
        detail(&report, "replay.marked")
            .contains("expected idempotent-replayed: true, got no such header"),
        "{}",
        detail(&report, "replay.marked")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_that_runs_copies_in_flight_fails_the_rules_of_copies() {
    let defects = Defects {
        runs_copies_in_flight: true,
        ..Defects::default()
    };
    let server = small_guard(defects, true).await;
    let report = checked(&server).await;
    assert_eq!(
        report.ids(Verdict::Fail),
        [
            "mismatch.concurrent",
            "concurrent.copies",
            "lost-reply.mid-request",
        ],
        "{}",
        report.to_text()
    );
    // It never answers 409, so no retry-after is ever seen.
    assert_eq!(report.ids(Verdict::Skip), ["retry-after.syntax"]);
    let copies = detail(&report, "concurrent.copies");
    assert!(copies.contains("another body"), "{copies}");
    let lost = detail(&report, "lost-reply.mid-request");
    assert!(lost.contains("expected 1 effect"), "{lost}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_that_ignores_the_request_fails_the_mismatch_rules() {
    let defects = Defects {
        ignores_mismatch: true,
        ..Defects::default()
    };
    let server = small_guard(defects, true).await;
    let report = checked(&server).await;
    assert_failed(
        &report,
        &["mismatch.body", "mismatch.query", "mismatch.concurrent"],
    );
    let body = detail(&report, "mismatch.body");
    assert!(
        body.contains("expected 422 problem key-mismatch, got 201"),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_problem_type_fails_the_rules_that_expect_it() {
    let server = retrysafe_stack(Some(Breakage::RenamedKeyInvalid)).await;
    let report = checked(&server).await;
    assert_failed(
        &report,
        &[
            "key.too-long",
            "key.empty",
            "key.invalid-characters",
            "key.twice",
        ],
    );
    let empty = detail(&report, "key.empty");
    assert!(
        empty.contains("expected 400 problem key-invalid, got 400 problem invalid-key"),
        "{empty}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_409_without_retry_after_fails_concurrent_copies_only() {
    let server = retrysafe_stack(Some(Breakage::NoRetryAfterOn409)).await;
    let report = checked(&server).await;
    assert_eq!(
        report.ids(Verdict::Fail),
        ["concurrent.copies"],
        "{}",
        report.to_text()
    );
    let copies = detail(&report, "concurrent.copies");
    assert!(copies.contains("must carry retry-after"), "{copies}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn problems_sent_as_plain_json_fail_problem_documents_only() {
    let server = retrysafe_stack(Some(Breakage::ProblemsAsJson)).await;
    let report = checked(&server).await;
    assert_failed(&report, &["problem.documents"]);
    let documents = detail(&report, "problem.documents");
    assert!(
        documents.contains("not application/problem+json"),
        "{documents}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_that_lose_their_content_type_fail_replay_headers_only() {
    let server = retrysafe_stack(Some(Breakage::ReplaysWithoutContentType)).await;
    let report = checked(&server).await;
    assert_failed(&report, &["replay.headers"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_ignores_request_timeout_ms_fails_its_rules_only() {
    let server = small_guard(Defects::default(), false).await;
    let report = checked(&server).await;
    assert_failed(
        &report,
        &["request-timeout-ms.malformed", "request-timeout-ms.zero"],
    );
    let zero = detail(&report, "request-timeout-ms.zero");
    assert!(
        zero.contains("expected 504 problem deadline-exceeded, got 201"),
        "{zero}"
    );
}
