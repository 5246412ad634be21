//! Replays of completed requests, and the same key with another request.

use super::{Ctx, Finding, fail, first_success, pass, same_answer, skip};
use crate::check::{describe, expect_problem, flag, show};
use crate::http::{Answer, Request};

/// Headers a replay carries as the first answer did, when the first had them: the
/// ones that describe the representation or the created resource.
const STABLE: [&str; 5] = [
    "content-type",
    "content-encoding",
    "content-language",
    "location",
    "etag",
];

/// `replay.same-answer`, `replay.marked` and `replay.headers`: one request sent three
/// times, one after another.
pub(super) async fn replay(ctx: &Ctx<'_>) -> [Finding; 3] {
    let key = ctx.key();
    let request = ctx.keyed(key.as_str());
    let before = ctx.effects().await;
    let first = ctx.send(&request).await;
    let mut copies = Vec::new();
    for _ in 0..2 {
        copies.push(ctx.settled(&request).await);
    }
    let sent = format!(
        "sent {} with idempotency-key: {key} three times, one after another",
        request.line()
    );
    let judged: Result<String, String> = (|| {
        let first = first_success(&first, "the first copy")?;
        for (i, copy) in copies.iter().enumerate() {
            same_answer(first, copy, &format!("copy {}", i + 2))?;
        }
        Ok(format!("{sent}: {} each time", first.status))
    })();
    let replays_ok = judged.is_ok();
    let same = match judged {
        Ok(detail) => ctx.effects_since(before, 1, Ok(detail)).await,
        Err(e) => {
            ctx.effects_since(before, 1, Err(format!("{sent}; {e}")))
                .await
        }
    };
    let (Ok(first), true) = (&first, replays_ok) else {
        let why = "no replay to look at (see replay.same-answer)";
        return [same, skip(why), skip(why)];
    };
    let copies: Vec<&Answer> = copies.iter().flatten().collect();
    [same, marked(first, &copies), headers(first, &copies)]
}

fn marked(first: &Answer, copies: &[&Answer]) -> Finding {
    if flag(first, "idempotent-replayed") {
        return fail(format!(
            "the first answer of a key carries idempotent-replayed: {}; only replays may",
            show(first.header("idempotent-replayed").unwrap_or_default())
        ));
    }
    for (i, copy) in copies.iter().enumerate() {
        if !flag(copy, "idempotent-replayed") {
            return fail(format!(
                "copy {} was the first answer again but is not marked: expected \
                 idempotent-replayed: true, got {}",
                i + 2,
                copy.header("idempotent-replayed")
                    .map_or_else(|| "no such header".to_owned(), show)
            ));
        }
    }
    pass("the first answer unmarked, both copies idempotent-replayed: true")
}

fn headers(first: &Answer, copies: &[&Answer]) -> Finding {
    for (i, copy) in copies.iter().enumerate() {
        for name in STABLE {
            let before: Vec<&[u8]> = first.all(name).collect();
            let after: Vec<&[u8]> = copy.all(name).collect();
            if !before.is_empty() && before != after {
                return fail(format!(
                    "the first answer had {name}: {}, copy {} has {}",
                    show(&before.concat()),
                    i + 2,
                    if after.is_empty() {
                        "none".to_owned()
                    } else {
                        show(&after.concat())
                    }
                ));
            }
        }
        if let Some(cookie) = first
            .all("set-cookie")
            .find(|c| copy.all("set-cookie").any(|d| d == *c))
        {
            return fail(format!(
                "copy {} replays the first answer's set-cookie: {}: a cookie is never replayed",
                i + 2,
                show(cookie)
            ));
        }
    }
    let kept: Vec<&str> = STABLE
        .into_iter()
        .filter(|n| first.header(n).is_some())
        .collect();
    pass(if kept.is_empty() {
        "the first answer had none of content-type, content-encoding, content-language, \
         location, etag; no set-cookie replayed"
            .to_owned()
    } else {
        format!(
            "{} kept on both replays; no set-cookie replayed",
            kept.join(", ")
        )
    })
}

/// `mismatch.body`.
pub(super) async fn mismatch_body(ctx: &Ctx<'_>) -> Finding {
    mismatch(ctx, "another body", |ctx, r| ctx.other_body(r)).await
}

/// `mismatch.query`.
pub(super) async fn mismatch_query(ctx: &Ctx<'_>) -> Finding {
    mismatch(ctx, "another query", |ctx, r| ctx.other_query(r)).await
}

/// A key used, then the key with another request (422 `key-mismatch`,
/// `do-not-retry`), then the first request again (still its replay).
async fn mismatch(
    ctx: &Ctx<'_>,
    what: &str,
    other: impl Fn(&Ctx<'_>, Request) -> Request,
) -> Finding {
    let key = ctx.key();
    let request = ctx.keyed(key.as_str());
    let changed = other(ctx, request.clone());
    let before = ctx.effects().await;
    let first = ctx.send(&request).await;
    let first = match first_success(&first, &format!("the first request with key {key}")) {
        Ok(first) => first.clone(),
        Err(e) => return ctx.effects_since(before, 1, Err(e)).await,
    };
    let reused = ctx.settled(&changed).await;
    let judged = match &reused {
        Ok(answer) => expect_problem(answer, 422, "key-mismatch", true, false).map_err(|e| {
            format!(
                "sent {} with the used key {key} and {what}; {e}",
                changed.line()
            )
        }),
        Err(failure) => Err(format!(
            "sent {} with the used key {key} and {what}; no answer ({failure})",
            changed.line()
        )),
    };
    if let Err(e) = judged {
        return ctx.effects_since(before, 1, Err(e)).await;
    }
    let again = ctx.settled(&request).await;
    let judged =
        same_answer(&first, &again, "the first request again after the mismatch").map(|()| {
            format!(
                "the key {key} with {what}: {}; the first request still replays",
                describe(reused.as_ref().unwrap_or(&first))
            )
        });
    ctx.effects_since(before, 1, judged).await
}
