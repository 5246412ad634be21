//! What the store-level tests of this crate share: a claim of a request and a
//! completed record.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use retrysafe_core::idempotency::{
    CommitPoint, Completed, Fingerprint, RecordId, RequestInfo, Scope, StoredResponse, Token,
};
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore};
use retrysafe_memory::MemoryStore;

/// The lease of every claim.
pub(crate) const LEASE: Duration = Duration::from_secs(10);
/// The retention of every record.
pub(crate) const RETENTION: Duration = Duration::from_secs(60 * 60);

/// A claim of `info` with a fresh token, starting at `commit_point`.
pub(crate) fn claim(info: &RequestInfo, commit_point: CommitPoint) -> Claim<'_> {
    Claim::new(
        Token::random(),
        Fingerprint::from_bytes([1; 32]),
        LEASE,
        RETENTION,
        commit_point,
    )
    .with_request(info)
}

/// Claims and completes `id` with a response of `body` bytes.
pub(crate) async fn complete(store: &MemoryStore, id: &RecordId, body: usize) {
    let info = RequestInfo::new(Scope::new("tenant"), Method::POST, "/pay");
    let c = claim(&info, CommitPoint::Undeclared);
    assert!(matches!(
        store.claim(id, &c).await.unwrap(),
        ClaimOutcome::Claimed { .. }
    ));
    let body = Bytes::from(vec![b'x'; body]);
    let response = StoredResponse::new(StatusCode::CREATED, Vec::new(), body, Vec::new());
    let done = Completed::new(c.fingerprint, Some(response));
    store.complete(id, c.token, &done, RETENTION).await.unwrap();
}
