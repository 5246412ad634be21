//! The key's grammar and limits.

use super::{Ctx, Finding, first_success, same_answer};
use crate::check::{describe_exchange, expect_problem, show};
use crate::http::Request;

/// The longest key, in characters of content.
const MAX_KEY: usize = 255;

/// An sf-string of `content`, with `"` and `\` escaped.
fn sf_string(content: &str) -> String {
    let mut out = String::from("\"");
    for c in content.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// `key` padded with `fill` to `len` characters.
fn padded(key: &str, fill: char, len: usize) -> String {
    let mut out = key.to_owned();
    while out.chars().count() < len {
        out.push(fill);
    }
    out
}

/// Sends `first`, then `copy` (another form of the same key): the copy must get the
/// first answer again. The detail on success.
async fn same_key(ctx: &Ctx<'_>, first: &[u8], copy: &[u8]) -> Result<String, String> {
    let request = ctx.keyed(first);
    let answer = ctx.send(&request).await;
    let shown = show(first);
    let answer = first_success(&answer, &format!("idempotency-key: {shown}"))?;
    let again = ctx.settled(&ctx.keyed(copy)).await;
    same_answer(
        answer,
        &again,
        &format!(
            "idempotency-key: {shown}, then idempotency-key: {}",
            show(copy)
        ),
    )?;
    Ok(format!("{shown} then {}", show(copy)))
}

/// `key.forms`: `k` then `"k"`, and `"k2"` then `k2`.
pub(super) async fn forms(ctx: &Ctx<'_>) -> Finding {
    let before = ctx.effects().await;
    let judged = async {
        let bare = ctx.key();
        let a = same_key(ctx, bare.as_bytes(), sf_string(&bare).as_bytes()).await?;
        let other = ctx.key();
        let b = same_key(ctx, sf_string(&other).as_bytes(), other.as_bytes()).await?;
        Ok(format!("{a} and {b}: one record each, the copy replayed"))
    }
    .await;
    ctx.effects_since(before, 2, judged).await
}

/// `key.escapes`: an sf-string whose content holds `"` and `\`.
pub(super) async fn escapes(ctx: &Ctx<'_>) -> Finding {
    let before = ctx.effects().await;
    let value = sf_string(&format!("{} say \"hi\" \\ bye", ctx.key()));
    let judged = same_key(ctx, value.as_bytes(), value.as_bytes())
        .await
        .map(|d| format!("{d}: accepted and replayed"));
    ctx.effects_since(before, 1, judged).await
}

/// `key.quote-prefix`: `"k` is not an sf-string, so it is a bare key.
pub(super) async fn quote_prefix(ctx: &Ctx<'_>) -> Finding {
    let before = ctx.effects().await;
    let value = format!("\"{}", ctx.key());
    let judged = same_key(ctx, value.as_bytes(), value.as_bytes())
        .await
        .map(|d| format!("{d}: accepted as a bare key and replayed"));
    ctx.effects_since(before, 1, judged).await
}

/// `key.max-length`: a bare key of 255 characters, and an sf-string of 255 characters
/// of content (some escaped, so longer on the wire).
pub(super) async fn max_length(ctx: &Ctx<'_>) -> Finding {
    let before = ctx.effects().await;
    let judged = async {
        let bare = padded(&ctx.key(), 'x', MAX_KEY);
        same_key(ctx, bare.as_bytes(), bare.as_bytes()).await?;
        let content = padded(&format!("{} \"quoted\"", ctx.key()), 'y', MAX_KEY);
        let sf = sf_string(&content);
        same_key(ctx, sf.as_bytes(), sf.as_bytes()).await?;
        Ok(format!(
            "a bare key of {MAX_KEY} characters, and an sf-string of {MAX_KEY} characters of \
             content ({} on the wire): accepted and replayed",
            sf.len()
        ))
    }
    .await;
    ctx.effects_since(before, 2, judged).await
}

/// Sends each value as the key: each must be refused with 400 `key-invalid` (or just
/// 400, when `any_400`), and nothing may happen.
async fn refused(ctx: &Ctx<'_>, requests: Vec<(String, Request)>, any_400: bool) -> Finding {
    let before = ctx.effects().await;
    let mut shown = Vec::new();
    for (what, request) in &requests {
        let answer = ctx.send(request).await;
        let judged = match (&answer, any_400) {
            (Ok(a), true) if a.status == 400 => Ok(()),
            (Ok(a), false) => expect_problem(a, 400, "key-invalid", false, false),
            _ => Err(format!(
                "expected {}, got {}",
                if any_400 {
                    "400"
                } else {
                    "400 problem key-invalid"
                },
                describe_exchange(&answer)
            )),
        };
        if let Err(e) = judged {
            let detail = format!("sent {} with {what}; {e}", request.line());
            return ctx.effects_since(before, 0, Err(detail)).await;
        }
        shown.push(what.clone());
    }
    let answer = if any_400 { "400" } else { "400 key-invalid" };
    let detail = format!("{}: {answer} each", shown.join(", "));
    ctx.effects_since(before, 0, Ok(detail)).await
}

/// One request with one key value, described for messages.
fn with_key(ctx: &Ctx<'_>, value: &[u8]) -> (String, Request) {
    (
        format!("idempotency-key: {}", show(value)),
        ctx.keyed(value),
    )
}

/// `key.too-long`.
pub(super) async fn too_long(ctx: &Ctx<'_>) -> Finding {
    let bare = padded(&ctx.key(), 'x', MAX_KEY + 1);
    let sf = sf_string(&padded(&ctx.key(), 'y', MAX_KEY + 1));
    let requests = vec![
        (
            format!("a bare key of {} characters", MAX_KEY + 1),
            ctx.keyed(bare.as_str()),
        ),
        (
            format!("an sf-string of {} characters", MAX_KEY + 1),
            ctx.keyed(sf.as_str()),
        ),
    ];
    refused(ctx, requests, false).await
}

/// `key.empty`.
pub(super) async fn empty(ctx: &Ctx<'_>) -> Finding {
    let requests = vec![with_key(ctx, b""), with_key(ctx, b"\"\"")];
    refused(ctx, requests, false).await
}

/// `key.invalid-characters`: a space in a bare key, a bad escape, HTAB, non-ASCII.
pub(super) async fn invalid_characters(ctx: &Ctx<'_>) -> Finding {
    let key = ctx.key();
    let values: [Vec<u8>; 5] = [
        format!("{key} b").into_bytes(),
        format!("\"{key} \\q\"").into_bytes(),
        format!("{key}\tb").into_bytes(),
        format!("{key}\u{e9}").into_bytes(),
        format!("\"{key} \u{e9}\"").into_bytes(),
    ];
    let requests = values.iter().map(|v| with_key(ctx, v)).collect();
    refused(ctx, requests, false).await
}

/// `key.control-characters`: an HTTP parser may answer these itself, with a bare 400.
pub(super) async fn control_characters(ctx: &Ctx<'_>) -> Finding {
    let key = ctx.key();
    let requests = [0x01u8, 0x1b, 0x7f]
        .into_iter()
        .map(|c| {
            let mut value = key.clone().into_bytes();
            value.push(c);
            value.push(b'x');
            with_key(ctx, &value)
        })
        .collect();
    refused(ctx, requests, true).await
}

/// `key.twice`: the same value twice, and two values.
pub(super) async fn twice(ctx: &Ctx<'_>) -> Finding {
    let (one, two) = (ctx.key(), ctx.key());
    let requests = vec![
        (
            format!("idempotency-key: {one} twice"),
            ctx.keyed(one.as_str())
                .header("idempotency-key", one.as_str()),
        ),
        (
            format!("idempotency-key: {one} and idempotency-key: {two}"),
            ctx.keyed(one.as_str())
                .header("idempotency-key", two.as_str()),
        ),
    ];
    refused(ctx, requests, false).await
}

/// `key.missing`: 400 `key-missing`, or a request that is not guarded (it runs).
pub(super) async fn missing(ctx: &Ctx<'_>) -> Finding {
    let before = ctx.effects().await;
    let request = ctx.base();
    let answer = ctx.send(&request).await;
    let sent = format!("sent {} without idempotency-key", request.line());
    match &answer {
        Ok(a) if a.is_success() => {
            let detail = format!("{sent}: {}, the route does not require a key", a.status);
            ctx.effects_since(before, 1, Ok(detail)).await
        }
        Ok(a) => {
            let judged = expect_problem(a, 400, "key-missing", false, false)
                .map(|()| format!("{sent}: 400 key-missing"))
                .map_err(|e| {
                    format!("{sent}; {e} (or a 2xx, if the route does not require a key)")
                });
            ctx.effects_since(before, 0, judged).await
        }
        Err(failure) => {
            let detail = format!("{sent}; no answer ({failure})");
            ctx.effects_since(before, 0, Err(detail)).await
        }
    }
}
