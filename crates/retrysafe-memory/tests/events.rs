//! The tracing events of a `MemoryStore` carry its name: the report of its bound when
//! built, and the sweep of expired claims with its warning for one past its commit
//! point.
// A failed expectation panics with what was found.
#![allow(clippy::panic, clippy::unwrap_used, clippy::indexing_slicing)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::Method;
use retrysafe_core::idempotency::{CommitPoint, RequestInfo, Scope};
use retrysafe_core::store::IdempotencyStore;
use retrysafe_core::store::conformance::fresh_id;
use retrysafe_memory::MemoryStore;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};

mod support;

use support::{LEASE, claim, complete};

/// An event: its target and its fields as text (`message` included).
type Seen = (String, BTreeMap<String, String>);

/// Every event seen.
#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<Seen>>>);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Events {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        let target = event.metadata().target().to_owned();
        self.0.lock().unwrap().push((target, fields));
    }
}

#[tokio::test(start_paused = true)]
async fn every_event_of_a_memory_store_carries_its_name() {
    let events = Events::default();
    let subscriber = tracing_subscriber::registry().with(events.clone());
    let _default = tracing::subscriber::set_default(subscriber);

    // One claim in flight at most; room for one record of 200 bytes.
    let store = MemoryStore::new()
        .name("mem")
        .max_in_flight(1)
        .max_bytes(1600)
        .build()
        .unwrap();
    // A holder that dies past its commit point.
    let info = RequestInfo::new(Scope::new("tenant"), Method::POST, "/pay");
    let dead = fresh_id();
    let c = claim(&info, CommitPoint::Before);
    store.claim(&dead, &c).await.unwrap();
    store.commit_point(&dead, c.token).await.unwrap();
    tokio::time::advance(LEASE + Duration::from_millis(1)).await;
    // The bound is full: this claim sweeps the expired one into an unknown outcome (kept
    // whole, as pending records are never shrunk to tombstones).
    complete(&store, &fresh_id(), 200).await;

    let events = events.0.lock().unwrap().clone();
    let messages: Vec<&str> = events
        .iter()
        .filter_map(|(_, fields)| fields.get("message").map(String::as_str))
        .collect();
    for expected in [
        "MemoryStore remembers every key",
        "in-flight claim expired past its commit point",
        "swept expired in-flight claims",
    ] {
        assert!(
            messages.iter().any(|m| m.starts_with(expected)),
            "{expected}: {messages:#?}"
        );
    }
    for (target, fields) in &events {
        assert_eq!(target, "retrysafe::idempotency", "{fields:?}");
        assert_eq!(
            fields.get("name").map(String::as_str),
            Some("mem"),
            "{fields:?}"
        );
    }
}
