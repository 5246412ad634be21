//! Reading answers the way `docs/wire-convention.md` says a receiver reads them, and
//! describing them in failure messages.

use std::time::Duration;

use crate::http::{Answer, Exchange};

/// The prefix of the convention's problem types.
pub(crate) const PROBLEM_PREFIX: &str = "urn:retrysafe:problem:";

/// The longest `retry-after` the convention lets a server send, in seconds.
const MAX_RETRY_AFTER: u64 = 86_400;

/// A boolean flag header (`do-not-retry`, `idempotent-replayed`): absent is false; a
/// present value is true unless, trimmed of SP and HTAB, it is `0`, `?0` or `false`
/// in any case.
pub(crate) fn flag(answer: &Answer, name: &str) -> bool {
    answer.header(name).is_some_and(|value| {
        let value = trim_ows(value);
        !(value == b"0" || value == b"?0" || value.eq_ignore_ascii_case(b"false"))
    })
}

fn trim_ows(value: &[u8]) -> &[u8] {
    let start = value
        .iter()
        .position(|b| *b != b' ' && *b != b'\t')
        .unwrap_or(value.len());
    let end = value
        .iter()
        .rposition(|b| *b != b' ' && *b != b'\t')
        .map_or(start, |i| i + 1);
    value.get(start..end).unwrap_or_default()
}

/// The `type` member of a JSON body, whatever its content type.
pub(crate) fn problem_type(answer: &Answer) -> Option<String> {
    let json: serde_json::Value = serde_json::from_slice(&answer.body).ok()?;
    json.get("type")?.as_str().map(str::to_owned)
}

/// The slug of a convention problem type.
pub(crate) fn slug(answer: &Answer) -> Option<String> {
    problem_type(answer)?
        .strip_prefix(PROBLEM_PREFIX)
        .map(str::to_owned)
}

/// Whether `answer` is the convention's problem `slug` with `status`, carrying
/// `do-not-retry` (true by the reading rule) when `do_not_retry`, and a `retry-after`
/// when `retry_after` (then without `do-not-retry`: it asks for a retry). The error
/// says what differs.
pub(crate) fn expect_problem(
    answer: &Answer,
    status: u16,
    slug_expected: &str,
    do_not_retry: bool,
    retry_after: bool,
) -> Result<(), String> {
    let wanted = format!("{status} problem {slug_expected}");
    if answer.status != status || slug(answer).as_deref() != Some(slug_expected) {
        return Err(format!("expected {wanted}, got {}", describe(answer)));
    }
    if do_not_retry && !flag(answer, "do-not-retry") {
        return Err(format!(
            "{wanted} must carry do-not-retry: 1; got {}",
            describe(answer)
        ));
    }
    if retry_after {
        if answer.header("retry-after").is_none() {
            return Err(format!(
                "{wanted} must carry retry-after; got {}",
                describe(answer)
            ));
        }
        if flag(answer, "do-not-retry") {
            return Err(format!(
                "{wanted} asks for a retry and must not carry do-not-retry; got {}",
                describe(answer)
            ));
        }
    }
    Ok(())
}

/// The delay a `retry-after` asks for, if it parses: delay-seconds (clamped to 24 h)
/// or an HTTP-date (zero when past).
pub(crate) fn retry_after_delay(answer: &Answer) -> Option<Duration> {
    let value = std::str::from_utf8(trim_ows(answer.header("retry-after")?)).ok()?;
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        let seconds = value
            .parse::<u64>()
            .unwrap_or(u64::MAX)
            .min(MAX_RETRY_AFTER);
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or_default()
            .min(Duration::from_secs(MAX_RETRY_AFTER)),
    )
}

