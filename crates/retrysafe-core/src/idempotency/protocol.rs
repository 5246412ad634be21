//! The idempotency protocol of one guarded request, as a state machine without I/O:
//! the server twin of the client's [retry planner](crate::retry).
//!
//! An engine — the store-backed `IdempotencyLayer`, or a transactional layer that
//! writes the key in the handler's own database transaction — does the I/O and tells
//! the [`Protocol`] what happened; the protocol answers with the next [`Step`]:
//!
//! 1. [`Step::Claim`]: claim the key (a store call, or a transaction's key statement)
//!    and report it with [`Protocol::claimed`];
//! 2. [`Step::Wait`]: a copy is in flight; wait for it at most that long and report
//!    with [`Protocol::waited`];
//! 3. [`Step::Run`]: the caller holds the key; run the handler, tell the protocol how
//!    far it got against its declared commit point ([`Protocol::commit_point`]), and
//!    report its outcome with [`Protocol::handled`], which says how to [`Settle`] the
//!    record and what to
//!    [`Reply`]; after a [`Settle::Capture`], report with [`Protocol::captured`]; after
//!    the record is written, report with [`Protocol::settled`];
//! 4. [`Step::Replay`] or [`Step::Problem`]: answer at once;
//!    [`Step::RunUnguarded`]: the store failed before any record was seen and the
//!    layer fails open.
//!
//! After every transition the engine drains [`Protocol::notes`]: the events to report
//! and the side effects that go with them.
//!
//! ```
//! use std::time::Duration;
//! use http::StatusCode;
//! use retrysafe_core::__private::protocol::*;
//! use retrysafe::idempotency::{EventKind, Fingerprint};
//!
//! let policy = Policy::new();
//! let mut p = Protocol::new(&policy, Fingerprint::from_bytes([7; 32]), None);
//! assert_eq!(p.start(), Step::Claim);
//! assert_eq!(p.claimed(Claimed::Mine { takeover: false }), Step::Run);
//! assert_eq!(p.notes().collect::<Vec<_>>(), [Note::Event(EventKind::Claimed)]);
//!
//! let finish = p.handled(Handled::Answered { status: StatusCode::CREATED, no_effect: false });
//! assert_eq!(finish, Finish { settle: Settle::Capture, reply: Reply::Response });
//! let finish = p.captured(true);
//! assert_eq!(finish.settle, Settle::Complete);
//! assert_eq!(p.settled(Settle::Complete, Settled::Done), None);
//! ```

use std::time::Duration;

use http::StatusCode;
use tokio::time::Instant;

use super::Fingerprint;
use super::decision::Disposition;
use super::event::{Decision, EventKind, UnknownReason};
use super::record::{CommitPoint, Completed, Record, StoredResponse};
use crate::Deadline;
use crate::problem::{Problem, ProblemKind};
use crate::store::StoreError;

/// The settings of the protocol, the same for every request of a layer.
///
/// ```
/// use std::time::Duration;
/// use retrysafe_core::__private::protocol::Policy;
/// use retrysafe::idempotency::ProblemKind;
///
/// let policy = Policy::new().in_flight_retry_after(Duration::from_secs(2));
/// let p = policy.problem(ProblemKind::InFlight, "still running");
/// assert_eq!(p.retry_after_hint(), Some(Duration::from_secs(2)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    wait_for_in_flight: Option<Duration>,
    in_flight_retry_after: Duration,
    unavailable_retry_after: Duration,
    fail_open: bool,
    rolls_back: bool,
    reconciled: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy::new()
    }
}

impl Policy {
    /// The defaults: a copy in flight gets 409 at once with `retry-after: 1`, a store
    /// failure 503 with `retry-after: 1`, fail closed, no rollback.
    pub fn new() -> Self {
        Policy {
            wait_for_in_flight: None,
            in_flight_retry_after: Duration::from_secs(1),
            unavailable_retry_after: Duration::from_secs(1),
            fail_open: false,
            rolls_back: false,
            reconciled: false,
        }
    }

    /// A reconciler resolves this store's pending records: a copy that finds one (an
    /// `outcome_unknown` record, or one being resolved) is told to come back, 503
    /// `outcome-pending` with `retry-after`, rather than 500 `outcome-unknown`.
    #[must_use]
    pub fn reconciled(mut self, on: bool) -> Self {
        self.reconciled = on;
        self
    }

