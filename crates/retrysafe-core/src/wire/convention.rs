use http::HeaderMap;
use http::header::{HeaderName, RETRY_AFTER};

/// The header names of the retrysafe wire convention.
///
/// Every layer takes the same `Convention`; the defaults are the names listed in the
/// [module docs](super). A deployment can rename a header, for example to interoperate with
/// `x-envoy-expected-rq-timeout-ms`.
///
/// ```
/// use retrysafe::wire::Convention;
/// use http::HeaderName;
///
/// let c = Convention::default()
///     .with_request_timeout_ms(HeaderName::from_static("x-envoy-expected-rq-timeout-ms"));
/// assert_eq!(c.request_timeout_ms(), "x-envoy-expected-rq-timeout-ms");
/// assert_eq!(c.idempotency_key(), "idempotency-key");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Convention {
    idempotency_key: HeaderName,
    idempotent_replayed: HeaderName,
    retry_attempt: HeaderName,
    grpc_previous_rpc_attempts: HeaderName,
    do_not_retry: HeaderName,
    retry_point: HeaderName,
    request_timeout_ms: HeaderName,
    grpc_timeout: HeaderName,
    retry_after: HeaderName,
    grpc_retry_pushback_ms: HeaderName,
}

impl Default for Convention {
    fn default() -> Self {
        Self {
            idempotency_key: HeaderName::from_static("idempotency-key"),
            idempotent_replayed: HeaderName::from_static("idempotent-replayed"),
            retry_attempt: HeaderName::from_static("retry-attempt"),
            grpc_previous_rpc_attempts: HeaderName::from_static("grpc-previous-rpc-attempts"),
            do_not_retry: HeaderName::from_static("do-not-retry"),
            retry_point: HeaderName::from_static("retry-point"),
            request_timeout_ms: HeaderName::from_static("request-timeout-ms"),
            grpc_timeout: HeaderName::from_static("grpc-timeout"),
            retry_after: RETRY_AFTER,
            grpc_retry_pushback_ms: HeaderName::from_static("grpc-retry-pushback-ms"),
        }
    }
}

macro_rules! names {
    ($($(#[$doc:meta])* $field:ident, $with:ident;)*) => {
        impl Convention {
            $(
                $(#[$doc])*
                #[doc(hidden)]
                pub fn $field(&self) -> &HeaderName {
                    &self.$field
                }

                #[doc = concat!("Replaces the name returned by [`Convention::", stringify!($field), "`].")]
                #[must_use]
                pub fn $with(mut self, name: HeaderName) -> Self {
                    self.$field = name;
                    self
                }
            )*
        }
    };
}

names! {
    /// `idempotency-key` (request): the client's token for one logical operation.
    idempotency_key, with_idempotency_key;
    /// `idempotent-replayed` (response): this response is a stored one, replayed.
    idempotent_replayed, with_idempotent_replayed;
    /// `retry-attempt` (request): the 1-based attempt number, sent on attempts 2 and later.
    retry_attempt, with_retry_attempt;
    /// `grpc-previous-rpc-attempts` (gRPC request): attempts made before this one.
    grpc_previous_rpc_attempts, with_grpc_previous_rpc_attempts;
    /// `do-not-retry` (response): the caller must not retry this request, at any layer.
    do_not_retry, with_do_not_retry;
    /// `retry-point` (request): `caller` means the callee must not retry its own calls.
    retry_point, with_retry_point;
    /// `request-timeout-ms` (request): the time the caller has left, in milliseconds.
    request_timeout_ms, with_request_timeout_ms;
    /// `grpc-timeout` (gRPC request): the time the caller has left.
    grpc_timeout, with_grpc_timeout;
    /// `retry-after` (response): a minimum delay before a retry.
    retry_after, with_retry_after;
    /// `grpc-retry-pushback-ms` (gRPC response): the exact delay, or do not retry.
    grpc_retry_pushback_ms, with_grpc_retry_pushback_ms;
}

impl Convention {
    /// Whether `other` names the timeout headers (`request-timeout-ms`, `grpc-timeout`)
    /// as this convention does: then a value one of them wrote is what the other would
    /// read back, and a layer may take the writer's word instead of parsing the header.
    ///
    /// ```
    /// use http::HeaderName;
    /// use retrysafe::wire::Convention;
    /// let envoy = Convention::default()
    ///     .with_request_timeout_ms(HeaderName::from_static("x-envoy-expected-rq-timeout-ms"));
    /// assert!(Convention::default().same_timeout_names(&Convention::default()));
    /// assert!(!Convention::default().same_timeout_names(&envoy));
    /// ```
    #[doc(hidden)]
    #[must_use]
    pub fn same_timeout_names(&self, other: &Convention) -> bool {
        self.request_timeout_ms == other.request_timeout_ms
            && self.grpc_timeout == other.grpc_timeout
    }

    /// Removes from `headers` every inbound header that only a trusted peer may send:
    /// `retry-point`, `retry-attempt`, `grpc-previous-rpc-attempts`,
    /// `request-timeout-ms` and `grpc-timeout`.
    ///
    /// Use it (or the `EdgeLayer`) at the public edge, so that no outsider can drain a
    /// shared budget with forged `retry-attempt` or switch off internal retries.
    ///
    /// ```
    /// use retrysafe::wire::Convention;
    /// let mut h = http::HeaderMap::new();
    /// h.insert("retry-attempt", http::HeaderValue::from_static("3"));
    /// h.insert("content-type", http::HeaderValue::from_static("text/plain"));
    /// Convention::default().strip_inbound(&mut h);
    /// assert!(h.get("retry-attempt").is_none());
    /// assert!(h.get("content-type").is_some());
    /// ```
    #[doc(hidden)]
    pub fn strip_inbound(&self, headers: &mut HeaderMap) {
        for name in [
            &self.retry_point,
            &self.retry_attempt,
            &self.grpc_previous_rpc_attempts,
            &self.request_timeout_ms,
            &self.grpc_timeout,
        ] {
            headers.remove(name);
        }
    }
}
