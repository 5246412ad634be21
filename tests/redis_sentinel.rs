//! The `payments` example on Redis as users run it without a cluster, driven as real
//! processes: `--store redis+sentinel://…` on a private primary with two replicas and
//! three sentinels ([`LocalSentinel`], loopback ports), a `redis://` replica refused at
//! start, and `--replicated-writes`.
//!
//! The failover run: two instances on the service, keyed payments sent to them by
//! concurrent clients; the replicas are held behind (SIGSTOP) for a moment under load,
//! the primary is killed (SIGKILL) and the replicas resumed, so the replica the
//! sentinels promote lacks every write of that moment, as an asynchronous replica that
//! fell behind would. Both instances must answer again with no restart. Then every
//! payment that was answered 201 is sent again to the other instance, as a client whose
//! reply was lost would, and the ledger on the promoted node is read: no key may have
//! two payments, and no replayed 201 may name a payment the ledger lacks. What
//! asynchronous replication lost is counted: the acknowledged payments whose copy ran
//! again (a fresh 201). With `--replicated-writes 1:200` a write the replicas did not
//! acknowledge is refused or reported, so a copy may run again only after a completion
//! the instance reported lost (`completion_lost`). One JSON line per run
//! (`--nocapture`).
//!
//! `SENTINEL_FAILOVERS` (failovers per run, default 1), `SENTINEL_HOLD_MS` (how long
//! the replicas are held behind, default 500; 0 kills the primary alone),
//! `SENTINEL_CONCURRENCY` (clients, default 16), `SENTINEL_RUNS` (`both`, the
//! default; `default` or `replicated` for one of the two runs).
// Real processes on the wall clock: std's clock and sleeps on purpose.
#![allow(
    clippy::disallowed_methods,
    clippy::unwrap_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::indexing_slicing,
    missing_docs
)]

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::StatusCode;
use retrysafe_core::idempotency::Token;
use retrysafe_redis::redis;
use retrysafe_test_support::payments::{Answer, Api, Server, run_to_exit};
use retrysafe_test_support::redis_nodes::LocalSentinel;
use retrysafe_test_support::rng::env_number;

/// How long a logical payment keeps trying (409, 503, a lost connection) for a final
/// answer, and how long an instance may take to answer again after a failover.
const PATIENCE: Duration = Duration::from_secs(60);

/// The `--store` URL of the setup's service.
fn store_url(setup: &LocalSentinel) -> String {
    let hosts: Vec<String> = setup
        .sentinel_ports()
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    format!("redis+sentinel://{}/{}", hosts.join(","), setup.service())
}

/// A key prefix no other run uses.
fn fresh_prefix() -> String {
    format!("payments-sentinel:{}:", &Token::random().to_hex()[..12])
}

#[test]
fn replicated_writes_is_strict_and_for_redis_stores_only() {
    for bad in [
        "0:500", "1:0", "1", "1:", ":500", "1:abc", "+1:500", "1:+500", "-1:500", "1:500:2",
        " 1:500", "1.5:500", "",
    ] {
        let args = [
            "--store",
            "redis://127.0.0.1:6379",
            "--replicated-writes",
            bad,
        ];
        let (status, stderr) = run_to_exit(&args, &[]);
        assert_eq!(status.code(), Some(2), "{bad:?}: {stderr}");
        assert!(
            stderr.contains("--replicated-writes must be N:MS"),
            "{bad:?}: {stderr}"
        );
        assert!(stderr.contains("usage:"), "{bad:?}: {stderr}");
    }
    for store in ["memory", "postgres://postgres@127.0.0.1:5432/test"] {
        let (status, stderr) =
            run_to_exit(&["--store", store, "--replicated-writes", "1:500"], &[]);
        assert_eq!(status.code(), Some(2), "{store}: {stderr}");
        assert!(
            stderr.contains("--replicated-writes is for Redis stores"),
            "{store}: {stderr}"
        );
    }
    // Without --store the store is memory.
    let (status, stderr) = run_to_exit(&["--replicated-writes", "1:500"], &[]);
    assert_eq!(status.code(), Some(2), "{stderr}");
}

