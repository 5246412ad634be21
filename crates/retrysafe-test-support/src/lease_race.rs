//! Lease takeover against a late holder, exhaustively: every interleaving of the
//! operations of a holder whose lease expired (renew, late completion, release, commit
//! point, mark unknown, all with its old token) with those of a second copy of the
//! request (a takeover claim with a new token, then its completion or release), run
//! against a store through the `IdempotencyStore` trait, checking after every step
//! that the store behaves as one record with one holder.
//!
//! # Why interleavings of whole operations cover the race
//!
//! Every store runs each of these operations as one critical section: the MemoryStore
//! under the mutex of the key's shard (its completed records then go to moka, which is
//! why loom cannot model it), the RedisStore as one Lua script, the PostgresStore as one
//! SQL statement. Operations are therefore linearisable: whatever the threads, the
//! outcome of a concurrent run is the outcome of some sequential order of its
//! operations, consistent with each client's program order. Running every such order
//! (every merge of the two clients' programs) sequentially covers every outcome a
//! concurrent run can have. Here the MemoryStore runs them on tokio's paused clock
//! (exact, instant); the same engine ([`run_all`]) runs against Redis and PostgreSQL
//! with real leases (`tests/lease_race_stores.rs` of the workspace).
//!
//! # What is checked, for every interleaving
//!
//! - at most one completion succeeds, and a completed record is final: every later
//!   change by either token is refused as stale, a claim finds the completed record;
//!   likewise an `outcome_unknown` record (marked by the holder, or made by a claim
//!   that found an expired lease without a declared commit point);
//! - a takeover fences the old holder: once the second copy's claim succeeds, every
//!   operation with the old token is refused as stale;
//! - a refused (stale) operation changes nothing: the record read before and after it
//!   is the same;
//! - a claim succeeds only on an absent record (not a takeover) or on an expired lease
//!   of the old holder before its commit point (a takeover); it finds a live lease, a
//!   completed or unknown record otherwise;
//! - the final record is the one the last successful operation made.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use retrysafe_core::idempotency::{
    CommitPoint, Completed, Fingerprint, Record, RecordId, StoredResponse, Token,
};
use retrysafe_core::store::conformance::{TestClock, fresh_id};
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, StoreError};

/// One operation of the race.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// The old holder renews its (expired) lease.
    Renew,
    /// The old holder completes, late.
    Complete,
    /// The old holder releases the record.
    Release,
    /// The old holder declares its commit point.
    CommitPoint,
    /// The old holder marks the outcome unknown.
    MarkUnknown,
    /// The second copy claims with a new token (a takeover if it finds the expired lease
    /// before the commit point).
    Claim,
    /// The second copy completes (only if its claim succeeded).
    NewComplete,
    /// The second copy releases (only if its claim succeeded).
    NewRelease,
}

/// The old holder's programs (each after its lease expired).
pub const OLD_PROGRAMS: [&[Op]; 6] = [
    &[Op::Renew, Op::Complete],
    &[Op::Renew, Op::Release],
    &[Op::Complete],
    &[Op::Release],
    &[Op::CommitPoint, Op::Complete],
    &[Op::MarkUnknown],
];

/// The second copy's programs.
pub const NEW_PROGRAMS: [&[Op]; 2] = [&[Op::Claim, Op::NewComplete], &[Op::Claim, Op::NewRelease]];

/// The commit points the old holder claimed with.
pub const COMMIT_POINTS: [CommitPoint; 2] = [CommitPoint::Before, CommitPoint::Undeclared];

/// One interleaving: the old holder's commit point at claim time and the merged order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Case {
    /// The commit point the old holder declared when it claimed.
    pub commit_point: CommitPoint,
    /// The two programs' operations, merged.
    pub ops: Vec<Op>,
}

/// Every merge of `a` and `b` that keeps the order within each.
pub fn merges(a: &[Op], b: &[Op]) -> Vec<Vec<Op>> {
    match (a.split_first(), b.split_first()) {
        (None, _) => vec![b.to_vec()],
        (_, None) => vec![a.to_vec()],
        (Some((x, a_rest)), Some((y, b_rest))) => {
            let mut out = Vec::new();
            for mut tail in merges(a_rest, b) {
                tail.insert(0, *x);
                out.push(tail);
            }
            for mut tail in merges(a, b_rest) {
                tail.insert(0, *y);
                out.push(tail);
            }
            out
        }
    }
}

/// Every case: each commit point × old program × new program × merge.
pub fn all_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for commit_point in COMMIT_POINTS {
        for old in OLD_PROGRAMS {
            for new in NEW_PROGRAMS {
                for ops in merges(old, new) {
                    cases.push(Case { commit_point, ops });
                }
            }
        }
    }
    cases
}

