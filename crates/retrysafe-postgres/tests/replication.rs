//! The replication settings of PostgresStore against the real PostgreSQL at
//! `DATABASE_URL`, which has no standby: the warning `connect` logs, read from a
//! tracing layer that captures events.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

mod support;

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use retrysafe_postgres::sqlx;
use retrysafe_postgres::{PostgresStore, SynchronousCommit};
use support::{admin, connect_options, database_url};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt as _};

/// The events of one test: level, target, and the message with every field.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<(Level, String, String)>>>);

impl<S: Subscriber> Layer<S> for Captured {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        struct Text<'a>(&'a mut String);
        impl Visit for Text<'_> {
            fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
                let _ = write!(self.0, "{}={value:?} ", field.name());
            }
        }
        let mut text = String::new();
        event.record(&mut Text(&mut text));
        let meta = event.metadata();
        let seen = (*meta.level(), meta.target().to_owned(), text);
        self.0.lock().unwrap().push(seen);
    }
}

impl Captured {
    /// Captures the events of this thread (the test's, on a current-thread runtime)
    /// while the guard lives.
    fn start(&self) -> tracing::subscriber::DefaultGuard {
        tracing::subscriber::set_default(tracing_subscriber::registry().with(self.clone()))
    }

    /// The warnings of the store's target.
    fn warnings(&self) -> Vec<String> {
        let events = self.0.lock().unwrap();
        events
            .iter()
            .filter(|(level, target, _)| *level == Level::WARN && target == "retrysafe::postgres")
            .map(|(_, _, text)| text.clone())
            .collect()
    }
}

/// The server has no synchronous standby and streams to no standby: what every test
/// here starts from.
async fn assert_no_standby() {
    let mut conn = admin().await;
    let (names, standbys): (String, i64) = sqlx::query_as(
        "SELECT current_setting('synchronous_standby_names'), \
                (SELECT count(*) FROM pg_stat_replication)",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        (names.as_str(), standbys),
        ("", 0),
        "DATABASE_URL={} must have no standby for these tests",
        database_url()
    );
}

#[tokio::test]
async fn connect_warns_when_a_level_waits_for_a_standby_that_is_not_named() {
    assert_no_standby().await;
    let captured = Captured::default();
    let guard = captured.start();
    let store = PostgresStore::options()
        .synchronous_commit(SynchronousCommit::RemoteApply)
        .connect_with(connect_options())
        .await
        .unwrap();
    drop(guard);
    let warnings = captured.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("synchronous_standby_names is empty"),
        "{warnings:?}"
    );
    assert!(warnings[0].contains("RemoteApply"), "{warnings:?}");
    let report = store.check_replication().await.unwrap();
    assert!(!report.survives_promotion(), "{report:?}");
}

#[tokio::test]
async fn connect_is_silent_without_standbys_or_a_level_that_waits() {
    assert_no_standby().await;
    for level in [None, Some(SynchronousCommit::Local)] {
        let captured = Captured::default();
        let guard = captured.start();
        let mut options = PostgresStore::options();
        if let Some(level) = level {
            options = options.synchronous_commit(level);
        }
        let store = options.connect_with(connect_options()).await.unwrap();
        drop(guard);
        assert_eq!(captured.warnings(), Vec::<String>::new(), "{level:?}");
        drop(store);
    }
}
