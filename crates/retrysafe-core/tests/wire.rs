//! Tests of the wire convention's parsers and encoders: hostile input for every parser,
//! and properties (no panic on any bytes, encode → parse round-trips).
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use std::time::{Duration, SystemTime};

use http::HeaderValue;
use proptest::prelude::*;
use retrysafe_core::wire::{
    IdempotencyKey, KeyError, MAX_KEY_LEN, MAX_RETRY_AFTER, MAX_TIMEOUT, Pushback, RetryAfter,
    RetryPoint, TimeoutError, encode_grpc_timeout, encode_pushback, encode_request_timeout_ms,
    encode_retry_after, encode_retry_attempt, parse_do_not_retry, parse_flag, parse_grpc_timeout,
    parse_pushback, parse_request_timeout_ms, parse_retry_after, parse_retry_attempt,
    parse_retry_point,
};

/// Forty digits: more than any integer type holds.
const FORTY_DIGITS: &[u8] = b"9999999999999999999999999999999999999999";
/// Non-UTF-8 bytes.
const NOT_UTF8: &[u8] = b"\xff\xfe";
/// Sun, 06 Nov 1994 08:49:37 GMT, the RFC 9110 example date.
const EXAMPLE_DATE_SECS: u64 = 784_111_777;

fn ten_kb(byte: u8) -> Vec<u8> {
    vec![byte; 10 * 1024]
}

fn key(value: &[u8]) -> Result<String, KeyError> {
    IdempotencyKey::parse(value).map(|k| k.as_str().to_owned())
}

fn example_date() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(EXAMPLE_DATE_SECS)
}

/// The length in nanoseconds of a `grpc-timeout` unit.
fn grpc_unit_nanos(unit: u8) -> u128 {
    match unit {
        b'n' => 1,
        b'u' => 1_000,
        b'm' => 1_000_000,
        b'S' => 1_000_000_000,
        b'M' => 60_000_000_000,
        b'H' => 3_600_000_000_000,
        other => panic!("not a grpc-timeout unit: {other}"),
    }
}

/// Escapes a key's content as an sf-string.
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

// ---------------------------------------------------------------- idempotency-key

