#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub
)]
//! `ReplayBody`: lazy capped copy, replay by clones, hand-over of the inner body.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::error::Error as StdError;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use proptest::prelude::*;
use retrysafe_tower::retry::ReplayBody;
use tokio::sync::mpsc;

type BoxError = Box<dyn StdError + Send + Sync>;
/// Turns a lost wake-up into a failure instead of a hung test run (not a timing check).
const HANG_GUARD: Duration = Duration::from_secs(60);
type Polled = Poll<Option<Result<Frame<Bytes>, BoxError>>>;

// === test bodies and helpers ===

/// One step of a scripted body.
#[derive(Debug, Clone)]
enum Step {
    Data(Bytes),
    Trailers(HeaderMap),
    Fail(&'static str),
    /// Returns `Pending` once (waking at once), as a body waiting for the network would.
    Pending,
}

/// A hand-written body that plays a script; with `exact`, its size hint is the exact
/// number of data bytes left and it reports its end like `Full` does.
#[derive(Debug)]
struct Script {
    steps: VecDeque<Step>,
    exact: bool,
}

impl Script {
    fn new(steps: impl IntoIterator<Item = Step>) -> Self {
        Script {
            steps: steps.into_iter().collect(),
            exact: false,
        }
    }

    fn exact(steps: impl IntoIterator<Item = Step>) -> Self {
        Script {
            exact: true,
            ..Script::new(steps)
        }
    }
}

impl Body for Script {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match self.steps.pop_front() {
            None => Poll::Ready(None),
            Some(Step::Data(data)) => Poll::Ready(Some(Ok(Frame::data(data)))),
            Some(Step::Trailers(trailers)) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            Some(Step::Fail(msg)) => Poll::Ready(Some(Err(io::Error::other(msg)))),
            Some(Step::Pending) => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.exact && self.steps.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        if !self.exact {
            return SizeHint::default();
        }
        let left = self
            .steps
            .iter()
            .map(|s| match s {
                Step::Data(d) => d.len() as u64,
                _ => 0,
            })
            .sum();
        SizeHint::with_exact(left)
    }
}

/// A body fed through a channel, like a request body still arriving from a client.
#[derive(Debug)]
struct Chan(mpsc::Receiver<Result<Frame<Bytes>, io::Error>>);

type Tx = mpsc::Sender<Result<Frame<Bytes>, io::Error>>;

fn channel(buffer: usize) -> (Tx, Chan) {
    let (tx, rx) = mpsc::channel(buffer);
    (tx, Chan(rx))
}

fn send(tx: &Tx, chunk: &'static str) {
    tx.try_send(Ok(Frame::data(Bytes::from_static(chunk.as_bytes()))))
        .unwrap();
}

impl Body for Chan {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        self.0.poll_recv(cx)
    }
}

fn data(s: &'static str) -> Step {
    Step::Data(Bytes::from_static(s.as_bytes()))
}

fn trailers() -> HeaderMap {
    let mut map = HeaderMap::new();
    map.insert("x-checksum", HeaderValue::from_static("abc123"));
    map
}

fn poll<B>(body: &mut ReplayBody<B>) -> Polled
where
    B: Body,
    B::Error: Into<BoxError>,
{
    poll_with(body, Waker::noop())
}

fn poll_with<B>(body: &mut ReplayBody<B>, waker: &Waker) -> Polled
where
    B: Body,
    B::Error: Into<BoxError>,
{
    Pin::new(body).poll_frame(&mut Context::from_waker(waker))
}

/// Polls until the body is ready (scripted bodies wake themselves at once).
fn next<B>(body: &mut ReplayBody<B>) -> Option<Result<Frame<Bytes>, BoxError>>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    for _ in 0..1000 {
        if let Poll::Ready(frame) = poll(body) {
            return frame;
        }
    }
    panic!("body stayed pending");
}

fn next_data<B>(body: &mut ReplayBody<B>) -> Bytes
where
    B: Body,
    B::Error: Into<BoxError>,
{
    match next(body) {
        Some(Ok(frame)) => frame
            .into_data()
            .unwrap_or_else(|f| panic!("expected data, got {f:?}")),
        other => panic!("expected data, got {other:?}"),
    }
}

