//! What the `IdempotencyLayer` reports besides its answers: one decision per guarded
//! request (counted by name and told to the `on_event` hook), the records it made
//! `outcome_unknown` by reason, its store round trips, and the `retrysafe.idempotency`
//! span of each request — which never shows the raw key. Each test builds its layer
//! under a recorder of its own; the clock is paused.
#![cfg(all(feature = "idempotency", feature = "metrics"))]
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    missing_docs
)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use retrysafe_core::idempotency::{CommitPoint, Decision, Fingerprinter, RecordId, Scope, Token};
use retrysafe_core::recovery::{PendingRecord, ReconcilableStore, Resolution, Resolver};
use retrysafe_core::store::{Claim, ClaimOutcome, FaultyStore, IdempotencyStore};
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_memory::MemoryStore;
use retrysafe_tower::idempotency::{
    EventKind, IdempotencyEvent, IdempotencyLayer, Principal, ProblemKind,
};
use retrysafe_tower::server::ServerLayers;
use tower::ServiceExt;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// A handler steered by headers: `x-status: N`, `x-sleep-ms: N`, `x-big: N` (body
/// bytes).
async fn handler(req: Request) -> Response {
    let h = req.headers().clone();
    let num = |name: &str| -> Option<u64> { h.get(name)?.to_str().ok()?.parse().ok() };
    if let Some(ms) = num("x-sleep-ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let status = num("x-status").map_or(StatusCode::CREATED, |s| {
        StatusCode::from_u16(s as u16).unwrap()
    });
    let body = match num("x-big") {
        Some(n) => vec![b'x'; n as usize],
        None => b"paid".to_vec(),
    };
    (status, body).into_response()
}

/// Authentication: every request is alice's, except those marked `x-anonymous`, which
/// carry no principal (the layer cannot scope them).
async fn auth(mut req: Request) -> Request {
    if !req.headers().contains_key("x-anonymous") {
        req.extensions_mut().insert(Principal::new("alice"));
    }
    req
}

fn app(layer: IdempotencyLayer) -> Router {
    Router::new()
        .route("/pay", axum::routing::post(handler))
        .layer(layer)
        .layer(axum::middleware::map_request(auth))
}

fn post(key: &str) -> axum::http::request::Builder {
    Request::post("/pay").header("idempotency-key", key)
}

async fn send(app: &Router, req: axum::http::request::Builder, body: &'static str) -> StatusCode {
    let res = app
        .clone()
        .oneshot(req.body(Body::from(body)).unwrap())
        .await
        .unwrap();
    let status = res.status();
    to_bytes(res.into_body(), usize::MAX).await.unwrap();
    status
}

/// The events the hook heard: (kind, layer name).
type Heard = Arc<Mutex<Vec<(EventKind, String)>>>;

fn listen(layer: IdempotencyLayer) -> (IdempotencyLayer, Heard) {
    let heard: Heard = Arc::default();
    let h = Arc::clone(&heard);
    let layer = layer.on_event(move |e: &IdempotencyEvent| {
        h.lock().unwrap().push((e.kind, e.name.to_string()));
    });
    (layer, heard)
}

type Seen = Vec<(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
)>;

/// What the recorder holds now (taking it resets its counters).
fn take(snapshotter: &Snapshotter) -> Seen {
    snapshotter.snapshot().into_vec()
}

/// `metric{labels}` in `seen`: a counter's count, or a histogram's number of samples.
fn value(seen: &Seen, metric: &str, labels: &[(&str, &str)]) -> Option<u64> {
    seen.iter()
        .find(|(key, ..)| {
            let key = key.key();
            key.name() == metric
                && key.labels().count() == labels.len()
                && key.labels().all(|l| labels.contains(&(l.key(), l.value())))
        })
        .map(|(.., value)| match value {
            DebugValue::Counter(n) => *n,
            DebugValue::Histogram(samples) => samples.len() as u64,
            DebugValue::Gauge(g) => g.into_inner() as u64,
        })
}

fn decisions(seen: &Seen, name: &str) -> BTreeMap<&'static str, u64> {
    Decision::ALL
        .iter()
        .map(|d| {
            let n = value(
                seen,
                "retrysafe_idempotency_requests_total",
                &[("name", name), ("decision", d.as_str())],
            );
            (d.as_str(), n.unwrap_or_else(|| panic!("no series for {d}")))
        })
        .filter(|(_, n)| *n > 0)
        .collect()
}

