//! RedisStore against the real Redis at `REDIS_URL` (default `redis://127.0.0.1:6379`):
//! the shared conformance suite, then what is specific to Redis (round trips, key
//! naming, expiry, corrupt values, timeouts, the configuration check).
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

mod common;

use std::time::Duration;

use common::events::Events;
use common::{ServerLock, fresh_prefix, manager, manager_to, store};
use redis::aio::ConnectionManager;
use retrysafe_core::ConfigError;
use retrysafe_core::idempotency::{
    CommitPoint, Completed, DecodeError, Fingerprint, OutcomeUnknown, Record, RecordId, Token,
};
use retrysafe_core::store::conformance::fresh_id;
use retrysafe_core::store::{Claim, ClaimOutcome, IdempotencyStore, StoreError};
use retrysafe_redis::{EvictionPolicy, RedisStore, RedisStoreError};
use retrysafe_test_support::redis_nodes::CountingConnection;
use retrysafe_test_support::services::{host_port, proxy_to, redis_url, with_addr};
use tokio::net::TcpListener;

mod conformance {
    retrysafe_core::store_conformance_tests! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        store = super::store,
        clock = retrysafe_core::store::conformance::RealClock::default(),
    }
}

const LEASE: Duration = Duration::from_secs(10);
const RETENTION: Duration = Duration::from_secs(60);

fn claim_args(fingerprint: u8, commit_point: CommitPoint) -> Claim<'static> {
    Claim::new(
        Token::random(),
        Fingerprint::from_bytes([fingerprint; 32]),
        LEASE,
        RETENTION,
        commit_point,
    )
}

fn done(fingerprint: u8) -> Completed {
    Completed::new(Fingerprint::from_bytes([fingerprint; 32]), None)
}

/// Redis's clock in milliseconds.
async fn redis_now_ms(conn: &mut ConnectionManager) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    secs * 1000 + micros / 1000
}

#[tokio::test]
async fn every_store_call_is_one_round_trip() {
    let conn = CountingConnection::new(manager().await);
    let store = RedisStore::options()
        .key_prefix(fresh_prefix())
        .build(conn.clone())
        .await
        .unwrap();
    // No script flush while counting.
    let mut admin = manager().await;
    let lock = ServerLock::acquire(&mut admin, "scripts").await;

    // Warm up: each script is loaded on its first use after a server start.
    let warm = fresh_id();
    let c = claim_args(1, CommitPoint::Before);
    store.claim(&warm, &c).await.unwrap();
    store.renew(&warm, c.token, LEASE).await.unwrap();
    store.commit_point(&warm, c.token).await.unwrap();
    store
        .mark_unknown(
            &warm,
            c.token,
            RETENTION,
            retrysafe_core::idempotency::UnknownReason::ServiceError,
        )
        .await
        .unwrap();
    store
        .complete(&warm, c.token, &done(1), RETENTION)
        .await
        .ok();
    store.release(&warm, c.token).await.ok();
    store.wait(&warm, Duration::ZERO).await.unwrap();
    store.get(&warm).await.unwrap();
    conn.take();

    let id = fresh_id();
    let c = claim_args(1, CommitPoint::Before);
    assert_eq!(
        store.claim(&id, &c).await.unwrap(),
        ClaimOutcome::Claimed { takeover: false }
    );
    assert_eq!(conn.take(), 1, "claim");
    let copy = claim_args(1, CommitPoint::Before);
    assert!(matches!(
        store.claim(&id, &copy).await.unwrap(),
        ClaimOutcome::Existing {
            record: Record::InProgress(_),
            became_unknown: false
        }
    ));
    assert_eq!(conn.take(), 1, "claim of an existing record returns it");
    store.renew(&id, c.token, LEASE).await.unwrap();
    assert_eq!(conn.take(), 1, "renew");
    store.commit_point(&id, c.token).await.unwrap();
    assert_eq!(conn.take(), 1, "commit_point");
    assert!(matches!(
        store.get(&id).await.unwrap(),
        Some(Record::InProgress(_))
    ));
    assert_eq!(conn.take(), 1, "get");
    store.wait(&id, Duration::ZERO).await.unwrap();
    assert_eq!(conn.take(), 1, "wait: one poll");
    assert!(matches!(
        store.release(&id, copy.token).await,
        Err(StoreError::StaleToken)
    ));
    assert_eq!(conn.take(), 1, "a refused release");
    store
        .complete(&id, c.token, &done(1), RETENTION)
        .await
        .unwrap();
    assert_eq!(conn.take(), 1, "complete");
    assert_eq!(
        store.claim(&id, &copy).await.unwrap(),
        ClaimOutcome::Existing {
            record: Record::Completed(done(1)),
            became_unknown: false
        }
    );
    assert_eq!(conn.take(), 1, "claim of a completed record returns it");

    let other = fresh_id();
    store.claim(&other, &c).await.unwrap();
    conn.take();
    store.release(&other, c.token).await.unwrap();
    assert_eq!(conn.take(), 1, "release");
    store.claim(&other, &c).await.unwrap();
    conn.take();
    store
        .mark_unknown(
            &other,
            c.token,
            RETENTION,
            retrysafe_core::idempotency::UnknownReason::ServiceError,
        )
        .await
        .unwrap();
    assert_eq!(conn.take(), 1, "mark_unknown");
    lock.release(&mut admin).await;
}