fn next_error<B>(body: &mut ReplayBody<B>) -> String
where
    B: Body,
    B::Error: Into<BoxError>,
{
    match next(body) {
        Some(Err(e)) => e.to_string(),
        other => panic!("expected an error, got {other:?}"),
    }
}

/// Everything one attempt sees, frame by frame.
#[derive(Debug, Default, PartialEq)]
struct Seen {
    chunks: Vec<Bytes>,
    trailers: Option<HeaderMap>,
    error: Option<String>,
}

impl Seen {
    fn bytes(&self) -> Vec<u8> {
        self.chunks.concat()
    }
}

/// Reads an attempt to its end (or first error).
fn read_all<B>(body: &mut ReplayBody<B>) -> Seen
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let mut seen = Seen::default();
    loop {
        match next(body) {
            None => return seen,
            Some(Err(e)) => {
                seen.error = Some(e.to_string());
                return seen;
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(d) => seen.chunks.push(d),
                Err(frame) => {
                    assert!(seen.trailers.is_none(), "trailers seen twice");
                    seen.trailers = Some(frame.into_trailers().unwrap());
                }
            },
        }
    }
}

fn chunks(list: &[&'static str]) -> Vec<Bytes> {
    list.iter()
        .map(|s| Bytes::from_static(s.as_bytes()))
        .collect()
}

/// Counts wake-ups.
#[derive(Default)]
struct CountingWaker(AtomicUsize);

impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

impl CountingWaker {
    fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

// === replay under the cap ===

#[test]
fn under_the_cap_every_attempt_replays_the_same_frames_and_trailers() {
    let script = Script::new([
        data("a"),
        data("bc"),
        Step::Pending,
        data("def"),
        Step::Trailers(trailers()),
    ]);
    let mut first = ReplayBody::new(script, 64);
    let mut second = first.clone();
    let expected = Seen {
        chunks: chunks(&["a", "bc", "def"]),
        trailers: Some(trailers()),
        error: None,
    };

    assert_eq!(read_all(&mut first), expected);
    assert!(first.is_replayable());
    assert!(!first.is_capped());
    drop(first);

    let mut third = second.clone();
    assert!(second.is_replayable());
    assert_eq!(read_all(&mut second), expected);
    drop(second);

    assert_eq!(read_all(&mut third), expected);
    assert!(third.is_replayable());
    // An ended attempt stays ended.
    assert!(matches!(poll(&mut third), Poll::Ready(None)));
}

#[tokio::test]
async fn collects_through_body_ext_on_every_attempt() {
    let original = ReplayBody::new(Full::new(Bytes::from_static(b"payload")), 1024);
    let retries: Vec<_> = (0..3).map(|_| original.clone()).collect();
    assert_eq!(original.collect().await.unwrap().to_bytes(), "payload");
    for retry in retries {
        assert!(retry.is_replayable());
        assert_eq!(retry.collect().await.unwrap().to_bytes(), "payload");
    }
}

#[test]
fn chunks_that_are_not_bytes_are_copied_into_bytes() {
    let mut first = ReplayBody::new(Full::new(&b"slice data"[..]), 64);
    let mut retry = first.clone();
    assert_eq!(read_all(&mut first).bytes(), b"slice data");
    drop(first);
    assert_eq!(read_all(&mut retry).bytes(), b"slice data");
}

#[test]
fn a_body_that_is_not_unpin_is_replayed() {
    let stream = futures_util::stream::unfold(0u8, |n| async move {
        (n < 3).then(|| {
            (
                Ok::<_, Infallible>(Frame::data(Bytes::from(vec![b'x' + n]))),
                n + 1,
            )
        })
    });
    let mut first = ReplayBody::new(StreamBody::new(stream), 64);
    let mut retry = first.clone();
    assert_eq!(read_all(&mut first).bytes(), b"xyz");
    drop(first);
    assert_eq!(read_all(&mut retry).bytes(), b"xyz");
}

// === the cap ===

#[test]
fn a_body_of_exactly_the_cap_stays_replayable() {
    let mut first = ReplayBody::new(Script::new([data("abc"), data("def")]), 6);
    let mut retry = first.clone();
    assert_eq!(read_all(&mut first).bytes(), b"abcdef");
    assert!(first.is_replayable());
    drop(first);
    assert_eq!(read_all(&mut retry).bytes(), b"abcdef");
}

#[test]
fn over_the_cap_the_first_attempt_completes_and_clones_are_not_replayable() {
    let script = Script::new([
        data("ab"),
        data("cd"),
        data("ef"),
        data("gh"),
        Step::Trailers(trailers()),
    ]);
    let mut first = ReplayBody::new(script, 5);
    let mut early = first.clone();

    assert_eq!(next_data(&mut first), "ab");
    assert_eq!(next_data(&mut first), "cd");
    assert!(first.is_replayable(), "4 of 5 bytes copied so far");
    assert_eq!(next_data(&mut first), "ef");
    assert!(first.is_capped());
    assert!(!first.is_replayable());
    // The attempt in progress is not affected.
    let rest = read_all(&mut first);
    assert_eq!(rest.bytes(), b"gh");
    assert_eq!(rest.trailers, Some(trailers()));
    assert_eq!(rest.error, None);

    let mut late = first.clone();
    drop(first);
    for clone in [&mut early, &mut late] {
        assert!(clone.is_capped());
        assert!(!clone.is_replayable());
        // Never a truncated body: the first frame is an error.
        let err = next_error(clone);
        assert!(err.contains("cap"), "{err}");
        assert!(matches!(poll(clone), Poll::Ready(None)));
    }
}

#[test]
fn the_current_attempt_can_be_a_clone_when_the_cap_is_crossed() {
    let mut first = ReplayBody::new(Script::new([data("ab"), data("cd"), data("ef")]), 3);
    let mut second = first.clone();
    assert_eq!(next_data(&mut first), "ab");
    drop(first);

    // The second attempt replays "ab", crosses the cap on "cd" and still gets it all.
    let mut third = second.clone();
    let seen = read_all(&mut second);
    assert_eq!(seen.bytes(), b"abcdef");
    assert_eq!(seen.error, None);
    assert!(second.is_capped());
    drop(second);
    assert!(!third.is_replayable());
    assert!(next_error(&mut third).contains("cap"));
}

#[test]
fn the_copy_shares_the_chunks_and_is_dropped_at_the_cap() {
    let [ab, cd, ef, gh] = [&b"ab"[..], b"cd", b"ef", b"gh"].map(|s| Bytes::from(s.to_vec()));
    let script = Script::new([ab.clone(), cd.clone(), ef.clone(), gh.clone()].map(Step::Data));
    let mut first = ReplayBody::new(script, 4);
    let retry = first.clone();

    assert_eq!(next_data(&mut first), "ab");
    // The attempt's frame is gone; the copy still references the same buffer.
    assert!(!ab.is_unique(), "the copy shares the chunk");
    assert_eq!(next_data(&mut first), "cd");
    assert!(!cd.is_unique());
    assert_eq!(next_data(&mut first), "ef");
    assert!(first.is_capped());
    assert!(
        ab.is_unique() && cd.is_unique() && ef.is_unique(),
        "the copy is dropped at the cap"
    );
    assert_eq!(next_data(&mut first), "gh");
    assert!(gh.is_unique(), "nothing is copied after the cap");
    drop(first);
    // Size unknown: the retry's next frame is an error.
    assert_eq!(retry.size_hint().lower(), 0);
    assert_eq!(retry.size_hint().upper(), None);
    drop(retry);

    // Under the cap, the copy lives as long as a clone does, and no longer.
    let ij = Bytes::from(b"ij".to_vec());
    let mut first = ReplayBody::new(Script::new([Step::Data(ij.clone())]), 4);
    let retry = first.clone();
    assert_eq!(read_all(&mut first).bytes(), b"ij");
    drop(first);
    assert!(!ij.is_unique());
    drop(retry);
    assert!(ij.is_unique());
}

#[test]
fn a_size_hint_above_the_cap_caps_before_any_poll() {
    let mut first = ReplayBody::new(Full::new(Bytes::from_static(b"0123456789")), 9);
    assert!(first.is_capped());
    assert!(!first.is_replayable());
    let retry = first.clone();
    assert!(!retry.is_replayable());
    // Sent once, complete.
    assert_eq!(first.size_hint().exact(), Some(10));
    assert_eq!(read_all(&mut first).bytes(), b"0123456789");

    // The lower bound decides, not the upper one.
    let mut hint = SizeHint::new();
    hint.set_upper(1_000_000);
    let body = ReplayBody::new(Hinted(hint), 16);
    assert!(!body.is_capped());
}

/// A body with a given size hint and no data (only its hint matters).
#[derive(Debug)]
struct Hinted(SizeHint);

impl Body for Hinted {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(None)
    }

    fn size_hint(&self) -> SizeHint {
        self.0
    }
}

// === errors ===

#[test]
fn an_inner_error_reaches_the_attempt_and_stops_replays() {
    let (tx, channel) = channel(4);
    let mut first = ReplayBody::new(channel, 1024);
    let mut retry = first.clone();

    let ab = Bytes::from(b"ab".to_vec());
    tx.try_send(Ok(Frame::data(ab.clone()))).unwrap();
    assert_eq!(next_data(&mut first), "ab");
    assert!(poll(&mut first).is_pending());
    tx.try_send(Err(io::Error::other("connection reset by client")))
        .unwrap();
    let err = next_error(&mut first);
    assert!(err.contains("connection reset by client"), "{err}");
    assert!(!first.is_replayable());
    assert!(!first.is_capped());
    assert!(ab.is_unique(), "the copy is released once the body failed");
    drop(first);

    assert!(!retry.is_replayable());
    let err = next_error(&mut retry);
    assert!(err.contains("failed during an earlier attempt"), "{err}");
}

#[test]
fn an_error_during_a_later_attempt_reaches_that_attempt() {
    let script = Script::new([data("ab"), data("cd"), Step::Fail("disk gone"), data("ef")]);
    let mut first = ReplayBody::new(script, 1024);
    let mut second = first.clone();
    assert_eq!(next_data(&mut first), "ab");
    drop(first);

    let mut third = second.clone();
    assert!(second.is_replayable());
    let seen = read_all(&mut second);
    assert_eq!(seen.bytes(), b"abcd");
    assert_eq!(seen.error.as_deref(), Some("disk gone"));
    assert!(!second.is_replayable());
    drop(second);

    assert!(next_error(&mut third).contains("earlier attempt"));
}

// === hand-over between attempts ===

#[test]
fn a_clone_of_an_attempt_dropped_half_way_yields_every_byte_once_in_order() {
    let (tx, channel) = channel(8);
    let mut first = ReplayBody::new(channel, 1024);
    let mut second = first.clone();

    send(&tx, "a");
    send(&tx, "b");
    assert_eq!(next_data(&mut first), "a");
    assert_eq!(next_data(&mut first), "b");
    // The response arrived before the body was sent: the attempt is dropped.
    drop(first);

    let mut third = second.clone();
    assert_eq!(next_data(&mut second), "a");
    assert_eq!(next_data(&mut second), "b");
    // Caught up with the sender: waits for it like the first attempt would have.
    assert!(poll(&mut second).is_pending());
    send(&tx, "c");
    send(&tx, "d");
    tx.try_send(Ok(Frame::trailers(trailers()))).unwrap();
    drop(tx);
    let rest = read_all(&mut second);
    assert_eq!(rest.chunks, chunks(&["c", "d"]));
    assert_eq!(rest.trailers, Some(trailers()));
    drop(second);

    let all = read_all(&mut third);
    assert_eq!(all.chunks, chunks(&["a", "b", "c", "d"]));
    assert_eq!(all.trailers, Some(trailers()));
    assert_eq!(all.error, None);
}

#[test]
fn a_clone_polled_while_the_holder_is_alive_waits_until_it_is_dropped() {
    let mut first = ReplayBody::new(Script::new([data("a"), data("b"), data("c")]), 64);
    let mut second = first.clone();
    assert_eq!(next_data(&mut first), "a");

    let counter = Arc::new(CountingWaker::default());
    let waker = Waker::from(Arc::clone(&counter));
    assert!(poll_with(&mut second, &waker).is_pending());
    assert!(poll_with(&mut second, &waker).is_pending());
    assert!(!second.is_end_stream());
    assert_eq!(counter.count(), 0);

    drop(first);
    assert_eq!(counter.count(), 1, "woken once when the holder is dropped");
    let seen = read_all(&mut second);
    assert_eq!(seen.chunks, chunks(&["a", "b", "c"]));
}

#[test]
fn a_holder_that_reached_its_end_lets_the_waiting_clone_go_without_being_dropped() {
    let mut first = ReplayBody::new(Script::new([data("a"), Step::Trailers(trailers())]), 64);
    let mut second = first.clone();
    assert_eq!(next_data(&mut first), "a");

    let counter = Arc::new(CountingWaker::default());
    let waker = Waker::from(Arc::clone(&counter));
    assert!(poll_with(&mut second, &waker).is_pending());

    let rest = read_all(&mut first);
    assert_eq!(rest.trailers, Some(trailers()));
    assert_eq!(counter.count(), 1);
    // `first` is still alive.
    assert!(first.is_end_stream());
    let seen = read_all(&mut second);
    assert_eq!(seen.chunks, chunks(&["a"]));
    assert_eq!(seen.trailers, Some(trailers()));
    drop(first);
}

#[tokio::test]
async fn a_retry_task_waits_for_the_previous_attempt_to_be_dropped() {
    let (tx, channel) = channel(8);
    let mut first = ReplayBody::new(channel, 1024);
    let retry = first.clone();
    tx.send(Ok(Frame::data(Bytes::from_static(b"hello "))))
        .await
        .unwrap();
    assert_eq!(next_data(&mut first), "hello ");

    let task = tokio::spawn(async move { retry.collect().await.map(|c| c.to_bytes()) });
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    // Single-threaded runtime: the task has run, and waits for `first`.
    assert!(!task.is_finished());

    drop(first);
    tx.send(Ok(Frame::data(Bytes::from_static(b"world"))))
        .await
        .unwrap();
    drop(tx);
    let collected = tokio::time::timeout(HANG_GUARD, task)
        .await
        .expect("the retry was never woken");
    assert_eq!(collected.unwrap().unwrap(), "hello world");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_on_other_threads_hand_the_body_over() {
    let (tx, channel) = channel(1);
    let mut attempt = ReplayBody::new(channel, 1 << 20);
    let producer = tokio::spawn(async move {
        for i in 0..200u32 {
            tx.send(Ok(Frame::data(Bytes::from(i.to_be_bytes().to_vec()))))
                .await
                .unwrap();
        }
    });
    let expected: Vec<u8> = (0..200u32).flat_map(u32::to_be_bytes).collect();

    // Each attempt reads some frames on one task and is dropped there, while the next
    // attempt, on another task, is already waiting for the inner body.
    for frames in [3usize, 17, 40] {
        let mut next = attempt.clone();
        // The current attempt takes the inner body before the next one is polled.
        let mut got = BytesMut::new();
        got.extend_from_slice(&attempt.frame().await.unwrap().unwrap().into_data().unwrap());
        let reader = tokio::spawn(async move {
            for _ in 1..frames {
                let frame = attempt.frame().await.unwrap().unwrap();
                got.extend_from_slice(&frame.into_data().unwrap());
            }
            got
        });
        let waiting = tokio::spawn(async move {
            let first = next.frame().await.unwrap().unwrap();
            (next, first)
        });
        let got = tokio::time::timeout(HANG_GUARD, reader)
            .await
            .expect("reader hung")
            .unwrap();
        assert_eq!(got[..], expected[..got.len()]);
        let (next, first) = tokio::time::timeout(HANG_GUARD, waiting)
            .await
            .expect("the next attempt was never woken")
            .unwrap();
        assert_eq!(first.into_data().unwrap()[..], expected[..4]);
        // `next` has started; the following attempt is a fresh clone of it.
        attempt = next.clone();
        drop(next);
    }
    let all = attempt.collect().await.unwrap().to_bytes();
    assert_eq!(all[..], expected[..]);
    producer.await.unwrap();
}

// === empty bodies ===

#[test]
fn empty_bodies_take_the_allocation_free_path() {
    fn check<B: Body<Error: Into<BoxError>>>(body: B) {
        let mut body = ReplayBody::new(body, 0);
        assert!(format!("{body:?}").contains("empty: true"), "{body:?}");
        assert!(body.is_end_stream());
        assert_eq!(body.size_hint().exact(), Some(0));
        assert!(body.is_replayable());
        assert!(!body.is_capped());
        let mut clone = body.clone();
        assert!(matches!(poll(&mut body), Poll::Ready(None)));
        assert!(matches!(poll(&mut clone), Poll::Ready(None)));
        assert!(clone.is_end_stream());
    }
    check(Empty::<Bytes>::new());
    check(Full::new(Bytes::new()));
    check(String::new());
    check(Script::exact([]));
}

#[test]
fn a_body_with_no_data_but_trailers_still_sends_and_replays_them() {
    let mut first = ReplayBody::new(Script::exact([Step::Trailers(trailers())]), 0);
    assert_eq!(first.size_hint().exact(), Some(0));
    assert!(!first.is_end_stream());
    let mut retry = first.clone();
    assert_eq!(read_all(&mut first).trailers, Some(trailers()));
    drop(first);
    assert!(retry.is_replayable());
    assert_eq!(read_all(&mut retry).trailers, Some(trailers()));
}

// === size_hint and is_end_stream ===

#[test]
fn size_hint_and_end_of_stream_follow_each_attempt() {
    let mut first = ReplayBody::new(Script::exact([data("ab"), data("cde")]), 64);
    let mut second = first.clone();
    assert_eq!(first.size_hint().exact(), Some(5));
    assert!(!first.is_end_stream());
    // A clone that has not started: the whole body, while `first` holds it.
    assert_eq!(second.size_hint().exact(), Some(5));
    assert!(!second.is_end_stream());

    assert_eq!(next_data(&mut first), "ab");
    assert_eq!(first.size_hint().exact(), Some(3));
    assert_eq!(second.size_hint().exact(), Some(5));
    assert_eq!(next_data(&mut first), "cde");
    assert_eq!(first.size_hint().exact(), Some(0));
    assert!(first.is_end_stream(), "the inner body says it has ended");
    drop(first);

    // Two bytes buffered plus three bytes, all replayed from the copy now.
    assert_eq!(second.size_hint().exact(), Some(5));
    assert!(!second.is_end_stream());
    assert_eq!(next_data(&mut second), "ab");
    assert_eq!(second.size_hint().exact(), Some(3));
    assert!(!second.is_end_stream());
    assert_eq!(next_data(&mut second), "cde");
    assert_eq!(second.size_hint().exact(), Some(0));
    assert!(second.is_end_stream());
    assert!(matches!(poll(&mut second), Poll::Ready(None)));
    assert!(second.is_end_stream());
    assert_eq!(second.size_hint().exact(), Some(0));
}

#[test]
fn size_hint_is_the_buffered_length_plus_the_inner_remainder() {
    // Exact remainder: buffered "ab" + 3 bytes not read yet.
    let mut first = ReplayBody::new(Script::exact([data("ab"), data("cde")]), 64);
    let mut second = first.clone();
    assert_eq!(next_data(&mut first), "ab");
    drop(first);
    assert_eq!(second.size_hint().exact(), Some(5));
    assert_eq!(next_data(&mut second), "ab");
    assert_eq!(second.size_hint().exact(), Some(3));

    // Unknown remainder: at least what is buffered, no upper bound.
    let (tx, channel) = channel(4);
    let mut first = ReplayBody::new(channel, 64);
    let second = first.clone();
    send(&tx, "abcd");
    assert_eq!(next_data(&mut first), "abcd");
    drop(first);
    assert_eq!(second.size_hint().lower(), 4);
    assert_eq!(second.size_hint().upper(), None);
    assert!(!second.is_end_stream());
}

#[test]
fn replay_bodies_are_send_sync_and_unpin_like_their_inner_body() {
    fn send_sync_unpin<T: Send + Sync + Unpin>() {}
    fn send_unpin<T: Send + Unpin>() {}
    // For every `Send` body, `Unpin` or not, `Sync` or not.
    fn any_send_body<B: Body + Send>() {
        send_unpin::<ReplayBody<B>>();
    }
    fn any_send_sync_body<B: Body + Send + Sync>() {
        send_sync_unpin::<ReplayBody<B>>();
    }
    any_send_body::<http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>>();
    any_send_sync_body::<Full<Bytes>>();
}

// === properties ===

/// A script from `data` cut at `cuts`, with optional pauses and trailers.
fn script(data: &[u8], cuts: &[usize], pauses: bool, with_trailers: bool, exact: bool) -> Script {
    let mut bounds: Vec<usize> = cuts.iter().map(|&c| c.min(data.len())).collect();
    bounds.sort_unstable();
    let mut steps = Vec::new();
    let mut start = 0;
    for end in bounds.into_iter().chain([data.len()]) {
        steps.push(Step::Data(Bytes::copy_from_slice(&data[start..end])));
        if pauses {
            steps.push(Step::Pending);
        }
        start = end;
    }
    if with_trailers {
        steps.push(Step::Trailers(trailers()));
    }
    Script {
        steps: steps.into(),
        exact,
    }
}

proptest! {
    #[test]
    fn every_attempt_sees_a_prefix_and_replayable_attempts_see_everything(
        data in proptest::collection::vec(any::<u8>(), 0..64),
        chunk_cuts in proptest::collection::vec(0usize..64, 0..8),
        cap in 0usize..80,
        stops in proptest::collection::vec(0usize..12, 0..5),
        pauses in any::<bool>(),
        with_trailers in any::<bool>(),
        exact in any::<bool>(),
    ) {
        let body = script(&data, &chunk_cuts, pauses, with_trailers, exact);
        let capped_from_start = exact && data.len() > cap;
        let mut attempt = ReplayBody::new(body, cap);
        let mut read_from_inner = 0;

        // Each attempt reads `stop` frames and is dropped; the last one reads to the end.
        let last = stops.len();
        for (i, stop) in stops.into_iter().chain([usize::MAX]).enumerate() {
            let next_attempt = attempt.clone();
            let replayable = attempt.is_replayable();

            let mut seen = Seen::default();
            let mut ended = false;
            for _ in 0..stop {
                match next(&mut attempt) {
                    None => { ended = true; break; }
                    Some(Err(e)) => { seen.error = Some(e.to_string()); break; }
                    Some(Ok(frame)) => match frame.into_data() {
                        Ok(d) => seen.chunks.push(d),
                        Err(frame) => {
                            prop_assert!(seen.trailers.is_none());
                            seen.trailers = frame.into_trailers().ok();
                        }
                    },
                }
            }
            let bytes = seen.bytes();
            // Never duplicated, reordered or invented: always a prefix of the original.
            prop_assert!(data.starts_with(&bytes), "attempt {} saw {:?}", i, bytes);
            read_from_inner = read_from_inner.max(bytes.len());
            if replayable || i == 0 {
                prop_assert_eq!(&seen.error, &None);
            }
            if ended {
                prop_assert_eq!(&bytes, &data);
                prop_assert_eq!(seen.trailers.is_some(), with_trailers);
            }
            if i == last && replayable {
                prop_assert!(ended, "a replayable last attempt reads everything");
                prop_assert_eq!(seen.trailers.is_some(), with_trailers);
            }
            prop_assert_eq!(
                attempt.is_capped(),
                capped_from_start || read_from_inner > cap
            );
            prop_assert_eq!(attempt.is_replayable(), !attempt.is_capped());

            drop(attempt);
            attempt = next_attempt;
        }
    }
}
