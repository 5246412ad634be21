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
    let headers: [&[(&str, &str)]; 5] = [
        &[("retry-attempt", "2")],
        &[("request-timeout-ms", "30000")],
        &[("grpc-timeout", "30S")],
        &[("retry-point", "caller")],
        &[
            ("retry-attempt", "3"),
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
            return ctx.effects_since(before, 1, Err(format!("key {key}: {e}"))).await;
        }
    }
    let detail = if refused == 0 {
        "copies with retry-attempt, request-timeout-ms, grpc-timeout, retry-point and all four \
         got the first answer again"
            .to_owned()
    } else {
        format!(
            "copies with request-timeout-ms, grpc-timeout and retry-point got the first answer \
             again; {refused} with retry-attempt were refused by a retry budget (503 \
             retry-budget-exhausted)"
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
    let detail = "retry-attempt: 0, -1, abc, 1.5, 4294967296 and empty were ignored; 2 was accepted";
    ctx.effects_since(before, ran, Ok(detail.to_owned())).await
}

/// `request-timeout-ms.malformed`: 400 `timeout-invalid`, before anything is recorded:
/// the same key without the header then runs.
pub(super) async fn timeout_malformed(ctx: &Ctx<'_>) -> Finding {
    let before = ctx.effects().await;
    let values = ["abc", "-5", "+5", "1.5", "0x10", "1 2", ""];
    for (i, value) in values.iter().enumerate() {
        let key = ctx.key();
        let plain = ctx.keyed(key.as_str());
        let request = plain.clone().header("request-timeout-ms", *value);
        let sent = format!(
            "sent {} with key {key} and request-timeout-ms: {}",
            request.line(),
            show(value.as_bytes())
        );
        let answer = ctx.send(&request).await;
        let refused = match &answer {
            Ok(a) => expect_problem(a, 400, "timeout-invalid", false, false),
            Err(failure) => Err(format!("no answer ({failure})")),
        };
        if let Err(e) = refused {
            return ctx.effects_since(before, i as u64, Err(format!("{sent}; {e}"))).await;
        }
        let after = ctx.send(&plain).await;
        if let Err(e) = first_success(&after, "the same key then, without the header") {
            let detail = format!("{sent}: 400 timeout-invalid; {e} (the refusal was recorded?)");
            return ctx.effects_since(before, i as u64, Err(detail)).await;
        }
    }
    let detail = "abc, -5, +5, 1.5, 0x10, \"1 2\" and empty: 400 timeout-invalid each; the \
                  same keys then ran";
    ctx.effects_since(before, values.len() as u64, Ok(detail.to_owned()))
        .await
}

/// `request-timeout-ms.zero`: 504 `deadline-exceeded` with `do-not-retry`, before
/// the handler starts.
pub(super) async fn timeout_zero(ctx: &Ctx<'_>) -> Finding {
    let before = ctx.effects().await;
    let key = ctx.key();
    let plain = ctx.keyed(key.as_str());
    let request = plain.clone().header("request-timeout-ms", "0");
    let sent = format!(
        "sent {} with key {key} and request-timeout-ms: 0",
        request.line()
    );
    let answer = ctx.send(&request).await;
    let refused = match &answer {
        Ok(a) => expect_problem(a, 504, "deadline-exceeded", true, false),
        Err(failure) => Err(format!("no answer ({failure})")),
    };
    if let Err(e) = refused {
        return ctx.effects_since(before, 0, Err(format!("{sent}; {e}"))).await;
    }
    let after = ctx.send(&plain).await;
    let judged = first_success(&after, "the same key then, without the header")
        .map(|_| format!("{sent}: 504 deadline-exceeded; the same key then ran"))
        .map_err(|e| format!("{sent}: 504 deadline-exceeded; {e} (the refusal was recorded?)"));
    ctx.effects_since(before, 1, judged).await
}

/// `request-timeout-ms.valid`: values with leading zeros or too many digits are valid
/// (clamped, not refused).
pub(super) async fn timeout_valid(ctx: &Ctx<'_>) -> Finding {
    let before = ctx.effects().await;
    let values = ["30000", "0030000", "9999999999999999999999999999999999999999"];
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