/// Checks one `retry-after` value as a server sends it: delay-seconds of at most
/// 86 400, or an HTTP-date (IMF-fixdate, RFC 850 or asctime).
pub(crate) fn retry_after_syntax(value: &[u8]) -> Result<(), String> {
    let shown = show(value);
    let Ok(text) = std::str::from_utf8(trim_ows(value)) else {
        return Err(format!("retry-after: {shown} is not ASCII"));
    };
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return match text.parse::<u64>() {
            Ok(s) if s <= MAX_RETRY_AFTER => Ok(()),
            _ => Err(format!(
                "retry-after: {shown} is more than {MAX_RETRY_AFTER} seconds (24 hours)"
            )),
        };
    }
    if text.len() <= 64 && httpdate::parse_http_date(text).is_ok() {
        return Ok(());
    }
    Err(format!(
        "retry-after: {shown} is neither delay-seconds (digits) nor an HTTP-date"
    ))
}

/// Checks the format of a problem document: `content-type: application/problem+json`,
/// a JSON object whose members are `type`, `title`, `status` and `detail` in that
/// order (others may follow), `type` a convention type with a slug of lowercase
/// letters, digits and hyphens, `status` the answer's status.
pub(crate) fn problem_document(answer: &Answer) -> Result<(), String> {
    let content_type = answer.header("content-type").unwrap_or_default();
    let media = String::from_utf8_lossy(content_type)
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    if media != "application/problem+json" {
        return Err(format!(
            "content-type is {}, not application/problem+json",
            show(content_type)
        ));
    }
    let json: serde_json::Value = serde_json::from_slice(&answer.body)
        .map_err(|e| format!("the body is not JSON ({e}): {}", show(&answer.body)))?;
    let Some(object) = json.as_object() else {
        return Err(format!(
            "the body is not a JSON object: {}",
            show(&answer.body)
        ));
    };
    let order = member_order(&answer.body);
    let first: Vec<&str> = order.iter().take(4).map(String::as_str).collect();
    if first != ["type", "title", "status", "detail"] {
        return Err(format!(
            "the members are {order:?}; the first must be type, title, status, detail in that order"
        ));
    }
    let string = |name: &str| object.get(name).and_then(serde_json::Value::as_str);
    let (Some(kind), Some(_), Some(_)) = (string("type"), string("title"), string("detail")) else {
        return Err("type, title and detail must be strings".to_owned());
    };
    let slug_ok = kind.strip_prefix(PROBLEM_PREFIX).is_some_and(|s| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    });
    if !slug_ok {
        return Err(format!(
            "type {kind:?} is not {PROBLEM_PREFIX}<slug> with a slug of a-z, 0-9 and -"
        ));
    }
    match object.get("status").and_then(serde_json::Value::as_u64) {
        Some(s) if s == u64::from(answer.status) => Ok(()),
        other => Err(format!(
            "the status member is {other:?}, the answer's status {}",
            answer.status
        )),
    }
}

