//! The one path of a guarded request: [`drive`] takes it through the idempotency
//! [`Protocol`] — claim (and wait), run the handler, capture its response, settle the
//! record — doing the I/O the protocol asks for with an [`Engine`] (a store's, or the
//! transactional layer's in `retrysafe-postgres`), and turns the protocol's answer into
//! the response. The decisions are the protocol's; the engines only do the I/O.

use std::any::Any;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use retrysafe_core::__private::protocol::{
    Claimed, Finish, Handled, Note, Protocol, Reply, Settle, Settled, Step, Waited,
};
use retrysafe_core::CallContext;
use retrysafe_core::idempotency::{CommitPoint, Completed, IdempotencyContext, NoEffect, Scope};
use retrysafe_core::problem::{Problem, ProblemKind};
use retrysafe_core::wire::{DO_NOT_RETRY_VALUE, IdempotencyKey};
use tracing::Span;

use super::answers::CapturedResponse;
use super::backend::{Handler, Served};
use super::body::{RequestBody, ResponseBody};
use super::request::{Admitted, KeyedRequest};
use super::shared::Shared;

type Res<B> = Response<ResponseBody<B>>;

/// A handler's result: its answer or error, or its panic.
pub type HandlerResult<B, E> = Result<Result<Response<B>, E>, Box<dyn Any + Send>>;

/// What became of a handler an [`Engine`] ran.
#[derive(Debug)]
pub enum Ran<B, E> {
    /// It answered, failed or panicked.
    Done(HandlerResult<B, E>),
    /// The engine cancelled (dropped) it: it ran past its time, or its lease was lost.
    Cancelled,
    /// The engine cannot settle the record as the protocol would (a transactional
    /// handler kept its transaction): answer with this problem.
    Refused(Problem),
}

/// The I/O of one guarded request, as the protocol asks for it.
pub trait Engine: Send {
    /// Claims the key, with a new token.
    fn claim(&mut self) -> impl Future<Output = Claimed> + Send;

    /// Waits for a copy in flight, at most `max`.
    fn wait(&mut self, max: Duration) -> impl Future<Output = Waited> + Send;

    /// The context the handler of the claimed record sees.
    fn context(&mut self, scope: Scope, key: IdempotencyKey) -> IdempotencyContext;

    /// Runs the handler with `request`, its call scoped with `context`, as the holder
    /// of the claim.
    fn handle<H: Handler>(
        &mut self,
        handler: H,
        request: Request<RequestBody<H::ReqBody>>,
        context: CallContext,
    ) -> impl Future<Output = Ran<H::ResBody, H::Error>> + Send;

    /// Where the handler stood against its commit point when it was done.
    fn commit_point(&self) -> CommitPoint {
        CommitPoint::Undeclared
    }

    /// Collects a response body to store it (see
    /// [`Answers::capture`](super::answers::Answers::capture)), within the time the
    /// engine allows.
    fn capture<B>(
        &mut self,
        shared: &Shared,
        response: Response<B>,
    ) -> impl Future<Output = Option<CapturedResponse<B>>> + Send
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
    fn note(&mut self, shared: &Shared, note: Note);
}

/// Takes `request` through `protocol` with `engine`, from its claim to its answer.
///
/// (A function returning an `async` block, not an `async fn`: an `async fn` keeps a
/// second copy of its arguments in its future, which lies in the request's task.)
#[allow(
    clippy::manual_async_fn,
    reason = "an `async fn` keeps its arguments twice in its future"
)]
pub fn drive<'a, E, H>(
    shared: &'a Shared,
    mut protocol: Protocol,
    engine: &'a mut E,
    handler: H,
    request: Admitted<H::ReqBody>,
) -> impl Future<Output = Served<H>> + Send + 'a
where
    E: Engine,
    H: Handler,
{
    async move {
        let span = match &request {
            Admitted::Keyed(keyed) => Some(&keyed.span),
            Admitted::Unkeyed(_) => None,
        };
        match negotiate(shared, &mut protocol, engine, span).await {
            Step::Run => run(shared, &mut protocol, engine, handler, request).await,
            Step::RunUnguarded => unguarded(handler, request).await,
            step => Ok(answer_of(shared, step)),
        }
    }
}

