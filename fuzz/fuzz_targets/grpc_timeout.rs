//! `grpc-timeout`: parsing never panics; a value is at most `MAX_TIMEOUT`, and encoding
//! it gives a valid header that parses back to no more than it (encoders round down).
#![no_main]

use libfuzzer_sys::fuzz_target;
use retrysafe_core::wire::{MAX_TIMEOUT, encode_grpc_timeout, parse_grpc_timeout};

fuzz_target!(|data: &[u8]| {
    if let Ok(timeout) = parse_grpc_timeout(data) {
        assert!(timeout <= MAX_TIMEOUT);
        let encoded = encode_grpc_timeout(timeout);
        let back = parse_grpc_timeout(encoded.as_bytes());
        assert!(
            matches!(back, Ok(d) if d <= timeout),
            "{encoded:?} -> {back:?}"
        );
    }
});
