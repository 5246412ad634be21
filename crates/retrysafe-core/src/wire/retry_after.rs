use std::time::{Duration, SystemTime};

use http::HeaderValue;

use super::ascii::{parse_digits_saturating, trim_ows};

/// The largest delay a `retry-after` value is taken to ask for; larger values (and
/// dates further ahead) are clamped to it. 24 hours.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 60 * 60);

/// A parsed `retry-after` value (RFC 9110 §10.2.3): a minimum delay, never shorter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryAfter {
    /// `delay-seconds`, clamped to [`MAX_RETRY_AFTER`].
    Delay(Duration),
    /// An HTTP-date (IMF-fixdate, or the obsolete RFC 850 and asctime forms).
    At(SystemTime),
}

impl RetryAfter {
    /// The delay from `now`: zero for a date in the past, at most [`MAX_RETRY_AFTER`].
    ///
    /// A [`RetryAfter::Delay`] ignores `now` (it is relative) and is clamped too.
    ///
    /// ```
    /// use std::time::{Duration, SystemTime};
    /// use retrysafe::wire::RetryAfter;
    /// let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
    /// let at = RetryAfter::At(now + Duration::from_secs(30));
    /// assert_eq!(at.delay_from(now), Duration::from_secs(30));
    /// assert_eq!(RetryAfter::At(SystemTime::UNIX_EPOCH).delay_from(now), Duration::ZERO);
    /// ```
    pub fn delay_from(self, now: SystemTime) -> Duration {
        let delay = match self {
            RetryAfter::Delay(delay) => delay,
            RetryAfter::At(at) => at.duration_since(now).unwrap_or(Duration::ZERO),
        };
        delay.min(MAX_RETRY_AFTER)
    }
}

/// Parses a `retry-after` value. `None` for anything that is neither delay-seconds nor
/// an HTTP-date (negative numbers, fractions, garbage, non-UTF-8). Total.
///
/// Surrounding SP and HTAB are ignored. Delay-seconds (`1*DIGIT`) give
/// [`RetryAfter::Delay`], clamped to [`MAX_RETRY_AFTER`] (a number too large for any
/// integer type is clamped too, not refused). An HTTP-date in any of the three forms of
/// RFC 9110 gives [`RetryAfter::At`], unclamped; [`RetryAfter::delay_from`] clamps it.
///
/// ```
/// use std::time::Duration;
/// use retrysafe::wire::{parse_retry_after, RetryAfter, MAX_RETRY_AFTER};
/// assert_eq!(parse_retry_after(b" 120 "), Some(RetryAfter::Delay(Duration::from_secs(120))));
/// assert_eq!(parse_retry_after(b"99999999999"), Some(RetryAfter::Delay(MAX_RETRY_AFTER)));
/// assert!(matches!(
///     parse_retry_after(b"Sun, 06 Nov 1994 08:49:37 GMT"),
///     Some(RetryAfter::At(_))
/// ));
/// assert_eq!(parse_retry_after(b"-1"), None);
/// assert_eq!(parse_retry_after(b"1.5"), None);
/// ```
pub fn parse_retry_after(value: &[u8]) -> Option<RetryAfter> {
    let value = trim_ows(value);
    if let Some(secs) = parse_digits_saturating(value) {
        return Some(RetryAfter::Delay(
            Duration::from_secs(secs).min(MAX_RETRY_AFTER),
        ));
    }
    // The longest HTTP-date (an asctime or RFC 850 date) is well under 64 bytes;
    // refusing longer input first keeps the date parser's work bounded.
    if value.len() > MAX_HTTP_DATE_LEN {
        return None;
    }
    let text = std::str::from_utf8(value).ok()?;
    httpdate::parse_http_date(text).ok().map(RetryAfter::At)
}

/// Longer than any HTTP-date form (`Sunday, 06-Nov-94 08:49:37 GMT` is 30 bytes).
const MAX_HTTP_DATE_LEN: usize = 64;

/// Encodes a delay as delay-seconds, rounded *up* (a minimum delay is never shortened).
///
/// Delays above [`MAX_RETRY_AFTER`] are sent as [`MAX_RETRY_AFTER`], the most any
/// parser here honours.
///
/// ```
/// use std::time::Duration;
/// use retrysafe::wire::encode_retry_after;
/// assert_eq!(encode_retry_after(Duration::from_millis(1_200)), "2");
/// assert_eq!(encode_retry_after(Duration::from_secs(3)), "3");
/// assert_eq!(encode_retry_after(Duration::ZERO), "0");
/// ```
pub fn encode_retry_after(delay: Duration) -> HeaderValue {
    let delay = delay.min(MAX_RETRY_AFTER);
    let secs = delay
        .as_secs()
        .saturating_add(u64::from(delay.subsec_nanos() > 0));
    HeaderValue::from(secs)
}
