//! `request-timeout-ms`: parsing never panics; a value is at most `MAX_TIMEOUT`, and
//! encoding it gives a header that parses back to no more than it (rounded down).
#![no_main]

use libfuzzer_sys::fuzz_target;
use retrysafe_core::wire::{MAX_TIMEOUT, encode_request_timeout_ms, parse_request_timeout_ms};

fuzz_target!(|data: &[u8]| {
    if let Ok(timeout) = parse_request_timeout_ms(data) {
        assert!(timeout <= MAX_TIMEOUT);
        let encoded = encode_request_timeout_ms(timeout);
        let back = parse_request_timeout_ms(encoded.as_bytes());
        assert!(
            matches!(back, Ok(d) if d <= timeout),
            "{encoded:?} -> {back:?}"
        );
    }
});
