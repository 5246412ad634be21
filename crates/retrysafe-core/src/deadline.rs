use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::observe::handles::{Counter, Lazy};
use crate::observe::{Name, names};
use crate::wire::MAX_TIMEOUT;

/// The instant by which a call must be finished: a request extension and a field of the
/// inherited context.
///
/// A deadline can only be tightened: [`Deadline::tighten`] keeps the sooner of two. Time
/// comes from tokio, so deadlines follow a paused test clock.
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// use std::time::Duration;
/// use retrysafe::Deadline;
///
/// let d = Deadline::after(Duration::from_millis(100));
/// let tighter = d.tighten(Some(Deadline::after(Duration::from_millis(40))));
/// assert_eq!(tighter.remaining(), Duration::from_millis(40));
/// tokio::time::advance(Duration::from_millis(50)).await;
/// assert!(tighter.is_expired());
/// assert_eq!(d.remaining(), Duration::from_millis(50));
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Deadline(Instant);

impl Deadline {
    /// The deadline at `instant`.
    pub fn at(instant: Instant) -> Self {
        Deadline(instant)
    }

    /// A deadline `timeout` from now (saturating: at most [`MAX_TIMEOUT`] ahead).
    pub fn after(timeout: Duration) -> Self {
        Self::after_from(timeout, Instant::now())
    }

    /// A deadline `timeout` after the clock reading `now` (saturating: at most
    /// [`MAX_TIMEOUT`] ahead), for a caller that uses the reading for more than the
    /// deadline (the time left at it is `timeout`: no second read, no subtraction).
    ///
    /// ```
    /// use std::time::Duration;
    /// use retrysafe::Deadline;
    /// use tokio::time::Instant;
    ///
    /// let now = Instant::now();
    /// let deadline = Deadline::after_from(Duration::from_secs(2), now);
    /// assert_eq!(deadline.instant() - now, Duration::from_secs(2));
    /// ```
    #[doc(hidden)]
    #[inline]
    pub fn after_from(timeout: Duration, now: Instant) -> Self {
        Deadline(now.checked_add(timeout.min(MAX_TIMEOUT)).unwrap_or(now))
    }

    /// The instant.
    pub fn instant(self) -> Instant {
        self.0
    }

    /// The time left, zero once passed.
    pub fn remaining(self) -> Duration {
        self.0.saturating_duration_since(Instant::now())
    }

    /// Whether no time is left.
    pub fn is_expired(self) -> bool {
        self.remaining().is_zero()
    }

    /// The sooner of `self` and `other`: a deadline is only ever tightened.
    #[must_use]
    pub fn tighten(self, other: Option<Deadline>) -> Deadline {
        match other {
            Some(o) if o.0 < self.0 => o,
            _ => self,
        }
    }

    /// The deadline of an outbound call that has `self` of its own: the soonest of it,
    /// the request's [`Deadline`] extension and the deadline of the inherited
    /// [`CallContext`](crate::CallContext) (the request's extension, or the task's).
    /// What a client's deadline layer or middleware obeys.
    ///
    /// ```
    /// use std::time::Duration;
    /// use retrysafe::Deadline;
    ///
    /// let own = Deadline::after(Duration::from_secs(10));
    /// let mut extensions = http::Extensions::new();
    /// assert_eq!(own.tightened_by(&extensions), own);
    /// let sooner = Deadline::after(Duration::from_secs(1));
    /// extensions.insert(sooner);
    /// assert_eq!(own.tightened_by(&extensions), sooner);
    /// ```
    #[doc(hidden)]
    #[must_use]
    pub fn tightened_by(self, extensions: &http::Extensions) -> Deadline {
        let inherited = crate::CallContext::inherited(extensions).and_then(|c| c.deadline());
        self.tighten(extensions.get::<Deadline>().copied())
            .tighten(inherited)
    }

    /// `timeout` bounded by the time left on an optional deadline.
    pub fn bound(deadline: Option<Deadline>, timeout: Duration) -> Duration {
        match deadline {
            Some(d) => timeout.min(d.remaining()),
            None => timeout,
        }
    }
}

/// A call that ran out of time (it ended with a
/// [`DeadlineExceeded`](crate::error::DeadlineExceeded) error), as the `on_expiry` hook
/// of a deadline layer or middleware sees it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct DeadlineExpiry {
    /// The name of the layer or middleware whose call ran out of time.
    pub name: Name,
}

type ExpiryHook = Arc<dyn Fn(&DeadlineExpiry) + Send + Sync>;

/// How a deadline layer reports expiries: its name, its counter
/// (`retrysafe_deadline_exceeded_total{name}`, resolved by
/// [`resolve_metrics`](Self::resolve_metrics) when the layer is built, else at the
/// first expiry) and its hook.
#[doc(hidden)]
#[derive(Clone, Default)]
pub struct ExpiryObserver {
    name: Name,
    counter: Lazy<Counter>,
    hook: Option<ExpiryHook>,
}

impl ExpiryObserver {
    /// The observer of the layer `name`.
    pub fn new(name: Name) -> Self {
        ExpiryObserver {
            counter: Lazy::default(),
            name,
            hook: None,
        }
    }

    /// The same, calling `hook` on every expiry.
    #[must_use]
    pub fn with_hook(mut self, hook: impl Fn(&DeadlineExpiry) + Send + Sync + 'static) -> Self {
        self.hook = Some(Arc::new(hook));
        self
    }

    /// The same hook under another name (its counter resolved anew).
    #[must_use]
    pub fn renamed(&self, name: Name) -> Self {
        ExpiryObserver {
            hook: self.hook.clone(),
            ..Self::new(name)
        }
    }

    /// The name.
    pub fn name(&self) -> &Name {
        &self.name
    }

    /// Resolves the counter now, against the recorder installed now.
    pub fn resolve_metrics(&self) {
        let _ = self.counter();
    }

    fn counter(&self) -> &Counter {
        self.counter
            .get(|| Counter::new(names::DEADLINE_EXCEEDED_TOTAL, &self.name, None))
    }

    /// Counts a call that ran out of time and calls the hook.
    #[cold]
    pub fn expired(&self) {
        self.counter().increment();
        tracing::Span::current().record("deadline", "exceeded");
        if let Some(hook) = &self.hook {
            hook(&DeadlineExpiry {
                name: self.name.clone(),
            });
        }
    }
}

impl std::fmt::Debug for ExpiryObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpiryObserver")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}
