//! `grpc-retry-pushback-ms`: a total function of any bytes; a delay is at most
//! `MAX_RETRY_AFTER` and survives its own encoding (whole milliseconds).
#![no_main]

use libfuzzer_sys::fuzz_target;
use retrysafe_core::wire::{MAX_RETRY_AFTER, Pushback, encode_pushback, parse_pushback};

fuzz_target!(|data: &[u8]| {
    if let Pushback::After(delay) = parse_pushback(data) {
        assert!(delay <= MAX_RETRY_AFTER);
        let back = parse_pushback(encode_pushback(delay).as_bytes());
        assert_eq!(back, Pushback::After(delay));
    }
});
