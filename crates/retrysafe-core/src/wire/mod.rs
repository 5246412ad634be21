//! The wire convention: header names, and total parsers and encoders of their values.
//!
//! Every parser here is a pure function that is *total*: any input — empty, huge,
//! non-UTF-8, negative, overflowing — gives a documented result and never panics.
//! Encoders never round a time up: a caller is never told it has more time than it has.
//!
//! | header | on | parser | encoder |
//! |---|---|---|---|
//! | `idempotency-key` | request | [`IdempotencyKey::parse`] | [`IdempotencyKey::to_header_value`] |
//! | `idempotent-replayed` | response | [`parse_flag`] | `true` |
//! | `retry-attempt` | request | [`parse_retry_attempt`] | [`encode_retry_attempt`] |
//! | `do-not-retry` | response | [`parse_do_not_retry`] | [`DO_NOT_RETRY_VALUE`] |
//! | `retry-point` | request | [`parse_retry_point`] | [`RETRY_POINT_CALLER`] |
//! | `request-timeout-ms` | request | [`parse_request_timeout_ms`] | [`encode_request_timeout_ms`] |
//! | `grpc-timeout` | request | [`parse_grpc_timeout`] | [`encode_grpc_timeout`] |
//! | `retry-after` | response | [`parse_retry_after`] | [`encode_retry_after`] |
//! | `grpc-retry-pushback-ms` | response | [`parse_pushback`] | [`encode_pushback`] |

mod ascii;
mod convention;
mod flags;
mod key;
mod retry_after;
mod timeout;
pub(crate) use timeout::timeout_as_read;

pub use convention::Convention;
pub use flags::{
    DO_NOT_RETRY_VALUE, Pushback, REPLAYED_VALUE, RETRY_POINT_CALLER, RetryPoint, encode_pushback,
    encode_retry_attempt, parse_do_not_retry, parse_flag, parse_pushback, parse_retry_attempt,
    parse_retry_point,
};
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LEN};
pub use retry_after::{MAX_RETRY_AFTER, RetryAfter, encode_retry_after, parse_retry_after};
pub use timeout::{
    MAX_TIMEOUT, TimeoutError, encode_grpc_timeout, encode_request_timeout_ms, parse_grpc_timeout,
    parse_request_timeout_ms,
};
