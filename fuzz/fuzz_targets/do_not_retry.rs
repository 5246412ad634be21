//! `do-not-retry` and the other flags: total functions of any bytes (no panic), and an
//! absent header is never a mark.
#![no_main]

use libfuzzer_sys::fuzz_target;
use retrysafe_core::wire::{parse_do_not_retry, parse_flag};

fuzz_target!(|data: &[u8]| {
    let _ = parse_do_not_retry(Some(data));
    let _ = parse_flag(Some(data));
    assert!(!parse_do_not_retry(None));
});
