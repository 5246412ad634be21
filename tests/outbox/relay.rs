//! The relay: crash between send and mark, competition, a failing downstream,
//! ordering, rejection and dead letters.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::StatusCode;
use retrysafe_postgres::outbox::{Outbox, OutboxRelay, Outgoing, Settled};
use retrysafe_postgres::sqlx::{self, PgConnection};

use crate::harness::{Db, client, downstream, eventually, order_service, place_order};

const SUCCEEDED: i16 = 1;
const REJECTED: i16 = 2;
const DEAD: i16 = 3;

/// A relay with short leases and backoff, for tests.
fn test_relay(db: &Db) -> OutboxRelay {
    OutboxRelay::new(db.pool.clone())
        .http_client(client())
        .lease(Duration::from_millis(800))
        .send_timeout(Duration::from_millis(700))
        .poll_interval(Duration::from_millis(20))
        .backoff(retrysafe::retry::Backoff::new(
            Duration::from_millis(10),
            Duration::from_millis(50),
            retrysafe::retry::Jitter::Full,
        ))
}

/// Passes of `relay` until no row is pending.
async fn drain(db: &Db, relay: &OutboxRelay) {
    eventually("every row finished", Duration::from_secs(30), || async {
        relay.run_once().await.unwrap();
        (db.count(0).await == 0).then_some(())
    })
    .await;
}

#[tokio::test]
async fn enqueue_commits_with_the_effect_and_strips_credentials() {
    let db = Db::new().await;
    let (addr, seen) = downstream().await;
    let app = order_service(&db, addr, None).await;
    assert_eq!(place_order(&app, "order-1", "a").await, StatusCode::CREATED);
    // The same key again: replayed, nothing enqueued twice.
    assert_eq!(place_order(&app, "order-1", "a").await, StatusCode::CREATED);
    let keys = db.keys().await;
    assert_eq!(keys.len(), 1);
    let stored: Vec<u8> =
        retrysafe_postgres::sqlx::query_scalar("SELECT headers FROM retrysafe_outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(
        !String::from_utf8_lossy(&stored).contains("s3cret"),
        "credentials stored"
    );
    // A second order gets another child key.
    place_order(&app, "order-2", "b").await;
    let keys = db.keys().await;
    assert_eq!(keys.len(), 2);
    assert_ne!(keys[0], keys[1]);
    drain(&db, &test_relay(&db).build().unwrap()).await;
    assert_eq!(seen.effects_of(&keys[0]), 1);
    assert_eq!(seen.effects_of(&keys[1]), 1);
    assert_eq!(db.count(SUCCEEDED).await, 2);
}

#[tokio::test]
async fn relay_killed_between_send_and_mark_resends_without_a_second_effect() {
    let db = Db::new().await;
    let (addr, seen) = downstream().await;
    let app = order_service(&db, addr, None).await;
    place_order(&app, "order-1", "a").await;
    let key = db.keys().await.remove(0);

    let crashing = test_relay(&db)
        .__crash_after_send(|_| true)
        .build()
        .unwrap();
    let pass = crashing.run_once().await.unwrap();
    assert_eq!((pass.taken, pass.succeeded), (1, 0));
    assert_eq!(seen.effects_of(&key), 1, "the send happened");
    assert_eq!(db.count(0).await, 1, "but the row was not marked");

    // Another relay takes it once the lease has ended, and sends it again: the
    // downstream replays its answer, and the effect stays single.
    let second = test_relay(&db).build().unwrap();
    drain(&db, &second).await;
    assert_eq!(db.count(SUCCEEDED).await, 1);
    assert_eq!(seen.effects_of(&key), 1);
    assert_eq!(
        seen.requests.load(Ordering::SeqCst),
        2,
        "sent twice, effect once"
    );
    let (_, _, attempts) = db.states().await[0];
    assert_eq!(attempts, 2);
}

