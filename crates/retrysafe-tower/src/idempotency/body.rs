use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The request body the inner service sees: the original stream for requests the
    /// layer does not guard, the buffered bytes for guarded ones.
    #[derive(Debug)]
    pub struct RequestBody<B> {
        #[pin]
        kind: ReqKind<B>,
    }
}

pin_project! {
    #[project = ReqKindProj]
    #[derive(Debug)]
    enum ReqKind<B> {
        Buffered { data: Option<Bytes> },
        Stream { #[pin] inner: B },
    }
}

impl<B> RequestBody<B> {
    /// A body of these bytes, already buffered (a guarded request).
    pub(crate) fn buffered(data: Bytes) -> Self {
        RequestBody {
            kind: ReqKind::Buffered {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    /// The original stream, untouched (a request that is not guarded).
    pub(crate) fn stream(inner: B) -> Self {
        RequestBody {
            kind: ReqKind::Stream { inner },
        }
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            ReqKindProj::Buffered { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            ReqKindProj::Stream { inner } => inner.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ReqKind::Buffered { data } => data.is_none(),
            ReqKind::Stream { inner } => inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ReqKind::Buffered { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            ReqKind::Stream { inner } => inner.size_hint(),
        }
    }
}

pin_project! {
    /// The response body of the layer: the handler's own stream (untouched requests,
    /// released and `outcome_unknown` answers), a stored body (first answers that were
    /// stored, replays, problems), or the stored prefix followed by the rest of the
    /// handler's stream (a response too large to store).
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        #[pin]
        kind: ResKind<B>,
    }
}

pin_project! {
    #[project = ResKindProj]
    #[derive(Debug)]
    enum ResKind<B> {
        Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
        Stream { prefix: Option<Bytes>, #[pin] inner: B },
        Boxed { prefix: [Option<Bytes>; 2], inner: Pin<Box<B>> },
    }
}

impl<B> ResponseBody<B> {
    /// A body of these bytes and trailers (a stored answer, a replay, a problem).
    pub(crate) fn full(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        ResponseBody {
            kind: ResKind::Full {
                data: (!data.is_empty()).then_some(data),
                trailers,
            },
        }
    }

    /// The handler's own stream, untouched.
    pub(crate) fn stream(inner: B) -> Self {
        ResponseBody {
            kind: ResKind::Stream {
                prefix: None,
                inner,
            },
        }
    }

    /// The frames already read (up to two), then the rest of the stream.
    pub(crate) fn prefixed(prefix: [Option<Bytes>; 2], inner: Pin<Box<B>>) -> Self {
        let [a, b] = prefix;
        let keep = |p: Option<Bytes>| p.filter(|p| !p.is_empty());
        ResponseBody {
            kind: ResKind::Boxed {
                prefix: [keep(a), keep(b)],
                inner,
            },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            ResKindProj::Full { data, trailers } => {
                if let Some(d) = data.take() {
                    return Poll::Ready(Some(Ok(Frame::data(d))));
                }
                Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t))))
            }
            ResKindProj::Stream { prefix, inner } => {
                if let Some(p) = prefix.take() {
                    return Poll::Ready(Some(Ok(Frame::data(p))));
                }
                inner.poll_frame(cx)
            }
            ResKindProj::Boxed { prefix, inner } => {
                if let Some(p) = prefix.iter_mut().find_map(Option::take) {
                    return Poll::Ready(Some(Ok(Frame::data(p))));
                }
                inner.as_mut().poll_frame(cx)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResKind::Full { data, trailers } => data.is_none() && trailers.is_none(),
            ResKind::Stream { prefix, inner } => prefix.is_none() && inner.is_end_stream(),
            ResKind::Boxed { prefix, inner } => {
                prefix.iter().all(Option::is_none) && inner.is_end_stream()
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResKind::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            ResKind::Stream { prefix, inner } => prefixed_hint(prefix.as_ref(), inner.size_hint()),
            ResKind::Boxed { prefix, inner } => {
                prefixed_hint(prefix.iter().flatten(), inner.size_hint())
            }
        }
    }
}

fn prefixed_hint<'a>(prefix: impl IntoIterator<Item = &'a Bytes>, h: SizeHint) -> SizeHint {
    let extra: u64 = prefix.into_iter().map(|p| p.len() as u64).sum();
    let mut out = SizeHint::new();
    out.set_lower(h.lower().saturating_add(extra));
    if let Some(u) = h.upper() {
        out.set_upper(u.saturating_add(extra));
    }
    out
}

/// Collects body frames without copying a body that arrives in one frame.
#[derive(Default)]
pub(crate) struct Accumulator {
    first: Option<Bytes>,
    buf: Option<BytesMut>,
}

impl Accumulator {
    pub(crate) fn len(&self) -> usize {
        self.first.as_ref().map_or(0, Bytes::len) + self.buf.as_ref().map_or(0, BytesMut::len)
    }

    pub(crate) fn push(&mut self, data: Bytes) {
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

    pub(crate) fn freeze(self) -> Bytes {
        match (self.first, self.buf) {
            (_, Some(b)) => b.freeze(),
            (Some(f), None) => f,
            (None, None) => Bytes::new(),
        }
    }
}
