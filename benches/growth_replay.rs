//! Costs that grow with work: the `RetryLayer`'s `ReplayBody` against the body size.
//!
//! **default** (criterion, group `replay_body`): what the `RetryLayer`'s `ReplayBody`
//! costs against the bare body, at 1, 4, 16 and 64 KiB (the default cap) and at
//! 64 KiB + 1 byte (over the cap), for three bodies: `one_chunk` (`Full<Bytes>`, exact
//! size hint), `16_chunks` (16 `Bytes` frames, no size hint, as a streamed body) and
//! `one_chunk_slice` (`Full<&[u8]>`: data that is not `Bytes`, which `ReplayBody`
//! copies). Cases: `bare` (poll the body to its end), `first` (wrap it in
//! `ReplayBody::new(body, 64 KiB)`, keep a clone for a retry as the `RetryLayer` does,
//! poll the first attempt to its end, drop both) and `replay` (the retry's body: a
//! clone of the kept body polled to its end, after a first attempt that was not
//! timed; over the cap, the replay fails at once, and the bench checks that it does).
//!
//! `scripts/bench-growth replay`, or
//! `cargo bench --bench growth_replay -- --warm-up-time 0.5 --measurement-time 2`.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout, // the rounds modes print their tables
    clippy::cast_possible_truncation,
    missing_docs,
    unreachable_pub
)]

use std::convert::Infallible;
use std::error::Error;
use std::hint::black_box;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use criterion::{BatchSize, BenchmarkId, Criterion, Throughput};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use retrysafe::ReplayBody;

type BoxError = Box<dyn Error + Send + Sync>;

fn main() {
    let mut c = Criterion::default().configure_from_args();
    group(&mut c);
    c.final_summary();
}

/// The `RetryLayer`'s default replay cap.
const CAP: usize = 64 * 1024;

/// A body of `Bytes` frames handed out one per poll, with no size hint, as a
/// streamed request body is (hyper's would carry the same refcounted `Bytes`).
#[derive(Clone)]
struct Chunks {
    frames: Arc<[Bytes]>,
    next: usize,
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let frame = self.frames.get(self.next).cloned();
        self.next += 1;
        Poll::Ready(frame.map(|data| Ok(Frame::data(data))))
    }

    fn is_end_stream(&self) -> bool {
        self.next >= self.frames.len()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// Polls `body` to its end (every body here is ready at once); returns the data
/// bytes, or the error it ended with.
fn drain<B>(body: B) -> Result<u64, B::Error>
where
    B: Body,
{
    let mut body = pin!(body);
    let mut cx = Context::from_waker(Waker::noop());
    let mut bytes = 0u64;
    loop {
        match body.as_mut().poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    bytes += bytes::Buf::remaining(data) as u64;
                }
                black_box(frame);
            }
            Poll::Ready(Some(Err(e))) => return Err(e),
            Poll::Ready(None) => return Ok(bytes),
            Poll::Pending => panic!("body pending"),
        }
    }
}

/// The three shapes of body, each made fresh for an attempt from a template.
#[derive(Clone, Copy)]
enum Shape {
    OneChunk,
    SixteenChunks,
    OneChunkSlice,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::OneChunk => "one_chunk",
            Shape::SixteenChunks => "16_chunks",
            Shape::OneChunkSlice => "one_chunk_slice",
        }
    }
}

/// One size's body templates.
struct Template {
    whole: Bytes,
    frames: Arc<[Bytes]>,
    slice: &'static [u8],
}

impl Template {
    fn new(len: usize) -> Self {
        // Not `Bytes::from_static`: refcounted like the frames hyper hands out (the
        // slices taken below move `whole` to the shared representation up front).
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let whole = Bytes::from(data.clone());
        let piece = len / 16;
        let frames: Arc<[Bytes]> = (0..16)
            .map(|i| {
                let end = if i == 15 { len } else { (i + 1) * piece };
                whole.slice(i * piece..end)
            })
            .collect();
        Template {
            whole,
            frames,
            slice: Box::leak(data.into_boxed_slice()),
        }
    }
}

