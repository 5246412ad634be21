//! What the idempotency layers report besides their answers: events (a `tracing` event
//! and the `on_event` hook), the metric handles of a layer (resolved once, by `build` or
//! `Layer::layer`), and the `retrysafe.idempotency` span of each guarded request with
//! its store round trips.

use std::fmt;
use std::time::Duration;

use retrysafe_core::__private::handles::{Counter, Histogram, Lazy};
use retrysafe_core::idempotency::{Decision, RecordId, Scope, UnknownReason};
use retrysafe_core::observe::Name;
use retrysafe_core::observe::names;
use retrysafe_core::wire::IdempotencyKey;
use tokio::time::Instant;
use tracing::Span;
use tracing::field::Empty;

use super::event::{EventHook, EventKind, IdempotencyEvent};

/// What a layer reports, and under which name.
#[derive(Clone, Default)]
pub struct Telemetry {
    /// The layer's name in events, spans and metrics.
    pub(crate) name: Name,
    pub(crate) on_event: Option<EventHook>,
    /// The metric handles, resolved under `name` by `build` or when the layer makes its
    /// service, whichever comes first (a renamed layer starts afresh).
    pub(crate) metrics: Lazy<Metrics>,
}

impl fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Telemetry")
            .field("name", &self.name)
            .field("on_event", &self.on_event.is_some())
            .finish_non_exhaustive()
    }
}

impl Telemetry {
    /// The metric handles, resolved in the current recorder the first time.
    #[inline]
    pub(crate) fn metrics(&self) -> &Metrics {
        self.metrics.get(|| Metrics::resolve(&self.name))
    }

    /// Reports `kind` for `record` (`None` before the key and scope are known): a
    /// `tracing` event, and the `on_event` hook.
    pub fn emit(&self, kind: EventKind, record: Option<&RecordId>) {
        tracing::debug!(
            target: "retrysafe::idempotency",
            name = self.name.as_str(),
            event = kind.as_str(),
            record = ?record,
        );
        if let Some(f) = &self.on_event {
            f(&IdempotencyEvent::new(
                kind,
                record.copied(),
                self.name.clone(),
            ));
        }
    }

    /// Counts a guarded request's `decision` and records it on its `span`.
    pub(crate) fn decided(&self, decision: Decision, span: &Span) {
        self.metrics().decided(decision);
        span.record("decision", decision.as_str());
    }

    /// Counts a record that became `outcome_unknown` for `reason`.
    pub(crate) fn became_unknown(&self, reason: UnknownReason) {
        self.metrics().unknown(reason);
    }

    /// The `retrysafe.idempotency` span of a guarded request of `scope` with `key`.
    pub(crate) fn span(&self, scope: &Scope, key: &IdempotencyKey) -> Span {
        request_span(&self.name, scope, key)
    }

    /// Reports a guarded request refused before any claim (`Invalid`, or `Unavailable`
    /// for the layer's bound), with its record when its key and scope are known.
    pub(crate) fn refused(
        &self,
        decision: Decision,
        request: Option<(&Scope, &IdempotencyKey)>,
        span: &Span,
    ) {
        self.decided(decision, span);
        let kind = if decision == Decision::Unavailable {
            EventKind::Unavailable
        } else {
            EventKind::Invalid
        };
        let record = request.map(|(scope, key)| RecordId::new(scope, key));
        self.emit(kind, record.as_ref());
    }

    /// A store round trip of `op` for the request counted by `trips` is done.
    pub fn round_trip(&self, trips: &mut RoundTrips, op: StoreOp, started: Option<Instant>) {
        trips.done(self.metrics(), op, started);
    }

    /// The store round trips of a request with `span`, counted and timed as its span
    /// and the metrics need.
    pub fn round_trips(&self, span: Span) -> RoundTrips {
        RoundTrips::new(span, self.metrics())
    }
}

