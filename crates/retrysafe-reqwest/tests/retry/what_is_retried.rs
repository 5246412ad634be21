//! What is retried and what is not: 503, `do-not-retry`, POST with and without a key,
//! generated and child keys, a streaming body, a refused connection, a local refusal
//! from below.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Extensions, Method};
use reqwest::{Body, Request, Response};
use reqwest_middleware::{Middleware, Next};
use retrysafe_core::CallContext;
use retrysafe_core::budget::RetryBudget;
use retrysafe_core::error::CircuitOpen;
use retrysafe_core::idempotency::{IdempotencyContext, Principal, Scope, Token};
use retrysafe_core::retry::child_key_label;
use retrysafe_core::strategy::GiveUp;
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::reqwest::budget_counts;
use tokio::net::TcpListener;

use super::{
    Count, client, counted, events, hooked, marked, middleware, middleware_error, router, s, serve,
    stack,
};

both_forms! {
    #[tokio::test]
    async fn a_503_then_200_is_retried_with_retry_attempt_2(form) {
        let (url, script) = serve(vec![s(503), s(200)]).await;
        let (middleware, retries, give_ups) = hooked(middleware());
        let budget = RetryBudget::ratio();
        let response = stack(middleware)
            .budget(budget.clone())
            .client(form)
            .get(format!("{url}/items"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert!(!marked(&response));
        assert_eq!(response.text().await.unwrap(), "status 200");
        let seen = script.seen();
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0].header("retry-attempt"), None);
        assert_eq!(seen[1].header("retry-attempt"), Some("2"));
        // No deadline: no timeout header (the default timeouts stay local).
        assert_eq!(seen[0].header("request-timeout-ms"), None);
        let retries = events(&retries);
        assert_eq!(retries.len(), 1);
        assert_eq!(retries[0].attempt, 2);
        assert_eq!(
            retries[0].status,
            Some(http::StatusCode::SERVICE_UNAVAILABLE)
        );
        assert!(give_ups.lock().unwrap().is_empty());
        // One deposit for the call, one withdrawal for its retry.
        assert_eq!(budget_counts(&budget), (1, 1));
    }
}

both_forms! {
    #[tokio::test]
    async fn a_do_not_retry_or_replayed_reply_is_not_retried_and_recorded_in_the_context(form) {
        for header in [("do-not-retry", "1"), ("idempotent-replayed", "true")] {
            let (url, script) = serve(vec![(503, vec![header]), s(200)]).await;
            let client = client(form, middleware());
            let ctx = CallContext::new();
            // The context is inherited through the task-local scope, as inside a handler.
            let response = ctx
                .clone()
                .scope(async { client.get(format!("{url}/items")).send().await })
                .await
                .unwrap();
            assert_eq!(response.status(), 503);
            assert_eq!(script.seen().len(), 1);
            assert!(ctx.downstream_gave_up());
        }
    }
}

both_forms! {
    #[tokio::test]
    async fn a_post_without_a_key_is_sent_once_and_with_a_key_retried_with_that_key(form) {
        let (url, script) = serve(vec![s(503), s(201)]).await;
        let response = client(form, middleware())
            .post(format!("{url}/orders"))
            .body("order")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        assert!(!marked(&response));
        assert_eq!(script.seen().len(), 1);

        let (url, script) = serve(vec![s(503), s(503), s(201)]).await;
        let response = client(form, middleware())
            .post(format!("{url}/orders"))
            .header("idempotency-key", "order-42")
            .body("order")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        let seen = script.seen();
        assert_eq!(seen.len(), 3);
        for s in &seen {
            assert_eq!(s.method, Method::POST);
            assert_eq!(s.header("idempotency-key"), Some("order-42"));
            // The buffered body is sent again, byte for byte.
            assert_eq!(&s.body[..], b"order");
        }
    }
}

both_forms! {
    #[tokio::test]
    async fn generated_keys_are_added_to_post_and_patch_and_kept_across_attempts(form) {
        let (url, script) = serve(vec![s(503), s(503), s(201)]).await;
        let client = client(form, middleware().generate_idempotency_keys());
        let response = client
            .post(format!("{url}/orders"))
            .body("x")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        let seen = script.seen();
        assert_eq!(seen.len(), 3);
        let key = seen[0].header("idempotency-key").unwrap().to_owned();
        assert_eq!(key.len(), 32);
        assert!(key.bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(
            seen.iter()
                .all(|s| s.header("idempotency-key") == Some(&key))
        );

        // PATCH gets one, GET does not, and a key the caller set is kept.
        let (url, script) = serve(vec![s(200)]).await;
        client.patch(format!("{url}/o/1")).send().await.unwrap();
        client.get(format!("{url}/o/1")).send().await.unwrap();
        client
            .post(format!("{url}/o"))
            .header("idempotency-key", "mine")
            .send()
            .await
            .unwrap();
        let seen = script.seen();
        assert!(seen[0].header("idempotency-key").is_some_and(|k| k != key));
        assert_eq!(seen[1].header("idempotency-key"), None);
        assert_eq!(seen[2].header("idempotency-key"), Some("mine"));
    }
}

both_forms! {
    #[tokio::test]
    async fn keys_inside_a_guarded_handler_are_the_child_keys_of_the_record(form) {
        let (url, script) = serve(vec![s(503), s(201)]).await;
        let authority = url.trim_start_matches("http://").to_owned();
        let scope = Scope::from(&Principal::new("alice"));
        let inbound = IdempotencyKey::new("order-7").unwrap();
        let expected = IdempotencyContext::detached(scope, inbound.clone(), Token::random());
        let child = expected.next_child_key(&child_key_label(&Method::POST, &authority, "/ledger"));

        // The handler runs with its own claim token: the same child key.
        let record = IdempotencyContext::detached(scope, inbound, Token::random());
        let ctx = CallContext::new().with_idempotency(record);
        let client = client(form, middleware().generate_idempotency_keys());
        let response = ctx
            .scope(async { client.post(format!("{url}/ledger")).send().await })
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        let seen = script.seen();
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0].header("idempotency-key"), Some(child.as_str()));
        assert_eq!(seen[1].header("idempotency-key"), Some(child.as_str()));
    }
}

