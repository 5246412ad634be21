//! Copies at once, and copies whose reply was lost.

use super::{COPIES, Ctx, Finding, first_success, same_answer, skip};
use crate::check::{describe, describe_exchange, expect_problem, flag};
use crate::http::{Answer, Exchange};

/// `mismatch.concurrent`: the request and another with the same key, at once. One
/// runs; the other gets 422 `key-mismatch` — or, while the first is in flight, 409
/// `request-in-flight` and then, sent again after its `retry-after`, 422.
pub(super) async fn mismatch_concurrent(ctx: &Ctx<'_>) -> Finding {
    let key = ctx.key();
    let request = ctx.keyed(key.as_str());
    let changed = ctx.other_body(request.clone());
    let before = ctx.effects().await;
    let answers = ctx.together(&[request.clone(), changed.clone()]).await;
    let sent = format!(
        "sent {} with key {key} and two different bodies at once",
        request.line()
    );
    let ran: Vec<usize> = (0..answers.len())
        .filter(|i| matches!(answers.get(*i), Some(Ok(a)) if a.is_success()))
        .collect();
    let [winner] = ran.as_slice() else {
        let seen: Vec<String> = answers.iter().map(describe_exchange).collect();
        let detail = format!("{sent}; expected one 2xx, got {}", seen.join(" and "));
        return ctx.effects_since(before, 1, Err(detail)).await;
    };
    let (loser, loser_request) = if *winner == 0 {
        (answers.get(1), &changed)
    } else {
        (answers.first(), &request)
    };
    let judged = match loser {
        Some(Ok(a)) if a.status == 409 => {
            match expect_problem(a, 409, "request-in-flight", false, true) {
                Ok(()) => {
                    let again = ctx.settled(loser_request).await;
                    match &again {
                        Ok(b) => expect_problem(b, 422, "key-mismatch", true, false)
                            .map(|()| {
                                "the other got 409 request-in-flight, then 422 key-mismatch"
                                    .to_owned()
                            })
                            .map_err(|e| {
                                format!(
                                    "the other got 409, and sent again after its retry-after, {e}"
                                )
                            }),
                        Err(failure) => Err(format!(
                            "the other, sent again after its 409: no answer ({failure})"
                        )),
                    }
                }
                Err(e) => Err(format!("the other: {e}")),
            }
        }
        Some(Ok(a)) => expect_problem(a, 422, "key-mismatch", true, false)
            .map(|()| "the other got 422 key-mismatch".to_owned())
            .map_err(|e| format!("the other: {e}")),
        Some(Err(failure)) => Err(format!("the other: no answer ({failure})")),
        None => Err("the other: no answer".to_owned()),
    };
    let judged = judged
        .map(|d| format!("{sent}: one ran, {d}"))
        .map_err(|e| format!("{sent}; one ran, {e}"));
    ctx.effects_since(before, 1, judged).await
}

/// `concurrent.copies`: `COPIES` copies at once. Every answer is the one answer of the
/// request (its first run, or a replay of it) or 409 `request-in-flight` with a
/// `retry-after`; a later copy gets the replay; one effect.
pub(super) async fn concurrent(ctx: &Ctx<'_>) -> Finding {
    let key = ctx.key();
    let request = ctx.keyed(key.as_str());
    let before = ctx.effects().await;
    let copies = vec![request.clone(); COPIES];
    let answers = ctx.together(&copies).await;
    let sent = format!(
        "sent {COPIES} copies of {} with key {key} at once",
        request.line()
    );
    let judged = judge_copies(&answers).map_err(|e| format!("{sent}; {e}"));
    let (first, tally) = match judged {
        Ok(found) => found,
        Err(e) => return ctx.effects_since(before, 1, Err(e)).await,
    };
    let later = ctx.settled(&request).await;
    let judged = same_answer(&first, &later, "a copy sent after them all")
        .map(|()| format!("{sent}: {tally}; a later copy got the same answer"))
        .map_err(|e| format!("{sent}: {tally}; {e}"));
    ctx.effects_since(before, 1, judged).await
}

