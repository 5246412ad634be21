//! The errors a [`FaultLayer`](super::FaultLayer) injects.

use std::error::Error as StdError;
use std::fmt;
use std::io;

/// A reply the fault layer dropped after the inner service had answered: the call ran
/// (its effect happened), the caller never saw the answer.
///
/// Its [`source`](StdError::source) is an [`io::Error`] of kind
/// [`UnexpectedEof`](io::ErrorKind::UnexpectedEof), as a connection that closed before
/// the response arrived reports it, so a retry layer classifies it as a transport
/// failure with no response: retried for a safe request (an idempotent method, or one
/// carrying an `Idempotency-Key`) and for nothing else. Find it in an error chain with
/// [`find`](retrysafe_core::error::find).
#[derive(Debug)]
pub struct ReplyLost {
    source: io::Error,
}

impl ReplyLost {
    pub(super) fn new() -> Self {
        ReplyLost {
            source: io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the connection closed before the response arrived",
            ),
        }
    }
}

impl fmt::Display for ReplyLost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("reply lost after the call ran (injected by the fault layer)")
    }
}

impl StdError for ReplyLost {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&self.source)
    }
}

/// A connection the fault layer reset before the request reached the inner service:
/// nothing ran.
///
/// Its [`source`](StdError::source) is an [`io::Error`] of kind
/// [`ConnectionReset`](io::ErrorKind::ConnectionReset). A real client cannot tell a
/// reset before the request from one after it, so it is classified as a lost reply is:
/// retried only for a safe request.
#[derive(Debug)]
pub struct ConnectionReset {
    source: io::Error,
}

impl ConnectionReset {
    pub(super) fn new() -> Self {
        ConnectionReset {
            source: io::Error::new(io::ErrorKind::ConnectionReset, "connection reset by peer"),
        }
    }
}

impl fmt::Display for ConnectionReset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("connection reset before the request was sent (injected by the fault layer)")
    }
}

impl StdError for ConnectionReset {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&self.source)
    }
}
