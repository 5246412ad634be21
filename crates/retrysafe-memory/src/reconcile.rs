//! The [`ReconcilableStore`] side of the [`MemoryStore`]: finding, adopting and
//! settling pending records.

use std::time::Duration;

use retrysafe_core::idempotency::{Completed, Fingerprint, Record, RecordId, Token, UnknownReason};
use retrysafe_core::recovery::{PendingRecord, PendingState, ReconcilableStore, Settlement};
use retrysafe_core::store::StoreError;
use tokio::time::Instant;

use crate::MemoryStore;
use crate::inner::{InFlight, Inner, after, blob, lock, millis, unknown};
use crate::retained::{Adoption, Pending};

impl ReconcilableStore for MemoryStore {
    async fn due(&self, stale: Duration, limit: usize) -> Result<Vec<RecordId>, StoreError> {
        Ok(self.inner.due(stale, limit))
    }

    async fn list_pending(&self, limit: usize) -> Result<Vec<RecordId>, StoreError> {
        Ok(self.inner.list_pending(limit))
    }

    async fn adopt(
        &self,
        id: &RecordId,
        token: Token,
        hold: Duration,
        stale: Option<Duration>,
    ) -> Result<Option<PendingRecord>, StoreError> {
        Ok(self.inner.pending(id, Some((token, hold)), stale))
    }

    async fn peek(&self, id: &RecordId) -> Result<Option<PendingRecord>, StoreError> {
        Ok(self.inner.pending(id, None, None))
    }

    async fn settle(
        &self,
        id: &RecordId,
        token: Token,
        settlement: Settlement,
        notified: bool,
    ) -> Result<(), StoreError> {
        let done = self.inner.settle(id, token, settlement, notified);
        self.inner.flush_evicted();
        done
    }

    fn set_reconciled(&self, running: bool) {
        self.inner.reconcilers.set(running);
    }
}

/// What a resolver sees of an in-flight claim.
fn of_claim(id: RecordId, e: &InFlight, now_ms: u64) -> PendingRecord {
    PendingRecord::new(
        id,
        PendingState::Claim {
            commit_point: e.commit_point,
        },
        e.fingerprint,
    )
    .with_details(
        e.request.clone(),
        e.note.clone(),
        Duration::from_millis(now_ms.saturating_sub(e.claimed_ms)),
        false,
    )
}

/// What a resolver sees of an `outcome_unknown` record.
fn of_unknown(id: RecordId, p: &Pending, now_ms: u64) -> PendingRecord {
    PendingRecord::new(
        id,
        PendingState::Unknown { reason: p.reason },
        p.fingerprint,
    )
    .with_details(
        p.request.clone(),
        p.note.clone(),
        Duration::from_millis(now_ms.saturating_sub(p.claimed_ms)),
        p.notified,
    )
}

impl Inner {
    /// Expired claims past `stale` and unknown records due (those made from an ended
    /// lease once `stale` has passed since it ended, as for the claim), none adopted, at
    /// most `limit`.
    fn due(&self, stale: Duration, limit: usize) -> Vec<RecordId> {
        let mut due = Vec::new();
        for shard in self.shards() {
            let map = lock(shard);
            let now = Instant::now();
            let now_ms = self.millis(now);
            due.extend(
                map.iter()
                    .filter(|(_, e)| after(e.lease_until, stale) <= now)
                    .filter(|(_, e)| e.adopted(now_ms).is_none())
                    .map(|(id, _)| *id)
                    .take(limit.saturating_sub(due.len())),
            );
        }
        let now_ms = self.millis(Instant::now());
        let r = self.retained();
        let unknown = r.unknown_ids().filter(|id| {
            r.get(id).is_some_and(|e| {
                e.expires_ms > now_ms
                    && e.pending.as_ref().is_some_and(|p| {
                        p.due_ms <= now_ms
                            && p.stale_for(stale, now_ms)
                            && p.adopted(now_ms).is_none()
                    })
            })
        });
        due.extend(unknown.take(limit.saturating_sub(due.len())));
        due
    }

    /// Every claim whose lease ended and every unknown record, due or not, adopted or
    /// not, at most `limit`.
    fn list_pending(&self, limit: usize) -> Vec<RecordId> {
        let mut found = Vec::new();
        for shard in self.shards() {
            let map = lock(shard);
            let now = Instant::now();
            found.extend(
                map.iter()
                    .filter(|(_, e)| e.lease_until <= now)
                    .map(|(id, _)| *id)
                    .take(limit.saturating_sub(found.len())),
            );
        }
        let now_ms = self.millis(Instant::now());
        let r = self.retained();
        let unknown = r
            .unknown_ids()
            .filter(|id| r.get(id).is_some_and(|e| e.expires_ms > now_ms));
        found.extend(unknown.take(limit.saturating_sub(found.len())));
        found
    }

