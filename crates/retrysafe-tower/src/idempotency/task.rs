//! The detachable task of a guarded request: polled in place on the caller's task, and
//! spawned to finish on its own if the caller's future is dropped first.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::FutureExt;
use http::Response;
use tracing::{Instrument, Span};

use super::backend::{Backend, Handler, Served};
use super::body::ResponseBody;
use super::layer::IdempotencyLayer;
use super::problem::ProblemKind;
use super::request::Admitted;
use super::shared::Shared;
use super::slots::Slot;

/// Runs `request` through the layer's backend (the claim, the handler and the
/// completion) as a task and awaits it, holding `permit` and a token of the layer's
/// [`TaskTracker`](tokio_util::task::TaskTracker) until it is done.
///
/// The task is polled in place, on the caller's task: no spawn and no hand-off between
/// worker threads per request (moving the large task into a spawned one costs more
/// than the rest of the layer's work). It still outlives the caller: if the caller's
/// future is dropped before the task finished (the client went away, an outer timeout fired), the task is
/// spawned, as it stands, onto the runtime and runs to completion there, so dropping
/// the caller cancels nothing. A panic of the task (the backends catch handler panics;
/// this is one of our own) answers 500 `handler-panicked`.
///
/// The task owns the layer (no second clone of it for the answer to a panic, which the
/// task gives itself) and makes the backend's (large) future inside its box on its
/// first poll, so that future is never moved. It runs in `span` (the request's
/// `retrysafe.idempotency` span), or, when that one is disabled, in the caller's.
/// Boxed at once: the caller awaits the [`Detached`] (two words and a span), not a
/// future holding the task's parts until its first poll.
pub(crate) fn spawned<H, X>(
    layer: IdempotencyLayer<X>,
    handler: H,
    request: Admitted<H::ReqBody>,
    permit: Slot,
    span: Span,
) -> Detached<impl Future<Output = Served<H>> + Send + 'static>
where
    H: Handler,
    X: Backend,
{
    let token = layer.shared.in_flight.tracker.token();
    // Made in its box at once, and instrumented from outside it: the task is large
    // (the backend's future lies in it), and every move of it is a copy.
    let task = Box::pin(async move {
        let res = AssertUnwindSafe(layer.backend.run(&layer.shared, handler, request))
            .catch_unwind()
            .await;
        drop(permit);
        drop(token);
        res.unwrap_or_else(|panic| Ok(panicked(&layer.shared, &*panic)))
    });
    let span = if span.is_disabled() {
        Span::current()
    } else {
        span
    };
    Detached::new(task, span)
}

/// The answer to a panic of a guarded task.
fn panicked<B>(shared: &Shared, panic: &(dyn Any + Send)) -> Response<ResponseBody<B>> {
    let what = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic");
    tracing::error!(target: "retrysafe::idempotency", error = what, "guarded task panicked");
    shared.problem_of(
        ProblemKind::HandlerPanicked,
        "the request could not be completed",
    )
}

/// A future polled in place that is spawned, unfinished, when it is dropped: see
/// [`spawned`].
pub(crate) struct Detached<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    /// `None` once it has finished (or panicked).
    task: Option<Pin<Box<F>>>,
    /// Entered while the task is polled, here or spawned.
    span: Span,
}

impl<F> Detached<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn new(task: Pin<Box<F>>, span: Span) -> Self {
        Detached {
            task: Some(task),
            span,
        }
    }
}

impl<F> Future for Detached<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let Some(task) = this.task.as_mut() else {
            return Poll::Pending; // polled after it finished
        };
        let out = {
            let _entered = this.span.enter();
            std::task::ready!(task.as_mut().poll(cx))
        };
        self.task = None;
        Poll::Ready(out)
    }
}

impl<F> Drop for Detached<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        let Some(task) = self.task.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let span = std::mem::replace(&mut self.span, Span::none());
                drop(runtime.spawn(task.instrument(span)));
            }
            // Only while a runtime is torn down, which would cancel a spawned task too.
            Err(_) => tracing::error!(
                target: "retrysafe::idempotency",
                "a guarded request was dropped outside a tokio runtime; it cannot finish"
            ),
        }
    }
}
