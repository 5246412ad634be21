//! The conformance cases of a [`ReconcilableStore`]: adoption, settlement, the
//! in-flight index, notified flags, and a reconciler driving a resolver.
//!
//! Each case needs a store of its own (a fresh key prefix, table or schema): the
//! reconciler case adopts whatever is due in the store it is given. The
//! [`reconcilable_store_tests!`](crate::reconcilable_store_tests) macro names every case
//! and turns each into a test.
//!
//! ```text
//! retrysafe_core::reconcilable_store_tests! {
//!     #[tokio::test(start_paused = true)]
//!     store = || async { MyStore::new() },
//!     clock = retrysafe_core::store::conformance::PausedClock::default(),
//! }
//! ```

#![allow(
    clippy::panic,
    clippy::needless_pass_by_value,
    clippy::indexing_slicing
)]

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};

use super::conformance::{TestClock, fresh_id};
use super::{Claim, ClaimOutcome, StoreError};
use crate::idempotency::{
    CommitPoint, Completed, Fingerprint, Record, RecordId, RequestInfo, Scope, StoredResponse,
    Token, UnknownOutcome, UnknownReason,
};
use crate::recovery::{
    Operator, OperatorError, PendingRecord, PendingState, ReconcilableStore, Resolution, Resolver,
    Settlement,
};
use crate::wire::IdempotencyKey;

/// Generates one test per reconcile conformance case.
#[macro_export]
macro_rules! reconcilable_store_tests {
    (#[$attr:meta] store = $store:expr, clock = $clock:expr $(,)?) => {
        $crate::reconcilable_store_tests!(@cases [$attr] [$store] [$clock]
            due_lists_expired_claims_not_live_ones,
            adopt_shows_the_request_and_note,
            adopted_record_is_resolving_for_everyone,
            settle_complete_replays_the_response,
            settle_release_lets_the_next_copy_run,
            settle_later_turns_a_claim_unknown_and_defers_it,
            adoption_lapses_to_the_prior_state,
            unknown_records_are_due_with_reason_and_flag,
            before_claims_are_before,
            reconciled_counts_reconcilers,
            completed_and_released_records_are_not_due,
            reconciler_applies_every_resolution,
            operator_lists_unknown_records_not_yet_due,
            operator_leaves_live_claims_alone,
            operator_releases_an_expired_claim_before_its_commit_point,
            a_lease_made_unknown_by_a_copy_waits_like_the_claim,
        );
    };
    (@cases [$attr:meta] [$store:expr] [$clock:expr] $($case:ident),* $(,)?) => {
        $(
            #[$attr]
            async fn $case() {
                let store = ($store)().await;
                let clock = $clock;
                $crate::store::reconcile_conformance::$case(store, &clock).await;
            }
        )*
    };
}

const WHY: UnknownReason = UnknownReason::Status(StatusCode::BAD_GATEWAY);

fn fp(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

fn info(key: &str) -> RequestInfo {
    RequestInfo::new(Scope::new(key), Method::POST, "/payments")
        .with_label(Some(Arc::from("Acme")))
        .with_key(IdempotencyKey::new(key).expect("a valid key"))
}

fn claim<'a>(clock: &dyn TestClock, request: &'a RequestInfo, cp: CommitPoint) -> Claim<'a> {
    Claim::new(
        Token::random(),
        fp(1),
        clock.lease(),
        clock.lease() * 40,
        cp,
    )
    .with_request(request)
}

fn response(body: &'static str) -> StoredResponse {
    StoredResponse::new(
        StatusCode::CREATED,
        Vec::new(),
        Bytes::from_static(body.as_bytes()),
        Vec::new(),
    )
}

