//! What the layer reads of a guarded request before anything is claimed: the rules of
//! the request head (gRPC detection, the `Idempotency-Key` header) and the bounded
//! buffering of the body with its 413; and the request as a backend gets it.

use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderMap, Request};
use http_body::Body;
use http_body_util::BodyExt;
use retrysafe_core::idempotency::{Fingerprint, IdempotencyContext, RecordId, Scope};
use retrysafe_core::wire::{Convention, IdempotencyKey};
use retrysafe_core::{CallContext, Deadline};
use tokio::time::Instant;
use tracing::Span;

use super::body::{Accumulator, RequestBody};
use super::problem::{Problem, ProblemKind};

/// Whether a request is gRPC (`content-type: application/grpc*`).
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// The request's idempotency key: `Ok(None)` when it has none and `require_key` is off;
/// a 400 problem when it has none and `require_key` is on (`key-missing`), or when the
/// header is sent twice or is not a valid key (`key-invalid`).
pub(crate) fn idempotency_key(
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
pub(crate) async fn check_declared_length<B>(
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
pub(crate) async fn buffer_request_body<B>(
    mut body: Pin<&mut B>,
    limit: usize,
) -> Result<Bytes, Problem>
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

/// A guarded request with a key, buffered and fingerprinted, as a backend runs it.
#[derive(Debug)]
#[non_exhaustive]
pub struct KeyedRequest {
    /// The request head.
    pub parts: Parts,
    /// The buffered body.
    pub body: Bytes,
    /// The idempotency key.
    pub key: IdempotencyKey,
    /// The scope.
    pub scope: Scope,
    /// The fingerprint of method, path, query, the configured headers and the body.
    pub fingerprint: Fingerprint,
    /// The request's `retrysafe.idempotency` span (disabled unless a subscriber wants
    /// it).
    pub span: Span,
}

impl KeyedRequest {
    /// The record key: scope and idempotency key.
    pub fn record_id(&self) -> RecordId {
        RecordId::new(&self.scope, &self.key)
    }

    /// The request's [`Deadline`], if it has one.
    pub fn deadline(&self) -> Option<Deadline> {
        self.parts.extensions.get::<Deadline>().copied()
    }

    /// The request for the inner service, and the call context to scope its call with:
    /// the inherited [`CallContext`] now carrying the record's [`IdempotencyContext`]
    /// (made by `ctx` from scope and key), so outbound client layers derive child keys
    /// from the record. Both are request extensions too.
    pub fn into_request<B>(
        self: Box<Self>,
        ctx: impl FnOnce(Scope, IdempotencyKey) -> IdempotencyContext,
    ) -> (Request<RequestBody<B>>, CallContext) {
        let KeyedRequest {
            mut parts,
            body,
            key,
            scope,
            ..
        } = *self;
        let ctx = ctx(scope, key);
        let context = CallContext::inherited(&parts.extensions)
            .unwrap_or_default()
            .with_idempotency(ctx.clone());
        parts.extensions.insert(ctx);
        parts.extensions.insert(context.clone());
        (
            Request::from_parts(parts, RequestBody::buffered(body)),
            context,
        )
    }
}

/// A request the layer admitted to its backend.
///
/// Boxed either way: the request is handed down through several futures, and each
/// would hold (and move) it whole.
#[derive(Debug)]
pub enum Admitted<B> {
    /// With a key.
    Keyed(Box<KeyedRequest>),
    /// Without one, for a backend that guards those (the transactional layer runs each
    /// in a transaction of its own).
    Unkeyed(Box<Request<RequestBody<B>>>),
}