#[test]
fn sentinel_urls_are_parsed_strictly() {
    for (url, why) in [
        ("redis+sentinel://", "no /SERVICE"),
        ("redis+sentinel://127.0.0.1:26379", "no /SERVICE"),
        ("redis+sentinel://127.0.0.1:26379/", "service name"),
        ("redis+sentinel://127.0.0.1:26379/a/b", "service name"),
        ("redis+sentinel://127.0.0.1/payments", "is not HOST:PORT"),
        ("redis+sentinel://127.0.0.1:x/payments", "is not HOST:PORT"),
        ("redis+sentinel://127.0.0.1:0/payments", "is not HOST:PORT"),
        ("redis+sentinel://a:1,,b:2/payments", "is not HOST:PORT"),
        ("redis+sentinel://user:pw@a:1/payments", "credentials"),
    ] {
        let (status, stderr) = run_to_exit(&["--store", url], &[]);
        assert_eq!(status.code(), Some(2), "{url}: {stderr}");
        assert!(stderr.contains(why), "{url}: {stderr}");
        assert!(
            stderr.contains("redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE"),
            "{url}: {stderr}"
        );
    }
    let (status, stdout) = help();
    assert!(status.success());
    assert!(stdout.contains("redis+sentinel://"), "{stdout}");
    assert!(stdout.contains("--replicated-writes N:MS"), "{stdout}");
}

