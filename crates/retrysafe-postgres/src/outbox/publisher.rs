//! [`Publisher`]: how an [`OutboxRelay`](super::OutboxRelay) hands messages to a broker.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use retrysafe_core::error::BoxError;

use super::Message;

/// Publishes the outbox's [`Message`]s to a broker. A publish succeeds only when the
/// broker has taken responsibility for the message (a publisher confirm, for AMQP);
/// any failure is retried by the relay with backoff, so a publisher need not retry.
///
/// `id` is the row's child key: publish it as the message id, so that an idempotent
/// consumer ([`Consumer`](crate::consumer::Consumer)) skips a message sent twice.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use retrysafe::postgres::outbox::{Message, PublishError, Publisher};
///
/// /// Collects what it is given (a stand-in for a broker).
/// #[derive(Clone, Default)]
/// struct Collect(Arc<Mutex<Vec<String>>>);
///
/// impl Publisher for Collect {
///     async fn publish(&self, id: &str, message: &Message) -> Result<(), PublishError> {
///         self.0.lock().unwrap().push(format!("{id} {}", message.routing_key()));
///         Ok(())
///     }
/// }
///
/// # tokio_test_block_on(async {
/// let collect = Collect::default();
/// collect.publish("k1", &Message::new("", "orders", "x")).await.unwrap();
/// assert_eq!(*collect.0.lock().unwrap(), ["k1 orders"]);
/// # });
/// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
/// # }
/// ```
pub trait Publisher: Send + Sync + 'static {
    /// Publishes `message` with message id `id`; `Ok` once the broker confirmed it.
    fn publish(
        &self,
        id: &str,
        message: &Message,
    ) -> impl Future<Output = Result<(), PublishError>> + Send;
}

/// Why a publish failed. Every kind is retried by the relay.
///
/// ```
/// use retrysafe::postgres::outbox::PublishError;
///
/// assert_eq!(PublishError::Returned.to_string(), "the broker returned the message: no queue took it");
/// let e = PublishError::unavailable("connection reset");
/// assert_eq!(e.to_string(), "the broker is unavailable: connection reset");
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum PublishError {
    /// A `mandatory` message no queue took (the broker returned it).
    Returned,
    /// The broker refused the message (a negative confirm).
    Nacked,
    /// No connection, or it failed before the confirm arrived.
    Unavailable(BoxError),
}

impl PublishError {
    /// An [`Unavailable`](PublishError::Unavailable) error.
    pub fn unavailable(e: impl Into<BoxError>) -> Self {
        PublishError::Unavailable(e.into())
    }
}

impl fmt::Display for PublishError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PublishError::Returned => {
                f.write_str("the broker returned the message: no queue took it")
            }
            PublishError::Nacked => f.write_str("the broker refused the message"),
            PublishError::Unavailable(e) => write!(f, "the broker is unavailable: {e}"),
        }
    }
}

impl std::error::Error for PublishError {}

/// A [`Publisher`] behind a pointer, for the relay.
pub(crate) type BoxPublish<'a> =
    Pin<Box<dyn Future<Output = Result<(), PublishError>> + Send + 'a>>;

/// Object-safe form of [`Publisher`].
pub(crate) trait DynPublisher: Send + Sync + 'static {
    fn publish_boxed<'a>(&'a self, id: &'a str, message: &'a Message) -> BoxPublish<'a>;
}

impl<P: Publisher> DynPublisher for P {
    fn publish_boxed<'a>(&'a self, id: &'a str, message: &'a Message) -> BoxPublish<'a> {
        Box::pin(self.publish(id, message))
    }
}