#[tokio::test]
async fn scripts_are_reloaded_after_a_flush() {
    let store = store().await;
    let mut admin = manager().await;
    let lock = ServerLock::acquire(&mut admin, "scripts").await;
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut admin)
        .await
        .unwrap();
    lock.release(&mut admin).await;
    let id = fresh_id();
    let c = claim_args(1, CommitPoint::Undeclared);
    assert_eq!(
        store.claim(&id, &c).await.unwrap(),
        ClaimOutcome::Claimed { takeover: false }
    );
    store
        .complete(&id, c.token, &done(1), RETENTION)
        .await
        .unwrap();
    assert_eq!(
        store.get(&id).await.unwrap(),
        Some(Record::Completed(done(1)))
    );
}

#[tokio::test]
async fn one_key_per_record_with_the_id_as_hash_tag() {
    let prefix = fresh_prefix();
    let store = RedisStore::options()
        .key_prefix(prefix.clone())
        .build(manager().await)
        .await
        .unwrap();
    let mut admin = manager().await;
    let id = fresh_id();
    let key = store.key(&id);
    assert_eq!(key, format!("{prefix}{{{}}}", id.to_hex()));
    // The hash tag (between the first `{` and the next `}`) is exactly the record id.
    let open = key.find('{').unwrap();
    let close = open + key[open..].find('}').unwrap();
    assert_eq!(&key[open + 1..close], id.to_hex());
    assert_eq!(close, key.len() - 1);
    assert_eq!(store.key_prefix(), prefix);

    let c = claim_args(1, CommitPoint::Undeclared);
    store.claim(&id, &c).await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut admin)
        .await
        .unwrap();
    let mut keys = keys;
    keys.sort();
    let meta = format!("{key}:meta");
    let index = format!("{prefix}inflight");
    assert_eq!(
        keys,
        vec![index, key.clone(), meta],
        "one key per record, its companion hash, and the in-flight index"
    );
    let kind: String = redis::cmd("TYPE")
        .arg(&key)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(kind, "string");

    // The value is the record's own encoding, and its size is the encoded length.
    let raw: Vec<u8> = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut admin)
        .await
        .unwrap();
    let record = store.get(&id).await.unwrap().unwrap();
    assert_eq!(raw, record.encode().to_vec());
    assert_eq!(raw.len(), record.encoded_len());

    // An in-progress key outlives its lease (by the claim's retention).
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut admin)
        .await
        .unwrap();
    let lease_ms = i64::try_from(LEASE.as_millis()).unwrap();
    let retention_ms = i64::try_from(RETENTION.as_millis()).unwrap();
    assert!(
        pttl > lease_ms && pttl <= lease_ms + retention_ms,
        "in-progress PTTL {pttl}"
    );

    // A completed record expires after its retention.
    let retention = Duration::from_secs(5);
    store
        .complete(&id, c.token, &done(1), retention)
        .await
        .unwrap();
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(pttl > 0 && pttl <= 5000, "completed PTTL {pttl}");
}

