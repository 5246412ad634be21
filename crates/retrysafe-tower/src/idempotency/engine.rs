//! The HTTP edge of the idempotency protocol: drives
//! [`Protocol`](retrysafe_core::__private::protocol::Protocol) for an [`Engine`]
//! (the store engine of this crate, the transactional engine of `retrysafe-postgres`)
//! and turns its steps into responses. The decisions are the protocol's; the engines
//! only do the I/O.

use std::any::Any;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http_body::Body;
use retrysafe_core::__private::protocol::{
    Claimed, Finish, Handled, Note, Protocol, Reply, Settle, Settled, Step, Waited,
};
use retrysafe_core::idempotency::{Completed, NoEffect};
use retrysafe_core::problem::ProblemKind;
use retrysafe_core::wire::DO_NOT_RETRY_VALUE;
use tracing::Span;

use super::body::ResponseBody;
use super::guard::{Captured, Guard};

type Res<B> = Response<ResponseBody<B>>;

/// A handler's outcome: its answer or error, or its panic.
pub type Outcome<B, E> = Result<Result<Response<B>, E>, Box<dyn Any + Send>>;

/// The I/O of one guarded request, as the protocol asks for it.
pub trait Engine: Send {
    /// Claims the key, with a new token.
    fn claim(&mut self) -> impl Future<Output = Claimed> + Send;

    /// Waits for a copy in flight, at most `max`.
    fn wait(&mut self, max: Duration) -> impl Future<Output = Waited> + Send;

    /// Collects a response body to store it (see [`Guard::capture`]), within the time
    /// the engine allows.
    fn capture<B>(
        &mut self,
        guard: &Guard,
        response: Response<B>,
    ) -> impl Future<Output = Option<Captured<B>>> + Send
    where
        B: Body<Data = Bytes> + Send;

    /// Settles the record: stores `completed` (with [`Settle::Complete`]), releases it,
    /// or marks it unknown.
    fn settle(
        &mut self,
        settle: Settle,
        completed: Option<Completed>,
    ) -> impl Future<Output = Settled> + Send;

    /// Does what a note of the protocol asks (report an event, an unknown outcome,
    /// release a claim that timed out).
    fn note(&mut self, guard: &Guard, note: Note);
}

/// Claims (and waits) until the protocol says to run, replay or answer: returns that
/// step ([`Step::Run`], [`Step::RunUnguarded`], [`Step::Replay`] or
/// [`Step::Problem`]), its decision counted and recorded on the request's `span`.
pub async fn negotiate<E: Engine>(
    guard: &Guard,
    protocol: &mut Protocol,
    engine: &mut E,
    span: &Span,
) -> Step {
    let mut step = protocol.start();
    let step = loop {
        step = match step {
            Step::Claim => {
                let claimed = engine.claim().await;
                protocol.claimed(claimed)
            }
            Step::Wait(max) => {
                let waited = engine.wait(max).await;
                protocol.waited(waited)
            }
            other => break other,
        };
        deliver(guard, protocol, engine);
    };
    if let Some(decision) = protocol.decision() {
        guard.decided(decision, span);
    }
    step
}

fn deliver<E: Engine>(guard: &Guard, protocol: &mut Protocol, engine: &mut E) {
    for note in protocol.notes() {
        engine.note(guard, note);
    }
}

/// The answer to a step that answers at once: a replay or a problem. (A step that
/// runs the handler is the engine's to take; given here, it is a bug, answered 500.)
pub fn answer_of<B>(guard: &Guard, step: Step) -> Res<B> {
    match step {
        Step::Replay(stored) => guard.replay_owned(stored),
        Step::Problem(problem) => guard.problem(problem),
        _ => guard.problem_of(
            ProblemKind::HandlerPanicked,
            "the request could not be completed",
        ),
    }
}

/// After the handler ran: settles the record as the protocol says (capturing the
/// response body first when it is to be stored) and answers.
#[allow(
    clippy::manual_async_fn,
    reason = "an `async fn` keeps its arguments twice in its future"
)]
pub fn conclude<'a, E, B, Err>(
    guard: &'a Guard,
    protocol: &'a mut Protocol,
    engine: &'a mut E,
    outcome: Outcome<B, Err>,
) -> impl Future<Output = Result<Res<B>, Err>> + 'a
where
    E: Engine,
    B: Body<Data = Bytes> + Send + 'static,
    Err: 'a,
{
    async move {
        let handled = match &outcome {
            Err(_panic) => Handled::Panicked,
            Ok(Err(_)) => Handled::Failed,
            Ok(Ok(res)) => Handled::Answered {
                status: res.status(),
                no_effect: res.extensions().get::<NoEffect>().is_some(),
            },
        };
        let mut finish = protocol.handled(handled);
        let mut completed = None;
        let mut error = None;
        let response = match outcome {
            Ok(Ok(res)) if finish.settle == Settle::Capture => {
                match engine.capture(guard, res).await {
                    Some(Captured { stored, response }) => {
                        finish = protocol.captured(true);
                        completed = Some(Completed::new(*protocol.fingerprint(), stored));
                        Some(response)
                    }
                    None => {
                        finish = protocol.captured(false);
                        None
                    }
                }
            }
            Ok(Ok(res)) => Some(res.map(ResponseBody::stream)),
            Ok(Err(e)) => {
                error = Some(e);
                None
            }
            Err(_panic) => None,
        };
        let reply = settle(guard, protocol, engine, finish, completed).await;
        reply_with(guard, reply, response, error)
    }
}

/// After the engine cancelled the handler (it ran past its time, or its lease was
/// lost): settles the record as the protocol says for a cancelled handler — released
/// when it was before its declared commit point, `outcome_unknown` otherwise — and
/// answers with the protocol's problem.
pub(crate) async fn abandon<E, B, Err>(
    guard: &Guard,
    protocol: &mut Protocol,
    engine: &mut E,
) -> Result<Res<B>, Err>
where
    E: Engine,
{
    let finish = protocol.handled(Handled::Cancelled);
    let reply = settle(guard, protocol, engine, finish, None).await;
    reply_with(guard, reply, None, None)
}

/// Writes the record as `finish` says, reports the protocol's notes, and returns the
/// reply (a problem instead of the planned one when the write says so).
async fn settle<E: Engine>(
    guard: &Guard,
    protocol: &mut Protocol,
    engine: &mut E,
    finish: Finish,
    completed: Option<Completed>,
) -> Reply {
    let settled = engine.settle(finish.settle, completed).await;
    let reply = match protocol.settled(finish.settle, settled) {
        Some(problem) => Reply::Problem(problem),
        None => finish.reply,
    };
    deliver(guard, protocol, engine);
    reply
}

/// The caller's answer: the handler's response (marked `do-not-retry` when the reply
/// says so), its error, or a problem.
fn reply_with<B, Err>(
    guard: &Guard,
    reply: Reply,
    response: Option<Res<B>>,
    error: Option<Err>,
) -> Result<Res<B>, Err> {
    match (reply, response, error) {
        (Reply::Response, Some(res), _) => Ok(res),
        (Reply::ResponseDoNotRetry, Some(mut res), _) => {
            res.headers_mut().insert(
                guard.convention().do_not_retry().clone(),
                DO_NOT_RETRY_VALUE,
            );
            Ok(res)
        }
        (Reply::Error, _, Some(e)) => Err(e),
        (Reply::Problem(problem), _, _) => Ok(guard.problem(problem)),
        // The protocol replies with what the handler produced; anything else is a bug.
        _ => Ok(guard.problem_of(
            ProblemKind::HandlerPanicked,
            "the request could not be completed",
        )),
    }
}
