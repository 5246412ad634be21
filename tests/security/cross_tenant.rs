//! No replay across tenants: the same key from another principal, or another tenant,
//! runs on its own and never gets the first caller's answer.

use std::net::SocketAddr;

use retrysafe_core::idempotency::Scope;
use retrysafe_tower::idempotency::{IdempotencyLayer, ProblemKind};

use super::{Effects, app, eventually, pay, serve};

/// The cross-scope scenario, for callers identified by the header `as_caller(who)`.
async fn no_replay_across_scopes(
    addr: SocketAddr,
    fx: &Effects,
    as_caller: fn(&str) -> (&'static str, String),
) {
    let client = reqwest::Client::new();
    let send = |who: &'static str, key: &'static str, body: &'static str, hold: bool| {
        let client = client.clone();
        async move {
            let (name, value) = as_caller(who);
            let mut headers = vec![(name, value.as_str())];
            if hold {
                headers.push(("x-hold", "1"));
            }
            pay(&client, addr, Some(key), body, &headers).await
        }
    };

    // Same key, same body: A's effect, then B's own effect (never A's answer).
    let a1 = send("alice", "k-shared", "pay 100", false).await;
    assert_eq!(a1.status, 201);
    assert!(!a1.replayed());
    assert!(a1.text().contains("for alice"), "{}", a1.text());
    let b1 = send("bob", "k-shared", "pay 100", false).await;
    assert_eq!(b1.status, 201);
    assert!(!b1.replayed(), "a replay across scopes");
    assert!(b1.text().contains("for bob"), "{}", b1.text());
    assert_ne!(a1.body, b1.body);
    // Each replays its own.
    let a2 = send("alice", "k-shared", "pay 100", false).await;
    let b2 = send("bob", "k-shared", "pay 100", false).await;
    assert!(a2.replayed() && b2.replayed());
    assert_eq!(a2.body, a1.body);
    assert_eq!(b2.body, b1.body);
    assert_eq!(fx.runs(), 2);

    // Another body under the same key in a third scope: no 422 across scopes.
    let c1 = send("carol", "k-shared", "pay 999", false).await;
    assert_eq!(c1.status, 201, "{}", c1.text());
    assert!(!c1.replayed() && c1.text().contains("for carol"));
    assert_eq!(fx.runs(), 3);

    // A's copy in flight: B's same key is not a 409, it runs at once.
    let a_held = tokio::spawn(send("alice", "k-held", "pay 5", true));
    eventually("alice's handler parked", || fx.holding() == 1).await;
    let b3 = send("bob", "k-held", "pay 5", false).await;
    assert_eq!(b3.status, 201, "{}", b3.text());
    assert!(!b3.replayed() && b3.text().contains("for bob"));
    // While A's is still in flight, A's own duplicate is a 409 (the guard works).
    send("alice", "k-held", "pay 5", false)
        .await
        .assert_problem(ProblemKind::InFlight);
    fx.gate.open();
    let a3 = a_held.await.unwrap();
    assert_eq!(a3.status, 201);
    assert!(a3.text().contains("for alice"));
    assert_eq!(send("alice", "k-held", "pay 5", false).await.body, a3.body);
    assert_eq!(send("bob", "k-held", "pay 5", false).await.body, b3.body);
    assert_eq!(fx.runs(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_from_another_principal_is_never_replayed() {
    let fx = Effects::new();
    let addr = serve(app(IdempotencyLayer::in_memory(), true, &fx)).await;
    no_replay_across_scopes(addr, &fx, |who| ("authorization", format!("Bearer {who}"))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_from_another_tenant_is_never_replayed() {
    let fx = Effects::new();
    let layer = IdempotencyLayer::in_memory().scope_by(|parts| {
        parts
            .headers
            .get("x-tenant")
            .map(|v| Scope::new(v.as_bytes()))
    });
    let addr = serve(app(layer, false, &fx)).await;
    no_replay_across_scopes(addr, &fx, |who| ("x-tenant", who.to_owned())).await;
}