#[tokio::test]
async fn leases_come_from_the_redis_clock() {
    let store = store().await;
    let mut admin = manager().await;
    let id = fresh_id();
    let c = claim_args(1, CommitPoint::Before);
    let lease_ms = u64::try_from(LEASE.as_millis()).unwrap();
    let before = redis_now_ms(&mut admin).await;
    store.claim(&id, &c).await.unwrap();
    let after = redis_now_ms(&mut admin).await;
    let Some(Record::InProgress(p)) = store.get(&id).await.unwrap() else {
        panic!("expected in_progress");
    };
    assert!(
        (before + lease_ms..=after + lease_ms).contains(&p.lease_until_ms),
        "lease end {} not within Redis TIME {before}..={after} plus the lease",
        p.lease_until_ms
    );
    let before = redis_now_ms(&mut admin).await;
    store.renew(&id, c.token, LEASE * 2).await.unwrap();
    let after = redis_now_ms(&mut admin).await;
    let Some(Record::InProgress(p)) = store.get(&id).await.unwrap() else {
        panic!("expected in_progress");
    };
    assert!((before + 2 * lease_ms..=after + 2 * lease_ms).contains(&p.lease_until_ms));
    // A renewal keeps the key alive for the renewed lease plus the retention.
    let pttl: u64 = redis::cmd("PTTL")
        .arg(store.key(&id))
        .query_async(&mut admin)
        .await
        .unwrap();
    let retention_ms = u64::try_from(RETENTION.as_millis()).unwrap();
    assert!(
        pttl > 2 * lease_ms && pttl <= 2 * lease_ms + retention_ms,
        "renewed PTTL {pttl}"
    );
}

#[tokio::test]
async fn an_expired_unclaimed_lease_past_its_commit_point_becomes_unknown() {
    // The in-progress key outlives its lease, so a copy arriving later still finds it
    // and reports the unknown outcome instead of running again.
    let store = store().await;
    let id = fresh_id();
    let c = {
        let mut c = claim_args(1, CommitPoint::Undeclared);
        c.lease = Duration::from_millis(50);
        c
    };
    store.claim(&id, &c).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let copy = claim_args(1, CommitPoint::Undeclared);
    assert_eq!(
        store.claim(&id, &copy).await.unwrap(),
        ClaimOutcome::Existing {
            record: Record::OutcomeUnknown(OutcomeUnknown::new(Fingerprint::from_bytes([1; 32]))),
            became_unknown: true
        }
    );
}

