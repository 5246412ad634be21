//! The store conformance suite: one set of cases every [`IdempotencyStore`] passes.
//!
//! Each case is an async function over a shared store and a [`TestClock`]; the
//! [`store_conformance_tests!`](crate::store_conformance_tests) macro, which names
//! them all, turns them into one test each (the functions themselves are its
//! plumbing). Cases use fresh random record ids, so they can share one store (one
//! Redis database, one PostgreSQL schema) and run in parallel.
//!
//! ```text
//! retrysafe_core::store_conformance_tests! {
//!     #[tokio::test(start_paused = true)]
//!     store = || async { MyStore::new() },
//!     clock = retrysafe_core::store::conformance::PausedClock::default(),
//! }
//! ```

// Test code: a failed expectation panics with a message, as in any test.
#![allow(
    clippy::panic,
    clippy::match_wildcard_for_single_variants,
    clippy::needless_pass_by_value
)]

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};

use super::{Claim, ClaimOutcome, FaultyStore, IdempotencyStore, StoreError};
use crate::idempotency::{
    CommitPoint, Completed, Fingerprint, OutcomeUnknown, Record, RecordId, Scope, StoredResponse,
    Token, UnknownReason,
};
use crate::wire::IdempotencyKey;

/// The reason the cases give for an unknown outcome.
const WHY: UnknownReason = UnknownReason::ServiceError;

/// How a conformance case lets time pass for a store.
pub trait TestClock: Send + Sync {
    /// The lease the cases claim with: long enough for a few store round trips.
    fn lease(&self) -> Duration;
    /// Lets `by` pass for the store.
    fn advance(&self, by: Duration) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

/// tokio's paused clock (for stores that take their time from tokio, like the
/// MemoryStore): [`advance`](TestClock::advance) is `tokio::time::advance`. Use with
/// `#[tokio::test(start_paused = true)]`.
#[non_exhaustive]
#[derive(Debug, Clone, Copy)]
pub struct PausedClock {
    /// The lease; 10 s by default.
    pub lease: Duration,
}

impl Default for PausedClock {
    fn default() -> Self {
        PausedClock {
            lease: Duration::from_secs(10),
        }
    }
}

impl PausedClock {
    /// The paused clock with leases of `lease`.
    pub fn with_lease(lease: Duration) -> Self {
        PausedClock { lease }
    }
}

impl TestClock for PausedClock {
    fn lease(&self) -> Duration {
        self.lease
    }
    fn advance(&self, by: Duration) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(tokio::time::advance(by))
    }
}

/// The real clock (for stores with their own clock, like Redis and PostgreSQL):
/// [`advance`](TestClock::advance) sleeps. Leases of a few hundred milliseconds keep
/// the suite quick.
#[non_exhaustive]
#[derive(Debug, Clone, Copy)]
pub struct RealClock {
    /// The lease; 400 ms by default.
    pub lease: Duration,
}

impl Default for RealClock {
    fn default() -> Self {
        RealClock {
            lease: Duration::from_millis(400),
        }
    }
}

impl RealClock {
    /// The real clock with leases of `lease`.
    pub fn with_lease(lease: Duration) -> Self {
        RealClock { lease }
    }
}

impl TestClock for RealClock {
    fn lease(&self) -> Duration {
        self.lease
    }
    fn advance(&self, by: Duration) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(tokio::time::sleep(by))
    }
}

