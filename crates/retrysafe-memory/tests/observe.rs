//! What a `MemoryStore` and its reconciler report, with a recorder of their own: the
//! evictions (records tombstoned, tombstones forgotten) through the store's hook and
//! its gauges, and a reconciler's resolutions through its hook and its metrics.
// A failed expectation panics with what was found.
#![allow(clippy::panic, clippy::unwrap_used, clippy::indexing_slicing)]
#![cfg(feature = "metrics")]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::Method;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use retrysafe_core::idempotency::{CommitPoint, Record, RecordId, RequestInfo, Scope};
use retrysafe_core::recovery::{
    PendingRecord, ReconcilableStore, Resolution, Resolved, ResolvedKind, Resolver,
};
use retrysafe_core::store::conformance::fresh_id;
use retrysafe_core::store::{ClaimOutcome, IdempotencyStore};
use retrysafe_memory::{Eviction, EvictionKind, MemoryStore};

mod support;

use support::{LEASE, claim, complete};

/// What the recorder holds now. (Taking it resets the counters and gauges to zero.)
fn take(snapshotter: &Snapshotter) -> Seen {
    snapshotter.snapshot().into_vec()
}

type Seen = Vec<(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
)>;

/// The value of `metric{labels}` in `seen`: a counter's count, a gauge's value, or a
/// histogram's number of samples.
fn value(seen: &Seen, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    seen.iter()
        .find(|(key, ..)| {
            let key = key.key();
            key.name() == metric
                && key.labels().count() == labels.len()
                && key.labels().all(|l| labels.contains(&(l.key(), l.value())))
        })
        .map(|(.., value)| match value {
            DebugValue::Counter(n) => *n as f64,
            DebugValue::Gauge(g) => g.into_inner(),
            DebugValue::Histogram(samples) => samples.len() as f64,
        })
}

#[tokio::test(start_paused = true)]
async fn evictions_reach_the_hook_and_the_gauges_by_name() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let heard: Arc<Mutex<Vec<Eviction>>> = Arc::default();
    let h = Arc::clone(&heard);
    // Room for one record of 200 bytes (three quarters of the bound), and for three
    // tombstones (the last quarter).
    let max_bytes = 1600;
    assert_eq!(max_bytes / 4 / MemoryStore::TOMBSTONE_BYTES, 3);
    let store = metrics::with_local_recorder(&recorder, || {
        MemoryStore::new()
            .name("sessions")
            .max_bytes(max_bytes)
            .on_eviction(move |e| h.lock().unwrap().push(e.clone()))
            .build()
            .unwrap()
    });
    let bytes = |s: &Seen| value(s, "retrysafe_memory_store_bytes", &[("name", "sessions")]);
    let retention = |s: &Seen| {
        value(
            s,
            "retrysafe_memory_store_effective_retention_seconds",
            &[("name", "sessions")],
        )
    };
    // Both gauges exist from `build` on; the retention one stays 0 until keys are
    // forgotten.
    let seen = take(&snapshotter);
    assert_eq!(bytes(&seen), Some(0.0));
    assert_eq!(retention(&seen), Some(0.0));

    let first = fresh_id();
    complete(&store, &first, 200).await;
    let one = bytes(&take(&snapshotter)).unwrap();
    assert!(one > 200.0, "the record weighs its body and more: {one}");
    assert_eq!(one, store.cached_bytes() as f64);

    // Each new record pushes the previous one out: it becomes a tombstone.
    tokio::time::advance(Duration::from_secs(1)).await;
    let second = fresh_id();
    complete(&store, &second, 200).await;
    assert_eq!(
        store
            .claim(
                &first,
                &claim(
                    &RequestInfo::new(Scope::new("tenant"), Method::POST, "/pay"),
                    CommitPoint::Undeclared
                )
            )
            .await
            .unwrap(),
        ClaimOutcome::Existing {
            record: Record::Evicted(retrysafe_core::idempotency::Evicted::new()),
            became_unknown: false
        }
    );
    {
        let heard = heard.lock().unwrap();
        assert_eq!(heard.len(), 1, "{heard:?}");
        assert_eq!(heard[0].kind, EvictionKind::Tombstoned);
        assert_eq!(heard[0].record, first);
        assert_eq!(heard[0].name.as_str(), "sessions");
    }
    assert_eq!(
        bytes(&take(&snapshotter)),
        Some(store.cached_bytes() as f64)
    );

    // Past three tombstones the oldest are forgotten: the retention gauge says how far
    // back every key is still remembered.
    for _ in 0..6 {
        tokio::time::advance(Duration::from_secs(1)).await;
        complete(&store, &fresh_id(), 200).await;
    }
    let heard = heard.lock().unwrap().clone();
    let tombstoned = heard
        .iter()
        .filter(|e| e.kind == EvictionKind::Tombstoned)
        .count();
    let forgotten: Vec<&Eviction> = heard
        .iter()
        .filter(|e| e.kind == EvictionKind::Forgotten)
        .collect();
    assert_eq!(tombstoned, 7);
    assert_eq!(forgotten.len(), 4, "{heard:?}");
    assert_eq!(
        forgotten[0].record, first,
        "the oldest tombstone goes first"
    );
    let remembered = store.effective_retention().unwrap();
    assert_eq!(
        retention(&take(&snapshotter)),
        Some(remembered.as_secs_f64())
    );
    assert!(remembered > Duration::ZERO);
}

