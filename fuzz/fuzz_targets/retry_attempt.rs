//! `retry-attempt`: parsing never panics; an accepted attempt number encodes and parses
//! back to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use retrysafe_core::wire::{encode_retry_attempt, parse_retry_attempt};

fuzz_target!(|data: &[u8]| {
    if let Some(attempt) = parse_retry_attempt(data) {
        let encoded = encode_retry_attempt(attempt);
        assert_eq!(parse_retry_attempt(encoded.as_bytes()), Some(attempt));
    }
});
