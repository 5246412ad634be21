//! A request body that can be sent more than once: [`ReplayBody`] streams the first
//! attempt while keeping a capped copy, and each clone replays that copy for the next
//! attempt before reading on from where the previous attempt stopped.
//!
//! ```
//! use bytes::Bytes;
//! use http_body::Body as _;
//! use http_body_util::{BodyExt, Full};
//! use retrysafe::ReplayBody;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let first = ReplayBody::new(Full::new(Bytes::from_static(b"hello")), 64 * 1024);
//! // Keep a clone for a retry before the first attempt is sent.
//! let retry = first.clone();
//!
//! // The first attempt streams straight from the original body.
//! assert_eq!(first.collect().await?.to_bytes(), "hello");
//!
//! // The retry replays the copy, byte for byte.
//! assert!(retry.is_replayable());
//! assert_eq!(retry.size_hint().exact(), Some(5));
//! assert_eq!(retry.collect().await?.to_bytes(), "hello");
//! # Ok(())
//! # }
//! ```

use std::error::Error as StdError;
use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker, ready};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

type BoxError = Box<dyn StdError + Send + Sync>;

/// `Shared::flags` bit: the copy was dropped because it would have exceeded the cap.
const CAPPED: u8 = 1;
/// `Shared::flags` bit: the inner body failed.
const FAILED: u8 = 2;
/// `Shared::flags` bit: the wrapped body has ended; every byte of it was read.
const COMPLETE: u8 = 4;

/// A request body that can be replayed for a retry, copied lazily up to a cap.
///
/// The first attempt streams straight from the wrapped body while every data chunk (a
/// reference-counted [`Bytes`], so usually without copying the payload) and the trailers
/// are kept, up to `cap` bytes of data. Nothing is buffered before the first send.
///
/// A [`Clone`] is the body of the next attempt: it first replays the kept chunks, then
/// reads on from the wrapped body where the previous attempt stopped, so an attempt that
/// got its response before its body was fully sent loses nothing. Exactly one clone reads
/// the wrapped body at a time; a clone polled while another one still holds it (an old
/// attempt's body that the client has not dropped yet) waits, and is woken when the
/// holder ends or is dropped.
///
/// When the copy would exceed `cap`, it is dropped: the attempt in progress goes on
/// streaming normally, but the body is no longer replayable ([`is_capped`] and
/// [`is_replayable`] tell), and a clone that would need the dropped bytes fails with an
/// error instead of sending a truncated body. A body whose size hint already says it is
/// larger than `cap` is never copied at all. An error from the wrapped body reaches the
/// attempt that read it and makes the body not replayable.
///
/// A body that is already at its end when wrapped (a `GET` with
/// `http_body_util::Empty`, an empty `Full`) takes a fast path that allocates nothing;
/// otherwise `new` allocates the shared state once and [`Clone`] only bumps a reference
/// count.
///
/// [`is_capped`]: ReplayBody::is_capped
/// [`is_replayable`]: ReplayBody::is_replayable
///
/// # Example
///
/// ```
/// use bytes::Bytes;
/// use http_body_util::{BodyExt, Full};
/// use retrysafe::ReplayBody;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// // 11 bytes with room for 8: sent once, not retried.
/// let first = ReplayBody::new(Full::new(Bytes::from_static(b"hello world")), 8);
/// assert!(first.is_capped());
/// let retry = first.clone();
/// assert_eq!(first.collect().await?.to_bytes(), "hello world");
/// assert!(!retry.is_replayable());
///
/// // A body without data costs nothing to wrap and is always replayable.
/// let empty = ReplayBody::new(http_body_util::Empty::<Bytes>::new(), 8);
/// assert!(empty.is_replayable());
/// assert!(empty.clone().collect().await?.to_bytes().is_empty());
/// # Ok(())
/// # }
/// ```
pub struct ReplayBody<B> {
    kind: Kind<B>,
}

enum Kind<B> {
    /// The wrapped body had ended before it was wrapped: nothing to read, copy or share.
    Empty,
    /// A clone not polled yet: the shared copy only.
    Fresh(Arc<Shared<B>>),
    /// A handle that reads. Boxed, as `Fresh` holds a pointer only: a request is moved
    /// many times on its way through a client (hyper's dispatch moves it half a dozen
    /// times), and a body two words wide keeps every one of those copies small.
    Shared(Box<Handle<B>>),
}

/// One attempt's view of a shared, replayable body.
struct Handle<B> {
    shared: Arc<Shared<B>>,
    /// The reader state, while this handle holds it.
    state: Option<Pin<Box<State<B>>>>,
    /// How far this handle has got.
    cursor: Cursor,
    /// This handle has returned its end (or an error) and handed the state back.
    finished: bool,
}

