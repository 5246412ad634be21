//! `Failure::of`: the failure an error chain stands for.

use std::error::Error as StdError;
use std::fmt;

use retrysafe_core::classify::Failure;
use retrysafe_core::error::{BudgetExhausted, CircuitOpen, DeadlineExceeded, find};

use super::ms;

/// An error wrapping another, as transports nest them.
#[derive(Debug)]
struct Wrapped(Box<dyn StdError + Send + Sync + 'static>);

impl fmt::Display for Wrapped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("wrapped")
    }
}

impl StdError for Wrapped {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.0)
    }
}

pub(super) fn of(e: &(dyn StdError + 'static)) -> Failure {
    Failure::of(e, |_| None)
}

#[test]
fn failure_of_io_kinds() {
    use std::io::{Error, ErrorKind as K};
    for kind in [K::ConnectionRefused, K::AddrNotAvailable] {
        assert_eq!(of(&Error::from(kind)), Failure::ConnectFailed, "{kind:?}");
    }
    assert_eq!(of(&Error::from(K::NotFound)), Failure::Other);
    for kind in [
        K::ConnectionReset,
        K::ConnectionAborted,
        K::BrokenPipe,
        K::UnexpectedEof,
        K::NotConnected,
    ] {
        assert_eq!(of(&Error::from(kind)), Failure::NoResponse, "{kind:?}");
    }
    assert_eq!(of(&Error::from(K::TimedOut)), Failure::Timeout);
    assert_eq!(of(&Error::from(K::PermissionDenied)), Failure::Other);
    assert_eq!(of(&Error::other("boom")), Failure::Other);

    // A refused connection deep in a chain may be a dependency's, reported by a
    // service after it did its work: not "nothing sent" (the transport adapter's
    // recogniser vouches for its own connect errors).
    let nested = Wrapped(Box::new(Wrapped(Box::new(Error::from(
        K::ConnectionRefused,
    )))));
    assert_eq!(of(&nested), Failure::Other);
    let vouched = Failure::of(&nested, |e| {
        e.is::<Wrapped>().then_some(Failure::ConnectFailed)
    });
    assert_eq!(vouched, Failure::ConnectFailed);
    let nested = Wrapped(Box::new(Error::from(K::ConnectionReset)));
    assert_eq!(of(&nested), Failure::NoResponse);
}

#[test]
fn failure_of_our_errors_and_extra() {
    assert_eq!(of(&BudgetExhausted::new()), Failure::Local);
    assert_eq!(of(&CircuitOpen::new(ms(5))), Failure::Local);
    // A deadline given up by a layer of ours is not retried by another.
    assert_eq!(of(&DeadlineExceeded::new()), Failure::Local);
    assert_eq!(
        of(&Wrapped(Box::new(BudgetExhausted::new()))),
        Failure::Local
    );

    // The transport adapter's recogniser decides first.
    let refused = Failure::of(&std::io::Error::from(std::io::ErrorKind::TimedOut), |_| {
        Some(Failure::RefusedStream)
    });
    assert_eq!(refused, Failure::RefusedStream);

    // `find` looks through the chain.
    let boxed: Box<dyn StdError + Send + Sync> =
        Box::new(Wrapped(Box::new(CircuitOpen::new(ms(7)))));
    assert_eq!(find::<CircuitOpen>(&*boxed).unwrap().retry_in(), ms(7));
    assert!(find::<BudgetExhausted>(&*boxed).is_none());
    assert_eq!(BudgetExhausted::new().to_string(), "retry budget exhausted");
    assert_eq!(DeadlineExceeded::new().to_string(), "deadline exceeded");
    assert_eq!(
        CircuitOpen::new(ms(7)).to_string(),
        "circuit open (retry in 7 ms)"
    );
}