/// Generates one test per conformance case.
///
/// `store` is a closure returning a future of the store; `clock` a [`TestClock`].
#[macro_export]
macro_rules! store_conformance_tests {
    (#[$attr:meta] store = $store:expr, clock = $clock:expr $(,)?) => {
        $crate::store_conformance_tests!(@cases [$attr] [$store] [$clock]
            claim_complete_replay,
            claim_race_has_one_winner,
            stale_tokens_are_refused,
            stale_token_after_expiry_and_reclaim,
            takeover_before_commit_point,
            no_takeover_with_other_fingerprint,
            expiry_after_commit_point_is_unknown,
            expiry_without_declared_commit_point_is_unknown,
            renew_extends_the_lease,
            release_frees_the_key,
            mark_unknown_is_final,
            completed_retention,
            unknown_retention,
            not_stored_marker,
            stored_response_round_trips,
            wait_wakes_on_completion,
            wait_wakes_on_release,
            wait_returns_after_max,
            keys_are_independent,
            repeated_claim_is_claimed,
            repeated_complete_succeeds,
            repeated_release_succeeds,
            repeated_mark_unknown_succeeds,
            repeated_renew_and_commit_point_succeed,
            lost_replies_are_resent,
        );
    };
    (@cases [$attr:meta] [$store:expr] [$clock:expr] $($case:ident),* $(,)?) => {
        $(
            #[$attr]
            async fn $case() {
                let store = ::std::sync::Arc::new(($store)().await);
                let clock = $clock;
                $crate::store::conformance::$case(store, &clock).await;
            }
        )*
    };
}

/// A fresh random record id.
pub fn fresh_id() -> RecordId {
    let key = IdempotencyKey::new(&Token::random().to_hex()).expect("hex is a valid key");
    RecordId::new(&Scope::new(Token::random().to_bytes()), &key)
}

fn fp(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

fn claim_args(
    clock: &dyn TestClock,
    fingerprint: Fingerprint,
    commit_point: CommitPoint,
) -> Claim<'static> {
    Claim {
        token: Token::random(),
        fingerprint,
        lease: clock.lease(),
        retention: clock.lease() * 10,
        commit_point,
        request: None,
    }
}

fn response(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: vec![(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body: Bytes::from_static(body.as_bytes()),
        trailers: Vec::new(),
    }
}

fn completed(fingerprint: Fingerprint, body: &'static str) -> Completed {
    Completed {
        fingerprint,
        response: Some(response(body)),
    }
}

async fn must_claim<S: IdempotencyStore>(store: &S, id: &RecordId, c: &Claim<'_>) -> bool {
    match store.claim(id, c).await.expect("claim") {
        ClaimOutcome::Claimed { takeover } => takeover,
        other => panic!("expected a claim, got {other:?}"),
    }
}

async fn existing<S: IdempotencyStore>(store: &S, id: &RecordId, c: &Claim<'_>) -> (Record, bool) {
    match store.claim(id, c).await.expect("claim") {
        ClaimOutcome::Existing {
            record,
            became_unknown,
        } => (record, became_unknown),
        other => panic!("expected an existing record, got {other:?}"),
    }
}

fn assert_stale<T: std::fmt::Debug>(r: Result<T, StoreError>, what: &str) {
    assert!(
        matches!(r, Err(StoreError::StaleToken)),
        "{what}: expected StaleToken, got {r:?}"
    );
}

/// Claim, complete, then a second claim sees the completed record with its response.
#[doc(hidden)]
pub async fn claim_complete_replay<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let id = fresh_id();
    let c = claim_args(clock, fp(1), CommitPoint::Undeclared);
    assert!(!must_claim(&*store, &id, &c).await);
    match store.get(&id).await.expect("get") {
        Some(Record::InProgress(r)) => {
            assert_eq!(r.token, c.token);
            assert_eq!(r.fingerprint, fp(1));
            assert_eq!(r.commit_point, CommitPoint::Undeclared);
        }
        other => panic!("expected in_progress, got {other:?}"),
    }
    let done = completed(fp(1), "{\"id\":1}");
    store
        .complete(&id, c.token, &done, clock.lease() * 10)
        .await
        .expect("complete");
    let again = claim_args(clock, fp(1), CommitPoint::Undeclared);
    let (record, became_unknown) = existing(&*store, &id, &again).await;
    assert!(!became_unknown);
    assert_eq!(record, Record::Completed(done.clone()));
    assert_eq!(
        store.get(&id).await.expect("get"),
        Some(Record::Completed(done))
    );
}

