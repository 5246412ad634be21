//! What a store keeps about the request of a claim.

use std::fmt;
use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::Method;

use super::{DecodeError, Scope};
use crate::wire::IdempotencyKey;

const INFO_VERSION: u8 = 1;

/// What a store keeps about the request that claimed a record, so that a resolver, the
/// reconcile hook and an operator can tell which request it was: the scope (its hash),
/// the principal's label if it was given one explicitly
/// ([`Principal::with_label`](super::Principal::with_label)), the method, the path
/// (at most [`MAX_PATH`](Self::MAX_PATH) bytes), and the raw idempotency key only when
/// the layer was built to store keys for resolution (stores hold hashes otherwise).
///
/// ```
/// use http::Method;
/// use retrysafe_core::idempotency::{Principal, RequestInfo, Scope};
/// use retrysafe::wire::IdempotencyKey;
///
/// let scope = Scope::from(&Principal::new("alice"));
/// let info = RequestInfo::new(scope, Method::POST, "/payments")
///     .with_key(IdempotencyKey::new("order-7").unwrap());
/// let again = RequestInfo::decode(info.encode()).unwrap();
/// assert_eq!(again, info);
/// assert_eq!(again.key.unwrap().as_str(), "order-7");
/// ```
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RequestInfo {
    /// The record's scope.
    pub scope: Scope,
    /// The principal's explicit label.
    pub label: Option<Arc<str>>,
    /// The request method.
    pub method: Method,
    /// The request path, cut to at most [`RequestInfo::MAX_PATH`] bytes.
    pub path: String,
    /// The idempotency key, only when the layer stores keys for resolution.
    pub key: Option<IdempotencyKey>,
}

impl RequestInfo {
    /// The longest path kept, in bytes.
    #[doc(hidden)]
    pub const MAX_PATH: usize = 256;

    /// The request `method path` in `scope`, without label or key.
    pub fn new(scope: Scope, method: Method, path: &str) -> Self {
        RequestInfo {
            scope,
            label: None,
            method,
            path: cut(path, Self::MAX_PATH).to_owned(),
            key: None,
        }
    }

    /// The same with the principal's label.
    #[must_use]
    pub fn with_label(mut self, label: Option<Arc<str>>) -> Self {
        self.label = label.map(|l| Arc::from(cut(&l, u16::MAX.into())));
        self
    }

    /// The same with the raw idempotency key.
    #[must_use]
    pub fn with_key(mut self, key: IdempotencyKey) -> Self {
        self.key = Some(key);
        self
    }

    /// Encodes the information: a version byte, the scope hash, then the method, path,
    /// label and key, each with a length.
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(64 + self.path.len());
        b.put_u8(INFO_VERSION);
        b.put_slice(self.scope.as_bytes());
        put_short(&mut b, self.method.as_str().as_bytes());
        put_short(&mut b, self.path.as_bytes());
        put_opt(&mut b, self.label.as_deref());
        put_opt(&mut b, self.key.as_ref().map(IdempotencyKey::as_str));
        b.freeze()
    }

    /// Decodes what [`encode`](Self::encode) wrote. Total: any bytes give the
    /// information or an error, never a panic. Bytes after the known fields are ignored
    /// (a later release may append fields).
    pub fn decode(mut b: Bytes) -> Result<Self, DecodeError> {
        if take(&mut b, 1)?.first() != Some(&INFO_VERSION) {
            return Err(DecodeError::Invalid("request info version"));
        }
        let mut scope = [0u8; 32];
        scope.copy_from_slice(&take(&mut b, 32)?);
        let method =
            Method::from_bytes(&take_short(&mut b)?).map_err(|_| DecodeError::Invalid("method"))?;
        let path = text(&take_short(&mut b)?)?;
        let label = take_opt(&mut b)?.map(|l| text(&l)).transpose()?;
        let key = take_opt(&mut b)?
            .map(|k| IdempotencyKey::new(&text(&k)?).map_err(|_| DecodeError::Invalid("key")))
            .transpose()?;
        Ok(RequestInfo {
            scope: Scope::from_hash(scope),
            label: label.map(Arc::from),
            method,
            path: cut(&path, Self::MAX_PATH).to_owned(),
            key,
        })
    }
}

impl fmt::Debug for RequestInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestInfo")
            .field("scope", &self.scope)
            .field("label", &self.label)
            .field("method", &self.method)
            .field("path", &self.path)
            .field("key", &self.key.as_ref().map(|_| "…"))
            .finish()
    }
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
pub(crate) fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.get(..end).unwrap_or_default()
}

fn put_short(b: &mut BytesMut, v: &[u8]) {
    let len = v.len().min(u16::MAX.into());
    b.put_u16(u16::try_from(len).unwrap_or(u16::MAX));
    b.put_slice(v.get(..len).unwrap_or_default());
}

fn put_opt(b: &mut BytesMut, v: Option<&str>) {
    match v {
        Some(v) => {
            b.put_u8(1);
            put_short(b, v.as_bytes());
        }
        None => b.put_u8(0),
    }
}

fn take(b: &mut Bytes, n: usize) -> Result<Bytes, DecodeError> {
    if b.remaining() < n {
        return Err(DecodeError::Truncated);
    }
    Ok(b.split_to(n))
}

fn take_short(b: &mut Bytes) -> Result<Bytes, DecodeError> {
    let len = take(b, 2)?;
    let len = u16::from_be_bytes([
        len.first().copied().unwrap_or(0),
        len.get(1).copied().unwrap_or(0),
    ]);
    take(b, len.into())
}

fn take_opt(b: &mut Bytes) -> Result<Option<Bytes>, DecodeError> {
    match take(b, 1)?.first() {
        Some(0) => Ok(None),
        Some(1) => Ok(Some(take_short(b)?)),
        _ => Err(DecodeError::Invalid("optional field")),
    }
}

fn text(b: &Bytes) -> Result<String, DecodeError> {
    std::str::from_utf8(b)
        .map(str::to_owned)
        .map_err(|_| DecodeError::Invalid("text"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::idempotency::Principal;

    #[test]
    fn decode_is_total_on_prefixes_and_garbage() {
        let info = RequestInfo::new(Scope::new("s"), Method::PATCH, "/a/é")
            .with_label(Some(Arc::from("Acme")))
            .with_key(IdempotencyKey::new("k-1").unwrap());
        let bytes = info.encode();
        assert_eq!(RequestInfo::decode(bytes.clone()).unwrap(), info);
        for n in 0..bytes.len() {
            assert!(RequestInfo::decode(bytes.slice(..n)).is_err(), "prefix {n}");
        }
        for seed in 0u8..=255 {
            let junk: Vec<u8> = (0..80u8)
                .map(|i| i.wrapping_mul(seed).wrapping_add(seed))
                .collect();
            let _ = RequestInfo::decode(Bytes::from(junk));
        }
    }

    #[test]
    fn long_paths_are_cut_on_a_character_boundary() {
        let path = "é".repeat(200);
        let info = RequestInfo::new(Scope::from(&Principal::new("p")), Method::POST, &path);
        assert!(info.path.len() <= RequestInfo::MAX_PATH);
        assert!(path.starts_with(&info.path));
    }
}
