//! Crash tests with real processes: two `payments` instances share one store while
//! load runs through them; one of them is killed with SIGKILL at a random moment, many
//! times, and restarted. The kill lands before the commit point (requests held there by
//! `x-simulate-delay-ms`), after the effect before the answer
//! (`x-simulate-delay-after-ms`), or, for the requests of the back-to-back streams that
//! carry no delay, anywhere: mostly in the store's round trips (claim, commit point,
//! ledger write, completion). After each kill every key of the round is resent, to
//! either instance, until it has a definitive answer — a 201 (the first answer replayed,
//! or a run), or the stable 500 `outcome-unknown` problem — retrying the 409s of a dead
//! holder's lease and the 503 `outcome-pending` of a key being resolved; then the
//! backend is read directly, key by key:
//!
//! - never two payments for one key; a 201 answered to anyone is the payment in the
//!   ledger, and every 201 for a key is the same answer;
//! - Redis, and PostgreSQL in the plain mode (`PAYMENTS_PG_MODE=plain`: a `PostgresStore`
//!   under the `IdempotencyLayer`, the payment written on its own): one payment; a
//!   completed record has exactly one payment;
//! - PostgreSQL in the example's default mode, the transactional layer (key and payment
//!   in one transaction): exactly one payment for every key, every key answered 201, no
//!   `outcome_unknown` ever, and no key row without its payment;
//! - no `in_progress` record is left once every key has its answer, in particular none
//!   whose lease has expired by the store's clock (Redis `TIME`, PostgreSQL
//!   `clock_timestamp()`);
//! - key by key, against what the store held right after the kill (read once the dead
//!   process's last commands have landed): a key with no record or a claim before its
//!   commit point runs once after the kill (a takeover once the lease expired); a claim
//!   past its commit point is resolved by the survivors' reconciler (on by default in
//!   the example) from the ledger: its payment, if written, replayed; if not, one
//!   payment made after the kill — effectively once, never `outcome_unknown`; a
//!   completed key is replayed. With the transactional layer
//!   no claim is ever visible: a killed transaction leaves nothing. The summary line
//!   counts the killed requests by these stages, which is where the kills landed.
//!
//! The `MemoryStore` forgets everything with its process by design (the
//! embedded default); a crash of a memory-backed instance loses its records and its
//! ledger alike, so there is nothing to test here for it.
//!
//! `CRASH_ROUNDS` (default 30 kills per store) and `CRASH_SEED` (printed by every run)
//! are read from the environment; each test prints two `crash …:` summary lines (run
//! with `--nocapture` to see them).
// This test drives real child processes on the wall clock (spawning, killing, waiting
// for leases), so it uses std's clock on purpose.
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
use retrysafe_core::idempotency::Token;
use retrysafe_test_support::eventually;
use retrysafe_test_support::payments::audit::{
    Final, KeyAudit, Payment, RecordState, Tally, resolve_all,
};
use retrysafe_test_support::payments::{Answer, Api, PgSpace, RedisSpace, Server, run_to_exit};
use retrysafe_test_support::rng::{SplitMix64, env_number, seed_from_env};
use retrysafe_test_support::services::{database_url, redis_url};

/// How long one key may take to get a definitive answer after a kill.
const PATIENCE: Duration = Duration::from_secs(60);

/// The lease of the Redis instances: a dead holder's key is answered 409 this long.
const LEASE_MS: &str = "400";
/// How long a handler may run: short, so that the reconciler, which waits this long
/// past a dead holder's lease before it asks the resolver, settles the killed holders'
/// records within the resend loop's patience (the delay hooks hold a handler at most
/// 400 ms).
const MAX_EXECUTION_MS: &str = "2000";

/// Requests with a delay hook per round, and back-to-back streams without one.
const SLOW: usize = 6;
const STREAMS: usize = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Redis,
    /// `--store postgres://…`: the transactional layer.
    PostgresTx,
    /// `--store postgres://…` with `PAYMENTS_PG_MODE=plain`: the `IdempotencyLayer` over
    /// a `PostgresStore`, the payment written on its own after the commit point.
    PostgresPlain,
}

impl Mode {
    fn transactional(self) -> bool {
        self == Mode::PostgresTx
    }