/// Many concurrent claims of one id: exactly one wins, the others see it in progress.
#[doc(hidden)]
pub async fn claim_race_has_one_winner<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let id = fresh_id();
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let store = Arc::clone(&store);
        let c = claim_args(clock, fp(1), CommitPoint::Undeclared);
        tasks.push(tokio::spawn(async move {
            (c.token, store.claim(&id, &c).await.expect("claim"))
        }));
    }
    let mut winners = Vec::new();
    let mut losers = 0;
    for t in tasks {
        let (token, outcome) = t.await.expect("task");
        match outcome {
            ClaimOutcome::Claimed { takeover } => {
                assert!(!takeover);
                winners.push(token);
            }
            ClaimOutcome::Existing {
                record: Record::InProgress(r),
                became_unknown: false,
            } => {
                losers += 1;
                assert_eq!(r.fingerprint, fp(1));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one claim wins");
    assert_eq!(losers, 31);
    match store.get(&id).await.expect("get") {
        Some(Record::InProgress(r)) => assert_eq!(Some(&r.token), winners.first()),
        other => panic!("expected in_progress, got {other:?}"),
    }
}

/// Every token-carrying call refuses a token that never held the record.
#[doc(hidden)]
pub async fn stale_tokens_are_refused<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let id = fresh_id();
    let c = claim_args(clock, fp(1), CommitPoint::Before);
    must_claim(&*store, &id, &c).await;
    let wrong = Token::random();
    let r = clock.lease() * 10;
    assert_stale(
        store.complete(&id, wrong, &completed(fp(1), "x"), r).await,
        "complete",
    );
    assert_stale(store.release(&id, wrong).await, "release");
    assert_stale(store.renew(&id, wrong, clock.lease()).await, "renew");
    assert_stale(store.commit_point(&id, wrong).await, "commit_point");
    assert_stale(store.mark_unknown(&id, wrong, r, WHY).await, "mark_unknown");
    // Nothing changed.
    match store.get(&id).await.expect("get") {
        Some(Record::InProgress(p)) => {
            assert_eq!(p.token, c.token);
            assert_eq!(p.commit_point, CommitPoint::Before);
        }
        other => panic!("expected in_progress, got {other:?}"),
    }
    // On an absent record too.
    let absent = fresh_id();
    assert_stale(
        store
            .complete(&absent, wrong, &completed(fp(1), "x"), r)
            .await,
        "complete absent",
    );
    assert_stale(store.release(&absent, wrong).await, "release absent");
    assert_stale(
        store.renew(&absent, wrong, clock.lease()).await,
        "renew absent",
    );
    // And once completed, the holder's own token is stale for further changes.
    store
        .complete(&id, c.token, &completed(fp(1), "x"), r)
        .await
        .expect("complete");
    assert_stale(store.release(&id, c.token).await, "release after complete");
    assert_stale(
        store.mark_unknown(&id, c.token, r, WHY).await,
        "mark_unknown after complete",
    );
    assert_stale(
        store
            .complete(&id, c.token, &completed(fp(1), "y"), r)
            .await,
        "complete twice",
    );
    assert_eq!(
        store.get(&id).await.expect("get"),
        Some(Record::Completed(completed(fp(1), "x")))
    );
}

/// After a lease expires and another copy re-claims, the first holder's token is stale.
#[doc(hidden)]
pub async fn stale_token_after_expiry_and_reclaim<S: IdempotencyStore>(
    store: Arc<S>,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let first = claim_args(clock, fp(1), CommitPoint::Before);
    must_claim(&*store, &id, &first).await;
    clock.advance(clock.lease() + clock.lease() / 2).await;
    let second = claim_args(clock, fp(1), CommitPoint::Before);
    assert!(must_claim(&*store, &id, &second).await, "a takeover");
    let r = clock.lease() * 10;
    assert_stale(
        store
            .complete(&id, first.token, &completed(fp(1), "late"), r)
            .await,
        "late complete",
    );
    assert_stale(store.release(&id, first.token).await, "late release");
    assert_stale(
        store.renew(&id, first.token, clock.lease()).await,
        "late renew",
    );
    assert_stale(
        store.commit_point(&id, first.token).await,
        "late commit_point",
    );
    assert_stale(
        store.mark_unknown(&id, first.token, r, WHY).await,
        "late mark_unknown",
    );
    store
        .complete(&id, second.token, &completed(fp(1), "second"), r)
        .await
        .expect("complete by the new holder");
    assert_eq!(
        store.get(&id).await.expect("get"),
        Some(Record::Completed(completed(fp(1), "second")))
    );
}

/// An expired lease before the commit point is taken over; a live one is not.
#[doc(hidden)]
pub async fn takeover_before_commit_point<S: IdempotencyStore>(
    store: Arc<S>,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let first = claim_args(clock, fp(1), CommitPoint::Before);
    must_claim(&*store, &id, &first).await;
    let early = claim_args(clock, fp(1), CommitPoint::Before);
    let (rec, _) = existing(&*store, &id, &early).await;
    assert!(
        matches!(rec, Record::InProgress(_)),
        "a live lease is not taken over"
    );
    clock.advance(clock.lease() + clock.lease() / 2).await;
    let second = claim_args(clock, fp(1), CommitPoint::Before);
    assert!(must_claim(&*store, &id, &second).await);
    match store.get(&id).await.expect("get") {
        Some(Record::InProgress(p)) => {
            assert_eq!(p.token, second.token);
            assert_eq!(p.commit_point, CommitPoint::Before);
        }
        other => panic!("expected in_progress, got {other:?}"),
    }
}

/// An expired lease is never taken over by a request with another fingerprint.
#[doc(hidden)]
pub async fn no_takeover_with_other_fingerprint<S: IdempotencyStore>(
    store: Arc<S>,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let first = claim_args(clock, fp(1), CommitPoint::Before);
    must_claim(&*store, &id, &first).await;
    clock.advance(clock.lease() + clock.lease() / 2).await;
    let other = claim_args(clock, fp(2), CommitPoint::Before);
    let (rec, became_unknown) = existing(&*store, &id, &other).await;
    assert!(!became_unknown);
    assert_eq!(rec.fingerprint(), &fp(1));
    // The rightful copy can still take over.
    let same = claim_args(clock, fp(1), CommitPoint::Before);
    assert!(must_claim(&*store, &id, &same).await);
}

/// An expired lease after the commit point becomes `outcome_unknown`, reported once.
#[doc(hidden)]
pub async fn expiry_after_commit_point_is_unknown<S: IdempotencyStore>(
    store: Arc<S>,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let first = claim_args(clock, fp(1), CommitPoint::Before);
    must_claim(&*store, &id, &first).await;
    store
        .commit_point(&id, first.token)
        .await
        .expect("commit point");
    match store.get(&id).await.expect("get") {
        Some(Record::InProgress(p)) => assert_eq!(p.commit_point, CommitPoint::Passed),
        other => panic!("expected in_progress, got {other:?}"),
    }
    clock.advance(clock.lease() + clock.lease() / 2).await;
    let second = claim_args(clock, fp(1), CommitPoint::Before);
    let (rec, became_unknown) = existing(&*store, &id, &second).await;
    assert!(became_unknown, "the claim that found the expiry reports it");
    assert_eq!(
        rec,
        Record::OutcomeUnknown(OutcomeUnknown { fingerprint: fp(1) })
    );
    let third = claim_args(clock, fp(1), CommitPoint::Before);
    let (rec, became_unknown) = existing(&*store, &id, &third).await;
    assert!(!became_unknown, "reported once");
    assert!(matches!(rec, Record::OutcomeUnknown(_)));
    assert_stale(
        store
            .complete(&id, first.token, &completed(fp(1), "late"), clock.lease())
            .await,
        "late complete after unknown",
    );
}

/// A handler that never declares a commit point: an expired lease is `outcome_unknown`.
#[doc(hidden)]
pub async fn expiry_without_declared_commit_point_is_unknown<S: IdempotencyStore>(
    store: Arc<S>,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let first = claim_args(clock, fp(1), CommitPoint::Undeclared);
    must_claim(&*store, &id, &first).await;
    clock.advance(clock.lease() + clock.lease() / 2).await;
    let second = claim_args(clock, fp(1), CommitPoint::Undeclared);
    let (rec, became_unknown) = existing(&*store, &id, &second).await;
    assert!(became_unknown);
    assert!(matches!(rec, Record::OutcomeUnknown(_)));
}

/// Renewal keeps a lease alive past its first expiry.
#[doc(hidden)]
pub async fn renew_extends_the_lease<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let id = fresh_id();
    let lease = clock.lease();
    let first = claim_args(clock, fp(1), CommitPoint::Before);
    must_claim(&*store, &id, &first).await;
    clock.advance(lease * 2 / 3).await;
    store.renew(&id, first.token, lease).await.expect("renew");
    clock.advance(lease * 2 / 3).await;
    // 4/3 of a lease after the claim, 2/3 after the renewal: still held.
    let probe = claim_args(clock, fp(1), CommitPoint::Before);
    let (rec, _) = existing(&*store, &id, &probe).await;
    match rec {
        Record::InProgress(p) => assert_eq!(p.token, first.token),
        other => panic!("expected in_progress, got {other:?}"),
    }
    clock.advance(lease).await;
    assert!(
        must_claim(&*store, &id, &probe).await,
        "expired after the renewed lease"
    );
}

