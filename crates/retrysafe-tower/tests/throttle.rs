//! Tests of the `AdaptiveThrottleLayer` with seeded draws on tokio's paused clock:
//! what counts as an accept, that rejections never reach the callee and are typed,
//! local and never retried, the gRPC answer, the window, and reproducibility.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub
)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use retrysafe_core::classify::Failure;
use retrysafe_core::error::find;
use retrysafe_tower::BoxError;
use retrysafe_tower::answer::GrpcStatusLayer;
use retrysafe_tower::retry::{ReplayBody, RetryLayer, failure_of};
use retrysafe_tower::throttle::{AdaptiveThrottleLayer, Throttled};
use tower::{Service, ServiceBuilder, ServiceExt};

/// A callee answering `status` (with `retry-after: 1` when asked), counting its calls.
fn callee<B>(
    status: u16,
    retry_after: bool,
    calls: &Arc<AtomicU32>,
) -> impl Service<Request<B>, Response = Response<String>, Error = Infallible, Future = impl Send> + Clone
{
    let calls = Arc::clone(calls);
    tower::service_fn(move |_req: Request<B>| {
        calls.fetch_add(1, Ordering::SeqCst);
        let mut response = Response::builder().status(status);
        if retry_after {
            response = response.header("retry-after", "1");
        }
        std::future::ready(Ok::<_, Infallible>(response.body(String::new()).unwrap()))
    })
}

fn get() -> Request<String> {
    Request::get("http://api/items")
        .body(String::new())
        .unwrap()
}

/// Makes `n` calls; the outcomes: `true` for an answer, `false` for `Throttled`.
async fn drive<S>(svc: &mut S, n: usize) -> Vec<bool>
where
    S: Service<Request<String>, Error = BoxError>,
{
    let mut outcomes = Vec::with_capacity(n);
    for _ in 0..n {
        match svc.ready().await.unwrap().call(get()).await {
            Ok(_) => outcomes.push(true),
            Err(e) => {
                assert!(find::<Throttled>(&*e).is_some(), "{e}");
                outcomes.push(false);
            }
        }
    }
    outcomes
}

#[tokio::test(start_paused = true)]
async fn a_healthy_callee_is_never_throttled() {
    let calls = Arc::new(AtomicU32::new(0));
    let layer = AdaptiveThrottleLayer::new().seed(1);
    let mut svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(callee(200, false, &calls));
    assert!(drive(&mut svc, 500).await.into_iter().all(|ok| ok));
    assert_eq!(layer.throttle().counts(), (500, 500));
    // A 4xx is the callee's accepted answer too.
    let mut svc = ServiceBuilder::new()
        .layer(AdaptiveThrottleLayer::new().seed(1))
        .service(callee(404, false, &calls));
    assert!(drive(&mut svc, 500).await.into_iter().all(|ok| ok));
}