/// The store calls of the layer, the `op` label of `retrysafe_idempotency_store_seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOp {
    /// `claim`.
    Claim,
    /// `wait` (for a copy in flight).
    Wait,
    /// `complete`.
    Complete,
    /// `release`.
    Release,
    /// `mark_unknown`.
    MarkUnknown,
    /// `renew` (a lease renewal).
    Renew,
}

impl StoreOp {
    const ALL: [StoreOp; 6] = [
        StoreOp::Claim,
        StoreOp::Wait,
        StoreOp::Complete,
        StoreOp::Release,
        StoreOp::MarkUnknown,
        StoreOp::Renew,
    ];

    fn as_str(self) -> &'static str {
        match self {
            StoreOp::Claim => "claim",
            StoreOp::Wait => "wait",
            StoreOp::Complete => "complete",
            StoreOp::Release => "release",
            StoreOp::MarkUnknown => "mark_unknown",
            StoreOp::Renew => "renew",
        }
    }
}

/// The statuses that make a record `outcome_unknown` (408 and the 5xx that exist), each
/// with its own `reason` label; any other is `other`.
const STATUS_REASONS: [(u16, &str); 13] = [
    (408, "status_408"),
    (500, "status_500"),
    (501, "status_501"),
    (502, "status_502"),
    (503, "status_503"),
    (504, "status_504"),
    (505, "status_505"),
    (506, "status_506"),
    (507, "status_507"),
    (508, "status_508"),
    (509, "status_509"),
    (510, "status_510"),
    (511, "status_511"),
];

/// The named reasons, in the order of [`named_index`].
const NAMED_REASONS: [&str; 5] = [
    "panicked",
    "service_error",
    "body_error",
    "lease_expired",
    "cancelled",
];

fn named_index(reason: UnknownReason) -> Option<usize> {
    Some(match reason {
        UnknownReason::Panicked => 0,
        UnknownReason::ServiceError => 1,
        UnknownReason::BodyError => 2,
        UnknownReason::LeaseExpired => 3,
        UnknownReason::Cancelled => 4,
        _ => return None,
    })
}

/// The metric handles of one layer, one per label value, resolved when the layer is
/// built or makes its service: nothing is looked up per request. Empty (no-ops)
/// without the feature `metrics`.
#[derive(Clone, Default)]
pub(crate) struct Metrics {
    decisions: [Counter; Decision::ALL.len()],
    named_unknown: [Counter; NAMED_REASONS.len()],
    status_unknown: [Counter; STATUS_REASONS.len()],
    other_unknown: Counter,
    store: [Histogram; StoreOp::ALL.len()],
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    /// The handles of the layer named `name`, in the current recorder.
    pub(crate) fn resolve(name: &Name) -> Self {
        let counter = |metric, label, value| Counter::new(metric, name, Some((label, value)));
        let unknown = names::IDEMPOTENCY_OUTCOME_UNKNOWN_TOTAL;
        Metrics {
            decisions: Decision::ALL
                .map(|d| counter(names::IDEMPOTENCY_REQUESTS_TOTAL, "decision", d.as_str())),
            named_unknown: NAMED_REASONS.map(|r| counter(unknown, "reason", r)),
            status_unknown: STATUS_REASONS.map(|(_, r)| counter(unknown, "reason", r)),
            other_unknown: counter(unknown, "reason", "other"),
            store: StoreOp::ALL.map(|op| {
                Histogram::new(
                    names::IDEMPOTENCY_STORE_SECONDS,
                    name,
                    Some(("op", op.as_str())),
                )
            }),
        }
    }

    /// Counts a guarded request's decision.
    pub(crate) fn decided(&self, decision: Decision) {
        if let Some(c) = self.decisions.get(decision.index()) {
            c.increment();
        }
    }

    /// Counts a record that became `outcome_unknown`.
    pub(crate) fn unknown(&self, reason: UnknownReason) {
        let counter = match reason {
            UnknownReason::Status(status) => STATUS_REASONS
                .iter()
                .position(|(code, _)| *code == status.as_u16())
                .and_then(|i| self.status_unknown.get(i)),
            named => named_index(named).and_then(|i| self.named_unknown.get(i)),
        };
        counter.unwrap_or(&self.other_unknown).increment();
    }

