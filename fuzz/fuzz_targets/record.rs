//! The idempotency record decoder (what a store hands back, possibly corrupted):
//! decoding never panics, and a decoded record encodes to bytes that decode to the
//! same record, of the length `encoded_len` says.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use retrysafe_core::idempotency::Record;

fuzz_target!(|data: &[u8]| {
    if let Ok(record) = Record::decode(Bytes::copy_from_slice(data)) {
        let encoded = record.encode();
        assert_eq!(encoded.len(), record.encoded_len());
        assert_eq!(Record::decode(encoded).as_ref(), Ok(&record));
    }
});