/// A released record is gone: the next claim runs afresh (not a takeover).
#[doc(hidden)]
pub async fn release_frees_the_key<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let id = fresh_id();
    let first = claim_args(clock, fp(1), CommitPoint::Undeclared);
    must_claim(&*store, &id, &first).await;
    store.release(&id, first.token).await.expect("release");
    assert_eq!(store.get(&id).await.expect("get"), None);
    let second = claim_args(clock, fp(2), CommitPoint::Undeclared);
    assert!(!must_claim(&*store, &id, &second).await);
    assert_stale(store.release(&id, first.token).await, "release twice");
}

/// `mark_unknown` is final: later claims see `outcome_unknown`, not reported again.
#[doc(hidden)]
pub async fn mark_unknown_is_final<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let id = fresh_id();
    let first = claim_args(clock, fp(1), CommitPoint::Undeclared);
    must_claim(&*store, &id, &first).await;
    store
        .mark_unknown(&id, first.token, clock.lease() * 10, WHY)
        .await
        .expect("mark");
    let second = claim_args(clock, fp(1), CommitPoint::Undeclared);
    let (rec, became_unknown) = existing(&*store, &id, &second).await;
    assert!(!became_unknown);
    assert_eq!(
        rec,
        Record::OutcomeUnknown(OutcomeUnknown { fingerprint: fp(1) })
    );
    clock.advance(clock.lease() * 2).await;
    let (rec, _) = existing(&*store, &id, &second).await;
    assert!(
        matches!(rec, Record::OutcomeUnknown(_)),
        "not a lease: kept for the retention"
    );
}

