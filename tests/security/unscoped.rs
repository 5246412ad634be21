//! No scope, no guarding: a request the layer cannot scope is refused, and its handler
//! never runs.

use std::sync::atomic::Ordering;

use retrysafe::memory::MemoryStore;
use retrysafe_core::idempotency::Scope;
use retrysafe_tower::idempotency::{IdempotencyLayer, ProblemKind};

use super::{Effects, app, pay, serve};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_scope_nothing_is_guarded_and_nothing_runs() {
    let client = reqwest::Client::new();
    let store = MemoryStore::new();

    // No authentication layer: no Principal.
    let fx = Effects::new();
    let addr = serve(app(IdempotencyLayer::new(store.clone()), false, &fx)).await;
    for _ in 0..3 {
        pay(&client, addr, Some("k"), "pay 1", &[])
            .await
            .assert_problem(ProblemKind::ScopeMissing);
    }
    // A forged bearer header is nothing without the authentication layer.
    pay(
        &client,
        addr,
        Some("k"),
        "pay 1",
        &[("authorization", "Bearer alice")],
    )
    .await
    .assert_problem(ProblemKind::ScopeMissing);
    assert_eq!(
        fx.started.load(Ordering::SeqCst),
        0,
        "the handler never ran"
    );
    assert_eq!(
        (store.in_flight_len(), store.cached_len()),
        (0, 0),
        "no record"
    );
    // Without a key the request is not guarded at all (the first row of the decision table).
    assert_eq!(pay(&client, addr, None, "pay 1", &[]).await.status, 201);
    assert_eq!(fx.runs(), 1);
    assert_eq!((store.in_flight_len(), store.cached_len()), (0, 0));

    // A scope_by rule that finds nothing answers the same.
    let fx = Effects::new();
    let layer = IdempotencyLayer::new(store.clone()).scope_by(|parts| {
        parts
            .headers
            .get("x-tenant")
            .map(|v| Scope::new(v.as_bytes()))
    });
    let addr = serve(app(layer, false, &fx)).await;
    pay(&client, addr, Some("k"), "pay 1", &[])
        .await
        .assert_problem(ProblemKind::ScopeMissing);
    assert_eq!(fx.started.load(Ordering::SeqCst), 0);
    assert_eq!((store.in_flight_len(), store.cached_len()), (0, 0));
    let ok = pay(&client, addr, Some("k"), "pay 1", &[("x-tenant", "t1")]).await;
    assert_eq!(ok.status, 201);
    assert_eq!((store.in_flight_len(), store.cached_len()), (0, 1));
}