    /// A copy that finds its key in flight waits for it up to `max` (counted from its
    /// first claim, bounded by its deadline), then gets 409; `None` answers 409 at once.
    #[must_use]
    pub fn wait_for_in_flight(mut self, max: Option<Duration>) -> Self {
        self.wait_for_in_flight = max;
        self
    }

    /// The `retry-after` of a 409 `request-in-flight`.
    #[must_use]
    pub fn in_flight_retry_after(mut self, d: Duration) -> Self {
        self.in_flight_retry_after = d;
        self
    }

    /// The `retry-after` of a 503 `store-unavailable` or `overloaded`.
    #[must_use]
    pub fn unavailable_retry_after(mut self, d: Duration) -> Self {
        self.unavailable_retry_after = d;
        self
    }

    /// Run the handler unguarded when the claim itself failed and no record was seen.
    #[must_use]
    pub fn fail_open(mut self, on: bool) -> Self {
        self.fail_open = on;
        self
    }

    /// The engine undoes a failed handler's effects (its transaction rolls back):
    /// nothing is ever `outcome_unknown`, and a failed call is answered without
    /// `do-not-retry`.
    #[must_use]
    pub fn rolls_back(mut self, on: bool) -> Self {
        self.rolls_back = on;
        self
    }

    /// Whether the engine rolls a failed handler back.
    pub fn is_rolling_back(&self) -> bool {
        self.rolls_back
    }

    /// The layer's answer of `kind`: the `retry-after` its case requires, and
    /// `do-not-retry` as the kind says — except a failed handler of an engine that
    /// rolls back, after which a retry is safe.
    pub fn problem(
        &self,
        kind: ProblemKind,
        detail: impl Into<std::borrow::Cow<'static, str>>,
    ) -> Problem {
        let problem = Problem::new(kind, detail);
        match kind {
            ProblemKind::InFlight => problem.retry_after(self.in_flight_retry_after),
            ProblemKind::StoreUnavailable | ProblemKind::Overloaded => {
                problem.retry_after(self.unavailable_retry_after)
            }
            ProblemKind::OutcomePending => problem.retry_after(self.in_flight_retry_after),
            ProblemKind::HandlerPanicked if self.rolls_back => problem.retryable(),
            _ => problem,
        }
    }
}

/// What a claim found.
#[derive(Debug)]
#[non_exhaustive]
pub enum Claimed {
    /// The caller holds the key now.
    Mine {
        /// It took over an expired lease of a holder that had not reached its commit
        /// point.
        takeover: bool,
    },
    /// A record exists.
    Existing {
        /// The record.
        record: Record,
        /// This claim turned an expired lease into `outcome_unknown`.
        became_unknown: bool,
    },
    /// Another copy holds the key and its record cannot be read yet (a transaction
    /// that has not committed).
    Busy,
    /// The claim failed.
    Failed(StoreError),
}

/// What a wait for a copy in flight ended with.
#[derive(Debug)]
#[non_exhaustive]
pub enum Waited {
    /// The holder may be done (or gone): claim again.
    LookAgain,
    /// The record left `in_progress`: this is it.
    Record(Record),
    /// The time to wait ran out.
    TimedOut,
    /// The wait failed.
    Failed(StoreError),
}

/// The next thing the engine does.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Step {
    /// Claim the key (again, with a new token).
    Claim,
    /// A copy is in flight: wait for it at most this long, then report
    /// [`Protocol::waited`].
    Wait(Duration),
    /// The caller holds the key: run the handler.
    Run,
    /// The store failed before any record was seen, and the layer fails open: run the
    /// handler unguarded.
    RunUnguarded,
    /// Answer with this stored response, replayed.
    Replay(StoredResponse),
    /// Answer with this problem.
    Problem(Problem),
}

/// What became of the handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Handled {
    /// It answered with `status`, marked [`NoEffect`](super::NoEffect) or not.
    Answered {
        /// The response status.
        status: StatusCode,
        /// The response carries the `NoEffect` marker.
        no_effect: bool,
    },
    /// It panicked.
    Panicked,
    /// The service returned an error instead of a response.
    Failed,
    /// The engine cancelled (dropped) the handler: it ran past its time, or its lease
    /// was lost.
    Cancelled,
}

