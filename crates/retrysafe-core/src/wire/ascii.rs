//! Small total helpers over header bytes, shared by the parsers of this module.

use http::HeaderValue;

/// Removes surrounding optional whitespace (RFC 9110 `OWS`: SP and HTAB).
pub(crate) fn trim_ows(value: &[u8]) -> &[u8] {
    let is_ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = value.iter().position(|b| !is_ows(b)).unwrap_or(value.len());
    let end = value
        .iter()
        .rposition(|b| !is_ows(b))
        .map_or(start, |i| i + 1);
    value.get(start..end).unwrap_or_default()
}

/// Reads `1*DIGIT` as a `u64`, saturating at `u64::MAX` instead of overflowing.
///
/// `None` when `digits` is empty or holds anything but ASCII digits (no sign, no
/// fraction, no whitespace). Linear in the length of the input and never panics.
pub(crate) fn parse_digits_saturating(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(digits.iter().fold(0u64, |acc, d| {
        acc.saturating_mul(10)
            .saturating_add(u64::from(d.saturating_sub(b'0')))
    }))
}

/// A header value from text the caller has built of visible ASCII and SP only.
///
/// `HeaderValue` accepts every such byte, so the fallback is unreachable; it exists only
/// so that no encoder can ever panic.
pub(crate) fn header_value(text: &str) -> HeaderValue {
    HeaderValue::from_str(text).unwrap_or_else(|_| HeaderValue::from_static(""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trims_only_sp_and_htab() {
        assert_eq!(trim_ows(b""), b"");
        assert_eq!(trim_ows(b" \t "), b"");
        assert_eq!(trim_ows(b" \ta b\t "), b"a b");
        assert_eq!(trim_ows(b"\r\nx\n"), b"\r\nx\n");
        assert_eq!(trim_ows(b"x"), b"x");
    }

    #[test]
    fn digits_saturate_and_reject_non_digits() {
        assert_eq!(parse_digits_saturating(b""), None);
        assert_eq!(parse_digits_saturating(b"0"), Some(0));
        assert_eq!(parse_digits_saturating(b"007"), Some(7));
        assert_eq!(
            parse_digits_saturating(b"18446744073709551615"),
            Some(u64::MAX)
        );
        assert_eq!(
            parse_digits_saturating(b"18446744073709551616"),
            Some(u64::MAX)
        );
        assert_eq!(parse_digits_saturating(&[b'9'; 10_000]), Some(u64::MAX));
        for bad in [
            &b"-1"[..],
            b"+1",
            b"1.5",
            b" 1",
            b"1 ",
            b"1e3",
            b"\xff",
            b"0x10",
        ] {
            assert_eq!(parse_digits_saturating(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn header_value_keeps_text() {
        assert_eq!(header_value("12n"), "12n");
        assert_eq!(header_value("\"a b\""), "\"a b\"");
    }
}