fn help() -> (std::process::ExitStatus, String) {
    let out = std::process::Command::new(retrysafe_test_support::payments::binary())
        .arg("--help")
        .output()
        .unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// The shared setup, for the tests that only use it.
async fn shared() -> &'static LocalSentinel {
    tokio::task::spawn_blocking(LocalSentinel::shared)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_replica_is_refused_at_start() {
    let setup = shared().await;
    let replica = setup.replicas()[0];
    let primary = setup.primary().unwrap();
    let url = format!("redis://127.0.0.1:{replica}");
    let (status, stderr) = run_to_exit(&["--store", &url], &[]);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("read-only replica"), "{stderr}");
    assert!(stderr.contains(&format!("127.0.0.1:{primary}")), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_writes_reach_the_store() {
    let setup = shared().await;
    let prefix = fresh_prefix();
    let env = [("PAYMENTS_REDIS_PREFIX", prefix.as_str())];
    let url = store_url(setup);
    // Two replicas: waiting for both is answered; for three, nothing is. The wait for
    // two is the longest the store's 1 s call timeout allows, room for running
    // loopback replicas on a loaded machine (it ends as soon as both acknowledge);
    // only the wait for three runs out.
    let two = Server::start_with(&["--store", &url, "--replicated-writes", "2:1000"], &env);
    let answer = Api::new(&two).pay("rw-2", "acct-rw", 100, &[]).await;
    answer.assert_created("acct-rw", 100);
    let three = Server::start_with(&["--store", &url, "--replicated-writes", "3:200"], &env);
    let answer = Api::new(&three).pay("rw-3", "acct-rw", 100, &[]).await;
    answer.assert_unavailable();
    assert_eq!(Api::new(&two).totals("acct-rw").await, (1, 100));
}

/// One acknowledged payment: its key, account and the payment id of the 201.
#[derive(Debug, Clone)]
struct Acknowledged {
    key: String,
    account: String,
    id: String,
    /// The instance that answered it (the copy goes to the other).
    instance: usize,
}

/// What the clients saw during the load.
#[derive(Debug, Default)]
struct Load {
    logical: AtomicU64,
    unavailable_answers: AtomicU64,
    transport_errors: AtomicU64,
    other_final: AtomicU64,
    given_up: AtomicU64,
    acknowledged: Mutex<Vec<Acknowledged>>,
}

/// Sends `key` to `api` until a final answer (not 409 or 503, not a transport error),
/// for at most [`PATIENCE`].
async fn final_answer(api: &Api, key: &str, account: &str, load: &Load) -> Option<Answer> {
    let started = Instant::now();
    while started.elapsed() < PATIENCE {
        match api.try_pay(key, account, 100, &[]).await {
            Ok(a) if a.status == StatusCode::SERVICE_UNAVAILABLE => {
                load.unavailable_answers.fetch_add(1, Ordering::Relaxed);
            }
            Ok(a) if a.status == StatusCode::CONFLICT => {}
            Ok(a) => return Some(a),
            Err(_) => {
                load.transport_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    None
}

/// One client: logical payments in turn to the two instances until `stop`.
async fn client(apis: [Api; 2], run: String, n: u64, stop: Arc<AtomicBool>, load: Arc<Load>) {
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let key = format!("{run}-{n}-{i}");
        let account = format!("acct-{key}");
        let instance = usize::from(i % 2 == 1);
        i += 1;
        load.logical.fetch_add(1, Ordering::Relaxed);
        match final_answer(&apis[instance], &key, &account, &load).await {
            Some(a) if a.status == StatusCode::CREATED => {
                let id = a.json()["id"].as_str().unwrap().to_owned();
                load.acknowledged.lock().unwrap().push(Acknowledged {
                    key,
                    account,
                    id,
                    instance,
                });
            }
            Some(_) => {
                load.other_final.fetch_add(1, Ordering::Relaxed);
            }
            None => {
                load.given_up.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Holds the replicas behind for `hold` (not when zero), kills the primary, resumes
/// the replicas, and waits for the promotion. Returns the old primary's port.
fn fail_over(setup: &mut LocalSentinel, hold: Duration) -> u16 {
    let old = setup.primary().unwrap();
    let mut replicas = Vec::new();
    if !hold.is_zero() {
        replicas = setup.hold_replicas_behind().unwrap();
        std::thread::sleep(hold);
    }
    setup.kill(old).unwrap();
    if !hold.is_zero() {
        for r in &replicas {
            setup.resume(*r).unwrap();
        }
    }
    setup.wait_promoted(old).unwrap();
    old
}

/// Sends a fresh payment to `server` until it is answered 201: the tries it took.
async fn answers_again(server: &Server, tag: &str) -> u64 {
    let api = Api::new(server);
    let started = Instant::now();
    let mut tries = 0;
    loop {
        tries += 1;
        let key = format!("again-{}", Token::random().to_hex());
        let answer = api.try_pay(&key, "acct-again", 1, &[]).await;
        if answer
            .as_ref()
            .is_ok_and(|a| a.status == StatusCode::CREATED)
        {
            return tries;
        }
        assert!(
            started.elapsed() < PATIENCE,
            "{tag} did not answer 201 again within {PATIENCE:?}; last {answer:?}; stderr:\n{}",
            server.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the copies of the acknowledged payments found, and the ledger.
#[derive(Debug, Default)]
struct Audit {
    replayed: u64,
    run_again: u64,
    outcome_unknown: u64,
    other: u64,
    keys_with_two_payments: u64,
    replayed_without_payment: u64,
}

/// Sends a copy of every acknowledged payment to the other instance, then reads the
/// ledger of every key on the promoted primary.
async fn audit(
    apis: &[Api; 2],
    acknowledged: &[Acknowledged],
    prefix: &str,
    primary: u16,
) -> Audit {
    use futures_util::StreamExt;
    let load = Load::default();
    // Many at once: a copy of a claim left in progress waits out its lease.
    let copies: Vec<Option<Answer>> = futures_util::stream::iter(acknowledged)
        .map(|p| final_answer(&apis[1 - p.instance], &p.key, &p.account, &load))
        .buffered(64)
        .collect()
        .await;
    let client = redis::Client::open(format!("redis://127.0.0.1:{primary}")).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut ledgers: Vec<BTreeSet<String>> = Vec::new();
    for chunk in acknowledged.chunks(500) {
        let mut pipe = redis::pipe();
        for p in chunk {
            pipe.cmd("HKEYS")
                .arg(format!("{prefix}{{ledger}}:account:{}", p.account));
        }
        let found: Vec<Vec<String>> = pipe.query_async(&mut conn).await.unwrap();
        ledgers.extend(found.into_iter().map(|ids| ids.into_iter().collect()));
    }
    let mut audit = Audit::default();
    for ((p, copy), ledger) in acknowledged.iter().zip(copies).zip(ledgers) {
        if ledger.len() >= 2 {
            audit.keys_with_two_payments += 1;
        }
        let Some(copy) = copy else {
            audit.other += 1;
            continue;
        };
        match copy.status {
            StatusCode::CREATED => {
                let id = copy.json()["id"].as_str().unwrap().to_owned();
                if !ledger.contains(&id) {
                    audit.replayed_without_payment += 1;
                }
                if copy.replayed() && id == p.id {
                    audit.replayed += 1;
                } else {
                    audit.run_again += 1;
                }
            }
            StatusCode::INTERNAL_SERVER_ERROR => audit.outcome_unknown += 1,
            _ => audit.other += 1,
        }
    }
    audit
}

/// One run: two instances (with `--replicated-writes 1:200` when `replicated`), load,
/// `failovers` failovers, then the copies and the ledger. Returns the setup.
async fn run(setup: LocalSentinel, replicated: bool) -> LocalSentinel {
    let failovers = env_number("SENTINEL_FAILOVERS", 1);
    let hold = Duration::from_millis(env_number("SENTINEL_HOLD_MS", 500));
    let concurrency = env_number("SENTINEL_CONCURRENCY", 16);
    let prefix = fresh_prefix();
    let env = [("PAYMENTS_REDIS_PREFIX", prefix.as_str())];
    let url = store_url(&setup);
    // Short leases and executions: the keys left pending by the failover are resolved
    // (from the ledger, by the reconciler) within seconds.
    let mut args = vec!["--store", url.as_str(), "--lease-ms", "2000"];
    args.extend(["--max-execution-ms", "4000", "--reconcile-ms", "500"]);
    if replicated {
        args.extend(["--replicated-writes", "1:200"]);
    }
    let mut servers = [
        Server::start_with(&args, &env),
        Server::start_with(&args, &env),
    ];
    let pids = [servers[0].pid(), servers[1].pid()];
    let apis = [Api::new(&servers[0]), Api::new(&servers[1])];
    let load = Arc::new(Load::default());
    let mut setup = setup;
    let mut tries_to_answer = Vec::new();
    for f in 0..failovers {
        let stop = Arc::new(AtomicBool::new(false));
        let run = format!("{}-{f}", &Token::random().to_hex()[..8]);
        let clients: Vec<_> = (0..concurrency)
            .map(|n| {
                let (apis, stop, load) = (apis.clone(), Arc::clone(&stop), Arc::clone(&load));
                tokio::spawn(client(apis, run.clone(), n, stop, load))
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let (back, old) = tokio::task::spawn_blocking(move || {
            let old = fail_over(&mut setup, hold);
            (setup, old)
        })
        .await
        .unwrap();
        setup = back;
        // The same processes answer again, through the promoted primary.
        for (i, server) in servers.iter().enumerate() {
            tries_to_answer.push(answers_again(server, &format!("instance {i}")).await);
        }
        stop.store(true, Ordering::Relaxed);
        for c in clients {
            tokio::time::timeout(PATIENCE * 2, c)
                .await
                .unwrap()
                .unwrap();
        }
        setup = tokio::task::spawn_blocking(move || {
            setup.restart(old).unwrap();
            setup
        })
        .await
        .unwrap();
    }
    for (server, pid) in servers.iter_mut().zip(pids) {
        assert!(server.is_running(), "an instance exited");
        assert_eq!(server.pid(), pid);
    }
    let acknowledged = load.acknowledged.lock().unwrap().clone();
    let audit = audit(&apis, &acknowledged, &prefix, setup.primary().unwrap()).await;
    let completions_lost: usize = servers
        .iter()
        .map(|s| s.stderr().matches("completion_lost").count())
        .sum();
    let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
    println!(
        "{{\"replicated_writes\": {replicated}, \"failovers\": {failovers}, \
         \"hold_ms\": {}, \"logical\": {}, \"acknowledged\": {}, \"unavailable_answers\": {}, \
         \"transport_errors\": {}, \"given_up\": {}, \"copies_replayed\": {}, \
         \"copies_run_again\": {}, \"copies_outcome_unknown\": {}, \"copies_other\": {}, \
         \"keys_with_two_payments\": {}, \"replayed_without_payment\": {}, \
         \"completions_lost\": {completions_lost}, \"tries_to_answer_again\": {tries_to_answer:?}}}",
        hold.as_millis(),
        g(&load.logical),
        acknowledged.len(),
        g(&load.unavailable_answers),
        g(&load.transport_errors),
        g(&load.given_up),
        audit.replayed,
        audit.run_again,
        audit.outcome_unknown,
        audit.other,
        audit.keys_with_two_payments,
        audit.replayed_without_payment,
    );
    assert!(!acknowledged.is_empty(), "the load went through");
    assert_eq!(audit.keys_with_two_payments, 0, "keys with two payments");
    assert_eq!(
        audit.replayed_without_payment, 0,
        "replays of lost payments"
    );
    if replicated {
        assert!(
            audit.run_again <= u64::try_from(completions_lost).unwrap(),
            "with --replicated-writes a copy runs again only after a completion reported lost"
        );
    }
    setup
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_follow_a_sentinel_failover_without_a_restart() {
    let runs = std::env::var("SENTINEL_RUNS").unwrap_or_else(|_| "both".to_owned());
    assert!(
        ["both", "default", "replicated"].contains(&runs.as_str()),
        "SENTINEL_RUNS={runs}: expected both, default or replicated"
    );
    let mut setup = tokio::task::spawn_blocking(|| LocalSentinel::start().unwrap())
        .await
        .unwrap();
    if runs != "replicated" {
        setup = run(setup, false).await;
    }
    if runs != "default" {
        run(setup, true).await;
    }
}