/// A completed record is kept for its retention, then the key is new again.
#[doc(hidden)]
pub async fn completed_retention<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let id = fresh_id();
    let retention = clock.lease() * 2;
    let first = claim_args(clock, fp(1), CommitPoint::Undeclared);
    must_claim(&*store, &id, &first).await;
    store
        .complete(&id, first.token, &completed(fp(1), "x"), retention)
        .await
        .expect("complete");
    clock.advance(retention / 2).await;
    assert!(matches!(
        store.get(&id).await.expect("get"),
        Some(Record::Completed(_))
    ));
    clock.advance(retention).await;
    assert_eq!(
        store.get(&id).await.expect("get"),
        None,
        "gone after the retention"
    );
    let second = claim_args(clock, fp(2), CommitPoint::Undeclared);
    assert!(!must_claim(&*store, &id, &second).await);
}

/// An `outcome_unknown` record is kept for its retention, then the key is new again.
#[doc(hidden)]
pub async fn unknown_retention<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let id = fresh_id();
    let retention = clock.lease() * 2;
    let first = claim_args(clock, fp(1), CommitPoint::Undeclared);
    must_claim(&*store, &id, &first).await;
    store
        .mark_unknown(&id, first.token, retention, WHY)
        .await
        .expect("mark");
    clock.advance(retention / 2).await;
    assert!(matches!(
        store.get(&id).await.expect("get"),
        Some(Record::OutcomeUnknown(_))
    ));
    clock.advance(retention).await;
    assert_eq!(store.get(&id).await.expect("get"), None);
}