    /// What a resolver sees of `id` if it is pending, adopting it with `adopt` (a token
    /// and a hold) if given: a claim whose lease ended `stale` ago (any claim without
    /// `stale`), or an `outcome_unknown` record (one made from an ended lease, `stale`
    /// after it ended); `None` if another adoption is live.
    fn pending(
        &self,
        id: &RecordId,
        adopt: Option<(Token, Duration)>,
        stale: Option<Duration>,
    ) -> Option<PendingRecord> {
        let mut map = self.lock(id);
        let now = Instant::now();
        let now_ms = self.millis(now);
        let adoption = adopt.map(|(token, hold)| Adoption {
            token,
            until_ms: now_ms.saturating_add(millis(hold)),
        });
        if let Some(e) = map.get_mut(id) {
            let ready = stale.is_none_or(|s| after(e.lease_until, s) <= now);
            if adoption.is_some() && (e.adopted(now_ms).is_some() || !ready) {
                return None;
            }
            if adoption.is_some() {
                e.adoption = adoption;
            }
            return Some(of_claim(*id, e, now_ms));
        }
        let mut r = self.retained();
        let p = r.peek_mut(id, now_ms)?.pending.as_mut()?;
        if adoption.is_some() {
            let ready = stale.is_none_or(|s| p.stale_for(s, now_ms));
            if p.adopted(now_ms).is_some() || !ready {
                return None;
            }
            p.adoption = adoption;
        }
        Some(of_unknown(*id, p, now_ms))
    }

    /// Applies `settlement` to the record `token` adopted.
    fn settle(
        &self,
        id: &RecordId,
        token: Token,
        settlement: Settlement,
        notified: bool,
    ) -> Result<(), StoreError> {
        let mut map = self.lock(id);
        let now = Instant::now();
        let now_ms = self.millis(now);
        let adopted_by = |a: Option<Adoption>| a.is_some_and(|a| a.token == token);
        if map.get(id).is_some_and(|e| adopted_by(e.adoption)) {
            let Some(claim) = self.take(&mut map, id) else {
                return Err(StoreError::StaleToken);
            };
            self.recent().remember(*id, token, now);
            self.settle_claim(*id, &claim, settlement, notified, now);
            return Ok(());
        }
        let mine = self
            .retained()
            .peek_mut(id, now_ms)
            .and_then(|e| e.pending.as_ref())
            .is_some_and(|p| adopted_by(p.adoption));
        if !mine {
            return self.resent(&map, id, token, &settlement, now);
        }
        self.recent().remember(*id, token, now);
        self.settle_unknown(*id, settlement, notified, now);
        Ok(())
    }

    /// Settles an adopted claim, already out of the in-flight map. Under its shard lock.
    fn settle_claim(
        &self,
        id: RecordId,
        claim: &InFlight,
        settlement: Settlement,
        notified: bool,
        now: Instant,
    ) {
        let wait = match settlement {
            Settlement::Complete {
                response,
                retention,
            } => {
                let done = Record::Completed(Completed::new(claim.fingerprint, Some(response)));
                self.put(id, blob(&done), now, retention, claim.scope, None);
                return;
            }
            Settlement::Release => return,
            Settlement::Later { after } => after,
            // A settlement this release does not know: the record stays pending.
            _ => Duration::ZERO,
        };
        let due_ms = self.millis(now).saturating_add(millis(wait));
        let ended = Some(self.millis(claim.lease_until));
        let pending = claim.pending(UnknownReason::LeaseExpired, notified, due_ms, ended);
        let record = blob(&unknown(claim.fingerprint));
        self.put(id, record, now, claim.retention, claim.scope, Some(pending));
    }

    /// Settles an adopted `outcome_unknown` record. Under its shard lock.
    fn settle_unknown(&self, id: RecordId, settlement: Settlement, notified: bool, now: Instant) {
        let now_ms = self.millis(now);
        let mut r = self.retained();
        let wait = match settlement {
            Settlement::Complete {
                response,
                retention,
            } => {
                let Some(e) = r.get(&id) else { return };
                let fingerprint = e
                    .pending
                    .as_ref()
                    .map_or(Fingerprint::NONE, |p| p.fingerprint);
                let scope = e.scope;
                drop(r);
                let done = Record::Completed(Completed::new(fingerprint, Some(response)));
                self.put(id, blob(&done), now, retention, scope, None);
                return;
            }
            Settlement::Release => {
                r.remove(&id);
                return;
            }
            Settlement::Later { after } => after,
            _ => Duration::ZERO,
        };
        if let Some(p) = r.peek_mut(&id, now_ms).and_then(|e| e.pending.as_mut()) {
            p.adoption = None;
            p.notified = p.notified || notified;
            p.due_ms = now_ms.saturating_add(millis(wait));
        }
    }

    /// Whether a settlement by `token` is the same one sent again (its reply was lost).
    fn resent(
        &self,
        map: &crate::inner::Claims,
        id: &RecordId,
        token: Token,
        settlement: &Settlement,
        now: Instant,
    ) -> Result<(), StoreError> {
        if !self.recent().recalls(id, token, now) || map.contains_key(id) {
            return Err(StoreError::StaleToken);
        }
        let now_ms = self.millis(now);
        let applied = match settlement {
            Settlement::Complete { .. } => {
                matches!(
                    self.kept(id, now_ms).map(crate::inner::decode),
                    Some(Ok(Record::Completed(_) | Record::Evicted(_)))
                )
            }
            Settlement::Release => self.kept(id, now_ms).is_none(),
            _ => self.is_unknown(id, now_ms),
        };
        if applied {
            Ok(())
        } else {
            Err(StoreError::StaleToken)
        }
    }
}
