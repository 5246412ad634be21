//! The idempotency protocol on its own: every row of the `IdempotencyLayer`'s decision
//! table as a transition of the machine, for a store-backed engine and for an engine
//! that rolls back (the transactional layer). Paused clock: waits are exact.
#![allow(clippy::unwrap_used, clippy::panic)]

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use retrysafe_core::__private::protocol::{
    Claimed, Finish, Handled, Note, Policy, Protocol, Reply, Settle, Settled, Step, Waited,
};
use retrysafe_core::Deadline;
use retrysafe_core::idempotency::{
    CommitPoint, Completed, Decision, EventKind, Evicted, Fingerprint, HeaderFilter, InProgress,
    OutcomeUnknown, Record, Resolving, StoredResponse, Token, UnknownReason,
};
use retrysafe_core::problem::{Problem, ProblemKind};
use retrysafe_core::store::StoreError;

const FP: Fingerprint = Fingerprint::from_bytes([1; 32]);
const OTHER: Fingerprint = Fingerprint::from_bytes([2; 32]);
const SECOND: Duration = Duration::from_secs(1);

fn stored() -> StoredResponse {
    StoredResponse::capture(
        StatusCode::CREATED,
        &HeaderMap::new(),
        Bytes::from_static(b"paid"),
        None,
        &HeaderFilter::default(),
    )
}

fn completed(fp: Fingerprint) -> Record {
    Record::Completed(Completed::new(fp, Some(stored())))
}

fn in_progress(fp: Fingerprint) -> Record {
    Record::InProgress(InProgress::new(
        10_000,
        Token::random(),
        fp,
        CommitPoint::Undeclared,
    ))
}

fn existing(record: Record) -> Claimed {
    Claimed::Existing {
        record,
        became_unknown: false,
    }
}

fn store() -> Protocol {
    Protocol::new(&Policy::new(), FP, None)
}

fn transactional() -> Protocol {
    Protocol::new(&Policy::new().rolls_back(true), FP, None)
}

fn notes(p: &mut Protocol) -> Vec<Note> {
    p.notes().collect()
}

fn problem(step: Step) -> Problem {
    match step {
        Step::Problem(p) => p,
        other => panic!("expected a problem, got {other:?}"),
    }
}

fn answered(status: u16) -> Handled {
    Handled::Answered {
        status: StatusCode::from_u16(status).unwrap(),
        no_effect: false,
    }
}

/// Claims the key for `p` and leaves it running.
fn running(mut p: Protocol) -> Protocol {
    assert_eq!(p.start(), Step::Claim);
    assert_eq!(p.claimed(Claimed::Mine { takeover: false }), Step::Run);
    assert_eq!(notes(&mut p), [Note::Event(EventKind::Claimed)]);
    p
}

// ---- before the handler: what a copy gets ----

#[tokio::test(start_paused = true)]
async fn a_first_request_claims_and_runs() {
    let mut p = store();
    assert_eq!(p.start(), Step::Claim);
    assert_eq!(p.claimed(Claimed::Mine { takeover: false }), Step::Run);
    assert_eq!(notes(&mut p), [Note::Event(EventKind::Claimed)]);
    assert_eq!(notes(&mut p), []);
}

#[tokio::test(start_paused = true)]
async fn an_expired_lease_before_its_commit_point_is_taken_over() {
    let mut p = store();
    assert_eq!(p.claimed(Claimed::Mine { takeover: true }), Step::Run);
    assert_eq!(notes(&mut p), [Note::Event(EventKind::Takeover)]);
}

#[tokio::test(start_paused = true)]
async fn a_completed_key_replays_the_stored_response() {
    let mut p = store();
    assert_eq!(p.claimed(existing(completed(FP))), Step::Replay(stored()));
    assert_eq!(notes(&mut p), [Note::Event(EventKind::Replayed)]);
}

