//! `retry-point`: a total function of any bytes; only `caller` (trimmed, any case) is
//! the retry point.
#![no_main]

use libfuzzer_sys::fuzz_target;
use retrysafe_core::wire::parse_retry_point;

fuzz_target!(|data: &[u8]| {
    if parse_retry_point(data).is_some() {
        let trimmed = data.trim_ascii();
        assert!(trimmed.eq_ignore_ascii_case(b"caller"), "{data:?}");
    }
});