/// A fresh body of `shape` from `t`, boxed behind one type so every case pays the
/// same.
enum AnyBody {
    Full(Full<Bytes>),
    Chunks(Chunks),
    Slice(Full<&'static [u8]>),
}

impl Body for AnyBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            AnyBody::Full(b) => Pin::new(b).poll_frame(cx),
            AnyBody::Chunks(b) => Pin::new(b).poll_frame(cx),
            // The copy of a non-`Bytes` buffer into `Bytes` is what a transport (or
            // `ReplayBody`) has to do with such data anyway.
            AnyBody::Slice(b) => Pin::new(b)
                .poll_frame(cx)
                .map(|f| f.map(|f| f.map(|f| f.map_data(Bytes::from_static)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            AnyBody::Full(b) => b.is_end_stream(),
            AnyBody::Chunks(b) => b.is_end_stream(),
            AnyBody::Slice(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            AnyBody::Full(b) => b.size_hint(),
            AnyBody::Chunks(b) => b.size_hint(),
            AnyBody::Slice(b) => b.size_hint(),
        }
    }
}

fn make(shape: Shape, t: &Template) -> AnyBody {
    match shape {
        Shape::OneChunk => AnyBody::Full(Full::new(t.whole.clone())),
        Shape::SixteenChunks => AnyBody::Chunks(Chunks {
            frames: Arc::clone(&t.frames),
            next: 0,
        }),
        Shape::OneChunkSlice => AnyBody::Slice(Full::new(t.slice)),
    }
}

/// Wraps a slice body so `ReplayBody` sees `&[u8]` data (which it copies into
/// `Bytes`), not the `Bytes` that `AnyBody` hands the bare case.
enum Wrapped {
    Any(AnyBody),
    Slice(Full<&'static [u8]>),
}

fn make_for_replay(shape: Shape, t: &Template) -> Wrapped {
    match shape {
        Shape::OneChunkSlice => Wrapped::Slice(Full::new(t.slice)),
        other => Wrapped::Any(make(other, t)),
    }
}

/// The first attempt of the `RetryLayer`: wrap, keep a clone for a retry, send the
/// first attempt to its end. Returns the kept clone and the bytes sent.
fn first<B>(body: B) -> (ReplayBody<B>, u64)
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let body = ReplayBody::new(body, CAP);
    let backup = body.clone();
    let sent = drain(body).unwrap();
    (backup, sent)
}

/// A retry: a clone of the kept body, sent to its end (an error when the body was
/// not replayable).
fn replay<B>(kept: &ReplayBody<B>) -> Result<u64, BoxError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    drain(kept.clone())
}

fn group(c: &mut Criterion) {
    let sizes = [
        ("1KiB", 1024),
        ("4KiB", 4 * 1024),
        ("16KiB", 16 * 1024),
        ("64KiB", CAP),
        ("64KiB+1", CAP + 1),
    ];
    let shapes = [Shape::OneChunk, Shape::SixteenChunks, Shape::OneChunkSlice];
    let mut g = c.benchmark_group("replay_body");
    for (label, len) in sizes {
        let t = Template::new(len);
        g.throughput(Throughput::Bytes(len as u64));
        for shape in shapes {
            let over = len > CAP;
            // Checks before timing: every case sends the whole body once; a replay
            // sends it again below the cap and fails above it.
            assert_eq!(drain(make(shape, &t)).unwrap(), len as u64);
            let (kept, sent) = match make_for_replay(shape, &t) {
                Wrapped::Any(b) => {
                    let (k, s) = first(b);
                    (Ok(k), s)
                }
                Wrapped::Slice(b) => {
                    let (k, s) = first(b);
                    (Err(k), s)
                }
            };
            assert_eq!(sent, len as u64);
            let replayed = match &kept {
                Ok(k) => (k.is_replayable(), replay(k).ok()),
                Err(k) => (k.is_replayable(), replay(k).ok()),
            };
            if over {
                assert_eq!(replayed, (false, None), "{label} {}", shape.name());
            } else {
                assert_eq!(replayed, (true, Some(len as u64)), "{label}");
            }

            let id = |case: &str| BenchmarkId::new(format!("{}/{case}", shape.name()), label);
            g.bench_function(id("bare"), |b| {
                b.iter(|| drain(make(shape, &t)).unwrap());
            });
            g.bench_function(id("first"), |b| {
                b.iter(|| match make_for_replay(shape, &t) {
                    Wrapped::Any(body) => first(body).1,
                    Wrapped::Slice(body) => first(body).1,
                });
            });
            // Only the replay is timed: the first attempt and the drop of the kept
            // body (and of the chunks it holds) are set up and torn down outside.
            g.bench_function(id("replay"), |b| match shape {
                Shape::OneChunkSlice => b.iter_batched(
                    || first(Full::new(t.slice)).0,
                    |kept| {
                        let r = replay(&kept).ok();
                        (r, kept)
                    },
                    BatchSize::SmallInput,
                ),
                _ => b.iter_batched(
                    || first(make(shape, &t)).0,
                    |kept| {
                        let r = replay(&kept).ok();
                        (r, kept)
                    },
                    BatchSize::SmallInput,
                ),
            });
        }
    }
    g.finish();
}
