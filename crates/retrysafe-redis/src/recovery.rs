//! [`ReconcilableStore`] for [`RedisStore`]: the in-flight index, adoption and
//! settlement, each one Lua script.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use redis::Value;
use redis::aio::ConnectionLike;
use retrysafe_core::idempotency::{
    Completed, Fingerprint, Record, RecordId, RequestInfo, Token, UnknownReason,
};
use retrysafe_core::recovery::{PendingRecord, PendingState, ReconcilableStore, Settlement};
use retrysafe_core::store::{RESEND_WINDOW, StoreError};

use crate::RedisStore;
use crate::scripts::SCRIPTS;
use crate::slots::SLOTS;
use crate::store::SLOTS_PER_LEASE;
use crate::store::{decode, held, last_key, meta_key, millis, retention_millis};

/// How many index entries one `due` call looks at, at most, per id it may return:
/// entries whose lease ended less than `stale` ago are skipped, not returned.
const SCAN_PER_ID: usize = 4;

/// The most index entries one `due` call looks at.
const MAX_SCAN: usize = 10_000;

/// How many index keys (hash slots, on a cluster) `due` asks about at once.
const DUE_BATCH: usize = 512;

/// How long a scan lease is held without being renewed: longer than a reconciler's
/// interval (default 5 s), so that one running reconciler keeps its slots.
const SCAN_LEASE: Duration = Duration::from_secs(30);

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The groups of slots whose scan lease this store holds (taken or renewed now);
    /// every group on a single server, which has one index key.
    async fn held_scan_leases(&self) -> Result<Vec<u16>, StoreError> {
        let groups = SLOTS / SLOTS_PER_LEASE;
        if !self.per_slot() {
            return Ok((0..groups).collect());
        }
        let owner = self.owner().to_bytes();
        let replies = join_all((0..groups).map(|group| {
            let key = self.scan_lease_key(group);
            async move {
                let mut conn = self.connection().clone();
                let held: i64 = self
                    .bounded(
                        SCRIPTS
                            .scan_lease
                            .key(key)
                            .arg(&owner[..])
                            .arg(millis(SCAN_LEASE))
                            .invoke_async(&mut conn),
                    )
                    .await?;
                Ok::<_, StoreError>((group, held == 1))
            }
        }));
        let mut held = Vec::new();
        for reply in replies.await {
            if let (group, true) = reply? {
                held.push(group);
            }
        }
        Ok(held)
    }

    /// On a cluster, loads `scripts` on every primary before a walk sends one script
    /// per hash slot, 512 at a time. Without it, a primary whose script cache is empty
    /// (after a restart or a failover) answers each of the 512 `NOSCRIPT`, and each
    /// caller loads the script again on every node: a burst of thousands of calls that,
    /// on a busy client, outlasts the call timeout; the loads still queued when the walk
    /// gives up are dropped by the cluster client unsent, so the next walk meets the
    /// same empty caches and fails again. The load goes to the primaries only (on a
    /// store of [`connect_cluster`](crate::RedisStoreOptions::connect_cluster)), which
    /// run the scripts: a replica that does not answer does not hold every walk to the
    /// call timeout. A load that fails does not stop the walk: each slot's call still
    /// loads its script when it meets `NOSCRIPT`. Nothing to do on a single server,
    /// where a walk is one script.
    async fn load_on_every_primary(&self, scripts: &[&redis::Script]) {
        if !self.per_slot() {
            return;
        }
        let loads = join_all(scripts.iter().map(|script| async move {
            #[cfg(feature = "cluster")]
            if let Some(mut primaries) = primaries::of(self.connection()) {
                return self.bounded(script.load_async(&mut primaries)).await;
            }
            let mut conn = self.connection().clone();
            self.bounded(script.load_async(&mut conn)).await
        }));
        for loaded in loads.await {
            if let Err(e) = loaded {
                tracing::debug!(
                    target: "retrysafe::redis",
                    name = self.name().as_str(),
                    error = %e,
                    "could not load a walk's script on every cluster primary first"
                );
            }
        }
    }

    /// The due ids (hex) listed by one index key, at most `limit` of `scan` looked at.
    async fn due_in(
        &self,
        index: &str,
        stale: Duration,
        limit: usize,
        scan: usize,
    ) -> Result<Vec<String>, StoreError> {
        let mut conn = self.connection().clone();
        self.bounded(
            SCRIPTS
                .due
                .key(index)
                .arg(self.key_prefix())
                .arg(millis(stale))
                .arg(limit)
                .arg(scan)
                .invoke_async(&mut conn),
        )
        .await
    }
}