/// Runs the handler of a claim that is ours, then settles the record.
async fn run<E, H>(
    shared: &Shared,
    protocol: &mut Protocol,
    engine: &mut E,
    handler: H,
    request: Admitted<H::ReqBody>,
) -> Served<H>
where
    E: Engine,
    H: Handler,
{
    let (request, context) = match request {
        // The handler runs in this (detachable) task: the inherited call context is
        // re-scoped, now carrying the record, so outbound client layers derive child
        // keys and report back when they give up.
        Admitted::Keyed(keyed) => keyed.into_request(|scope, key| engine.context(scope, key)),
        Admitted::Unkeyed(request) => {
            let context = CallContext::inherited(request.extensions()).unwrap_or_default();
            (*request, context)
        }
    };
    let ran = engine.handle(handler, request, context).await;
    protocol.commit_point(engine.commit_point());
    match ran {
        Ran::Done(outcome) => conclude(shared, protocol, engine, outcome).await,
        Ran::Cancelled => abandon(shared, protocol, engine).await,
        Ran::Refused(problem) => Ok(shared.answers().problem(problem)),
    }
}

/// A request run unguarded: the store failed before any record was seen and the layer
/// fails open.
pub(crate) async fn unguarded<H: Handler>(handler: H, request: Admitted<H::ReqBody>) -> Served<H> {
    let request = match request {
        Admitted::Keyed(keyed) => {
            let KeyedRequest { parts, body, .. } = *keyed;
            Request::from_parts(parts, RequestBody::buffered(body))
        }
        Admitted::Unkeyed(request) => *request,
    };
    Ok(handler.call(request).await?.map(ResponseBody::stream))
}

/// Claims (and waits) until the protocol says to run, replay or answer: returns that
/// step ([`Step::Run`], [`Step::RunUnguarded`], [`Step::Replay`] or
/// [`Step::Problem`]); for a keyed request, its decision counted and recorded on its
/// `span`.
pub(crate) async fn negotiate<E: Engine>(
    shared: &Shared,
    protocol: &mut Protocol,
    engine: &mut E,
    span: Option<&Span>,
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
        deliver(shared, protocol, engine);
    };
    if let (Some(decision), Some(span)) = (protocol.decision(), span) {
        shared.telemetry().decided(decision, span);
    }
    step
}

fn deliver<E: Engine>(shared: &Shared, protocol: &mut Protocol, engine: &mut E) {
    for note in protocol.notes() {
        engine.note(shared, note);
    }
}

/// The answer to a step that answers at once: a replay or a problem. (A step that
/// runs the handler is the engine's to take; given here, it is a bug, answered 500.)
fn answer_of<B>(shared: &Shared, step: Step) -> Res<B> {
    match step {
        Step::Replay(stored) => shared.answers().replay_owned(stored),
        Step::Problem(problem) => shared.answers().problem(problem),
        _ => shared.problem_of(
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
fn conclude<'a, E, B, Err>(
    shared: &'a Shared,
    protocol: &'a mut Protocol,
    engine: &'a mut E,
    outcome: HandlerResult<B, Err>,
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
                match engine.capture(shared, res).await {
                    Some(CapturedResponse { stored, response }) => {
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
        let reply = settle(shared, protocol, engine, finish, completed).await;
        reply_with(shared, reply, response, error)
    }
}

/// After the engine cancelled the handler (it ran past its time, or its lease was
/// lost): settles the record as the protocol says for a cancelled handler — released
/// when it was before its declared commit point, `outcome_unknown` otherwise — and
/// answers with the protocol's problem.
async fn abandon<E, B, Err>(
    shared: &Shared,
    protocol: &mut Protocol,
    engine: &mut E,
) -> Result<Res<B>, Err>
where
    E: Engine,
{
    let finish = protocol.handled(Handled::Cancelled);
    let reply = settle(shared, protocol, engine, finish, None).await;
    reply_with(shared, reply, None, None)
}

/// Writes the record as `finish` says, reports the protocol's notes, and returns the
/// reply (a problem instead of the planned one when the write says so).
async fn settle<E: Engine>(
    shared: &Shared,
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
    deliver(shared, protocol, engine);
    reply
}

/// The caller's answer: the handler's response (marked `do-not-retry` when the reply
/// says so), its error, or a problem.
fn reply_with<B, Err>(
    shared: &Shared,
    reply: Reply,
    response: Option<Res<B>>,
    error: Option<Err>,
) -> Result<Res<B>, Err> {
    match (reply, response, error) {
        (Reply::Response, Some(res), _) => Ok(res),
        (Reply::ResponseDoNotRetry, Some(mut res), _) => {
            res.headers_mut().insert(
                shared.answers().convention.do_not_retry().clone(),
                DO_NOT_RETRY_VALUE,
            );
            Ok(res)
        }
        (Reply::Error, _, Some(e)) => Err(e),
        (Reply::Problem(problem), _, _) => Ok(shared.answers().problem(problem)),
        // The protocol replies with what the handler produced; anything else is a bug.
        _ => Ok(shared.problem_of(
            ProblemKind::HandlerPanicked,
            "the request could not be completed",
        )),
    }
}