async fn must_claim<S: ReconcilableStore>(store: &S, id: &RecordId, c: &Claim<'_>) {
    match store.claim(id, c).await.expect("claim") {
        ClaimOutcome::Claimed { .. } => {}
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// A claim of `id` whose holder passed its commit point with a note and then vanished;
/// its lease has ended.
async fn abandoned<S: ReconcilableStore>(
    store: &S,
    clock: &dyn TestClock,
    id: &RecordId,
    request: &RequestInfo,
) -> Token {
    let c = claim(clock, request, CommitPoint::Undeclared);
    must_claim(store, id, &c).await;
    store
        .commit_point_with(id, c.token, b"ledger-entry-7")
        .await
        .expect("commit point with a note");
    clock.advance(clock.lease() + clock.lease() / 2).await;
    c.token
}

async fn adopt<S: ReconcilableStore>(
    store: &S,
    clock: &dyn TestClock,
    id: &RecordId,
) -> (Token, PendingRecord) {
    let token = Token::random();
    let p = store
        .adopt(id, token, clock.lease() * 4, Some(Duration::ZERO))
        .await
        .expect("adopt")
        .unwrap_or_else(|| panic!("the record should be adoptable"));
    (token, p)
}

fn stale(r: Result<(), StoreError>, what: &str) {
    assert!(
        matches!(r, Err(StoreError::StaleToken)),
        "{what}: expected a stale token, got {r:?}"
    );
}

/// An expired claim is due once its lease ended `stale` ago; a live one is not.
#[doc(hidden)]
pub async fn due_lists_expired_claims_not_live_ones<S: ReconcilableStore>(
    store: S,
    clock: &dyn TestClock,
) {
    let (live, gone) = (fresh_id(), fresh_id());
    let (a, b) = (info("live-1"), info("gone-1"));
    must_claim(
        &store,
        &live,
        &Claim::new(
            Token::random(),
            fp(1),
            clock.lease() * 20,
            clock.lease() * 40,
            CommitPoint::Undeclared,
        )
        .with_request(&a),
    )
    .await;
    abandoned(&store, clock, &gone, &b).await;
    let due = store.due(Duration::ZERO, 100_000).await.expect("due");
    assert!(due.contains(&gone), "an expired claim is due");
    assert!(!due.contains(&live), "a live claim is not due");
    let due = store.due(clock.lease() * 10, 100_000).await.expect("due");
    assert!(
        !due.contains(&gone),
        "not before `stale` has passed since the lease ended"
    );
}

/// Adopting gives what a resolver needs: state, request, note, age.
#[doc(hidden)]
pub async fn adopt_shows_the_request_and_note<S: ReconcilableStore>(
    store: S,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let request = info("order-1");
    abandoned(&store, clock, &id, &request).await;
    let (_, p) = adopt(&store, clock, &id).await;
    assert_eq!(p.record, id);
    assert_eq!(
        p.state,
        PendingState::Claim {
            commit_point: CommitPoint::Passed
        }
    );
    assert_eq!(p.fingerprint, fp(1));
    assert_eq!(p.request.as_deref(), Some(&request));
    assert_eq!(p.key().map(IdempotencyKey::as_str), Some("order-1"));
    assert_eq!(p.note.as_deref(), Some(&b"ledger-entry-7"[..]));
    assert!(p.age >= clock.lease(), "age {:?}", p.age);
    assert!(!p.notified);
}

/// While adopted: reads and claims see `resolving`, a second adoption gets nothing, and
/// the late holder's token calls are refused.
#[doc(hidden)]
pub async fn adopted_record_is_resolving_for_everyone<S: ReconcilableStore>(
    store: S,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let request = info("order-2");
    let holder = abandoned(&store, clock, &id, &request).await;
    let (_, _) = adopt(&store, clock, &id).await;
    assert!(
        matches!(store.get(&id).await.expect("get"), Some(Record::Resolving(r)) if r.fingerprint == fp(1))
    );
    let copy = claim(clock, &request, CommitPoint::Undeclared);
    match store.claim(&id, &copy).await.expect("claim") {
        ClaimOutcome::Existing {
            record: Record::Resolving(_),
            became_unknown: false,
        } => {}
        other => panic!("a copy must see the record being resolved, got {other:?}"),
    }
    let again = store
        .adopt(&id, Token::random(), clock.lease(), Some(Duration::ZERO))
        .await
        .expect("adopt");
    assert!(again.is_none(), "a second adoption must get nothing");
    stale(
        store.renew(&id, holder, clock.lease()).await,
        "renew by the late holder",
    );
    stale(
        store.commit_point(&id, holder).await,
        "commit point by the late holder",
    );
    stale(
        store
            .complete(&id, holder, &Completed::new(fp(1), None), clock.lease())
            .await,
        "complete by the late holder",
    );
    stale(
        store.mark_unknown(&id, holder, clock.lease(), WHY).await,
        "mark_unknown by the late holder",
    );
    stale(
        store.release(&id, holder).await,
        "release by the late holder",
    );
    assert!(matches!(
        store.get(&id).await.expect("get"),
        Some(Record::Resolving(_))
    ));
}

/// `Complete` stores the resolver's response under the original fingerprint.
#[doc(hidden)]
pub async fn settle_complete_replays_the_response<S: ReconcilableStore>(
    store: S,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let request = info("order-3");
    abandoned(&store, clock, &id, &request).await;
    let (token, _) = adopt(&store, clock, &id).await;
    stale(
        store
            .settle(&id, Token::random(), Settlement::Release, false)
            .await,
        "settle by another token",
    );
    let complete = Settlement::Complete {
        response: response("paid"),
        retention: clock.lease() * 40,
    };
    store
        .settle(&id, token, complete.clone(), true)
        .await
        .expect("settle");
    // Sent again after a lost reply: already done.
    store
        .settle(&id, token, complete, true)
        .await
        .expect("settle resent");
    let copy = claim(clock, &request, CommitPoint::Undeclared);
    match store.claim(&id, &copy).await.expect("claim") {
        ClaimOutcome::Existing {
            record: Record::Completed(c),
            ..
        } => {
            assert_eq!(c, Completed::new(fp(1), Some(response("paid"))));
        }
        other => panic!("expected the completed record, got {other:?}"),
    }
    assert!(
        store.peek(&id).await.expect("peek").is_none(),
        "a completed record is not pending"
    );
}

/// `Release` deletes the record: the next copy runs.
#[doc(hidden)]
pub async fn settle_release_lets_the_next_copy_run<S: ReconcilableStore>(
    store: S,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let request = info("order-4");
    abandoned(&store, clock, &id, &request).await;
    let (token, _) = adopt(&store, clock, &id).await;
    store
        .settle(&id, token, Settlement::Release, false)
        .await
        .expect("settle");
    store
        .settle(&id, token, Settlement::Release, false)
        .await
        .expect("settle resent");
    assert_eq!(store.get(&id).await.expect("get"), None);
    must_claim(
        &store,
        &id,
        &claim(clock, &request, CommitPoint::Undeclared),
    )
    .await;
}

/// `Later` turns an abandoned claim into `outcome_unknown`, notified, due again only
/// after the wait.
#[doc(hidden)]
pub async fn settle_later_turns_a_claim_unknown_and_defers_it<S: ReconcilableStore>(
    store: S,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let request = info("order-5");
    abandoned(&store, clock, &id, &request).await;
    let (token, _) = adopt(&store, clock, &id).await;
    let wait = clock.lease() * 2;
    store
        .settle(&id, token, Settlement::Later { after: wait }, true)
        .await
        .expect("settle");
    assert!(matches!(
        store.get(&id).await.expect("get"),
        Some(Record::OutcomeUnknown(_))
    ));
    let p = store.peek(&id).await.expect("peek").expect("still pending");
    assert!(
        matches!(p.state, PendingState::Unknown { .. }),
        "{:?}",
        p.state
    );
    assert!(p.notified);
    assert_eq!(
        p.note.as_deref(),
        Some(&b"ledger-entry-7"[..]),
        "the note stays"
    );
    assert!(
        !store
            .due(Duration::ZERO, 100_000)
            .await
            .expect("due")
            .contains(&id),
        "not due before the wait"
    );
    clock.advance(wait + clock.lease() / 2).await;
    assert!(
        store
            .due(Duration::ZERO, 100_000)
            .await
            .expect("due")
            .contains(&id),
        "due after the wait"
    );
    let (_, p) = adopt(&store, clock, &id).await;
    assert!(p.notified);
}

/// A lapsed adoption leaves the record as it was: another adoption may take it, and
/// the first adopter's settlement is refused.
#[doc(hidden)]
pub async fn adoption_lapses_to_the_prior_state<S: ReconcilableStore>(
    store: S,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let request = info("order-6");
    abandoned(&store, clock, &id, &request).await;
    let first = Token::random();
    store
        .adopt(&id, first, clock.lease(), Some(Duration::ZERO))
        .await
        .expect("adopt")
        .expect("adopted");
    clock.advance(clock.lease() + clock.lease() / 2).await;
    assert!(
        matches!(
            store.get(&id).await.expect("get"),
            Some(Record::InProgress(_))
        ),
        "back to the expired claim"
    );
    let (second, p) = adopt(&store, clock, &id).await;
    assert_eq!(
        p.state,
        PendingState::Claim {
            commit_point: CommitPoint::Passed
        }
    );
    stale(
        store.settle(&id, first, Settlement::Release, false).await,
        "settle after the adoption lapsed",
    );
    store
        .settle(
            &id,
            second,
            Settlement::Later {
                after: clock.lease(),
            },
            false,
        )
        .await
        .expect("settle");
    // An unknown record adopted and lapsed is unknown again, never absent.
    clock.advance(clock.lease() * 2).await;
    store
        .adopt(&id, Token::random(), clock.lease(), Some(Duration::ZERO))
        .await
        .expect("adopt")
        .expect("adopted");
    clock.advance(clock.lease() + clock.lease() / 2).await;
    assert!(matches!(
        store.get(&id).await.expect("get"),
        Some(Record::OutcomeUnknown(_))
    ));
}

/// Records marked unknown are due at once, with their reason; `mark_notified` sets the
/// flag.
#[doc(hidden)]
pub async fn unknown_records_are_due_with_reason_and_flag<S: ReconcilableStore>(
    store: S,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let request = info("order-7");
    let c = claim(clock, &request, CommitPoint::Undeclared);
    must_claim(&store, &id, &c).await;
    store
        .mark_unknown(&id, c.token, clock.lease() * 40, WHY)
        .await
        .expect("mark");
    assert!(
        store
            .due(Duration::ZERO, 100_000)
            .await
            .expect("due")
            .contains(&id)
    );
    let p = store.peek(&id).await.expect("peek").expect("pending");
    assert_eq!(p.state, PendingState::Unknown { reason: Some(WHY) });
    assert_eq!(p.request.as_deref(), Some(&request));
    assert!(!p.notified);
    store.mark_notified(&id).await.expect("notified");
    store.mark_notified(&id).await.expect("notified again");
    assert!(
        store
            .peek(&id)
            .await
            .expect("peek")
            .expect("pending")
            .notified
    );
}

/// A claim before its declared commit point is reported as such.
#[doc(hidden)]
pub async fn before_claims_are_before<S: ReconcilableStore>(store: S, clock: &dyn TestClock) {
    let id = fresh_id();
    let request = info("order-8");
    must_claim(&store, &id, &claim(clock, &request, CommitPoint::Before)).await;
    clock.advance(clock.lease() + clock.lease() / 2).await;
    let (token, p) = adopt(&store, clock, &id).await;
    assert!(p.is_before_commit_point());
    assert_eq!(p.note, None);
    store
        .settle(&id, token, Settlement::Release, false)
        .await
        .expect("release");
    assert_eq!(store.get(&id).await.expect("get"), None);
}

/// `reconciled` is true while a reconciler counts itself in.
#[doc(hidden)]
pub async fn reconciled_counts_reconcilers<S: ReconcilableStore>(store: S, _clock: &dyn TestClock) {
    let before = store.reconciled();
    store.set_reconciled(true);
    assert!(store.reconciled());
    store.set_reconciled(false);
    assert_eq!(store.reconciled(), before);
}

/// Completed and released records leave the index.
#[doc(hidden)]
pub async fn completed_and_released_records_are_not_due<S: ReconcilableStore>(
    store: S,
    clock: &dyn TestClock,
) {
    let (done, freed) = (fresh_id(), fresh_id());
    let request = info("order-9");
    let a = claim(clock, &request, CommitPoint::Undeclared);
    must_claim(&store, &done, &a).await;
    store
        .complete(
            &done,
            a.token,
            &Completed::new(fp(1), Some(response("ok"))),
            clock.lease() * 40,
        )
        .await
        .expect("complete");
    let b = claim(clock, &request, CommitPoint::Undeclared);
    must_claim(&store, &freed, &b).await;
    store.release(&freed, b.token).await.expect("release");
    clock.advance(clock.lease() * 2).await;
    let due = store.due(Duration::ZERO, 100_000).await.expect("due");
    assert!(!due.contains(&done) && !due.contains(&freed));
    assert!(
        store
            .adopt(&done, Token::random(), clock.lease(), Some(Duration::ZERO))
            .await
            .expect("adopt")
            .is_none()
    );
}

/// A resolver that answers from a table by key, and counts its calls.
struct Table {
    calls: AtomicUsize,
}

impl Resolver for Table {
    async fn resolve(&self, record: &PendingRecord) -> Resolution {
        self.calls.fetch_add(1, Ordering::SeqCst);
        match record.key().map(IdempotencyKey::as_str) {
            Some(k) if k.starts_with("happened") => Resolution::Happened(response("found")),
            Some(k) if k.starts_with("not") => Resolution::DidNotHappen,
            _ => Resolution::Unknown,
        }
    }
}

/// One reconciler pass over `store` with `table`, every record due at once, the hook
/// recording into `heard`. Other cases may share the store: the case looks only at its
/// own records.
async fn pass<S: ReconcilableStore>(
    store: &S,
    table: &Arc<Table>,
    heard: &Arc<Mutex<Vec<UnknownOutcome>>>,
) {
    let h = Arc::clone(heard);
    let _ = store
        .reconciler(Arc::clone(table))
        .max_execution(Duration::from_millis(1))
        .grace(Duration::from_millis(1))
        .batch(100_000)
        .on_outcome_unknown(move |u| h.lock().expect("lock").push(u.clone()))
        .run_once()
        .await;
}

/// A reconciler pass applies each resolution, releases claims before their commit point
/// without asking, and tells the hook of what stays unknown, once.
#[doc(hidden)]
pub async fn reconciler_applies_every_resolution<S: ReconcilableStore>(
    store: S,
    clock: &dyn TestClock,
) {
    let tag = Token::random().to_hex();
    let keys = ["happened", "not", "unknown"].map(|k| format!("{k}-{tag}"));
    let infos: Vec<RequestInfo> = keys.iter().map(|k| info(k)).collect();
    let ids: Vec<RecordId> = infos.iter().map(|_| fresh_id()).collect();
    for (id, request) in ids.iter().zip(&infos) {
        let c = claim(clock, request, CommitPoint::Passed);
        must_claim(&store, id, &c).await;
    }
    let before = fresh_id();
    let before_info = info(&format!("before-{tag}"));
    must_claim(
        &store,
        &before,
        &claim(clock, &before_info, CommitPoint::Before),
    )
    .await;
    clock.advance(clock.lease() + clock.lease() / 2).await;

    let table = Arc::new(Table {
        calls: AtomicUsize::new(0),
    });
    let heard = Arc::new(Mutex::new(Vec::<UnknownOutcome>::new()));
    pass(&store, &table, &heard).await;
    let [happened, not, unknown] = [0, 1, 2].map(|i| ids[i]);
    match store.get(&happened).await.expect("get") {
        Some(Record::Completed(c)) => assert_eq!(c.response, Some(response("found"))),
        other => panic!("expected completed, got {other:?}"),
    }
    assert_eq!(store.get(&not).await.expect("get"), None);
    assert_eq!(store.get(&before).await.expect("get"), None);
    assert!(matches!(
        store.get(&unknown).await.expect("get"),
        Some(Record::OutcomeUnknown(_))
    ));
    let told: Vec<UnknownOutcome> = heard.lock().expect("lock").clone();
    assert_eq!(
        told.iter().filter(|u| u.record == unknown).count(),
        1,
        "the hook hears of it once"
    );
    assert!(
        told.iter()
            .all(|u| ![happened, not, before].contains(&u.record))
    );
    let heard_unknown = told.iter().find(|u| u.record == unknown).expect("told");
    assert_eq!(heard_unknown.request.as_deref(), Some(&infos[2]));
    // The next pass, once the record is due again, asks again but does not tell again.
    clock.advance(Duration::from_secs(6)).await;
    pass(&store, &table, &heard).await;
    let told = heard
        .lock()
        .expect("lock")
        .iter()
        .filter(|u| u.record == unknown)
        .count();
    assert_eq!(told, 1, "a notified record is not told again");
}

/// An operator lists every pending record, those whose next pass is not due yet
/// included.
#[doc(hidden)]
pub async fn operator_lists_unknown_records_not_yet_due<S: ReconcilableStore>(
    store: S,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let request = info("op-1");
    let c = claim(clock, &request, CommitPoint::Undeclared);
    must_claim(&store, &id, &c).await;
    store
        .mark_unknown(&id, c.token, clock.lease() * 40, WHY)
        .await
        .expect("mark");
    let (token, _) = adopt(&store, clock, &id).await;
    let later = Settlement::Later {
        after: clock.lease() * 20,
    };
    store.settle(&id, token, later, true).await.expect("settle");
    let due = store.due(Duration::ZERO, 100_000).await.expect("due");
    assert!(!due.contains(&id), "in backoff: not due");
    let listed = Operator::new(store.clone())
        .pending(100_000)
        .await
        .expect("pending");
    assert!(
        listed.iter().any(|p| p.record == id),
        "an operator sees it all the same"
    );
}

/// A live claim is never changed by an operator, before or past its commit point: the
/// holder is not fenced and settles its record itself.
#[doc(hidden)]
pub async fn operator_leaves_live_claims_alone<S: ReconcilableStore>(
    store: S,
    clock: &dyn TestClock,
) {
    let operator = Operator::new(store.clone());
    let (passed, before) = (fresh_id(), fresh_id());
    let (a, b) = (info("op-2"), info("op-3"));
    let long = |request| {
        Claim::new(
            Token::random(),
            fp(1),
            clock.lease() * 20,
            clock.lease() * 40,
            CommitPoint::Before,
        )
        .with_request(request)
    };
    let (p, q) = (long(&a), long(&b));
    must_claim(&store, &passed, &p).await;
    store
        .commit_point(&passed, p.token)
        .await
        .expect("commit point");
    must_claim(&store, &before, &q).await;
    assert!(matches!(
        operator.release_before_commit_point(&passed).await,
        Err(OperatorError::PastCommitPoint)
    ));
    for id in [&passed, &before] {
        assert!(matches!(
            operator.resolve(id, Resolution::Unknown).await,
            Err(OperatorError::Live)
        ));
        assert!(matches!(
            operator.resolve(id, Resolution::DidNotHappen).await,
            Err(OperatorError::Live)
        ));
        assert!(matches!(
            store.get(id).await.expect("get"),
            Some(Record::InProgress(_))
        ));
    }
    assert!(matches!(
        operator.release_before_commit_point(&before).await,
        Err(OperatorError::Live)
    ));
    store
        .renew(&passed, p.token, clock.lease() * 20)
        .await
        .expect("the holder still renews");
    store
        .commit_point(&before, q.token)
        .await
        .expect("the holder still reaches its commit point");
    for (id, token) in [(&passed, p.token), (&before, q.token)] {
        store
            .complete(id, token, &Completed::new(fp(1), None), clock.lease() * 40)
            .await
            .expect("the holder still completes");
    }
}

/// An operator releases a claim whose lease ended before its commit point: the next
/// copy runs, the late holder is fenced.
#[doc(hidden)]
pub async fn operator_releases_an_expired_claim_before_its_commit_point<S: ReconcilableStore>(
    store: S,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let request = info("op-4");
    let c = claim(clock, &request, CommitPoint::Before);
    must_claim(&store, &id, &c).await;
    clock.advance(clock.lease() + clock.lease() / 2).await;
    Operator::new(store.clone())
        .release_before_commit_point(&id)
        .await
        .expect("released");
    assert_eq!(store.get(&id).await.expect("get"), None);
    stale(
        store.commit_point(&id, c.token).await,
        "commit point by the late holder",
    );
    let copy = claim(clock, &request, CommitPoint::Before);
    must_claim(&store, &id, &copy).await;
}

/// An expired claim past its commit point that a copy made unknown is considered by a
/// reconciler only `stale` after its lease ended, as the claim would have been: its
/// holder may still run until then, and must not meet a `DidNotHappen`.
#[doc(hidden)]
pub async fn a_lease_made_unknown_by_a_copy_waits_like_the_claim<S: ReconcilableStore>(
    store: S,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let request = info("wait-1");
    abandoned(&store, clock, &id, &request).await;
    let copy = claim(clock, &request, CommitPoint::Undeclared);
    match store.claim(&id, &copy).await.expect("claim") {
        ClaimOutcome::Existing {
            became_unknown: true,
            ..
        } => {}
        other => panic!("the copy should make it unknown, got {other:?}"),
    }
    let stale = clock.lease() * 3;
    let due = store.due(stale, 100_000).await.expect("due");
    assert!(
        !due.contains(&id),
        "not before `stale` since the lease ended"
    );
    let early = store
        .adopt(&id, Token::random(), clock.lease(), Some(stale))
        .await
        .expect("adopt");
    assert!(early.is_none(), "not adoptable before `stale` either");
    let due = store.due(Duration::ZERO, 100_000).await.expect("due");
    assert!(due.contains(&id), "due for a reconciler that does not wait");
    clock.advance(stale).await;
    let due = store.due(stale, 100_000).await.expect("due");
    assert!(due.contains(&id), "due once `stale` has passed");
    let p = store
        .adopt(&id, Token::random(), clock.lease(), Some(stale))
        .await
        .expect("adopt")
        .expect("adoptable once `stale` has passed");
    assert_eq!(
        p.state,
        PendingState::Unknown {
            reason: Some(UnknownReason::LeaseExpired)
        }
    );
}
