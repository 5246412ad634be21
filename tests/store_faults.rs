//! The store taken away under load, with the app never restarted: a `payments` instance
//! serves a continuous load of fresh keys (some held before their commit point or after
//! their effect by the delay hooks, so that the fault finds requests at every stage)
//! while its store
//!
//! - becomes unreachable: a TCP proxy in front of the shared Redis or PostgreSQL is cut
//!   (every connection closed, new ones closed at once) and later restored;
//! - is restarted: a private `redis-server` (AOF with `appendfsync always`, which the
//!   store's documentation requires for durability) is killed with SIGKILL and started again on the same
//!   port and directory; a private PostgreSQL cluster (initdb into a temporary
//!   directory, as user `postgres`) is stopped with `pg_ctl -m immediate` and started
//!   again (crash recovery).
//!
//! Checked: every request started after the store went away and answered before it came
//! back is a 503 problem with `retry-after` (fail closed), and no request ever fails at
//! the transport level (the app stays up); once the store is back the same process
//! serves again (the time until the first 201 is printed, not asserted); then every key
//! is resent until it has a definitive answer, and the backend, read directly, holds one
//! payment per key and never two, every 201 its payment, and no `in_progress` record. With
//! PostgreSQL in the example's default, transactional mode every key ends with exactly
//! one payment; with Redis and with PostgreSQL in the plain mode (`PAYMENTS_PG_MODE=plain`:
//! a `PostgresStore` under the `IdempotencyLayer`) a request caught past its commit point
//! may end `outcome_unknown` (counted), and so may one whose answer was returned but
//! could not be stored before its lease ended (`completion_lost`, counted; its payment
//! must be there). A fresh key sent after the store is back never ends unknown.
//!
//! `FAULTS_SEED` repeats a run (its seed is printed); each test prints one summary line.
//! `STORE_FAULTS_LEASE_MS` changes the app's lease (default 500 ms, so that claims
//! stranded by the outage expire quickly); `STORE_FAULTS_REDIS_AOF=no` runs the private
//! Redis without persistence, which fails the restart test (see `PrivateRedis::spawn`).
// This test drives real child processes (the app, redis-server, pg_ctl) on the wall
// clock, so it uses std's clock on purpose.
#![allow(
    clippy::disallowed_methods,
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    missing_docs
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use http::StatusCode;
use retrysafe_test_support::payments::audit::{
    Final, KeyAudit, Payment, Tally, is_outcome_unknown, resolve_all,
};
use retrysafe_test_support::payments::{Answer, Api, PgSpace, RedisSpace, Server};
use retrysafe_test_support::private::{PrivatePg, PrivateRedis};
use retrysafe_test_support::rng::{SplitMix64, seed_from_env};
use retrysafe_test_support::services::{database_url, host_port, proxy_to, redis_url, with_addr};

/// How long one key may take to get a definitive answer once the store is back.
const PATIENCE: Duration = Duration::from_secs(60);

/// Load before the fault, and how long the store stays away.
const BEFORE: Duration = Duration::from_millis(600);
const OUTAGE: Duration = Duration::from_millis(2500);

/// Concurrent load streams.
const STREAMS: u64 = 6;

/// The app's lease with Redis and plain PostgreSQL: a claim stranded by the outage is
/// answered 409 this long.
const LEASE_MS: &str = "500";

/// How long a handler may run (its handlers are quick): the reconciler waits this long
/// past an ended lease before it settles the record that lease left behind, so a short
/// one lets the stranded keys reach their answer within the run.
const MAX_EXECUTION_MS: &str = "2000";

// ---------------------------------------------------------------------------------
// Load

/// One request of the load: when it was sent and answered, and the answer.
struct Sent {
    payment: Payment,
    started: Instant,
    finished: Instant,
    answer: Result<Answer, String>,
}

/// Streams of fresh keys against one app until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Vec<Sent>>>,
}

