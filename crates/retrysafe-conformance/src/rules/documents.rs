//! What every answer of the run shows: the convention's problem documents and
//! `retry-after` values.

use std::collections::BTreeMap;

use super::{Ctx, Finding, fail, pass, skip};
use crate::check::{PROBLEM_PREFIX, problem_document, problem_type, retry_after_syntax};

/// `problem.documents`: every answer whose `type` is a convention problem type is an
/// RFC 9457 document of the convention's form, and one type has one title.
pub(super) fn problems(ctx: &Ctx<'_>) -> Finding {
    let mut titles: BTreeMap<String, String> = BTreeMap::new();
    let mut checked = 0;
    for answer in ctx.seen() {
        let Some(kind) = problem_type(&answer).filter(|t| t.starts_with(PROBLEM_PREFIX)) else {
            continue;
        };
        checked += 1;
        if let Err(e) = problem_document(&answer) {
            return fail(format!("a {} answer of type {kind}: {e}", answer.status));
        }
        let title = serde_json::from_slice::<serde_json::Value>(&answer.body)
            .ok()
            .and_then(|j| j.get("title").and_then(|t| t.as_str()).map(str::to_owned))
            .unwrap_or_default();
        match titles.get(&kind) {
            Some(seen) if *seen != title => {
                return fail(format!(
                    "type {kind} came with the titles {seen:?} and {title:?}: a title is fixed \
                     per type"
                ));
            }
            _ => {
                titles.insert(kind, title);
            }
        }
    }
    if checked == 0 {
        return skip("no answer of the run was a convention problem (urn:retrysafe:problem:…)");
    }
    let slugs: Vec<&str> = titles
        .keys()
        .map(|k| k.trim_start_matches(PROBLEM_PREFIX))
        .collect();
    pass(format!(
        "{checked} problem answers ({}): application/problem+json, type, title, status, \
         detail in that order, status as the answer's",
        slugs.join(", ")
    ))
}

/// `retry-after.syntax`: every `retry-after` of the run.
pub(super) fn retry_after(ctx: &Ctx<'_>) -> Finding {
    let mut checked = 0;
    for answer in ctx.seen() {
        for value in answer.all("retry-after") {
            checked += 1;
            if let Err(e) = retry_after_syntax(value) {
                return fail(format!("on a {} answer: {e}", answer.status));
            }
        }
    }
    if checked == 0 {
        return skip(
            "no answer of the run carried retry-after (it comes with 409 request-in-flight and \
             503 answers; a handler slow enough for copies to overlap shows it)",
        );
    }
    pass(format!(
        "{checked} retry-after values, each delay-seconds or an HTTP-date"
    ))
}