/// What to do with the record once the handler is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settle {
    /// Collect the response body up to the storable limit, then report
    /// [`Protocol::captured`].
    Capture,
    /// Store the collected response (for a transaction: write the key row and commit).
    Complete,
    /// Delete the record (for a transaction: roll back): a retry runs again.
    Release,
    /// Mark the record `outcome_unknown`: never for an engine that rolls back.
    MarkUnknown(UnknownReason),
}

/// What the caller gets once the record is settled.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reply {
    /// The handler's response, as it is.
    Response,
    /// The handler's response, marked `do-not-retry: 1`.
    ResponseDoNotRetry,
    /// The service's error.
    Error,
    /// This problem instead.
    Problem(Problem),
}

/// How to settle the record, and what to answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finish {
    /// What to do with the record.
    pub settle: Settle,
    /// What to answer (unless [`Protocol::settled`] replaces it).
    pub reply: Reply,
}

/// How writing the record went.
#[derive(Debug)]
#[non_exhaustive]
pub enum Settled {
    /// Written (committed, rolled back).
    Done,
    /// The write failed (for a store, after its retries).
    Failed(StoreError),
    /// A transaction the handler left aborted (a statement failed): nothing committed.
    Aborted,
}

/// What the engine reports, or does, besides the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Note {
    /// Report this event.
    Event(EventKind),
    /// The record became `outcome_unknown` for this reason: report it (the
    /// `outcome_unknown` event and the reconcile hook).
    Unknown(UnknownReason),
    /// A claim that failed in transit (timed out, or its connection failed) may have
    /// landed: release it with its token, in the background.
    ReleaseClaim,
}

/// The protocol of one guarded request. See the module docs (`protocol.rs`).
#[derive(Debug)]
pub struct Protocol {
    policy: Policy,
    fingerprint: Fingerprint,
    started: Instant,
    deadline: Option<Deadline>,
    seen_record: bool,
    conflicted: bool,
    status: Option<StatusCode>,
    decision: Option<Decision>,
    /// Where the handler stood against its commit point when it was done.
    commit_point: CommitPoint,
    notes: [Option<Note>; 2],
}

impl Protocol {
    /// The protocol of a request with `fingerprint` and `deadline`, starting now.
    pub fn new(policy: &Policy, fingerprint: Fingerprint, deadline: Option<Deadline>) -> Self {
        Protocol {
            policy: *policy,
            fingerprint,
            started: Instant::now(),
            deadline,
            seen_record: false,
            conflicted: false,
            status: None,
            decision: None,
            commit_point: CommitPoint::Undeclared,
            notes: [None, None],
        }
    }

    /// The first step: [`Step::Claim`].
    pub fn start(&self) -> Step {
        Step::Claim
    }

    /// The request's fingerprint.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// How the request was decided so far: after the last claim or wait, how it was
    /// decided ([`Step::Run`] is `first` or `takeover`; a problem or a replay says
    /// which); `None` before the first claim was reported.
    pub fn decision(&self) -> Option<Decision> {
        self.decision
    }

    /// Decides `decision`, reported as the event `kind`.
    fn decide(&mut self, decision: Decision, kind: EventKind) {
        self.decision = Some(decision);
        self.note(Note::Event(kind));
    }

    /// The events and side effects of the last transition, in order.
    pub fn notes(&mut self) -> impl Iterator<Item = Note> + use<> {
        let notes = std::mem::take(&mut self.notes);
        notes.into_iter().flatten()
    }

    fn note(&mut self, note: Note) {
        if let Some(slot) = self.notes.iter_mut().find(|n| n.is_none()) {
            *slot = Some(note);
        }
    }