/// The outcome of one operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The operation succeeded.
    Ok,
    /// Refused: the token no longer holds the record.
    Stale,
    /// The claim succeeded.
    Claimed {
        /// Over the old holder's expired lease.
        takeover: bool,
    },
    /// The claim found a record.
    Existing {
        /// What it found.
        record: Kind,
        /// Whether the claim itself made it `outcome_unknown`.
        became_unknown: bool,
    },
    /// The second copy did not hold the record, so it did not run this.
    Skipped,
}

/// A record, summarised: whose it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// No record.
    Absent,
    /// In progress, held by the old holder (`true`) or the second copy.
    InProgress {
        /// Held by the old holder.
        old: bool,
        /// Its holder's commit point.
        commit_point: CommitPoint,
    },
    /// Completed by the old holder (`true`) or the second copy.
    Completed {
        /// Completed by the old holder.
        old: bool,
    },
    /// `outcome_unknown`.
    Unknown,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// What one case did: each operation's outcome, and the record after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    /// Each operation, its outcome and the record after it.
    pub steps: Vec<(Op, Outcome, Kind)>,
}

fn fingerprint() -> Fingerprint {
    Fingerprint::from_bytes([7; 32])
}

fn completed(body: &'static str) -> Completed {
    Completed::new(
        fingerprint(),
        Some(StoredResponse::new(
            StatusCode::OK,
            Vec::new(),
            Bytes::from_static(body.as_bytes()),
            Vec::new(),
        )),
    )
}

/// One case's record and tokens.
struct Holders {
    id: RecordId,
    old: Token,
    new: Token,
}

impl Holders {
    fn kind(&self, record: Option<Record>) -> Kind {
        match record {
            None => Kind::Absent,
            Some(Record::InProgress(p)) => {
                assert!(
                    p.token == self.old || p.token == self.new,
                    "held by a token nobody has"
                );
                Kind::InProgress {
                    old: p.token == self.old,
                    commit_point: p.commit_point,
                }
            }
            Some(Record::Completed(c)) => {
                let body = c.response.map(|r| r.body).unwrap_or_default();
                assert!(body == "old" || body == "new", "completed with {body:?}");
                Kind::Completed { old: body == "old" }
            }
            Some(Record::OutcomeUnknown(_)) => Kind::Unknown,
            Some(other) => panic!("a record state this test does not know: {other:?}"),
        }
    }
}

/// `Ok` or `Stale`; any other error fails the case.
fn plain(what: Op, r: Result<(), StoreError>) -> Outcome {
    match r {
        Ok(()) => Outcome::Ok,
        Err(StoreError::StaleToken) => Outcome::Stale,
        Err(e) => panic!("{what:?}: {e}"),
    }
}

/// The lease the old holder claimed with, and the second copy claims and renews with.
fn lease(clock: &dyn TestClock) -> Duration {
    clock.lease()
}

/// Runs every case against `store`: claims a record per case for the old holder, lets
/// every lease expire at once (`clock`), then runs each case's operations in order,
/// checking the invariants of the module docs after each. Returns each case's trace.
pub async fn run_all<S: IdempotencyStore>(store: &S, clock: &dyn TestClock) -> Vec<(Case, Trace)> {
    let cases = all_cases();
    let retention = lease(clock) * 20;
    let mut holders = Vec::with_capacity(cases.len());
    for case in &cases {
        let h = Holders {
            id: fresh_id(),
            old: Token::random(),
            new: Token::random(),
        };
        let claim = Claim::new(
            h.old,
            fingerprint(),
            lease(clock),
            retention,
            case.commit_point,
        );
        match store.claim(&h.id, &claim).await.unwrap() {
            ClaimOutcome::Claimed { takeover: false } => {}
            other => panic!("first claim: {other:?}"),
        }
        holders.push(h);
    }
    clock.advance(lease(clock) + lease(clock) / 2).await;
    let mut traces = Vec::with_capacity(cases.len());
    for (case, h) in cases.into_iter().zip(holders) {
        let trace = run_case(store, clock, &case, &h, retention).await;
        check(&case, &trace);
        traces.push((case, trace));
    }
    traces
}

/// Runs one case's operations; the record is read before and after each.
async fn run_case<S: IdempotencyStore>(
    store: &S,
    clock: &dyn TestClock,
    case: &Case,
    h: &Holders,
    retention: Duration,
) -> Trace {
    let mut new_holds = false;
    let mut steps = Vec::new();
    for &op in &case.ops {
        let before = h.kind(store.get(&h.id).await.unwrap());
        let outcome = apply(store, clock, op, h, retention, &mut new_holds).await;
        let after = h.kind(store.get(&h.id).await.unwrap());
        check_step(case, op, &outcome, before, after);
        steps.push((op, outcome, after));
    }
    Trace { steps }
}