#[tokio::test(start_paused = true)]
async fn every_decision_is_counted_once_under_the_layers_name() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let (layer, heard) = listen(IdempotencyLayer::new(MemoryStore::new()));
    let layer =
        metrics::with_local_recorder(&recorder, || layer.name("payments-api").build().unwrap());
    let app = app(layer);

    // first, replay, mismatch
    assert_eq!(send(&app, post("k-1"), "a").await, StatusCode::CREATED);
    assert_eq!(send(&app, post("k-1"), "a").await, StatusCode::CREATED);
    assert_eq!(
        send(&app, post("k-1"), "b").await,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    // a 503 of the handler makes the record unknown; its copy is told so
    let failing = || post("k-2").header("x-status", "503");
    assert_eq!(
        send(&app, failing(), "a").await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        send(&app, failing(), "a").await,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    // a copy while the first is in flight
    let slow = app.clone();
    let first =
        tokio::spawn(
            async move { send(&slow, post("k-3").header("x-sleep-ms", "100"), "a").await },
        );
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(send(&app, post("k-3"), "a").await, StatusCode::CONFLICT);
    assert_eq!(first.await.unwrap(), StatusCode::CREATED);
    // refused before any claim: a key too long, and no scope
    let long = "k".repeat(256);
    let too_long = Request::post("/pay").header("idempotency-key", long.as_str());
    assert_eq!(send(&app, too_long, "a").await, StatusCode::BAD_REQUEST);
    let anonymous = post("k-4").header("x-anonymous", "1");
    assert_eq!(
        send(&app, anonymous, "a").await,
        StatusCode::INTERNAL_SERVER_ERROR
    );

    let seen = take(&snapshotter);
    assert_eq!(
        decisions(&seen, "payments-api"),
        BTreeMap::from([
            ("first", 3),
            ("replay", 1),
            ("mismatch", 1),
            ("unknown", 1),
            ("in_flight", 1),
            ("invalid", 2),
        ])
    );
    let unknown = |reason| {
        value(
            &seen,
            "retrysafe_idempotency_outcome_unknown_total",
            &[("name", "payments-api"), ("reason", reason)],
        )
    };
    assert_eq!(unknown("status_503"), Some(1));
    assert_eq!(unknown("status_500"), Some(0));
    assert_eq!(unknown("panicked"), Some(0));
    assert_eq!(unknown("other"), Some(0));
    // One claim per request that reached the store (7), and one write per record
    // settled: two completions, one mark.
    let store = |op| {
        value(
            &seen,
            "retrysafe_idempotency_store_seconds",
            &[("name", "payments-api"), ("op", op)],
        )
    };
    assert_eq!(store("claim"), Some(7));
    assert_eq!(store("complete"), Some(2));
    assert_eq!(store("mark_unknown"), Some(1));
    assert_eq!(store("release"), Some(0));

    // The hook heard every decision (and what became of the records), with the name.
    let heard = heard.lock().unwrap().clone();
    assert!(heard.iter().all(|(_, name)| name == "payments-api"));
    let kinds: Vec<EventKind> = heard.iter().map(|(kind, _)| *kind).collect();
    let count = |kind| kinds.iter().filter(|k| **k == kind).count();
    assert_eq!(count(EventKind::Claimed), 3);
    assert_eq!(count(EventKind::Replayed), 1);
    assert_eq!(count(EventKind::Mismatch), 1);
    assert_eq!(count(EventKind::Unknown), 1);
    assert_eq!(count(EventKind::Conflict), 1);
    assert_eq!(count(EventKind::Invalid), 2);
    assert_eq!(count(EventKind::OutcomeUnknown), 1);
    assert_eq!(kinds.len(), 10, "{kinds:?}");
}

#[tokio::test(start_paused = true)]
async fn a_copy_of_an_evicted_record_is_answered_409_and_counted_evicted() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // Room for one record of 1 KiB: the next pushes it out, leaving a tombstone.
    let store = MemoryStore::new().max_bytes(3 * 1024).build().unwrap();
    let (layer, heard) = listen(IdempotencyLayer::new(store));
    let layer = metrics::with_local_recorder(&recorder, || layer.name("small").build().unwrap());
    let app = app(layer);
    let big = |key| post(key).header("x-big", "1024");
    assert_eq!(send(&app, big("old"), "a").await, StatusCode::CREATED);
    assert_eq!(send(&app, big("new"), "a").await, StatusCode::CREATED);
    let copy = app
        .clone()
        .oneshot(big("old").body(Body::from("a")).unwrap())
        .await
        .unwrap();
    assert_eq!(copy.status(), StatusCode::CONFLICT);
    assert_eq!(
        copy.extensions()
            .get::<retrysafe_tower::idempotency::Problem>()
            .map(|p| p.kind()),
        Some(ProblemKind::ResponseEvicted)
    );

    let seen = take(&snapshotter);
    assert_eq!(
        decisions(&seen, "small"),
        BTreeMap::from([("first", 2), ("evicted", 1)])
    );
    let heard = heard.lock().unwrap().clone();
    assert_eq!(
        heard.last(),
        Some(&(EventKind::Evicted, "small".to_owned()))
    );
}