#[tokio::test]
async fn competing_relays_deliver_each_row_once() {
    let db = Db::new().await;
    let (addr, seen) = downstream().await;
    db.enqueue_posts(&format!("http://{addr}/effects"), None, 150, None)
        .await;
    let delivered = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let relay = test_relay(&db).batch(10).build().unwrap();
        let pool = db.pool.clone();
        let delivered = Arc::clone(&delivered);
        tasks.push(tokio::spawn(async move {
            loop {
                let pass = relay.run_once().await.unwrap();
                delivered.fetch_add(pass.succeeded, Ordering::SeqCst);
                let pending: i64 = retrysafe_postgres::sqlx::query_scalar(
                    "SELECT count(*) FROM retrysafe_outbox WHERE state = 0",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                if pending == 0 {
                    return;
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        delivered.load(Ordering::SeqCst),
        150,
        "each row marked by exactly one relay"
    );
    assert_eq!(
        seen.requests.load(Ordering::SeqCst),
        150,
        "each row sent once"
    );
    assert_eq!(seen.total_effects(), 150);
    assert_eq!(seen.duplicates(), 0);
}

#[tokio::test]
async fn a_downstream_answering_503_for_a_while_is_retried_until_it_recovers() {
    let db = Db::new().await;
    let (addr, seen) = downstream().await;
    seen.fail_first.store(5, Ordering::SeqCst);
    db.enqueue_posts(&format!("http://{addr}/effects"), None, 1, None)
        .await;
    let relay = test_relay(&db).build().unwrap();
    let retried = AtomicUsize::new(0);
    eventually("delivered", Duration::from_secs(30), || async {
        let pass = relay.run_once().await.unwrap();
        retried.fetch_add(pass.retried, Ordering::SeqCst);
        (db.count(SUCCEEDED).await == 1).then_some(())
    })
    .await;
    assert_eq!(retried.load(Ordering::SeqCst), 5);
    assert_eq!(seen.effects_of("k-0"), 1);
    assert_eq!(
        db.states().await[0].2,
        6,
        "five 503s, then the send that succeeded"
    );
}

#[tokio::test]
async fn rows_of_one_ordering_key_are_delivered_in_order() {
    let db = Db::new().await;
    let (addr, seen) = downstream().await;
    // The first row fails a few times: the others must wait for it.
    seen.fail_first.store(3, Ordering::SeqCst);
    db.enqueue_posts(
        &format!("http://{addr}/effects"),
        None,
        6,
        Some("account-1"),
    )
    .await;
    drain(&db, &test_relay(&db).build().unwrap()).await;
    assert_eq!(*seen.order.lock().unwrap(), ["0", "1", "2", "3", "4", "5"]);
}

#[tokio::test]
async fn an_ordering_key_follows_commit_order_across_concurrent_transactions() {
    let db = Db::new().await;
    let (addr, seen) = downstream().await;
    let url = format!("http://{addr}/effects");
    let ordered = |body: &'static str| {
        Outgoing::from(
            http::Request::post(url.as_str())
                .body(bytes::Bytes::from_static(body.as_bytes()))
                .unwrap(),
        )
        .ordering_key("account-1")
    };
    let mut first = db.pool.begin().await.unwrap();
    enqueue_on(&mut first, "k-first", ordered("first")).await;

    // A second transaction enqueueing for the same key waits for the first to end.
    let mut second = db.pool.begin().await.unwrap();
    let second_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *second)
        .await
        .unwrap();
    let later = ordered("second");
    let second = tokio::spawn(async move {
        enqueue_on(&mut second, "k-second", later).await;
        second.commit().await.unwrap();
    });
    eventually("the second waiting on the key", Duration::from_secs(30), || async {
        let waiting: bool = sqlx::query_scalar(
            "SELECT count(*) > 0 FROM pg_locks WHERE pid = $1 AND locktype = 'advisory' AND NOT granted",
        )
        .bind(second_pid)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        waiting.then_some(())
    })
    .await;
    let relay = test_relay(&db).build().unwrap();
    assert_eq!(
        relay.run_once().await.unwrap().taken,
        0,
        "nothing committed yet"
    );

    first.commit().await.unwrap();
    second.await.unwrap();
    drain(&db, &relay).await;
    assert_eq!(*seen.order.lock().unwrap(), ["first", "second"]);
    // Rows of another key, or of none, do not wait for a key held.
    let mut tx = db.pool.begin().await.unwrap();
    enqueue_on(&mut tx, "k-a", ordered("a")).await;
    let unordered = Outgoing::from(
        http::Request::post(url.as_str())
            .body(bytes::Bytes::new())
            .unwrap(),
    );
    let mut other = db.pool.begin().await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), async {
        enqueue_on(&mut other, "k-b", unordered.clone()).await;
        enqueue_on(&mut other, "k-c", unordered.ordering_key("account-2")).await;
        other.commit().await.unwrap();
    })
    .await
    .expect("no wait on another key");
    tx.commit().await.unwrap();
}

async fn enqueue_on(tx: &mut PgConnection, key: &str, outgoing: Outgoing) {
    let key = retrysafe::wire::IdempotencyKey::new(key).unwrap();
    Outbox::new().enqueue(tx, &key, outgoing).await.unwrap();
}

#[tokio::test]
async fn a_final_4xx_is_rejected_and_an_old_row_is_dead_lettered() {
    let db = Db::new().await;
    let (addr, seen) = downstream().await;
    seen.reject.store(true, Ordering::SeqCst);
    db.enqueue_posts(&format!("http://{addr}/effects"), None, 1, None)
        .await;
    let rejected = Arc::new(std::sync::Mutex::new(Vec::<Settled>::new()));
    let hook = Arc::clone(&rejected);
    let relay = test_relay(&db)
        .on_rejected(move |s| hook.lock().unwrap().push(s.clone()))
        .build()
        .unwrap();
    drain(&db, &relay).await;
    assert_eq!(db.count(REJECTED).await, 1);
    let settled = rejected.lock().unwrap().clone();
    assert_eq!(settled.len(), 1);
    assert_eq!(
        (settled[0].key.as_str(), settled[0].status),
        ("k-0", Some(422))
    );

    // A row to an address nobody listens on keeps failing until its dead-letter age.
    db.enqueue_posts("http://127.0.0.1:1/effects", None, 1, None)
        .await;
    let dead = Arc::new(AtomicUsize::new(0));
    let hook = Arc::clone(&dead);
    let relay = test_relay(&db)
        .dead_letter_age(Duration::from_millis(300))
        .on_dead(move |_| {
            hook.fetch_add(1, Ordering::SeqCst);
        })
        .build()
        .unwrap();
    drain(&db, &relay).await;
    assert_eq!(db.count(DEAD).await, 1);
    assert_eq!(dead.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn finished_rows_are_swept_after_the_retention() {
    let db = Db::new().await;
    let (addr, _seen) = downstream().await;
    db.enqueue_posts(&format!("http://{addr}/effects"), None, 3, None)
        .await;
    let relay = test_relay(&db)
        .retention(Duration::from_millis(1))
        .build()
        .unwrap();
    drain(&db, &relay).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(relay.sweep(100).await.unwrap(), 3);
    assert!(db.states().await.is_empty());
}

#[tokio::test]
async fn a_spawned_relay_delivers_until_stopped_and_an_aborted_one_leaves_its_rows_leased() {
    let db = Db::new().await;
    let (addr, seen) = downstream().await;
    let url = format!("http://{addr}/effects");
    db.enqueue_posts(&url, None, 20, None).await;
    let handle = test_relay(&db).build().unwrap().spawn();
    eventually(
        "delivered by the spawned relay",
        Duration::from_secs(30),
        || async { (db.count(SUCCEEDED).await == 20).then_some(()) },
    )
    .await;
    handle.stop().await;
    assert_eq!(seen.total_effects(), 20);

    // A relay that crashes after its first send: the task ends, the row stays leased,
    // and a new relay delivers it once the lease has ended.
    let mut tx = db.pool.begin().await.unwrap();
    let key = retrysafe::wire::IdempotencyKey::new("late").unwrap();
    retrysafe_postgres::outbox::Outbox::new()
        .enqueue(
            &mut tx,
            &key,
            http::Request::post(url.as_str())
                .body(bytes::Bytes::new())
                .unwrap(),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let crashing = test_relay(&db)
        .__crash_after_send(|_| true)
        .build()
        .unwrap()
        .spawn();
    eventually("the crash", Duration::from_secs(30), || async {
        crashing.is_finished().then_some(())
    })
    .await;
    assert_eq!(db.count(0).await, 1);
    let handle = test_relay(&db).build().unwrap().spawn();
    eventually("the resend", Duration::from_secs(30), || async {
        (db.count(SUCCEEDED).await == 21).then_some(())
    })
    .await;
    handle.abort();
    assert_eq!(seen.effects_of("late"), 1);
    assert_eq!(seen.duplicates(), 0);
}

#[tokio::test]
async fn the_backlog_gauge_counts_the_rows_not_yet_delivered_by_name() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let db = Db::new().await;
    let (addr, _seen) = downstream().await;
    let app = order_service(&db, addr, None).await;
    place_order(&app, "order-1", "a").await;
    place_order(&app, "order-2", "b").await;
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let relay = metrics::with_local_recorder(&recorder, || {
        test_relay(&db).name("orders").batch(1).build().unwrap()
    });
    let backlog = || {
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .find(|(key, ..)| {
                let key = key.key();
                let labels: Vec<(&str, &str)> =
                    key.labels().map(|l| (l.key(), l.value())).collect();
                key.name() == "retrysafe_outbox_backlog" && labels == [("name", "orders")]
            })
            .map(|(.., value)| match value {
                DebugValue::Gauge(g) => g.into_inner(),
                other => panic!("not a gauge: {other:?}"),
            })
    };
    // One row a pass: the gauge follows what is left after each.
    assert_eq!(relay.run_once().await.unwrap().succeeded, 1);
    assert_eq!(backlog(), Some(1.0));
    assert_eq!(relay.run_once().await.unwrap().succeeded, 1);
    assert_eq!(backlog(), Some(0.0));
}
