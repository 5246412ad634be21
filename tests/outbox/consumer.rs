//! The idempotent consumer: crash between commit and ack, a poison message, a message
//! without an id; and the whole path from an order to the consumer's effect.

use std::time::Duration;

use futures_util::StreamExt;
use retrysafe_postgres::consumer::{Consumer, Processed};
use retrysafe_postgres::outbox::amqp::AmqpPublisher;
use retrysafe_postgres::outbox::amqp::lapin::message::Delivery;
use retrysafe_postgres::outbox::amqp::lapin::options::{BasicConsumeOptions, BasicPublishOptions};
use retrysafe_postgres::outbox::amqp::lapin::types::FieldTable;
use retrysafe_postgres::outbox::amqp::lapin::{
    self, BasicProperties, Connection, ConnectionProperties,
};
use retrysafe_postgres::outbox::{Message, OutboxRelay, Publisher};
use retrysafe_postgres::sqlx::{self, PgConnection};
use retrysafe_test_support::services::database_url;

use crate::harness::{
    Broker, Db, amqp_url, client, downstream, eventually, order_service, place_order,
};

/// A subscription to a queue on a connection of its own (a consumer process). Its
/// deliveries can be settled while it lives: dropping lapin's consumer closes its
/// channel.
pub struct Subscription {
    pub conn: Connection,
    consumer: lapin::Consumer,
}

impl Subscription {
    pub async fn new(queue: &str) -> Subscription {
        let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let channel = conn.create_channel().await.unwrap();
        let consumer = channel
            .basic_consume(
                queue.into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        Subscription { conn, consumer }
    }

    pub async fn next(&mut self) -> Delivery {
        tokio::time::timeout(Duration::from_secs(10), self.consumer.next())
            .await
            .expect("a delivery within 10 s")
            .unwrap()
            .unwrap()
    }

    /// Closes the connection, as a process that dies.
    pub async fn close(self) {
        self.conn.close(320, "gone".into()).await.unwrap();
    }
}

/// The effect: one row in `consumed` per run.
pub fn record<'c>(
    tx: &'c mut PgConnection,
    body: &'c [u8],
    id: String,
) -> retrysafe_postgres::consumer::Effect<'c, (), sqlx::Error> {
    Box::pin(async move {
        sqlx::query("INSERT INTO consumed (message_id, body) VALUES ($1, $2)")
            .bind(id)
            .bind(body)
            .execute(tx)
            .await
            .map(|_| ())
    })
}

async fn consumer(db: &Db) -> Consumer {
    let c = Consumer::new(db.pool.clone(), "billing")
        .max_redeliveries(2)
        .build()
        .unwrap();
    c.migrate().await.unwrap();
    c
}

#[tokio::test]
async fn consumer_killed_between_commit_and_ack_skips_the_redelivery() {
    let db = Db::new().await;
    let broker = Broker::new().await;
    let publisher = AmqpPublisher::new(amqp_url());
    publisher
        .publish("m-1", &Message::new("", broker.queue.as_str(), "hello"))
        .await
        .unwrap();

    let crashing = Consumer::new(db.pool.clone(), "billing")
        .__crash_after_commit(|_| true)
        .build()
        .unwrap();
    crashing.migrate().await.unwrap();
    let mut sub = Subscription::new(&broker.queue).await;
    let delivery = sub.next().await;
    assert!(!delivery.redelivered);
    let outcome = crashing
        .process(delivery, |tx, body| record(tx, body, "m-1".into()))
        .await
        .unwrap();
    assert!(matches!(outcome, Processed::Crashed));
    // The process dies: its connection goes, and the broker requeues the message.
    sub.close().await;

    let mut sub = Subscription::new(&broker.queue).await;
    let delivery = sub.next().await;
    assert!(delivery.redelivered);
    // A limit of no redelivery at all: an id already processed is still skipped and
    // acknowledged, never dead-lettered.
    let strict = Consumer::new(db.pool.clone(), "billing")
        .max_redeliveries(0)
        .build()
        .unwrap();
    let outcome = strict
        .process(delivery, |tx, body| record(tx, body, "m-1".into()))
        .await
        .unwrap();
    assert!(matches!(outcome, Processed::Duplicate), "{outcome:?}");
    sub.close().await;
    assert_eq!(db.consumed().await.get("m-1"), Some(&1));
    assert_eq!(broker.ready(&broker.queue).await, 0, "acknowledged");
    broker.cleanup().await;
}