/// A completed-but-not-stored marker round-trips.
#[doc(hidden)]
pub async fn not_stored_marker<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let id = fresh_id();
    let first = claim_args(clock, fp(1), CommitPoint::Undeclared);
    must_claim(&*store, &id, &first).await;
    let marker = Completed {
        fingerprint: fp(1),
        response: None,
    };
    store
        .complete(&id, first.token, &marker, clock.lease() * 10)
        .await
        .expect("complete");
    assert_eq!(
        store.get(&id).await.expect("get"),
        Some(Record::Completed(marker))
    );
}

/// Status, multi-value headers, binary body and trailers come back byte for byte.
#[doc(hidden)]
pub async fn stored_response_round_trips<S: IdempotencyStore>(
    store: Arc<S>,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let first = claim_args(clock, fp(7), CommitPoint::Undeclared);
    must_claim(&*store, &id, &first).await;
    let link = HeaderName::from_static("link");
    let resp = StoredResponse {
        status: StatusCode::ACCEPTED,
        headers: vec![
            (link.clone(), HeaderValue::from_static("<a>; rel=next")),
            (
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            ),
            (link, HeaderValue::from_static("<b>; rel=prev")),
            (
                HeaderName::from_static("x-opaque"),
                HeaderValue::from_bytes(b"\x80\xff").expect("opaque"),
            ),
        ],
        body: Bytes::from((0u8..=255).cycle().take(70_000).collect::<Vec<u8>>()),
        trailers: vec![(
            HeaderName::from_static("x-checksum"),
            HeaderValue::from_static("abc"),
        )],
    };
    let done = Completed {
        fingerprint: fp(7),
        response: Some(resp),
    };
    store
        .complete(&id, first.token, &done, clock.lease() * 10)
        .await
        .expect("complete");
    assert_eq!(
        store.get(&id).await.expect("get"),
        Some(Record::Completed(done))
    );
}

/// A waiter wakes when the holder completes, well before its maximum.
#[doc(hidden)]
pub async fn wait_wakes_on_completion<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let id = fresh_id();
    let lease = clock.lease();
    let first = claim_args(clock, fp(1), CommitPoint::Undeclared);
    must_claim(&*store, &id, &first).await;
    let waiter = {
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            let start = tokio::time::Instant::now();
            store.wait(&id, lease * 20).await.expect("wait");
            start.elapsed()
        })
    };
    clock.advance(lease / 4).await;
    store
        .complete(&id, first.token, &completed(fp(1), "x"), lease * 10)
        .await
        .expect("complete");
    let waited = waiter.await.expect("waiter");
    assert!(
        waited < lease * 10,
        "woke on completion, not at the maximum: {waited:?}"
    );
    assert!(matches!(
        store.get(&id).await.expect("get"),
        Some(Record::Completed(_))
    ));
}

/// A waiter wakes when the holder releases.
#[doc(hidden)]
pub async fn wait_wakes_on_release<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let id = fresh_id();
    let lease = clock.lease();
    let first = claim_args(clock, fp(1), CommitPoint::Undeclared);
    must_claim(&*store, &id, &first).await;
    let waiter = {
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            let start = tokio::time::Instant::now();
            store.wait(&id, lease * 20).await.expect("wait");
            start.elapsed()
        })
    };
    clock.advance(lease / 4).await;
    store.release(&id, first.token).await.expect("release");
    let waited = waiter.await.expect("waiter");
    assert!(waited < lease * 10, "woke on release: {waited:?}");
    assert_eq!(store.get(&id).await.expect("get"), None);
}

/// A waiter on a record that stays in progress returns after its maximum, no sooner.
#[doc(hidden)]
pub async fn wait_returns_after_max<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let id = fresh_id();
    let lease = clock.lease();
    let first = claim_args(clock, fp(1), CommitPoint::Undeclared);
    must_claim(&*store, &id, &first).await;
    let max = lease / 2;
    let waiter = {
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            let start = tokio::time::Instant::now();
            store.wait(&id, max).await.expect("wait");
            start.elapsed()
        })
    };
    // Let the waiter start while the lease is live: on a paused clock `advance` moves
    // time before it yields, so a waiter first polled after it would find the lease
    // already over (and a store that wakes waiters at lease expiry returns at once).
    tokio::task::yield_now().await;
    clock.advance(lease).await;
    let waited = waiter.await.expect("waiter");
    assert!(waited >= max, "waited the maximum: {waited:?}");
    assert!(matches!(
        store.get(&id).await.expect("get"),
        Some(Record::InProgress(_))
    ));
}

