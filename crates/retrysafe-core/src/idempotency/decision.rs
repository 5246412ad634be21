use http::StatusCode;

use super::{Completed, Fingerprint, Record, StoredResponse};

/// What an existing record means for a new copy of a request (the decision table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision<'a> {
    /// Same fingerprint, completed: replay this response.
    Replay(&'a StoredResponse),
    /// Same fingerprint, still running: answer 409 (or wait and look again).
    InFlight,
    /// Different fingerprint (running or completed): 422, do not retry.
    Mismatch,
    /// Same fingerprint, outcome unknown: a stable 500 problem, do not retry.
    OutcomeUnknown,
    /// Same fingerprint, completed but too large to store: 409 problem, do not retry.
    NotStored,
}

/// Decides what an existing `record` means for a request with fingerprint `fp`.
///
/// ```
/// use retrysafe_core::idempotency::*;
/// let fp = Fingerprint::from_bytes([1; 32]);
/// let other = Fingerprint::from_bytes([2; 32]);
/// let rec = Record::OutcomeUnknown(OutcomeUnknown { fingerprint: fp });
/// assert_eq!(decide(&rec, &fp), Decision::OutcomeUnknown);
/// assert_eq!(decide(&rec, &other), Decision::Mismatch);
/// ```
pub fn decide<'a>(record: &'a Record, fp: &Fingerprint) -> Decision<'a> {
    if record.fingerprint() != fp {
        return Decision::Mismatch;
    }
    match record {
        Record::InProgress(_) => Decision::InFlight,
        Record::Completed(Completed {
            response: Some(r), ..
        }) => Decision::Replay(r),
        Record::Completed(Completed { response: None, .. }) => Decision::NotStored,
        Record::OutcomeUnknown(_) => Decision::OutcomeUnknown,
    }
}

/// A response extension a handler inserts when it knows its call had no effect: the key
/// is released and a retry runs the handler again.
///
/// ```
/// use retrysafe_core::idempotency::NoEffect;
/// let mut res = http::Response::new(());
/// res.extensions_mut().insert(NoEffect);
/// assert!(res.extensions().get::<NoEffect>().is_some());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoEffect;

/// What becomes of a record once its handler answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// 2xx, 3xx, or a 4xx other than 401/403/408/429: stored for the retention.
    Store,
    /// 401, 403, 429, or a [`NoEffect`] response: released, a retry runs again.
    Release,
    /// 5xx or 408 without [`NoEffect`] (and panics): `outcome_unknown`.
    OutcomeUnknown,
}

impl Disposition {
    /// The disposition of a handler's answer.
    ///
    /// ```
    /// use http::StatusCode;
    /// use retrysafe_core::idempotency::Disposition;
    /// assert_eq!(Disposition::of(StatusCode::CREATED, false), Disposition::Store);
    /// assert_eq!(Disposition::of(StatusCode::UNPROCESSABLE_ENTITY, false), Disposition::Store);
    /// assert_eq!(Disposition::of(StatusCode::TOO_MANY_REQUESTS, false), Disposition::Release);
    /// assert_eq!(Disposition::of(StatusCode::BAD_GATEWAY, false), Disposition::OutcomeUnknown);
    /// assert_eq!(Disposition::of(StatusCode::BAD_GATEWAY, true), Disposition::Release);
    /// ```
    pub fn of(status: StatusCode, no_effect: bool) -> Disposition {
        if no_effect {
            return Disposition::Release;
        }
        match status {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN | StatusCode::TOO_MANY_REQUESTS => {
                Disposition::Release
            }
            StatusCode::REQUEST_TIMEOUT => Disposition::OutcomeUnknown,
            s if s.is_server_error() => Disposition::OutcomeUnknown,
            _ => Disposition::Store,
        }
    }
}