#[tokio::test(start_paused = true)]
async fn throttles_and_overloads_are_not_accepts_and_rejections_stay_home() {
    for (status, retry_after) in [(429, false), (503, true), (503, false)] {
        let calls = Arc::new(AtomicU32::new(0));
        let layer = AdaptiveThrottleLayer::new().seed(3);
        let mut svc =
            ServiceBuilder::new()
                .layer(layer.clone())
                .service(callee(status, retry_after, &calls));
        let outcomes = drive(&mut svc, 1000).await;
        let sent = outcomes.iter().filter(|ok| **ok).count();
        assert_eq!(
            calls.load(Ordering::SeqCst) as usize,
            sent,
            "rejections stay home"
        );
        assert!(
            sent < 20,
            "{status}: {sent} sent to a callee that accepts nothing"
        );
        assert_eq!(
            layer.throttle().counts(),
            (1000, 0),
            "every call is a request"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn the_same_seed_makes_the_same_decisions_and_the_window_forgets() {
    let run = || async {
        let calls = Arc::new(AtomicU32::new(0));
        let layer = AdaptiveThrottleLayer::new()
            .seed(42)
            .window(Duration::from_secs(10))
            .k(1.5)
            .build()
            .unwrap();
        let mut svc = ServiceBuilder::new()
            .layer(layer.clone())
            .service(callee(503, false, &calls));
        let first = drive(&mut svc, 200).await;
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(layer.throttle().counts(), (0, 0), "the window forgot");
        assert!(
            drive(&mut svc, 1).await[0],
            "nothing counts against a new call"
        );
        first
    };
    let first = run().await;
    assert_eq!(first, run().await);
    let mut other = AdaptiveThrottleLayer::new().seed(43);
    let calls = Arc::new(AtomicU32::new(0));
    let mut svc = ServiceBuilder::new()
        .layer(std::mem::take(&mut other))
        .service(callee(503, false, &calls));
    assert_ne!(
        first,
        drive(&mut svc, 200).await,
        "another seed draws otherwise"
    );
}

#[tokio::test(start_paused = true)]
async fn a_rejection_is_local_and_never_retried_above() {
    let e: BoxError = Box::new(Throttled::new());
    assert_eq!(failure_of(&*e), Failure::Local);
    // A RetryLayer above a throttle that rejects: one call, the typed error.
    let calls = Arc::new(AtomicU32::new(0));
    let layer = AdaptiveThrottleLayer::new().seed(5);
    let mut inner = ServiceBuilder::new()
        .layer(layer.clone())
        .service(callee(503, false, &calls));
    drive(&mut inner, 100).await;
    let before = layer.throttle().counts().0;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .layer(layer.clone())
        .service(callee::<ReplayBody<String>>(503, false, &calls));
    let mut throttled = 0;
    for _ in 0..20 {
        if let Err(e) = svc.clone().oneshot(get()).await {
            assert!(find::<Throttled>(&*e).is_some());
            throttled += 1;
        }
    }
    assert!(throttled > 0);
    // Every attempt the retry layer made is a request; a rejection ended its call.
    let attempts = layer.throttle().counts().0 - before;
    assert!(
        attempts >= 20 && attempts < 20 + 3 * (20 - throttled),
        "{attempts}"
    );
}

#[tokio::test(start_paused = true)]
async fn grpc_rejections_are_unavailable_marked_do_not_retry() {
    let calls = Arc::new(AtomicU32::new(0));
    let svc = ServiceBuilder::new()
        .layer(GrpcStatusLayer::new())
        .layer(AdaptiveThrottleLayer::new().seed(9))
        .service(callee(429, false, &calls));
    let grpc = || {
        Request::post("http://api/pkg.Svc/Get")
            .header("content-type", "application/grpc")
            .body(String::new())
            .unwrap()
    };
    let mut last = None;
    for _ in 0..50 {
        last = Some(svc.clone().oneshot(grpc()).await.unwrap());
    }
    let last = last.unwrap();
    assert_eq!(last.status(), StatusCode::OK);
    assert_eq!(last.headers()["grpc-status"], "14");
    assert_eq!(last.headers()["do-not-retry"], "1");
}

#[test]
fn build_names_every_bad_field() {
    let e = AdaptiveThrottleLayer::new()
        .window(Duration::ZERO)
        .k(0.0)
        .build()
        .unwrap_err();
    assert_eq!(e.fields().collect::<Vec<_>>(), ["window", "k"]);
}

#[tokio::test(start_paused = true)]
async fn grpc_unavailable_and_resource_exhausted_in_the_head_are_not_accepts() {
    // Trailers-Only answers (HTTP 200, the status in the head), as tonic sends a failed
    // unary call; OK and NOT_FOUND are accepts.
    for (code, accepted) in [("14", false), ("8", false), ("0", true), ("5", true)] {
        let layer = AdaptiveThrottleLayer::new().seed(2);
        let svc = ServiceBuilder::new()
            .layer(layer.clone())
            .service(tower::service_fn(move |_req: Request<String>| {
                let response = Response::builder()
                    .header("content-type", "application/grpc")
                    .header("grpc-status", code)
                    .body(String::new())
                    .unwrap();
                std::future::ready(Ok::<_, Infallible>(response))
            }));
        let request = Request::post("http://api/pkg.Svc/Get")
            .header("content-type", "application/grpc")
            .body(String::new())
            .unwrap();
        svc.oneshot(request).await.unwrap();
        let accepts = u64::from(accepted);
        assert_eq!(
            layer.throttle().counts(),
            (1, accepts),
            "grpc-status {code}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn client_layers_throttle_once_per_call_and_never_retry_a_rejection() {
    use retrysafe_core::budget::{BudgetSnapshot, RetryBudget};
    use retrysafe_core::strategy::StandardRetryStrategy;
    use retrysafe_tower::client::ClientLayers;

    // A callee that refuses everything with 503: the retry part makes up to three
    // attempts of each call the throttle lets through; a rejection reaches nothing.
    let calls = Arc::new(AtomicU32::new(0));
    let layer = AdaptiveThrottleLayer::new().seed(4);
    let budget = RetryBudget::ratio();
    let layers = ClientLayers::new()
        .retry(RetryLayer::new().strategy(StandardRetryStrategy::new().seed(1)))
        .budget(budget.clone())
        .throttle(layer.clone())
        .build()
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(layers)
        .service(callee::<ReplayBody<String>>(503, false, &calls));
    let (mut throttled, mut answered) = (0, 0);
    for _ in 0..60 {
        let before = calls.load(Ordering::SeqCst);
        match svc.clone().oneshot(get()).await {
            Ok(response) => {
                assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
                assert_eq!(response.headers()["do-not-retry"], "1");
                answered += 1;
            }
            Err(e) => {
                assert!(find::<Throttled>(&*e).is_some(), "{e}");
                assert_eq!(
                    calls.load(Ordering::SeqCst),
                    before,
                    "a rejection stays home"
                );
                throttled += 1;
            }
        }
    }
    assert!(throttled > 30, "{throttled} of 60 throttled");
    // One request per logical call, however many attempts it made; no accept.
    assert_eq!(layer.throttle().counts(), (60, 0));
    // A rejection is no request for the budget: one deposit per call let through.
    match budget.snapshot() {
        BudgetSnapshot::Ratio { deposits, .. } => assert_eq!(deposits, answered),
        other => panic!("{other:?}"),
    }
    assert!(
        u64::from(calls.load(Ordering::SeqCst)) > answered,
        "the retry part retried"
    );
}