/// The one 2xx answer among copies sent at once, and a tally of what came back.
fn judge_copies(answers: &[Exchange]) -> Result<(Answer, String), String> {
    let mut first: Option<&Answer> = None;
    let (mut ran, mut replayed, mut in_flight) = (0, 0, 0);
    for (i, exchange) in answers.iter().enumerate() {
        let copy = i + 1;
        let answer = match exchange {
            Ok(a) => a,
            Err(failure) => return Err(format!("copy {copy}: no answer ({failure})")),
        };
        if answer.is_success() {
            if let Some(first) = first {
                same_answer(first, exchange, &format!("copy {copy}"))?;
            }
            first = first.or(Some(answer));
            if flag(answer, "idempotent-replayed") {
                replayed += 1;
            } else {
                ran += 1;
            }
            continue;
        }
        expect_problem(answer, 409, "request-in-flight", false, true).map_err(|e| {
            format!(
                "copy {copy}: {e} (a copy must get the request's answer, or 409 while it is in flight)"
            )
        })?;
        in_flight += 1;
    }
    let Some(first) = first else {
        return Err(format!(
            "none of the copies got a 2xx answer: {}",
            answers.first().map(describe_exchange).unwrap_or_default()
        ));
    };
    Ok((
        first.clone(),
        format!("{ran} unmarked 2xx, {replayed} replayed, {in_flight} x 409 request-in-flight"),
    ))
}

/// `lost-reply.after-answer`: a copy whose answer arrived but was never read (the
/// connection closed), then retries with the same key: each gets the one answer.
pub(super) async fn lost_after_answer(ctx: &Ctx<'_>) -> Finding {
    let key = ctx.key();
    let request = ctx.keyed(key.as_str());
    let before = ctx.effects().await;
    let sent = format!(
        "sent {} with key {key}, closed the connection once the answer arrived, unread",
        request.line()
    );
    if let Err(e) = ctx.drop_answer(&request).await {
        return ctx
            .effects_since(before, 1, Err(format!("{sent}; {e}")))
            .await;
    }
    let retry = ctx.settled(&request).await;
    let judged = match first_success(&retry, "the retry") {
        Ok(first) => {
            let again = ctx.settled(&request).await;
            same_answer(first, &again, "a second retry")
                .map(|()| format!("{sent}: the retries got {} twice", describe(first)))
        }
        Err(e) => Err(e),
    }
    .map_err(|e| format!("{sent}; {e}"));
    ctx.effects_settled(before, 1, judged).await
}

/// `lost-reply.mid-request`: a copy whose connection closed while the server worked
/// on it (25 ms after it was sent, or when its answer began, if sooner), then a retry
/// with the same key until it gets an answer: one effect, whether the first copy ran
/// to its end or not.
pub(super) async fn lost_mid_request(ctx: &Ctx<'_>) -> Finding {
    if !ctx.counting() {
        return skip(format!(
            "needs --ledger-url: only the effects tell whether the lost copy ran too \
             (effects not counted: {})",
            ctx.why_not_counted()
        ));
    }
    let key = ctx.key();
    let request = ctx.keyed(key.as_str());
    let before = ctx.effects().await;
    let sent = format!(
        "sent {} with key {key} and closed the connection before reading any answer",
        request.line()
    );
    if let Err(e) = ctx.close_early(&request).await {
        return ctx
            .effects_since(before, 1, Err(format!("{sent}; {e}")))
            .await;
    }
    let retry = ctx.settled(&request).await;
    let judged = first_success(&retry, "the retry")
        .map(|a| format!("{sent}: the retry got {}", describe(a)))
        .map_err(|e| format!("{sent}; {e}"));
    ctx.effects_settled(before, 1, judged).await
}