/// What every clone shares.
struct Shared<B> {
    /// The reader state while no handle holds it, and the handles waiting for it.
    slot: Mutex<Slot<B>>,
    /// `CAPPED` and `FAILED`, readable without taking the state.
    flags: AtomicU8,
    cap: usize,
    /// The wrapped body's size hint before it was read: the size of the whole body.
    whole_size: SizeHint,
}

struct Slot<B> {
    state: Option<Pin<Box<State<B>>>>,
    waiters: Vec<Waker>,
}

pin_project! {
    /// The wrapped body and the copy of what has been read from it.
    struct State<B> {
        // `None` once the wrapped body has ended or failed.
        #[pin]
        inner: Option<B>,
        // Every data chunk read so far, unless `capped` or `failed`.
        chunks: Vec<Bytes>,
        trailers: Option<HeaderMap>,
        // Data frames read from the wrapped body so far.
        frames: usize,
        // Data bytes read from the wrapped body so far.
        bytes: u64,
        capped: bool,
        failed: bool,
    }
}

/// The position of one handle in the stream of frames.
#[derive(Debug, Default, Clone, Copy)]
struct Cursor {
    /// Data frames this handle has returned.
    frames: usize,
    /// Data bytes this handle has returned.
    bytes: u64,
    trailers_sent: bool,
}

/// Why a clone could not produce the whole body.
#[derive(Debug, Clone, Copy)]
enum Unavailable {
    Capped,
    Failed,
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Unavailable::Capped => {
                "request body cannot be replayed: it exceeded the replay buffer cap"
            }
            Unavailable::Failed => {
                "request body cannot be replayed: it failed during an earlier attempt"
            }
        })
    }
}

impl StdError for Unavailable {}

impl<B> ReplayBody<B> {
    /// Wraps `body`, keeping a copy of at most `cap` bytes of data for replays.
    ///
    /// Nothing is read or copied here. A body that is already at its end is dropped and
    /// replaced by an allocation-free empty body; a body whose size hint has a lower
    /// bound above `cap` is never copied (it is capped from the start).
    pub fn new(body: B, cap: usize) -> Self
    where
        B: Body,
    {
        if body.is_end_stream() {
            return ReplayBody { kind: Kind::Empty };
        }
        let whole_size = body.size_hint();
        let capped = whole_size.lower() > cap as u64;
        let shared = Arc::new(Shared {
            slot: Mutex::new(Slot {
                state: None,
                waiters: Vec::new(),
            }),
            flags: AtomicU8::new(if capped { CAPPED } else { 0 }),
            cap,
            whole_size,
        });
        let state = Box::pin(State {
            inner: Some(body),
            chunks: Vec::new(),
            trailers: None,
            frames: 0,
            bytes: 0,
            capped,
            failed: false,
        });
        ReplayBody {
            kind: Kind::Shared(Box::new(Handle {
                shared,
                state: Some(state),
                cursor: Cursor::default(),
                finished: false,
            })),
        }
    }

    /// Whether a clone of this body can be sent as a complete copy of the original:
    /// the copy was never capped and the wrapped body has not failed.
    ///
    /// It can turn false while an attempt is streaming, never back to true.
    #[doc(hidden)]
    pub fn is_replayable(&self) -> bool {
        self.flags()
            .is_none_or(|flags| flags & (CAPPED | FAILED) == 0)
    }

    /// The shared copy's flags; `None` for an empty body.
    fn flags(&self) -> Option<u8> {
        match &self.kind {
            Kind::Empty => None,
            Kind::Fresh(shared) => Some(shared.flags()),
            Kind::Shared(handle) => Some(handle.shared.flags()),
        }
    }

    /// Whether the whole body is held in the copy: the wrapped body has ended, and the
    /// copy was neither capped nor failed. A clone then replays it without waiting for
    /// any other attempt (a hedge is sent only then).
    #[doc(hidden)]
    pub fn is_buffered(&self) -> bool {
        self.flags().is_none_or(|flags| flags == COMPLETE)
    }

    /// Whether the copy was dropped (or never started) because the body is larger than
    /// the cap. A capped body is sent once and not retried.
    #[doc(hidden)]
    pub fn is_capped(&self) -> bool {
        self.flags().is_some_and(|flags| flags & CAPPED != 0)
    }
}

impl<B> Clone for ReplayBody<B> {
    /// Returns the body of the next attempt: it starts from the beginning, replaying the
    /// copy. Allocates nothing (its first poll allocates its reader handle, a few
    /// words).
    fn clone(&self) -> Self {
        let kind = match &self.kind {
            Kind::Empty => Kind::Empty,
            Kind::Fresh(shared) => Kind::Fresh(Arc::clone(shared)),
            Kind::Shared(handle) => Kind::Fresh(Arc::clone(&handle.shared)),
        };
        ReplayBody { kind }
    }
}