    /// A claim (or a transaction's key statement) found `claimed`.
    pub fn claimed(&mut self, claimed: Claimed) -> Step {
        match claimed {
            Claimed::Mine { takeover } => {
                if takeover {
                    self.decide(Decision::Takeover, EventKind::Takeover);
                } else {
                    self.decide(Decision::First, EventKind::Claimed);
                }
                Step::Run
            }
            Claimed::Existing {
                record,
                became_unknown,
            } => {
                if became_unknown {
                    self.note(Note::Unknown(UnknownReason::LeaseExpired));
                }
                self.found(record)
            }
            Claimed::Busy => self.in_flight(),
            Claimed::Failed(error) => {
                // The claim may have landed and only its reply been lost.
                let in_transit = matches!(error, StoreError::Timeout | StoreError::Unavailable(_));
                if in_transit && !self.policy.rolls_back {
                    self.note(Note::ReleaseClaim);
                }
                // Fail open only when no record was seen and the store is just down:
                // never past a record that exists, never over corrupt data.
                let may_run = !self.seen_record
                    && matches!(error, StoreError::Timeout | StoreError::Unavailable(_));
                self.store_failed(&error, may_run)
            }
        }
    }

    /// A wait for a copy in flight ended with `waited`.
    pub fn waited(&mut self, waited: Waited) -> Step {
        match waited {
            Waited::LookAgain => Step::Claim,
            Waited::Record(record) => self.found(record),
            Waited::TimedOut => {
                self.decision = Some(Decision::InFlight);
                Step::Problem(self.in_flight_problem())
            }
            Waited::Failed(error) => {
                tracing::warn!(
                    target: "retrysafe::idempotency",
                    error = %error,
                    "waiting for a request in flight failed"
                );
                self.store_failed(&error, false)
            }
        }
    }

    /// The answer a copy gets from the existing record of its key.
    fn found(&mut self, record: Record) -> Step {
        self.seen_record = true;
        if let Record::Evicted(_) = record {
            // Only a trace is left (no fingerprint to compare): the key ran.
            self.decide(Decision::Evicted, EventKind::Evicted);
            return Step::Problem(self.policy.problem(
                ProblemKind::ResponseEvicted,
                "the request with this Idempotency-Key completed, but its response is no \
                 longer stored; it will not be run again",
            ));
        }
        if record.fingerprint() != &self.fingerprint {
            self.decide(Decision::Mismatch, EventKind::Mismatch);
            return Step::Problem(self.policy.problem(
                ProblemKind::KeyMismatch,
                "this Idempotency-Key was already used with a different request",
            ));
        }
        match record {
            Record::InProgress(_) => self.in_flight(),
            Record::Completed(Completed {
                response: Some(stored),
                ..
            }) => {
                self.decide(Decision::Replay, EventKind::Replayed);
                Step::Replay(stored)
            }
            Record::Completed(Completed { response: None, .. }) => {
                self.decide(Decision::NotStored, EventKind::NotStored);
                Step::Problem(self.policy.problem(
                    ProblemKind::ResponseNotStored,
                    "the request with this Idempotency-Key completed, but its response was \
                     too large to store",
                ))
            }
            Record::Resolving(_) => Step::Problem(self.pending_problem()),
            Record::OutcomeUnknown(_) if self.policy.reconciled => {
                Step::Problem(self.pending_problem())
            }
            Record::OutcomeUnknown(_) | Record::Evicted(_) => {
                self.decide(Decision::Unknown, EventKind::Unknown);
                Step::Problem(self.policy.problem(
                    ProblemKind::OutcomeUnknown,
                    "the first request with this Idempotency-Key may or may not have taken \
                     effect; it will not be run again",
                ))
            }
        }
    }

    fn pending_problem(&mut self) -> Problem {
        self.decide(Decision::Pending, EventKind::Pending);
        self.policy.problem(
            ProblemKind::OutcomePending,
            "the outcome of the first request with this Idempotency-Key is being resolved; \
             retry later to see it",
        )
    }

    /// The key is in flight: report a conflict the first time, then wait while the
    /// copy may, or answer 409.
    fn in_flight(&mut self) -> Step {
        if !self.conflicted {
            self.note(Note::Event(EventKind::Conflict));
        }
        self.conflicted = true;
        self.decision = Some(Decision::InFlight);
        let max = self.policy.wait_for_in_flight.unwrap_or(Duration::ZERO);
        let left = Deadline::bound(self.deadline, max.saturating_sub(self.started.elapsed()));
        if left.is_zero() {
            return Step::Problem(self.in_flight_problem());
        }
        Step::Wait(left)
    }

    fn in_flight_problem(&self) -> Problem {
        self.policy.problem(
            ProblemKind::InFlight,
            "a request with this Idempotency-Key is still in progress; retry later",
        )
    }

