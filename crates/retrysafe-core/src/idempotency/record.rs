use std::fmt;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use super::{Fingerprint, Token};

/// The version byte that opens every encoded record.
#[doc(hidden)]
pub const RECORD_VERSION: u8 = 1;

const TAG_IN_PROGRESS: u8 = 1;
const TAG_COMPLETED: u8 = 2;
const TAG_NOT_STORED: u8 = 3;
const TAG_UNKNOWN: u8 = 4;
const TAG_RESOLVING: u8 = 5;
const TAG_EVICTED: u8 = 6;

/// Whether the holder of a claim has passed the point after which its effect may have
/// happened. Decides what a lease expiry means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CommitPoint {
    /// The handler does not declare a commit point: an expired lease becomes
    /// `outcome_unknown`.
    Undeclared,
    /// The handler declares its commit point and has not reached it yet: an expired
    /// lease may be taken over by the next copy, which runs the handler.
    Before,
    /// The handler passed its commit point: an expired lease becomes `outcome_unknown`.
    Passed,
}

impl CommitPoint {
    /// Whether an expired lease in this state may be taken over (nothing happened yet).
    #[doc(hidden)]
    pub fn allows_takeover(self) -> bool {
        self == CommitPoint::Before
    }

    fn to_byte(self) -> u8 {
        match self {
            CommitPoint::Undeclared => 0,
            CommitPoint::Before => 1,
            CommitPoint::Passed => 2,
        }
    }

    fn from_byte(b: u8) -> Result<Self, DecodeError> {
        match b {
            0 => Ok(CommitPoint::Undeclared),
            1 => Ok(CommitPoint::Before),
            2 => Ok(CommitPoint::Passed),
            _ => Err(DecodeError::Invalid("commit point")),
        }
    }
}

/// A claim being executed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InProgress {
    /// End of the lease, in milliseconds of the store's own clock (for example Redis
    /// `TIME` or PostgreSQL `clock_timestamp()`; the MemoryStore uses tokio time since its
    /// creation).
    pub lease_until_ms: u64,
    /// The holder's token.
    pub token: Token,
    /// The fingerprint of the request that claimed.
    pub fingerprint: Fingerprint,
    /// Whether the holder passed its commit point.
    pub commit_point: CommitPoint,
}

/// A finished call whose answer is kept for the retention.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Completed {
    /// The fingerprint of the request that ran.
    pub fingerprint: Fingerprint,
    /// The stored response, or `None` when it was too large to store (later copies get
    /// a `response-not-stored` problem; the handler never runs again).
    pub response: Option<StoredResponse>,
}

impl Completed {
    /// The encoded form of `Record::Completed` of this completion, written from a
    /// reference (a store that keeps the encoded record need not clone the response to
    /// encode it).
    pub(crate) fn encode_record(&self) -> Bytes {
        let mut buf = BytesMut::with_capacity(
            2 + 32
                + self
                    .response
                    .as_ref()
                    .map_or(0, StoredResponse::encoded_len),
        );
        buf.put_u8(RECORD_VERSION);
        self.encode_into(&mut buf);
        buf.freeze()
    }

    fn encode_into(&self, buf: &mut BytesMut) {
        match &self.response {
            Some(resp) => {
                buf.put_u8(TAG_COMPLETED);
                buf.put_slice(self.fingerprint.as_bytes());
                resp.encode_into(buf);
            }
            None => {
                buf.put_u8(TAG_NOT_STORED);
                buf.put_slice(self.fingerprint.as_bytes());
            }
        }
    }
}

/// A call whose outcome cannot be known: replayed as a stable problem, never re-run.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutcomeUnknown {
    /// The fingerprint of the request that ran.
    pub fingerprint: Fingerprint,
}

impl InProgress {
    /// A claim held by `token` until `lease_until_ms` (of the store's clock).
    pub fn new(
        lease_until_ms: u64,
        token: Token,
        fingerprint: Fingerprint,
        commit_point: CommitPoint,
    ) -> Self {
        InProgress {
            lease_until_ms,
            token,
            fingerprint,
            commit_point,
        }
    }
}

impl Completed {
    /// A finished call with its stored response (`None`: too large to store).
    pub fn new(fingerprint: Fingerprint, response: Option<StoredResponse>) -> Self {
        Completed {
            fingerprint,
            response,
        }
    }
}

impl OutcomeUnknown {
    /// A call of the request with `fingerprint` whose outcome cannot be known.
    pub fn new(fingerprint: Fingerprint) -> Self {
        OutcomeUnknown { fingerprint }
    }
}

