//! Building blocks of the [`IdempotencyLayer`](super::IdempotencyLayer), public so that
//! idempotency layers of other crates — the transactional layer of `retrysafe-postgres` —
//! compose them instead of copying them: the request-head rules (gRPC detection, the
//! `Idempotency-Key` header), the bounded request-body buffering with its 413, the
//! bounded capture of a response body, the replay of a stored response, and the
//! validation of duration settings.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use http::{HeaderMap, HeaderValue};
//! use retrysafe_core::wire::Convention;
//! use retrysafe_tower::idempotency::blocks;
//!
//! let mut headers = HeaderMap::new();
//! headers.insert("idempotency-key", HeaderValue::from_static("order-7"));
//! let key = blocks::idempotency_key(&headers, &Convention::default(), true).unwrap();
//! assert_eq!(key.unwrap().as_str(), "order-7");
//!
//! let body = http_body_util::Full::new(bytes::Bytes::from_static(b"{\"amount\":1}"));
//! let buffered = blocks::buffer_request_body(std::pin::pin!(body), 1024).await.unwrap();
//! assert_eq!(&buffered[..], b"{\"amount\":1}");
//! # }
//! ```

use std::pin::Pin;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderMap, HeaderName, HeaderValue, Response};
use http_body::Body;
use http_body_util::BodyExt;
use retrysafe_core::ConfigError;
use retrysafe_core::idempotency::StoredResponse;
use retrysafe_core::wire::{Convention, IdempotencyKey, REPLAYED_VALUE};
use tokio::time::Instant;

use super::body::ResponseBody;
use super::problem::{Problem, ProblemKind};

/// Whether a request is gRPC (`content-type: application/grpc*`).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// The request's idempotency key: `Ok(None)` when it has none and `require_key` is off;
/// a 400 problem when it has none and `require_key` is on (`key-missing`), or when the
/// header is sent twice or is not a valid key (`key-invalid`).
pub fn idempotency_key(
    headers: &HeaderMap,
    convention: &Convention,
    require_key: bool,
) -> Result<Option<IdempotencyKey>, Problem> {
    let mut keys = headers.get_all(convention.idempotency_key()).iter();
    match (keys.next(), keys.next()) {
        (None, _) if require_key => Err(Problem::new(
            ProblemKind::KeyMissing,
            "this endpoint requires an Idempotency-Key header",
        )),
        (None, _) => Ok(None),
        (Some(_), Some(_)) => Err(Problem::new(
            ProblemKind::KeyInvalid,
            "the Idempotency-Key header must be sent once",
        )),
        (Some(v), None) => IdempotencyKey::from_header(v).map(Some).map_err(|e| {
            Problem::new(
                ProblemKind::KeyInvalid,
                format!("{e}: a key is 1 to 255 printable ASCII characters"),
            )
        }),
    }
}

/// Refuses, before anything is read, a request body whose declared length
/// (`content-length`, or the body's size hint) is over `limit`: the body is drained
/// (bounded: at most 8 MiB and 2 s, so that an HTTP/1.1 client still sending gets the
/// answer instead of a reset) and a 413 `body-too-large` problem is returned.
pub async fn check_declared_length<B>(
    headers: &HeaderMap,
    mut body: Pin<&mut B>,
    limit: usize,
) -> Result<(), Problem>
where
    B: Body<Data = Bytes>,
{
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) || body.size_hint().lower() > limit as u64 {
        drain(body.as_mut()).await;
        return Err(too_large(limit));
    }
    Ok(())
}

/// Buffers a request body of at most `limit` bytes (trailers are dropped). Past the
/// limit, the rest is drained (bounded, as in [`check_declared_length`]) and a 413
/// `body-too-large` problem is returned; a body that fails is a 400 `body-unreadable`.
/// A body that arrives in one frame is not copied.
pub async fn buffer_request_body<B>(mut body: Pin<&mut B>, limit: usize) -> Result<Bytes, Problem>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    match read_body(body.as_mut(), limit).await {
        Ok(b) => Ok(b),
        Err(ReadError::TooLarge) => {
            drain(body.as_mut()).await;
            Err(too_large(limit))
        }
        Err(ReadError::Failed(e)) => Err(Problem::new(
            ProblemKind::BodyUnreadable,
            format!("could not read the request body: {e}"),
        )),
    }
}

fn too_large(limit: usize) -> Problem {
    Problem::new(
        ProblemKind::BodyTooLarge,
        format!("the request body is over {limit} bytes"),
    )
}

