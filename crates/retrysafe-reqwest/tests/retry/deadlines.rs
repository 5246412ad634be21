//! The deadline: `request-timeout-ms` on every attempt, `retry-after` past it, an
//! expired one; exact delays and headers on the paused clock against a stub.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::Request as AxumRequest;
use http::{Extensions, HeaderMap};
use reqwest::{Request, Response};
use reqwest_middleware::{ClientWithMiddleware, Middleware, Next};
use retrysafe_core::error::DeadlineExceeded;
use retrysafe_core::strategy::GiveUp;
use retrysafe_core::{CallContext, Deadline};
use retrysafe_reqwest::retry::RetryMiddleware;
use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::Form;
use retrysafe_test_support::forms::reqwest::Stack;
use tokio::net::TcpListener;
use tokio::time::Instant;

use super::{
    Reply, Seen, client, events, hooked, marked, middleware, middleware_error, s, serve, stack,
    strategy,
};

pub(super) fn timeout_ms(seen: &Seen) -> u64 {
    seen.header("request-timeout-ms").unwrap().parse().unwrap()
}

both_forms! {
    #[tokio::test]
    async fn a_deadline_extension_becomes_a_request_timeout_header_on_every_attempt(form) {
        let (url, script) = serve(vec![s(503), s(503), s(200)]).await;
        let response = client(form, middleware())
            .get(format!("{url}/items"))
            .with_extension(Deadline::after(Duration::from_secs(10)))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let seen = script.seen();
        assert_eq!(seen.len(), 3);
        let left: Vec<u64> = seen.iter().map(timeout_ms).collect();
        // Never more than the deadline, never growing (exact values: the paused-clock test).
        assert!(left[0] <= 10_000);
        assert!(left[1] <= left[0] && left[2] <= left[1], "{left:?}");

        // An inherited deadline counts too.
        let (url, script) = serve(vec![s(200)]).await;
        let ctx = CallContext::new().with_deadline(Deadline::after(Duration::from_secs(3)));
        let client = client(form, middleware());
        ctx.scope(async { client.get(format!("{url}/items")).send().await })
            .await
            .unwrap();
        assert!(timeout_ms(&script.seen()[0]) <= 3_000);
    }
}

both_forms! {
    /// A black hole under a deadline: an explicit `attempt_timeout` cuts the attempt that
    /// never answers and leaves time for the retry, whose answer is the call's; the
    /// attempts' `request-timeout-ms` is the attempt's bound, not the deadline's.
    #[tokio::test]
    async fn an_explicit_attempt_timeout_cuts_a_black_hole_under_a_deadline(form) {
        let calls = Arc::new(AtomicU32::new(0));
        let headers = Arc::new(Mutex::new(Vec::new()));
        let app = {
            let (calls, headers) = (Arc::clone(&calls), Arc::clone(&headers));
            axum::Router::new().fallback(move |request: AxumRequest| {
                let (calls, headers) = (Arc::clone(&calls), Arc::clone(&headers));
                async move {
                    headers.lock().unwrap().push(request.headers().clone());
                    if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                        std::future::pending::<()>().await;
                    }
                    "answered"
                }
            })
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

        let response = Stack::new()
            .strategy(strategy().attempt_timeout(Duration::from_millis(300)))
            .client(form)
            .get(format!("http://{addr}/items"))
            .with_extension(Deadline::after(Duration::from_secs(30)))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.text().await.unwrap(), "answered");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        let headers = headers.lock().unwrap();
        for h in headers.iter() {
            let left: u64 = h["request-timeout-ms"].to_str().unwrap().parse().unwrap();
            assert!(left <= 300, "{left}");
        }
        assert_eq!(headers[1]["retry-attempt"], "2");
    }
}

both_forms! {
    #[tokio::test]
    async fn no_attempt_starts_when_the_deadline_has_passed(form) {
        let (url, script) = serve(vec![s(200)]).await;
        let error = client(form, middleware())
            .get(format!("{url}/items"))
            .with_extension(Deadline::after(Duration::ZERO))
            .send()
            .await
            .unwrap_err();
        assert!(middleware_error::<DeadlineExceeded>(&error).is_some());
        assert!(script.seen().is_empty());
    }
}

/// The end of the chain on the paused clock: records when each attempt came and what it
/// carried, and answers from a script without any I/O.
struct Stub {
    replies: Mutex<VecDeque<Reply>>,
    seen: Attempts,
}

/// When each attempt reached the stub, and its headers.
type Attempts = Arc<Mutex<Vec<(Instant, HeaderMap)>>>;

#[async_trait::async_trait]
impl Middleware for Stub {
    async fn handle(
        &self,
        req: Request,
        _extensions: &mut Extensions,
        _next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        self.seen
            .lock()
            .unwrap()
            .push((Instant::now(), req.headers().clone()));
        let (status, headers) = self
            .replies
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or((200, vec![]));
        let mut b = http::Response::builder().status(status);
        for (name, value) in headers {
            b = b.header(name, value);
        }
        Ok(Response::from(b.body("").unwrap()))
    }
}

fn stubbed(
    form: Form,
    middleware: RetryMiddleware,
    replies: Vec<Reply>,
) -> (ClientWithMiddleware, Attempts) {
    let seen = Arc::default();
    let client = stack(middleware)
        .below(Stub {
            replies: Mutex::new(replies.into()),
            seen: Arc::clone(&seen),
        })
        .client(form);
    (client, seen)
}

both_forms! {
    #[tokio::test(start_paused = true)]
    async fn retry_after_is_a_minimum_delay_and_the_time_left_shrinks_exactly(form) {
        let t0 = Instant::now();
        let (client, seen) = stubbed(
            form,
            middleware(),
            vec![
                (503, vec![("retry-after", "1")]),
                (503, vec![("retry-after", "2")]),
                s(200),
            ],
        );
        let response = client
            .get("http://api.local/items")
            .with_extension(Deadline::after(Duration::from_secs(5)))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let seen = seen.lock().unwrap();
        let at: Vec<Duration> = seen.iter().map(|(t, _)| *t - t0).collect();
        // The backoff is at most 50 ms and 100 ms here: `retry-after` decides, exactly.
        assert_eq!(
            at,
            [
                Duration::ZERO,
                Duration::from_secs(1),
                Duration::from_secs(3)
            ]
        );
        let left: Vec<&str> = seen
            .iter()
            .map(|(_, h)| h["request-timeout-ms"].to_str().unwrap())
            .collect();
        assert_eq!(left, ["5000", "4000", "2000"]);
        let attempts: Vec<Option<&str>> = seen
            .iter()
            .map(|(_, h)| h.get("retry-attempt").map(|v| v.to_str().unwrap()))
            .collect();
        assert_eq!(attempts, [None, Some("2"), Some("3")]);
    }
}

both_forms! {
    #[tokio::test(start_paused = true)]
    async fn a_retry_that_would_outlast_the_deadline_is_not_made(form) {
        // 3 s left after the first 503; retry-after 3 leaves no time for the attempt.
        let (middleware, _, give_ups) = hooked(middleware());
        let replies = vec![(503, vec![("retry-after", "3")]), s(200)];
        let (client, seen) = stubbed(form, middleware, replies);
        let response = client
            .get("http://api.local/items")
            .with_extension(Deadline::after(Duration::from_secs(3)))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        assert!(marked(&response));
        assert_eq!(seen.lock().unwrap().len(), 1);
        assert_eq!(events(&give_ups)[0].reason, GiveUp::NotEnoughTime);
    }
}
