use std::time::Duration;

use http::HeaderValue;

use super::MAX_RETRY_AFTER;
use super::ascii::{parse_digits_saturating, trim_ows};

/// The value a layer sends in `do-not-retry`.
pub const DO_NOT_RETRY_VALUE: HeaderValue = HeaderValue::from_static("1");
/// The value of `idempotent-replayed` on a replayed response.
pub const REPLAYED_VALUE: HeaderValue = HeaderValue::from_static("true");
/// The value of `retry-point` by which a caller makes itself the retry point.
pub const RETRY_POINT_CALLER: HeaderValue = HeaderValue::from_static("caller");

/// Reads a `do-not-retry` header: `None` (absent) is `false`; a present value is `true`
/// unless it is `0`, `false` or `?0` (surrounding whitespace ignored, `false` in any
/// case). Total: non-UTF-8 and empty values are `true`.
///
/// `0` and `?0` (the RFC 9651 false boolean) are matched exactly; anything else that
/// is present, including `no`, `00` or a value of only whitespace, means `true`.
///
/// ```
/// use retrysafe::wire::parse_do_not_retry;
/// assert!(!parse_do_not_retry(None));
/// assert!(parse_do_not_retry(Some(b"1")));
/// assert!(parse_do_not_retry(Some(b"")));
/// assert!(!parse_do_not_retry(Some(b" FALSE ")));
/// assert!(!parse_do_not_retry(Some(b"?0")));
/// ```
pub fn parse_do_not_retry(value: Option<&[u8]>) -> bool {
    let Some(value) = value else {
        return false;
    };
    let value = trim_ows(value);
    !(value == b"0" || value == b"?0" || value.eq_ignore_ascii_case(b"false"))
}

/// Reads a boolean flag such as `idempotent-replayed`: the same rule as
/// [`parse_do_not_retry`].
pub fn parse_flag(value: Option<&[u8]>) -> bool {
    parse_do_not_retry(value)
}

/// A parsed `retry-point` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryPoint {
    /// `caller`: the caller is the retry point; the callee must not retry.
    Caller,
}

/// Reads `retry-point`: `caller` (surrounding whitespace ignored, any case) gives
/// `Some(RetryPoint::Caller)`; any other value is ignored (`None`). Total.
///
/// ```
/// use retrysafe::wire::{parse_retry_point, RetryPoint};
/// assert_eq!(parse_retry_point(b" Caller "), Some(RetryPoint::Caller));
/// assert_eq!(parse_retry_point(b"callee"), None);
/// ```
pub fn parse_retry_point(value: &[u8]) -> Option<RetryPoint> {
    trim_ows(value)
        .eq_ignore_ascii_case(b"caller")
        .then_some(RetryPoint::Caller)
}

/// Reads `retry-attempt`: a 1-based attempt number, `1..=u32::MAX`, surrounding
/// whitespace allowed. `None` for 0, negative, overflowing or malformed values. Total.
///
/// ```
/// use retrysafe::wire::parse_retry_attempt;
/// assert_eq!(parse_retry_attempt(b" 2 "), Some(2));
/// assert_eq!(parse_retry_attempt(b"4294967295"), Some(u32::MAX));
/// assert_eq!(parse_retry_attempt(b"4294967296"), None);
/// assert_eq!(parse_retry_attempt(b"0"), None);
/// assert_eq!(parse_retry_attempt(b"+2"), None);
/// ```
pub fn parse_retry_attempt(value: &[u8]) -> Option<u32> {
    let attempt = parse_digits_saturating(trim_ows(value))?;
    u32::try_from(attempt).ok().filter(|&attempt| attempt >= 1)
}

/// Encodes an attempt number for `retry-attempt` (or `grpc-previous-rpc-attempts`).
///
/// ```
/// use retrysafe::wire::encode_retry_attempt;
/// assert_eq!(encode_retry_attempt(2), "2");
/// assert_eq!(encode_retry_attempt(10), "10");
/// ```
pub fn encode_retry_attempt(attempt: u32) -> HeaderValue {
    // The numbers retries have (a handful of attempts) need neither formatting nor an
    // allocation.
    const DIGITS: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
    match usize::try_from(attempt).ok().and_then(|i| DIGITS.get(i)) {
        Some(digit) => HeaderValue::from_static(digit),
        None => HeaderValue::from(attempt),
    }
}

/// A parsed `grpc-retry-pushback-ms` value (gRFC A6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Pushback {
    /// A non-negative integer: retry after exactly this delay (clamped to
    /// [`MAX_RETRY_AFTER`](super::MAX_RETRY_AFTER)).
    After(Duration),
    /// Negative or unparseable: do not retry.
    DoNotRetry,
}

/// Reads `grpc-retry-pushback-ms`. Total: anything but a non-negative integer is
/// [`Pushback::DoNotRetry`].
///
/// After trimming SP and HTAB, ASCII digits give [`Pushback::After`] that many
/// milliseconds, clamped to [`MAX_RETRY_AFTER`] (a number too large for any integer
/// type is clamped too). Everything else — empty, a sign (`-1`, `+1`), a fraction,
/// garbage, non-UTF-8 — is [`Pushback::DoNotRetry`].
///
/// ```
/// use std::time::Duration;
/// use retrysafe::wire::{parse_pushback, Pushback};
/// assert_eq!(parse_pushback(b"250"), Pushback::After(Duration::from_millis(250)));
/// assert_eq!(parse_pushback(b"-1"), Pushback::DoNotRetry);
/// assert_eq!(parse_pushback(b"soon"), Pushback::DoNotRetry);
/// ```
pub fn parse_pushback(value: &[u8]) -> Pushback {
    match parse_digits_saturating(trim_ows(value)) {
        Some(millis) => Pushback::After(Duration::from_millis(millis).min(MAX_RETRY_AFTER)),
        None => Pushback::DoNotRetry,
    }
}

/// Encodes a pushback delay in whole milliseconds, rounded up.
///
/// Not clamped: a delay above [`MAX_RETRY_AFTER`] is sent as it is (a parser clamps it).
///
/// ```
/// use std::time::Duration;
/// use retrysafe::wire::encode_pushback;
/// assert_eq!(encode_pushback(Duration::from_micros(1_001)), "2");
/// assert_eq!(encode_pushback(Duration::ZERO), "0");
/// ```
pub fn encode_pushback(delay: Duration) -> HeaderValue {
    let millis = delay
        .as_millis()
        .saturating_add(u128::from(!delay.subsec_nanos().is_multiple_of(1_000_000)));
    HeaderValue::from(u64::try_from(millis).unwrap_or(u64::MAX))
}
