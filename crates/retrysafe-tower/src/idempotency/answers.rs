//! How a layer answers: its problem responses, the replay of a stored response, and
//! the bounded capture of a handler's response for storing.

use std::panic::AssertUnwindSafe;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{HeaderMap, HeaderName, HeaderValue, Response};
use http_body::Body;
use http_body_util::BodyExt;
use retrysafe_core::idempotency::{HeaderFilter, StoredResponse};
use retrysafe_core::wire::{Convention, DO_NOT_RETRY_VALUE, REPLAYED_VALUE, encode_retry_after};
use tokio::time::Instant;

use super::body::{Accumulator, ResponseBody};
use super::problem::{Problem, Responder};
use super::rules::MIB;

type Res<B> = Response<ResponseBody<B>>;

/// How a layer writes its answers: the header names, the problem responder, what of a
/// response is stored, and how much.
#[derive(Clone)]
pub struct Answers {
    pub(crate) convention: Convention,
    pub(crate) responder: Option<Responder>,
    pub(crate) header_filter: HeaderFilter,
    pub(crate) max_stored_response: usize,
}

impl std::fmt::Debug for Answers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Answers")
            .field("custom_responder", &self.responder.is_some())
            .field("max_stored_response", &self.max_stored_response)
            .finish_non_exhaustive()
    }
}

impl Default for Answers {
    fn default() -> Self {
        Answers {
            convention: Convention::default(),
            responder: None,
            header_filter: HeaderFilter::default(),
            max_stored_response: MIB,
        }
    }
}

impl Answers {
    /// The answer to `problem`: the configured responder's (or the default RFC 9457
    /// one), with the `do-not-retry` and `retry-after` headers the problem carries and
    /// the [`Problem`] as a response extension. Every problem answer of the layer (and
    /// of the transactional layer) is written here.
    pub fn problem<B>(&self, problem: Problem) -> Res<B> {
        let res = match &self.responder {
            Some(f) => f(&problem),
            None => problem.to_response(),
        };
        let (mut parts, body) = res.into_parts();
        if problem.do_not_retry() {
            parts
                .headers
                .insert(self.convention.do_not_retry().clone(), DO_NOT_RETRY_VALUE);
        }
        if let Some(d) = problem.retry_after_hint() {
            parts
                .headers
                .insert(self.convention.retry_after().clone(), encode_retry_after(d));
        }
        parts.extensions.insert(problem);
        Response::from_parts(parts, ResponseBody::full(body, None))
    }

    /// The replay of a stored response, marked `idempotent-replayed: true`: moved out
    /// of its record, not copied.
    pub(crate) fn replay_owned<B>(&self, stored: StoredResponse) -> Res<B> {
        replay_owned(&self.convention, stored)
    }

    /// Collects a handler's response to store it: the body up to the storable limit
    /// and until `until` (see `capture_response_body`); the stored form keeps the
    /// headers the filter lets through. `None` when the body failed, or panicked, while
    /// it was collected.
    pub async fn capture<B>(
        &self,
        response: Response<B>,
        until: Instant,
    ) -> Option<CapturedResponse<B>>
    where
        B: Body<Data = Bytes>,
    {
        let (head, body) = response.into_parts();
        let captured =
            AssertUnwindSafe(capture_response_body(body, self.max_stored_response, until))
                .catch_unwind()
                .await
                .unwrap_or(CapturedBody::Failed);
        match captured {
            CapturedBody::Whole { data, trailers } => Some(CapturedResponse {
                stored: Some(StoredResponse::capture(
                    head.status,
                    &head.headers,
                    data.clone(),
                    trailers.as_ref(),
                    &self.header_filter,
                )),
                response: Response::from_parts(head, ResponseBody::full(data, trailers)),
            }),
            CapturedBody::TooLarge(rest) => Some(CapturedResponse {
                stored: None,
                response: Response::from_parts(head, rest),
            }),
            CapturedBody::Failed => None,
        }
    }
}

/// A handler's response as [`Answers::capture`] collected it.
#[derive(Debug)]
pub struct CapturedResponse<B> {
    /// The response as it is stored; `None` when it was too large (or too slow) to
    /// store, in which case [`response`](Self::response) streams the rest of the body.
    pub stored: Option<StoredResponse>,
    /// The response to send.
    pub response: Res<B>,
}

/// What `capture_response_body` collected.
#[derive(Debug)]
pub(crate) enum CapturedBody<B> {
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
pub(crate) async fn capture_response_body<B>(
    body: B,
    limit: usize,
    until: Instant,
) -> CapturedBody<B>
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

/// The replay of a stored response the caller owns (a record just decoded): its status,
/// stored headers, body and trailers, marked with the convention's
/// `idempotent-replayed: true`; headers and trailers are moved, not copied.
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use http::StatusCode;
    use http_body_util::{BodyExt, Empty};

    use super::*;

    // A replay is the stored response: status, multi-value headers in order, the
    // marker, body and trailers.
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
        let owned = replay_owned::<Empty<Bytes>>(&convention, stored);
        for res in [owned] {
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
