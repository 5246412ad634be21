//! `Idempotency-Key`: parsing never panics; an accepted key is at most `MAX_KEY_LEN`
//! characters and survives its own header encoding unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use retrysafe_core::wire::{IdempotencyKey, MAX_KEY_LEN};

fuzz_target!(|data: &[u8]| {
    if let Ok(key) = IdempotencyKey::parse(data) {
        assert!(!key.as_str().is_empty() && key.as_str().len() <= MAX_KEY_LEN);
        let again = IdempotencyKey::parse(key.to_header_value().as_bytes());
        assert_eq!(again.as_ref().map(IdempotencyKey::as_str), Ok(key.as_str()));
    }
});