/// A record that a reconciler adopted and is resolving (asking the downstream whether
/// the effect happened): copies are told to come back later (503 `outcome-pending`).
/// Stores report this state to readers; the record's prior state is kept underneath,
/// and comes back if the adoption lapses.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Resolving {
    /// The fingerprint of the request that created the record.
    pub fingerprint: Fingerprint,
    /// End of the adoption, in milliseconds of the store's own clock.
    pub until_ms: u64,
}

impl Resolving {
    /// A record of the request with `fingerprint`, adopted until `until_ms`.
    pub fn new(fingerprint: Fingerprint, until_ms: u64) -> Self {
        Resolving {
            fingerprint,
            until_ms,
        }
    }
}

/// The trace a store keeps of a completed record whose response it had to drop before
/// the retention ended (a `MemoryStore` over its byte budget): the key ran, and it is
/// never run again while the trace lasts; copies get 409 `response-evicted`. The trace
/// keeps no fingerprint, so a copy with a different body is told the same.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Evicted {}

impl Evicted {
    /// The trace of an evicted record.
    pub fn new() -> Self {
        Evicted {}
    }
}

/// The state of one record. A released record is simply absent.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Record {
    /// Claimed, running.
    InProgress(InProgress),
    /// Finished, answer stored (or too large to store).
    Completed(Completed),
    /// Outcome unknown.
    OutcomeUnknown(OutcomeUnknown),
    /// Adopted by a reconciler, being resolved.
    Resolving(Resolving),
    /// Completed, but only a trace of it is left.
    Evicted(Evicted),
}

/// Why bytes are not a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeError {
    /// The version byte is not one this release reads.
    UnknownVersion(u8),
    /// The bytes end early.
    Truncated,
    /// Bytes are left over after the record.
    TrailingBytes,
    /// A field holds an impossible value (named).
    Invalid(&'static str),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::UnknownVersion(v) => write!(f, "unknown record version {v}"),
            DecodeError::Truncated => f.write_str("record is truncated"),
            DecodeError::TrailingBytes => f.write_str("record has trailing bytes"),
            DecodeError::Invalid(what) => write!(f, "record has an invalid {what}"),
        }
    }
}

impl std::error::Error for DecodeError {}

impl Record {
    /// The fingerprint of the request that created the record.
    pub fn fingerprint(&self) -> &Fingerprint {
        match self {
            Record::InProgress(r) => &r.fingerprint,
            Record::Completed(r) => &r.fingerprint,
            Record::OutcomeUnknown(r) => &r.fingerprint,
            Record::Resolving(r) => &r.fingerprint,
            Record::Evicted(_) => &Fingerprint::NONE,
        }
    }

    /// The number of bytes [`Record::encode`] writes.
    #[doc(hidden)]
    pub fn encoded_len(&self) -> usize {
        2 + 32
            + match self {
                Record::InProgress(_) => 16 + 8 + 1,
                Record::Resolving(_) => 8,
                Record::Completed(Completed {
                    response: Some(r), ..
                }) => r.encoded_len(),
                Record::Completed(Completed { response: None, .. })
                | Record::OutcomeUnknown(_)
                | Record::Evicted(_) => 0,
            }
    }

    /// Encodes the record: a version byte, a state tag, the fingerprint and the state's
    /// fields, lengths big-endian.
    pub fn encode(&self) -> Bytes {
        let mut buf = BytesMut::with_capacity(self.encoded_len());
        buf.put_u8(RECORD_VERSION);
        match self {
            Record::InProgress(r) => {
                buf.put_u8(TAG_IN_PROGRESS);
                buf.put_slice(r.fingerprint.as_bytes());
                buf.put_slice(&r.token.to_bytes());
                buf.put_u64(r.lease_until_ms);
                buf.put_u8(r.commit_point.to_byte());
            }
            Record::Completed(done) => done.encode_into(&mut buf),
            Record::OutcomeUnknown(r) => {
                buf.put_u8(TAG_UNKNOWN);
                buf.put_slice(r.fingerprint.as_bytes());
            }
            Record::Resolving(r) => {
                buf.put_u8(TAG_RESOLVING);
                buf.put_slice(r.fingerprint.as_bytes());
                buf.put_u64(r.until_ms);
            }
            Record::Evicted(_) => {
                buf.put_u8(TAG_EVICTED);
                buf.put_slice(Fingerprint::NONE.as_bytes());
            }
        }
        buf.freeze()
    }