#[tokio::test]
async fn a_poison_message_goes_to_the_dead_letter_queue() {
    let db = Db::new().await;
    let broker = Broker::new().await;
    AmqpPublisher::new(amqp_url())
        .publish("poison", &Message::new("", broker.queue.as_str(), "bad"))
        .await
        .unwrap();
    let consumer = consumer(&db).await;
    let (conn, _) = (
        Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap(),
        (),
    );
    let channel = conn.create_channel().await.unwrap();
    let mut consumed = channel
        .basic_consume(
            broker.queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut failures = 0;
    loop {
        let delivery = tokio::time::timeout(Duration::from_secs(10), consumed.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let outcome = consumer
            .process(delivery, |_tx, _body| {
                Box::pin(async { Err::<(), _>("cannot parse") })
            })
            .await
            .unwrap();
        match outcome {
            Processed::Failed(_) => failures += 1,
            Processed::DeadLettered(reason) => {
                assert_eq!(reason, "redelivered too often");
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    // The first delivery and two redeliveries failed; the third redelivery is over the limit.
    assert_eq!(failures, 3);
    let dead = crate::harness::eventually("the dead letter", Duration::from_secs(10), || async {
        broker.get(&format!("{}.dead", broker.queue)).await
    })
    .await;
    assert_eq!(dead, b"bad");
    assert!(db.consumed().await.is_empty());
    conn.close(200, "done".into()).await.unwrap();
    broker.cleanup().await;
}

#[tokio::test]
async fn a_message_without_an_id_is_dead_lettered() {
    let db = Db::new().await;
    let broker = Broker::new().await;
    broker
        .channel
        .basic_publish(
            "".into(),
            broker.queue.as_str().into(),
            BasicPublishOptions::default(),
            b"anonymous",
            BasicProperties::default(),
        )
        .await
        .unwrap();
    let mut sub = Subscription::new(&broker.queue).await;
    let delivery = sub.next().await;
    let outcome = consumer(&db)
        .await
        .process(delivery, |tx, body| record(tx, body, "none".into()))
        .await
        .unwrap();
    assert!(matches!(
        outcome,
        Processed::DeadLettered("the message has no id")
    ));
    let dead = crate::harness::eventually("the dead letter", Duration::from_secs(10), || async {
        broker.get(&format!("{}.dead", broker.queue)).await
    })
    .await;
    assert_eq!(dead, b"anonymous");
    sub.close().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn an_order_reaches_the_downstream_and_the_consumer_once() {
    let db = Db::new().await;
    let broker = Broker::new().await;
    let (addr, seen) = downstream().await;
    let app = order_service(&db, addr, Some(broker.queue.clone())).await;
    for i in 0..5 {
        place_order(&app, &format!("order-{i}"), &format!("{i}")).await;
        place_order(&app, &format!("order-{i}"), &format!("{i}")).await; // a retry
    }
    let relay = OutboxRelay::new(db.pool.clone())
        .http_client(client())
        .publisher(AmqpPublisher::new(amqp_url()))
        .build()
        .unwrap();
    let pass = relay.run_once().await.unwrap();
    assert_eq!((pass.taken, pass.succeeded), (10, 10));
    assert_eq!(seen.total_effects(), 5);
    let consumer = consumer(&db).await;
    let mut sub = Subscription::new(&broker.queue).await;
    for _ in 0..5 {
        let delivery = sub.next().await;
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .unwrap()
            .to_string();
        let outcome = consumer
            .process(delivery, |tx, body| record(tx, body, id))
            .await
            .unwrap();
        assert!(matches!(outcome, Processed::Done(())));
    }
    let consumed = db.consumed().await;
    assert_eq!(consumed.len(), 5);
    assert!(consumed.values().all(|n| *n == 1));
    // The message ids are the rows' child keys.
    let keys = db.keys().await;
    assert!(consumed.keys().all(|id| keys.contains(id)));
    sub.close().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn processed_ids_are_swept_after_the_retention() {
    let db = Db::new().await;
    let broker = Broker::new().await;
    AmqpPublisher::new(amqp_url())
        .publish("old", &Message::new("", broker.queue.as_str(), "x"))
        .await
        .unwrap();
    let consumer = Consumer::new(db.pool.clone(), "billing")
        .publisher_dead_letter_age(Duration::from_millis(1))
        .redelivery_horizon(Duration::from_millis(1))
        .retention(Duration::from_millis(5))
        .build()
        .unwrap();
    consumer.migrate().await.unwrap();
    let mut sub = Subscription::new(&broker.queue).await;
    let delivery = sub.next().await;
    let outcome = consumer
        .process(delivery, |tx, body| record(tx, body, "old".into()))
        .await
        .unwrap();
    assert!(matches!(outcome, Processed::Done(())));
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(consumer.sweep(100).await.unwrap(), 1);
    // Gone: a second sweep finds nothing.
    assert_eq!(consumer.sweep(100).await.unwrap(), 0);
    sub.close().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn a_spawned_sweeper_deletes_processed_ids_past_the_retention() {
    let db = Db::new().await;
    let broker = Broker::new().await;
    let publisher = AmqpPublisher::new(amqp_url());
    for id in ["a", "b"] {
        publisher
            .publish(id, &Message::new("", broker.queue.as_str(), id))
            .await
            .unwrap();
    }
    let consumer = Consumer::new(db.pool.clone(), "billing")
        .publisher_dead_letter_age(Duration::from_millis(1))
        .redelivery_horizon(Duration::from_millis(1))
        .retention(Duration::from_millis(5))
        .sweep_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    consumer.migrate().await.unwrap();
    let mut sub = Subscription::new(&broker.queue).await;
    for _ in 0..2 {
        let delivery = sub.next().await;
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .unwrap()
            .to_string();
        let outcome = consumer
            .process(delivery, |tx, body| record(tx, body, id))
            .await
            .unwrap();
        assert!(matches!(outcome, Processed::Done(())));
    }
    // Another consumer's ids are not its to sweep.
    sqlx::query("INSERT INTO retrysafe_processed (consumer, message_id) VALUES ('shipping', 'a')")
        .execute(&db.pool)
        .await
        .unwrap();
    let ids = || async {
        let rows: Vec<String> =
            sqlx::query_scalar("SELECT consumer FROM retrysafe_processed ORDER BY consumer")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        rows
    };
    assert_eq!(ids().await, ["billing", "billing", "shipping"]);
    let sweeper = consumer.spawn_sweeper();
    eventually("the sweep", Duration::from_secs(30), || async {
        (ids().await == ["shipping"]).then_some(())
    })
    .await;
    assert!(!sweeper.is_finished());
    sweeper.stop().await;
    sub.close().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn a_sweep_interval_of_zero_is_refused() {
    let pool = retrysafe_postgres::sqlx::postgres::PgPoolOptions::new()
        .connect_lazy(&database_url())
        .unwrap();
    let error = Consumer::new(pool, "billing")
        .sweep_interval(Duration::ZERO)
        .build()
        .unwrap_err();
    assert_eq!(error.fields().collect::<Vec<_>>(), ["sweep_interval"]);
}
