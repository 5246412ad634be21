//! [`Inbound`]: a message as a broker delivered it.

use std::future::Future;

use retrysafe_core::error::BoxError;

/// A delivered message, as [`Consumer::process`](super::Consumer::process) needs it:
/// its id, whether the broker delivered it before, its body, and the three ways to
/// settle it with the broker.
///
/// ```
/// use std::sync::Mutex;
/// use retrysafe::postgres::consumer::Inbound;
/// use retrysafe::BoxError;
///
/// /// A message of an in-process queue.
/// struct Local { id: Option<String>, body: Vec<u8>, settled: Mutex<Option<&'static str>> }
///
/// impl Inbound for Local {
///     fn message_id(&self) -> Option<&str> { self.id.as_deref() }
///     fn redelivered(&self) -> bool { false }
///     fn body(&self) -> &[u8] { &self.body }
///     async fn ack(&self) -> Result<(), BoxError> { *self.settled.lock().unwrap() = Some("ack"); Ok(()) }
///     async fn requeue(&self) -> Result<(), BoxError> { *self.settled.lock().unwrap() = Some("requeue"); Ok(()) }
///     async fn dead_letter(&self) -> Result<(), BoxError> { *self.settled.lock().unwrap() = Some("dead"); Ok(()) }
/// }
///
/// let m = Local { id: Some("k1".into()), body: b"x".to_vec(), settled: Mutex::new(None) };
/// assert_eq!(m.message_id(), Some("k1"));
/// assert_eq!(m.body(), b"x");
/// ```
pub trait Inbound: Send + Sync {
    /// The message id (the outbox's child key), if it has one.
    fn message_id(&self) -> Option<&str>;
    /// Whether the broker delivered it before (to this or another consumer).
    fn redelivered(&self) -> bool;
    /// The body.
    fn body(&self) -> &[u8];
    /// Acknowledges it: the broker forgets it.
    fn ack(&self) -> impl Future<Output = Result<(), BoxError>> + Send;
    /// Gives it back to the broker for a later delivery.
    fn requeue(&self) -> impl Future<Output = Result<(), BoxError>> + Send;
    /// Sends it to the dead-letter queue.
    fn dead_letter(&self) -> impl Future<Output = Result<(), BoxError>> + Send;
}
