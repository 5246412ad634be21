//! The run: the relay and the consumer as crash-prone workers, restarted by
//! supervisors, and the client placing orders.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use retrysafe::postgres::consumer::{Consumer, Processed};
use retrysafe::postgres::outbox::OutboxRelay;
use retrysafe::postgres::outbox::amqp::AmqpPublisher;
use retrysafe::postgres::outbox::amqp::lapin::options::BasicConsumeOptions;
use retrysafe::postgres::outbox::amqp::lapin::types::FieldTable;
use retrysafe::postgres::outbox::amqp::lapin::{Connection, ConnectionProperties};
use retrysafe::postgres::sqlx;
use retrysafe::retry::{Backoff, Jitter};
use tokio::time::Instant;

use crate::Options;
use crate::audit::{Counters, Report};
use crate::services::{self, Env};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// SplitMix64: a seeded stream of numbers.
#[derive(Debug)]
pub(crate) struct Rng(std::sync::Mutex<u64>);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(std::sync::Mutex::new(seed))
    }

    /// The stream of one worker: seeded by the run's seed and the worker's number, so
    /// that workers running side by side do not draw from (and reorder) one stream.
    pub(crate) fn of_worker(seed: u64, worker: u64) -> Rng {
        Rng::new(Rng::new(seed ^ worker.wrapping_mul(0xD6E8_FEB8_6659_FD93)).next())
    }

    pub(crate) fn next(&self) -> u64 {
        let mut s = self.0.lock().unwrap();
        *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number from 1 to `n` (`n` at least 1).
    pub(crate) fn one_to(&self, n: u64) -> u64 {
        1 + self.next() % n.max(1)
    }

    /// True once in `n` draws, on average.
    pub(crate) fn one_in(&self, n: u64) -> bool {
        self.next().is_multiple_of(n)
    }
}

/// One crash in about this many sends (relay) or commits (consumer).
const CRASH_EVERY: u64 = 25;

/// The workers' numbers, for their streams.
const RELAY: u64 = 1;
const CONSUMER: u64 = 2;
const CLIENT: u64 = 3;

/// When one worker crashes, counted in its events (the relay's sends, the consumer's
/// commits) over all its restarts: the first crash within the first `first_within`
/// events, so that every run has one, then one after every 1 to 2 × [`CRASH_EVERY`]
/// events. Drawn from the seed alone, so a seed gives the same schedule every run.
#[derive(Debug)]
pub(crate) struct CrashSchedule {
    rng: Rng,
    /// Events so far, and the event that crashes next.
    at: std::sync::Mutex<(u64, u64)>,
}

impl CrashSchedule {
    pub(crate) fn new(rng: Rng, first_within: u64) -> CrashSchedule {
        let first = rng.one_to(first_within.min(CRASH_EVERY));
        CrashSchedule {
            rng,
            at: std::sync::Mutex::new((0, first)),
        }
    }

    /// Counts one event; `true` when the worker crashes at it.
    pub(crate) fn crash_now(&self) -> bool {
        let mut at = self.at.lock().unwrap();
        at.0 += 1;
        if at.0 < at.1 {
            return false;
        }
        at.1 = at.0 + self.rng.one_to(2 * CRASH_EVERY);
        true
    }
}

pub(crate) async fn run(options: &Options) -> Result<Report, Error> {
    let env = Env::new(options).await?;
    let result = drive(options, &env).await;
    env.cleanup(options).await;
    result
}

async fn drive(options: &Options, env: &Env) -> Result<Report, Error> {
    let (down_addr, downstream) = services::downstream().await?;
    let orders_addr = services::orders(env, down_addr).await?;
    let rng = Rng::of_worker(options.seed, CLIENT);
    let orders = options.orders as u64;
    // Every row is sent at least once and every message committed once: the first
    // crash of each worker falls within those, so every run has both kinds.
    let relay_crashes = Arc::new(CrashSchedule::new(
        Rng::of_worker(options.seed, RELAY),
        2 * orders,
    ));
    let consumer_crashes = CrashSchedule::new(Rng::of_worker(options.seed, CONSUMER), orders);
    let counters = Arc::new(Counters::default());
    let stop = Arc::new(AtomicBool::new(false));
    let consumer = tokio::spawn(consume(
        options.clone(),
        env.consumer()?,
        consumer_crashes,
        Arc::clone(&counters),
        Arc::clone(&stop),
        env.queue.clone(),
    ));

    // A backlog placed while no relay runs, then drained: the relay's throughput.
    let backlog = options.orders / 2;
    place_orders(orders_addr, 0..backlog, &rng, None).await?;
    let started = Instant::now();
    let relay = tokio::spawn(supervise_relay(
        options.clone(),
        env.pool.clone(),
        relay_crashes,
        Arc::clone(&counters),
        Arc::clone(&stop),
    ));
    wait_for(
        env,
        "SELECT count(*) FROM retrysafe_outbox WHERE state = 0",
        0,
    )
    .await?;
    counters.drain_secs.store(
        u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
        Ordering::Relaxed,
    );
    counters
        .backlog_rows
        .store(2 * backlog as u64, Ordering::Relaxed);

    // The rest while it runs (and the consumer has caught up): the latency from
    // commit to delivery.
    let processed = "SELECT count(*) FROM retrysafe_processed WHERE processed_at IS NOT NULL";
    wait_for(env, processed, i64::try_from(backlog).unwrap_or(i64::MAX)).await?;
    counters
        .live_from_id
        .store(max_id(env).await? as u64, Ordering::Relaxed);
    // Paced well below the relay's throughput (100 orders, 200 rows a second), so the
    // figure is the relay's own delay, not a queue's.
    place_orders(
        orders_addr,
        backlog..options.orders,
        &rng,
        Some(Duration::from_millis(80)),
    )
    .await?;
    wait_for(
        env,
        "SELECT count(*) FROM retrysafe_outbox WHERE state = 0",
        0,
    )
    .await?;
    let orders = i64::try_from(options.orders).unwrap_or(i64::MAX);
    wait_for(env, processed, orders).await?;
    stop.store(true, Ordering::Relaxed);
    let _ = relay.await;
    consumer.abort();
    Report::audit(env, &downstream, &counters).await
}

