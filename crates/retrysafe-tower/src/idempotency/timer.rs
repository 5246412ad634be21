//! Timeouts that cost nothing when the work is ready at once.
//!
//! A tokio timeout reads the clock and takes a handle to the runtime's timer when it is
//! made, whether or not its timer is ever needed. Most bounded steps of a guarded
//! request (a MemoryStore call, a buffered body, a handler's one-frame body) finish on
//! their first poll, so these poll the work once before they make the timer.
//!
//! One hand-written future, not an `async fn` around `tokio::time::timeout`: that held
//! the work twice (its argument, and the pinned local it was moved to), and these
//! futures lie inside the request's boxed futures, whose every byte is copied.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

/// `work`, unless it is still running `limit` after its first poll (`None`). The
/// bound starts when the work first waits, which for work that is ready at once is
/// never.
pub(crate) fn within<F: Future>(limit: Duration, work: F) -> Within<F> {
    Within {
        work,
        limit: Limit::After(limit),
        timer: None,
    }
}

/// `work`, unless it is still running at `until` (`None`); no timer is made if it is
/// ready at its first poll.
pub(crate) fn until<F: Future>(until: Instant, work: F) -> Within<F> {
    Within {
        work,
        limit: Limit::At(until),
        timer: None,
    }
}

#[derive(Clone, Copy)]
enum Limit {
    /// This long after the work first waits.
    After(Duration),
    /// At this instant.
    At(Instant),
}

pin_project! {
    /// The future of [`within`] and [`until`].
    pub(crate) struct Within<F> {
        #[pin]
        work: F,
        limit: Limit,
        // Made when the work first waits.
        #[pin]
        timer: Option<Sleep>,
    }
}

impl<F: Future> Future for Within<F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        // The work first, every time: an answer that is ready is never dropped for a
        // timer that fired at the same poll.
        if let Poll::Ready(out) = this.work.poll(cx) {
            return Poll::Ready(Some(out));
        }
        if this.timer.is_none() {
            let at = match *this.limit {
                Limit::After(limit) => Instant::now().checked_add(limit),
                Limit::At(at) => Some(at),
            };
            // A bound too far to represent is no bound.
            let Some(at) = at else {
                return Poll::Pending;
            };
            this.timer.set(Some(tokio::time::sleep_until(at)));
        }
        match this.timer.as_pin_mut() {
            Some(timer) => timer.poll(cx).map(|()| None),
            None => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{until, within};

    // On the paused clock: ready work needs no timer; waiting work is bounded from its
    // first wait (not from when the future was made); work that answers in time is
    // answered; `until` is bounded by its instant.
    #[tokio::test(start_paused = true)]
    async fn bounds_start_at_the_first_wait() {
        assert_eq!(within(Duration::ZERO, async { 7 }).await, Some(7));

        // Made 10 s before it is first polled: its bound starts at the first wait, so
        // the work (3 s from its first poll) is cut at 2 s from then, not at once.
        let made = within(Duration::from_secs(2), async {
            tokio::time::sleep(Duration::from_secs(3)).await;
        });
        tokio::time::advance(Duration::from_secs(10)).await;
        let start = Instant::now();
        assert_eq!(made.await, None);
        assert_eq!(start.elapsed(), Duration::from_secs(2));

        let start = Instant::now();
        let answered = within(Duration::from_secs(5), async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            "in time"
        });
        assert_eq!(answered.await, Some("in time"));
        assert_eq!(start.elapsed(), Duration::from_secs(1));

        let start = Instant::now();
        let at = start + Duration::from_millis(1500);
        assert_eq!(until(at, std::future::pending::<()>()).await, None);
        assert_eq!(start.elapsed(), Duration::from_millis(1500));

        let far = within(Duration::MAX, async { "no bound" });
        assert_eq!(far.await, Some("no bound"));
    }
}
