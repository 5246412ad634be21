//! The standalone `RetryMiddleware`'s fit in `ClientBuilder::with`, the size of the
//! fused middleware's one future, and attempts that start from the caller's extensions.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, Middleware, Next};
use retrysafe_core::Deadline;
use retrysafe_reqwest::retry::RetryMiddleware;
use retrysafe_test_support::both_forms;

use super::{middleware, s, serve, stack};

fn assert_send_sync<T: Send + Sync + 'static>(_: &T) {}

#[tokio::test]
async fn the_middleware_fits_the_client_builder_and_its_future_is_send() {
    let middleware = RetryMiddleware::default().generate_idempotency_keys();
    assert_send_sync(&middleware);
    let (url, script) = serve(vec![s(200)]).await;
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware.clone())
        .build();
    // `tokio::spawn` takes only `Send` futures.
    let response = tokio::spawn(client.get(format!("{url}/x")).send())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(script.seen().len(), 1);
    // The same middleware in a second client (a cheap clone).
    let other = ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build();
    assert_eq!(
        other.get(format!("{url}/y")).send().await.unwrap().status(),
        200
    );
    assert!(format!("{other:?}").contains("ClientWithMiddleware"));
}

/// A middleware above the stack that calls it, records the size of the future it
/// returns, and answers without awaiting it.
#[derive(Clone, Default)]
struct FutureSize(Arc<Mutex<Option<usize>>>);

#[async_trait::async_trait]
impl Middleware for FutureSize {
    async fn handle(
        &self,
        req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let future = next.run(req, extensions);
        *self.0.lock().unwrap() = Some(std::mem::size_of_val(&*future));
        drop(future);
        Err(reqwest_middleware::Error::middleware(
            std::io::Error::other("measured, not sent"),
        ))
    }
}

#[tokio::test]
async fn the_fused_middlewares_one_future_fits_the_allocators_thread_cache() {
    // The future the fused middleware returns is boxed once per call. glibc serves
    // blocks of up to 1 032 bytes from its per-thread cache; a larger one goes through
    // the arena, which costs a few hundred instructions more per call. The request is
    // kept once in that future (it was four times, in 3 928 bytes); see BENCHMARKS.md.
    let size = FutureSize::default();
    let builder = ClientBuilder::new(reqwest::Client::new()).with(size.clone());
    let client = retrysafe_reqwest::ClientMiddlewares::new()
        .deadline(Duration::from_secs(10))
        .build()
        .unwrap()
        .apply(builder)
        .build();
    let request = client.post("http://127.0.0.1:9/items").body("a body");
    assert!(request.send().await.is_err());
    let bytes = size.0.lock().unwrap().unwrap();
    assert!(
        bytes <= 1_032,
        "the fused middleware's future is {bytes} bytes"
    );
}

/// A middleware below the retry middleware that leaves a note in the extensions, and
/// records what each attempt saw there.
#[derive(Clone, Default)]
struct Scribble(Arc<Mutex<Vec<(bool, bool)>>>);

#[derive(Clone)]
struct Note;

#[async_trait::async_trait]
impl Middleware for Scribble {
    async fn handle(
        &self,
        request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        use retrysafe_core::strategy::RetryCharged;
        self.0.lock().unwrap().push((
            extensions.get::<Note>().is_some(),
            extensions.get::<RetryCharged>().is_some(),
        ));
        extensions.insert(Note);
        next.run(request, extensions).await
    }
}

#[tokio::test]
async fn each_attempt_starts_from_the_callers_extensions_and_nothing_leaks_back() {
    use retrysafe_core::strategy::RetryCharged;
    use retrysafe_reqwest::DeadlineMiddleware;
    let (url, script) = serve(vec![s(503), s(200), s(503), s(200)]).await;
    let scribble = Scribble::default();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(DeadlineMiddleware::new(Duration::from_millis(500)))
        .with(middleware())
        .with(scribble.clone())
        .build();
    let mut extensions = Extensions::new();
    let request = client.get(format!("{url}/a")).build().unwrap();
    let response = client
        .execute_with_extensions(request, &mut extensions)
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // The retry did not see the first attempt's note; each carried its retry mark.
    assert_eq!(*scribble.0.lock().unwrap(), [(false, true), (false, true)]);
    // The caller's extensions hold no deadline and no retry mark afterwards...
    assert!(extensions.get::<Deadline>().is_none());
    assert!(extensions.get::<RetryCharged>().is_none());
    // ...so reusing them after the first call's deadline has passed works.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let request = client.get(format!("{url}/b")).build().unwrap();
    let response = client
        .execute_with_extensions(request, &mut extensions)
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(script.seen().len(), 4);
}

both_forms! {
    #[tokio::test]
    async fn no_attempt_sees_another_attempts_extensions_and_nothing_leaks_back(form) {
        let (url, script) = serve(vec![s(503), s(200), s(503), s(200)]).await;
        let scribble = Scribble::default();
        let client = stack(middleware())
            .deadline(Duration::from_millis(500))
            .below(scribble.clone())
            .client(form);
        let mut extensions = Extensions::new();
        let request = client.get(format!("{url}/a")).build().unwrap();
        let response = client
            .execute_with_extensions(request, &mut extensions)
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        // The retry did not see the first attempt's note.
        let notes: Vec<bool> = scribble.0.lock().unwrap().iter().map(|s| s.0).collect();
        assert_eq!(notes, [false, false]);
        // The caller's extensions hold no deadline and no retry mark afterwards...
        assert!(extensions.get::<Deadline>().is_none());
        assert!(
            extensions
                .get::<retrysafe_core::strategy::RetryCharged>()
                .is_none()
        );
        // ...so reusing them after the first call's deadline has passed works.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let request = client.get(format!("{url}/b")).build().unwrap();
        let response = client
            .execute_with_extensions(request, &mut extensions)
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(script.seen().len(), 4);
    }
}
