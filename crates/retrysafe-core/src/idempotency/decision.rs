use http::StatusCode;

/// A response extension a handler inserts when it knows its call had no effect: the key
/// is released and a retry runs the handler again.
///
/// ```
/// use retrysafe::idempotency::NoEffect;
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
    /// use retrysafe_core::__private::Disposition;
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