impl<C> ReconcilableStore for RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// One script per index key: the ids whose score (a claim's lease end, an unknown
    /// record's next pass) has passed, claims only once `stale` more has; entries of
    /// records that expired or are no longer pending are dropped as they are seen. On
    /// a cluster the index is one key per hash slot: the walk goes through them
    /// 512 at a time (one script each, sent together), stops once `limit`
    /// ids are found, and the next call starts where this one stopped. It walks only
    /// the slots whose scan lease this store holds (16 leases of 1024 slots, each
    /// taken for 30 s and renewed by every walk), so that the
    /// reconcilers of several app servers do not all scan every slot; the leases of a
    /// reconciler that stops lapse and are taken by another.
    async fn due(&self, stale: Duration, limit: usize) -> Result<Vec<RecordId>, StoreError> {
        let limit = limit.min(MAX_SCAN);
        if limit == 0 {
            return Ok(Vec::new());
        }
        let scan = limit
            .saturating_mul(SCAN_PER_ID)
            .saturating_add(100)
            .min(MAX_SCAN);
        self.load_on_every_primary(&[&SCRIPTS.scan_lease, &SCRIPTS.due])
            .await;
        let from = self.cursor().load(Ordering::Relaxed);
        let held = self.held_scan_leases().await?;
        let indexes: Vec<(Option<u16>, String)> = self
            .index_keys(from)
            .into_iter()
            .filter(|(slot, _)| slot.is_none_or(|s| held.contains(&(s / SLOTS_PER_LEASE))))
            .collect();
        let mut ids = Vec::new();
        for batch in indexes.chunks(DUE_BATCH) {
            let want = limit - ids.len();
            let replies = join_all(
                batch
                    .iter()
                    .map(|(_, index)| self.due_in(index, stale, want, scan)),
            );
            for ((slot, _), found) in batch.iter().zip(replies.await) {
                ids.extend(found?.iter().filter_map(|hex| record_id(hex)));
                if ids.len() >= limit {
                    // The next call starts again at this key (it may list more than
                    // were taken), so that every slot is reached in turn.
                    self.cursor().store(slot.unwrap_or(from), Ordering::Relaxed);
                    ids.truncate(limit);
                    return Ok(ids);
                }
            }
        }
        Ok(ids)
    }

    /// One script per index key (on a cluster, 512 at a time, sent together), looking
    /// at up to 10 000 entries of each, however recently due: no scan lease is needed
    /// to list.
    async fn list_pending(&self, limit: usize) -> Result<Vec<RecordId>, StoreError> {
        let limit = limit.min(MAX_SCAN);
        self.load_on_every_primary(&[&SCRIPTS.list]).await;
        let mut ids = Vec::new();
        for batch in self.index_keys(0).chunks(DUE_BATCH) {
            if ids.len() >= limit {
                break;
            }
            let want = limit - ids.len();
            let replies = join_all(batch.iter().map(|(_, index)| async move {
                let mut conn = self.connection().clone();
                self.bounded::<Vec<String>>(
                    SCRIPTS
                        .list
                        .key(index)
                        .arg(self.key_prefix())
                        .arg(want)
                        .arg(MAX_SCAN)
                        .invoke_async(&mut conn),
                )
                .await
            }));
            for found in replies.await {
                ids.extend(found?.iter().filter_map(|hex| record_id(hex)));
            }
        }
        ids.truncate(limit);
        Ok(ids)
    }

    async fn adopt(
        &self,
        id: &RecordId,
        token: Token,
        hold: Duration,
        stale: Option<Duration>,
    ) -> Result<Option<PendingRecord>, StoreError> {
        let key = self.key(id);
        let stale = stale.map_or(-1, |s| i64::try_from(millis(s)).unwrap_or(i64::MAX));
        let (reply, _): (Vec<Value>, bool) = self
            .indexed(id, false, || {
                let mut script = SCRIPTS.adopt.key(&key);
                script
                    .key(meta_key(&key))
                    .arg(&token.to_bytes()[..])
                    .arg(retention_millis(hold))
                    .arg(stale)
                    .arg(id.to_hex());
                script
            })
            .await?;
        pending(*id, &reply)
    }

    async fn peek(&self, id: &RecordId) -> Result<Option<PendingRecord>, StoreError> {
        let key = self.key(id);
        let mut conn = self.connection().clone();
        let reply: Vec<Value> = self
            .bounded(
                SCRIPTS
                    .peek
                    .key(&key)
                    .key(meta_key(&key))
                    .invoke_async(&mut conn),
            )
            .await?;
        pending(*id, &reply)
    }

    async fn settle(
        &self,
        id: &RecordId,
        token: Token,
        settlement: Settlement,
        notified: bool,
    ) -> Result<(), StoreError> {
        let key = self.key(id);
        let member = id.to_hex();
        let window = millis(RESEND_WINDOW);
        let kind = match &settlement {
            Settlement::Complete { .. } => "complete",
            Settlement::Release => "release",
            Settlement::Later { .. } => "later",
            _ => {
                return Err(StoreError::unavailable(
                    "a settlement this store does not know",
                ));
            }
        };
        // The script puts the record's own fingerprint in place of this one.
        let completed = match &settlement {
            Settlement::Complete { response, .. } => {
                Record::Completed(Completed::new(Fingerprint::NONE, Some(response.clone())))
                    .encode()
            }
            _ => Bytes::new(),
        };
        let (reply, _) = self
            .indexed(id, false, || {
                let mut script = SCRIPTS.settle.key(&key);
                script
                    .key(last_key(&key))
                    .key(meta_key(&key))
                    .arg(&token.to_bytes()[..])
                    .arg(kind)
                    .arg(&member)
                    .arg(window);
                match &settlement {
                    Settlement::Complete { retention, .. } => {
                        script.arg(&completed[..]).arg(retention_millis(*retention));
                    }
                    Settlement::Later { after } => {
                        script
                            .arg(millis(*after))
                            .arg(if notified { "1" } else { "0" });
                    }
                    _ => {}
                }
                script
            })
            .await?;
        held(reply)
    }

    fn set_reconciled(&self, running: bool) {
        self.reconcilers().set(running);
    }
}

