//! What the run came to: counted from what each system holds, not from the workers'
//! own bookkeeping.

use std::sync::atomic::{AtomicU64, Ordering};

use retrysafe::postgres::sqlx;
use serde_json::json;

use crate::services::{Downstream, Env};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Counters the workers keep.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) amqp_deliveries: AtomicU64,
    pub(crate) relay_crashes: AtomicU64,
    pub(crate) consumer_crashes: AtomicU64,
    pub(crate) dead_lettered_messages: AtomicU64,
    /// Microseconds the relay took to drain the backlog.
    pub(crate) drain_secs: AtomicU64,
    pub(crate) backlog_rows: AtomicU64,
    /// Outbox rows above this id were enqueued while the relay ran.
    pub(crate) live_from_id: AtomicU64,
}

/// The figures of one run.
#[derive(Debug)]
pub(crate) struct Report {
    orders: i64,
    downstream_effects: u64,
    consumer_effects: i64,
    http_sends: u64,
    amqp_deliveries: u64,
    duplicates: u64,
    missing_downstream: i64,
    missing_consumer: i64,
    dead_letters: u64,
    relay_crashes: u64,
    consumer_crashes: u64,
    rows_per_sec: f64,
    latency_ms: [f64; 4],
}

impl Report {
    pub(crate) async fn audit(
        env: &Env,
        downstream: &Downstream,
        counters: &Counters,
    ) -> Result<Report, Error> {
        let pool = &env.pool;
        let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
            .fetch_one(pool)
            .await?;
        let http_keys: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT child_key, id, (extract(epoch FROM created_at) * 1e6)::bigint
             FROM retrysafe_outbox WHERE kind = 1",
        )
        .fetch_all(pool)
        .await?;
        let effects = downstream
            .effects
            .lock()
            .map(|e| e.clone())
            .unwrap_or_default();
        let downstream_effects: u64 = effects.values().map(|(n, _)| n).sum();
        let missing_downstream = http_keys
            .iter()
            .filter(|(k, _, _)| !effects.contains_key(k))
            .count();
        let live = i64::try_from(counters.live_from_id.load(Ordering::Relaxed)).unwrap_or(0);
        let mut http_latency: Vec<f64> = http_keys
            .iter()
            .filter(|(_, id, _)| *id > live)
            .filter_map(|(k, _, created)| {
                effects.get(k).map(|(_, at)| (at - created) as f64 / 1000.0)
            })
            .collect();
        let (consumer_effects, consumer_dups, missing_consumer) = consumer_counts(env).await?;
        let mut amqp_latency: Vec<f64> = sqlx::query_scalar(
            "SELECT (extract(epoch FROM c.at - o.created_at) * 1000)::float8
             FROM consumed c JOIN retrysafe_outbox o ON o.child_key = c.message_id
             WHERE o.id > $1",
        )
        .bind(live)
        .fetch_all(pool)
        .await?;
        let dead_rows: i64 =
            sqlx::query_scalar("SELECT count(*) FROM retrysafe_outbox WHERE state IN (2, 3)")
                .fetch_one(pool)
                .await?;
        let drain = counters.drain_secs.load(Ordering::Relaxed) as f64 / 1e6;
        Ok(Report {
            orders,
            downstream_effects,
            consumer_effects,
            http_sends: downstream.requests.load(Ordering::Relaxed),
            amqp_deliveries: counters.amqp_deliveries.load(Ordering::Relaxed),
            duplicates: effects
                .values()
                .map(|(n, _)| n.saturating_sub(1))
                .sum::<u64>()
                + consumer_dups,
            missing_downstream: i64::try_from(missing_downstream).unwrap_or(i64::MAX),
            missing_consumer,
            dead_letters: u64::try_from(dead_rows).unwrap_or(0)
                + counters.dead_lettered_messages.load(Ordering::Relaxed),
            relay_crashes: counters.relay_crashes.load(Ordering::Relaxed),
            consumer_crashes: counters.consumer_crashes.load(Ordering::Relaxed),
            rows_per_sec: counters.backlog_rows.load(Ordering::Relaxed) as f64 / drain.max(1e-6),
            latency_ms: [
                percentile(&mut http_latency, 500),
                percentile(&mut http_latency, 990),
                percentile(&mut amqp_latency, 500),
                percentile(&mut amqp_latency, 990),
            ],
        })
    }

    pub(crate) fn print(&self) {
        println!(
            "orders placed: {} (about one in five sent twice)",
            self.orders
        );
        println!(
            "relay: {} crashes between send and mark; consumer: {} crashes between commit and ack",
            self.relay_crashes, self.consumer_crashes
        );
        println!(
            "relay throughput draining the backlog: {:.0} rows/s",
            self.rows_per_sec
        );
        println!(
            "commit -> delivery: http p50 {:.1} ms, p99 {:.1} ms; amqp (to the consumer's commit) p50 {:.1} ms, p99 {:.1} ms",
            self.latency_ms[0], self.latency_ms[1], self.latency_ms[2], self.latency_ms[3]
        );
        println!(
            "{}",
            json!({
                "orders": self.orders,
                "downstream_effects": self.downstream_effects,
                "consumer_effects": self.consumer_effects,
                "http_sends": self.http_sends,
                "amqp_deliveries": self.amqp_deliveries,
                "duplicates": self.duplicates,
                "missing_downstream": self.missing_downstream,
                "missing_consumer": self.missing_consumer,
                "dead_letters": self.dead_letters,
            })
        );
    }
}

/// The consumer's effects: total, beyond one per message, and orders with none.
async fn consumer_counts(env: &Env) -> Result<(i64, u64, i64), Error> {
    let per_id: Vec<i64> = sqlx::query_scalar("SELECT count(*) FROM consumed GROUP BY message_id")
        .fetch_all(&env.pool)
        .await?;
    let missing: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM retrysafe_outbox o WHERE o.kind = 2
         AND NOT EXISTS (SELECT 1 FROM consumed c WHERE c.message_id = o.child_key)",
    )
    .fetch_one(&env.pool)
    .await?;
    let total = per_id.iter().sum();
    let dups = per_id
        .iter()
        .map(|n| u64::try_from(n - 1).unwrap_or(0))
        .sum();
    Ok((total, dups, missing))
}

/// The value at `per_mille` (500: the median) of `values`, by nearest rank below.
fn percentile(values: &mut [f64], per_mille: usize) -> f64 {
    values.sort_by(f64::total_cmp);
    let i = values.len().saturating_sub(1) * per_mille / 1000;
    values.get(i).copied().unwrap_or(0.0)
}