/// Records of different ids never interact.
#[doc(hidden)]
pub async fn keys_are_independent<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let a = fresh_id();
    let b = fresh_id();
    let ca = claim_args(clock, fp(1), CommitPoint::Undeclared);
    let cb = claim_args(clock, fp(1), CommitPoint::Undeclared);
    must_claim(&*store, &a, &ca).await;
    must_claim(&*store, &b, &cb).await;
    assert_stale(
        store.release(&a, cb.token).await,
        "a token of another record",
    );
    store.release(&b, cb.token).await.expect("release b");
    assert!(matches!(
        store.get(&a).await.expect("get"),
        Some(Record::InProgress(_))
    ));
}

/// A claim sent again by its own token (its reply was lost) is `Claimed` again; a copy
/// with another token still finds the record in progress.
#[doc(hidden)]
pub async fn repeated_claim_is_claimed<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let id = fresh_id();
    let c = claim_args(clock, fp(1), CommitPoint::Before);
    assert!(!must_claim(&*store, &id, &c).await);
    assert!(
        !must_claim(&*store, &id, &c).await,
        "the repeated claim holds it"
    );
    let copy = claim_args(clock, fp(1), CommitPoint::Before);
    let (rec, became_unknown) = existing(&*store, &id, &copy).await;
    assert!(!became_unknown);
    match rec {
        Record::InProgress(p) => assert_eq!(p.token, c.token),
        other => panic!("expected in_progress, got {other:?}"),
    }
    // Another fingerprint with the holder's token is not the same claim.
    let mut odd = c;
    odd.fingerprint = fp(2);
    existing(&*store, &id, &odd).await;
}

/// A completion sent again with the same content succeeds; one with other content is
/// refused and changes nothing.
#[doc(hidden)]
pub async fn repeated_complete_succeeds<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let id = fresh_id();
    let c = claim_args(clock, fp(1), CommitPoint::Undeclared);
    must_claim(&*store, &id, &c).await;
    let r = clock.lease() * 10;
    let done = completed(fp(1), "{\"id\":1}");
    store
        .complete(&id, c.token, &done, r)
        .await
        .expect("complete");
    store
        .complete(&id, c.token, &done, r)
        .await
        .expect("the same completion again");
    assert_stale(
        store
            .complete(&id, c.token, &completed(fp(1), "other"), r)
            .await,
        "another completion",
    );
    assert_eq!(
        store.get(&id).await.expect("get"),
        Some(Record::Completed(done))
    );
}

/// A release sent again by the token that released succeeds while the record is
/// absent; another token is refused.
#[doc(hidden)]
pub async fn repeated_release_succeeds<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let id = fresh_id();
    let c = claim_args(clock, fp(1), CommitPoint::Undeclared);
    must_claim(&*store, &id, &c).await;
    store.release(&id, c.token).await.expect("release");
    store
        .release(&id, c.token)
        .await
        .expect("the same release again");
    assert_stale(store.release(&id, Token::random()).await, "another token");
    assert_eq!(store.get(&id).await.expect("get"), None);
    // The key is free: the next copy runs afresh.
    let next = claim_args(clock, fp(1), CommitPoint::Undeclared);
    assert!(!must_claim(&*store, &id, &next).await);
}

