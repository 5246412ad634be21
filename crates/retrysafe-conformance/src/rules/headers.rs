//! The convention's per-attempt request headers: `retry-attempt`,
//! `request-timeout-ms`, `grpc-timeout` and `retry-point`.

use super::{Ctx, Finding, first_success, same_answer};
use crate::check::{describe_exchange, expect_problem, show};
use crate::http::Exchange;

/// Whether `exchange` is a server-side retry budget's refusal: 503
/// `retry-budget-exhausted` with `do-not-retry`, which a request carrying
/// `retry-attempt` of 2 or more may get.
fn budget_refusal(exchange: &Exchange) -> bool {
    matches!(exchange, Ok(a) if expect_problem(a, 503, "retry-budget-exhausted", true, false).is_ok())
}

/// `same-request.per-attempt-headers`: copies that differ from the first only by a
/// per-attempt header get its answer again.
pub(super) async fn per_attempt(ctx: &Ctx<'_>) -> Finding {
    let key = ctx.key();
    let request = ctx.keyed(key.as_str());
    let before = ctx.effects().await;
    let first = ctx.send(&request).await;
    let first = match first_success(&first, &format!("the first request with key {key}")) {
        Ok(first) => first.clone(),
        Err(e) => return ctx.effects_since(before, 1, Err(e)).await,
    };
    let headers: [&[(&str, &str)]; 6] = [
        &[("retry-attempt", "2")],
        &[("grpc-previous-rpc-attempts", "1")],
        &[("request-timeout-ms", "30000")],
        &[("grpc-timeout", "30S")],
        &[("retry-point", "caller")],
        &[
            ("retry-attempt", "3"),
            ("grpc-previous-rpc-attempts", "2"),
            ("request-timeout-ms", "29000"),
            ("grpc-timeout", "29S"),
            ("retry-point", "caller"),
        ],
    ];
    let mut refused = 0;
    for set in headers {
        let copy = set
            .iter()
            .fold(request.clone(), |r, (name, value)| r.header(name, *value));
        let shown: Vec<String> = set.iter().map(|(n, v)| format!("{n}: {v}")).collect();
        let shown = shown.join(", ");
        let answer = ctx.settled(&copy).await;
        if set.iter().any(|(n, _)| *n == "retry-attempt") && budget_refusal(&answer) {
            refused += 1;
            continue;
        }
        if let Err(e) = same_answer(&first, &answer, &format!("a copy with {shown}")) {
            return ctx
                .effects_since(before, 1, Err(format!("key {key}: {e}")))
                .await;
        }
    }
    let detail = if refused == 0 {
        "copies with retry-attempt, grpc-previous-rpc-attempts, request-timeout-ms, \
         grpc-timeout, retry-point and all five got the first answer again"
            .to_owned()
    } else {
        format!(
            "copies with grpc-previous-rpc-attempts, request-timeout-ms, grpc-timeout and \
             retry-point got the first answer again; {refused} with retry-attempt were refused \
             by a retry budget (503 retry-budget-exhausted)"
        )
    };
    ctx.effects_since(before, 1, Ok(detail)).await
}

/// `retry-attempt.parsing`: a malformed value is ignored (the request runs as a first
/// attempt); a valid one is a retry, which a server-side budget may refuse.
pub(super) async fn retry_attempt(ctx: &Ctx<'_>) -> Finding {
    let before = ctx.effects().await;
    let mut ran = 0;
    for value in ["0", "-1", "abc", "1.5", "4294967296", "", "2"] {
        let key = ctx.key();
        let request = ctx.keyed(key.as_str()).header("retry-attempt", value);
        let answer = ctx.send(&request).await;
        if matches!(&answer, Ok(a) if a.is_success()) {
            ran += 1;
            continue;
        }
        if value == "2" && budget_refusal(&answer) {
            continue;
        }
        let expected = if value == "2" {
            "a 2xx answer (or 503 retry-budget-exhausted from a server-side retry budget)"
        } else {
            "a 2xx answer: a malformed retry-attempt is ignored, as if absent"
        };
        let detail = format!(
            "sent {} with key {key} and retry-attempt: {}; expected {expected}, got {}",
            request.line(),
            show(value.as_bytes()),
            describe_exchange(&answer)
        );
        return ctx.effects_since(before, ran, Err(detail)).await;
    }
    let detail =
        "retry-attempt: 0, -1, abc, 1.5, 4294967296 and empty were ignored; 2 was accepted";
    ctx.effects_since(before, ran, Ok(detail.to_owned())).await
}

