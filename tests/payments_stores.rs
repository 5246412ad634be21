//! The `payments` example on Redis, on a Redis Cluster (a local one of 3 primaries and 3
//! replicas, made by the test) and on PostgreSQL, driven as real processes: several
//! instances on one store behaving as one, instances killed with SIGKILL before and
//! after their effect, a stale holder's late completion, and the store taken away
//! mid-run (through a TCP proxy that the test cuts and restores).
//!
//! Every test reads what the example wrote directly in the backend (the Redis ledger
//! and records, the PostgreSQL tables and locks), in a key prefix or a schema of its
//! own. The servers are the real ones at `REDIS_URL` and `DATABASE_URL`; a test fails,
//! never skips, when one cannot be reached.
// This test drives real child processes on the wall clock, so it uses std's clock and
// sleeps on purpose.
#![allow(
    clippy::disallowed_methods,
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use std::time::Duration;

use http::StatusCode;
use retrysafe_core::idempotency::{CommitPoint, Completed, Fingerprinter, Record, Token};
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, StoreError};
use retrysafe_postgres::PostgresStore;
use retrysafe_redis::redis::{self, cluster_async::ClusterConnection};
use retrysafe_test_support::eventually;
use retrysafe_test_support::payments::{
    Answer, Api, PgSpace, RedisSpace, Server, pay_split, record_id,
};
use retrysafe_test_support::redis_nodes::LocalCluster;
use retrysafe_test_support::services::{database_url, host_port, proxy_to, redis_url, with_addr};
use serde_json::json;

/// How long a test waits for something that must happen (a lease to expire, a killed
/// session to end, a store to come back). Generous: the machine is noisy.
const PATIENCE: Duration = Duration::from_secs(30);

/// Which backend a shared test body runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Redis,
    /// The local Redis Cluster of 3 primaries and 3 replicas ([`LocalCluster::shared`]):
    /// the example is given one node's URL and finds the cluster.
    RedisCluster,
    Postgres,
}

/// One test's namespace on one backend.
enum Space {
    Redis(RedisSpace),
    RedisCluster(RedisSpace<ClusterConnection>),
    Postgres(PgSpace),
}

impl Space {
    async fn new(kind: Kind) -> Space {
        match kind {
            Kind::Redis => Space::Redis(RedisSpace::new().await),
            Kind::RedisCluster => Space::RedisCluster(cluster_space().await),
            Kind::Postgres => Space::Postgres(PgSpace::new().await),
        }
    }

    /// The `--store` URL of an instance called `name` (PostgreSQL sessions carry it as
    /// their `application_name`).
    fn url(&self, name: &str) -> String {
        match self {
            Space::Redis(_) => redis_url(),
            Space::RedisCluster(r) => r.url.clone(),
            Space::Postgres(_) => PgSpace::url_named(name),
        }
    }

    fn env(&self) -> [(&str, &str); 1] {
        match self {
            Space::Redis(r) => r.env(),
            Space::RedisCluster(r) => r.env(),
            Space::Postgres(p) => p.env(),
        }
    }

    /// Starts an instance called `name` on this space.
    fn start(&self, name: &str, args: &[&str]) -> Server {
        let url = self.url(name);
        let mut all = vec!["--store", url.as_str()];
        all.extend_from_slice(args);
        Server::start_with(&all, &self.env())
    }

    /// The amounts of `account`'s payments in the backend, read directly.
    async fn amounts(&self, account: &str) -> Vec<i64> {
        match self {
            Space::Redis(r) => r.amounts(account).await,
            Space::RedisCluster(r) => r.ledger_amounts(account).await,
            Space::Postgres(p) => p.amounts(account).await,
        }
    }
}

/// The amounts of an account's payments in the example's Redis ledger, read directly.
trait LedgerAmounts {
    async fn ledger_amounts(&self, account: &str) -> Vec<i64>;
}

