//! Recognising transport failures in an error chain.

use std::error::Error as StdError;

use retrysafe_core::classify::Failure;

/// What kind of transport failure `error` is: walks the `source()` chain for our own
/// local errors, `std::io::Error` kinds, hyper-util's connect errors, hyper's "closed
/// before a response" errors, h2's `REFUSED_STREAM`, and with the `tonic` feature
/// tonic's `ConnectError` and `TimeoutExpired`.
///
/// ```
/// use retrysafe::classify::Failure;
/// use retrysafe::retry::failure_of;
///
/// let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
/// assert_eq!(failure_of(&refused), Failure::ConnectFailed);
/// let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
/// assert_eq!(failure_of(&reset), Failure::NoResponse);
/// ```
pub fn failure_of(error: &(dyn StdError + 'static)) -> Failure {
    Failure::of(error, |e| {
        // A tonic `Channel` wraps its connect step's errors, and its own timer.
        #[cfg(feature = "tonic")]
        {
            if e.is::<tonic::ConnectError>() {
                return Some(Failure::ConnectFailed);
            }
            if e.is::<tonic::TimeoutExpired>() {
                return Some(Failure::Timeout);
            }
        }
        if let Some(h2) = e.downcast_ref::<h2::Error>()
            && h2.reason() == Some(h2::Reason::REFUSED_STREAM)
        {
            return Some(Failure::RefusedStream);
        }
        if let Some(legacy) = e.downcast_ref::<hyper_util::client::legacy::Error>()
            && legacy.is_connect()
        {
            return Some(Failure::ConnectFailed);
        }
        if let Some(hyper) = e.downcast_ref::<hyper::Error>() {
            // An h2 error below decides first (REFUSED_STREAM is retryable for any
            // request); otherwise a connection that closed before the response.
            if hyper.source().is_some_and(|s| s.is::<h2::Error>()) {
                return None;
            }
            if hyper.is_incomplete_message() || hyper.is_closed() || hyper.is_canceled() {
                return Some(Failure::NoResponse);
            }
            if hyper.is_timeout() {
                return Some(Failure::Timeout);
            }
        }
        None
    })
}