    /// Mixed into the seed, so the two tests of one run differ.
    fn salt(self) -> u64 {
        match self {
            Mode::Redis => 0x0052_6564_6973,
            Mode::PostgresTx => 0x5067_5478,
            Mode::PostgresPlain => 0x5067_506c,
        }
    }
}

enum Space {
    Redis(RedisSpace),
    /// With `true` in the plain mode.
    Postgres(PgSpace, bool),
}

impl Space {
    async fn new(mode: Mode) -> Space {
        match mode {
            Mode::Redis => Space::Redis(RedisSpace::new().await),
            Mode::PostgresTx => Space::Postgres(PgSpace::new().await, false),
            Mode::PostgresPlain => Space::Postgres(PgSpace::new().await, true),
        }
    }

    /// Starts an instance called `name` (PostgreSQL sessions carry it as their
    /// `application_name`).
    fn start(&self, name: &str) -> Server {
        match self {
            Space::Redis(r) => {
                let url = redis_url();
                Server::start_with(
                    &[
                        "--store",
                        url.as_str(),
                        "--lease-ms",
                        LEASE_MS,
                        "--max-execution-ms",
                        MAX_EXECUTION_MS,
                    ],
                    &r.env(),
                )
            }
            Space::Postgres(p, false) => {
                let url = PgSpace::url_named(name);
                Server::start_with(&["--store", url.as_str()], &p.env())
            }
            Space::Postgres(p, true) => {
                let url = PgSpace::url_named(name);
                let [schema] = p.env();
                Server::start_with(
                    &[
                        "--store",
                        url.as_str(),
                        "--lease-ms",
                        LEASE_MS,
                        "--max-execution-ms",
                        MAX_EXECUTION_MS,
                    ],
                    &[schema, ("PAYMENTS_PG_MODE", "plain")],
                )
            }
        }
    }

    async fn audit(&self, payments: &[Payment]) -> Vec<KeyAudit> {
        match self {
            Space::Redis(r) => r.audit(payments).await,
            Space::Postgres(p, _) => p.audit(payments).await,
        }
    }
}

/// Where a request of a round was meant to be when the kill came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Point {
    /// Held before its commit point (`x-simulate-delay-ms`).
    BeforeCommit,
    /// Held after its effect, before its answer (`x-simulate-delay-after-ms`).
    AfterEffect,
    /// No delay: a back-to-back stream, mostly in store round trips.
    Stream,
}

/// One key of a round: what its clients were answered before the definitive answer,
/// and how many of its sends died with the process.
struct Sent {
    payment: Payment,
    point: Point,
    answers: Vec<Answer>,
    interrupted: u32,
}

impl Sent {
    fn new(payment: Payment, point: Point) -> Sent {
        Sent {
            payment,
            point,
            answers: Vec::new(),
            interrupted: 0,
        }
    }

    /// Records one send: an answer (a 201, a 409 while another copy holds the key, or a
    /// 503 with `retry-after` should a store call time out on a loaded machine — the
    /// store is healthy here, so nothing else), or a connection that died.
    fn record(&mut self, answer: reqwest::Result<Answer>) {
        match answer {
            Ok(a) => {
                match a.status {
                    StatusCode::CREATED => {
                        a.assert_created(&self.payment.account, self.payment.amount);
                    }
                    StatusCode::SERVICE_UNAVAILABLE => a.assert_unavailable(),
                    _ => a.assert_problem_type(409, "request-in-flight"),
                }
                self.answers.push(a);
            }
            Err(_) => self.interrupted += 1,
        }
    }
}

/// Counts of one test, for its summary line.
#[derive(Debug, Default)]
struct Counts {
    kills: u64,
    /// Keys whose request died with its process, by what the store held after the kill
    /// (see [`STAGES`]).
    stage: [u64; 5],
    /// Sends that died with their process, by kill point.
    interrupted: [u64; 3],
    /// Keys whose definitive answer is `outcome-unknown`, by kill point.
    unknown: [u64; 3],
    /// Keys answered 201 only after the kill (a takeover or a rerun), by kill point.
    ran_after: [u64; 3],
    resend_sends: u64,
}

