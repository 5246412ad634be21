//! A reconciler over the layer's store: copies of a pending key are told to come back
//! (503 `outcome-pending`), the resolver's answer is applied, the hook hears of each
//! unknown outcome once, and an operator can do the same by hand.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderValue, StatusCode};
use axum::{Extension, Router};
use bytes::Bytes;
use retrysafe_core::idempotency::{
    IdempotencyContext, Principal, Record, Scope, StoredResponse, UnknownOutcome,
};
use retrysafe_core::recovery::{
    Operator, OperatorError, PendingRecord, PendingState, ReconcilableStore, ReconcilerHandle,
    Resolution, Resolver,
};
use retrysafe_core::store::IdempotencyStore;
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_memory::MemoryStore;
use retrysafe_tower::idempotency::{IdempotencyLayer, ProblemKind};

use super::{app, send};

const EVERY: Duration = Duration::from_secs(1);

/// Answers from a table by key; remembers what it was asked.
#[derive(Default)]
struct Table {
    answers: Mutex<HashMap<String, Resolution>>,
    asked: Mutex<Vec<PendingRecord>>,
}

impl Resolver for Table {
    async fn resolve(&self, record: &PendingRecord) -> Resolution {
        self.asked.lock().unwrap().push(record.clone());
        let key = record
            .key()
            .map(|k| k.as_str().to_owned())
            .unwrap_or_default();
        self.answers
            .lock()
            .unwrap()
            .get(&key)
            .cloned()
            .unwrap_or(Resolution::Unknown)
    }
}

fn created(body: &'static str) -> StoredResponse {
    StoredResponse::new(
        StatusCode::CREATED,
        vec![(
            axum::http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain"),
        )],
        Bytes::from_static(body.as_bytes()),
        Vec::new(),
    )
}

struct Setup {
    app: Router,
    store: MemoryStore,
    table: Arc<Table>,
    effects: Arc<AtomicUsize>,
    told_by_layer: Arc<Mutex<Vec<UnknownOutcome>>>,
    told_by_reconciler: Arc<Mutex<Vec<UnknownOutcome>>>,
    _reconciler: Option<ReconcilerHandle>,
}

/// A handler that has its effect (with a note at its commit point) and then answers 502:
/// an unknown outcome. With `reconcile`, a reconciler runs every second.
fn setup(reconcile: bool) -> Setup {
    setup_with(reconcile, |layer| layer)
}

/// [`setup`], with the layer changed by `tweak` before it is built.
fn setup_with(reconcile: bool, tweak: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer) -> Setup {
    let store = MemoryStore::new();
    let table = Arc::new(Table::default());
    let effects = Arc::new(AtomicUsize::new(0));
    let told_by_layer = Arc::new(Mutex::new(Vec::new()));
    let told_by_reconciler = Arc::new(Mutex::new(Vec::new()));
    let reconciler = reconcile.then(|| {
        let told = Arc::clone(&told_by_reconciler);
        store
            .reconciler(Arc::clone(&table))
            .interval(EVERY)
            .max_execution(Duration::from_secs(5))
            .grace(EVERY)
            .on_outcome_unknown(move |u| told.lock().unwrap().push(u.clone()))
            .spawn()
            .unwrap()
    });
    let told = Arc::clone(&told_by_layer);
    let layer = IdempotencyLayer::new(store.clone())
        .handlers_declare_commit_point()
        .store_keys_for_resolution()
        .on_outcome_unknown(move |u| told.lock().unwrap().push(u.clone()));
    let layer = tweak(layer).build().unwrap();
    let seen = Arc::clone(&effects);
    let handler = move |Extension(ctx): Extension<IdempotencyContext>| {
        let seen = Arc::clone(&seen);
        async move {
            ctx.commit_point_with("ledger-entry-7").await.unwrap();
            seen.fetch_add(1, Ordering::SeqCst);
            (StatusCode::BAD_GATEWAY, "downstream timed out")
        }
    };
    Setup {
        app: app(layer, handler),
        store,
        table,
        effects,
        told_by_layer,
        told_by_reconciler,
        _reconciler: reconciler,
    }
}