#[tokio::test(start_paused = true)]
async fn a_different_request_with_the_key_is_a_mismatch_in_flight_or_completed() {
    for record in [completed(OTHER), in_progress(OTHER)] {
        let mut p = store();
        let answer = problem(p.claimed(existing(record)));
        assert_eq!(answer.kind(), ProblemKind::KeyMismatch);
        assert_eq!(answer.kind().status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert!(answer.do_not_retry());
        assert_eq!(notes(&mut p), [Note::Event(EventKind::Mismatch)]);
    }
}

#[tokio::test(start_paused = true)]
async fn a_key_in_flight_answers_409_with_retry_after_at_once() {
    let mut p = Protocol::new(&Policy::new().in_flight_retry_after(2 * SECOND), FP, None);
    let answer = problem(p.claimed(existing(in_progress(FP))));
    assert_eq!(answer.kind(), ProblemKind::InFlight);
    assert_eq!(answer.kind().status(), StatusCode::CONFLICT);
    assert_eq!(answer.retry_after_hint(), Some(2 * SECOND));
    assert!(!answer.do_not_retry());
    assert_eq!(notes(&mut p), [Note::Event(EventKind::Conflict)]);
}

#[tokio::test(start_paused = true)]
async fn waiting_for_a_key_in_flight_ends_in_the_replay_and_reports_one_conflict() {
    let policy = Policy::new().wait_for_in_flight(Some(5 * SECOND));
    let mut p = Protocol::new(&policy, FP, None);
    assert_eq!(p.claimed(existing(in_progress(FP))), Step::Wait(5 * SECOND));
    assert_eq!(notes(&mut p), [Note::Event(EventKind::Conflict)]);
    tokio::time::advance(2 * SECOND).await;
    assert_eq!(p.waited(Waited::LookAgain), Step::Claim);
    // Still in flight: the wait goes on for what is left, with no second conflict.
    assert_eq!(p.claimed(existing(in_progress(FP))), Step::Wait(3 * SECOND));
    assert_eq!(notes(&mut p), []);
    // A wait that sees the record directly (a transaction's probe).
    assert_eq!(
        p.waited(Waited::Record(completed(FP))),
        Step::Replay(stored())
    );
    assert_eq!(notes(&mut p), [Note::Event(EventKind::Replayed)]);
}

#[tokio::test(start_paused = true)]
async fn a_wait_is_bounded_by_the_deadline_and_ends_in_409() {
    let policy = Policy::new().wait_for_in_flight(Some(5 * SECOND));
    let mut p = Protocol::new(&policy, FP, Some(Deadline::after(SECOND)));
    assert_eq!(p.claimed(existing(in_progress(FP))), Step::Wait(SECOND));
    assert_eq!(
        problem(p.waited(Waited::TimedOut)).kind(),
        ProblemKind::InFlight
    );
    // Out of time: no further wait.
    let mut p = Protocol::new(&policy, FP, Some(Deadline::after(SECOND)));
    tokio::time::advance(SECOND).await;
    assert_eq!(
        problem(p.claimed(existing(in_progress(FP)))).kind(),
        ProblemKind::InFlight
    );
}

#[tokio::test(start_paused = true)]
async fn waiters_whose_holder_released_race_to_claim() {
    let policy = Policy::new().wait_for_in_flight(Some(5 * SECOND));
    let mut p = Protocol::new(&policy, FP, None);
    assert!(matches!(
        p.claimed(existing(in_progress(FP))),
        Step::Wait(_)
    ));
    assert_eq!(p.waited(Waited::LookAgain), Step::Claim);
    assert_eq!(p.claimed(Claimed::Mine { takeover: false }), Step::Run);
}

#[tokio::test(start_paused = true)]
async fn an_unknown_outcome_is_a_stable_500_never_a_rerun() {
    let mut p = store();
    let record = Record::OutcomeUnknown(OutcomeUnknown::new(FP));
    let answer = problem(p.claimed(existing(record)));
    assert_eq!(answer.kind(), ProblemKind::OutcomeUnknown);
    assert_eq!(answer.kind().status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(answer.do_not_retry());
    assert_eq!(notes(&mut p), [Note::Event(EventKind::Unknown)]);
    assert_eq!(p.decision(), Some(Decision::Unknown));
}

#[tokio::test(start_paused = true)]
async fn an_expired_lease_past_its_commit_point_becomes_unknown_and_is_reported() {
    let mut p = store();
    let claimed = Claimed::Existing {
        record: Record::OutcomeUnknown(OutcomeUnknown::new(FP)),
        became_unknown: true,
    };
    assert_eq!(
        problem(p.claimed(claimed)).kind(),
        ProblemKind::OutcomeUnknown
    );
    assert_eq!(
        notes(&mut p),
        [
            Note::Unknown(UnknownReason::LeaseExpired),
            Note::Event(EventKind::Unknown)
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_response_too_large_to_store_answers_409_response_not_stored() {
    let mut p = store();
    let record = Record::Completed(Completed::new(FP, None));
    let answer = problem(p.claimed(existing(record)));
    assert_eq!(answer.kind(), ProblemKind::ResponseNotStored);
    assert_eq!(answer.kind().status(), StatusCode::CONFLICT);
    assert!(answer.do_not_retry());
    assert_eq!(notes(&mut p), [Note::Event(EventKind::NotStored)]);
    assert_eq!(p.decision(), Some(Decision::NotStored));
}

#[tokio::test(start_paused = true)]
async fn a_store_that_fails_answers_503_with_retry_after() {
    let policy = Policy::new().unavailable_retry_after(3 * SECOND);
    for error in [
        StoreError::unavailable("down"),
        StoreError::Timeout,
        StoreError::StaleToken,
    ] {
        let in_transit = matches!(error, StoreError::Timeout | StoreError::Unavailable(_));
        let mut p = Protocol::new(&policy, FP, None);
        let answer = problem(p.claimed(Claimed::Failed(error)));
        assert_eq!(answer.kind(), ProblemKind::StoreUnavailable);
        assert_eq!(answer.kind().status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(answer.retry_after_hint(), Some(3 * SECOND));
        // A claim lost in transit may have landed: it is taken back.
        let unavailable = Note::Event(EventKind::Unavailable);
        let expected: &[Note] = if in_transit {
            &[Note::ReleaseClaim, unavailable]
        } else {
            &[unavailable]
        };
        assert_eq!(notes(&mut p), expected);
        assert_eq!(p.decision(), Some(Decision::Unavailable));
    }
}

#[tokio::test(start_paused = true)]
async fn a_full_store_answers_503_overloaded() {
    let mut p = Protocol::new(&Policy::new().fail_open(true), FP, None);
    let answer = problem(p.claimed(Claimed::Failed(StoreError::Full)));
    assert_eq!(answer.kind(), ProblemKind::Overloaded);
    assert_eq!(answer.retry_after_hint(), Some(SECOND));
}

#[tokio::test(start_paused = true)]
async fn fail_open_runs_unguarded_only_when_no_record_was_seen_and_the_store_is_down() {
    let open = Policy::new()
        .fail_open(true)
        .wait_for_in_flight(Some(SECOND));
    let mut p = Protocol::new(&open, FP, None);
    assert_eq!(
        p.claimed(Claimed::Failed(StoreError::unavailable("down"))),
        Step::RunUnguarded
    );
    let mut p = Protocol::new(&open, FP, None);
    assert_eq!(
        p.claimed(Claimed::Failed(StoreError::Timeout)),
        Step::RunUnguarded
    );
    // Never over corrupt data.
    let corrupt = Record::decode(Bytes::from_static(b"\xff")).unwrap_err();
    let mut p = Protocol::new(&open, FP, None);
    let answer = problem(p.claimed(Claimed::Failed(StoreError::Corrupt(corrupt))));
    assert_eq!(answer.kind(), ProblemKind::StoreUnavailable);
    // Never past a record that exists: after a wait, a failed claim answers 503.
    let mut p = Protocol::new(&open, FP, None);
    assert!(matches!(
        p.claimed(existing(in_progress(FP))),
        Step::Wait(_)
    ));
    assert_eq!(p.waited(Waited::LookAgain), Step::Claim);
    let answer = problem(p.claimed(Claimed::Failed(StoreError::unavailable("down"))));
    assert_eq!(answer.kind(), ProblemKind::StoreUnavailable);
    // Nor when the wait itself fails.
    let mut p = Protocol::new(&open, FP, None);
    assert!(matches!(
        p.claimed(existing(in_progress(FP))),
        Step::Wait(_)
    ));
    let answer = problem(p.waited(Waited::Failed(StoreError::unavailable("down"))));
    assert_eq!(answer.kind(), ProblemKind::StoreUnavailable);
}

// ---- after the handler: how the record is settled ----

#[tokio::test(start_paused = true)]
async fn a_success_or_a_client_error_is_captured_and_stored() {
    for status in [200, 201, 302, 400, 404, 409, 422] {
        let mut p = running(store());
        assert_eq!(
            p.handled(answered(status)),
            Finish {
                settle: Settle::Capture,
                reply: Reply::Response
            }
        );
        assert_eq!(
            p.captured(true),
            Finish {
                settle: Settle::Complete,
                reply: Reply::Response
            }
        );
        assert_eq!(p.settled(Settle::Complete, Settled::Done), None);
        assert_eq!(notes(&mut p), []);
    }
}

#[tokio::test(start_paused = true)]
async fn unauthorised_forbidden_throttled_or_no_effect_releases_the_key() {
    for status in [401, 403, 429] {
        let mut p = running(store());
        assert_eq!(
            p.handled(answered(status)),
            Finish {
                settle: Settle::Release,
                reply: Reply::Response
            }
        );
    }
    let mut p = running(store());
    let handled = Handled::Answered {
        status: StatusCode::SERVICE_UNAVAILABLE,
        no_effect: true,
    };
    assert_eq!(p.handled(handled).settle, Settle::Release);
}

#[tokio::test(start_paused = true)]
async fn a_5xx_or_408_is_unknown_marked_do_not_retry_and_reported_once_written() {
    for status in [500, 502, 503, 408] {
        let mut p = running(store());
        let finish = p.handled(answered(status));
        let reason = UnknownReason::Status(StatusCode::from_u16(status).unwrap());
        assert_eq!(
            finish,
            Finish {
                settle: Settle::MarkUnknown(reason),
                reply: Reply::ResponseDoNotRetry
            }
        );
        assert_eq!(p.settled(finish.settle, Settled::Done), None);
        assert_eq!(notes(&mut p), [Note::Unknown(reason)]);
    }
}

#[tokio::test(start_paused = true)]
async fn a_panic_is_unknown_and_answers_500_handler_panicked() {
    let mut p = running(store());
    let finish = p.handled(Handled::Panicked);
    assert_eq!(finish.settle, Settle::MarkUnknown(UnknownReason::Panicked));
    let Reply::Problem(answer) = finish.reply else {
        panic!("a problem")
    };
    assert_eq!(answer.kind(), ProblemKind::HandlerPanicked);
    assert!(answer.do_not_retry());
}

#[tokio::test(start_paused = true)]
async fn a_service_error_is_unknown_and_passed_on() {
    let mut p = running(store());
    assert_eq!(
        p.handled(Handled::Failed),
        Finish {
            settle: Settle::MarkUnknown(UnknownReason::ServiceError),
            reply: Reply::Error
        }
    );
}

#[tokio::test(start_paused = true)]
async fn a_body_that_fails_while_captured_is_unknown() {
    let mut p = running(store());
    assert_eq!(p.handled(answered(200)).settle, Settle::Capture);
    let finish = p.captured(false);
    assert_eq!(finish.settle, Settle::MarkUnknown(UnknownReason::BodyError));
    let Reply::Problem(answer) = finish.reply else {
        panic!("a problem")
    };
    assert_eq!(answer.kind(), ProblemKind::OutcomeUnknown);
}

#[tokio::test(start_paused = true)]
async fn a_write_that_fails_keeps_the_real_answer_and_reports_completion_lost() {
    for settle in [
        Settle::Complete,
        Settle::Release,
        Settle::MarkUnknown(UnknownReason::Panicked),
    ] {
        let mut p = running(store());
        let failed = Settled::Failed(StoreError::unavailable("down"));
        assert_eq!(p.settled(settle, failed), None);
        assert_eq!(notes(&mut p), [Note::Event(EventKind::CompletionLost)]);
    }
}

// ---- handlers that declare a commit point ----

/// `running(store())`, its handler declaring a commit point and done in `state`.
fn declared(state: CommitPoint) -> Protocol {
    let mut p = running(store());
    p.commit_point(state);
    p
}

#[tokio::test(start_paused = true)]
async fn a_failure_before_the_declared_commit_point_releases_and_invites_a_retry() {
    for status in [500, 502, 503, 408] {
        let mut p = declared(CommitPoint::Before);
        let finish = p.handled(answered(status));
        assert_eq!(
            finish,
            Finish {
                settle: Settle::Release,
                reply: Reply::Response
            },
            "{status} before the commit point: released, answered as it is"
        );
        assert_eq!(p.settled(finish.settle, Settled::Done), None);
        assert_eq!(notes(&mut p), [], "nothing is unknown, nothing is reported");
    }

    let mut p = declared(CommitPoint::Before);
    let finish = p.handled(Handled::Panicked);
    assert_eq!(finish.settle, Settle::Release);
    let Reply::Problem(answer) = finish.reply else {
        panic!("a problem")
    };
    assert_eq!(answer.kind(), ProblemKind::HandlerPanicked);
    assert_eq!(answer.kind().status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(!answer.do_not_retry(), "nothing happened: a retry is safe");

    let mut p = declared(CommitPoint::Before);
    assert_eq!(
        p.handled(Handled::Failed),
        Finish {
            settle: Settle::Release,
            reply: Reply::Error
        }
    );

    let mut p = declared(CommitPoint::Before);
    let finish = p.handled(Handled::Cancelled);
    assert_eq!(finish.settle, Settle::Release);
    let Reply::Problem(answer) = finish.reply else {
        panic!("a problem")
    };
    assert!(!answer.do_not_retry());

    let mut p = declared(CommitPoint::Before);
    assert_eq!(p.handled(answered(200)).settle, Settle::Capture);
    let finish = p.captured(false);
    assert_eq!(finish.settle, Settle::Release);
    let Reply::Problem(answer) = finish.reply else {
        panic!("a problem")
    };
    assert!(!answer.do_not_retry());
}

#[tokio::test(start_paused = true)]
async fn before_the_commit_point_a_success_or_a_client_error_is_still_stored() {
    for status in [200, 201, 400, 404, 409, 422] {
        let mut p = declared(CommitPoint::Before);
        assert_eq!(p.handled(answered(status)).settle, Settle::Capture);
        assert_eq!(p.captured(true).settle, Settle::Complete);
    }
}

#[tokio::test(start_paused = true)]
async fn a_failure_past_the_commit_point_or_undeclared_is_unknown() {
    for state in [CommitPoint::Passed, CommitPoint::Undeclared] {
        let mut p = declared(state);
        let reason = UnknownReason::Status(StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            p.handled(answered(503)),
            Finish {
                settle: Settle::MarkUnknown(reason),
                reply: Reply::ResponseDoNotRetry
            },
            "{state:?}"
        );

        let mut p = declared(state);
        let finish = p.handled(Handled::Panicked);
        assert_eq!(finish.settle, Settle::MarkUnknown(UnknownReason::Panicked));
        let Reply::Problem(answer) = finish.reply else {
            panic!("a problem")
        };
        assert!(answer.do_not_retry(), "{state:?}");

        let mut p = declared(state);
        assert_eq!(
            p.handled(Handled::Cancelled).settle,
            Settle::MarkUnknown(UnknownReason::Cancelled)
        );
    }
}

// ---- an engine that rolls back ----

#[tokio::test(start_paused = true)]
async fn rolled_back_failures_release_and_are_never_unknown() {
    let mut p = running(transactional());
    let finish = p.handled(Handled::Panicked);
    assert_eq!(finish.settle, Settle::Release);
    let Reply::Problem(answer) = finish.reply else {
        panic!("a problem")
    };
    assert_eq!(answer.kind(), ProblemKind::HandlerPanicked);
    assert!(!answer.do_not_retry(), "nothing happened: a retry is safe");

    let mut p = running(transactional());
    assert_eq!(
        p.handled(answered(502)),
        Finish {
            settle: Settle::Release,
            reply: Reply::Response
        }
    );
    let mut p = running(transactional());
    assert_eq!(p.handled(Handled::Failed).settle, Settle::Release);
    let mut p = running(transactional());
    assert_eq!(p.handled(answered(200)).settle, Settle::Capture);
    assert_eq!(p.captured(false).settle, Settle::Release);
    assert_eq!(p.settled(Settle::Release, Settled::Done), None);
    assert_eq!(notes(&mut p), []);
}

#[tokio::test(start_paused = true)]
async fn a_busy_key_of_an_uncommitted_transaction_is_in_flight() {
    let mut p = transactional();
    assert_eq!(
        problem(p.claimed(Claimed::Busy)).kind(),
        ProblemKind::InFlight
    );
    assert_eq!(notes(&mut p), [Note::Event(EventKind::Conflict)]);
}

#[tokio::test(start_paused = true)]
async fn a_transaction_that_cannot_commit_answers_503_and_a_timed_out_open_releases_nothing() {
    let mut p = running(transactional());
    assert_eq!(p.handled(answered(201)).settle, Settle::Capture);
    assert_eq!(p.captured(true).settle, Settle::Complete);
    let answer = p
        .settled(
            Settle::Complete,
            Settled::Failed(StoreError::unavailable("gone")),
        )
        .unwrap();
    assert_eq!(answer.kind(), ProblemKind::StoreUnavailable);

    let mut p = transactional();
    let answer = problem(p.claimed(Claimed::Failed(StoreError::Timeout)));
    assert_eq!(answer.kind(), ProblemKind::StoreUnavailable);
    assert_eq!(notes(&mut p), [Note::Event(EventKind::Unavailable)]);
}

#[tokio::test(start_paused = true)]
async fn an_aborted_transaction_passes_a_client_error_and_refuses_a_success() {
    let mut p = running(transactional());
    p.handled(answered(409));
    assert_eq!(p.settled(Settle::Complete, Settled::Aborted), None);

    let mut p = running(transactional());
    p.handled(answered(201));
    let answer = p.settled(Settle::Complete, Settled::Aborted).unwrap();
    assert_eq!(answer.kind(), ProblemKind::HandlerPanicked);
    assert!(!answer.do_not_retry());
}

#[tokio::test(start_paused = true)]
async fn with_a_reconciler_pending_records_answer_503_outcome_pending_with_retry_after() {
    let reconciled = || Protocol::new(&Policy::new().reconciled(true), FP, None);
    let unknown = Record::OutcomeUnknown(OutcomeUnknown::new(FP));
    let p = problem(reconciled().claimed(existing(unknown.clone())));
    assert_eq!(p.kind(), ProblemKind::OutcomePending);
    assert_eq!(p.kind().status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(p.retry_after_hint(), Some(SECOND));
    assert!(
        !p.do_not_retry(),
        "a client comes back to see the resolution"
    );

    // A record being resolved: pending, with or without a reconciler here.
    let resolving = Record::Resolving(Resolving::new(FP, 5_000));
    let p = problem(store().claimed(existing(resolving)));
    assert_eq!(p.kind(), ProblemKind::OutcomePending);

    // An expired lease past its commit point that this claim made unknown: reported
    // once, and pending.
    let mut p = reconciled();
    let step = p.claimed(Claimed::Existing {
        record: unknown.clone(),
        became_unknown: true,
    });
    assert_eq!(problem(step).kind(), ProblemKind::OutcomePending);
    assert_eq!(
        notes(&mut p),
        [
            Note::Unknown(UnknownReason::LeaseExpired),
            Note::Event(EventKind::Pending)
        ]
    );
    assert_eq!(p.decision(), Some(Decision::Pending));

    // Without a reconciler the answer stays the stable 500.
    let p = problem(store().claimed(existing(unknown)));
    assert_eq!(p.kind(), ProblemKind::OutcomeUnknown);
    assert!(p.do_not_retry());
}

#[tokio::test(start_paused = true)]
async fn an_evicted_trace_answers_409_response_evicted_and_never_runs() {
    for mut p in [store(), transactional()] {
        let step = p.claimed(existing(Record::Evicted(Evicted::new())));
        assert_eq!(notes(&mut p), [Note::Event(EventKind::Evicted)]);
        assert_eq!(p.decision(), Some(Decision::Evicted));
        let p = problem(step);
        assert_eq!(p.kind(), ProblemKind::ResponseEvicted);
        assert_eq!(p.kind().status(), StatusCode::CONFLICT);
        assert!(p.do_not_retry());
    }
}