enum ReadError {
    TooLarge,
    Failed(Box<dyn std::error::Error + Send + Sync>),
}

/// How much of a refused request body is read and discarded before the 413 is sent,
/// and for how long: a client that is still sending when the server answers and closes
/// gets a connection reset instead of the answer (HTTP/1.1 has no better way). Bounded,
/// so a huge or endless body costs at most this.
const DRAIN_BYTES: usize = 8 * 1024 * 1024;
const DRAIN_TIME: Duration = Duration::from_secs(2);

async fn drain<B: Body<Data = Bytes>>(mut body: Pin<&mut B>) {
    let mut left = DRAIN_BYTES;
    let until = Instant::now() + DRAIN_TIME;
    while let Ok(Some(Ok(frame))) = tokio::time::timeout_at(until, body.frame()).await {
        let n = frame.data_ref().map_or(0, Bytes::len);
        match left.checked_sub(n) {
            Some(l) => left = l,
            None => return,
        }
    }
}

async fn read_body<B>(mut body: Pin<&mut B>, limit: usize) -> Result<Bytes, ReadError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut acc = Accumulator::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ReadError::Failed(e.into()))?;
        let Ok(data) = frame.into_data() else {
            continue; // request trailers are not part of the fingerprint
        };
        if acc.len() + data.len() > limit {
            return Err(ReadError::TooLarge);
        }
        acc.push(data);
    }
    Ok(acc.freeze())
}

/// Collects body frames without copying a body that arrives in one frame.
#[derive(Default)]
struct Accumulator {
    first: Option<Bytes>,
    buf: Option<BytesMut>,
}

impl Accumulator {
    fn len(&self) -> usize {
        self.first.as_ref().map_or(0, Bytes::len) + self.buf.as_ref().map_or(0, BytesMut::len)
    }

    fn push(&mut self, data: Bytes) {
        match (self.first.take(), &mut self.buf) {
            (None, None) => self.first = Some(data),
            (Some(f), None) => {
                let mut b = BytesMut::with_capacity(f.len() + data.len());
                b.extend_from_slice(&f);
                b.extend_from_slice(&data);
                self.buf = Some(b);
            }
            (_, Some(b)) => b.extend_from_slice(&data),
        }
    }

    fn freeze(self) -> Bytes {
        match (self.first, self.buf) {
            (_, Some(b)) => b.freeze(),
            (Some(f), None) => f,
            (None, None) => Bytes::new(),
        }
    }
}

/// What [`capture_response_body`] collected.
#[derive(Debug)]
pub enum CapturedBody<B> {
    /// The whole body (and its trailers): store it and answer with
    /// [`ResponseBody::full`].
    Whole {
        /// The body.
        data: Bytes,
        /// The trailers, if the body had any.
        trailers: Option<HeaderMap>,
    },
    /// The body was over the limit, or still streaming at the time limit: it is not
    /// stored. The response body to send: what was read, then the rest of the stream.
    TooLarge(ResponseBody<B>),
    /// The body failed (an error frame) while it was collected.
    Failed,
}

/// Collects a response body up to `limit` bytes and until `until`; past either, returns
/// what was read followed by the rest of the stream ([`CapturedBody::TooLarge`]: the
/// response is then not stored). The frame that crosses the limit is passed on as it
/// is, never copied.
pub async fn capture_response_body<B>(body: B, limit: usize, until: Instant) -> CapturedBody<B>
where
    B: Body<Data = Bytes>,
{
    let mut body = Box::pin(body);
    let mut acc = Accumulator::default();
    let mut trailers: Option<HeaderMap> = None;
    loop {
        let frame = match super::timer::until(until, body.frame()).await {
            Some(Some(frame)) => frame,
            Some(None) => break,
            None => {
                return CapturedBody::TooLarge(ResponseBody::prefixed(
                    [Some(acc.freeze()), None],
                    body,
                ));
            }
        };
        let Ok(frame) = frame else {
            return CapturedBody::Failed;
        };
        match frame.into_data() {
            Ok(data) => {
                if acc.len() + data.len() > limit {
                    return CapturedBody::TooLarge(ResponseBody::prefixed(
                        [Some(acc.freeze()), Some(data)],
                        body,
                    ));
                }
                acc.push(data);
            }
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    match &mut trailers {
                        None => trailers = Some(t),
                        Some(existing) => existing.extend(t),
                    }
                }
            }
        }
    }
    CapturedBody::Whole {
        data: acc.freeze(),
        trailers,
    }
}

