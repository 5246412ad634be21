//! The outbox's RabbitMQ publisher, and the consumer's AMQP messages (feature `amqp`).
//!
//! Built on [lapin](https://docs.rs/lapin): of the Rust AMQP 0-9-1 clients it is the
//! best kept — maintained by the amqp-rs organisation since 2016 with steady releases,
//! the most used by far, tokio-native, and it implements what an outbox needs
//! natively: publisher confirms, `mandatory` publishing with `basic.return` matched to
//! its confirm, and per-delivery acknowledgement. (amqprs is younger and less used;
//! amiquip is blocking and unmaintained.)
//!
//! [`AmqpPublisher`] publishes each message **persistent** (delivery mode 2) and
//! **`mandatory`** on a channel in confirm mode, and succeeds only on the broker's
//! confirm: a message no queue took comes back as `basic.return` and is a failed send
//! ([`PublishError::Returned`]), as is a negative confirm or a connection lost before
//! the confirm. The message id is the row's child key. A lost connection is opened
//! again on the next publish.
//!
//! A lapin [`Delivery`] is an [`Inbound`] message for the idempotent
//! [`Consumer`](crate::consumer::Consumer): `dead_letter` rejects it without requeue,
//! so the queue's dead-letter exchange takes it ([`declare_queue`] declares a queue
//! with one).
//!
//! ```no_run
//! use retrysafe::postgres::outbox::amqp::{AmqpPublisher, declare_queue};
//! use retrysafe::postgres::outbox::{Message, Publisher};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let publisher = AmqpPublisher::new("amqp://guest:guest@127.0.0.1:5672/%2f");
//! declare_queue(&publisher.channel().await?, "orders").await?;
//! publisher.publish("key-1", &Message::new("", "orders", "created")).await?;
//! // No queue is bound to this routing key: the broker returns the message.
//! assert!(publisher.publish("key-2", &Message::new("", "nowhere", "x")).await.is_err());
//! # Ok(()) }
//! ```

use std::fmt;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicNackOptions, BasicPublishOptions, BasicRejectOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use retrysafe_core::error::BoxError;
use tokio::sync::Mutex;

use super::{Message, PublishError, Publisher};
use crate::consumer::Inbound;

/// The lapin this module is built on.
pub use lapin;

/// Publishes outbox messages to RabbitMQ: persistent, `mandatory`, with publisher
/// confirms; see the [module docs](self).
///
/// ```
/// use std::time::Duration;
/// use retrysafe::postgres::outbox::amqp::AmqpPublisher;
///
/// let publisher = AmqpPublisher::new("amqp://127.0.0.1:5672/%2f")
///     .confirm_timeout(Duration::from_secs(2));
/// assert_eq!(publisher.uri(), "amqp://127.0.0.1:5672/%2f");
/// ```
pub struct AmqpPublisher {
    uri: String,
    confirm_timeout: Duration,
    open: Mutex<Option<(Connection, Channel)>>,
}

impl fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpPublisher")
            .field("confirm_timeout", &self.confirm_timeout)
            .finish_non_exhaustive()
    }
}

impl AmqpPublisher {
    /// A publisher to the broker at `uri`; it connects on first use (and again after
    /// a lost connection). Confirms are awaited up to 5 s.
    pub fn new(uri: impl Into<String>) -> Self {
        AmqpPublisher {
            uri: uri.into(),
            confirm_timeout: Duration::from_secs(5),
            open: Mutex::new(None),
        }
    }

    /// How long a publish waits for the broker's confirm (default 5 s).
    #[must_use]
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// The broker's URI.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// The publisher's channel (in confirm mode), connecting when there is none or it
    /// was lost.
    pub async fn channel(&self) -> Result<Channel, lapin::Error> {
        let mut open = self.open.lock().await;
        if let Some((conn, channel)) = open.as_ref()
            && conn.status().connected()
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        *open = None;
        let conn = Connection::connect(&self.uri, ConnectionProperties::default()).await?;
        let channel = conn.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        *open = Some((conn, channel.clone()));
        Ok(channel)
    }

    async fn forget(&self) {
        *self.open.lock().await = None;
    }