    /// The store failed: 503 (fail closed), or, when `may_run` and failing open, run
    /// unguarded.
    fn store_failed(&mut self, error: &StoreError, may_run: bool) -> Step {
        if self.policy.fail_open && may_run {
            self.decide(Decision::Unguarded, EventKind::Unguarded);
            tracing::warn!(
                target: "retrysafe::idempotency",
                error = %error,
                "idempotency store failed; running the request unguarded (fail_open)"
            );
            return Step::RunUnguarded;
        }
        self.decide(Decision::Unavailable, EventKind::Unavailable);
        if matches!(error, StoreError::Full) {
            // A bound of the store, reached under load (or a key flood): the same answer
            // as the layer's own bound, and no warning per refused request.
            tracing::debug!(target: "retrysafe::idempotency", "idempotency store full");
            return Step::Problem(self.policy.problem(
                ProblemKind::Overloaded,
                "the idempotency store cannot take more requests in progress; retry later",
            ));
        }
        tracing::warn!(target: "retrysafe::idempotency", error = %error, "idempotency store failed");
        let detail = if matches!(error, StoreError::Timeout) {
            "the idempotency store did not answer in time; retry later"
        } else {
            "the idempotency store is unavailable; retry later"
        };
        Step::Problem(self.policy.problem(ProblemKind::StoreUnavailable, detail))
    }

    /// Where the handler (run after [`Step::Run`]) stood against its commit point when
    /// it was done: [`CommitPoint::Before`] when its layer's handlers declare one and it
    /// had not reached it, [`CommitPoint::Passed`] once it had, and
    /// [`CommitPoint::Undeclared`] (the default) for handlers that declare none. Report
    /// it before [`Protocol::handled`].
    pub fn commit_point(&mut self, state: CommitPoint) {
        self.commit_point = state;
    }

    /// Whether a failed handler provably had no effect: its transaction rolls back, or
    /// it failed before the commit point it declares (its effect comes after it).
    fn nothing_happened(&self) -> bool {
        self.policy.rolls_back || self.commit_point == CommitPoint::Before
    }

    /// The handler (run after [`Step::Run`]) is done: how to settle the record and
    /// what to answer.
    ///
    /// A failure — a 5xx or 408 answer, a panic, an error, a cancellation — is
    /// `outcome_unknown` and answered `do-not-retry`, unless nothing happened (see
    /// [`Protocol::commit_point`]; or the engine rolls back): then the key is released
    /// and the answer invites a retry.
    pub fn handled(&mut self, handled: Handled) -> Finish {
        let (settle, reply) = match handled {
            Handled::Panicked => (
                self.unknown_or_release(UnknownReason::Panicked),
                Reply::Problem(self.panicked()),
            ),
            Handled::Failed => (
                self.unknown_or_release(UnknownReason::ServiceError),
                Reply::Error,
            ),
            Handled::Cancelled => self.cancelled(),
            Handled::Answered { status, no_effect } => {
                self.status = Some(status);
                match Disposition::of(status, no_effect) {
                    Disposition::Store => (Settle::Capture, Reply::Response),
                    Disposition::Release => (Settle::Release, Reply::Response),
                    // Nothing happened: the answer goes as it is, a retry runs again.
                    Disposition::OutcomeUnknown if self.nothing_happened() => {
                        (Settle::Release, Reply::Response)
                    }
                    Disposition::OutcomeUnknown => (
                        Settle::MarkUnknown(UnknownReason::Status(status)),
                        Reply::ResponseDoNotRetry,
                    ),
                }
            }
        };
        Finish { settle, reply }
    }

    /// The answer to a panic: `handler-panicked`, marked `do-not-retry` unless nothing
    /// happened.
    fn panicked(&self) -> Problem {
        let detail = if self.policy.rolls_back {
            "the request handler failed; nothing was committed"
        } else if self.nothing_happened() {
            "the request handler failed before its commit point; nothing happened, a retry \
             is safe"
        } else {
            "the request handler failed"
        };
        let problem = self.policy.problem(ProblemKind::HandlerPanicked, detail);
        if self.nothing_happened() {
            problem.retryable()
        } else {
            problem
        }
    }

