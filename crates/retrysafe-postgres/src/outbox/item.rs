//! What a transaction enqueues: an HTTP request or a broker message.

use bytes::Bytes;
use http::header::{AUTHORIZATION, COOKIE, HeaderName, PROXY_AUTHORIZATION};
use http::{HeaderMap, HeaderValue, Method, Request, Uri};

use super::sql::{KIND_HTTP, KIND_MESSAGE};

/// The header that carries a row's child key.
pub(crate) const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Headers the outbox never stores: credentials belong to the relay's client stack or
/// publisher, which adds them when it sends (they may have expired by then anyway), and
/// the idempotency key is the row's own child key.
fn never_stored(name: &HeaderName) -> bool {
    name == AUTHORIZATION
        || name == PROXY_AUTHORIZATION
        || name == COOKIE
        || name == IDEMPOTENCY_KEY
}

/// `headers` without those [never stored](never_stored).
fn storable(mut headers: HeaderMap) -> HeaderMap {
    let names: Vec<HeaderName> = headers
        .keys()
        .filter(|n| never_stored(n))
        .cloned()
        .collect();
    for name in names {
        headers.remove(name);
    }
    headers
}

/// One entry for the outbox: an HTTP request, or a message for a
/// [`Publisher`](super::Publisher), with an optional ordering key.
///
/// Built from an `http::Request<Bytes>` (also through `From`) or a [`Message`]:
///
/// ```
/// use bytes::Bytes;
/// use retrysafe::postgres::outbox::Outgoing;
///
/// let request = http::Request::post("http://ledger.internal/entries")
///     .header("authorization", "Bearer secret")
///     .header("content-type", "application/json")
///     .body(Bytes::from_static(br#"{"amount_cents":500}"#))
///     .unwrap();
/// let outgoing = Outgoing::from(request).ordering_key("account-7");
/// assert_eq!(outgoing.ordering_key_str(), Some("account-7"));
/// // Credentials are never written to the outbox: the relay's client stack adds them.
/// assert!(outgoing.headers().get("authorization").is_none());
/// assert_eq!(outgoing.headers()["content-type"], "application/json");
/// ```
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub(crate) kind: i16,
    pub(crate) method: String,
    pub(crate) target: String,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) ordering_key: Option<String>,
}

impl Outgoing {
    /// An HTTP request to send, without its `authorization`, `proxy-authorization`,
    /// `cookie` and `idempotency-key` headers (the relay sends the row's child key as
    /// `Idempotency-Key`). Its extensions are not kept.
    pub fn http(request: Request<Bytes>) -> Self {
        let (parts, body) = request.into_parts();
        Outgoing {
            kind: KIND_HTTP,
            method: parts.method.to_string(),
            target: parts.uri.to_string(),
            headers: storable(parts.headers),
            body,
            ordering_key: None,
        }
    }

    /// A message to publish, without the same headers as an HTTP request: a
    /// publisher that needs credentials has its own.
    ///
    /// ```
    /// use retrysafe::postgres::outbox::{Message, Outgoing};
    ///
    /// let message = Message::new("", "orders", "created")
    ///     .header("authorization", "Bearer secret")
    ///     .header("cookie", "session=secret")
    ///     .header("x-trace", "t-1");
    /// let outgoing = Outgoing::message(message);
    /// assert!(outgoing.headers().get("authorization").is_none());
    /// assert!(outgoing.headers().get("cookie").is_none());
    /// assert_eq!(outgoing.headers()["x-trace"], "t-1");
    /// ```
    pub fn message(message: Message) -> Self {
        Outgoing {
            kind: KIND_MESSAGE,
            method: message.exchange,
            target: message.routing_key,
            headers: storable(message.headers),
            body: message.body,
            ordering_key: None,
        }
    }

    /// Delivers this entry after every earlier pending entry with the same key, and
    /// before every later one (entries of one aggregate, in order). An entry that ends
    /// `rejected` or `dead` no longer holds back those after it.
    ///
    /// The order is the order in which the enqueueing transactions commit. To make it
    /// so, [`Outbox::enqueue`](super::Outbox::enqueue) takes a transaction-level lock
    /// on the key: a second transaction enqueueing for the same key waits until the
    /// first commits or rolls back. Transactions of one aggregate thus run one at a
    /// time from their first ordered enqueue to their end: enqueue late in the
    /// transaction, after the slow work.
    #[must_use]
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// The ordering key, if one was set.
    #[doc(hidden)]
    pub fn ordering_key_str(&self) -> Option<&str> {
        self.ordering_key.as_deref()
    }

