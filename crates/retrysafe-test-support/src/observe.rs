//! What the observability tests share: a metrics recorder of their own (no global one)
//! and a tracing layer that keeps the spans it sees.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::Context;

/// A recorder of this test's own. Layers built inside [`build`](Self::build) resolve
/// their handles against it, so tests running at the same time do not mix.
pub struct Recorder {
    recorder: DebuggingRecorder,
    snapshotter: Snapshotter,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder").finish_non_exhaustive()
    }
}

impl Default for Recorder {
    fn default() -> Self {
        Self::new()
    }
}

impl Recorder {
    /// A recorder of its own, not installed anywhere yet.
    pub fn new() -> Self {
        let recorder = DebuggingRecorder::new();
        Recorder {
            snapshotter: recorder.snapshotter(),
            recorder,
        }
    }

    /// Runs `f` (which builds layers) with this recorder installed.
    pub fn build<T>(&self, f: impl FnOnce() -> T) -> T {
        metrics::with_local_recorder(&self.recorder, f)
    }

    /// The values now (reading resets the counters: read once, at the end).
    pub fn read(&self) -> Values {
        let mut values = HashMap::new();
        for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
            let key = key.key();
            let mut labels: Vec<(String, String)> = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            values.insert((key.name().to_owned(), labels), value);
        }
        Values(values)
    }
}

/// Metric values by name and labels.
#[derive(Debug)]
pub struct Values(HashMap<(String, Vec<(String, String)>), DebugValue>);

impl Values {
    fn get(&self, metric: &str, labels: &[(&str, &str)]) -> Option<&DebugValue> {
        let mut labels: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        labels.sort();
        self.0.get(&(metric.to_owned(), labels))
    }

    /// The counter `metric{labels}`: 0 when never incremented (or never resolved).
    pub fn counter(&self, metric: &str, labels: &[(&str, &str)]) -> u64 {
        match self.get(metric, labels) {
            Some(DebugValue::Counter(n)) => *n,
            None => 0,
            Some(other) => panic!("{metric} is not a counter: {other:?}"),
        }
    }

    /// The gauge `metric{labels}`, if it was resolved.
    pub fn gauge(&self, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
        match self.get(metric, labels) {
            Some(DebugValue::Gauge(v)) => Some(v.into_inner()),
            None => None,
            Some(other) => panic!("{metric} is not a gauge: {other:?}"),
        }
    }

    /// The metrics with the label `key="value"`.
    pub fn names_with_label(&self, key: &str, value: &str) -> Vec<String> {
        self.0
            .keys()
            .filter(|(_, labels)| labels.iter().any(|(k, v)| k == key && v == value))
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Whether `metric{labels}` was resolved (registered with the recorder).
    pub fn has(&self, metric: &str, labels: &[(&str, &str)]) -> bool {
        self.get(metric, labels).is_some()
    }

    /// The label keys of every series of `metric`, sorted, each once.
    pub fn label_keys(&self, metric: &str) -> Vec<String> {
        let keys: std::collections::BTreeSet<String> = self
            .0
            .keys()
            .filter(|(name, _)| name == metric)
            .flat_map(|(_, labels)| labels.iter().map(|(k, _)| k.clone()))
            .collect();
        keys.into_iter().collect()
    }

    /// Every counter of `metric`, summed (whatever the labels).
    pub fn total(&self, metric: &str) -> u64 {
        self.0
            .iter()
            .filter(|((name, _), _)| name == metric)
            .map(|(_, v)| match v {
                DebugValue::Counter(n) => *n,
                _ => 0,
            })
            .sum()
    }
}

/// A span as the [`Spans`] layer saw it: its name and its fields as text.
#[derive(Debug, Clone)]
pub struct SeenSpan {
    /// The span's name.
    pub name: &'static str,
    /// The parent's name, if the span has a parent.
    pub parent: Option<&'static str>,
    /// Its fields, each as `Debug` text (a string as itself).
    pub fields: HashMap<&'static str, String>,
}

/// A `tracing-subscriber` layer keeping every span it sees, in creation order, with
/// the fields recorded on it since.
#[derive(Clone, Default, Debug)]
pub struct Spans {
    spans: Arc<Mutex<Vec<SeenSpan>>>,
    ids: Arc<Mutex<HashMap<Id, usize>>>,
}

impl Spans {
    /// The spans named `name`, in creation order.
    pub fn named(&self, name: &str) -> Vec<SeenSpan> {
        let spans = self.spans.lock().unwrap();
        spans.iter().filter(|s| s.name == name).cloned().collect()
    }
}

struct Fields<'a>(&'a mut HashMap<&'static str, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name(), value.to_owned());
    }
}

impl<S> tracing_subscriber::Layer<S> for Spans
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let parent = match attrs.parent() {
            Some(parent) => ctx.span(parent),
            None if attrs.is_contextual() => ctx.lookup_current(),
            None => None,
        }
        .map(|span| span.name());
        let mut fields = HashMap::new();
        attrs.record(&mut Fields(&mut fields));
        let mut spans = self.spans.lock().unwrap();
        self.ids.lock().unwrap().insert(id.clone(), spans.len());
        spans.push(SeenSpan {
            name: attrs.metadata().name(),
            parent,
            fields,
        });
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        let Some(&index) = self.ids.lock().unwrap().get(id) else {
            return;
        };
        let mut spans = self.spans.lock().unwrap();
        if let Some(span) = spans.get_mut(index) {
            values.record(&mut Fields(&mut span.fields));
        }
    }
}