impl Load {
    fn start(api: &Api, prefix: &str, seed: u64) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..STREAMS)
            .map(|t| {
                let (api, stop) = (api.clone(), Arc::clone(&stop));
                let prefix = format!("{prefix}-{t}");
                let mut rng = SplitMix64::new(seed.wrapping_add(t));
                tokio::spawn(async move {
                    let mut out = Vec::new();
                    let mut n: i64 = 0;
                    while !stop.load(Ordering::Acquire) {
                        n += 1;
                        let payment = Payment::new(format!("{prefix}-{n}"), n);
                        // One request in four waits before its commit point or after its
                        // effect, so the fault finds some there.
                        let delay = rng.range(0, 200).to_string();
                        let hook = match rng.range(0, 8) {
                            0 => Some(("x-simulate-delay-ms", delay.as_str())),
                            1 => Some(("x-simulate-delay-after-ms", delay.as_str())),
                            _ => None,
                        };
                        let started = Instant::now();
                        let answer = api
                            .try_pay(
                                &payment.key,
                                &payment.account,
                                payment.amount,
                                hook.as_slice(),
                            )
                            .await
                            .map_err(|e| e.to_string());
                        let refused = answer
                            .as_ref()
                            .is_ok_and(|a| a.status != StatusCode::CREATED);
                        out.push(Sent {
                            payment,
                            started,
                            finished: Instant::now(),
                            answer,
                        });
                        if refused {
                            // A client told to retry later would wait; this one sends its
                            // next key a little later, so an outage does not spin.
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                    out
                })
            })
            .collect();
        Load { stop, tasks }
    }

    async fn stop(self) -> Vec<Sent> {
        self.stop.store(true, Ordering::Release);
        let mut all = Vec::new();
        for task in self.tasks {
            all.extend(task.await.unwrap());
        }
        all
    }
}