    /// Decodes a record. Total: any bytes give a record or a [`DecodeError`], never a
    /// panic. The body of a completed record shares `bytes` (no copy).
    pub fn decode(mut bytes: Bytes) -> Result<Record, DecodeError> {
        let version = take_u8(&mut bytes)?;
        if version != RECORD_VERSION {
            return Err(DecodeError::UnknownVersion(version));
        }
        let tag = take_u8(&mut bytes)?;
        let fingerprint = Fingerprint::from_bytes(take_array(&mut bytes)?);
        let record = match tag {
            TAG_IN_PROGRESS => {
                let token = Token::from_bytes(take_array(&mut bytes)?);
                let lease_until_ms = u64::from_be_bytes(take_array(&mut bytes)?);
                let commit_point = CommitPoint::from_byte(take_u8(&mut bytes)?)?;
                Record::InProgress(InProgress {
                    lease_until_ms,
                    token,
                    fingerprint,
                    commit_point,
                })
            }
            TAG_COMPLETED => Record::Completed(Completed {
                fingerprint,
                response: Some(StoredResponse::decode_from(&mut bytes)?),
            }),
            TAG_NOT_STORED => Record::Completed(Completed {
                fingerprint,
                response: None,
            }),
            TAG_UNKNOWN => Record::OutcomeUnknown(OutcomeUnknown { fingerprint }),
            TAG_RESOLVING => Record::Resolving(Resolving {
                fingerprint,
                until_ms: u64::from_be_bytes(take_array(&mut bytes)?),
            }),
            TAG_EVICTED => Record::Evicted(Evicted {}),
            _ => return Err(DecodeError::Invalid("state tag")),
        };
        if bytes.has_remaining() {
            return Err(DecodeError::TrailingBytes);
        }
        Ok(record)
    }
}

fn take_u8(b: &mut Bytes) -> Result<u8, DecodeError> {
    if b.remaining() < 1 {
        return Err(DecodeError::Truncated);
    }
    Ok(b.get_u8())
}

fn take_array<const N: usize>(b: &mut Bytes) -> Result<[u8; N], DecodeError> {
    if b.remaining() < N {
        return Err(DecodeError::Truncated);
    }
    let mut out = [0u8; N];
    b.copy_to_slice(&mut out);
    Ok(out)
}

fn take_bytes(b: &mut Bytes) -> Result<Bytes, DecodeError> {
    let len = u32::from_be_bytes(take_array(b)?);
    let len = usize::try_from(len).map_err(|_| DecodeError::Truncated)?;
    if b.remaining() < len {
        return Err(DecodeError::Truncated);
    }
    Ok(b.split_to(len))
}

fn put_bytes(buf: &mut BytesMut, bytes: &[u8]) {
    // Lengths are bounded far below 4 GiB by the layer's limits.
    buf.put_u32(u32::try_from(bytes.len()).unwrap_or(u32::MAX));
    buf.put_slice(bytes);
}

/// A captured response: status, the stored headers, body and trailers.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status code.
    pub status: StatusCode,
    /// The stored headers (already filtered by a [`HeaderFilter`]), in order; a header
    /// with several values appears several times.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The whole body.
    pub body: Bytes,
    /// Trailers, when the response had any.
    pub trailers: Vec<(HeaderName, HeaderValue)>,
}

impl StoredResponse {
    /// A stored response from its parts (headers already filtered), as a store
    /// decodes it.
    pub fn new(
        status: StatusCode,
        headers: Vec<(HeaderName, HeaderValue)>,
        body: Bytes,
        trailers: Vec<(HeaderName, HeaderValue)>,
    ) -> Self {
        StoredResponse {
            status,
            headers,
            body,
            trailers,
        }
    }

    /// Captures a response head, body and trailers, keeping the headers `filter` allows.
    #[doc(hidden)]
    pub fn capture(
        status: StatusCode,
        headers: &HeaderMap,
        body: Bytes,
        trailers: Option<&HeaderMap>,
        filter: &HeaderFilter,
    ) -> Self {
        let keep = |map: &HeaderMap| {
            map.iter()
                .filter(|(n, _)| filter.is_stored(n))
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect::<Vec<_>>()
        };
        StoredResponse {
            status,
            headers: keep(headers),
            body,
            trailers: trailers.map(keep).unwrap_or_default(),
        }
    }

    /// The stored headers as a `HeaderMap` (multi-value headers intact).
    #[doc(hidden)]
    pub fn header_map(&self) -> HeaderMap {
        to_map(&self.headers)
    }

    /// The trailers as a `HeaderMap`, `None` when there were none.
    #[doc(hidden)]
    pub fn trailer_map(&self) -> Option<HeaderMap> {
        (!self.trailers.is_empty()).then(|| to_map(&self.trailers))
    }

    /// Payload bytes: body, header names and values, trailers.
    #[doc(hidden)]
    pub fn payload_len(&self) -> usize {
        let h = |v: &[(HeaderName, HeaderValue)]| {
            v.iter()
                .map(|(n, v)| n.as_str().len() + v.len())
                .sum::<usize>()
        };
        self.body.len() + h(&self.headers) + h(&self.trailers)
    }

