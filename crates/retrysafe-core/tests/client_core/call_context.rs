//! The inherited `CallContext`: scoping, the extension first, deadlines that only
//! tighten, and a shared give-up.

use retrysafe_core::idempotency::{IdempotencyContext, Principal, Scope, Token};
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_core::{CallContext, Deadline};

use super::ms;

fn idem(key: &str) -> IdempotencyContext {
    IdempotencyContext::detached(
        Scope::from(&Principal::new("alice")),
        IdempotencyKey::new(key).unwrap(),
        Token::random(),
    )
}

#[tokio::test(start_paused = true)]
async fn scope_makes_the_context_current_only_inside() {
    assert!(CallContext::current().is_none());
    let ctx = CallContext::new()
        .with_deadline(Deadline::after(ms(80)))
        .with_caller_is_retry_point(true)
        .with_idempotency(idem("k1"));
    let inside = ctx
        .clone()
        .scope(async {
            tokio::time::sleep(ms(30)).await;
            let c = CallContext::current().unwrap();
            (
                c.deadline().unwrap().remaining(),
                c.caller_is_retry_point(),
                c.idempotency().unwrap().key().as_str().to_owned(),
            )
        })
        .await;
    assert_eq!(inside, (ms(50), true, "k1".to_owned()));
    assert!(CallContext::current().is_none());

    // sync_scope, nested scopes: the innermost wins, the outer comes back.
    let outer = CallContext::new().with_caller_is_retry_point(true);
    let inner = CallContext::new();
    outer.clone().sync_scope(|| {
        assert!(CallContext::current().unwrap().caller_is_retry_point());
        inner.clone().sync_scope(|| {
            assert!(!CallContext::current().unwrap().caller_is_retry_point());
        });
        assert!(CallContext::current().unwrap().caller_is_retry_point());
    });
    assert!(CallContext::current().is_none());

    // Not inherited by spawned tasks (they carry it by hand, as an extension).
    let spawned = outer
        .scope(async {
            tokio::spawn(async { CallContext::current().is_some() })
                .await
                .unwrap()
        })
        .await;
    assert!(!spawned);
}

#[tokio::test(start_paused = true)]
async fn inherited_prefers_the_extension() {
    let mut ext = http::Extensions::new();
    assert!(CallContext::inherited(&ext).is_none());

    let task = CallContext::new().with_caller_is_retry_point(true);
    let carried = CallContext::new().with_deadline(Deadline::after(ms(5)));
    ext.insert(carried.clone());
    let (from_ext, from_task) = task.clone().sync_scope(|| {
        (
            CallContext::inherited(&ext).unwrap(),
            CallContext::inherited(&http::Extensions::new()).unwrap(),
        )
    });
    assert!(!from_ext.caller_is_retry_point());
    assert_eq!(from_ext.deadline().unwrap().remaining(), ms(5));
    assert!(from_task.caller_is_retry_point());
    assert!(from_task.deadline().is_none());
    // The inherited context is the same context: it shares the gave-up flag.
    from_ext.mark_downstream_gave_up();
    assert!(carried.downstream_gave_up());
    assert!(!task.downstream_gave_up());
}

#[tokio::test(start_paused = true)]
async fn with_deadline_only_tightens() {
    let ctx = CallContext::new().with_deadline(Deadline::after(ms(100)));
    let later = ctx.clone().with_deadline(Deadline::after(ms(500)));
    assert_eq!(later.deadline().unwrap().remaining(), ms(100));
    let sooner = ctx.clone().with_deadline(Deadline::after(ms(20)));
    assert_eq!(sooner.deadline().unwrap().remaining(), ms(20));
    assert_eq!(ctx.deadline().unwrap().remaining(), ms(100));
    assert!(CallContext::new().deadline().is_none());
    tokio::time::advance(ms(30)).await;
    assert!(sooner.deadline().unwrap().is_expired());
    assert_eq!(later.deadline().unwrap().remaining(), ms(70));
}

#[tokio::test(start_paused = true)]
async fn gave_up_is_shared_across_clones_and_derived_contexts() {
    let ctx = CallContext::new();
    assert!(!ctx.downstream_gave_up());
    let clone = ctx.clone();
    let derived = ctx
        .clone()
        .with_deadline(Deadline::after(ms(10)))
        .with_caller_is_retry_point(true)
        .with_idempotency(idem("k2"));
    derived.mark_downstream_gave_up();
    assert!(ctx.downstream_gave_up());
    assert!(clone.downstream_gave_up());
    // An independent context does not see it.
    assert!(!CallContext::new().downstream_gave_up());
    let dbg = format!("{derived:?}");
    assert!(dbg.contains("downstream_gave_up: true"), "{dbg}");

    // Marked from inside a scope, seen outside.
    let outer = CallContext::new();
    outer
        .clone()
        .scope(async { CallContext::current().unwrap().mark_downstream_gave_up() })
        .await;
    assert!(outer.downstream_gave_up());
}
