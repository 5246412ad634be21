//! Idempotency keys: generated for POST and PATCH and kept across attempts; inside a
//! guarded handler, deterministic child keys.

use http::{Request, StatusCode};
use retrysafe_core::CallContext;
use retrysafe_core::idempotency::{IdempotencyContext, Principal, Scope, Token};
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::Form;

use super::{Seen, get, layer, post, run, stack, stacked, status, with};

fn key_of(seen: &Seen) -> Option<IdempotencyKey> {
    seen.parts
        .headers
        .get("idempotency-key")
        .map(|v| IdempotencyKey::from_header(v).unwrap())
}

async fn generated_keys_are_added_to_post_and_patch_and_kept_across_attempts(form: Form) {
    let keys = stacked(form, layer().generate_idempotency_keys());
    let (res, seen) = run(
        keys.clone(),
        post("http://api.local/orders", "x"),
        vec![Ok(status(503)), Ok(status(503)), Ok(status(201))],
    )
    .await;
    assert_eq!(res.unwrap().status(), StatusCode::CREATED);
    assert_eq!(seen.len(), 3);
    let key = key_of(&seen[0]).unwrap();
    assert_eq!(key.as_str().len(), 32);
    assert!(key.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(key_of(&seen[1]).unwrap(), key);
    assert_eq!(key_of(&seen[2]).unwrap(), key);

    // Another request, another random key.
    let (_, again) = run(
        keys.clone(),
        post("http://api.local/orders", "x"),
        vec![Ok(status(201))],
    )
    .await;
    assert_ne!(key_of(&again[0]).unwrap(), key);

    let patch = Request::patch("http://api.local/orders/1")
        .body("p".to_owned())
        .unwrap();
    let (_, seen) = run(keys.clone(), patch, vec![Ok(status(200))]).await;
    assert!(key_of(&seen[0]).is_some());

    // None on a GET, and a key the caller set is kept.
    let (_, seen) = run(
        keys.clone(),
        get("http://api.local/orders"),
        vec![Ok(status(200))],
    )
    .await;
    assert!(key_of(&seen[0]).is_none());
    let own = Request::post("http://api.local/orders")
        .header("idempotency-key", "mine-1")
        .body("x".to_owned())
        .unwrap();
    let (_, seen) = run(keys, own, vec![Ok(status(503)), Ok(status(201))]).await;
    assert_eq!(seen[0].header("idempotency-key"), Some("mine-1"));
    assert_eq!(seen[1].header("idempotency-key"), Some("mine-1"));

    // Without the option, no key is added.
    let (_, seen) = run(
        stack(form),
        post("http://api.local/orders", "x"),
        vec![Ok(status(201))],
    )
    .await;
    assert!(key_of(&seen[0]).is_none());
}

both_forms!(
    generated_keys_are_added_to_post_and_patch_and_kept_across_attempts,
    start_paused = true
);

async fn keys_inside_a_guarded_handler_are_deterministic_child_keys(form: Form) {
    let scope = Scope::from(&Principal::new("alice"));
    let inbound = IdempotencyKey::new("order-7").unwrap();
    let expected = IdempotencyContext::detached(scope, inbound.clone(), Token::random());
    let first = expected.next_child_key("POST ledger.local/entries");
    let second = expected.next_child_key("POST mail.local/send");
    assert_ne!(first, second);

    // The parent handler runs twice (a takeover, or a retry after NoEffect): each run
    // has its own claim token, and repeats the same keys in the same order.
    for _run in 0..2 {
        let record = IdempotencyContext::detached(scope, inbound.clone(), Token::random());
        let ctx = CallContext::new().with_idempotency(record);
        let keys = stacked(form, layer().generate_idempotency_keys());
        let (_, seen) = ctx
            .clone()
            .scope(run(
                keys.clone(),
                post("http://ledger.local/entries", "e"),
                vec![Ok(status(503)), Ok(status(201))],
            ))
            .await;
        assert_eq!(key_of(&seen[0]).unwrap(), first);
        assert_eq!(key_of(&seen[1]).unwrap(), first);
        let (_, seen) = ctx
            .scope(run(
                keys,
                post("http://mail.local/send", "m"),
                vec![Ok(status(202))],
            ))
            .await;
        assert_eq!(key_of(&seen[0]).unwrap(), second);
    }

    // Another inbound key, other child keys.
    let other = IdempotencyContext::detached(
        scope,
        IdempotencyKey::new("order-8").unwrap(),
        Token::random(),
    );
    let ctx = CallContext::new().with_idempotency(other);
    let req = with(post("http://ledger.local/entries", "e"), ctx);
    let (_, seen) = run(
        stacked(form, layer().generate_idempotency_keys()),
        req,
        vec![Ok(status(201))],
    )
    .await;
    assert_ne!(key_of(&seen[0]).unwrap(), first);
}

both_forms!(
    keys_inside_a_guarded_handler_are_deterministic_child_keys,
    start_paused = true
);