/// Runs `op` on the case's record; `new_holds` tells whether the new holder's claim
/// succeeded (its own operations are skipped until then).
async fn apply<S: IdempotencyStore>(
    store: &S,
    clock: &dyn TestClock,
    op: Op,
    h: &Holders,
    retention: Duration,
    new_holds: &mut bool,
) -> Outcome {
    match op {
        Op::Renew => plain(op, store.renew(&h.id, h.old, lease(clock)).await),
        Op::Complete => plain(
            op,
            store
                .complete(&h.id, h.old, &completed("old"), retention)
                .await,
        ),
        Op::Release => plain(op, store.release(&h.id, h.old).await),
        Op::CommitPoint => plain(op, store.commit_point(&h.id, h.old).await),
        Op::MarkUnknown => plain(
            op,
            store
                .mark_unknown(
                    &h.id,
                    h.old,
                    retention,
                    retrysafe_core::idempotency::UnknownReason::ServiceError,
                )
                .await,
        ),
        Op::Claim => {
            let claim = Claim::new(
                h.new,
                fingerprint(),
                lease(clock),
                retention,
                CommitPoint::Before,
            );
            match store.claim(&h.id, &claim).await.unwrap() {
                ClaimOutcome::Claimed { takeover } => {
                    *new_holds = true;
                    Outcome::Claimed { takeover }
                }
                ClaimOutcome::Existing {
                    record,
                    became_unknown,
                } => Outcome::Existing {
                    record: h.kind(Some(record)),
                    became_unknown,
                },
                other => panic!("a claim outcome this test does not know: {other:?}"),
            }
        }
        Op::NewComplete if *new_holds => plain(
            op,
            store
                .complete(&h.id, h.new, &completed("new"), retention)
                .await,
        ),
        Op::NewRelease if *new_holds => plain(op, store.release(&h.id, h.new).await),
        Op::NewComplete | Op::NewRelease => Outcome::Skipped,
    }
}

/// What one step must keep: a refused operation changes nothing, and a claim takes
/// only an absent record or (as a takeover) the old holder's expired one.
fn check_step(case: &Case, op: Op, outcome: &Outcome, before: Kind, after: Kind) {
    if matches!(outcome, Outcome::Stale | Outcome::Skipped) {
        assert_eq!(
            before, after,
            "{case:?}: a refused {op:?} changed the record"
        );
    }
    if let Outcome::Claimed { takeover } = *outcome {
        let expected = if takeover {
            before
                == Kind::InProgress {
                    old: true,
                    commit_point: CommitPoint::Before,
                }
        } else {
            before == Kind::Absent
        };
        assert!(
            expected,
            "{case:?}: claimed (takeover {takeover}) over {before}"
        );
    }
}

/// The invariants over a whole trace (see the module docs).
fn check(case: &Case, trace: &Trace) {
    let mut completions = 0;
    let mut final_since: Option<Kind> = None;
    let mut fenced = false;
    for (op, outcome, after) in &trace.steps {
        let old_op = matches!(
            op,
            Op::Renew | Op::Complete | Op::Release | Op::CommitPoint | Op::MarkUnknown
        );
        if let Some(done) = final_since {
            // Completed (or outcome unknown) is final.
            match outcome {
                Outcome::Ok => panic!("{case:?}: {op:?} succeeded after {done}"),
                Outcome::Claimed { .. } => panic!("{case:?}: claimed a record {done}"),
                Outcome::Existing { record, .. } => assert_eq!(*record, done, "{case:?}"),
                Outcome::Stale | Outcome::Skipped => {}
            }
            assert_eq!(*after, done, "{case:?}: the completed record changed");
        }
        if fenced && old_op {
            assert_eq!(
                *outcome,
                Outcome::Stale,
                "{case:?}: the old token was accepted after the takeover"
            );
        }
        match (op, outcome) {
            (Op::Claim, Outcome::Claimed { .. }) => fenced = true,
            (Op::Complete | Op::NewComplete, Outcome::Ok) => {
                completions += 1;
                let done = Kind::Completed {
                    old: *op == Op::Complete,
                };
                assert_eq!(*after, done, "{case:?}");
                final_since = Some(done);
            }
            (Op::Release | Op::NewRelease, Outcome::Ok) => {
                assert_eq!(*after, Kind::Absent, "{case:?}");
            }
            (Op::MarkUnknown, Outcome::Ok)
            | (
                Op::Claim,
                Outcome::Existing {
                    became_unknown: true,
                    ..
                },
            ) => {
                // Outcome unknown is final too.
                assert_eq!(*after, Kind::Unknown, "{case:?}");
                final_since = Some(Kind::Unknown);
            }
            _ => {}
        }
    }
    assert!(completions <= 1, "{case:?}: {completions} completions");
    if let Some(done) = final_since {
        assert_eq!(trace.steps.last().map(|s| s.2), Some(done), "{case:?}");
    }
}