/// What the store held for a key whose request died with its process: where the kill
/// found it.
const STAGES: [&str; 5] = [
    "no record (before or during its claim; with PostgreSQL's transactional layer also \
     anywhere before its commit)",
    "claimed, before the commit point",
    "past the commit point, payment written",
    "past the commit point, no payment (between the commit-point write and the ledger \
     write)",
    "completed, answer not delivered (after the completion write)",
];

/// Checks what became of one key after the kill against what the store held right after
/// it (`before`), and returns its stage (an index into [`STAGES`]):
///
/// - no record, or a claim before its commit point: the key runs after the kill (a
///   takeover once the dead holder's lease expired), once;
/// - a claim past its commit point (or the `outcome_unknown` record a copy made of it):
///   resolved by the survivors' reconciler from the ledger (the example runs one by
///   default): with its payment written, completed with that payment and replayed, the
///   ledger as it was; without, released and run once after the kill;
/// - completed: replayed, the ledger as it was;
/// - with the transactional layer no claim or `outcome_unknown` is ever visible.
fn expect_from_kill(
    mode: Mode,
    key: &str,
    before: &KeyAudit,
    last: &Final,
    after: &KeyAudit,
) -> usize {
    let ran_after = matches!(last, Final::Created(a) if !a.replayed());
    let replayed = matches!(last, Final::Created(a) if a.replayed());
    let unknown = matches!(last, Final::OutcomeUnknown(_));
    let ctx = || format!("{key}: at the kill {before:?}, then {last:?}, now {after:?}");
    let (stage, ok) = match before.record {
        RecordState::Absent => (
            0,
            ran_after && before.payments.is_empty() && after.payments.len() == 1,
        ),
        RecordState::InProgress { passed: false, .. } => (
            1,
            !mode.transactional()
                && ran_after
                && before.payments.is_empty()
                && after.payments.len() == 1,
        ),
        RecordState::InProgress { passed: true, .. } => (
            if before.payments.is_empty() { 3 } else { 2 },
            !mode.transactional() && resolved(before, replayed, ran_after, after),
        ),
        RecordState::Completed => (
            4,
            replayed && before.payments.len() == 1 && after.payments == before.payments,
        ),
        RecordState::OutcomeUnknown => (
            3,
            !mode.transactional() && resolved(before, replayed, ran_after, after),
        ),
    };
    assert!(ok && !unknown, "{}", ctx());
    stage
}

/// A pending key the reconciler resolved from the ledger: the payment made before the
/// kill replayed, or, when none was made, one payment made after it.
fn resolved(before: &KeyAudit, replayed: bool, ran_after: bool, after: &KeyAudit) -> bool {
    if before.payments.is_empty() {
        ran_after && after.payments.len() == 1
    } else {
        replayed && after.payments == before.payments
    }
}

fn slot(point: Point) -> usize {
    match point {
        Point::BeforeCommit => 0,
        Point::AfterEffect => 1,
        Point::Stream => 2,
    }
}

/// A fresh instance name (an `application_name`).
fn name(role: &str) -> String {
    format!("payments-crash-{role}-{}", &Token::random().to_hex()[..8])
}

/// One request with a delay hook sent to `api`, and maybe a copy of it sent to `other`
/// `copy_after_ms` later.
async fn send_slow(
    api: Api,
    other: Api,
    mut sent: Sent,
    delay_ms: u64,
    copy_after_ms: Option<u64>,
) -> Sent {
    let hook = match sent.point {
        Point::BeforeCommit => "x-simulate-delay-ms",
        _ => "x-simulate-delay-after-ms",
    };
    let delay = delay_ms.to_string();
    let p = sent.payment.clone();
    let hooks = [(hook, delay.as_str())];
    let original = api.try_pay(&p.key, &p.account, p.amount, &hooks);
    let copy = async {
        match copy_after_ms {
            Some(ms) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Some(other.try_pay(&p.key, &p.account, p.amount, &[]).await)
            }
            None => None,
        }
    };
    let (original, copy) = tokio::join!(original, copy);
    sent.record(original);
    if let Some(copy) = copy {
        sent.record(copy);
    }
    sent
}

