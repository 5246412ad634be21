//! Key floods against the `MemoryStore`'s bounds, and a full in-flight map that never
//! fails open.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use retrysafe::memory::MemoryStore;
use retrysafe_tower::idempotency::{IdempotencyLayer, ProblemKind};

use super::{Answer, Effects, Rng, app, eventually, pay, seed, serve};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_flood_stays_within_the_memory_store_bounds() {
    const MAP: usize = 16; // the store's in-flight bound
    const MAX_BYTES: u64 = 64 * 1024;
    const FLOOD: usize = 600;
    const BODY: usize = 1024;
    let mut rng = Rng(seed());

    let evicted = Arc::new(AtomicUsize::new(0));
    let store = {
        let evicted = Arc::clone(&evicted);
        MemoryStore::new()
            .max_in_flight(MAP)
            .max_bytes(MAX_BYTES)
            .on_evicted(move |_| {
                evicted.fetch_add(1, Ordering::SeqCst);
            })
            .build()
            .unwrap()
    };
    // The layer's own bound is above the store's, so the store's is the one flooded.
    let layer = IdempotencyLayer::new(store.clone())
        .max_in_flight(1024)
        .build()
        .unwrap();
    let fx = Effects::new();
    let addr = serve(app(layer, true, &fx)).await;
    let client = reqwest::Client::new();
    let bearer = [("authorization", "Bearer mallory")];
    let hold = [("authorization", "Bearer mallory"), ("x-hold", "1")];

    // Sample the cache's weight all along.
    let sampling = Arc::new(AtomicBool::new(true));
    let max_seen = Arc::new(AtomicU64::new(0));
    let samples = Arc::new(AtomicUsize::new(0));
    let sampler = tokio::spawn({
        let (store, sampling, max_seen, samples) = (
            store.clone(),
            Arc::clone(&sampling),
            Arc::clone(&max_seen),
            Arc::clone(&samples),
        );
        async move {
            while sampling.load(Ordering::SeqCst) {
                let bytes = store.cached_bytes();
                assert!(bytes <= MAX_BYTES, "cached_bytes {bytes} over {MAX_BYTES}");
                max_seen.fetch_max(bytes, Ordering::SeqCst);
                samples.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    });

    // Half the in-flight map held by parked handlers.
    let mut holders = Vec::new();
    let held: Vec<String> = (0..MAP)
        .map(|i| format!("held-{i}-{}", rng.key()))
        .collect();
    for key in &held[..MAP / 2] {
        let (client, key) = (client.clone(), key.clone());
        holders.push(tokio::spawn(async move {
            pay(&client, addr, Some(&key), "hold", &hold).await
        }));
    }
    eventually("the first holders parked", || fx.holding() == MAP / 2).await;
    assert_eq!(store.in_flight_len(), MAP / 2);

    // The flood: distinct keys that complete, four at a time, with duplicates of the
    // held keys mixed in.
    let mut flood: Vec<String> = (0..FLOOD).map(|i| format!("f{i}-{}", rng.key())).collect();
    flood.sort();
    flood.dedup();
    let big = BODY.to_string();
    let results: Vec<Answer> = futures_util::stream::iter(flood.iter().enumerate())
        .map(|(i, key)| {
            let (client, big, store) = (client.clone(), big.clone(), store.clone());
            let dup = held[(i / 50) % (MAP / 2)].clone();
            async move {
                let a = pay(
                    &client,
                    addr,
                    Some(key),
                    "flood",
                    &[bearer[0], ("x-big", &big)],
                )
                .await;
                let bytes = store.cached_bytes();
                assert!(bytes <= MAX_BYTES, "cached_bytes {bytes} over {MAX_BYTES}");
                if i % 50 == 0 {
                    // A duplicate of a held key: 409, never a second run.
                    pay(&client, addr, Some(&dup), "hold", &bearer)
                        .await
                        .assert_problem(ProblemKind::InFlight);
                }
                a
            }
        })
        .buffer_unordered(4)
        .collect()
        .await;
    for a in &results {
        assert_eq!(a.status, 201, "{}", a.text());
        assert!(!a.replayed());
        assert_eq!(a.body.len(), BODY);
    }
    assert_eq!(fx.runs(), flood.len(), "every flood key ran once");
    assert_eq!(fx.holding(), MAP / 2, "the held keys still run, once each");
    assert_eq!(
        store.in_flight_len(),
        MAP / 2,
        "no in-flight claim was evicted"
    );
    assert!(
        evicted.load(Ordering::SeqCst) > 0,
        "the flood evicted completed records"
    );

    // The other half of the map held too: the map is full.
    for key in &held[MAP / 2..] {
        let (client, key) = (client.clone(), key.clone());
        holders.push(tokio::spawn(async move {
            pay(&client, addr, Some(&key), "hold", &hold).await
        }));
    }
    eventually("all holders parked", || fx.holding() == MAP).await;
    assert_eq!(store.in_flight_len(), MAP);
    // New keys: 503 with retry-after, never an eviction of a claim.
    for _ in 0..20 {
        let a = pay(&client, addr, Some(&rng.key()), "new", &bearer).await;
        a.assert_problem(ProblemKind::Overloaded);
        assert!(a.headers.contains_key("retry-after"));
    }
    // Every held key is still in flight: its duplicates get 409 and do not run.
    for key in &held {
        pay(&client, addr, Some(key), "hold", &bearer)
            .await
            .assert_problem(ProblemKind::InFlight);
    }
    assert_eq!(store.in_flight_len(), MAP);
    assert_eq!(fx.started.load(Ordering::SeqCst), flood.len() + MAP);

    // The holders finish; each held key then replays its own response.
    fx.gate.open();
    let mut firsts = Vec::new();
    for h in holders {
        let a = h.await.unwrap();
        assert_eq!(a.status, 201);
        firsts.push(a.body);
    }
    for (key, first) in held.iter().zip(&firsts) {
        let again = pay(&client, addr, Some(key), "hold", &bearer).await;
        assert!(again.replayed(), "{key}: {}", again.text());
        assert_eq!(&again.body, first);
        assert!(again.text().contains(key.as_str()));
    }
    assert_eq!(fx.runs(), flood.len() + MAP, "no key ran twice");
    assert_eq!(store.in_flight_len(), 0);

    sampling.store(false, Ordering::SeqCst);
    sampler.await.unwrap();
    // Every completed record is still cached, or shrunk to a tombstone (its key never
    // runs again), or was reported evicted (a tombstone dropped past its share).
    let cached = store.cached_len() as usize;
    let tombstones = store.tombstones_len() as usize;
    let evicted = evicted.load(Ordering::SeqCst);
    assert_eq!(
        cached + tombstones + evicted,
        flood.len() + MAP,
        "cached {cached}, tombstones {tombstones}, evicted {evicted}"
    );
    eprintln!(
        "key flood: {} keys, {} samples, max cached_bytes {} of {MAX_BYTES}, {cached} cached, \
         {tombstones} tombstones, {evicted} evicted",
        flood.len(),
        samples.load(Ordering::SeqCst),
        max_seen.load(Ordering::SeqCst)
    );
}

/// A flood that fills the store's in-flight map cannot switch a `fail_open` layer to
/// unguarded execution: a full map is not an unavailable store, so new keys get 503
/// and nothing runs unguarded (a duplicate of a held key included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_in_flight_map_never_fails_open() {
    const MAP: usize = 4;
    let store = MemoryStore::new().max_in_flight(MAP).build().unwrap();
    let layer = IdempotencyLayer::new(store.clone()).fail_open();
    let fx = Effects::new();
    let addr = serve(app(layer, true, &fx)).await;
    let client = reqwest::Client::new();
    let bearer = [("authorization", "Bearer mallory")];
    let hold = [("authorization", "Bearer mallory"), ("x-hold", "1")];
    let mut holders = Vec::new();
    for i in 0..MAP {
        let client = client.clone();
        holders.push(tokio::spawn(async move {
            pay(&client, addr, Some(&format!("held-{i}")), "x", &hold).await
        }));
    }
    eventually("the map is full", || fx.holding() == MAP).await;
    for i in 0..20 {
        let a = pay(&client, addr, Some(&format!("new-{i}")), "x", &bearer).await;
        a.assert_problem(ProblemKind::Overloaded);
    }
    pay(&client, addr, Some("held-0"), "x", &bearer)
        .await
        .assert_problem(ProblemKind::InFlight);
    assert_eq!(
        fx.started.load(Ordering::SeqCst),
        MAP,
        "nothing ran unguarded"
    );
    fx.gate.open();
    for h in holders {
        assert_eq!(h.await.unwrap().status, 201);
    }
    assert_eq!(
        pay(&client, addr, Some("new-0"), "x", &bearer).await.status,
        201
    );
    assert_eq!(fx.runs(), MAP + 1);
}
