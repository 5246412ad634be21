//! The broker connection cut and restored under a running relay.

use std::time::Duration;

use retrysafe_postgres::outbox::OutboxRelay;
use retrysafe_postgres::outbox::amqp::AmqpPublisher;

use crate::harness::{Broker, Db, amqp_url, eventually};
use retrysafe_test_support::services::proxy_to;

#[tokio::test]
async fn a_cut_broker_connection_is_retried_until_restored() {
    let db = Db::new().await;
    let broker = Broker::new().await;
    let proxy = proxy_to("127.0.0.1:5672").await;
    let through_proxy = amqp_url().replace("127.0.0.1:5672", &proxy.addr.to_string());
    let relay = OutboxRelay::new(db.pool.clone())
        .publisher(AmqpPublisher::new(through_proxy).confirm_timeout(Duration::from_millis(500)))
        .lease(Duration::from_secs(2))
        .send_timeout(Duration::from_secs(1))
        .backoff(retrysafe::retry::Backoff::new(
            Duration::from_millis(10),
            Duration::from_millis(50),
            retrysafe::retry::Jitter::Full,
        ))
        .build()
        .unwrap();

    // A first batch goes through, over a connection the publisher keeps.
    enqueue_messages(&db, &broker.queue, 0..5).await;
    assert_eq!(relay.run_once().await.unwrap().succeeded, 5);

    // The connection is cut: sends fail and the rows stay pending.
    proxy.cut();
    enqueue_messages(&db, &broker.queue, 5..10).await;
    let pass = relay.run_once().await.unwrap();
    assert_eq!((pass.taken, pass.succeeded, pass.retried), (5, 0, 5));

    // Restored: the publisher reconnects and the rows are delivered.
    proxy.restore();
    eventually(
        "delivered after the restore",
        Duration::from_secs(30),
        || async {
            relay.run_once().await.unwrap();
            (db.count(1).await == 10).then_some(())
        },
    )
    .await;
    let delivered = eventually(
        "ten messages in the queue",
        Duration::from_secs(10),
        || async {
            let n = broker.ready(&broker.queue).await;
            (n >= 10).then_some(n)
        },
    )
    .await;
    // At least once: a confirm lost in the cut may have been sent again; the consumer
    // skips such a copy by its id.
    assert!(delivered >= 10);
    broker.cleanup().await;
}

async fn enqueue_messages(db: &Db, queue: &str, ids: std::ops::Range<usize>) {
    for i in ids {
        let mut tx = db.pool.begin().await.unwrap();
        let key = retrysafe::wire::IdempotencyKey::new(&format!("m-{i}")).unwrap();
        retrysafe_postgres::outbox::Outbox::new()
            .enqueue(
                &mut tx,
                &key,
                retrysafe_postgres::outbox::Message::new("", queue, format!("{i}")),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
}