/// Claims `key` for alice directly in `store`, as a holder that then dies: its lease
/// expires after `lease` on the paused clock. The fingerprint is that of `post(key)`
/// with body `body`.
async fn dead_holder(
    store: &MemoryStore,
    key: &str,
    body: &'static str,
    lease: Duration,
) -> (RecordId, Token) {
    let scope = Scope::from(&Principal::new("alice"));
    let id = RecordId::new(&scope, &IdempotencyKey::new(key).unwrap());
    let uri = "/pay".parse().unwrap();
    let fingerprint = Fingerprinter::default().fingerprint(
        &axum::http::Method::POST,
        &uri,
        &axum::http::HeaderMap::new(),
        body.as_bytes(),
    );
    let token = Token::random();
    let claim = Claim::new(
        token,
        fingerprint,
        lease,
        Duration::from_secs(3600),
        CommitPoint::Before,
    );
    assert_eq!(
        store.claim(&id, &claim).await.unwrap(),
        ClaimOutcome::Claimed { takeover: false }
    );
    (id, token)
}

const LEASE: Duration = Duration::from_secs(10);

#[tokio::test(start_paused = true)]
async fn a_copy_after_an_expired_lease_before_the_commit_point_is_counted_takeover() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let store = MemoryStore::new();
    let (layer, heard) =
        listen(IdempotencyLayer::new(store.clone()).handlers_declare_commit_point());
    let layer = metrics::with_local_recorder(&recorder, || layer.name("orders").build().unwrap());
    let app = app(layer);
    dead_holder(&store, "k-1", "a", LEASE).await;

    assert_eq!(send(&app, post("k-1"), "a").await, StatusCode::CONFLICT);
    tokio::time::advance(LEASE + Duration::from_millis(1)).await;
    assert_eq!(send(&app, post("k-1"), "a").await, StatusCode::CREATED);
    assert_eq!(send(&app, post("k-1"), "a").await, StatusCode::CREATED);

    let seen = take(&snapshotter);
    assert_eq!(
        decisions(&seen, "orders"),
        BTreeMap::from([("in_flight", 1), ("takeover", 1), ("replay", 1)])
    );
    let heard = heard.lock().unwrap().clone();
    let takeovers = heard.iter().filter(|(k, _)| *k == EventKind::Takeover);
    assert_eq!(takeovers.count(), 1, "{heard:?}");
}

/// A resolver that never knows: records stay pending.
struct NeverKnows;

impl Resolver for NeverKnows {
    async fn resolve(&self, _: &PendingRecord) -> Resolution {
        Resolution::Unknown
    }
}

