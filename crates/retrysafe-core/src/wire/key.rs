use std::fmt;

use http::HeaderValue;

use super::ascii::{header_value, trim_ows};

/// The longest idempotency key accepted, in characters (after unquoting).
pub const MAX_KEY_LEN: usize = 255;

/// The longest (trimmed) header value that can still carry a valid key: an sf-string
/// whose every character is escaped, plus its two quotes.
const MAX_SF_STRING_LEN: usize = MAX_KEY_LEN * 2 + 2;

/// A character of a bare key: visible ASCII (VCHAR).
fn is_bare_char(b: u8) -> bool {
    (0x21..=0x7e).contains(&b)
}

/// A character of an sf-string's content: visible ASCII or SP.
fn is_sf_char(b: u8) -> bool {
    (0x20..=0x7e).contains(&b)
}

/// Unquotes an RFC 9651 sf-string: `"`, then characters of 0x20–0x7E where `"` and
/// `\` appear only escaped by `\`, then `"`, and nothing after it.
///
/// `None` if `value` is not exactly one valid sf-string. The content may still be
/// empty or too long; the caller checks that.
fn unquote_sf_string(value: &[u8]) -> Option<Vec<u8>> {
    let inner = value.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
    let mut content = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter().copied();
    while let Some(b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(escaped @ (b'"' | b'\\')) => content.push(escaped),
                _ => return None,
            },
            b'"' => return None,
            b if is_sf_char(b) => content.push(b),
            _ => return None,
        }
    }
    Some(content)
}

/// A validated idempotency key: 1 to [`MAX_KEY_LEN`] printable ASCII characters.
///
/// Both wire forms are accepted and name the same key: an RFC 9651 sf-string
/// (`"abc"`: unescaped, then 1 to 255 characters of 0x20–0x7E) and a bare value as
/// Stripe sends it (`8e03-…`: surrounding whitespace trimmed, then 1 to 255 characters of
/// 0x21–0x7E, any first character). A value that starts with `"` but is not a valid
/// sf-string is read as a bare value.
///
/// ```
/// use retrysafe::wire::IdempotencyKey;
/// let quoted = IdempotencyKey::parse(br#""8e03-978e""#).unwrap();
/// let bare = IdempotencyKey::parse(b"  8e03-978e ").unwrap();
/// assert_eq!(quoted, bare);
/// assert_eq!(bare.as_str(), "8e03-978e");
/// assert!(IdempotencyKey::parse(b"").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(Box<str>);

/// Why a header value is not an idempotency key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is empty (after trimming or unquoting).
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] characters.
    TooLong,
    /// The key holds a byte that is not printable ASCII (or not allowed in its form).
    NotPrintable,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyError::Empty => "idempotency key is empty",
            KeyError::TooLong => "idempotency key is longer than 255 characters",
            KeyError::NotPrintable => {
                "idempotency key holds a character that is not printable ascii"
            }
        })
    }
}

impl std::error::Error for KeyError {}