    /// The headers that will be stored.
    #[doc(hidden)]
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }
}

impl From<Request<Bytes>> for Outgoing {
    fn from(request: Request<Bytes>) -> Self {
        Outgoing::http(request)
    }
}

impl From<Message> for Outgoing {
    fn from(message: Message) -> Self {
        Outgoing::message(message)
    }
}

/// A message for a broker: its exchange, routing key, headers and body. Its message id
/// is the outbox row's child key.
///
/// ```
/// use retrysafe::postgres::outbox::Message;
///
/// let message = Message::new("orders", "order.created", r#"{"order":1}"#)
///     .header("content-type", "application/json");
/// assert_eq!(message.exchange(), "orders");
/// assert_eq!(message.routing_key(), "order.created");
/// assert_eq!(message.body(), &br#"{"order":1}"#[..]);
/// assert_eq!(message.headers()["content-type"], "application/json");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    exchange: String,
    routing_key: String,
    headers: HeaderMap,
    body: Bytes,
}

impl Message {
    /// A message for `exchange` (`""`: the default exchange, which routes to the queue
    /// named by the routing key) with `routing_key` and `body`.
    pub fn new(
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        body: impl Into<Bytes>,
    ) -> Self {
        Message {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            headers: HeaderMap::new(),
            body: body.into(),
        }
    }

    /// Adds a header (ignored when the name or value is not a valid HTTP header).
    #[must_use]
    pub fn header(mut self, name: &str, value: &str) -> Self {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            self.headers.append(name, value);
        }
        self
    }

    pub(crate) fn from_row(
        exchange: &str,
        routing_key: &str,
        headers: HeaderMap,
        body: Bytes,
    ) -> Self {
        Message {
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
            headers,
            body,
        }
    }

    /// The exchange.
    pub fn exchange(&self) -> &str {
        &self.exchange
    }

    /// The routing key.
    pub fn routing_key(&self) -> &str {
        &self.routing_key
    }

    /// The headers.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }
}

/// Encodes headers as `u16 name length, name, u32 value length, value` repeated: header
/// values need not be UTF-8.
pub(crate) fn encode_headers(headers: &HeaderMap) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        let name = name.as_str().as_bytes();
        let value = value.as_bytes();
        out.extend_from_slice(&u16::try_from(name.len()).unwrap_or(0).to_be_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(&u32::try_from(value.len()).unwrap_or(0).to_be_bytes());
        out.extend_from_slice(value);
    }
    out
}

/// Decodes [`encode_headers`]; a damaged tail is dropped.
pub(crate) fn decode_headers(mut bytes: &[u8]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    while let Some((name, rest)) = take(bytes, 2) {
        let Some((value, rest)) = take(rest, 4) else {
            break;
        };
        let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value))
        else {
            break;
        };
        headers.append(name, value);
        bytes = rest;
    }
    headers
}

/// Splits a length-prefixed field (`width` bytes of big-endian length) off `bytes`.
fn take(bytes: &[u8], width: usize) -> Option<(&[u8], &[u8])> {
    let (len, rest) = bytes.split_at_checked(width)?;
    let len = len.iter().fold(0usize, |n, b| (n << 8) | usize::from(*b));
    rest.split_at_checked(len)
}

/// The request a row describes, with its child key as `Idempotency-Key`.
pub(crate) fn request_of(
    method: &str,
    target: &str,
    headers: HeaderMap,
    body: Bytes,
    key: &str,
) -> Result<Request<Bytes>, String> {
    let method = Method::from_bytes(method.as_bytes()).map_err(|e| e.to_string())?;
    let uri: Uri = target
        .parse()
        .map_err(|e: http::uri::InvalidUri| e.to_string())?;
    let mut request = Request::new(body);
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.headers_mut() = headers;
    let key = HeaderValue::from_str(key).map_err(|e| e.to_string())?;
    request.headers_mut().insert(IDEMPOTENCY_KEY, key);
    Ok(request)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let mut h = HeaderMap::new();
        h.append("x-a", HeaderValue::from_static("1"));
        h.append("x-a", HeaderValue::from_static("2"));
        h.append(
            "x-b",
            HeaderValue::from_bytes(b"\xff\x80").unwrap_or(HeaderValue::from_static("")),
        );
        assert_eq!(decode_headers(&encode_headers(&h)), h);
        assert!(decode_headers(&[0, 9, b'x']).is_empty());
    }
}