#[tokio::test]
async fn corrupt_values_are_reported_not_replayed() {
    let store = store().await;
    let mut admin = manager().await;
    let cases: [(&[u8], StoreErrorKind); 5] = [
        (b"", StoreErrorKind::Corrupt(DecodeError::Truncated)),
        (
            b"\x09\x01rest",
            StoreErrorKind::Corrupt(DecodeError::UnknownVersion(9)),
        ),
        (b"\x01\x09", StoreErrorKind::Corrupt(DecodeError::Truncated)),
        (
            &[
                1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                0, 0, 0, 0, 0, 0,
            ],
            StoreErrorKind::Corrupt(DecodeError::Invalid("state tag")),
        ),
        // Looks like an in_progress record, but is cut short.
        (
            &[1, 1, 7, 7, 7],
            StoreErrorKind::Corrupt(DecodeError::Truncated),
        ),
    ];
    for (bytes, expected) in cases {
        let id = fresh_id();
        let () = redis::cmd("SET")
            .arg(store.key(&id))
            .arg(bytes)
            .arg("PX")
            .arg(60_000)
            .query_async(&mut admin)
            .await
            .unwrap();
        let got = store.get(&id).await;
        assert_eq!(kind(&got), expected, "get of {bytes:?}: {got:?}");
        let got = store.claim(&id, &claim_args(1, CommitPoint::Before)).await;
        assert_eq!(kind(&got), expected, "claim of {bytes:?}: {got:?}");
        // Nobody holds a corrupt record: token calls are refused, the value is kept.
        let t = Token::random();
        assert_eq!(
            kind(&store.release(&id, t).await),
            StoreErrorKind::StaleToken
        );
        assert_eq!(
            kind(&store.complete(&id, t, &done(1), RETENTION).await),
            StoreErrorKind::StaleToken
        );
        let raw: Vec<u8> = redis::cmd("GET")
            .arg(store.key(&id))
            .query_async(&mut admin)
            .await
            .unwrap();
        assert_eq!(raw, bytes);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoreErrorKind {
    Ok,
    StaleToken,
    Timeout,
    Unavailable,
    Corrupt(DecodeError),
    Other,
}

fn kind<T>(r: &Result<T, StoreError>) -> StoreErrorKind {
    match r {
        Ok(_) => StoreErrorKind::Ok,
        Err(StoreError::StaleToken) => StoreErrorKind::StaleToken,
        Err(StoreError::Timeout) => StoreErrorKind::Timeout,
        Err(StoreError::Unavailable(_)) => StoreErrorKind::Unavailable,
        Err(StoreError::Corrupt(e)) => StoreErrorKind::Corrupt(*e),
        Err(_) => StoreErrorKind::Other,
    }
}

/// The settings a build refused.
fn refused<T: std::fmt::Debug>(r: Result<T, RedisStoreError>) -> ConfigError {
    match r {
        Err(RedisStoreError::Config(e)) => e,
        other => panic!("expected refused settings, got {other:?}"),
    }
}

#[tokio::test]
async fn options_are_validated() {
    let manager = manager().await;
    let conn = || CountingConnection::new(manager.clone());
    for prefix in ["a{b", "a}b", "{x}"] {
        let e = RedisStore::options().key_prefix(prefix).build(conn()).await;
        assert_eq!(refused(e).field(), "key_prefix");
    }
    let e = RedisStore::options()
        .call_timeout(Duration::ZERO)
        .build(conn())
        .await;
    assert_eq!(refused(e).field(), "call_timeout");
    let e = RedisStore::options()
        .call_timeout(Duration::from_secs(365 * 24 * 60 * 60))
        .build(conn())
        .await;
    assert_eq!(refused(e).field(), "call_timeout");
    let store = RedisStore::options()
        .key_prefix("")
        .call_timeout(Duration::from_millis(250))
        .build(conn())
        .await
        .unwrap();
    assert_eq!(store.call_timeout(), Duration::from_millis(250));
    assert_eq!(
        store.key(&RecordId::from_bytes([0; 32])),
        format!("{{{}}}", "00".repeat(32))
    );
    let dbg = format!("{store:?}");
    assert!(dbg.contains("RedisStore") && dbg.contains("250ms"), "{dbg}");
}

#[tokio::test]
async fn build_names_every_refused_setting() {
    let e = RedisStore::options()
        .key_prefix("a{b}")
        .call_timeout(Duration::ZERO)
        .build(CountingConnection::new(manager().await))
        .await;
    assert_eq!(
        refused(e).fields().collect::<Vec<_>>(),
        ["key_prefix", "call_timeout"]
    );
}

/// A port nothing listens on.
async fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    port
}

#[tokio::test]
async fn connecting_to_a_closed_port_is_unreachable_not_a_hang() {
    let port = closed_port().await;
    let url = format!("redis://127.0.0.1:{port}");
    let r = tokio::time::timeout(Duration::from_secs(20), RedisStore::connect(url.as_str()))
        .await
        .expect("connect must give up by itself");
    match r {
        Err(RedisStoreError::Unreachable { at, cause }) => {
            assert_eq!(at, format!("127.0.0.1:{port}"));
            assert_eq!(cause, "connection refused");
        }
        other => panic!("expected Unreachable, got {other:?}"),
    }
    // Said once, with the address.
    let shown = RedisStore::connect(url.as_str())
        .await
        .unwrap_err()
        .to_string();
    assert_eq!(
        shown,
        format!("cannot connect to Redis at 127.0.0.1:{port}: connection refused")
    );
}

#[tokio::test]
async fn a_url_that_does_not_parse_is_invalid_not_unavailable() {
    for url in [
        "redis://127.0.0.1:99999",
        "redis://bad host/",
        "http://127.0.0.1:6379",
    ] {
        let r = RedisStore::connect(url).await;
        assert!(
            matches!(r, Err(RedisStoreError::InvalidUrl(_))),
            "{url}: {r:?}"
        );
        let shown = r.unwrap_err().to_string();
        assert!(shown.starts_with("invalid Redis URL: "), "{shown}");
    }
}

#[tokio::test]
async fn a_server_gone_after_start_up_is_unavailable_not_a_hang() {
    let proxy = proxy_to(&host_port(&redis_url(), 6379)).await;
    let store = RedisStore::options()
        .key_prefix(fresh_prefix())
        .call_timeout(Duration::from_secs(1))
        .build(manager_to(&with_addr(&redis_url(), proxy.addr)).await)
        .await
        .unwrap();
    let id = fresh_id();
    let c = claim_args(1, CommitPoint::Undeclared);
    store.claim(&id, &c).await.unwrap();
    // The server goes away: connections closed, the port refuses new ones.
    proxy.shut_down();
    let outcomes = tokio::time::timeout(Duration::from_secs(20), async {
        [
            kind(&store.claim(&id, &c).await),
            kind(&store.get(&id).await),
            kind(&store.complete(&id, c.token, &done(1), RETENTION).await),
            kind(&store.wait(&id, Duration::from_secs(1)).await),
        ]
    })
    .await
    .expect("store calls are bounded");
    for k in outcomes {
        assert!(
            matches!(k, StoreErrorKind::Unavailable | StoreErrorKind::Timeout),
            "{k:?}"
        );
    }
}

#[tokio::test]
async fn a_stalled_server_is_a_timeout_and_the_store_recovers() {
    let proxy = proxy_to(&host_port(&redis_url(), 6379)).await;
    let store = RedisStore::options()
        .key_prefix(fresh_prefix())
        .call_timeout(Duration::from_secs(1))
        .build(manager_to(&with_addr(&redis_url(), proxy.addr)).await)
        .await
        .unwrap();
    let id = fresh_id();
    let c = claim_args(1, CommitPoint::Undeclared);
    store.claim(&id, &c).await.unwrap();

    proxy.stall(true);
    let stalled = tokio::time::timeout(Duration::from_secs(20), async {
        [
            kind(&store.get(&id).await),
            kind(&store.renew(&id, c.token, LEASE).await),
            kind(
                &store
                    .claim(&id, &claim_args(1, CommitPoint::Undeclared))
                    .await,
            ),
        ]
    })
    .await
    .expect("calls are bounded by the call timeout");
    assert_eq!(stalled, [StoreErrorKind::Timeout; 3]);

    // The held requests reach Redis late (their replies are discarded); new calls work.
    proxy.stall(false);
    store
        .complete(&id, c.token, &done(1), RETENTION)
        .await
        .unwrap();
    assert_eq!(
        store.get(&id).await.unwrap(),
        Some(Record::Completed(done(1)))
    );
}

#[tokio::test]
async fn connect_reaches_the_configured_server() {
    let store = RedisStore::connect(redis_url().as_str())
        .await
        .unwrap_or_else(|e| panic!("cannot reach Redis at REDIS_URL={}: {e}", redis_url()));
    assert_eq!(store.key_prefix(), "retrysafe:");
    assert_eq!(store.call_timeout(), Duration::from_secs(1));
    // Keys under the default prefix: use a fresh id and clean up.
    let id = fresh_id();
    let c = claim_args(1, CommitPoint::Undeclared);
    store.claim(&id, &c).await.unwrap();
    store.release(&id, c.token).await.unwrap();
    assert_eq!(store.get(&id).await.unwrap(), None);
}

/// A private `redis-server` on a free loopback port with the given eviction policy and
/// no persistence; killed when dropped. The shared server's policy is its owner's, so
/// policies are tried on servers of their own.
struct PrivateRedis {
    port: u16,
    child: std::process::Child,
}

impl PrivateRedis {
    async fn start(policy: &str) -> PrivateRedis {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(std::env::temp_dir())
            .args(["--appendonly", "no", "--save", ""])
            .args(["--maxmemory-policy", policy])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start redis-server (is it installed?)");
        let server = PrivateRedis { port, child };
        let client = redis::Client::open(server.url()).unwrap();
        let ready = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
                    let pong: redis::RedisResult<String> =
                        redis::cmd("PING").query_async(&mut conn).await;
                    if pong.is_ok() {
                        return;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(ready.is_ok(), "private redis-server not ready on {port}");
        server
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn making_a_store_refuses_volatile_and_allkeys_policies() {
    for policy in ["volatile-lru", "allkeys-lru"] {
        let server = PrivateRedis::start(policy).await;
        let connected = RedisStore::connect(server.url().as_str()).await;
        let built = RedisStore::options()
            .build(manager_to(&server.url()).await)
            .await;
        for r in [connected.map(drop), built.map(drop)] {
            match r {
                Err(e @ RedisStoreError::UnsafeEvictionPolicy(_)) => {
                    let RedisStoreError::UnsafeEvictionPolicy(report) = &e else {
                        unreachable!()
                    };
                    assert_eq!(report.eviction_policy, EvictionPolicy::parse(policy));
                    let message = e.to_string();
                    assert!(
                        message.contains(policy) && message.contains("noeviction"),
                        "{message}"
                    );
                }
                other => panic!("{policy} must be refused, got {other:?}"),
            }
        }
        // The user's responsibility, when asked for.
        let skipped = RedisStore::options()
            .skip_config_check()
            .build(manager_to(&server.url()).await)
            .await;
        assert!(skipped.is_ok(), "{skipped:?}");
    }
}

#[tokio::test]
async fn making_a_store_accepts_noeviction() {
    let server = PrivateRedis::start("noeviction").await;
    let store = RedisStore::connect(server.url().as_str()).await.unwrap();
    let report = store.check_config().await.unwrap();
    assert_eq!(report.eviction_policy, EvictionPolicy::NoEviction);
    assert!(report.aof.is_some() && report.rdb.is_some(), "{report:?}");
    let id = fresh_id();
    let c = claim_args(1, CommitPoint::Undeclared);
    store.claim(&id, &c).await.unwrap();
    RedisStore::options()
        .build(manager_to(&server.url()).await)
        .await
        .unwrap();
}

#[tokio::test]
async fn check_config_reports_unknown_when_config_is_refused() {
    let mut admin = manager().await;
    let user = format!("retrysafe-test-{}", Token::random().to_hex());
    let password = Token::random().to_hex();
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(&user)
        .arg("on")
        .arg(format!(">{password}"))
        .arg("~*")
        .arg("+@all")
        .arg("-config")
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = format!(
        "redis://{user}:{password}@{}",
        host_port(&redis_url(), 6379)
    );
    // By default a policy that cannot be read is refused; skipped, it is the user's.
    let refused = RedisStore::connect(url.as_str()).await;
    let restricted = RedisStore::options()
        .name("orders-redis")
        .skip_config_check()
        .build(manager_to(&url).await)
        .await;
    let events = Events::default();
    let subscriber = tracing_subscriber::layer::SubscriberExt::with(
        tracing_subscriber::registry(),
        events.clone(),
    );
    let outcome = match &restricted {
        Ok(store) => {
            let _default = tracing::subscriber::set_default(subscriber);
            Some(store.check_config().await)
        }
        Err(_) => None,
    };
    let _: i64 = redis::cmd("ACL")
        .arg("DELUSER")
        .arg(&user)
        .query_async(&mut admin)
        .await
        .unwrap();

    match refused {
        Err(e @ RedisStoreError::EvictionPolicyUnreadable) => {
            assert!(e.to_string().contains("skip_config_check"), "{e}");
        }
        other => panic!("an unreadable policy must be refused, got {other:?}"),
    }
    restricted.unwrap();
    let report = outcome.unwrap().unwrap();
    assert_eq!(report.eviction_policy, EvictionPolicy::Unknown);
    assert_eq!(
        (report.aof, report.rdb, report.persistent()),
        (None, None, None)
    );
    // Its warning carries the store's name.
    let events = events.0.lock().unwrap().clone();
    let refusal = events
        .iter()
        .find(|e| e["message"].starts_with("cannot read the Redis configuration"))
        .unwrap_or_else(|| panic!("{events:#?}"));
    assert_eq!(refusal["name"], "orders-redis", "{refusal:?}");
}

#[tokio::test]
async fn check_config_on_a_server_gone_is_a_store_error() {
    let proxy = proxy_to(&host_port(&redis_url(), 6379)).await;
    let store = RedisStore::options()
        .call_timeout(Duration::from_millis(500))
        .build(manager_to(&with_addr(&redis_url(), proxy.addr)).await)
        .await
        .unwrap();
    proxy.shut_down();
    let r = tokio::time::timeout(Duration::from_secs(20), store.check_config())
        .await
        .expect("bounded");
    assert!(matches!(r, Err(RedisStoreError::Store(_))), "{r:?}");
}