// An unknown outcome with a reconciler running: copies get 503 `outcome-pending` with
// `retry-after` until the resolver finds the effect; then the resolver's answer is
// replayed. The layer's hook hears of it once (with what the store keeps of the
// request), and the reconciler's hook not again.
#[tokio::test(start_paused = true)]
async fn a_pending_key_answers_503_until_resolved_then_replays() {
    let s = setup(true);
    let first = send(&s.app, "alice", "pay-1", "x").await;
    assert_eq!(first.0, StatusCode::BAD_GATEWAY);
    assert_eq!(first.1["do-not-retry"], "1");

    let copy = send(&s.app, "alice", "pay-1", "x").await;
    assert_eq!(copy.0, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(copy.3, Some(ProblemKind::OutcomePending));
    assert!(copy.1.contains_key("retry-after"));
    assert!(
        !copy.1.contains_key("do-not-retry"),
        "a client should come back"
    );

    // The resolver does not know yet: the record stays pending through a pass.
    tokio::time::sleep(EVERY * 2).await;
    assert_eq!(
        send(&s.app, "alice", "pay-1", "x").await.3,
        Some(ProblemKind::OutcomePending)
    );
    let asked = s.table.asked.lock().unwrap().last().cloned().unwrap();
    assert!(
        matches!(asked.state, PendingState::Unknown { .. }),
        "{asked:?}"
    );
    assert_eq!(asked.key().unwrap().as_str(), "pay-1");
    assert_eq!(asked.note.as_deref(), Some(&b"ledger-entry-7"[..]));
    let request = asked.request.as_deref().unwrap();
    assert_eq!(
        (request.method.as_str(), request.path.as_str()),
        ("POST", "/pay")
    );
    assert_eq!(request.scope, Scope::from(&Principal::new("alice")));

    // Found: completed with the resolver's answer, replayed from then on.
    s.table
        .answers
        .lock()
        .unwrap()
        .insert("pay-1".to_owned(), Resolution::Happened(created("paid")));
    tokio::time::sleep(Duration::from_secs(120)).await;
    let resolved = send(&s.app, "alice", "pay-1", "x").await;
    assert_eq!(resolved.0, StatusCode::CREATED);
    assert_eq!(resolved.2, "paid");
    assert_eq!(resolved.1["idempotent-replayed"], "true");
    assert_eq!(s.effects.load(Ordering::SeqCst), 1, "never run again");

    let layer_told = s.told_by_layer.lock().unwrap().clone();
    assert_eq!(layer_told.len(), 1);
    assert_eq!(
        layer_told[0]
            .request
            .as_ref()
            .unwrap()
            .key
            .as_ref()
            .unwrap()
            .as_str(),
        "pay-1"
    );
    assert!(
        s.told_by_reconciler.lock().unwrap().is_empty(),
        "the layer marked it notified: the reconciler does not tell again"
    );
}

// `DidNotHappen` releases the key: the next copy runs the handler.
#[tokio::test(start_paused = true)]
async fn did_not_happen_lets_the_next_copy_run() {
    let s = setup(true);
    s.table
        .answers
        .lock()
        .unwrap()
        .insert("pay-2".to_owned(), Resolution::DidNotHappen);
    assert_eq!(
        send(&s.app, "bob", "pay-2", "x").await.0,
        StatusCode::BAD_GATEWAY
    );
    tokio::time::sleep(EVERY * 3).await;
    assert_eq!(s.store.get(&record("bob", "pay-2")).await.unwrap(), None);
    assert_eq!(
        send(&s.app, "bob", "pay-2", "x").await.0,
        StatusCode::BAD_GATEWAY
    );
    assert_eq!(
        s.effects.load(Ordering::SeqCst),
        2,
        "released: the copy ran"
    );
}

// Without a reconciler, an unknown outcome is the stable 500 `outcome-unknown`.
#[tokio::test(start_paused = true)]
async fn without_a_reconciler_unknown_stays_a_stable_500() {
    let s = setup(false);
    send(&s.app, "carol", "pay-3", "x").await;
    let copy = send(&s.app, "carol", "pay-3", "x").await;
    assert_eq!(copy.0, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(copy.3, Some(ProblemKind::OutcomeUnknown));
    assert_eq!(copy.1["do-not-retry"], "1");
}

// A reconciler in another process (here: an operator, by hand) is declared with
// `reconciled_elsewhere`: copies of the unknown record are told to come back, 503
// `outcome-pending`, and get the resolution once it is made.
#[tokio::test(start_paused = true)]
async fn a_reconciler_elsewhere_makes_copies_come_back() {
    let s = setup_with(false, IdempotencyLayer::reconciled_elsewhere);
    let first = send(&s.app, "erin", "pay-5", "x").await;
    assert_eq!(first.0, StatusCode::BAD_GATEWAY);
    let copy = send(&s.app, "erin", "pay-5", "x").await;
    assert_eq!(copy.0, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(copy.3, Some(ProblemKind::OutcomePending));
    assert!(copy.1.contains_key("retry-after"));
    assert!(!copy.1.contains_key("do-not-retry"));
    Operator::new(s.store.clone())
        .resolve(
            &record("erin", "pay-5"),
            Resolution::Happened(created("paid elsewhere")),
        )
        .await
        .unwrap();
    let replay = send(&s.app, "erin", "pay-5", "x").await;
    assert_eq!(
        (replay.0, &replay.2[..]),
        (StatusCode::CREATED, &b"paid elsewhere"[..])
    );
    assert_eq!(s.effects.load(Ordering::SeqCst), 1);
}

fn record(who: &str, key: &str) -> retrysafe_core::idempotency::RecordId {
    retrysafe_core::idempotency::RecordId::new(
        &Scope::from(&Principal::new(who)),
        &IdempotencyKey::new(key).unwrap(),
    )
}

// The operator's API: look a key up, list what is pending, resolve by hand (with the
// reconciler's rules), and refuse to release a claim past its commit point.
#[tokio::test(start_paused = true)]
async fn an_operator_looks_up_lists_and_resolves_by_hand() {
    let s = setup(false);
    send(&s.app, "dave", "pay-4", "x").await;
    let operator = Operator::new(s.store.clone());
    let scope = Scope::from(&Principal::new("dave"));
    let key = IdempotencyKey::new("pay-4").unwrap();
    let found = operator.lookup(&scope, &key).await.unwrap();
    assert!(matches!(found.state, Some(Record::OutcomeUnknown(_))));
    assert_eq!(
        found.pending.as_ref().unwrap().note.as_deref(),
        Some(&b"ledger-entry-7"[..])
    );
    let pending = operator.pending(100).await.unwrap();
    assert!(pending.iter().any(|p| p.record == found.record));

    assert!(matches!(
        operator.release_before_commit_point(&found.record).await,
        Err(OperatorError::PastCommitPoint)
    ));
    operator
        .resolve(&found.record, Resolution::Happened(created("paid by hand")))
        .await
        .unwrap();
    let replay = send(&s.app, "dave", "pay-4", "x").await;
    assert_eq!(
        (replay.0, replay.2.as_ref()),
        (StatusCode::CREATED, &b"paid by hand"[..])
    );
    assert!(matches!(
        operator
            .resolve(&found.record, Resolution::DidNotHappen)
            .await,
        Err(OperatorError::NotPending)
    ));
    assert!(operator.pending(100).await.unwrap().is_empty());
    assert_eq!(s.effects.load(Ordering::SeqCst), 1);
}