/// Fresh keys (`outage-N`) sent one after another to `api`, 20 ms apart, until `until`
/// (less the time one refusal may take).
async fn send_during(api: Api, until: Instant) -> Vec<Sent> {
    let mut out = Vec::new();
    while Instant::now() + Duration::from_millis(1100) < until {
        let payment = Payment::new(format!("outage-{}", out.len()), 7);
        let started = Instant::now();
        let answer = api
            .try_pay(&payment.key, &payment.account, payment.amount, &[])
            .await
            .map_err(|e| e.to_string());
        out.push(Sent {
            payment,
            started,
            finished: Instant::now(),
            answer,
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    out
}

/// Fresh keys sent one after another to `api` until one is answered 201: how long the
/// app took to serve again after `back` (the store ready again), and the keys sent.
async fn first_success(api: &Api, back: Instant) -> (Duration, Vec<Payment>) {
    let mut probes = Vec::new();
    loop {
        let payment = Payment::new(format!("probe-{}", probes.len()), 1);
        let answer = api
            .try_pay(&payment.key, &payment.account, payment.amount, &[])
            .await;
        probes.push(payment);
        match answer {
            Ok(a) if a.status == StatusCode::CREATED => return (back.elapsed(), probes),
            Ok(a) => a.assert_unavailable(),
            Err(e) => panic!("the app must stay up: {e}"),
        }
        assert!(
            back.elapsed() < PATIENCE,
            "the app did not serve again within {PATIENCE:?} of the store's return"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Where the store lives for one test, and how to read it.
enum Space {
    Redis(RedisSpace),
    /// With `true` in the example's plain mode (`PAYMENTS_PG_MODE=plain`).
    Postgres(PgSpace, bool),
}

impl Space {
    async fn audit(&self, payments: &[Payment]) -> Vec<KeyAudit> {
        match self {
            Space::Redis(r) => r.audit(payments).await,
            Space::Postgres(p, _) => p.audit(payments).await,
        }
    }

    fn env(&self) -> Vec<(&str, &str)> {
        match self {
            Space::Redis(r) => r.env().to_vec(),
            Space::Postgres(p, false) => p.env().to_vec(),
            Space::Postgres(p, true) => vec![p.env()[0], ("PAYMENTS_PG_MODE", "plain")],
        }
    }

    fn transactional(&self) -> bool {
        matches!(self, Space::Postgres(_, false))
    }
}

/// The store goes away and comes back under load; `fault` takes it away, `repair`
/// brings it back. Checks everything and prints the summary line of `test`.
async fn outage_under_load<F, R>(test: &str, space: &Space, store_url: &str, fault: F, repair: R)
where
    F: AsyncFnOnce(),
    R: AsyncFnOnce(),
{
    let seed = seed_from_env("FAULTS_SEED", test);
    // `STORE_FAULTS_LEASE_MS` sets another lease (the completion of a request caught by
    // the outage is retried while its lease lasts).
    let lease = std::env::var("STORE_FAULTS_LEASE_MS").unwrap_or_else(|_| LEASE_MS.to_owned());
    let mut args = vec!["--store", store_url];
    if !space.transactional() {
        args.extend([
            "--lease-ms",
            lease.as_str(),
            "--max-execution-ms",
            MAX_EXECUTION_MS,
        ]);
    }
    let mut server = Server::start_with(&args, &space.env());
    let api = Api::new(&server);

    let load = Load::start(&api, "load", seed);
    tokio::time::sleep(BEFORE).await;
    fault().await;
    let down = Instant::now();
    // Fresh keys sent while the store is away, one after another, apart from the load
    // (whose streams may all be waiting on requests the outage caught mid-flight).
    let outage = tokio::spawn(send_during(api.clone(), down + OUTAGE));
    tokio::time::sleep(OUTAGE).await;
    let back = Instant::now();
    repair().await;
    let ready = Instant::now();
    let (recovery, probes) = first_success(&api, ready).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut sent = load.stop().await;
    sent.extend(outage.await.unwrap());
    assert!(server.is_running(), "the app was never restarted");

    // Fail closed while the store is away; the app itself always answers.
    let mut refused = 0u64;
    let mut refused_during = 0u64;
    let mut created_before_resend = 0u64;
    let mut app_unknown = 0u64;
    let mut slowest_refusal = Duration::ZERO;
    for s in &sent {
        let a = match &s.answer {
            Ok(a) => a,
            Err(e) => panic!("{}: no answer from the app: {e}", s.payment.key),
        };
        let during = s.started >= down && s.finished <= back;
        match a.status {
            StatusCode::CREATED => {
                assert!(!during, "a 201 while the store was away: {a:?}");
                a.assert_created(&s.payment.account, s.payment.amount);
                created_before_resend += 1;
            }
            StatusCode::SERVICE_UNAVAILABLE => {
                a.assert_unavailable();
                refused += 1;
                refused_during += u64::from(during);
                if during {
                    slowest_refusal = slowest_refusal.max(s.finished - s.started);
                }
            }
            StatusCode::INTERNAL_SERVER_ERROR if !space.transactional() => {
                // The ledger write failed after the commit point (the store went away
                // under it): the handler's own 500, marked do-not-retry; the record
                // becomes outcome_unknown. Only a request already running can see it.
                a.assert_problem_type(500, "payment-outcome-unknown");
                assert_eq!(a.headers["do-not-retry"], "1", "{a:?}");
                assert!(s.started < back, "{a:?}");
                app_unknown += 1;
            }
            _ => panic!("{}: unexpected answer {a:?}", s.payment.key),
        }
        assert!(
            !is_outcome_unknown(a),
            "a fresh key is never unknown: {a:?}"
        );
    }
    assert!(
        refused_during > 0,
        "no request was refused during the outage"
    );

    // Resend every key until it has its definitive answer; read the backend.
    let mut payments: Vec<Payment> = sent.iter().map(|s| s.payment.clone()).collect();
    payments.extend(probes);
    let (finals, resends) = resolve_all(std::slice::from_ref(&api), &payments, 8, PATIENCE).await;
    let audits = space.audit(&payments).await;
    let mut tally = Tally::default();
    let mut unknown_started_late = 0u64;
    for (i, (last, audit)) in finals.iter().zip(&audits).enumerate() {
        let earlier: Vec<&Answer> = sent
            .get(i)
            .and_then(|s| s.answer.as_ref().ok())
            .filter(|a| a.status == StatusCode::CREATED)
            .into_iter()
            .collect();
        tally.add(&earlier, last, audit);
        if matches!(last, Final::OutcomeUnknown(_)) && sent.get(i).is_none_or(|s| s.started >= back)
        {
            unknown_started_late += 1;
        }
    }
    assert!(server.is_running(), "the app was never restarted");
    println!(
        "{test}: requests {requests} during {secs:.1} s of load, 503 {refused} ({refused_during} \
         sent and answered while the store was away, the slowest in {slowest_ms} ms), 201 \
         {created_before_resend}, app 500 (payment outcome unknown) {app_unknown}; store back \
         in {repair_ms} ms, first 201 {recovery_ms} ms after it was back; resent to a \
         definitive answer ({resends} sends): {tally}",
        requests = sent.len(),
        secs = (ready - down + BEFORE + recovery).as_secs_f64() + 0.3,
        slowest_ms = slowest_refusal.as_millis(),
        repair_ms = (ready - back).as_millis(),
        recovery_ms = recovery.as_millis(),
    );
    tally.assert_sound(space.transactional());
    assert_eq!(
        unknown_started_late, 0,
        "only a request running when the store went away may end unknown"
    );
    if let Space::Postgres(p, false) = space {
        let (rows, in_progress, paid) = p.table_counts().await;
        assert_eq!(in_progress, 0);
        assert_eq!(u64::try_from(rows).unwrap(), tally.keys, "{tally:?}");
        assert_eq!(u64::try_from(paid).unwrap(), tally.keys, "{tally:?}");
    }
    drop(server);
}

// ---------------------------------------------------------------------------------
// The store unreachable (a proxy cut and restored)

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_unreachable_under_load_fails_closed_and_recovers() {
    let space = Space::Redis(RedisSpace::new().await);
    let proxy = proxy_to(&host_port(&redis_url(), 6379)).await;
    let url = with_addr(&redis_url(), proxy.addr);
    outage_under_load(
        "redis unreachable",
        &space,
        &url,
        async || proxy.cut(),
        async || proxy.restore(),
    )
    .await;
}

async fn postgres_unreachable(plain: bool) {
    let space = Space::Postgres(PgSpace::new().await, plain);
    let proxy = proxy_to(&host_port(&database_url(), 5432)).await;
    let url = with_addr(&database_url(), proxy.addr);
    let test = if plain {
        "postgres plain unreachable"
    } else {
        "postgres tx unreachable"
    };
    outage_under_load(
        test,
        &space,
        &url,
        async || proxy.cut(),
        async || proxy.restore(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tx_unreachable_under_load_fails_closed_and_recovers() {
    postgres_unreachable(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_plain_unreachable_under_load_fails_closed_and_recovers() {
    postgres_unreachable(true).await;
}

// ---------------------------------------------------------------------------------
// The store restarted: private servers

async fn postgres_restarted(plain: bool) {
    let pg = PrivatePg::start().await;
    let space = Space::Postgres(PgSpace::at(&pg.url()).await, plain);
    let test = if plain {
        "postgres plain restarted (pg_ctl -m immediate)"
    } else {
        "postgres tx restarted (pg_ctl -m immediate)"
    };
    outage_under_load(
        test,
        &space,
        &pg.url(),
        async || pg.stop_immediate().await,
        async || pg.start_server().await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tx_restarted_under_load_fails_closed_and_recovers() {
    postgres_restarted(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_plain_restarted_under_load_fails_closed_and_recovers() {
    postgres_restarted(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarted_under_load_fails_closed_and_recovers() {
    let redis = tokio::sync::Mutex::new(PrivateRedis::start().await);
    let url = redis.lock().await.url();
    let space = Space::Redis(RedisSpace::at(&url).await);
    let test = if std::env::var("STORE_FAULTS_REDIS_AOF").as_deref() == Ok("no") {
        "redis restarted (SIGKILL, NO persistence)"
    } else {
        "redis restarted (SIGKILL, AOF fsync always)"
    };
    outage_under_load(
        test,
        &space,
        &url,
        async || redis.lock().await.kill(),
        async || redis.lock().await.spawn().await,
    )
    .await;
}