/// Posts orders `range`, eight at a time (a chunk every `pace`, if given); about one
/// in five is sent twice, as a client's retry would.
async fn place_orders(
    addr: std::net::SocketAddr,
    range: std::ops::Range<usize>,
    rng: &Rng,
    pace: Option<Duration>,
) -> Result<(), Error> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let ids: Vec<usize> = range.collect();
    for chunk in ids.chunks(8) {
        let next = pace.map(|p| Instant::now() + p);
        let sends = chunk.iter().flat_map(|i| {
            let copies = if rng.one_in(5) { 2 } else { 1 };
            std::iter::repeat_n(*i, copies)
        });
        let answers = futures_util::future::join_all(sends.map(|i| {
            let request = http::Request::post(format!("http://{addr}/orders"))
                .header("idempotency-key", format!("order-{i}"))
                .body(Full::new(Bytes::from(format!("order {i}"))))
                .unwrap();
            client.request(request)
        }))
        .await;
        for answer in answers {
            let status = answer?.status();
            // A copy that arrives while the first is in flight gets 409: the first
            // one's commit stands.
            if !(status.is_success() || status == http::StatusCode::CONFLICT) {
                return Err(format!("order answered {status}").into());
            }
        }
        if let Some(next) = next {
            tokio::time::sleep_until(next).await;
        }
    }
    Ok(())
}

/// Runs relays one after another: each crashes between a send and its mark when the
/// schedule says so; the next takes the crashed one's rows once their lease ends.
async fn supervise_relay(
    options: Options,
    pool: sqlx::PgPool,
    schedule: Arc<CrashSchedule>,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::Relaxed) {
        let schedule = Arc::clone(&schedule);
        let crashes = options.crashes;
        let relay = OutboxRelay::new(pool.clone())
            .http_client(Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>())
            .publisher(AmqpPublisher::new(options.amqp.clone()))
            .lease(Duration::from_secs(1))
            .send_timeout(Duration::from_millis(800))
            .poll_interval(Duration::from_millis(10))
            .backoff(Backoff::new(
                Duration::from_millis(10),
                Duration::from_millis(200),
                Jitter::Full,
            ))
            .__crash_after_send(move |_| crashes && schedule.crash_now())
            .build()
            .unwrap()
            .spawn();
        while !relay.is_finished() && !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if relay.is_finished() {
            counters.relay_crashes.fetch_add(1, Ordering::Relaxed);
        } else {
            relay.stop().await;
        }
    }
}

/// Consumes the queue; a crash between commit and ack closes the connection (the
/// broker requeues what was not acknowledged) and a new consumer starts.
async fn consume(
    options: Options,
    consumer: Consumer,
    schedule: CrashSchedule,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
    queue: String,
) {
    let crashes = options.crashes;
    let consumer = consumer.__crash_after_commit(move |_| crashes && schedule.crash_now());
    while !stop.load(Ordering::Relaxed) {
        if let Err(e) = consume_until_crash(&options, &consumer, &counters, &queue).await {
            eprintln!("consumer: {e}; restarting");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn consume_until_crash(
    options: &Options,
    consumer: &Consumer,
    counters: &Counters,
    queue: &str,
) -> Result<(), Error> {
    let conn = Connection::connect(&options.amqp, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    let mut deliveries = channel
        .basic_consume(
            queue.into(),
            "example".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    while let Some(delivery) = deliveries.next().await {
        let delivery = delivery?;
        counters.amqp_deliveries.fetch_add(1, Ordering::Relaxed);
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default();
        let outcome = consumer
            .process(delivery, |tx, body| {
                let body = String::from_utf8_lossy(body).into_owned();
                Box::pin(async move {
                    sqlx::query("INSERT INTO consumed (message_id, body) VALUES ($1, $2)")
                        .bind(id)
                        .bind(body)
                        .execute(tx)
                        .await
                        .map(|_| ())
                })
            })
            .await?;
        match outcome {
            Processed::Crashed => {
                counters.consumer_crashes.fetch_add(1, Ordering::Relaxed);
                let _ = conn.close(320, "crashed".into()).await;
                return Ok(());
            }
            Processed::DeadLettered(_) => {
                counters
                    .dead_lettered_messages
                    .fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }
    Ok(())
}

async fn max_id(env: &Env) -> Result<i64, Error> {
    Ok(
        sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM retrysafe_outbox")
            .fetch_one(&env.pool)
            .await?,
    )
}

/// Waits until `count_sql` counts `target` (at most five minutes).
async fn wait_for(env: &Env, count_sql: &str, target: i64) -> Result<(), Error> {
    let end = Instant::now() + Duration::from_secs(300);
    loop {
        let n: i64 = sqlx::query_scalar(count_sql).fetch_one(&env.pool).await?;
        if n == target {
            return Ok(());
        }
        if Instant::now() > end {
            return Err(format!("gave up waiting: {count_sql} = {n}, not {target}").into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
