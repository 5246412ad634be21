//! Per-request overrides in the reqwest-middleware `Extensions`, the retry point and
//! the inherited `CallContext`.

use std::time::Duration;

use retrysafe_core::strategy::{Idempotent, NoRetry};
use retrysafe_core::{CallContext, Deadline};
use retrysafe_test_support::both_forms;

use super::deadlines::timeout_ms;
use super::{client, empty_budget, marked, middleware, s, serve};

both_forms! {
    #[tokio::test]
    async fn no_retry_idempotent_and_budget_extensions_override_per_request(form) {
        let client = client(form, middleware());

        let (url, script) = serve(vec![s(503), s(200)]).await;
        let response = client
            .get(format!("{url}/a"))
            .with_extension(NoRetry)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        assert!(!marked(&response));
        assert_eq!(script.seen().len(), 1);

        let (url, script) = serve(vec![s(503), s(201)]).await;
        let response = client
            .post(format!("{url}/b"))
            .with_extension(Idempotent)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        assert_eq!(script.seen().len(), 2);

        // A budget that allows no retry: the 503 is the answer, marked.
        let (url, script) = serve(vec![s(503), s(200)]).await;
        let response = client
            .get(format!("{url}/c"))
            .with_extension(empty_budget())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        assert!(marked(&response));
        assert_eq!(script.seen().len(), 1);
    }
}

#[derive(Clone)]
struct ReadOnly;

both_forms! {
    #[tokio::test]
    async fn idempotent_if_sees_the_head_and_the_extensions(form) {
        let middleware = middleware().idempotent_if(|parts| {
            parts.uri.path().starts_with("/read/") || parts.extensions.get::<ReadOnly>().is_some()
        });
        let client = client(form, middleware);
        let (url, script) = serve(vec![s(503), s(200)]).await;
        let response = client.post(format!("{url}/read/x")).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(script.seen().len(), 2);

        // Declared by an extension the predicate reads; the extensions are still there
        // afterwards (the deadline in them becomes the header).
        let (url, script) = serve(vec![s(503), s(200)]).await;
        client
            .post(format!("{url}/write"))
            .with_extension(ReadOnly)
            .with_extension(Deadline::after(Duration::from_secs(4)))
            .send()
            .await
            .unwrap();
        let seen = script.seen();
        assert_eq!(seen.len(), 2);
        assert!(timeout_ms(&seen[1]) <= 4_000);

        let (url, script) = serve(vec![s(503), s(200)]).await;
        let response = client.post(format!("{url}/write")).send().await.unwrap();
        assert_eq!(response.status(), 503);
        assert_eq!(script.seen().len(), 1);
    }
}

both_forms! {
    #[tokio::test]
    async fn the_retry_point_is_sent_and_an_inherited_one_makes_one_attempt(form) {
        let (url, script) = serve(vec![s(503), s(200)]).await;
        client(form, middleware().retry_point())
            .get(format!("{url}/x"))
            .send()
            .await
            .unwrap();
        let seen = script.seen();
        assert_eq!(seen.len(), 2);
        assert!(
            seen.iter()
                .all(|s| s.header("retry-point") == Some("caller"))
        );

        let (url, script) = serve(vec![s(503), s(200)]).await;
        let ctx = CallContext::new().with_caller_is_retry_point(true);
        let client = client(form, middleware());
        let response = ctx
            .clone()
            .scope(async { client.get(format!("{url}/x")).send().await })
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        assert!(!marked(&response));
        assert!(!ctx.downstream_gave_up());
        let seen = script.seen();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].header("retry-point"), Some("caller"));
    }
}