impl<B> Body for ReplayBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let kind = &mut self.get_mut().kind;
        if let Kind::Fresh(shared) = kind {
            // Its first poll: it takes the place of the reading handle.
            *kind = Kind::Shared(Box::new(Handle::fresh(Arc::clone(shared))));
        }
        match kind {
            Kind::Empty | Kind::Fresh(_) => Poll::Ready(None),
            Kind::Shared(handle) => handle.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Empty => true,
            Kind::Fresh(shared) => shared.ends_at_start(),
            Kind::Shared(handle) => handle.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Empty => SizeHint::with_exact(0),
            Kind::Fresh(shared) => shared.size_from_start(),
            Kind::Shared(handle) => handle.size_hint(),
        }
    }
}

impl<B> fmt::Debug for ReplayBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("ReplayBody");
        match &self.kind {
            Kind::Empty => {
                d.field("empty", &true);
            }
            Kind::Fresh(shared) => {
                d.field("cap", &shared.cap)
                    .field("replayable", &self.is_replayable())
                    .field("capped", &self.is_capped())
                    .field("holds_inner", &false)
                    .field("finished", &false)
                    .field("frames_sent", &0)
                    .field("bytes_sent", &0);
            }
            Kind::Shared(handle) => {
                d.field("cap", &handle.shared.cap)
                    .field("replayable", &self.is_replayable())
                    .field("capped", &self.is_capped())
                    .field("holds_inner", &handle.state.is_some())
                    .field("finished", &handle.finished)
                    .field("frames_sent", &handle.cursor.frames)
                    .field("bytes_sent", &handle.cursor.bytes);
            }
        }
        d.finish()
    }
}

// === impl Handle ===

impl<B> Handle<B> {
    /// A handle that starts from the beginning, its reader state still parked.
    fn fresh(shared: Arc<Shared<B>>) -> Self {
        Handle {
            shared,
            state: None,
            cursor: Cursor::default(),
            finished: false,
        }
    }

    /// Gives the reader state back to the slot, waking any handle waiting for it.
    fn release(&mut self) {
        if let Some(state) = self.state.take() {
            // The last handle has no one to hand the state to: just drop it.
            if Arc::strong_count(&self.shared) > 1 {
                self.shared.put_back(state);
            }
        }
    }
}