impl LedgerAmounts for RedisSpace {
    async fn ledger_amounts(&self, account: &str) -> Vec<i64> {
        self.amounts(account).await
    }
}

impl LedgerAmounts for RedisSpace<ClusterConnection> {
    async fn ledger_amounts(&self, account: &str) -> Vec<i64> {
        cluster_amounts(self, account).await
    }
}

/// The amounts of `account`'s payments on the cluster. The example keeps each payment
/// in the hash slot of its idempotency record, under the short tag of that slot
/// (`{prefix}{<tag>}:account:<account>`): read the hash of every slot, one pipeline per
/// range of slots a primary holds.
async fn cluster_amounts(space: &RedisSpace<ClusterConnection>, account: &str) -> Vec<i64> {
    use retrysafe_redis::redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
    use retrysafe_redis::slots::tag_of_slot;
    let mut conn = space.conn.clone();
    let ranges: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut amounts = Vec::new();
    for range in ranges {
        let first: u16 = redis::from_redis_value(range[0].clone()).unwrap();
        let last: u16 = redis::from_redis_value(range[1].clone()).unwrap();
        let mut pipe = redis::pipe();
        for slot in first..=last {
            let tag = tag_of_slot(slot);
            pipe.cmd("HVALS")
                .arg(format!("{}{{{tag}}}:account:{account}", space.prefix));
        }
        let route = SingleNodeRoutingInfo::SpecificNode(Route::new(first, SlotAddr::Master));
        let count = usize::from(last - first) + 1;
        let replies = conn.route_pipeline(pipe, 0, count, route).await.unwrap();
        for reply in replies {
            let found: Vec<i64> = redis::from_redis_value(reply).unwrap();
            amounts.extend(found);
        }
    }
    amounts
}

/// A key prefix of one test on the shared local Redis Cluster.
async fn cluster_space() -> RedisSpace<ClusterConnection> {
    let cluster = tokio::task::spawn_blocking(LocalCluster::shared)
        .await
        .unwrap();
    RedisSpace::cluster(&cluster.urls()).await
}

/// A fresh instance name (an `application_name`, also a prefix of nothing else).
fn name(role: &str) -> String {
    format!("payments-test-{role}-{}", &Token::random().to_hex()[..8])
}

/// Sends `key` to `api` until the answer is not `retry_on` (statuses a client retries:
/// 409 in flight, 503 unavailable), pausing briefly; the first other answer.
async fn pay_until_not(
    api: &Api,
    retry_on: &[u16],
    key: &str,
    account: &str,
    amount: i64,
) -> Answer {
    eventually(
        &format!("an answer to {key} other than {retry_on:?}"),
        PATIENCE,
        || async {
            let answer = api.pay(key, account, amount, &[]).await;
            if retry_on.contains(&answer.status.as_u16()) {
                // Every answer a client is told to retry says when.
                answer.assert_problem(answer.status.as_u16());
                assert!(answer.headers.contains_key("retry-after"), "{answer:?}");
                None
            } else {
                Some(answer)
            }
        },
    )
    .await
}

/// `copies` answers to one request, split over two instances: exactly one ran, every
/// other one is its replay or a 409 in flight (with `retry-after`). Returns the answer
/// that ran.
fn exactly_one_ran<'a>(answers: &'a [Answer], account: &str, amount: i64) -> &'a Answer {
    let ran: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED && !a.replayed())
        .collect();
    assert_eq!(ran.len(), 1, "exactly one copy runs: {answers:?}");
    let first = ran[0];
    first.assert_created(account, amount);
    for a in answers {
        if a.status == StatusCode::CREATED {
            assert_eq!(a.body, first.body, "every 201 is the same answer: {a:?}");
        } else {
            a.assert_problem_type(409, "request-in-flight");
            assert!(a.headers.contains_key("retry-after"), "{a:?}");
        }
    }
    first
}

// ---------------------------------------------------------------------------------
// Several instances on one store behave as one