#[test]
fn key_bare_and_quoted_forms_are_one_key() {
    let bare = IdempotencyKey::parse(b"8e03-978e").unwrap();
    let quoted = IdempotencyKey::parse(br#""8e03-978e""#).unwrap();
    let padded = IdempotencyKey::parse(b" \t 8e03-978e\t ").unwrap();
    let padded_quoted = IdempotencyKey::parse(b" \"8e03-978e\"\t").unwrap();
    assert_eq!(bare.as_str(), "8e03-978e");
    assert_eq!(bare, quoted);
    assert_eq!(bare, padded);
    assert_eq!(bare, padded_quoted);
    assert_eq!(bare.to_string(), "8e03-978e");
    assert_eq!(format!("{bare:?}"), r#"IdempotencyKey("8e03-978e")"#);
}

#[test]
fn key_empty_and_whitespace_only_are_empty() {
    assert_eq!(key(b""), Err(KeyError::Empty));
    assert_eq!(key(b" "), Err(KeyError::Empty));
    assert_eq!(key(b" \t \t"), Err(KeyError::Empty));
    assert_eq!(key(br#""""#), Err(KeyError::Empty));
    assert_eq!(key(b"  \"\"  "), Err(KeyError::Empty));
    assert_eq!(key(&ten_kb(b' ')), Err(KeyError::Empty));
}

#[test]
fn key_length_boundaries() {
    let max = "k".repeat(MAX_KEY_LEN);
    let over = "k".repeat(MAX_KEY_LEN + 1);
    assert_eq!(key(max.as_bytes()), Ok(max.clone()));
    assert_eq!(key(over.as_bytes()), Err(KeyError::TooLong));
    // Surrounding whitespace does not count.
    assert_eq!(key(format!("  {max}\t").as_bytes()), Ok(max.clone()));
    // The sf-string form counts the unquoted content.
    assert_eq!(key(sf_string(&max).as_bytes()), Ok(max.clone()));
    assert_eq!(key(sf_string(&over).as_bytes()), Err(KeyError::TooLong));
    // Every character escaped: 2 * 255 + 2 bytes on the wire, still 255 characters.
    let quotes = "\"".repeat(MAX_KEY_LEN);
    let wire = sf_string(&quotes);
    assert_eq!(wire.len(), 2 * MAX_KEY_LEN + 2);
    assert_eq!(key(wire.as_bytes()), Ok(quotes));
    let over_escaped = "\\".repeat(MAX_KEY_LEN + 1);
    assert_eq!(
        key(sf_string(&over_escaped).as_bytes()),
        Err(KeyError::TooLong)
    );
    // A one-character key.
    assert_eq!(key(b"x"), Ok("x".to_owned()));
    assert_eq!(key(b"\" \""), Ok(" ".to_owned()));
}

#[test]
fn key_huge_values_are_too_long_before_printability() {
    assert_eq!(key(&ten_kb(b'a')), Err(KeyError::TooLong));
    assert_eq!(key(&ten_kb(0xff)), Err(KeyError::TooLong));
    assert_eq!(key(&ten_kb(0)), Err(KeyError::TooLong));
    assert_eq!(key(&[0xff; MAX_KEY_LEN + 1]), Err(KeyError::TooLong));
    let mut quoted = ten_kb(b'a');
    quoted[0] = b'"';
    *quoted.last_mut().unwrap() = b'"';
    assert_eq!(key(&quoted), Err(KeyError::TooLong));
}

#[test]
fn key_non_printable_bytes_are_refused() {
    assert_eq!(key(NOT_UTF8), Err(KeyError::NotPrintable));
    assert_eq!(key(b"abc\xff"), Err(KeyError::NotPrintable));
    assert_eq!(key("caf\u{e9}".as_bytes()), Err(KeyError::NotPrintable));
    assert_eq!(key(b"a\x00b"), Err(KeyError::NotPrintable));
    assert_eq!(key(b"a\x7fb"), Err(KeyError::NotPrintable));
    assert_eq!(key(b"a\r\nb"), Err(KeyError::NotPrintable));
    // A space or tab inside a bare value.
    assert_eq!(key(b"a b"), Err(KeyError::NotPrintable));
    assert_eq!(key(b"a\tb"), Err(KeyError::NotPrintable));
    // Inside an sf-string a space is fine, a tab or non-ASCII byte is not.
    assert_eq!(key(b"\"a b\""), Ok("a b".to_owned()));
    assert_eq!(key(b"\"a\tb\""), Err(KeyError::NotPrintable));
    assert_eq!(key(b"\"a\xffb\""), Err(KeyError::NotPrintable));
    assert_eq!(key(b"\"\x01\""), Err(KeyError::NotPrintable));
}

#[test]
fn key_sf_string_escapes() {
    assert_eq!(key(br#""a\"b""#), Ok(r#"a"b"#.to_owned()));
    assert_eq!(key(br#""a\\b""#), Ok(r"a\b".to_owned()));
    assert_eq!(key(br#""\\""#), Ok(r"\".to_owned()));
    assert_eq!(key(br#""\"""#), Ok(r#"""#.to_owned()));
    assert_eq!(
        key(br#"" leading and trailing ""#),
        Ok(" leading and trailing ".to_owned())
    );
}

#[test]
fn key_invalid_sf_strings_are_read_bare() {
    // Opening quote only.
    assert_eq!(key(br#""abc"#), Ok(r#""abc"#.to_owned()));
    // A lone quote.
    assert_eq!(key(br#"""#), Ok(r#"""#.to_owned()));
    // An unknown escape.
    assert_eq!(key(br#""a\b""#), Ok(r#""a\b""#.to_owned()));
    // An unescaped quote inside.
    assert_eq!(key(br#""a"b""#), Ok(r#""a"b""#.to_owned()));
    // The closing quote is escaped, so the string never closes.
    assert_eq!(key(br#""abc\""#), Ok(r#""abc\""#.to_owned()));
    // Text after the closing quote.
    assert_eq!(key(br#""abc"x"#), Ok(r#""abc"x"#.to_owned()));
    // Read bare, a space inside is not allowed.
    assert_eq!(key(br#""a b"c"#), Err(KeyError::NotPrintable));
    // A bare value may contain quotes and backslashes anywhere.
    assert_eq!(key(br#"a"b\c""#), Ok(r#"a"b\c""#.to_owned()));
}

#[test]
fn key_negative_numbers_and_fractions_are_just_keys() {
    assert_eq!(key(b"-1"), Ok("-1".to_owned()));
    assert_eq!(key(b"1.5"), Ok("1.5".to_owned()));
    assert_eq!(
        key(FORTY_DIGITS),
        Ok(String::from_utf8(FORTY_DIGITS.to_vec()).unwrap())
    );
}

#[test]
fn key_new_uses_the_content_rule_without_trimming() {
    assert_eq!(IdempotencyKey::new("abc").unwrap().as_str(), "abc");
    assert_eq!(IdempotencyKey::new(" a b ").unwrap().as_str(), " a b ");
    assert_eq!(IdempotencyKey::new(r#""q""#).unwrap().as_str(), r#""q""#);
    assert_eq!(IdempotencyKey::new(""), Err(KeyError::Empty));
    assert_eq!(
        IdempotencyKey::new(&"k".repeat(MAX_KEY_LEN))
            .unwrap()
            .as_str()
            .len(),
        MAX_KEY_LEN
    );
    assert_eq!(
        IdempotencyKey::new(&"k".repeat(MAX_KEY_LEN + 1)),
        Err(KeyError::TooLong)
    );
    assert_eq!(IdempotencyKey::new("a\tb"), Err(KeyError::NotPrintable));
    assert_eq!(IdempotencyKey::new("\u{e9}"), Err(KeyError::NotPrintable));
    assert_eq!(IdempotencyKey::new("a\u{7f}"), Err(KeyError::NotPrintable));
}

#[test]
fn key_header_value_forms() {
    let enc = |k: &str| IdempotencyKey::new(k).unwrap().to_header_value();
    assert_eq!(enc("8e03-978e"), "8e03-978e");
    assert_eq!(enc(r#"a"b\c"#), r#"a"b\c"#);
    assert_eq!(enc("a b"), r#""a b""#);
    assert_eq!(enc(" "), r#"" ""#);
    assert_eq!(enc(r#""abc"#), r#""\"abc""#);
    assert_eq!(enc(r#"x "y" \z"#), r#""x \"y\" \\z""#);
    for k in [
        "8e03-978e",
        "a b",
        r#""abc"#,
        r#""x""#,
        r"\",
        r#"""#,
        " lead",
        "trail ",
    ] {
        let key = IdempotencyKey::new(k).unwrap();
        assert_eq!(IdempotencyKey::from_header(&key.to_header_value()), Ok(key));
    }
}

#[test]
fn key_error_display_is_lowercase() {
    for e in [KeyError::Empty, KeyError::TooLong, KeyError::NotPrintable] {
        let text = e.to_string();
        assert!(text.starts_with("idempotency key"), "{text}");
        assert_eq!(text, text.to_lowercase());
    }
}

// ---------------------------------------------------------------- retry-after

#[test]
fn retry_after_delay_seconds() {
    let secs = |s| Some(RetryAfter::Delay(Duration::from_secs(s)));
    assert_eq!(parse_retry_after(b"0"), secs(0));
    assert_eq!(parse_retry_after(b"120"), secs(120));
    assert_eq!(parse_retry_after(b"  120\t"), secs(120));
    assert_eq!(parse_retry_after(b"0007"), secs(7));
    assert_eq!(parse_retry_after(b"86400"), secs(86_400));
    assert_eq!(
        parse_retry_after(b"86401"),
        Some(RetryAfter::Delay(MAX_RETRY_AFTER))
    );
}

#[test]
fn retry_after_overflow_clamps() {
    let max = Some(RetryAfter::Delay(MAX_RETRY_AFTER));
    assert_eq!(parse_retry_after(FORTY_DIGITS), max);
    assert_eq!(parse_retry_after(b"18446744073709551616"), max);
    assert_eq!(parse_retry_after(&ten_kb(b'9')), max);
}

#[test]
fn retry_after_garbage_is_none() {
    for bad in [
        &b""[..],
        b"   ",
        b"\t",
        NOT_UTF8,
        b"-1",
        b"-0",
        b"+5",
        b"1.5",
        b"1e3",
        b"1 2",
        b"soon",
        b"0x10",
        b"Sun, 06 Nov 1994 08:49:37",
        b"Sun, 32 Nov 1994 08:49:37 GMT",
        b"Sun, 06 Nov 1994 08:49:37 GMT trailing",
    ] {
        assert_eq!(parse_retry_after(bad), None, "{bad:?}");
    }
    assert_eq!(parse_retry_after(&ten_kb(b'a')), None);
    assert_eq!(parse_retry_after(&ten_kb(0xff)), None);
}

#[test]
fn retry_after_http_dates_in_all_three_forms() {
    let at = Some(RetryAfter::At(example_date()));
    assert_eq!(parse_retry_after(b"Sun, 06 Nov 1994 08:49:37 GMT"), at);
    assert_eq!(parse_retry_after(b"Sunday, 06-Nov-94 08:49:37 GMT"), at);
    assert_eq!(parse_retry_after(b"Sun Nov  6 08:49:37 1994"), at);
    assert_eq!(parse_retry_after(b"  Sun, 06 Nov 1994 08:49:37 GMT \t"), at);
}

#[test]
fn retry_after_delay_from() {
    let now = example_date();
    let in_past = parse_retry_after(b"Sun, 06 Nov 1994 08:49:00 GMT").unwrap();
    assert_eq!(in_past.delay_from(now), Duration::ZERO);
    let same = parse_retry_after(b"Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
    assert_eq!(same.delay_from(now), Duration::ZERO);
    let soon = parse_retry_after(b"Sun, 06 Nov 1994 08:50:07 GMT").unwrap();
    assert_eq!(soon.delay_from(now), Duration::from_secs(30));
    let far = parse_retry_after(b"Fri, 31 Dec 9999 23:59:59 GMT").unwrap();
    assert_eq!(far.delay_from(now), MAX_RETRY_AFTER);
    // Relative delays ignore `now`; an oversized one built by hand is clamped.
    let d = RetryAfter::Delay(Duration::from_secs(5));
    assert_eq!(d.delay_from(SystemTime::UNIX_EPOCH), Duration::from_secs(5));
    assert_eq!(d.delay_from(now), Duration::from_secs(5));
    let huge = RetryAfter::Delay(Duration::MAX);
    assert_eq!(huge.delay_from(now), MAX_RETRY_AFTER);
}

#[test]
fn retry_after_encoding_rounds_up_and_clamps() {
    assert_eq!(encode_retry_after(Duration::ZERO), "0");
    assert_eq!(encode_retry_after(Duration::from_nanos(1)), "1");
    assert_eq!(encode_retry_after(Duration::from_millis(1_200)), "2");
    assert_eq!(encode_retry_after(Duration::from_secs(2)), "2");
    assert_eq!(encode_retry_after(MAX_RETRY_AFTER), "86400");
    assert_eq!(
        encode_retry_after(MAX_RETRY_AFTER + Duration::from_nanos(1)),
        "86400"
    );
    assert_eq!(encode_retry_after(Duration::MAX), "86400");
}

// ---------------------------------------------------------------- request-timeout-ms

#[test]
fn request_timeout_ms_parses_digits() {
    assert_eq!(parse_request_timeout_ms(b"0"), Ok(Duration::ZERO));
    assert_eq!(
        parse_request_timeout_ms(b"250"),
        Ok(Duration::from_millis(250))
    );
    assert_eq!(
        parse_request_timeout_ms(b" \t250 "),
        Ok(Duration::from_millis(250))
    );
    assert_eq!(
        parse_request_timeout_ms(b"000250"),
        Ok(Duration::from_millis(250))
    );
    let max_ms = u64::try_from(MAX_TIMEOUT.as_millis()).unwrap();
    assert_eq!(
        parse_request_timeout_ms(max_ms.to_string().as_bytes()),
        Ok(MAX_TIMEOUT)
    );
    assert_eq!(
        parse_request_timeout_ms((max_ms + 1).to_string().as_bytes()),
        Ok(MAX_TIMEOUT)
    );
}

#[test]
fn request_timeout_ms_overflow_clamps() {
    assert_eq!(parse_request_timeout_ms(FORTY_DIGITS), Ok(MAX_TIMEOUT));
    assert_eq!(
        parse_request_timeout_ms(b"18446744073709551615"),
        Ok(MAX_TIMEOUT)
    );
    assert_eq!(parse_request_timeout_ms(&ten_kb(b'7')), Ok(MAX_TIMEOUT));
}

#[test]
fn request_timeout_ms_refuses_garbage() {
    assert_eq!(parse_request_timeout_ms(b""), Err(TimeoutError::Empty));
    assert_eq!(parse_request_timeout_ms(b"  \t "), Err(TimeoutError::Empty));
    assert_eq!(
        parse_request_timeout_ms(&ten_kb(b' ')),
        Err(TimeoutError::Empty)
    );
    for bad in [
        NOT_UTF8, b"-1", b"+1", b"1.5", b"1,5", b"1e3", b"1 000", b"100ms", b"0x10", b"ten",
    ] {
        assert_eq!(
            parse_request_timeout_ms(bad),
            Err(TimeoutError::Malformed),
            "{bad:?}"
        );
    }
    assert_eq!(
        parse_request_timeout_ms(&ten_kb(b'x')),
        Err(TimeoutError::Malformed)
    );
    assert_eq!(TimeoutError::Empty.to_string(), "timeout header is empty");
}

#[test]
fn request_timeout_ms_encoding_rounds_down() {
    assert_eq!(encode_request_timeout_ms(Duration::ZERO), "0");
    assert_eq!(
        encode_request_timeout_ms(Duration::from_nanos(999_999)),
        "0"
    );
    assert_eq!(encode_request_timeout_ms(Duration::from_micros(1_999)), "1");
    assert_eq!(encode_request_timeout_ms(Duration::from_secs(3)), "3000");
    assert_eq!(encode_request_timeout_ms(MAX_TIMEOUT), "2592000000");
    assert_eq!(encode_request_timeout_ms(Duration::MAX), "2592000000");
}

/// The encoders keep their last value per thread: a value repeated, alternated with
/// others, or encoded on another thread comes out as a fresh encoding would.
#[test]
fn timeout_encodings_repeated_and_alternated_stay_exact() {
    let ms = |m| encode_request_timeout_ms(Duration::from_millis(m));
    let grpc = |n| encode_grpc_timeout(Duration::from_nanos(n));
    for _ in 0..3 {
        assert_eq!(ms(10_000), "10000");
        assert_eq!(ms(10_000), "10000");
        assert_eq!(ms(9_999), "9999");
        assert_eq!(grpc(10_000_000_000), "10000000u");
        assert_eq!(grpc(10_000_000_000), "10000000u");
        assert_eq!(grpc(1), "1n");
        assert_eq!(
            encode_request_timeout_ms(Duration::from_micros(10_000_999)),
            "10000"
        );
    }
    let kept = ms(250);
    let other = std::thread::spawn(|| {
        let a = encode_request_timeout_ms(Duration::from_millis(250));
        let b = encode_request_timeout_ms(Duration::from_millis(251));
        (a, b)
    })
    .join()
    .unwrap();
    assert_eq!(other.0, "250");
    assert_eq!(other.1, "251");
    assert_eq!(kept, "250");
    assert_eq!(ms(250), "250");
}

// ---------------------------------------------------------------- grpc-timeout

#[test]
fn grpc_timeout_every_unit() {
    assert_eq!(parse_grpc_timeout(b"2H"), Ok(Duration::from_secs(7_200)));
    assert_eq!(parse_grpc_timeout(b"3M"), Ok(Duration::from_secs(180)));
    assert_eq!(parse_grpc_timeout(b"4S"), Ok(Duration::from_secs(4)));
    assert_eq!(parse_grpc_timeout(b"5m"), Ok(Duration::from_millis(5)));
    assert_eq!(parse_grpc_timeout(b"6u"), Ok(Duration::from_micros(6)));
    assert_eq!(parse_grpc_timeout(b"7n"), Ok(Duration::from_nanos(7)));
    assert_eq!(parse_grpc_timeout(b"0n"), Ok(Duration::ZERO));
    assert_eq!(parse_grpc_timeout(b"0H"), Ok(Duration::ZERO));
    assert_eq!(
        parse_grpc_timeout(b" 100m\t"),
        Ok(Duration::from_millis(100))
    );
}

#[test]
fn grpc_timeout_digit_count_boundary() {
    assert_eq!(
        parse_grpc_timeout(b"99999999n"),
        Ok(Duration::from_nanos(99_999_999))
    );
    assert_eq!(parse_grpc_timeout(b"00000001S"), Ok(Duration::from_secs(1)));
    assert_eq!(
        parse_grpc_timeout(b"999999999n"),
        Err(TimeoutError::Malformed)
    );
    assert_eq!(
        parse_grpc_timeout(b"000000001S"),
        Err(TimeoutError::Malformed)
    );
    assert_eq!(
        parse_grpc_timeout(FORTY_DIGITS),
        Err(TimeoutError::Malformed)
    );
    let mut forty = FORTY_DIGITS.to_vec();
    forty.push(b'S');
    assert_eq!(parse_grpc_timeout(&forty), Err(TimeoutError::Malformed));
    let mut huge = ten_kb(b'9');
    huge.push(b'n');
    assert_eq!(parse_grpc_timeout(&huge), Err(TimeoutError::Malformed));
}

#[test]
fn grpc_timeout_clamps_to_max() {
    assert_eq!(parse_grpc_timeout(b"99999999H"), Ok(MAX_TIMEOUT));
    assert_eq!(parse_grpc_timeout(b"99999999M"), Ok(MAX_TIMEOUT));
    assert_eq!(parse_grpc_timeout(b"99999999S"), Ok(MAX_TIMEOUT));
    assert_eq!(parse_grpc_timeout(b"720H"), Ok(MAX_TIMEOUT));
    assert_eq!(
        parse_grpc_timeout(b"719H"),
        Ok(Duration::from_secs(719 * 3_600))
    );
}

#[test]
fn grpc_timeout_refuses_garbage() {
    assert_eq!(parse_grpc_timeout(b""), Err(TimeoutError::Empty));
    assert_eq!(parse_grpc_timeout(b" \t "), Err(TimeoutError::Empty));
    for bad in [
        NOT_UTF8, b"S", b"n", b"10", b"10s", b"10h", b"10x", b"10 S", b"1 0S", b"-1S", b"+1S",
        b"1.5S", b"10SS", b"10mS", b"S10", b"10\xffS", b"10\xff",
    ] {
        assert_eq!(
            parse_grpc_timeout(bad),
            Err(TimeoutError::Malformed),
            "{bad:?}"
        );
    }
    assert_eq!(
        parse_grpc_timeout(&ten_kb(b'S')),
        Err(TimeoutError::Malformed)
    );
    assert_eq!(
        parse_grpc_timeout(&ten_kb(0xff)),
        Err(TimeoutError::Malformed)
    );
}

#[test]
fn grpc_timeout_encoding_picks_the_finest_unit_and_rounds_down() {
    assert_eq!(encode_grpc_timeout(Duration::ZERO), "0n");
    assert_eq!(encode_grpc_timeout(Duration::from_nanos(1)), "1n");
    assert_eq!(
        encode_grpc_timeout(Duration::from_nanos(99_999_999)),
        "99999999n"
    );
    assert_eq!(
        encode_grpc_timeout(Duration::from_nanos(100_000_000)),
        "100000u"
    );
    assert_eq!(
        encode_grpc_timeout(Duration::from_nanos(100_000_999)),
        "100000u"
    );
    assert_eq!(
        encode_grpc_timeout(Duration::from_micros(99_999_999)),
        "99999999u"
    );
    assert_eq!(
        encode_grpc_timeout(Duration::from_micros(100_000_000)),
        "100000m"
    );
    assert_eq!(
        encode_grpc_timeout(Duration::from_millis(99_999_999)),
        "99999999m"
    );
    assert_eq!(
        encode_grpc_timeout(Duration::from_millis(100_000_999)),
        "100000S"
    );
    assert_eq!(
        encode_grpc_timeout(Duration::from_secs(99_999_999)),
        "99999999S"
    );
    assert_eq!(
        encode_grpc_timeout(Duration::from_secs(100_000_059)),
        "1666667M"
    );
    assert_eq!(
        encode_grpc_timeout(Duration::from_secs(99_999_999 * 60)),
        "99999999M"
    );
    assert_eq!(
        encode_grpc_timeout(Duration::from_secs(100_000_000 * 60)),
        "1666666H"
    );
    assert_eq!(
        encode_grpc_timeout(Duration::from_secs(99_999_999 * 3_600)),
        "99999999H"
    );
    assert_eq!(
        encode_grpc_timeout(Duration::from_secs(100_000_000 * 3_600)),
        "99999999H"
    );
    assert_eq!(encode_grpc_timeout(Duration::MAX), "99999999H");
    assert_eq!(encode_grpc_timeout(MAX_TIMEOUT), "2592000S");
}

// ---------------------------------------------------------------- do-not-retry, flags

#[test]
fn do_not_retry_values() {
    assert!(!parse_do_not_retry(None));
    for no in [
        &b"0"[..],
        b"?0",
        b"false",
        b"FALSE",
        b"False",
        b"fAlSe",
        b" 0 ",
        b"\t?0\t",
        b"  false ",
    ] {
        assert!(!parse_do_not_retry(Some(no)), "{no:?}");
        assert!(!parse_flag(Some(no)), "{no:?}");
    }
    for yes in [
        &b"1"[..],
        b"?1",
        b"true",
        b"",
        b"   ",
        NOT_UTF8,
        b"00",
        b"-0",
        b"no",
        b"f",
        b"falsey",
        b"0 0",
        b"?0;x",
        FORTY_DIGITS,
    ] {
        assert!(parse_do_not_retry(Some(yes)), "{yes:?}");
        assert!(parse_flag(Some(yes)), "{yes:?}");
    }
    assert!(parse_do_not_retry(Some(&ten_kb(b'0'))));
    assert!(!parse_flag(None));
}

#[test]
fn retry_point_values() {
    for caller in [&b"caller"[..], b"CALLER", b"Caller", b" caller\t"] {
        assert_eq!(
            parse_retry_point(caller),
            Some(RetryPoint::Caller),
            "{caller:?}"
        );
    }
    for other in [
        &b""[..],
        b"  ",
        b"callee",
        b"caller2",
        b"call er",
        b"\"caller\"",
        NOT_UTF8,
        b"-1",
    ] {
        assert_eq!(parse_retry_point(other), None, "{other:?}");
    }
    assert_eq!(parse_retry_point(&ten_kb(b'c')), None);
}

#[test]
fn retry_attempt_values() {
    assert_eq!(parse_retry_attempt(b"1"), Some(1));
    assert_eq!(parse_retry_attempt(b" 2\t"), Some(2));
    assert_eq!(parse_retry_attempt(b"007"), Some(7));
    assert_eq!(parse_retry_attempt(b"4294967295"), Some(u32::MAX));
    for bad in [
        &b""[..],
        b"   ",
        b"0",
        b"000",
        b"4294967296",
        b"18446744073709551616",
        FORTY_DIGITS,
        b"-1",
        b"+1",
        b"1.0",
        b"1e2",
        b"one",
        NOT_UTF8,
        b"1 2",
    ] {
        assert_eq!(parse_retry_attempt(bad), None, "{bad:?}");
    }
    assert_eq!(parse_retry_attempt(&ten_kb(b'1')), None);
    assert_eq!(encode_retry_attempt(1), "1");
    assert_eq!(encode_retry_attempt(u32::MAX), "4294967295");
}

#[test]
fn pushback_values() {
    let after = |ms| Pushback::After(Duration::from_millis(ms));
    assert_eq!(parse_pushback(b"0"), after(0));
    assert_eq!(parse_pushback(b"250"), after(250));
    assert_eq!(parse_pushback(b" 250\t"), after(250));
    assert_eq!(
        parse_pushback(b"86400000"),
        Pushback::After(MAX_RETRY_AFTER)
    );
    assert_eq!(
        parse_pushback(b"86400001"),
        Pushback::After(MAX_RETRY_AFTER)
    );
    assert_eq!(
        parse_pushback(FORTY_DIGITS),
        Pushback::After(MAX_RETRY_AFTER)
    );
    assert_eq!(
        parse_pushback(&ten_kb(b'9')),
        Pushback::After(MAX_RETRY_AFTER)
    );
    for bad in [
        &b""[..],
        b"  ",
        b"-1",
        b"-0",
        b"-99999999999999999999999",
        b"+1",
        b"1.5",
        b"1e3",
        b"soon",
        NOT_UTF8,
        b"1 0",
    ] {
        assert_eq!(parse_pushback(bad), Pushback::DoNotRetry, "{bad:?}");
    }
    assert_eq!(parse_pushback(&ten_kb(b'-')), Pushback::DoNotRetry);
}

#[test]
fn pushback_encoding_rounds_up() {
    assert_eq!(encode_pushback(Duration::ZERO), "0");
    assert_eq!(encode_pushback(Duration::from_nanos(1)), "1");
    assert_eq!(encode_pushback(Duration::from_millis(250)), "250");
    assert_eq!(encode_pushback(Duration::from_micros(250_001)), "251");
    assert_eq!(encode_pushback(Duration::from_secs(2)), "2000");
    assert_eq!(encode_pushback(Duration::MAX), "18446744073709551615");
}

// ---------------------------------------------------------------- properties

/// Every parser, on one input; asserts each result's documented invariants.
fn check_all_parsers(bytes: &[u8]) {
    match IdempotencyKey::parse(bytes) {
        Ok(k) => {
            let s = k.as_str();
            assert!(!s.is_empty() && s.len() <= MAX_KEY_LEN);
            assert!(s.bytes().all(|b| (0x20..=0x7e).contains(&b)));
            assert_eq!(
                IdempotencyKey::from_header(&k.to_header_value()),
                Ok(k.clone())
            );
            assert_eq!(IdempotencyKey::new(s), Ok(k));
        }
        Err(KeyError::Empty | KeyError::TooLong | KeyError::NotPrintable) => {}
        Err(other) => panic!("undocumented key error {other:?}"),
    }
    if let Some(r) = parse_retry_after(bytes) {
        assert!(r.delay_from(SystemTime::UNIX_EPOCH) <= MAX_RETRY_AFTER);
        assert!(r.delay_from(SystemTime::now()) <= MAX_RETRY_AFTER);
        if let RetryAfter::Delay(d) = r {
            assert!(d <= MAX_RETRY_AFTER);
        }
    }
    if let Ok(d) = parse_request_timeout_ms(bytes) {
        assert!(d <= MAX_TIMEOUT);
    }
    if let Ok(d) = parse_grpc_timeout(bytes) {
        assert!(d <= MAX_TIMEOUT);
    }
    if let Some(n) = parse_retry_attempt(bytes) {
        assert!(n >= 1);
    }
    if let Pushback::After(d) = parse_pushback(bytes) {
        assert!(d <= MAX_RETRY_AFTER);
    }
    let _ = parse_retry_point(bytes);
    assert_eq!(parse_do_not_retry(Some(bytes)), parse_flag(Some(bytes)));
    if let Ok(value) = HeaderValue::from_bytes(bytes) {
        assert_eq!(
            IdempotencyKey::from_header(&value),
            IdempotencyKey::parse(bytes)
        );
    }
}

/// Header-like bytes: digits, units, quotes, escapes, whitespace, signs, high bytes.
fn headerish() -> impl Strategy<Value = Vec<u8>> {
    let atom = prop_oneof![
        Just(b'0'),
        Just(b'9'),
        (b'0'..=b'9'),
        Just(b' '),
        Just(b'\t'),
        Just(b'"'),
        Just(b'\\'),
        Just(b'-'),
        Just(b'+'),
        Just(b'.'),
        Just(b'?'),
        prop::sample::select(b"HMSmun".to_vec()),
        any::<u8>(),
    ];
    prop::collection::vec(atom, 0..64)
}

fn bare_key() -> impl Strategy<Value = String> {
    "[\\x21-\\x7e]{1,255}"
}

fn sf_key() -> impl Strategy<Value = String> {
    "[\\x20-\\x7e]{1,255}"
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn no_parser_panics_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..1_000)) {
        check_all_parsers(&bytes);
    }

    #[test]
    fn no_parser_panics_on_arbitrary_strings(text in any::<String>()) {
        check_all_parsers(text.as_bytes());
    }

    #[test]
    fn no_parser_panics_on_header_like_bytes(bytes in headerish()) {
        check_all_parsers(&bytes);
    }

    #[test]
    fn bare_range_keys_round_trip(k in bare_key()) {
        let key = IdempotencyKey::new(&k).unwrap();
        let wire = key.to_header_value();
        prop_assert_eq!(IdempotencyKey::from_header(&wire), Ok(key.clone()));
        if !k.starts_with('"') {
            prop_assert_eq!(wire.as_bytes(), k.as_bytes());
        }
        // The sf-string form of the same key, with whitespace around, is the same key.
        let quoted = format!(" \t{} ", sf_string(&k));
        prop_assert_eq!(IdempotencyKey::parse(quoted.as_bytes()), Ok(key.clone()));
        // The bare form, padded, is the same key (unless it happens to look quoted).
        if !k.starts_with('"') {
            let padded = format!("\t {k}  ");
            prop_assert_eq!(IdempotencyKey::parse(padded.as_bytes()), Ok(key));
        }
    }

    #[test]
    fn sf_range_keys_round_trip(k in sf_key()) {
        let key = IdempotencyKey::new(&k).unwrap();
        prop_assert_eq!(key.as_str(), k.as_str());
        let wire = key.to_header_value();
        prop_assert_eq!(IdempotencyKey::from_header(&wire), Ok(key.clone()));
        prop_assert_eq!(IdempotencyKey::parse(sf_string(&k).as_bytes()), Ok(key));
    }

    #[test]
    fn retry_attempt_round_trips(n in 1..=u32::MAX) {
        prop_assert_eq!(parse_retry_attempt(encode_retry_attempt(n).as_bytes()), Some(n));
    }

    #[test]
    fn request_timeout_ms_round_trips_floored(
        nanos in 0..=u64::try_from(MAX_TIMEOUT.as_nanos()).unwrap()
    ) {
        let d = Duration::from_nanos(nanos);
        let floored = Duration::from_millis(u64::try_from(d.as_millis()).unwrap());
        let back = parse_request_timeout_ms(encode_request_timeout_ms(d).as_bytes());
        prop_assert_eq!(back, Ok(floored));
        prop_assert!(floored <= d);
    }

    #[test]
    fn request_timeout_ms_clamps_beyond_max(secs in MAX_TIMEOUT.as_secs()..=u64::MAX, nanos in 0u32..1_000_000_000) {
        let d = Duration::new(secs, nanos);
        let back = parse_request_timeout_ms(encode_request_timeout_ms(d).as_bytes());
        prop_assert_eq!(back, Ok(MAX_TIMEOUT));
    }

    #[test]
    fn grpc_timeout_round_trips_rounding_down(
        nanos in prop_oneof![
            0..=1_000_000u64,
            0..=u64::try_from(MAX_TIMEOUT.as_nanos()).unwrap(),
        ]
    ) {
        let d = Duration::from_nanos(nanos);
        let wire = encode_grpc_timeout(d);
        let bytes = wire.as_bytes();
        prop_assert!(bytes.len() >= 2 && bytes.len() <= 9);
        let unit = grpc_unit_nanos(*bytes.last().unwrap());
        let back = parse_grpc_timeout(bytes).unwrap();
        prop_assert!(back <= d);
        prop_assert!(d.as_nanos() - back.as_nanos() < unit);
        if d.as_nanos().is_multiple_of(unit) {
            prop_assert_eq!(back, d);
        }
        // The unit is the finest that fits: one finer would need more than 8 digits.
        if unit > 1 {
            let finer = match unit {
                1_000 => 1,
                1_000_000 => 1_000,
                1_000_000_000 => 1_000_000,
                60_000_000_000 => 1_000_000_000,
                _ => 60_000_000_000,
            };
            prop_assert!(d.as_nanos() / finer > 99_999_999);
        }
    }

    #[test]
    fn grpc_timeout_whole_units_are_exact(
        amount in 0..=99_999_999u64,
        unit in prop::sample::select(b"HMSmun".to_vec()),
    ) {
        let nanos = u128::from(amount) * grpc_unit_nanos(unit);
        let d = Duration::new(
            u64::try_from(nanos / 1_000_000_000).unwrap(),
            u32::try_from(nanos % 1_000_000_000).unwrap(),
        );
        let back = parse_grpc_timeout(encode_grpc_timeout(d).as_bytes()).unwrap();
        prop_assert_eq!(back, d.min(MAX_TIMEOUT));
        let wire = format!("{amount}{}", char::from(unit));
        prop_assert_eq!(parse_grpc_timeout(wire.as_bytes()), Ok(d.min(MAX_TIMEOUT)));
    }

    #[test]
    fn grpc_timeout_never_exceeds_left(secs in any::<u64>(), nanos in 0u32..1_000_000_000) {
        let d = Duration::new(secs, nanos);
        let wire = encode_grpc_timeout(d);
        let bytes = wire.as_bytes();
        let digits = &bytes[..bytes.len() - 1];
        prop_assert!(!digits.is_empty() && digits.len() <= 8);
        let amount: u128 = std::str::from_utf8(digits).unwrap().parse().unwrap();
        prop_assert!(amount * grpc_unit_nanos(*bytes.last().unwrap()) <= d.as_nanos());
    }

    #[test]
    fn retry_after_round_trips_rounding_up(
        nanos in 0..=u64::try_from(MAX_RETRY_AFTER.as_nanos()).unwrap()
    ) {
        let d = Duration::from_nanos(nanos);
        let back = parse_retry_after(encode_retry_after(d).as_bytes()).unwrap();
        let RetryAfter::Delay(back) = back else {
            panic!("delay-seconds parsed as a date");
        };
        prop_assert!(back >= d);
        prop_assert!(back < d + Duration::from_secs(1));
        prop_assert_eq!(back.subsec_nanos(), 0);
    }

    #[test]
    fn retry_after_dates_give_bounded_delays(offset in 0u64..=200_000, now_secs in 0u64..=4_000_000_000) {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(now_secs);
        let at = now + Duration::from_secs(offset);
        let wire = httpdate::fmt_http_date(at);
        let parsed = parse_retry_after(wire.as_bytes()).unwrap();
        prop_assert_eq!(parsed, RetryAfter::At(at));
        prop_assert_eq!(parsed.delay_from(now), Duration::from_secs(offset).min(MAX_RETRY_AFTER));
        prop_assert_eq!(parsed.delay_from(at + Duration::from_secs(1)), Duration::ZERO);
    }

    #[test]
    fn pushback_round_trips_rounding_up(
        nanos in 0..=u64::try_from(MAX_RETRY_AFTER.as_nanos()).unwrap()
    ) {
        let d = Duration::from_nanos(nanos);
        let Pushback::After(back) = parse_pushback(encode_pushback(d).as_bytes()) else {
            panic!("an encoded pushback parsed as do-not-retry");
        };
        prop_assert!(back >= d);
        prop_assert!(back < d + Duration::from_millis(1));
        prop_assert_eq!(back.subsec_nanos() % 1_000_000, 0);
    }

    #[test]
    fn digit_parsers_agree_on_decimal_numbers(n in any::<u64>(), pad_l in "[ \t]{0,3}", pad_r in "[ \t]{0,3}") {
        let wire = format!("{pad_l}{n}{pad_r}");
        let bytes = wire.as_bytes();
        prop_assert_eq!(
            parse_request_timeout_ms(bytes),
            Ok(Duration::from_millis(n).min(MAX_TIMEOUT))
        );
        prop_assert_eq!(
            parse_pushback(bytes),
            Pushback::After(Duration::from_millis(n).min(MAX_RETRY_AFTER))
        );
        prop_assert_eq!(
            parse_retry_after(bytes),
            Some(RetryAfter::Delay(Duration::from_secs(n).min(MAX_RETRY_AFTER)))
        );
        prop_assert_eq!(
            parse_retry_attempt(bytes),
            u32::try_from(n).ok().filter(|&a| a >= 1)
        );
        prop_assert_eq!(parse_do_not_retry(Some(bytes)), n != 0);
        let negative = format!("-{n}");
        prop_assert_eq!(parse_pushback(negative.as_bytes()), Pushback::DoNotRetry);
        prop_assert_eq!(parse_retry_attempt(negative.as_bytes()), None);
        prop_assert_eq!(parse_retry_after(negative.as_bytes()), None);
        prop_assert_eq!(
            parse_request_timeout_ms(negative.as_bytes()),
            Err(TimeoutError::Malformed)
        );
    }
}
