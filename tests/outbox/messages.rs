//! The message path through the real RabbitMQ: a relay crash between a publish and its
//! mark, a `mandatory` message no queue takes, and the headers a message keeps.

use std::time::Duration;

use retrysafe_postgres::consumer::{Consumer, Processed};
use retrysafe_postgres::outbox::amqp::lapin::options::{BasicGetOptions, QueueDeleteOptions};
use retrysafe_postgres::outbox::amqp::lapin::types::AMQPValue;
use retrysafe_postgres::outbox::amqp::{AmqpPublisher, declare_queue};
use retrysafe_postgres::outbox::{Message, OutboxRelay, PublishError, Publisher};

use crate::consumer::{Subscription, record};
use crate::harness::{Broker, Db, amqp_url, eventually, unique};

const PENDING: i16 = 0;
const SUCCEEDED: i16 = 1;

/// A relay of messages with short leases and backoff, for tests.
fn message_relay(db: &Db) -> OutboxRelay {
    OutboxRelay::new(db.pool.clone())
        .publisher(AmqpPublisher::new(amqp_url()).confirm_timeout(Duration::from_millis(600)))
        .lease(Duration::from_millis(800))
        .send_timeout(Duration::from_millis(700))
        .backoff(retrysafe::retry::Backoff::new(
            Duration::from_millis(10),
            Duration::from_millis(50),
            retrysafe::retry::Jitter::Full,
        ))
}

/// Waits until `queue` holds `n` ready messages.
async fn ready(broker: &Broker, queue: &str, n: u32) {
    eventually("the queue's messages", Duration::from_secs(10), || async {
        (broker.ready(queue).await == n).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_message_published_again_after_a_relay_crash_is_consumed_once_by_its_id() {
    let db = Db::new().await;
    let broker = Broker::new().await;
    db.enqueue("m-0", Message::new("", broker.queue.as_str(), "hello"))
        .await;

    // Published and confirmed, then the relay dies before its mark.
    let crashing = message_relay(&db)
        .__crash_after_send(|_| true)
        .build()
        .unwrap();
    let pass = crashing.run_once().await.unwrap();
    assert_eq!((pass.taken, pass.succeeded), (1, 0));
    assert_eq!(db.count(PENDING).await, 1, "the row was not marked");
    ready(&broker, &broker.queue, 1).await;

    // Another relay takes the row once the lease has ended and publishes it again.
    let second = message_relay(&db).build().unwrap();
    eventually("the second publish", Duration::from_secs(30), || async {
        second.run_once().await.unwrap();
        (db.count(SUCCEEDED).await == 1).then_some(())
    })
    .await;
    ready(&broker, &broker.queue, 2).await;

    // Two copies, neither flagged redelivered by the broker: the consumer tells them
    // apart by their message id alone.
    let consumer = Consumer::new(db.pool.clone(), "billing").build().unwrap();
    consumer.migrate().await.unwrap();
    let mut sub = Subscription::new(&broker.queue).await;
    let mut outcomes = Vec::new();
    for _ in 0..2 {
        let delivery = sub.next().await;
        assert!(
            !delivery.redelivered,
            "a publish of its own, not a redelivery"
        );
        assert_eq!(
            delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.as_str()),
            Some("m-0")
        );
        let outcome = consumer
            .process(delivery, |tx, body| record(tx, body, "m-0".into()))
            .await
            .unwrap();
        outcomes.push(outcome);
    }
    assert!(matches!(outcomes[0], Processed::Done(())), "{outcomes:?}");
    assert!(matches!(outcomes[1], Processed::Duplicate), "{outcomes:?}");
    assert_eq!(db.consumed().await.get("m-0"), Some(&1));
    sub.close().await;
    ready(&broker, &broker.queue, 0).await;
    broker.cleanup().await;
}

#[tokio::test]
async fn a_mandatory_message_the_broker_returns_is_a_failed_send() {
    let db = Db::new().await;
    let broker = Broker::new().await;
    let nowhere = unique("outbox_test_nowhere_");
    let publisher = AmqpPublisher::new(amqp_url());
    // No queue is bound to this routing key: the broker returns the message.
    let error = publisher
        .publish("k-1", &Message::new("", nowhere.as_str(), "x"))
        .await
        .unwrap_err();
    assert!(matches!(error, PublishError::Returned), "{error}");
    // The channel stays usable: a routable message goes through.
    publisher
        .publish("k-2", &Message::new("", broker.queue.as_str(), "y"))
        .await
        .unwrap();
    ready(&broker, &broker.queue, 1).await;

    // Through the relay the row is left pending for a retry, saying why.
    db.enqueue("m-0", Message::new("", nowhere.as_str(), "x"))
        .await;
    let relay = message_relay(&db).build().unwrap();
    let pass = relay.run_once().await.unwrap();
    assert_eq!((pass.taken, pass.succeeded, pass.retried), (1, 0, 1));
    let (_, error) = db.row("m-0").await;
    assert!(
        error.as_deref().is_some_and(|e| e.contains("returned")),
        "{error:?}"
    );

    // Once a queue takes that routing key, the retry is delivered.
    declare_queue(&broker.channel, &nowhere).await.unwrap();
    eventually(
        "delivered once routable",
        Duration::from_secs(30),
        || async {
            relay.run_once().await.unwrap();
            (db.count(SUCCEEDED).await == 1).then_some(())
        },
    )
    .await;
    let body = eventually("the message", Duration::from_secs(10), || async {
        broker.get(&nowhere).await
    })
    .await;
    assert_eq!(body, b"x");
    for q in [nowhere.clone(), format!("{nowhere}.dead")] {
        let _ = broker
            .channel
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    broker.cleanup().await;
}

#[tokio::test]
async fn a_message_never_stores_or_publishes_credentials() {
    let db = Db::new().await;
    let broker = Broker::new().await;
    let message = Message::new("", broker.queue.as_str(), "hello")
        .header("authorization", "Bearer s3cret")
        .header("proxy-authorization", "Basic s3cret")
        .header("cookie", "session=s3cret")
        .header("x-trace", "t-1");
    db.enqueue("m-0", message).await;
    let (stored, _) = db.row("m-0").await;
    let stored = String::from_utf8_lossy(&stored).into_owned();
    assert!(!stored.contains("s3cret"), "credentials stored: {stored}");
    assert!(stored.contains("x-trace"), "{stored}");

    let relay = message_relay(&db).build().unwrap();
    assert_eq!(relay.run_once().await.unwrap().succeeded, 1);
    let got = eventually("the message", Duration::from_secs(10), || async {
        broker
            .channel
            .basic_get(
                broker.queue.as_str().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap()
    })
    .await;
    let headers = got
        .delivery
        .properties
        .headers()
        .clone()
        .unwrap_or_default();
    for name in ["authorization", "proxy-authorization", "cookie"] {
        assert!(!headers.contains_key(name), "{name} published");
    }
    match headers.inner().get("x-trace") {
        Some(AMQPValue::LongString(v)) => assert_eq!(v.as_bytes(), b"t-1"),
        other => panic!("x-trace: {other:?}"),
    }
    broker.cleanup().await;
}