async fn two_instances_behave_as_one(kind: Kind) {
    let space = Space::new(kind).await;
    let a = space.start(&name("a"), &[]);
    let b = space.start(&name("b"), &[]);
    let (api_a, api_b) = (Api::new(&a), Api::new(&b));

    // One after another, on either instance.
    let first = api_a.pay("seq-1", "acct-seq", 1250, &[]).await;
    first.assert_created("acct-seq", 1250);
    assert!(!first.replayed(), "{first:?}");
    let copy = api_b.pay("seq-1", "acct-seq", 1250, &[]).await;
    assert!(copy.replayed(), "B replays what A ran: {copy:?}");
    assert_eq!(copy.body, first.body);
    let changed = api_b.pay("seq-1", "acct-seq", 9999, &[]).await;
    changed.assert_problem_type(422, "key-mismatch");
    assert_eq!(changed.headers["do-not-retry"], "1");
    assert_eq!(space.amounts("acct-seq").await, vec![1250]);
    assert_eq!(api_a.totals("acct-seq").await, (1, 1250));
    assert_eq!(api_b.totals("acct-seq").await, (1, 1250));

    // A failure without an effect on A (released, or rolled back): B's retry runs once.
    let failed = api_a
        .pay("fail-1", "acct-fail", 4200, &[("x-simulate-fail", "500")])
        .await;
    failed.assert_problem_type(500, "simulated-failure");
    assert!(space.amounts("acct-fail").await.is_empty());
    let retry = api_b.pay("fail-1", "acct-fail", 4200, &[]).await;
    retry.assert_created("acct-fail", 4200);
    assert!(!retry.replayed(), "{retry:?}");
    assert!(api_a.pay("fail-1", "acct-fail", 4200, &[]).await.replayed());
    assert_eq!(space.amounts("acct-fail").await, vec![4200]);

    // Twenty copies at once, half on each instance.
    let answers = pay_split(
        &[api_a.clone(), api_b.clone()],
        20,
        "split-1",
        "acct-split",
        990,
        "1000",
    )
    .await;
    let ran = exactly_one_ran(&answers, "acct-split", 990);
    assert_eq!(space.amounts("acct-split").await, vec![990]);
    for api in [&api_a, &api_b] {
        let later = api.pay("split-1", "acct-split", 990, &[]).await;
        assert!(later.replayed(), "{later:?}");
        assert_eq!(later.body, ran.body);
        assert_eq!(api.totals("acct-split").await, (1, 990));
    }
    assert_eq!(space.amounts("acct-split").await, vec![990]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_two_instances_behave_as_one() {
    two_instances_behave_as_one(Kind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_two_instances_behave_as_one() {
    two_instances_behave_as_one(Kind::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_two_instances_behave_as_one() {
    two_instances_behave_as_one(Kind::RedisCluster).await;
}

/// On a cluster a payment is kept in the hash slot of its idempotency record, so a
/// failover of one node loses both or neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_a_payment_lives_in_the_slot_of_its_record() {
    use retrysafe_redis::slots::{slot_of_record, tag_of_slot};
    let space = cluster_space().await;
    let server = Server::start_with(&["--store", space.url.as_str()], &space.env());
    let api = Api::new(&server);
    let mut conn = space.conn.clone();
    for n in 0..8 {
        let key = format!("slot-{n}");
        api.pay(&key, "acct-slot", 10, &[])
            .await
            .assert_created("acct-slot", 10);
        let id = record_id(&key);
        let slot = slot_of_record(&id);
        let record_slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(space.store.key(&id))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(record_slot, slot);
        let payment = format!(
            "{}{{{}}}:account:acct-slot",
            space.prefix,
            tag_of_slot(slot)
        );
        let amounts: Vec<i64> = redis::cmd("HVALS")
            .arg(&payment)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(
            amounts.contains(&10),
            "{payment} holds the payment of {key}"
        );
    }
    assert_eq!(space.ledger_amounts("acct-slot").await.len(), 8);
}

async fn waiting_copies_get_the_answer_across_instances(kind: Kind) {
    let space = Space::new(kind).await;
    let a = space.start(&name("a"), &["--in-flight", "wait"]);
    let b = space.start(&name("b"), &["--in-flight", "wait"]);
    let apis = [Api::new(&a), Api::new(&b)];

    let answers = pay_split(&apis, 20, "wait-1", "acct-wait", 300, "800").await;
    for answer in &answers {
        answer.assert_created("acct-wait", 300);
        assert_eq!(
            answer.body, answers[0].body,
            "every copy gets the same answer"
        );
    }
    assert_eq!(
        answers.iter().filter(|a| !a.replayed()).count(),
        1,
        "{answers:?}"
    );
    assert_eq!(space.amounts("acct-wait").await, vec![300]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_waiting_copies_get_the_answer_across_instances() {
    waiting_copies_get_the_answer_across_instances(Kind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_waiting_copies_get_the_answer_across_instances() {
    waiting_copies_get_the_answer_across_instances(Kind::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_waiting_copies_get_the_answer_across_instances() {
    waiting_copies_get_the_answer_across_instances(Kind::RedisCluster).await;
}

async fn a_key_is_new_again_after_the_ttl(kind: Kind) {
    let space = Space::new(kind).await;
    let server = space.start(&name("ttl"), &["--ttl-ms", "1000"]);
    let api = Api::new(&server);

    let first = api.pay("ttl-1", "acct-ttl", 50, &[]).await;
    let first_id = first.assert_created("acct-ttl", 50);
    assert!(api.pay("ttl-1", "acct-ttl", 50, &[]).await.replayed());

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let later = api.pay("ttl-1", "acct-ttl", 50, &[]).await;
    let later_id = later.assert_created("acct-ttl", 50);
    assert!(!later.replayed(), "{later:?}");
    assert_ne!(first_id, later_id);
    assert_eq!(space.amounts("acct-ttl").await, vec![50, 50]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_key_is_new_again_after_the_ttl() {
    a_key_is_new_again_after_the_ttl(Kind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_key_is_new_again_after_the_ttl() {
    a_key_is_new_again_after_the_ttl(Kind::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_a_key_is_new_again_after_the_ttl() {
    a_key_is_new_again_after_the_ttl(Kind::RedisCluster).await;
}

// ---------------------------------------------------------------------------------
// An instance killed (SIGKILL) mid-handler, before its commit point

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_before_the_commit_point_runs_once_after_the_lease() {
    killed_before_the_commit_point_runs_once_after_the_lease(RedisSpace::new().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_killed_before_the_commit_point_runs_once_after_the_lease() {
    killed_before_the_commit_point_runs_once_after_the_lease(cluster_space().await).await;
}

async fn killed_before_the_commit_point_runs_once_after_the_lease<C>(space: RedisSpace<C>)
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
    RedisSpace<C>: LedgerAmounts,
{
    let url = space.url.clone();
    let args = ["--store", url.as_str(), "--lease-ms", "500"];
    let a = Server::start_with(&args, &space.env());
    let b = Server::start_with(&args, &space.env());
    let (api_a, api_b) = (Api::new(&a), Api::new(&b));

    let original = {
        let api = api_a.clone();
        tokio::spawn(async move {
            api.try_pay(
                "kill-1",
                "acct-kill",
                700,
                &[("x-simulate-delay-ms", "30000")],
            )
            .await
        })
    };
    // A holds the claim and has not reached its commit point.
    let record = eventually("A's claim", PATIENCE, || async {
        space.record("kill-1").await
    })
    .await;
    let Record::InProgress(claim) = record else {
        panic!("expected A's claim, found {record:?}");
    };
    assert_eq!(claim.commit_point, CommitPoint::Before);

    a.kill();
    assert!(original.await.unwrap().is_err(), "A died before answering");
    assert!(space.ledger_amounts("acct-kill").await.is_empty());

    // B answers 409 while A's lease lasts, then takes over and runs once.
    let ran = pay_until_not(&api_b, &[409], "kill-1", "acct-kill", 700).await;
    ran.assert_created("acct-kill", 700);
    assert!(!ran.replayed(), "{ran:?}");
    assert_eq!(space.ledger_amounts("acct-kill").await, vec![700]);
    assert!(
        matches!(space.record("kill-1").await, Some(Record::Completed(_))),
        "the takeover completed the record"
    );
    let again = api_b.pay("kill-1", "acct-kill", 700, &[]).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, ran.body);
    assert_eq!(space.ledger_amounts("acct-kill").await, vec![700]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_killed_before_the_commit_point_runs_once_at_once() {
    let space = PgSpace::new().await;
    let (name_a, name_b) = (name("a"), name("b"));
    let (url_a, url_b) = (PgSpace::url_named(&name_a), PgSpace::url_named(&name_b));
    let a = Server::start_with(&["--store", url_a.as_str()], &space.env());
    let b = Server::start_with(&["--store", url_b.as_str()], &space.env());
    let api_b = Api::new(&b);

    let original = {
        let api = Api::new(&a);
        tokio::spawn(async move {
            api.try_pay(
                "kill-1",
                "acct-kill",
                700,
                &[("x-simulate-delay-ms", "30000")],
            )
            .await
        })
    };
    // A's transaction holds the key.
    eventually("A's key lock", PATIENCE, || async {
        space.holds_key_lock(&name_a).await.then_some(())
    })
    .await;
    a.kill();
    assert!(original.await.unwrap().is_err(), "A died before answering");
    // The server ends the dead client's sessions, rolling back its transaction.
    eventually("A's sessions to end", PATIENCE, || async {
        (space.sessions(&name_a).await == 0).then_some(())
    })
    .await;
    assert!(space.amounts("acct-kill").await.is_empty());
    assert!(
        !space.key_row_exists("kill-1").await,
        "no key row survives a crash"
    );

    // No lease to wait for: the very next copy runs.
    let ran = api_b.pay("kill-1", "acct-kill", 700, &[]).await;
    ran.assert_created("acct-kill", 700);
    assert!(!ran.replayed(), "{ran:?}");
    assert_eq!(space.amounts("acct-kill").await, vec![700]);
    assert!(space.key_row_exists("kill-1").await);
    let again = api_b.pay("kill-1", "acct-kill", 700, &[]).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, ran.body);
    assert_eq!(space.amounts("acct-kill").await.len(), 1);
}

// ---------------------------------------------------------------------------------
// An instance killed (SIGKILL) after its effect, before its answer was stored, with no
// reconciler running (`--reconcile-ms 0`): what the store alone guarantees. With the
// reconciler (the example's default) the key is resolved instead: see
// tests/payments_recovery.rs.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_after_the_effect_is_outcome_unknown_never_twice() {
    killed_after_the_effect_is_outcome_unknown_never_twice(RedisSpace::new().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_killed_after_the_effect_is_outcome_unknown_never_twice() {
    killed_after_the_effect_is_outcome_unknown_never_twice(cluster_space().await).await;
}

async fn killed_after_the_effect_is_outcome_unknown_never_twice<C>(space: RedisSpace<C>)
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
    RedisSpace<C>: LedgerAmounts,
{
    let url = space.url.clone();
    let args = [
        "--store",
        url.as_str(),
        "--lease-ms",
        "500",
        "--reconcile-ms",
        "0",
    ];
    let a = Server::start_with(&args, &space.env());
    let b = Server::start_with(&args, &space.env());
    let api_b = Api::new(&b);

    let original = {
        let api = Api::new(&a);
        tokio::spawn(async move {
            api.try_pay(
                "after-1",
                "acct-after",
                800,
                &[("x-simulate-delay-after-ms", "30000")],
            )
            .await
        })
    };
    // The payment is in the ledger, the claim past its commit point, no answer stored.
    eventually("A's payment", PATIENCE, || async {
        (!space.ledger_amounts("acct-after").await.is_empty()).then_some(())
    })
    .await;
    let record = space.record("after-1").await;
    let Some(Record::InProgress(claim)) = record else {
        panic!("expected A's claim, found {record:?}");
    };
    assert_eq!(claim.commit_point, CommitPoint::Passed);

    a.kill();
    assert!(original.await.unwrap().is_err(), "A died before answering");

    // Once A's lease has expired, the record is outcome_unknown: a stable 500 problem,
    // marked do-not-retry, and the payment is never made a second time.
    for _ in 0..2 {
        let unknown = pay_until_not(&api_b, &[409], "after-1", "acct-after", 800).await;
        unknown.assert_problem_type(500, "outcome-unknown");
        assert_eq!(unknown.headers["do-not-retry"], "1", "{unknown:?}");
    }
    assert!(
        matches!(
            space.record("after-1").await,
            Some(Record::OutcomeUnknown(_))
        ),
        "the expired lease past the commit point became outcome_unknown"
    );
    assert_eq!(space.ledger_amounts("acct-after").await, vec![800]);
    assert_eq!(api_b.totals("acct-after").await, (1, 800));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_killed_after_the_effect_commits_neither_then_runs_once() {
    let space = PgSpace::new().await;
    let (name_a, name_b) = (name("a"), name("b"));
    let (url_a, url_b) = (PgSpace::url_named(&name_a), PgSpace::url_named(&name_b));
    let a = Server::start_with(&["--store", url_a.as_str()], &space.env());
    let b = Server::start_with(&["--store", url_b.as_str()], &space.env());
    let api_b = Api::new(&b);

    let original = {
        let api = Api::new(&a);
        tokio::spawn(async move {
            api.try_pay(
                "after-1",
                "acct-after",
                800,
                &[("x-simulate-delay-after-ms", "30000")],
            )
            .await
        })
    };
    // A has inserted the payment in its open transaction: done, not committed.
    eventually("A's uncommitted insert", PATIENCE, || async {
        space.uncommitted_insert(&name_a).await.then_some(())
    })
    .await;
    assert!(
        space.amounts("acct-after").await.is_empty(),
        "not visible uncommitted"
    );

    a.kill();
    assert!(original.await.unwrap().is_err(), "A died before answering");
    eventually("A's sessions to end", PATIENCE, || async {
        (space.sessions(&name_a).await == 0).then_some(())
    })
    .await;
    // Neither the payment nor the key committed.
    assert!(space.amounts("acct-after").await.is_empty());
    assert!(!space.key_row_exists("after-1").await);

    // The retry runs, once.
    let ran = api_b.pay("after-1", "acct-after", 800, &[]).await;
    ran.assert_created("acct-after", 800);
    assert!(!ran.replayed(), "{ran:?}");
    let again = api_b.pay("after-1", "acct-after", 800, &[]).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, ran.body);
    assert_eq!(space.amounts("acct-after").await, vec![800]);
    assert!(
        space.key_row_exists("after-1").await,
        "key and payment committed together"
    );
}

// ---------------------------------------------------------------------------------
// A late completion with a stale token

/// The fingerprint the example's layer computes for `POST /payments` with this JSON
/// payment, as `Api::pay` sends it.
fn payment_fingerprint(account: &str, amount: i64) -> retrysafe_core::idempotency::Fingerprint {
    let body = serde_json::to_vec(&json!({ "account": account, "amount_cents": amount })).unwrap();
    let mut headers = http::HeaderMap::new();
    headers.insert(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    Fingerprinter::default().fingerprint(
        &http::Method::POST,
        &"/payments".parse().unwrap(),
        &headers,
        &body,
    )
}

/// Every write of a holder whose lease was taken over is refused.
async fn assert_stale(store: &impl IdempotencyStore, key: &str, stale: Token, done: &Completed) {
    let id = record_id(key);
    let retention = Duration::from_secs(60);
    let lease = Duration::from_secs(10);
    let refused = |what: &str, r: Result<(), StoreError>| {
        assert!(
            matches!(r, Err(StoreError::StaleToken)),
            "a stale {what} must be refused, got {r:?}"
        );
    };
    refused(
        "completion",
        store.complete(&id, stale, done, retention).await,
    );
    refused("release", store.release(&id, stale).await);
    refused("renewal", store.renew(&id, stale, lease).await);
    refused("commit point", store.commit_point(&id, stale).await);
    refused(
        "mark_unknown",
        store
            .mark_unknown(
                &id,
                stale,
                retention,
                retrysafe_core::idempotency::UnknownReason::ServiceError,
            )
            .await,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_late_completion_with_a_stale_token_is_refused() {
    let space = RedisSpace::new().await;
    let url = redis_url();
    let server = Server::start_with(&["--store", url.as_str()], &space.env());
    let api = Api::new(&server);

    // A holder that stalled: it claimed the key (as another instance of the example
    // would) with a short lease, before its commit point, and then went quiet.
    let fingerprint = payment_fingerprint("acct-stale", 450);
    let stale = Token::random();
    let claim = Claim::new(
        stale,
        fingerprint,
        Duration::from_millis(300),
        Duration::from_secs(60),
        CommitPoint::Before,
    );
    assert_eq!(
        space
            .store
            .claim(&record_id("stale-1"), &claim)
            .await
            .unwrap(),
        ClaimOutcome::Claimed { takeover: false }
    );

    // The example answers 409 while that lease lasts, then takes over and runs.
    let ran = pay_until_not(&api, &[409], "stale-1", "acct-stale", 450).await;
    ran.assert_created("acct-stale", 450);
    assert!(!ran.replayed(), "{ran:?}");

    // The stalled holder wakes up: its late completion (and everything else) is refused.
    let late = Completed::new(fingerprint, None);
    assert_stale(&space.store, "stale-1", stale, &late).await;
    let Some(Record::Completed(done)) = space.record("stale-1").await else {
        panic!("the example's completion must stand");
    };
    assert!(
        done.response.is_some(),
        "the example's answer is stored, not the late one"
    );
    let again = api.pay("stale-1", "acct-stale", 450, &[]).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, ran.body);
    assert_eq!(space.amounts("acct-stale").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_late_completion_with_a_stale_token_is_refused() {
    // The transactional layer commits its key row in the holder's own transaction, so a
    // stale completion cannot arise there; the PostgresStore (the same table, store
    // API) refuses one.
    let space = PgSpace::new().await;
    let store = PostgresStore::options()
        .schema(space.schema.clone())
        .call_timeout(Duration::from_secs(10))
        .connect(&database_url())
        .await
        .unwrap();
    store.migrate().await.unwrap();

    let id = record_id("stale-1");
    let fingerprint = payment_fingerprint("acct-stale", 450);
    let claim = |token| {
        Claim::new(
            token,
            fingerprint,
            Duration::from_millis(300),
            Duration::from_secs(60),
            CommitPoint::Before,
        )
    };
    let (stale, fresh) = (Token::random(), Token::random());
    assert_eq!(
        store.claim(&id, &claim(stale)).await.unwrap(),
        ClaimOutcome::Claimed { takeover: false }
    );
    // A second holder takes over once the lease has expired (by the database's clock).
    eventually("the takeover", PATIENCE, || async {
        match store.claim(&id, &claim(fresh)).await.unwrap() {
            ClaimOutcome::Claimed { takeover } => {
                assert!(takeover);
                Some(())
            }
            ClaimOutcome::Existing { record, .. } => {
                assert!(matches!(record, Record::InProgress(_)), "{record:?}");
                None
            }
            other => panic!("unexpected claim outcome {other:?}"),
        }
    })
    .await;
    let late = Completed::new(fingerprint, None);
    assert_stale(&store, "stale-1", stale, &late).await;
    store
        .complete(&id, fresh, &late, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(store.get(&id).await.unwrap(), Some(Record::Completed(late)));
    store.pool().close().await;
}

// ---------------------------------------------------------------------------------
// The store unreachable mid-run

async fn store_unreachable_fails_closed_and_recovers(kind: Kind) {
    let space = Space::new(kind).await;
    let (upstream, default_port) = match kind {
        Kind::Redis => (redis_url(), 6379),
        Kind::Postgres => (database_url(), 5432),
        // The cluster client learns every node's address from the cluster itself.
        Kind::RedisCluster => panic!("one proxy cannot stand between a cluster and its client"),
    };
    let proxy = proxy_to(&host_port(&upstream, default_port)).await;
    let instance = name("proxied");
    let url = with_addr(&space.url(&instance), proxy.addr);
    let server = Server::start_with(
        &["--store", url.as_str(), "--lease-ms", "1000"],
        &space.env(),
    );
    let api = Api::new(&server);

    let first = api.pay("up-1", "acct-up-1", 100, &[]).await;
    first.assert_created("acct-up-1", 100);

    // The store goes away while a handler waits before its effect: that request fails
    // closed (503, retry-after) and records nothing.
    let mid = {
        let api = api.clone();
        tokio::spawn(async move {
            api.pay("up-3", "acct-up-3", 300, &[("x-simulate-delay-ms", "3000")])
                .await
        })
    };
    match &space {
        Space::Redis(r) => {
            eventually("the claim of up-3", PATIENCE, || async {
                r.record("up-3").await
            })
            .await;
        }
        Space::RedisCluster(_) => unreachable!("refused above"),
        Space::Postgres(p) => {
            eventually("the key lock of up-3", PATIENCE, || async {
                p.holds_key_lock(&instance).await.then_some(())
            })
            .await;
        }
    }
    proxy.cut();
    mid.await.unwrap().assert_unavailable();

    // While it is away: fail closed, for new keys and replays alike; reads too.
    let refused = api.pay("up-2", "acct-up-2", 200, &[]).await;
    refused.assert_unavailable();
    refused.assert_problem_type(503, "store-unavailable");
    let replay = api.pay("up-1", "acct-up-1", 100, &[]).await;
    replay.assert_problem_type(503, "store-unavailable");
    let read = api.try_totals("acct-up-1").await;
    read.assert_unavailable();
    assert!(space.amounts("acct-up-2").await.is_empty());
    assert!(space.amounts("acct-up-3").await.is_empty());

    // It comes back: each key runs once (retrying while the store reconnects, or
    // while the stranded claim of up-3 waits for its lease), nothing was lost.
    proxy.restore();
    for (key, account, amount) in [("up-2", "acct-up-2", 200), ("up-3", "acct-up-3", 300)] {
        let ran = pay_until_not(&api, &[409, 503], key, account, amount).await;
        ran.assert_created(account, amount);
        assert!(!ran.replayed(), "{ran:?}");
        let again = api.pay(key, account, amount, &[]).await;
        assert!(again.replayed(), "{again:?}");
        assert_eq!(again.body, ran.body);
    }
    let replay = pay_until_not(&api, &[503], "up-1", "acct-up-1", 100).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(
        replay.body, first.body,
        "the first answer survived the outage"
    );
    assert_eq!(space.amounts("acct-up-1").await, vec![100]);
    assert_eq!(space.amounts("acct-up-2").await, vec![200]);
    assert_eq!(space.amounts("acct-up-3").await, vec![300]);
    assert_eq!(api.totals("acct-up-3").await, (1, 300));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_unreachable_mid_run_fails_closed_and_recovers() {
    store_unreachable_fails_closed_and_recovers(Kind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_unreachable_mid_run_fails_closed_and_recovers() {
    store_unreachable_fails_closed_and_recovers(Kind::Postgres).await;
}