/// Fresh keys sent one after another to `api` until `stop`, or until the server dies.
async fn send_stream(api: Api, prefix: String, stop: Arc<AtomicBool>) -> Vec<Sent> {
    let mut out = Vec::new();
    for n in 0.. {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let payment = Payment::new(format!("{prefix}-{n}"), 100 + n);
        let p = payment.clone();
        let answer = api.try_pay(&p.key, &p.account, p.amount, &[]).await;
        let died = answer.is_err();
        let mut sent = Sent::new(payment, Point::Stream);
        sent.record(answer);
        out.push(sent);
        if died {
            break;
        }
    }
    out
}

async fn crash_and_restart(mode: Mode) {
    let test = format!("crash {mode:?}");
    let mut rng = SplitMix64::new(seed_from_env("CRASH_SEED", &test) ^ mode.salt());
    let rounds = env_number("CRASH_ROUNDS", 30);
    let space = Space::new(mode).await;
    let names = [name("a"), name("b")];
    let mut servers = [Some(space.start(&names[0])), Some(space.start(&names[1]))];
    let started = Instant::now();
    let mut total = Tally::default();
    let mut counts = Counts::default();
    let mut everything: Vec<(Payment, Option<Answer>)> = Vec::new();

    for round in 0..rounds {
        let apis = [
            Api::new(servers[0].as_ref().unwrap()),
            Api::new(servers[1].as_ref().unwrap()),
        ];
        let victim = usize::from(rng.one_in(2));
        let survivor = 1 - victim;

        let mut slow = Vec::new();
        for i in 0..SLOW {
            let point = if rng.one_in(2) {
                Point::BeforeCommit
            } else {
                Point::AfterEffect
            };
            let amount = i64::try_from(rng.range(1, 1_000_000)).unwrap();
            let sent = Sent::new(Payment::new(format!("r{round}-s{i}"), amount), point);
            let delay = rng.range(0, 400);
            let copy = rng.one_in(2).then(|| rng.range(0, 300));
            slow.push(tokio::spawn(send_slow(
                apis[victim].clone(),
                apis[survivor].clone(),
                sent,
                delay,
                copy,
            )));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let streams: Vec<_> = (0..STREAMS)
            .map(|t| {
                // One stream keeps the survivor busy, the others run on the victim.
                let api = apis[if t == 0 { survivor } else { victim }].clone();
                tokio::spawn(send_stream(
                    api,
                    format!("r{round}-f{t}"),
                    Arc::clone(&stop),
                ))
            })
            .collect();

        tokio::time::sleep(Duration::from_millis(rng.range(5, 450))).await;
        servers[victim].take().unwrap().kill();
        counts.kills += 1;
        stop.store(true, Ordering::Release);

        let mut sent: Vec<Sent> = Vec::new();
        for task in slow {
            sent.push(task.await.unwrap());
        }
        for task in streams {
            sent.extend(task.await.unwrap());
        }
        let payments: Vec<Payment> = sent.iter().map(|s| s.payment.clone()).collect();

        // Every client has its answer and the survivor is idle: what the store holds now
        // is what the kill left, once what the dead process had already sent has landed
        // (PostgreSQL ends its sessions, finishing or rolling back; Redis has run every
        // command it received).
        match &space {
            Space::Postgres(p, _) => {
                eventually("the killed instance's sessions to end", PATIENCE, || {
                    let name = &names[victim];
                    async move { (p.sessions(name).await == 0).then_some(()) }
                })
                .await;
            }
            Space::Redis(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
        let at_kill = space.audit(&payments).await;

        servers[victim] = Some(space.start(&names[victim]));
        let apis = [
            Api::new(servers[0].as_ref().unwrap()),
            Api::new(servers[1].as_ref().unwrap()),
        ];
        let (finals, sends) = resolve_all(&apis, &payments, 8, PATIENCE).await;
        counts.resend_sends += sends;
        let audits = space.audit(&payments).await;
        let mut tally = Tally::default();
        for (((s, last), audit), before) in sent.iter().zip(&finals).zip(&audits).zip(&at_kill) {
            let earlier: Vec<&Answer> = s
                .answers
                .iter()
                .filter(|a| a.status == StatusCode::CREATED)
                .collect();
            tally.add(&earlier, last, audit);
            let k = slot(s.point);
            counts.interrupted[k] += u64::from(s.interrupted);
            match last {
                Final::OutcomeUnknown(_) => counts.unknown[k] += 1,
                Final::Created(a) if earlier.is_empty() && !a.replayed() => {
                    counts.ran_after[k] += 1;
                }
                Final::Created(_) => {}
            }
            let stage = expect_from_kill(mode, &s.payment.key, before, last, audit);
            if s.interrupted > 0 && earlier.is_empty() {
                counts.stage[stage] += 1;
            }
        }
        if let Err(e) = std::panic::catch_unwind(|| tally.assert_sound(mode.transactional())) {
            panic!("{test}, round {round} (victim {victim}): {e:?}; {tally:?}");
        }
        total.merge(&tally);
        for (s, last) in sent.into_iter().zip(finals) {
            let answer = match last {
                Final::Created(a) => Some(a),
                Final::OutcomeUnknown(_) => None,
            };
            everything.push((s.payment, answer));
        }
    }

    // Once more at the end, over every key of every round: nothing changed since.
    let payments: Vec<Payment> = everything.iter().map(|(p, _)| p.clone()).collect();
    let audits = space.audit(&payments).await;
    let mut again = Tally::default();
    for ((_, answer), audit) in everything.iter().zip(&audits) {
        let last = match answer {
            Some(a) => Final::Created(Answer {
                status: a.status,
                headers: a.headers.clone(),
                body: a.body.clone(),
            }),
            None => Final::OutcomeUnknown(Answer {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                headers: http::HeaderMap::new(),
                body: bytes::Bytes::new(),
            }),
        };
        again.add(&[], &last, audit);
    }
    again.assert_sound(mode.transactional());
    assert_eq!(again.effects, total.effects, "{again:?} / {total:?}");
    if let Space::Postgres(p, false) = &space {
        // No key row without its payment, no payment without its key row.
        let (rows, in_progress, paid) = p.table_counts().await;
        assert_eq!(in_progress, 0);
        assert_eq!(u64::try_from(rows).unwrap(), total.keys, "{total:?}");
        assert_eq!(u64::try_from(paid).unwrap(), total.keys, "{total:?}");
    }
    assert!(
        counts.interrupted.iter().sum::<u64>() > 0,
        "no kill interrupted a request: {counts:?}"
    );
    let stages: Vec<String> = STAGES
        .iter()
        .zip(counts.stage)
        .map(|(stage, n)| format!("{n} {stage}"))
        .collect();
    println!(
        "{test}: requests killed, by what the store held after the kill: {}",
        stages.join("; ")
    );
    println!(
        "{test}: kills {kills}, {total}; sends interrupted by a kill: before the commit point {ib}, after the effect {ia}, \
         streams {is}; outcome_unknown by point {ub}/{ua}/{us}; ran only after the kill \
         {rb}/{ra}/{rs}; resends {resends}; {secs:.1} s",
        kills = counts.kills,
        ib = counts.interrupted[0],
        ia = counts.interrupted[1],
        is = counts.interrupted[2],
        ub = counts.unknown[0],
        ua = counts.unknown[1],
        us = counts.unknown[2],
        rb = counts.ran_after[0],
        ra = counts.ran_after[1],
        rs = counts.ran_after[2],
        resends = counts.resend_sends,
        secs = started.elapsed().as_secs_f64(),
    );
}

#[test]
fn the_plain_postgres_hook_takes_two_values_only() {
    let url = database_url();
    let (status, stderr) = run_to_exit(
        &["--listen", "127.0.0.1:0", "--store", url.as_str()],
        &[("PAYMENTS_PG_MODE", "autocommit")],
    );
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("PAYMENTS_PG_MODE must be `transactional` or `plain`"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sigkill_at_random_points_never_runs_twice() {
    crash_and_restart(Mode::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tx_sigkill_at_random_points_is_exactly_once() {
    crash_and_restart(Mode::PostgresTx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_plain_sigkill_at_random_points_never_runs_twice() {
    crash_and_restart(Mode::PostgresPlain).await;
}
