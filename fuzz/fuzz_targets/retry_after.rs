//! `retry-after`: parsing never panics; any delay it yields is at most `MAX_RETRY_AFTER`,
//! and an encoded delay parses back to itself (whole seconds).
#![no_main]

use std::time::{Duration, SystemTime};

use libfuzzer_sys::fuzz_target;
use retrysafe_core::wire::{MAX_RETRY_AFTER, RetryAfter, encode_retry_after, parse_retry_after};

fuzz_target!(|data: &[u8]| {
    if let Some(after) = parse_retry_after(data) {
        for now in [SystemTime::UNIX_EPOCH, SystemTime::now()] {
            assert!(after.delay_from(now) <= MAX_RETRY_AFTER);
        }
        if let RetryAfter::Delay(delay) = after {
            let encoded = encode_retry_after(delay);
            let back = parse_retry_after(encoded.as_bytes());
            assert_eq!(
                back,
                Some(RetryAfter::Delay(Duration::from_secs(delay.as_secs())))
            );
        }
    }
});
