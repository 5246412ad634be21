use std::cell::RefCell;
use std::fmt;
use std::thread::LocalKey;
use std::time::Duration;

use http::HeaderValue;

use super::ascii::{header_value, parse_digits_saturating, trim_ows};

/// The longest timeout a parser returns; larger inbound values are clamped to it, so
/// that adding one to an `Instant` can never overflow. 30 days.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(30 * 24 * 60 * 60);

/// Why a timeout header value was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TimeoutError {
    /// Empty value.
    Empty,
    /// Not of the header's grammar.
    Malformed,
}

impl fmt::Display for TimeoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TimeoutError::Empty => "timeout header is empty",
            TimeoutError::Malformed => "timeout header is malformed",
        })
    }
}

impl std::error::Error for TimeoutError {}

/// Parses `request-timeout-ms`: a non-negative integer of milliseconds, surrounding
/// whitespace allowed; values above [`MAX_TIMEOUT`] are clamped. Total.
///
/// After trimming SP and HTAB: nothing left is [`TimeoutError::Empty`]; anything but
/// ASCII digits (a sign, a fraction, an exponent, inner whitespace, non-UTF-8) is
/// [`TimeoutError::Malformed`]. A number too large for any integer type is clamped to
/// [`MAX_TIMEOUT`], not refused.
///
/// ```
/// use std::time::Duration;
/// use retrysafe::wire::{parse_request_timeout_ms, TimeoutError, MAX_TIMEOUT};
/// assert_eq!(parse_request_timeout_ms(b" 250 "), Ok(Duration::from_millis(250)));
/// assert_eq!(parse_request_timeout_ms(&[b'9'; 40]), Ok(MAX_TIMEOUT));
/// assert_eq!(parse_request_timeout_ms(b""), Err(TimeoutError::Empty));
/// assert_eq!(parse_request_timeout_ms(b"-5"), Err(TimeoutError::Malformed));
/// ```
pub fn parse_request_timeout_ms(value: &[u8]) -> Result<Duration, TimeoutError> {
    let value = trim_ows(value);
    if value.is_empty() {
        return Err(TimeoutError::Empty);
    }
    let millis = parse_digits_saturating(value).ok_or(TimeoutError::Malformed)?;
    Ok(Duration::from_millis(millis).min(MAX_TIMEOUT))
}

/// Encodes the time left as `request-timeout-ms`, rounded *down* to whole milliseconds.
///
/// Values above [`MAX_TIMEOUT`] are sent as [`MAX_TIMEOUT`], the most any parser here
/// honours; clamping only ever shortens, so the caller is never told it has more time.
///
/// ```
/// use std::time::Duration;
/// use retrysafe::wire::encode_request_timeout_ms;
/// assert_eq!(encode_request_timeout_ms(Duration::from_micros(1_999)), "1");
/// assert_eq!(encode_request_timeout_ms(Duration::ZERO), "0");
/// ```
pub fn encode_request_timeout_ms(left: Duration) -> HeaderValue {
    let millis = u64::try_from(left.min(MAX_TIMEOUT).as_millis()).unwrap_or(u64::MAX);
    memoized(&LAST_MS, millis, HeaderValue::from)
}

/// The last value of each encoder on this thread, and what it encoded.
type Last<K> = RefCell<Option<(K, HeaderValue)>>;

std::thread_local! {
    static LAST_MS: Last<u64> = const { RefCell::new(None) };
    static LAST_GRPC: Last<u128> = const { RefCell::new(None) };
}

/// `encode(key)`, or a clone of it when it is the last key this thread encoded with
/// `last`. A deadline a client sets per call gives each call's first attempt the very
/// same timeout (it is read from the clock reading the deadline was made from), so the
/// header is most often the last one again; and a clone is a reference count where a
/// fresh value is a formatting and an allocation (about 250 instructions, and a `free`
/// when the request is dropped).
fn memoized<K: Copy + Eq>(
    last: &'static LocalKey<Last<K>>,
    key: K,
    encode: fn(K) -> HeaderValue,
) -> HeaderValue {
    last.try_with(|last| {
        let mut last = last.try_borrow_mut().ok()?;
        if let Some((k, value)) = &*last
            && *k == key
        {
            return Some(value.clone());
        }
        let value = encode(key);
        *last = Some((key, value.clone()));
        Some(value)
    })
    .ok()
    .flatten()
    .unwrap_or_else(|| encode(key))
}