impl IdempotencyKey {
    /// Parses a header value (either wire form). Total: never panics.
    ///
    /// Surrounding SP and HTAB are trimmed first. A value that then starts and ends with
    /// `"` and is a valid sf-string (only `\"` and `\\` escapes, no unescaped `"`
    /// inside, every character 0x20–0x7E) is unquoted; any other value is read as a
    /// bare key (so `"abc` is the bare key `"abc`). The checks run in this order, and
    /// the first that fails gives the error:
    ///
    /// 1. [`KeyError::Empty`]: nothing is left after trimming, or the sf-string is `""`;
    /// 2. [`KeyError::TooLong`]: the key is over [`MAX_KEY_LEN`] characters (bytes, for
    ///    input that is not ASCII). This is decided before any byte is inspected for
    ///    printability, so a huge value costs at most a bounded scan;
    /// 3. [`KeyError::NotPrintable`]: a bare key holds a byte outside 0x21–0x7E
    ///    (a space or tab inside, a control character, non-ASCII or non-UTF-8 bytes).
    ///
    /// ```
    /// use retrysafe::wire::{IdempotencyKey, KeyError};
    /// assert_eq!(IdempotencyKey::parse(br#""a \"b\"""#).unwrap().as_str(), r#"a "b""#);
    /// assert_eq!(IdempotencyKey::parse(br#""abc"#).unwrap().as_str(), r#""abc"#);
    /// assert_eq!(IdempotencyKey::parse(b" \t ").unwrap_err(), KeyError::Empty);
    /// assert_eq!(IdempotencyKey::parse(&[b'k'; 256]).unwrap_err(), KeyError::TooLong);
    /// assert_eq!(IdempotencyKey::parse(b"a b").unwrap_err(), KeyError::NotPrintable);
    /// ```
    pub fn parse(value: &[u8]) -> Result<Self, KeyError> {
        let value = trim_ows(value);
        if value.is_empty() {
            return Err(KeyError::Empty);
        }
        // No value this long can carry a key of at most MAX_KEY_LEN characters in
        // either form (the sf-string form needs at most two bytes per character plus
        // the two quotes), so stop before scanning it.
        if value.len() > MAX_SF_STRING_LEN {
            return Err(KeyError::TooLong);
        }
        if let Some(content) = unquote_sf_string(value) {
            return Self::from_content(&content);
        }
        if value.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong);
        }
        if !value.iter().all(|b| is_bare_char(*b)) {
            return Err(KeyError::NotPrintable);
        }
        // All bytes are ASCII here, so this conversion cannot fail.
        std::str::from_utf8(value)
            .map(|key| IdempotencyKey(key.into()))
            .map_err(|_| KeyError::NotPrintable)
    }

    /// Parses a `HeaderValue`; see [`IdempotencyKey::parse`].
    pub fn from_header(value: &HeaderValue) -> Result<Self, KeyError> {
        Self::parse(value.as_bytes())
    }

    /// Builds a key from a string that must already be a valid key (used for
    /// generated keys). Same rules as the sf-string form's content.
    ///
    /// Nothing is trimmed or unquoted: `key` is the key itself, 1 to [`MAX_KEY_LEN`]
    /// characters of 0x20–0x7E. Errors, checked in this order: [`KeyError::Empty`],
    /// [`KeyError::TooLong`] (over [`MAX_KEY_LEN`] bytes), [`KeyError::NotPrintable`].
    ///
    /// ```
    /// use retrysafe::wire::{IdempotencyKey, KeyError};
    /// assert_eq!(IdempotencyKey::new(" spaced key ").unwrap().as_str(), " spaced key ");
    /// assert_eq!(IdempotencyKey::new("tab\there").unwrap_err(), KeyError::NotPrintable);
    /// ```
    pub fn new(key: &str) -> Result<Self, KeyError> {
        Self::from_content(key.as_bytes())
    }

    /// Validates the content of a key (the sf-string rule) and builds it.
    fn from_content(content: &[u8]) -> Result<Self, KeyError> {
        if content.is_empty() {
            return Err(KeyError::Empty);
        }
        if content.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong);
        }
        if !content.iter().all(|b| is_sf_char(*b)) {
            return Err(KeyError::NotPrintable);
        }
        // All bytes are ASCII here, so this conversion cannot fail.
        std::str::from_utf8(content)
            .map(|key| IdempotencyKey(key.into()))
            .map_err(|_| KeyError::NotPrintable)
    }

    /// The key, unquoted.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Encodes the key as a header value: bare when that form can carry it, else an
    /// sf-string. `parse(to_header_value(k)) == k`.
    ///
    /// The bare form is used when every character is 0x21–0x7E and the key does not
    /// start with `"`; otherwise the key is sent as an sf-string with `"` and `\`
    /// escaped.
    ///
    /// ```
    /// use retrysafe::wire::IdempotencyKey;
    /// let bare = IdempotencyKey::new("8e03-978e").unwrap();
    /// assert_eq!(bare.to_header_value(), "8e03-978e");
    /// let spaced = IdempotencyKey::new(r#"a "b""#).unwrap();
    /// assert_eq!(spaced.to_header_value(), r#""a \"b\"""#);
    /// assert_eq!(IdempotencyKey::from_header(&spaced.to_header_value()).unwrap(), spaced);
    /// ```
    pub fn to_header_value(&self) -> HeaderValue {
        let key = self.as_str();
        let bare_ok = !key.starts_with('"') && !key.is_empty() && key.bytes().all(is_bare_char);
        if bare_ok {
            return header_value(key);
        }
        let mut quoted = String::with_capacity(key.len().saturating_mul(2).saturating_add(2));
        quoted.push('"');
        for c in key.chars() {
            if c == '"' || c == '\\' {
                quoted.push('\\');
            }
            quoted.push(c);
        }
        quoted.push('"');
        header_value(&quoted)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey")
            .field(&self.as_str())
            .finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