#[tokio::test(start_paused = true)]
async fn a_copy_meeting_an_expired_lease_past_its_commit_point_is_counted_pending() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let store = MemoryStore::new();
    // A reconciler runs (its first pass at once, the next long after this test).
    let _reconciler = store
        .reconciler(NeverKnows)
        .interval(Duration::from_secs(3600))
        .spawn()
        .unwrap();
    let (layer, heard) =
        listen(IdempotencyLayer::new(store.clone()).handlers_declare_commit_point());
    let layer = metrics::with_local_recorder(&recorder, || layer.name("orders").build().unwrap());
    let app = app(layer);
    let (id, token) = dead_holder(&store, "k-1", "a", LEASE).await;
    store.commit_point(&id, token).await.unwrap();
    tokio::time::advance(LEASE + Duration::from_millis(1)).await;

    // The claim turns the expired lease into outcome_unknown; with a reconciler
    // running, the copy is told to come back.
    assert_eq!(
        send(&app, post("k-1"), "a").await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        send(&app, post("k-1"), "a").await,
        StatusCode::SERVICE_UNAVAILABLE
    );

    let seen = take(&snapshotter);
    assert_eq!(decisions(&seen, "orders"), BTreeMap::from([("pending", 2)]));
    assert_eq!(
        value(
            &seen,
            "retrysafe_idempotency_outcome_unknown_total",
            &[("name", "orders"), ("reason", "lease_expired")],
        ),
        Some(1)
    );
    let heard = heard.lock().unwrap().clone();
    let pending = heard.iter().filter(|(k, _)| *k == EventKind::Pending);
    assert_eq!(pending.count(), 2, "{heard:?}");
}

#[tokio::test(start_paused = true)]
async fn a_copy_of_a_response_too_large_to_store_is_counted_not_stored() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let (layer, heard) = listen(IdempotencyLayer::in_memory().max_stored_response(1000));
    let layer = metrics::with_local_recorder(&recorder, || layer.name("orders").build().unwrap());
    let app = app(layer);
    let big = || post("k-1").header("x-big", "5000");
    assert_eq!(send(&app, big(), "a").await, StatusCode::CREATED);
    assert_eq!(send(&app, big(), "a").await, StatusCode::CONFLICT);

    let seen = take(&snapshotter);
    assert_eq!(
        decisions(&seen, "orders"),
        BTreeMap::from([("first", 1), ("not_stored", 1)])
    );
    let heard = heard.lock().unwrap().clone();
    assert_eq!(
        heard.last(),
        Some(&(EventKind::NotStored, "orders".to_owned()))
    );
}

#[tokio::test(start_paused = true)]
async fn a_failing_store_is_counted_unavailable_or_unguarded_with_fail_open() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let store = FaultyStore::new(MemoryStore::new());
    store.fail_all(true);
    let closed = IdempotencyLayer::new(store.clone()).name("closed");
    let open = IdempotencyLayer::new(store.clone())
        .fail_open()
        .name("open");
    let (closed, heard_closed) = listen(closed);
    let (open, heard_open) = listen(open);
    let (closed, open) = metrics::with_local_recorder(&recorder, || {
        (closed.build().unwrap(), open.build().unwrap())
    });
    let (closed, open) = (app(closed), app(open));

    assert_eq!(
        send(&closed, post("k-1"), "a").await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(send(&open, post("k-1"), "a").await, StatusCode::CREATED);
    assert_eq!(send(&open, post("k-1"), "a").await, StatusCode::CREATED);

    let seen = take(&snapshotter);
    assert_eq!(
        decisions(&seen, "closed"),
        BTreeMap::from([("unavailable", 1)])
    );
    assert_eq!(decisions(&seen, "open"), BTreeMap::from([("unguarded", 2)]));
    let kinds = |heard: &Heard| -> Vec<EventKind> {
        heard.lock().unwrap().iter().map(|(k, _)| *k).collect()
    };
    assert_eq!(kinds(&heard_closed), [EventKind::Unavailable]);
    assert_eq!(
        kinds(&heard_open),
        [EventKind::Unguarded, EventKind::Unguarded]
    );
}

#[tokio::test(start_paused = true)]
async fn a_layer_used_without_build_records_once_it_makes_its_service() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // Never built: `ServerLayers` makes its service, under the recorder.
    let layers = ServerLayers::new(IdempotencyLayer::in_memory().name("edge"))
        .authentication(axum::middleware::map_request(auth));
    let served = metrics::with_local_recorder(&recorder, || {
        Router::new()
            .route("/pay", axum::routing::post(handler))
            .layer(layers)
    });
    assert_eq!(send(&served, post("k-1"), "a").await, StatusCode::CREATED);
    assert_eq!(send(&served, post("k-1"), "a").await, StatusCode::CREATED);

    let seen = take(&snapshotter);
    assert_eq!(
        decisions(&seen, "edge"),
        BTreeMap::from([("first", 1), ("replay", 1)])
    );
    // Renamed after it was built, a layer records under its new name only.
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let layer = metrics::with_local_recorder(&recorder, || {
        let built = IdempotencyLayer::in_memory().name("old").build().unwrap();
        built.name("new").build().unwrap()
    });
    let app = app(layer);
    assert_eq!(send(&app, post("k-1"), "a").await, StatusCode::CREATED);
    let seen = take(&snapshotter);
    assert_eq!(decisions(&seen, "new"), BTreeMap::from([("first", 1)]));
    assert_eq!(decisions(&seen, "old"), BTreeMap::new());
}

