//! Timeouts that cost nothing when the work is ready at once.
//!
//! A tokio timeout reads the clock and takes a handle to the runtime's timer when it is
//! made, whether or not its timer is ever needed. Most bounded steps of a guarded
//! request (a MemoryStore call, a buffered body, a handler's one-frame body) finish on
//! their first poll, so these poll the work once before they make the timer.

use std::future::{Future, poll_fn};
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;

/// `work`, unless it is still running `limit` after its second poll (`None`). The
/// bound starts when the work first waits, which for work that is ready at once is
/// never.
pub(crate) async fn within<F: Future>(limit: Duration, work: F) -> Option<F::Output> {
    let mut work = std::pin::pin!(work);
    if let Poll::Ready(out) = poll_fn(|cx| Poll::Ready(work.as_mut().poll(cx))).await {
        return Some(out);
    }
    tokio::time::timeout(limit, work).await.ok()
}

/// `work`, unless it is still running at `until` (`None`); no timer is made if it is
/// ready at its first poll.
pub(crate) async fn until<F: Future>(until: Instant, work: F) -> Option<F::Output> {
    let mut work = std::pin::pin!(work);
    if let Poll::Ready(out) = poll_fn(|cx| Poll::Ready(work.as_mut().poll(cx))).await {
        return Some(out);
    }
    tokio::time::timeout_at(until, work).await.ok()
}