/// Answers from a list: `DidNotHappen` for everything.
struct DidNotHappen;

impl Resolver for DidNotHappen {
    async fn resolve(&self, _record: &PendingRecord) -> Resolution {
        Resolution::DidNotHappen
    }
}

#[tokio::test(start_paused = true)]
async fn a_reconciler_counts_its_resolutions_and_tells_its_hook() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let store = MemoryStore::new();
    let info = RequestInfo::new(Scope::new("tenant"), Method::POST, "/pay");
    // Two holders die: one past an undeclared commit point (the resolver is asked),
    // one before its declared commit point (released without asking).
    let (asked, fenced) = (fresh_id(), fresh_id());
    for (id, commit_point) in [
        (&asked, CommitPoint::Undeclared),
        (&fenced, CommitPoint::Before),
    ] {
        assert!(matches!(
            store.claim(id, &claim(&info, commit_point)).await.unwrap(),
            ClaimOutcome::Claimed { .. }
        ));
    }
    tokio::time::advance(LEASE + Duration::from_secs(1)).await;

    let heard: Arc<Mutex<Vec<Resolved>>> = Arc::default();
    let h = Arc::clone(&heard);
    let reconciler = metrics::with_local_recorder(&recorder, || {
        store
            .reconciler(DidNotHappen)
            .name("ledger")
            .max_execution(Duration::from_millis(1))
            .grace(Duration::from_millis(1))
            .on_resolution(move |r| h.lock().unwrap().push(r.clone()))
            .build()
            .unwrap()
    });
    let pass = reconciler.run_once().await;
    assert_eq!(
        (pass.did_not_happen, pass.released_before_commit_point),
        (1, 1)
    );

    let seen = take(&snapshotter);
    let resolutions = |kind: &str| {
        value(
            &seen,
            "retrysafe_reconciler_resolutions_total",
            &[("name", "ledger"), ("resolution", kind)],
        )
    };
    assert_eq!(resolutions("did_not_happen"), Some(1.0));
    assert_eq!(resolutions("released"), Some(1.0));
    assert_eq!(resolutions("happened"), Some(0.0));
    assert_eq!(resolutions("unknown"), Some(0.0));
    assert_eq!(resolutions("error"), Some(0.0));
    assert_eq!(
        value(&seen, "retrysafe_reconciler_pending", &[("name", "ledger")]),
        Some(2.0)
    );

    let mut heard = heard.lock().unwrap().clone();
    heard.sort_by_key(|r| r.resolution.as_str());
    let seen: Vec<(ResolvedKind, RecordId, &str)> = heard
        .iter()
        .map(|r| (r.resolution, r.record, r.name.as_str()))
        .collect();
    assert_eq!(
        seen,
        [
            (ResolvedKind::DidNotHappen, asked, "ledger"),
            (ResolvedKind::Released, fenced, "ledger"),
        ]
    );

    // Nothing is due any more: the gauge says so at the next pass.
    reconciler.run_once().await;
    let seen = take(&snapshotter);
    assert_eq!(
        value(&seen, "retrysafe_reconciler_pending", &[("name", "ledger")]),
        Some(0.0)
    );
    assert_eq!(
        value(
            &seen,
            "retrysafe_reconciler_resolutions_total",
            &[("name", "ledger"), ("resolution", "did_not_happen")]
        ),
        Some(0.0),
        "counted since the last look: nothing more"
    );
}