/// A pending record from the reply of the adopt or peek script (see `pending` in the
/// scripts' preamble): `None` for an empty reply.
fn pending(id: RecordId, reply: &[Value]) -> Result<Option<PendingRecord>, StoreError> {
    if reply.is_empty() {
        return Ok(None);
    }
    let field = |i: usize| reply.get(i).map(bytes).unwrap_or_default();
    let number = |i: usize| reply.get(i).and_then(integer);
    let record = decode(field(0))?;
    let state = match &record {
        Record::InProgress(r) => PendingState::Claim {
            commit_point: r.commit_point,
        },
        Record::OutcomeUnknown(_) => PendingState::Unknown {
            reason: text(&field(4))
                .and_then(|c| u16::try_from(c).ok())
                .and_then(UnknownReason::from_code),
        },
        _ => return Ok(None),
    };
    let request = Some(field(1))
        .filter(|r| !r.is_empty())
        .and_then(|r| RequestInfo::decode(Bytes::from(r)).ok())
        .map(Arc::new);
    let note = (number(2) == Some(1)).then(|| Bytes::from(field(3)));
    let age = match (text(&field(6)), number(7)) {
        (Some(at), Some(now)) => Duration::from_millis(now.saturating_sub(at)),
        _ => Duration::ZERO,
    };
    let notified = field(5) == b"1";
    Ok(Some(
        PendingRecord::new(id, state, *record.fingerprint())
            .with_details(request, note, age, notified),
    ))
}

/// The bytes of a bulk reply (numbers as their decimal text).
fn bytes(v: &Value) -> Vec<u8> {
    match v {
        Value::BulkString(b) => b.clone(),
        Value::SimpleString(s) => s.clone().into_bytes(),
        Value::Int(n) => n.to_string().into_bytes(),
        _ => Vec::new(),
    }
}

/// A non-negative integer reply.
fn integer(v: &Value) -> Option<u64> {
    match v {
        Value::Int(n) => u64::try_from(*n).ok(),
        other => text(&bytes(other)),
    }
}

/// A non-negative decimal number.
fn text(b: &[u8]) -> Option<u64> {
    std::str::from_utf8(b).ok()?.parse().ok()
}

/// The record id of its lowercase hex (as the index lists it).
fn record_id(hex: &str) -> Option<RecordId> {
    let digits = hex.as_bytes();
    if digits.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        let pair = std::str::from_utf8(pair).ok()?;
        *byte = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(RecordId::from_bytes(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_ids_round_trip_through_hex() {
        let id = RecordId::from_bytes([0xa7; 32]);
        assert_eq!(record_id(&id.to_hex()), Some(id));
        assert_eq!(record_id("zz"), None);
        assert_eq!(record_id(&"g".repeat(64)), None);
    }
}

/// `SCRIPT LOAD` for the primaries of a cluster alone.
#[cfg(feature = "cluster")]
mod primaries {
    use std::any::Any;

    use redis::aio::ConnectionLike;
    use redis::cluster_async::ClusterConnection;
    use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
    use redis::{Cmd, Pipeline, RedisFuture, Value};

    /// A cluster connection that sends each command to every primary, and answers once
    /// all of them did (one of their replies).
    pub(super) struct Primaries(ClusterConnection);

    /// The primaries of `conn`, when it is the cluster client's connection (the one
    /// [`connect_cluster`](crate::RedisStoreOptions::connect_cluster) makes); `None`
    /// for any other connection, which routes commands as its own client does.
    pub(super) fn of<C: Any>(conn: &C) -> Option<Primaries> {
        (conn as &dyn Any)
            .downcast_ref::<ClusterConnection>()
            .map(|c| Primaries(c.clone()))
    }

    impl ConnectionLike for Primaries {
        fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
            let every_primary = RoutingInfo::MultiNode((
                MultipleNodeRoutingInfo::AllMasters,
                Some(ResponsePolicy::AllSucceeded),
            ));
            Box::pin(self.0.route_command(cmd.clone(), every_primary))
        }

        fn req_packed_commands<'a>(
            &'a mut self,
            pipeline: &'a Pipeline,
            offset: usize,
            count: usize,
        ) -> RedisFuture<'a, Vec<Value>> {
            self.0.req_packed_commands(pipeline, offset, count)
        }

        fn get_db(&self) -> i64 {
            self.0.get_db()
        }
    }
}