    fn encoded_len(&self) -> usize {
        let h = |v: &[(HeaderName, HeaderValue)]| {
            4 + v
                .iter()
                .map(|(n, v)| 8 + n.as_str().len() + v.len())
                .sum::<usize>()
        };
        2 + h(&self.headers) + h(&self.trailers) + 4 + self.body.len()
    }

    fn encode_into(&self, buf: &mut BytesMut) {
        buf.put_u16(self.status.as_u16());
        for list in [&self.headers, &self.trailers] {
            buf.put_u32(u32::try_from(list.len()).unwrap_or(u32::MAX));
            for (n, v) in list {
                put_bytes(buf, n.as_str().as_bytes());
                put_bytes(buf, v.as_bytes());
            }
        }
        put_bytes(buf, &self.body);
    }

    fn decode_from(b: &mut Bytes) -> Result<Self, DecodeError> {
        let status = StatusCode::from_u16(u16::from_be_bytes(take_array(b)?))
            .map_err(|_| DecodeError::Invalid("status"))?;
        let mut lists = [Vec::new(), Vec::new()];
        for list in &mut lists {
            let count = u32::from_be_bytes(take_array(b)?);
            for _ in 0..count {
                let name = take_bytes(b)?;
                let value = take_bytes(b)?;
                let name = HeaderName::from_bytes(&name)
                    .map_err(|_| DecodeError::Invalid("header name"))?;
                let value = HeaderValue::from_maybe_shared(value)
                    .map_err(|_| DecodeError::Invalid("header value"))?;
                list.push((name, value));
            }
        }
        let body = take_bytes(b)?;
        let [headers, trailers] = lists;
        Ok(StoredResponse {
            status,
            headers,
            body,
            trailers,
        })
    }
}

fn to_map(list: &[(HeaderName, HeaderValue)]) -> HeaderMap {
    let mut map = HeaderMap::with_capacity(list.len());
    for (n, v) in list {
        map.append(n.clone(), v.clone());
    }
    map
}

/// Which response headers are stored and replayed.
///
/// Never stored: hop-by-hop headers, `content-length` (recomputed), `set-cookie`, `date`
/// (regenerated), `x-request-id`, `traceparent`, `tracestate`, `server-timing`,
/// rate-limit headers (`ratelimit*`, `x-ratelimit-*`), `idempotent-replayed`, and the
/// configured deny list.
///
/// ```
/// use retrysafe::idempotency::HeaderFilter;
/// use http::HeaderName;
/// let f = HeaderFilter::default().deny(HeaderName::from_static("x-secret"));
/// assert!(f.is_stored(&HeaderName::from_static("content-type")));
/// assert!(!f.is_stored(&HeaderName::from_static("set-cookie")));
/// assert!(!f.is_stored(&HeaderName::from_static("x-ratelimit-remaining")));
/// assert!(!f.is_stored(&HeaderName::from_static("x-secret")));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderFilter {
    deny: Vec<HeaderName>,
}

const NEVER_STORED: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
    "trailer",
    "proxy-authenticate",
    "proxy-authorization",
    "content-length",
    "set-cookie",
    "date",
    "x-request-id",
    "traceparent",
    "tracestate",
    "server-timing",
    "idempotent-replayed",
];

impl HeaderFilter {
    /// Adds a header to the deny list.
    #[must_use]
    pub fn deny(mut self, name: HeaderName) -> Self {
        self.deny.push(name);
        self
    }

    /// Whether a header of this name is stored and replayed.
    #[doc(hidden)]
    pub fn is_stored(&self, name: &HeaderName) -> bool {
        let n = name.as_str();
        !(NEVER_STORED.contains(&n)
            || n.starts_with("ratelimit")
            || n.starts_with("x-ratelimit")
            || n.starts_with("x-rate-limit")
            || self.deny.contains(name))
    }
}

#[cfg(test)]
mod tests {
    use http::{HeaderName, HeaderValue, StatusCode};

    use super::*;

    // The encoding a store writes from a reference is the record's own encoding.
    #[test]
    fn a_completion_encodes_as_its_record() {
        let response = StoredResponse::new(
            StatusCode::CREATED,
            vec![(
                HeaderName::from_static("content-type"),
                HeaderValue::from_static("application/json"),
            )],
            Bytes::from_static(b"{\"id\":7}"),
            Vec::new(),
        );
        for done in [
            Completed::new(Fingerprint::from_bytes([3; 32]), Some(response)),
            Completed::new(Fingerprint::from_bytes([4; 32]), None),
        ] {
            let record = Record::Completed(done.clone());
            assert_eq!(done.encode_record(), record.encode());
            assert_eq!(Record::decode(done.encode_record()).ok(), Some(record));
        }
    }
}