/// A `mark_unknown` sent again by the token that marked succeeds; another token is
/// refused.
#[doc(hidden)]
pub async fn repeated_mark_unknown_succeeds<S: IdempotencyStore>(
    store: Arc<S>,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let c = claim_args(clock, fp(1), CommitPoint::Undeclared);
    must_claim(&*store, &id, &c).await;
    let r = clock.lease() * 10;
    store
        .mark_unknown(&id, c.token, r, WHY)
        .await
        .expect("mark");
    store
        .mark_unknown(&id, c.token, r, WHY)
        .await
        .expect("the same mark again");
    assert_stale(
        store.mark_unknown(&id, Token::random(), r, WHY).await,
        "another token",
    );
    assert_stale(
        store
            .complete(&id, c.token, &completed(fp(1), "late"), r)
            .await,
        "complete after unknown",
    );
    assert_eq!(
        store.get(&id).await.expect("get"),
        Some(Record::OutcomeUnknown(OutcomeUnknown {
            fingerprint: fp(1)
        }))
    );
}

/// `renew` and `commit_point` sent again by the holder succeed and change nothing more.
#[doc(hidden)]
pub async fn repeated_renew_and_commit_point_succeed<S: IdempotencyStore>(
    store: Arc<S>,
    clock: &dyn TestClock,
) {
    let id = fresh_id();
    let c = claim_args(clock, fp(1), CommitPoint::Before);
    must_claim(&*store, &id, &c).await;
    for _ in 0..2 {
        store
            .renew(&id, c.token, clock.lease())
            .await
            .expect("renew");
    }
    for _ in 0..2 {
        store
            .commit_point(&id, c.token)
            .await
            .expect("commit point");
    }
    match store.get(&id).await.expect("get") {
        Some(Record::InProgress(p)) => {
            assert_eq!(p.token, c.token);
            assert_eq!(p.commit_point, CommitPoint::Passed);
        }
        other => panic!("expected in_progress, got {other:?}"),
    }
}

/// Each token call applied with its reply lost, then sent again with the same token,
/// answers as if the first reply had arrived.
#[doc(hidden)]
pub async fn lost_replies_are_resent<S: IdempotencyStore>(store: Arc<S>, clock: &dyn TestClock) {
    let store = FaultyStore::new(store);
    let r = clock.lease() * 10;
    let lose = |what: &str, out: Result<(), StoreError>| {
        assert!(
            matches!(out, Err(StoreError::Unavailable(_))),
            "{what}: the reply is lost, got {out:?}"
        );
    };

    // claim, renew, commit_point, complete.
    let id = fresh_id();
    let c = claim_args(clock, fp(1), CommitPoint::Before);
    store.lose_next_replies(1);
    lose("claim", store.claim(&id, &c).await.map(drop));
    assert!(!must_claim(&store, &id, &c).await, "claim resent");
    store.lose_next_replies(1);
    lose("renew", store.renew(&id, c.token, clock.lease()).await);
    store
        .renew(&id, c.token, clock.lease())
        .await
        .expect("renew resent");
    store.lose_next_replies(1);
    lose("commit_point", store.commit_point(&id, c.token).await);
    store
        .commit_point(&id, c.token)
        .await
        .expect("commit_point resent");
    let done = completed(fp(1), "done");
    store.lose_next_replies(1);
    lose("complete", store.complete(&id, c.token, &done, r).await);
    store
        .complete(&id, c.token, &done, r)
        .await
        .expect("complete resent");
    assert_eq!(
        store.get(&id).await.expect("get"),
        Some(Record::Completed(done))
    );

    // release.
    let id = fresh_id();
    let c = claim_args(clock, fp(1), CommitPoint::Undeclared);
    must_claim(&store, &id, &c).await;
    store.lose_next_replies(1);
    lose("release", store.release(&id, c.token).await);
    store.release(&id, c.token).await.expect("release resent");
    assert_eq!(store.get(&id).await.expect("get"), None);

    // mark_unknown.
    let id = fresh_id();
    let c = claim_args(clock, fp(1), CommitPoint::Undeclared);
    must_claim(&store, &id, &c).await;
    store.lose_next_replies(1);
    lose(
        "mark_unknown",
        store.mark_unknown(&id, c.token, r, WHY).await,
    );
    store
        .mark_unknown(&id, c.token, r, WHY)
        .await
        .expect("mark_unknown resent");
    assert!(matches!(
        store.get(&id).await.expect("get"),
        Some(Record::OutcomeUnknown(_))
    ));
}