impl<B> Handle<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.finished {
            return Poll::Ready(None);
        }
        if self.state.is_none() {
            self.state = self.shared.take_or_wait(cx);
        }
        let Some(state) = self.state.as_mut() else {
            return Poll::Pending;
        };
        let poll = self.cursor.step(state.as_mut(), &self.shared, cx);
        if let Poll::Ready(None | Some(Err(_))) = poll {
            // Done with the wrapped body: let a waiting clone have it now rather than
            // when this one is dropped.
            self.finished = true;
            self.release();
        }
        poll
    }

    fn is_end_stream(&self) -> bool {
        if self.finished {
            return true;
        }
        // A handle without the state has not started (it gives the state back only
        // once finished): it sees the body from its start.
        match &self.state {
            Some(state) => self.cursor.at_end(state),
            None => self.shared.ends_at_start(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        if self.finished {
            return SizeHint::with_exact(0);
        }
        match &self.state {
            Some(state) => self.cursor.size_hint(state),
            None => self.shared.size_from_start(),
        }
    }
}

impl<B> Drop for Handle<B> {
    fn drop(&mut self) {
        self.release();
    }
}

// === impl Shared ===

impl<B: Body> Shared<B> {
    /// For a handle that has not started: whether the body has no frame for it, as
    /// the parked reader state says (not while another handle holds the state).
    fn ends_at_start(&self) -> bool {
        self.lock()
            .state
            .as_deref()
            .is_some_and(|state| Cursor::default().at_end(state))
    }

    /// For a handle that has not started: the size of what it will send. While another
    /// handle holds the reader state, the whole body.
    fn size_from_start(&self) -> SizeHint {
        match self.lock().state.as_deref() {
            Some(state) => Cursor::default().size_hint(state),
            None => self.whole_size,
        }
    }
}

impl<B> Shared<B> {
    fn flags(&self) -> u8 {
        self.flags.load(Ordering::Acquire)
    }

    fn set_flag(&self, flag: u8) {
        self.flags.fetch_or(flag, Ordering::AcqRel);
    }

    fn lock(&self) -> MutexGuard<'_, Slot<B>> {
        // Nothing panics while the lock is held; a poisoned slot is still consistent.
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the parked reader state, or registers the task to be woken when it is
    /// given back.
    fn take_or_wait(&self, cx: &Context<'_>) -> Option<Pin<Box<State<B>>>> {
        let mut slot = self.lock();
        let state = slot.state.take();
        if state.is_none() && !slot.waiters.iter().any(|w| w.will_wake(cx.waker())) {
            slot.waiters.push(cx.waker().clone());
        }
        state
    }

    fn put_back(&self, state: Pin<Box<State<B>>>) {
        let waiters = {
            let mut slot = self.lock();
            slot.state = Some(state);
            std::mem::take(&mut slot.waiters)
        };
        for waker in waiters {
            waker.wake();
        }
    }
}

// === impl Cursor ===

impl Cursor {
    /// Returns the next frame for this handle: a replayed chunk, replayed trailers, or
    /// a frame read from the wrapped body (copied on the way unless capped).
    fn step<B>(
        &mut self,
        state: Pin<&mut State<B>>,
        shared: &Shared<B>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        match self.replay(state.as_ref().get_ref()) {
            Some(frame) => Poll::Ready(Some(frame)),
            None => self.read_on(state, shared, cx),
        }
    }

    /// What earlier attempts read and this handle has not sent yet: a chunk, the
    /// trailers, or the failure that ended the copy; `None` when it has caught up.
    fn replay<B>(&mut self, state: &State<B>) -> Option<Result<Frame<Bytes>, BoxError>> {
        if self.frames < state.frames {
            let chunk = if state.failed {
                Err(Unavailable::Failed)
            } else {
                state.chunks.get(self.frames).ok_or(Unavailable::Capped)
            };
            return Some(match chunk {
                Ok(chunk) => {
                    self.frames += 1;
                    self.bytes += chunk.len() as u64;
                    Ok(Frame::data(chunk.clone()))
                }
                Err(unavailable) => Err(unavailable.into()),
            });
        }
        if let (false, Some(trailers)) = (self.trailers_sent, state.trailers.as_ref()) {
            self.trailers_sent = true;
            return Some(Ok(Frame::trailers(trailers.clone())));
        }
        state.failed.then(|| Err(Unavailable::Failed.into()))
    }

    /// The next frame read from the wrapped body, copied on the way unless capped (or
    /// the end of the body, or its failure, recorded for every handle).
    fn read_on<B>(
        &mut self,
        state: Pin<&mut State<B>>,
        shared: &Shared<B>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        let mut state = state.project();
        let Some(inner) = state.inner.as_mut().as_pin_mut() else {
            return Poll::Ready(None);
        };
        let frame = match ready!(inner.poll_frame(cx)) {
            Some(Ok(frame)) => frame.map_data(|mut data| data.copy_to_bytes(data.remaining())),
            Some(Err(error)) => {
                state.inner.set(None);
                *state.failed = true;
                *state.chunks = Vec::new();
                shared.set_flag(FAILED);
                return Poll::Ready(Some(Err(error.into())));
            }
            None => {
                state.inner.set(None);
                shared.set_flag(COMPLETE);
                return Poll::Ready(None);
            }
        };
        if state
            .inner
            .as_ref()
            .get_ref()
            .as_ref()
            .is_some_and(Body::is_end_stream)
        {
            shared.set_flag(COMPLETE);
        }
        if let Some(data) = frame.data_ref() {
            let len = data.len() as u64;
            *state.frames += 1;
            *state.bytes += len;
            self.frames += 1;
            self.bytes += len;
            if !*state.capped {
                if *state.bytes > shared.cap as u64 {
                    *state.capped = true;
                    *state.chunks = Vec::new();
                    shared.set_flag(CAPPED);
                } else {
                    state.chunks.push(data.clone());
                }
            }
        } else if let Some(trailers) = frame.trailers_ref() {
            self.trailers_sent = true;
            *state.trailers = Some(trailers.clone());
        }
        Poll::Ready(Some(Ok(frame)))
    }

    /// Whether this handle has nothing left to return.
    fn at_end<B: Body>(&self, state: &State<B>) -> bool {
        self.frames == state.frames
            && (self.trailers_sent || state.trailers.is_none())
            && !state.failed
            && state.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    /// What is left for this handle: the copy it has not replayed yet plus what the
    /// wrapped body has not produced yet.
    fn size_hint<B: Body>(&self, state: &State<B>) -> SizeHint {
        if state.failed || (self.frames < state.frames && state.capped) {
            // The next frame is an error.
            return SizeHint::new();
        }
        let replay = state.bytes.saturating_sub(self.bytes);
        let rest = state
            .inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint);
        let mut hint = SizeHint::new();
        hint.set_lower(replay.saturating_add(rest.lower()));
        if let Some(upper) = rest.upper() {
            hint.set_upper(replay.saturating_add(upper));
        }
        hint
    }
}
