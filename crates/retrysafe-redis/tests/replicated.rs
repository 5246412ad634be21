//! `RedisStore::replicated_writes` against the server at `REDIS_URL`, which has no
//! replicas: every write that waits for one is refused, and what the store does then
//! (a claim or commit point released, a completion kept but reported) is what a
//! primary whose replicas lag behind gets. The cluster form is in `cluster.rs`.
#![allow(clippy::unwrap_used, clippy::panic, missing_docs)]

mod common;

use std::time::Duration;

use common::store;
use retrysafe_core::idempotency::{CommitPoint, Completed, Fingerprint, Record, Token};
use retrysafe_core::store::conformance::fresh_id;
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, StoreError};

fn claim() -> Claim<'static> {
    Claim::new(
        Token::random(),
        Fingerprint::from_bytes([3; 32]),
        Duration::from_secs(10),
        Duration::from_secs(60),
        CommitPoint::Before,
    )
}

fn unavailable<T: std::fmt::Debug>(r: Result<T, StoreError>) -> String {
    match r {
        Err(StoreError::Unavailable(e)) => e.to_string(),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[tokio::test]
async fn an_unacknowledged_claim_is_released_and_refused() {
    let store = store()
        .await
        .replicated_writes(1, Duration::from_millis(10));
    assert_eq!(store.replicas(), 1);
    let id = fresh_id();
    let e = unavailable(store.claim(&id, &claim()).await);
    assert!(e.contains("claim was not acknowledged by 1 replica"), "{e}");
    assert_eq!(store.get(&id).await.unwrap(), None, "released");
}

#[tokio::test]
async fn an_unacknowledged_commit_point_is_released_and_refused() {
    let plain = store().await;
    let waiting = plain
        .clone()
        .replicated_writes(1, Duration::from_millis(10));
    let id = fresh_id();
    let c = claim();
    assert_eq!(
        plain.claim(&id, &c).await.unwrap(),
        ClaimOutcome::Claimed { takeover: false }
    );
    let e = unavailable(waiting.commit_point_with(&id, c.token, b"note").await);
    assert!(e.contains("commit point"), "{e}");
    assert_eq!(plain.get(&id).await.unwrap(), None, "released");
}

#[tokio::test]
async fn an_unacknowledged_completion_is_reported_not_undone() {
    let plain = store().await;
    let waiting = plain
        .clone()
        .replicated_writes(1, Duration::from_millis(10));
    let id = fresh_id();
    let c = claim();
    plain.claim(&id, &c).await.unwrap();
    let done = Completed::new(c.fingerprint, None);
    let e = unavailable(
        waiting
            .complete(&id, c.token, &done, Duration::from_secs(60))
            .await,
    );
    assert!(e.contains("completion"), "{e}");
    // Written on the primary: a copy replays it unless a failover loses it.
    assert_eq!(plain.get(&id).await.unwrap(), Some(Record::Completed(done)));
}

#[tokio::test]
async fn zero_replicas_turns_it_off() {
    let store = store()
        .await
        .replicated_writes(0, Duration::from_millis(10));
    let id = fresh_id();
    let c = claim();
    store.claim(&id, &c).await.unwrap();
    store.commit_point(&id, c.token).await.unwrap();
    store
        .complete(
            &id,
            c.token,
            &Completed::new(c.fingerprint, None),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
}