/// The member names of a JSON object, in the order they appear.
fn member_order(body: &[u8]) -> Vec<String> {
    struct Keys(Vec<String>);
    impl<'de> serde::de::Visitor<'de> for Keys {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            mut self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            while let Some(key) = map.next_key::<String>()? {
                map.next_value::<serde::de::IgnoredAny>()?;
                self.0.push(key);
            }
            Ok(self.0)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    serde::Deserializer::deserialize_map(&mut de, Keys(Vec::new())).unwrap_or_default()
}

/// Bytes shown in a message: quoted, escaped, cut to 120 characters.
pub(crate) fn show(bytes: &[u8]) -> String {
    const MAX: usize = 120;
    let mut out = String::from("\"");
    for (i, b) in bytes.iter().enumerate() {
        if i == MAX {
            out.push_str(&format!("…(+{} bytes)", bytes.len() - MAX));
            break;
        }
        match b {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            0x20..=0x7e => out.push(char::from(*b)),
            _ => out.push_str(&format!("\\x{b:02x}")),
        }
    }
    out.push('"');
    out
}

/// An answer in a message: status, problem slug or body, and the convention's
/// headers it carries.
pub(crate) fn describe(answer: &Answer) -> String {
    let mut out = answer.status.to_string();
    match (problem_type(answer), slug(answer)) {
        (_, Some(slug)) => out.push_str(&format!(" problem {slug}")),
        (Some(kind), None) => out.push_str(&format!(" problem type {kind:?}")),
        (None, None) if answer.body.is_empty() => out.push_str(" (empty body)"),
        (None, None) => out.push_str(&format!(" body {}", show(&answer.body))),
    }
    for name in ["idempotent-replayed", "do-not-retry", "retry-after"] {
        if let Some(value) = answer.header(name) {
            out.push_str(&format!(", {name}: {}", show(value)));
        }
    }
    out
}

/// An exchange in a message.
pub(crate) fn describe_exchange(exchange: &Exchange) -> String {
    match exchange {
        Ok(answer) => describe(answer),
        Err(failure) => format!("no answer ({failure})"),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn answer(status: u16, headers: &[(&str, &str)], body: &str) -> Answer {
        Answer {
            status,
            headers: headers
                .iter()
                .map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec()))
                .collect(),
            body: body.as_bytes().to_vec(),
        }
    }

    #[test]
    fn flags_are_true_unless_zero_or_false() {
        for (value, set) in [
            ("1", true),
            ("", true),
            ("no", true),
            ("00", true),
            ("0", false),
            (" ?0 ", false),
            ("FALSE", false),
        ] {
            let a = answer(200, &[("do-not-retry", value)], "");
            assert_eq!(flag(&a, "do-not-retry"), set, "{value:?}");
        }
        assert!(!flag(&answer(200, &[], ""), "do-not-retry"));
    }

    #[test]
    fn retry_after_is_delay_seconds_or_an_http_date() {
        assert!(retry_after_syntax(b"1").is_ok());
        assert!(retry_after_syntax(b"86400").is_ok());
        assert!(retry_after_syntax(b"Sun, 06 Nov 1994 08:49:37 GMT").is_ok());
        assert!(retry_after_syntax(b"Sunday, 06-Nov-94 08:49:37 GMT").is_ok());
        assert!(retry_after_syntax(b"Sun Nov  6 08:49:37 1994").is_ok());
        for bad in [&b"86401"[..], b"-1", b"1.5", b"soon", b"", b"\xff"] {
            assert!(retry_after_syntax(bad).is_err(), "{bad:?}");
        }
        let a = answer(409, &[("retry-after", "2")], "");
        assert_eq!(retry_after_delay(&a), Some(Duration::from_secs(2)));
    }

    #[test]
    fn problem_documents_are_checked_for_members_order_and_status() {
        let good =
            r#"{"type":"urn:retrysafe:problem:key-invalid","title":"t","status":400,"detail":"d"}"#;
        let ct = [("content-type", "application/problem+json")];
        assert_eq!(problem_document(&answer(400, &ct, good)), Ok(()));
        assert!(problem_document(&answer(422, &ct, good)).is_err());
        assert!(
            problem_document(&answer(400, &[("content-type", "application/json")], good)).is_err()
        );
        let reordered =
            r#"{"title":"t","type":"urn:retrysafe:problem:key-invalid","status":400,"detail":"d"}"#;
        assert!(problem_document(&answer(400, &ct, reordered)).is_err());
        let bad_slug =
            r#"{"type":"urn:retrysafe:problem:Key_Invalid","title":"t","status":400,"detail":"d"}"#;
        assert!(problem_document(&answer(400, &ct, bad_slug)).is_err());
        assert_eq!(
            slug(&answer(400, &ct, good)).as_deref(),
            Some("key-invalid")
        );
    }

    #[test]
    fn expectations_name_what_differs() {
        let body = r#"{"type":"urn:retrysafe:problem:key-mismatch","title":"t","status":422,"detail":"d"}"#;
        let a = answer(422, &[], body);
        let e = expect_problem(&a, 422, "key-mismatch", true, false).unwrap_err();
        assert!(e.contains("do-not-retry"), "{e}");
        let e = expect_problem(&a, 409, "request-in-flight", false, true).unwrap_err();
        assert!(
            e.contains("expected 409 problem request-in-flight, got 422 problem key-mismatch"),
            "{e}"
        );
    }

    #[test]
    fn shown_bytes_are_escaped_and_cut() {
        assert_eq!(show(b"a\"\x01"), "\"a\\\"\\x01\"");
        assert!(show(&[b'x'; 200]).ends_with("…(+80 bytes)\""));
    }
}