    /// A cancelled handler: before its declared commit point nothing happened, so the
    /// key is released and a retry is safe; otherwise its outcome is unknown.
    fn cancelled(&self) -> (Settle, Reply) {
        if self.nothing_happened() {
            let problem = self.policy.problem(
                ProblemKind::HandlerPanicked,
                "the request handler was cancelled before its effect; a retry is safe",
            );
            return (Settle::Release, Reply::Problem(problem.retryable()));
        }
        let problem = self.policy.problem(
            ProblemKind::OutcomeUnknown,
            "the request handler was cancelled; it may or may not have taken effect",
        );
        (
            Settle::MarkUnknown(UnknownReason::Cancelled),
            Reply::Problem(problem),
        )
    }

    /// The response body (after [`Settle::Capture`]) was collected (`ok`: whole, or
    /// too large to store), or failed while it was collected.
    pub fn captured(&mut self, ok: bool) -> Finish {
        if ok {
            return Finish {
                settle: Settle::Complete,
                reply: Reply::Response,
            };
        }
        let problem = if self.policy.rolls_back {
            self.policy.problem(
                ProblemKind::HandlerPanicked,
                "the response failed while it was being produced; nothing was committed",
            )
        } else if self.nothing_happened() {
            self.policy
                .problem(
                    ProblemKind::HandlerPanicked,
                    "the response failed while it was being produced, before the handler's \
                     commit point; nothing happened, a retry is safe",
                )
                .retryable()
        } else {
            self.policy.problem(
                ProblemKind::OutcomeUnknown,
                "the response failed while it was being produced",
            )
        };
        Finish {
            settle: self.unknown_or_release(UnknownReason::BodyError),
            reply: Reply::Problem(problem),
        }
    }

    fn unknown_or_release(&self, reason: UnknownReason) -> Settle {
        if self.nothing_happened() {
            Settle::Release
        } else {
            Settle::MarkUnknown(reason)
        }
    }

    /// The record was settled by `settle` with `settled`: the problem that replaces
    /// the planned [`Reply`], if any. A store's failed write leaves the handler's real
    /// answer (and notes `completion_lost`); a transaction that could not commit is
    /// answered 503, so that a retry finds out (it replays, or runs).
    pub fn settled(&mut self, settle: Settle, settled: Settled) -> Option<Problem> {
        if self.policy.rolls_back {
            return self.transaction_settled(settle, settled);
        }
        match (settle, settled) {
            (Settle::MarkUnknown(reason), Settled::Done) => {
                self.note(Note::Unknown(reason));
            }
            (Settle::Capture, _) | (_, Settled::Done) => {}
            (settle, Settled::Failed(e)) => {
                tracing::error!(
                    target: "retrysafe::idempotency",
                    event = EventKind::CompletionLost.as_str(),
                    settle = ?settle,
                    error = %e,
                    "could not write the idempotency record; the handler's answer is returned anyway"
                );
                self.note(Note::Event(EventKind::CompletionLost));
            }
            (_, Settled::Aborted) => self.note(Note::Event(EventKind::CompletionLost)),
        }
        None
    }

    fn transaction_settled(&self, settle: Settle, settled: Settled) -> Option<Problem> {
        if settle != Settle::Complete {
            return None; // a failed rollback is the server's to finish
        }
        match settled {
            Settled::Done => None,
            // A statement of the handler failed, which aborted the transaction, and the
            // handler answered anyway. Nothing was committed. A client error is passed
            // on (a retry gets it again); a success would be a lie.
            Settled::Aborted if self.status.is_some_and(|s| s.is_client_error()) => None,
            Settled::Aborted => {
                tracing::error!(
                    target: "retrysafe::idempotency",
                    status = ?self.status,
                    "a statement of the request's transaction failed, and the handler answered as if it had not; nothing was committed"
                );
                Some(self.policy.problem(
                    ProblemKind::HandlerPanicked,
                    "a statement of the request's transaction failed; nothing was committed",
                ))
            }
            Settled::Failed(e) => {
                tracing::warn!(
                    target: "retrysafe::idempotency",
                    error = %e,
                    "could not commit the request's transaction; answering 503"
                );
                Some(self.policy.problem(
                    ProblemKind::StoreUnavailable,
                    "the request's transaction could not be committed; retry with the same key",
                ))
            }
        }
    }
}