/// `request-timeout-ms.malformed`: 400 `timeout-invalid`, before anything is recorded:
/// the refused requests make no effect, and their keys then run.
pub(super) async fn timeout_malformed(ctx: &Ctx<'_>) -> Finding {
    let values = ["abc", "-5", "+5", "1.5", "0x10", "1 2", ""];
    let refused = values
        .iter()
        .map(|v| {
            (
                format!("request-timeout-ms: {}", show(v.as_bytes())),
                ("request-timeout-ms", *v),
            )
        })
        .collect();
    let detail = "abc, -5, +5, 1.5, 0x10, \"1 2\" and empty: 400 timeout-invalid each, no effect; \
                  the same keys then ran";
    refused_then_run(ctx, refused, 400, "timeout-invalid", false, detail).await
}

/// `request-timeout-ms.zero`: 504 `deadline-exceeded` with `do-not-retry`, before the
/// handler starts: no effect, and the key then runs.
pub(super) async fn timeout_zero(ctx: &Ctx<'_>) -> Finding {
    let refused = vec![(
        "request-timeout-ms: 0".to_owned(),
        ("request-timeout-ms", "0"),
    )];
    let detail = "request-timeout-ms: 0: 504 deadline-exceeded with do-not-retry, no effect; the \
                  same key then ran";
    refused_then_run(ctx, refused, 504, "deadline-exceeded", true, detail).await
}

/// Sends a request with a fresh key and each header, expecting the problem `slug`
/// for each; checks that they made no effect, then that each key runs without the
/// header (a refusal records nothing).
async fn refused_then_run(
    ctx: &Ctx<'_>,
    refused: Vec<(String, (&'static str, &'static str))>,
    status: u16,
    slug: &str,
    do_not_retry: bool,
    detail: &str,
) -> Finding {
    let before = ctx.effects().await;
    let mut plain = Vec::new();
    for (shown, (name, value)) in &refused {
        let key = ctx.key();
        let request = ctx.keyed(key.as_str());
        let with = request.clone().header(name, *value);
        let answer = ctx.send(&with).await;
        let judged = match &answer {
            Ok(a) => expect_problem(a, status, slug, do_not_retry, false),
            Err(failure) => Err(format!("no answer ({failure})")),
        };
        if let Err(e) = judged {
            let detail = format!("sent {} with key {key} and {shown}; {e}", with.line());
            return ctx.effects_settled(before, 0, Err(detail)).await;
        }
        plain.push((key, request));
    }
    if let Err(e) = ctx.nothing_since(&before).await {
        return ctx
            .effects_since(before, 0, Err(format!("{status} {slug} each; {e}")))
            .await;
    }
    for (key, request) in &plain {
        let again = ctx.send(request).await;
        if let Err(e) = first_success(&again, &format!("key {key} then, without the header")) {
            let detail = format!("{status} {slug}; {e} (the refused request was recorded?)");
            return ctx.effects_since(before, 0, Err(detail)).await;
        }
    }
    ctx.effects_since(before, plain.len() as u64, Ok(detail.to_owned()))
        .await
}

/// `request-timeout-ms.valid`: values with leading zeros or too many digits are valid
/// (clamped, not refused).
pub(super) async fn timeout_valid(ctx: &Ctx<'_>) -> Finding {
    let before = ctx.effects().await;
    let values = [
        "30000",
        "0030000",
        "9999999999999999999999999999999999999999",
    ];
    for (i, value) in values.iter().enumerate() {
        let key = ctx.key();
        let request = ctx.keyed(key.as_str()).header("request-timeout-ms", *value);
        let answer = ctx.send(&request).await;
        if let Err(e) = first_success(&answer, &format!("request-timeout-ms: {value}")) {
            let detail = format!("sent {} with key {key}; {e}", request.line());
            return ctx.effects_since(before, i as u64, Err(detail)).await;
        }
    }
    let detail = "30000, 0030000 and a 40-digit value (30 days, clamped) were accepted";
    ctx.effects_since(before, values.len() as u64, Ok(detail.to_owned()))
        .await
}
