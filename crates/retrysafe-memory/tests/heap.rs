//! The byte accounting of the `MemoryStore` against its real heap: the live bytes a
//! fill leaves allocated (counted by a counting allocator, malloc's own headers not
//! included) stay within the weight the store counts for its records and tombstones.
//! One test in this binary, so that nothing else allocates meanwhile.
#![allow(clippy::print_stdout, clippy::cast_precision_loss)]

use std::alloc::System;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use retrysafe_core::idempotency::{
    CommitPoint, Completed, Fingerprint, RecordId, StoredResponse, Token,
};
use retrysafe_core::store::{Claim, IdempotencyStore};
use retrysafe_memory::MemoryStore;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const RETENTION: Duration = Duration::from_secs(3600);

fn id(i: u64) -> RecordId {
    let mut b = [0u8; 32];
    // Spread over the shards and the hash tables as SHA-256 ids are.
    let mixed = i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    b[..8].copy_from_slice(&mixed.to_le_bytes());
    b[8..16].copy_from_slice(&i.to_le_bytes());
    RecordId::from_bytes(b)
}

/// Fills `store` with `n` completed records of `body` bytes; returns the live heap
/// growth in bytes.
async fn fill(store: &MemoryStore, n: u64, body: usize) -> f64 {
    let record = Completed::new(
        Fingerprint::from_bytes([1; 32]),
        Some(StoredResponse::new(
            StatusCode::CREATED,
            Vec::new(),
            Bytes::from(vec![b'x'; body]),
            Vec::new(),
        )),
    );
    let region = Region::new(GLOBAL);
    for i in 0..n {
        let c = Claim::new(
            Token::random(),
            record.fingerprint,
            RETENTION,
            RETENTION,
            CommitPoint::Undeclared,
        );
        store.claim(&id(i), &c).await.expect("claim");
        store
            .complete(&id(i), c.token, &record, RETENTION)
            .await
            .expect("complete");
    }
    let change = region.change();
    change.bytes_allocated as f64 - change.bytes_deallocated as f64
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_weight_covers_the_live_heap() {
    // Record maps just after they grew (the lowest load factor) and just before.
    for (n, body) in [
        (14_400, 100),
        (14_300, 100),
        (14_400, 1024),
        (3_600, 16 * 1024),
    ] {
        let store = MemoryStore::new()
            .max_bytes(1 << 30)
            .build()
            .expect("store");
        let heap = fill(&store, n, body).await;
        let (weight, len) = (store.cached_bytes() as f64, store.cached_len() as f64);
        println!(
            "{n} records of {body} B: heap {:.0} B/record, weight {:.0} B/record",
            heap / len,
            weight / len
        );
        assert!(
            heap <= weight,
            "{n} × {body} B: heap {heap} > weight {weight}"
        );
    }
    // Mostly tombstones: a small store pushed far past its bound.
    let store = MemoryStore::new()
        .max_bytes(4 << 20)
        .build()
        .expect("store");
    let heap = fill(&store, 60_000, 100).await;
    let tombstones = store.tombstones_len();
    let weight = store.cached_bytes() as f64 + (tombstones * MemoryStore::TOMBSTONE_BYTES) as f64;
    println!(
        "{} records and {tombstones} tombstones: heap {heap:.0} B, weight {weight:.0} B",
        store.cached_len()
    );
    assert!(tombstones > 5_000, "{tombstones}");
    assert!(heap <= weight, "heap {heap} > weight {weight}");
}