/// The replay of a stored response: its status, stored headers, body and trailers,
/// marked with the convention's `idempotent-replayed: true`.
pub fn replay_response<B>(
    convention: &Convention,
    stored: &StoredResponse,
) -> Response<ResponseBody<B>> {
    let headers = stored.headers.iter().map(|(n, v)| (n.clone(), v.clone()));
    let mut res = Response::new(ResponseBody::full(
        stored.body.clone(),
        stored.trailer_map(),
    ));
    *res.status_mut() = stored.status;
    *res.headers_mut() = replayed_headers(convention, headers);
    res
}

/// [`replay_response`] of a response the caller owns (a record just decoded): its
/// headers and trailers are moved, not copied.
pub(crate) fn replay_owned<B>(
    convention: &Convention,
    stored: StoredResponse,
) -> Response<ResponseBody<B>> {
    let StoredResponse {
        status,
        headers,
        body,
        trailers,
        ..
    } = stored;
    let trailers = (!trailers.is_empty()).then(|| trailers.into_iter().collect());
    let mut res = Response::new(ResponseBody::full(body, trailers));
    *res.status_mut() = status;
    *res.headers_mut() = replayed_headers(convention, headers.into_iter());
    res
}

/// The stored `headers` (multi-value headers intact) and `idempotent-replayed: true`,
/// in a map with room for one header more (the `content-length` a server sets), so
/// that it is not grown again on the way out.
fn replayed_headers(
    convention: &Convention,
    headers: impl ExactSizeIterator<Item = (HeaderName, HeaderValue)>,
) -> HeaderMap {
    let mut map = HeaderMap::with_capacity(headers.len() + 2);
    for (name, value) in headers {
        map.append(name, value);
    }
    map.insert(convention.idempotent_replayed().clone(), REPLAYED_VALUE);
    map
}

/// A duration setting named `field`, validated as the layers validate theirs: greater
/// than zero and at most `max`.
///
/// ```
/// use std::time::Duration;
/// use retrysafe_tower::idempotency::blocks::duration_setting;
///
/// let max = Duration::from_secs(60);
/// assert_eq!(duration_setting(Duration::from_secs(1), "timeout", max), Ok(Duration::from_secs(1)));
/// assert_eq!(duration_setting(Duration::ZERO, "timeout", max).unwrap_err().field(), "timeout");
/// assert!(duration_setting(Duration::from_secs(61), "timeout", max).is_err());
/// ```
pub fn duration_setting(
    value: Duration,
    field: &'static str,
    max: Duration,
) -> Result<Duration, ConfigError> {
    if value.is_zero() {
        Err(ConfigError::new(field, "must be greater than zero"))
    } else if value > max {
        Err(ConfigError::new(field, "is too large"))
    } else {
        Ok(value)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use http::StatusCode;
    use http_body_util::{BodyExt, Empty};

    use super::*;

    // A replay from a borrowed or an owned record is the same response: status,
    // multi-value headers in order, the marker, body and trailers.
    #[tokio::test]
    async fn a_replay_moved_out_of_its_record_is_the_replay_of_the_record() {
        let h = |n: &'static str, v: &'static str| {
            (HeaderName::from_static(n), HeaderValue::from_static(v))
        };
        let stored = StoredResponse::new(
            StatusCode::CREATED,
            vec![
                h("x-a", "1"),
                h("content-type", "text/plain"),
                h("x-a", "2"),
            ],
            Bytes::from_static(b"done"),
            vec![h("grpc-status", "0"), h("x-t", "1"), h("x-t", "2")],
        );
        let convention = Convention::default();
        let borrowed = replay_response::<Empty<Bytes>>(&convention, &stored);
        let owned = replay_owned::<Empty<Bytes>>(&convention, stored);
        for res in [borrowed, owned] {
            assert_eq!(res.status(), StatusCode::CREATED);
            let values: Vec<_> = res.headers().get_all("x-a").iter().collect();
            assert_eq!(values, ["1", "2"]);
            assert_eq!(res.headers()["content-type"], "text/plain");
            assert_eq!(
                res.headers()[convention.idempotent_replayed()],
                REPLAYED_VALUE
            );
            assert_eq!(res.headers().len(), 4);
            let body = res.into_body().collect().await.unwrap();
            let trailers = body.trailers().cloned().unwrap();
            let values: Vec<_> = trailers.get_all("x-t").iter().collect();
            assert_eq!(values, ["1", "2"]);
            assert_eq!(trailers["grpc-status"], "0");
            assert_eq!(body.to_bytes(), "done");
        }
    }
}