/// Parses `grpc-timeout`: 1 to 8 ASCII digits and a unit (`H M S m u n`); values above
/// [`MAX_TIMEOUT`] are clamped. Total.
///
/// The grammar is that of the gRPC over HTTP/2 protocol: `TimeoutValue TimeoutUnit`,
/// where the value is 1 to 8 ASCII digits (`0` included) and the unit one of `H`
/// (hours), `M` (minutes), `S` (seconds), `m` (milliseconds), `u` (microseconds) and
/// `n` (nanoseconds). Surrounding SP and HTAB are ignored; nothing left is
/// [`TimeoutError::Empty`]. Anything else — more than 8 digits, no digits, a missing or
/// unknown unit, a sign, a fraction, inner whitespace, non-UTF-8 — is
/// [`TimeoutError::Malformed`].
///
/// ```
/// use std::time::Duration;
/// use retrysafe::wire::{parse_grpc_timeout, TimeoutError, MAX_TIMEOUT};
/// assert_eq!(parse_grpc_timeout(b"100m"), Ok(Duration::from_millis(100)));
/// assert_eq!(parse_grpc_timeout(b"99999999H"), Ok(MAX_TIMEOUT));
/// assert_eq!(parse_grpc_timeout(b"123456789n"), Err(TimeoutError::Malformed));
/// assert_eq!(parse_grpc_timeout(b"10"), Err(TimeoutError::Malformed));
/// ```
pub fn parse_grpc_timeout(value: &[u8]) -> Result<Duration, TimeoutError> {
    let value = trim_ows(value);
    let (unit, digits) = value.split_last().ok_or(TimeoutError::Empty)?;
    if digits.len() > GRPC_MAX_DIGITS {
        return Err(TimeoutError::Malformed);
    }
    let amount = parse_digits_saturating(digits).ok_or(TimeoutError::Malformed)?;
    let timeout = match unit {
        b'H' => Duration::from_secs(amount.saturating_mul(60 * 60)),
        b'M' => Duration::from_secs(amount.saturating_mul(60)),
        b'S' => Duration::from_secs(amount),
        b'm' => Duration::from_millis(amount),
        b'u' => Duration::from_micros(amount),
        b'n' => Duration::from_nanos(amount),
        _ => return Err(TimeoutError::Malformed),
    };
    Ok(timeout.min(MAX_TIMEOUT))
}

/// The most digits a `grpc-timeout` value may have.
const GRPC_MAX_DIGITS: usize = 8;

/// The largest `grpc-timeout` value: 8 digits.
const GRPC_MAX_AMOUNT: u128 = 99_999_999;

/// The `grpc-timeout` units from finest to coarsest, with their length in nanoseconds.
const GRPC_UNITS: [(char, u128); 6] = [
    ('n', 1),
    ('u', 1_000),
    ('m', 1_000_000),
    ('S', 1_000_000_000),
    ('M', 60 * 1_000_000_000),
    ('H', GRPC_HOUR),
];

/// An hour in nanoseconds, the coarsest `grpc-timeout` unit.
const GRPC_HOUR: u128 = 60 * 60 * 1_000_000_000;

/// What a reader of the timeout header written for `left` gets back — the parse of
/// [`encode_request_timeout_ms`] or [`encode_grpc_timeout`] — without writing or parsing
/// it: whole milliseconds, or the `grpc-timeout` unit's multiple, clamped to
/// [`MAX_TIMEOUT`].
#[inline]
pub(crate) fn timeout_as_read(left: Duration, grpc: bool) -> Duration {
    if !grpc {
        let left = left.min(MAX_TIMEOUT);
        return Duration::new(left.as_secs(), left.subsec_millis() * 1_000_000);
    }
    let nanos = left.as_nanos();
    let read = GRPC_UNITS
        .iter()
        .find_map(|&(_, unit)| {
            let amount = nanos / unit;
            (amount <= GRPC_MAX_AMOUNT).then_some(amount * unit)
        })
        .unwrap_or(GRPC_MAX_AMOUNT * GRPC_HOUR);
    let secs = u64::try_from(read / 1_000_000_000).unwrap_or(u64::MAX);
    let subsec = u32::try_from(read % 1_000_000_000).unwrap_or(0);
    Duration::new(secs, subsec).min(MAX_TIMEOUT)
}

/// Encodes the time left as `grpc-timeout` in the finest unit that fits in 8 digits,
/// rounding *down*: the encoded value never exceeds `left`.
///
/// The unit is the finest of `n`, `u`, `m`, `S`, `M`, `H` in which
/// `floor(left / unit)` has at most 8 digits. Zero is `0n`; a duration of
/// 99 999 999 hours or more (over 11 000 years) is sent as `99999999H`.
///
/// ```
/// use std::time::Duration;
/// use retrysafe::wire::encode_grpc_timeout;
/// assert_eq!(encode_grpc_timeout(Duration::from_nanos(99_999_999)), "99999999n");
/// assert_eq!(encode_grpc_timeout(Duration::from_nanos(100_000_001)), "100000u");
/// assert_eq!(encode_grpc_timeout(Duration::from_secs(30)), "30000000u");
/// assert_eq!(encode_grpc_timeout(Duration::ZERO), "0n");
/// ```
pub fn encode_grpc_timeout(left: Duration) -> HeaderValue {
    memoized(&LAST_GRPC, left.as_nanos(), grpc_timeout_of)
}

/// [`encode_grpc_timeout`] of a duration of `nanos` nanoseconds.
fn grpc_timeout_of(nanos: u128) -> HeaderValue {
    let encoded = GRPC_UNITS.iter().find_map(|&(unit, unit_nanos)| {
        let amount = nanos / unit_nanos;
        (amount <= GRPC_MAX_AMOUNT).then(|| format!("{amount}{unit}"))
    });
    match encoded {
        Some(text) => header_value(&text),
        None => HeaderValue::from_static("99999999H"),
    }
}