    async fn try_publish(&self, id: &str, message: &Message) -> Result<(), PublishError> {
        let channel = self.channel().await.map_err(PublishError::unavailable)?;
        let confirm = channel
            .basic_publish(
                ShortString::from(message.exchange()),
                ShortString::from(message.routing_key()),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                message.body(),
                properties(id, message),
            )
            .await
            .map_err(PublishError::unavailable)?;
        match tokio::time::timeout(self.confirm_timeout, confirm).await {
            Ok(Ok(Confirmation::Ack(None))) => Ok(()),
            Ok(Ok(Confirmation::Ack(Some(_)))) => Err(PublishError::Returned),
            Ok(Ok(Confirmation::Nack(_))) => Err(PublishError::Nacked),
            Ok(Ok(Confirmation::NotRequested)) => Err(PublishError::unavailable(
                "the channel is not in confirm mode",
            )),
            Ok(Err(e)) => Err(PublishError::unavailable(e)),
            Err(_) => Err(PublishError::unavailable("no confirm within the timeout")),
        }
    }
}

/// Persistent, with the message id and the message's headers (`content-type` as the
/// content type, the others as string headers).
fn properties(id: &str, message: &Message) -> BasicProperties {
    let mut headers = FieldTable::default();
    let mut props = BasicProperties::default()
        .with_message_id(ShortString::from(id))
        .with_delivery_mode(2);
    for (name, value) in message.headers() {
        if name == http::header::CONTENT_TYPE {
            if let Ok(v) = value.to_str() {
                props = props.with_content_type(ShortString::from(v));
            }
            continue;
        }
        headers.insert(
            ShortString::from(name.as_str()),
            AMQPValue::LongString(LongString::from(value.as_bytes().to_vec())),
        );
    }
    props.with_headers(headers)
}

impl Publisher for AmqpPublisher {
    async fn publish(&self, id: &str, message: &Message) -> Result<(), PublishError> {
        let result = self.try_publish(id, message).await;
        if let Err(PublishError::Unavailable(_)) = &result {
            // The channel may be broken: open a new one next time.
            self.forget().await;
        }
        result
    }
}

/// Declares durable queue `queue` whose rejected messages go to the durable queue
/// `{queue}.dead` (through the default exchange), and that queue. Idempotent.
pub async fn declare_queue(channel: &Channel, queue: &str) -> Result<(), lapin::Error> {
    let dead = format!("{queue}.dead");
    channel
        .queue_declare(
            ShortString::from(dead.as_str()),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await?;
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("x-dead-letter-exchange"),
        AMQPValue::LongString(LongString::from("")),
    );
    args.insert(
        ShortString::from("x-dead-letter-routing-key"),
        AMQPValue::LongString(LongString::from(dead.as_str())),
    );
    channel
        .queue_declare(
            ShortString::from(queue),
            QueueDeclareOptions::durable(),
            args,
        )
        .await?;
    Ok(())
}

impl Inbound for Delivery {
    fn message_id(&self) -> Option<&str> {
        self.properties
            .message_id()
            .as_ref()
            .map(ShortString::as_str)
    }

    fn redelivered(&self) -> bool {
        self.redelivered
    }

    fn body(&self) -> &[u8] {
        &self.data
    }

    async fn ack(&self) -> Result<(), BoxError> {
        settled(self.acker.ack(BasicAckOptions::default()).await)
    }

    async fn requeue(&self) -> Result<(), BoxError> {
        settled(
            self.acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                })
                .await,
        )
    }

    async fn dead_letter(&self) -> Result<(), BoxError> {
        settled(
            self.acker
                .reject(BasicRejectOptions { requeue: false })
                .await,
        )
    }
}

/// lapin answers `Ok(false)` for a delivery it can no longer settle: its channel closed
/// (or its consumer was dropped, which closes it), and the broker requeues it.
fn settled(done: Result<bool, lapin::Error>) -> Result<(), BoxError> {
    match done {
        Ok(true) => Ok(()),
        Ok(false) => Err("the delivery's channel is closed: the broker redelivers it".into()),
        Err(e) => Err(e.into()),
    }
}