/// A span's fields as text.
type SpanFields = BTreeMap<String, String>;

/// The `retrysafe.idempotency` spans (their fields as text, in the order they were
/// made), and every field of every span and event, to look for the raw key.
#[derive(Clone, Default)]
struct Capture {
    spans: Arc<Mutex<Vec<(u64, SpanFields)>>>,
    everything: Arc<Mutex<Vec<String>>>,
}

/// The capture, installed once as the process's global subscriber. A subscriber set
/// for one test's thread only races with the other tests of this binary: a span's
/// callsite first reached by another test while no subscriber wants it can keep
/// "disabled" cached after this test's subscriber is in place.
fn capture() -> &'static Capture {
    static CAPTURE: OnceLock<Capture> = OnceLock::new();
    CAPTURE.get_or_init(|| {
        let capture = Capture::default();
        tracing::subscriber::set_global_default(
            tracing_subscriber::registry().with(capture.clone()),
        )
        .expect("no other global subscriber in this test binary");
        capture
    })
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_owned(),
            format!("{value:?}").replace('"', ""),
        );
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _ctx: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        self.everything
            .lock()
            .unwrap()
            .extend(fields.values().cloned());
        if attrs.metadata().name() == "retrysafe.idempotency" {
            self.spans.lock().unwrap().push((id.into_u64(), fields));
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        values.record(&mut Fields(&mut fields));
        self.everything
            .lock()
            .unwrap()
            .extend(fields.values().cloned());
        // Span ids are reused once a span closes: the open one is the latest.
        let mut spans = self.spans.lock().unwrap();
        if let Some((_, span)) = spans.iter_mut().rev().find(|(i, _)| *i == id.into_u64()) {
            span.extend(fields);
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        self.everything
            .lock()
            .unwrap()
            .extend(fields.values().cloned());
    }
}

#[tokio::test(start_paused = true)]
async fn each_guarded_request_has_a_span_with_hashes_never_the_key() {
    let capture = capture();

    let key = "order-SECRET-4711";
    let app = app(IdempotencyLayer::in_memory().name("checkout"));
    assert_eq!(send(&app, post(key), "a").await, StatusCode::CREATED);
    assert_eq!(send(&app, post(key), "a").await, StatusCode::CREATED);
    assert_eq!(
        send(&app, post(key).header("x-status", "500"), "b").await,
        StatusCode::UNPROCESSABLE_ENTITY
    );

    // Other tests run beside this one: their layers have other names.
    let spans: Vec<BTreeMap<String, String>> = capture
        .spans
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, span)| span.get("name").is_some_and(|name| name == "checkout"))
        .map(|(_, span)| span.clone())
        .collect();
    assert_eq!(spans.len(), 3, "{spans:#?}");
    let scope = Scope::from(&Principal::new("alice"));
    let record = RecordId::new(&scope, &IdempotencyKey::new(key).unwrap());
    let hex =
        |bytes: &[u8; 32]| -> String { bytes[..4].iter().map(|b| format!("{b:02x}")).collect() };
    for (span, (decision, round_trips)) in
        spans
            .iter()
            .zip([("first", "2"), ("replay", "1"), ("mismatch", "1")])
    {
        assert_eq!(span["name"], "checkout", "{span:?}");
        assert_eq!(span["decision"], decision, "{span:?}");
        assert_eq!(span["scope"], hex(scope.as_bytes()), "{span:?}");
        assert_eq!(span["key"], hex(record.as_bytes()), "{span:?}");
        assert_eq!(span["store_round_trips"], round_trips, "{span:?}");
        assert!(span.contains_key("store_seconds"), "{span:?}");
    }
    let everything = capture.everything.lock().unwrap();
    assert!(!everything.is_empty());
    assert!(
        everything.iter().all(|v| !v.contains("SECRET")),
        "the raw key was recorded: {everything:?}"
    );
}