both_forms! {
    #[tokio::test]
    async fn a_streaming_body_is_sent_once_even_on_a_503(form) {
        let (url, script) = serve(vec![s(503), s(201)]).await;
        let (middleware, retries, give_ups) = hooked(middleware());
        let response = client(form, middleware)
            .post(format!("{url}/upload"))
            .header("idempotency-key", "upload-1")
            .body(Body::wrap("streamed".to_owned()))
            .send()
            .await
            .unwrap();
        // Not an error, not marked: the answer as it came.
        assert_eq!(response.status(), 503);
        assert!(!marked(&response));
        let seen = script.seen();
        assert_eq!(seen.len(), 1);
        assert_eq!(&seen[0].body[..], b"streamed");
        assert!(retries.lock().unwrap().is_empty() && give_ups.lock().unwrap().is_empty());
    }
}

/// An address nothing listens on (a listener bound, then closed).
async fn closed_port() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap()
}

both_forms! {
    #[tokio::test]
    async fn a_refused_connection_is_retried_even_for_a_post(form) {
        // Nothing listens on the first attempt; the server comes up before the retry.
        let addr = closed_port().await;
        let (app, script) = router(vec![s(201)]);
        let app = Mutex::new(Some(app));
        let bring_up = middleware().on_retry(move |_| {
            if let Some(app) = app.lock().unwrap().take() {
                let listener = std::net::TcpListener::bind(addr).unwrap();
                listener.set_nonblocking(true).unwrap();
                tokio::spawn(async move {
                    let listener = TcpListener::from_std(listener).unwrap();
                    axum::serve(listener, app).await.unwrap();
                });
            }
        });
        let response = client(form, bring_up)
            .post(format!("http://{addr}/orders"))
            .body("x")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        assert_eq!(script.seen().len(), 1);

        // Refused every time: attempts exhausted, reqwest's error passed on.
        let addr = closed_port().await;
        let (hooked_middleware, retries, give_ups) = hooked(middleware());
        let (client, count) = counted(form, hooked_middleware);
        let error = client
            .post(format!("http://{addr}/orders"))
            .send()
            .await
            .unwrap_err();
        match &error {
            reqwest_middleware::Error::Reqwest(e) => assert!(e.is_connect(), "{e:?}"),
            other @ reqwest_middleware::Error::Middleware(_) => {
                panic!("expected reqwest's connect error, got {other:?}")
            }
        }
        assert_eq!(count.load(Ordering::SeqCst), 3);
        assert_eq!(retries.lock().unwrap().len(), 2);
        let give_ups = events(&give_ups);
        assert_eq!(give_ups.len(), 1);
        assert_eq!(give_ups[0].attempts, 3);
        assert_eq!(give_ups[0].reason, GiveUp::AttemptsExhausted);
        assert_eq!(give_ups[0].status, None);
    }
}

/// A middleware below the retry that refuses every call, as an open breaker does.
struct Refuse(Arc<AtomicU32>);

#[async_trait::async_trait]
impl Middleware for Refuse {
    async fn handle(
        &self,
        _req: Request,
        _extensions: &mut Extensions,
        _next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Err(reqwest_middleware::Error::middleware(CircuitOpen::new(
            Duration::from_secs(5),
        )))
    }
}

both_forms! {
    #[tokio::test]
    async fn a_local_refusal_from_below_is_passed_on_not_retried(form) {
        let calls = Arc::new(AtomicU32::new(0));
        let client = stack(middleware())
            .below(Refuse(calls.clone()))
            .client(form);
        let error = client
            .get("http://127.0.0.1:9/never")
            .send()
            .await
            .unwrap_err();
        assert!(middleware_error::<CircuitOpen>(&error).is_some());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}

/// A middleware below the retry that wraps reqwest's errors with context.
struct Wrap;

#[async_trait::async_trait]
impl Middleware for Wrap {
    async fn handle(
        &self,
        req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        next.run(req, extensions).await.map_err(|e| match e {
            reqwest_middleware::Error::Reqwest(e) => reqwest_middleware::Error::Middleware(
                anyhow::Error::new(e).context("sending through Wrap"),
            ),
            other @ reqwest_middleware::Error::Middleware(_) => other,
        })
    }
}

both_forms! {
    #[tokio::test]
    async fn a_refused_connection_wrapped_by_a_middleware_below_is_still_retried(form) {
        let addr = closed_port().await;
        let count = Arc::new(AtomicU32::new(0));
        let client = stack(middleware())
            .below(Count(count.clone()))
            .below(Wrap)
            .client(form);
        let error = client
            .post(format!("http://{addr}/orders"))
            .send()
            .await
            .unwrap_err();
        assert!(error.is_middleware());
        assert_eq!(
            retrysafe_reqwest::retry::failure_of(&error),
            retrysafe_core::classify::Failure::ConnectFailed
        );
        // Nothing was sent: a POST without a key is retried, up to the attempt limit.
        assert_eq!(count.load(Ordering::SeqCst), 3);
    }
}