    /// Records a store round trip of `op` that took `took`.
    pub(crate) fn store(&self, op: StoreOp, took: Duration) {
        if let Some(h) = self.store.get(op as usize) {
            h.record(took.as_secs_f64());
        }
    }

    /// Whether the store histogram records anything (worth a clock read).
    pub(crate) fn store_enabled(&self) -> bool {
        self.store.first().is_some_and(Histogram::enabled)
    }
}

/// The `retrysafe.idempotency` span of a guarded request with a key, at level INFO: its
/// layer's `name`, the `decision`, the first 4 bytes (8 hex digits) of the scope and of
/// the record id (a hash of scope and key: never the raw key), and the store round trips
/// with their total time. A disabled span costs one check.
fn request_span(name: &Name, scope: &Scope, key: &IdempotencyKey) -> Span {
    // Without a subscriber at INFO, `Span::none()`: unlike a disabled span it keeps no
    // metadata, so recording on it and dropping it (and its clones) are no-ops even
    // when `tracing` forwards to `log`.
    if !tracing::level_enabled!(tracing::Level::INFO) {
        return Span::none();
    }
    let span = tracing::info_span!(
        target: "retrysafe::idempotency",
        "retrysafe.idempotency",
        name = name.as_str(),
        decision = Empty,
        scope = Empty,
        key = Empty,
        store_round_trips = Empty,
        store_seconds = Empty,
    );
    if span.is_disabled() {
        return Span::none();
    }
    let mut hex = [0u8; 8];
    span.record("scope", hex_prefix(scope.as_bytes(), &mut hex));
    let record = RecordId::new(scope, key);
    span.record("key", hex_prefix(record.as_bytes(), &mut hex));
    span
}

/// The first four bytes of `hash` as eight lowercase hex digits, written into `out`.
fn hex_prefix<'a>(hash: &[u8; 32], out: &'a mut [u8; 8]) -> &'a str {
    fn digit(n: u8) -> u8 {
        if n < 10 { b'0' + n } else { b'a' + n - 10 }
    }
    for (pair, byte) in out.chunks_exact_mut(2).zip(hash) {
        if let [hi, lo] = pair {
            *hi = digit(byte >> 4);
            *lo = digit(byte & 0x0f);
        }
    }
    std::str::from_utf8(out).unwrap_or_default()
}

/// The store round trips of one guarded request: counted, and timed only when its span
/// or the store histogram records them (no clock read otherwise); recorded on the span
/// when dropped.
#[derive(Debug)]
pub struct RoundTrips {
    span: Span,
    timed: bool,
    count: u32,
    total: Duration,
}

impl RoundTrips {
    pub(crate) fn new(span: Span, metrics: &Metrics) -> Self {
        let timed = !span.is_disabled() || metrics.store_enabled();
        RoundTrips {
            span,
            timed,
            count: 0,
            total: Duration::ZERO,
        }
    }

    /// The request's span.
    pub fn span(&self) -> &Span {
        &self.span
    }

    /// When a round trip starts, if it is timed.
    pub fn start(&self) -> Option<Instant> {
        self.timed.then(Instant::now)
    }

    /// A round trip of `op`, started at `started`, is done.
    pub(crate) fn done(&mut self, metrics: &Metrics, op: StoreOp, started: Option<Instant>) {
        self.count += 1;
        if let Some(at) = started {
            let took = at.elapsed();
            self.total += took;
            metrics.store(op, took);
        }
    }
}

/// The round trips are recorded on the span when the request's engine is done with
/// them.
impl Drop for RoundTrips {
    fn drop(&mut self) {
        if !self.span.is_disabled() {
            self.span.record("store_round_trips", self.count);
            self.span.record("store_seconds", self.total.as_secs_f64());
        }
    }
}
