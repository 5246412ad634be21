//! The context a server hands to the outbound calls it makes for one inbound request.
//!
//! A server-side layer (`PropagateLayer`, or the server form of `DeadlineLayer`) reads
//! the inbound deadline and `retry-point` header into a [`CallContext`] and makes it
//! current for the handler, both as a tokio task-local (scoped around the inner
//! service's `call` and around its future) and as a request extension for code that
//! spawns tasks. Client layers inside the handler pick it up without plumbing:
//! [`CallContext::inherited`].
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::time::Duration;
//! use retrysafe::{CallContext, Deadline};
//!
//! let ctx = CallContext::new().with_deadline(Deadline::after(Duration::from_millis(80)));
//! let seen = ctx
//!     .clone()
//!     .scope(async {
//!         // Deep inside the handler: an outbound client layer looks it up.
//!         let inherited = CallContext::current().expect("scoped");
//!         inherited.mark_downstream_gave_up();
//!         inherited.deadline().map(|d| d.remaining())
//!     })
//!     .await;
//! assert_eq!(seen, Some(Duration::from_millis(80)));
//! // The server layer sees what the outbound layer recorded.
//! assert!(ctx.downstream_gave_up());
//! assert!(CallContext::current().is_none());
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::Deadline;
use crate::idempotency::IdempotencyContext;

tokio::task_local! {
    static CURRENT: CallContext;
}

/// The future returned by [`CallContext::scope`]: `F` with the context current while it
/// is polled.
pub type Scoped<F> = tokio::task::futures::TaskLocalFuture<CallContext, F>;

/// What one inbound request passes to the outbound calls made for it.
///
/// The fields are separate and typed, so their meanings cannot be confused:
///
/// - [`deadline`](CallContext::deadline): the time the caller has left (less a margin);
///   only ever tightened;
/// - [`caller_is_retry_point`](CallContext::caller_is_retry_point): the caller sent
///   `retry-point: caller`, so outbound calls make one attempt each;
/// - [`idempotency`](CallContext::idempotency): the guarded record, from which outbound
///   calls derive deterministic child keys;
/// - [`downstream_gave_up`](CallContext::downstream_gave_up): an outbound `RetryLayer`
///   gave up after retrying, or an outbound call came back marked `do-not-retry`; the
///   server layer then marks its own failure response `do-not-retry: 1`.
///
/// A cheap `Clone`: clones (and contexts derived with the `with_*` methods) share one
/// `downstream_gave_up` flag.
#[derive(Clone, Default)]
pub struct CallContext {
    deadline: Option<Deadline>,
    caller_is_retry_point: bool,
    idempotency: Option<IdempotencyContext>,
    gave_up: Arc<AtomicBool>,
}

impl CallContext {
    /// An empty context: no deadline, no retry point, no idempotency record.
    pub fn new() -> Self {
        Self::default()
    }

    /// The context current on this task, if a server layer scoped one.
    pub fn current() -> Option<CallContext> {
        CURRENT.try_with(CallContext::clone).ok()
    }

    /// The context a client layer inherits for an outbound request: the request's
    /// `CallContext` extension if it carries one (code that spawned a task and carried
    /// it by hand), otherwise the task's current one.
    pub fn inherited(extensions: &http::Extensions) -> Option<CallContext> {
        extensions
            .get::<CallContext>()
            .cloned()
            .or_else(CallContext::current)
    }

    /// Runs `future` with this context current (the task-local).
    pub fn scope<F: Future>(self, future: F) -> Scoped<F> {
        CURRENT.scope(self, future)
    }

    /// Runs `f` with this context current; for the synchronous part of a `call`.
    #[doc(hidden)]
    pub fn sync_scope<R>(self, f: impl FnOnce() -> R) -> R {
        CURRENT.sync_scope(self, f)
    }

    /// The deadline, if any.
    pub fn deadline(&self) -> Option<Deadline> {
        self.deadline
    }

    /// This context with `deadline`, or the current one if that is sooner: a deadline
    /// is only ever tightened.
    #[must_use]
    pub fn with_deadline(mut self, deadline: Deadline) -> Self {
        self.deadline = Some(deadline.tighten(self.deadline));
        self
    }

    /// Whether the caller made itself the retry point (`retry-point: caller`).
    pub fn caller_is_retry_point(&self) -> bool {
        self.caller_is_retry_point
    }

    /// This context with the caller as the retry point (`true`) or not.
    #[must_use]
    pub fn with_caller_is_retry_point(mut self, yes: bool) -> Self {
        self.caller_is_retry_point = yes;
        self
    }

    /// The idempotency record guarding this request, if any.
    pub fn idempotency(&self) -> Option<&IdempotencyContext> {
        self.idempotency.as_ref()
    }

    /// This context with the record guarding the request.
    #[must_use]
    pub fn with_idempotency(mut self, idempotency: IdempotencyContext) -> Self {
        self.idempotency = Some(idempotency);
        self
    }

    /// Whether an outbound call made for this request gave up after retrying or came
    /// back marked `do-not-retry`.
    pub fn downstream_gave_up(&self) -> bool {
        self.gave_up.load(Ordering::Relaxed)
    }

    /// Records that an outbound call gave up (see
    /// [`downstream_gave_up`](CallContext::downstream_gave_up)).
    pub fn mark_downstream_gave_up(&self) {
        self.gave_up.store(true, Ordering::Relaxed);
    }
}

impl fmt::Debug for CallContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CallContext")
            .field("deadline", &self.deadline.map(Deadline::remaining))
            .field("caller_is_retry_point", &self.caller_is_retry_point)
            .field("idempotency", &self.idempotency)
            .field("downstream_gave_up", &self.downstream_gave_up())
            .finish()
    }
}
