//! Tests of the `HedgeLayer` on tokio's paused clock, so every delay is exact: which
//! requests are hedged, when, with which headers, what wins, the budget, the retry
//! point, the deadline, the percentile delay, and the `RetryLayer` below.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub
)]

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use retrysafe_core::budget::{BudgetSnapshot, RatioConfig, RetryBudget};
use retrysafe_core::strategy::{Idempotent, NoRetry};
use retrysafe_core::{CallContext, Deadline};
use retrysafe_tower::hedge::HedgeLayer;
use retrysafe_tower::retry::{ReplayBody, RetryLayer};
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};

/// What the callee saw of one call: its `retry-attempt` header.
type Seen = Arc<Mutex<Vec<Option<String>>>>;

/// A callee that reads the body, then answers the n-th call (0-based) after `waits[n]` ms with
/// `statuses[n]` (200 past the end of either), recording each call's `retry-attempt`.
fn callee<B>(
    waits: &'static [u64],
    statuses: &'static [u16],
    seen: &Seen,
) -> impl tower::Service<Request<B>, Response = Response<String>, Error = Infallible, Future = impl Send>
+ Clone
+ Send
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
{
    let seen = Arc::clone(seen);
    tower::service_fn(move |req: Request<B>| {
        let n = {
            let mut seen = seen.lock().unwrap();
            seen.push(
                req.headers()
                    .get("retry-attempt")
                    .map(|v| v.to_str().unwrap().to_owned()),
            );
            seen.len() - 1
        };
        async move {
            // Read the body first, as a server does: a hedge waits for it.
            let _ = req.into_body().collect().await;
            let wait = waits.get(n).copied().unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(wait)).await;
            let status = statuses.get(n).copied().unwrap_or(200);
            let response = Response::builder()
                .status(status)
                .body(format!("call {n}"))
                .unwrap();
            Ok::<_, Infallible>(response)
        }
    })
}

fn get() -> Request<String> {
    Request::get("http://api/items")
        .body(String::new())
        .unwrap()
}

fn fixed(ms: u64) -> HedgeLayer {
    HedgeLayer::new()
        .delay(Duration::from_millis(ms))
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_slow_get_is_hedged_and_the_first_answer_wins() {
    let seen = Seen::default();
    let layer = fixed(20);
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(callee(&[100, 5], &[], &seen));
    let started = Instant::now();
    let response = svc.oneshot(get()).await.unwrap();
    assert_eq!(response.body(), "call 1");
    assert_eq!(started.elapsed(), Duration::from_millis(25));
    assert_eq!(*seen.lock().unwrap(), [None, Some("2".to_owned())]);
    let stats = layer.stats();
    assert_eq!((stats.sent, stats.won, stats.budget_refusals), (1, 1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_fast_answer_sends_no_hedge() {
    let seen = Seen::default();
    let layer = fixed(20);
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(callee(&[10], &[], &seen));
    assert_eq!(svc.oneshot(get()).await.unwrap().body(), "call 0");
    assert_eq!(seen.lock().unwrap().len(), 1);
    assert_eq!(layer.stats().sent, 0);
}

#[tokio::test(start_paused = true)]
async fn max_hedges_are_sent_one_delay_apart() {
    let seen = Seen::default();
    let layer = fixed(10).max_hedges(2).build().unwrap();
    let svc =
        ServiceBuilder::new()
            .layer(layer.clone())
            .service(callee(&[100, 100, 5], &[], &seen));
    let started = Instant::now();
    assert_eq!(svc.oneshot(get()).await.unwrap().body(), "call 2");
    assert_eq!(started.elapsed(), Duration::from_millis(25));
    assert_eq!(
        *seen.lock().unwrap(),
        [None, Some("2".to_owned()), Some("3".to_owned())]
    );
}

#[tokio::test(start_paused = true)]
async fn a_retryable_answer_does_not_win() {
    // The hedge answers 503 first; the slow first copy's 200 wins.
    let seen = Seen::default();
    let layer = fixed(20);
    let svc =
        ServiceBuilder::new()
            .layer(layer.clone())
            .service(callee(&[50, 1], &[200, 503], &seen));
    let started = Instant::now();
    let response = svc.oneshot(get()).await.unwrap();
    assert_eq!(
        (response.status(), response.body().as_str()),
        (StatusCode::OK, "call 0")
    );
    assert_eq!(started.elapsed(), Duration::from_millis(50));
    assert_eq!(layer.stats().won, 0);
}

#[tokio::test(start_paused = true)]
async fn a_4xx_is_acceptable() {
    let seen = Seen::default();
    let svc = ServiceBuilder::new()
        .layer(fixed(20))
        .service(callee(&[50, 1], &[200, 404], &seen));
    let response = svc.oneshot(get()).await.unwrap();
    assert_eq!(
        response.status(),
        StatusCode::NOT_FOUND,
        "a 4xx is not retried: it wins"
    );
}

#[tokio::test(start_paused = true)]
async fn unsafe_requests_are_never_hedged() {
    let post = || {
        Request::post("http://api/pay")
            .body(String::from("{}"))
            .unwrap()
    };
    let keyed = || {
        Request::post("http://api/pay")
            .header("idempotency-key", "k1")
            .body(String::from("{}"))
            .unwrap()
    };
    for (layer, request, calls) in [
        (fixed(20), post(), 1),
        (fixed(20), keyed(), 1),
        (fixed(20).hedge_keyed_requests(), keyed(), 2),
        (fixed(20).hedge_keyed_requests(), post(), 1),
    ] {
        let seen = Seen::default();
        let svc = ServiceBuilder::new()
            .layer(layer)
            .service(callee(&[100, 5], &[], &seen));
        svc.oneshot(request).await.unwrap();
        assert_eq!(seen.lock().unwrap().len(), calls);
    }
    // Declared idempotent: hedged; `NoRetry`: not.
    for (mark_idempotent, calls) in [(true, 2), (false, 1)] {
        let seen = Seen::default();
        let svc = ServiceBuilder::new()
            .layer(fixed(20))
            .service(callee(&[100, 5], &[], &seen));
        let mut request = post();
        if mark_idempotent {
            request.extensions_mut().insert(Idempotent);
        } else {
            *request.method_mut() = Method::GET;
            request.extensions_mut().insert(NoRetry);
        }
        svc.oneshot(request).await.unwrap();
        assert_eq!(seen.lock().unwrap().len(), calls);
    }
}

#[tokio::test(start_paused = true)]
async fn a_hop_that_is_not_the_retry_point_does_not_hedge() {
    let seen = Seen::default();
    let svc = ServiceBuilder::new()
        .layer(fixed(20))
        .service(callee(&[100, 5], &[], &seen));
    let mut request = get();
    request
        .extensions_mut()
        .insert(CallContext::new().with_caller_is_retry_point(true));
    svc.oneshot(request).await.unwrap();
    assert_eq!(seen.lock().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_budget_pays_for_hedges_and_refusals_are_counted() {
    // No floor and no deposits: nothing to pay with.
    let budget = RetryBudget::ratio_with(RatioConfig::default().with_min_per_sec(0));
    let seen = Seen::default();
    let layer = fixed(20).budget(budget.clone());
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(callee(&[100, 5], &[], &seen));
    assert_eq!(svc.oneshot(get()).await.unwrap().body(), "call 0");
    assert_eq!(seen.lock().unwrap().len(), 1);
    assert_eq!(layer.stats().budget_refusals, 1);
}

#[tokio::test(start_paused = true)]
async fn with_a_retry_layer_below_one_deposit_per_request_and_the_hedge_is_withdrawn() {
    let budget = RetryBudget::ratio_with(
        RatioConfig::default()
            .with_min_per_sec(0)
            .with_retry_ratio(1.0),
    );
    let seen = Seen::default();
    let layer = fixed(20).budget(budget.clone());
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .layer(RetryLayer::new())
        .service(callee(&[100, 5], &[200, 200], &seen));
    assert_eq!(svc.oneshot(get()).await.unwrap().body(), "call 1");
    match budget.snapshot() {
        BudgetSnapshot::Ratio {
            deposits,
            withdrawals,
            ..
        } => assert_eq!((deposits, withdrawals), (1, 1)),
        other => panic!("{other:?}"),
    }
    // The hedge is sent once by the retry layer: a 503 to it is not retried.
    let seen = Seen::default();
    let svc = ServiceBuilder::new()
        .layer(fixed(20).budget(budget.clone()))
        .layer(RetryLayer::new())
        .service(callee(&[100, 1], &[200, 503], &seen));
    assert_eq!(svc.oneshot(get()).await.unwrap().body(), "call 0");
    assert_eq!(seen.lock().unwrap().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn no_hedge_past_the_deadline() {
    let seen = Seen::default();
    let layer = fixed(20);
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(callee(&[100, 5], &[], &seen));
    let mut request = get();
    request
        .extensions_mut()
        .insert(Deadline::after(Duration::from_millis(15)));
    svc.oneshot(request).await.unwrap();
    assert_eq!(seen.lock().unwrap().len(), 1);
    assert_eq!(layer.stats().sent, 0);
}

#[tokio::test(start_paused = true)]
async fn the_percentile_delay_waits_for_samples_and_has_a_floor() {
    let seen = Seen::default();
    let layer = HedgeLayer::new().build().unwrap();
    // 20 answers of 1 ms, then one of 100 ms: hedged at the 10 ms floor.
    let waits: &'static [u64] = Box::leak(
        std::iter::repeat_n(1, 20)
            .chain([100, 1])
            .collect::<Vec<_>>()
            .into_boxed_slice(),
    );
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(callee(waits, &[], &seen));
    for _ in 0..20 {
        svc.clone().oneshot(get()).await.unwrap();
    }
    assert_eq!(layer.stats().sent, 0, "no hedge before 20 samples");
    let started = Instant::now();
    assert_eq!(svc.oneshot(get()).await.unwrap().body(), "call 21");
    assert_eq!(started.elapsed(), Duration::from_millis(11));
    assert_eq!(layer.stats().sent, 1);
}

#[test]
fn build_names_every_bad_field() {
    let e = HedgeLayer::new()
        .max_hedges(0)
        .percentile(1.5)
        .max_replay_body(usize::MAX)
        .build()
        .unwrap_err();
    assert_eq!(
        e.fields().collect::<Vec<_>>(),
        ["max_hedges", "percentile", "max_replay_body"]
    );
    let e = HedgeLayer::new().delay(Duration::ZERO).build().unwrap_err();
    assert_eq!(e.fields().collect::<Vec<_>>(), ["delay"]);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_loser_is_neutral_to_a_half_open_breaker() {
    use retrysafe_core::breaker::{BreakerConfig, CircuitBreaker, State};
    use retrysafe_tower::breaker::CircuitBreakerLayer;

    let config = BreakerConfig::default()
        .with_minimum_calls(2)
        .with_half_open_probes(2);
    let breaker = CircuitBreaker::new(config);
    // Open it with two failures.
    let seen = Seen::default();
    let failing = ServiceBuilder::new()
        .layer(CircuitBreakerLayer::new(breaker.clone()))
        .service(callee(&[], &[502, 502], &seen));
    for _ in 0..2 {
        let _ = failing.clone().oneshot(get()).await.unwrap();
    }
    assert_eq!(breaker.state(), State::Open);
    tokio::time::advance(Duration::from_secs(5)).await;

    // Half-open: the slow first copy and the hedge are the two probes; the hedge wins
    // and the first copy is cancelled: given back, not counted as a failure.
    let seen = Seen::default();
    let svc = ServiceBuilder::new()
        .layer(fixed(20))
        .layer(CircuitBreakerLayer::new(breaker.clone()))
        .service(callee(&[100, 5], &[], &seen));
    let response = svc.oneshot(get()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(seen.lock().unwrap().len(), 2);
    assert_ne!(
        breaker.state(),
        State::Open,
        "not reopened by the cancelled copy"
    );
}

#[tokio::test(start_paused = true)]
async fn a_hedge_refused_below_does_not_end_the_call() {
    use retrysafe_core::budget::RetryBudget;
    use retrysafe_tower::budget::RetryBudgetLayer;

    // A budget layer below with an empty budget of its own refuses the hedge (marked
    // retry-attempt 2, paid for in another budget): the first copy's answer comes.
    let seen = Seen::default();
    let empty = RetryBudget::ratio_with(RatioConfig::default().with_min_per_sec(0));
    let svc = ServiceBuilder::new()
        .layer(fixed(20))
        .layer(RetryBudgetLayer::new(empty))
        .service(callee(&[100, 5], &[], &seen));
    assert_eq!(svc.oneshot(get()).await.unwrap().body(), "call 0");
    assert_eq!(seen.lock().unwrap().len(), 1);
}

/// A callee that answers the n-th call (0-based) after `waits[n]` ms with `statuses[n]`
/// and, when `marked[n]`, `do-not-retry: 1`; it records every call's head and the time
/// it arrived.
fn scripted(
    waits: &'static [u64],
    statuses: &'static [u16],
    marked: &'static [bool],
    heads: &Heads,
) -> impl tower::Service<
    Request<ReplayBody<String>>,
    Response = Response<String>,
    Error = Infallible,
    Future = impl Send,
> + Clone
+ Send {
    let heads = Arc::clone(heads);
    tower::service_fn(move |req: Request<ReplayBody<String>>| {
        let n = {
            let mut heads = heads.lock().unwrap();
            heads.push((Instant::now(), req.headers().clone()));
            heads.len() - 1
        };
        async move {
            let _ = req.into_body().collect().await;
            tokio::time::sleep(Duration::from_millis(waits.get(n).copied().unwrap_or(0))).await;
            let mut response = Response::builder().status(statuses.get(n).copied().unwrap_or(200));
            if marked.get(n).copied().unwrap_or(false) {
                response = response.header("do-not-retry", "1");
            }
            Ok::<_, Infallible>(response.body(format!("call {n}")).unwrap())
        }
    })
}

/// The heads of the calls a `scripted` callee got, and when each arrived.
type Heads = Arc<Mutex<Vec<(Instant, http::HeaderMap)>>>;

fn header(heads: &Heads, n: usize, name: &str) -> Option<String> {
    heads.lock().unwrap()[n]
        .1
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
}

/// A ratio budget with no floor, where each deposit pays for one withdrawal.
fn one_for_one() -> RetryBudget {
    RetryBudget::ratio_with(
        RatioConfig::default()
            .with_min_per_sec(0)
            .with_retry_ratio(1.0),
    )
}

fn deposits_and_withdrawals(budget: &RetryBudget) -> (u64, u64) {
    match budget.snapshot() {
        BudgetSnapshot::Ratio {
            deposits,
            withdrawals,
            ..
        } => (deposits, withdrawals),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn an_answer_marked_do_not_retry_wins() {
    // The hedge's 503 is marked do-not-retry: no retry layer would follow it, so it is
    // the answer, ahead of the slow first copy's 200.
    let heads = Heads::default();
    let layer = fixed(20);
    let svc = ServiceBuilder::new().layer(layer.clone()).service(scripted(
        &[100, 5],
        &[200, 503],
        &[false, true],
        &heads,
    ));
    let response = svc.oneshot(get()).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.body(), "call 1");
    assert_eq!(layer.stats().won, 1);
}

#[tokio::test(start_paused = true)]
async fn with_no_acceptable_answer_the_first_copys_comes_back() {
    // Both copies answer 503 (the hedge first): the first copy's answer is returned.
    let seen = Seen::default();
    let layer = fixed(20);
    let svc =
        ServiceBuilder::new()
            .layer(layer.clone())
            .service(callee(&[100, 5], &[503, 503], &seen));
    let started = Instant::now();
    let response = svc.oneshot(get()).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.body(), "call 0");
    assert_eq!(started.elapsed(), Duration::from_millis(100));
    assert_eq!((layer.stats().sent, layer.stats().won), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_streaming_body_is_hedged_only_once_it_is_wholly_read() {
    use bytes::Bytes;
    use http_body_util::StreamBody;

    // The body's second half comes 50 ms after the first; the hedge is due at 20 ms.
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(2);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        let chunk = rx.recv().await?;
        Some((Ok::<_, Infallible>(http_body::Frame::data(chunk)), rx))
    });
    let request = Request::put("http://api/items/1")
        .body(StreamBody::new(stream))
        .unwrap();
    tokio::spawn(async move {
        tx.send(Bytes::from_static(b"hello ")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        tx.send(Bytes::from_static(b"world")).await.unwrap();
    });
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let (b, a) = (Arc::clone(&bodies), Arc::clone(&arrivals));
    let layer = fixed(20);
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(tower::service_fn(move |req: Request<ReplayBody<_>>| {
            let n = {
                let mut a = a.lock().unwrap();
                a.push(Instant::now());
                a.len() - 1
            };
            let b = Arc::clone(&b);
            async move {
                let body = req.into_body().collect().await.unwrap().to_bytes();
                b.lock().unwrap().push(body);
                let wait = if n == 0 { 1_000 } else { 5 };
                tokio::time::sleep(Duration::from_millis(wait)).await;
                Ok::<_, Infallible>(Response::new(format!("call {n}")))
            }
        }));
    let started = Instant::now();
    assert_eq!(svc.oneshot(request).await.unwrap().body(), "call 1");
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), 2);
    assert!(
        arrivals[1] - started >= Duration::from_millis(50),
        "the hedge left at {:?}, before the body was read",
        arrivals[1] - started
    );
    assert!(bodies.lock().unwrap().iter().all(|b| b == "hello world"));
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_cap_is_never_hedged() {
    let seen = Seen::default();
    let layer = fixed(20).max_replay_body(4).build().unwrap();
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(callee(&[100, 5], &[], &seen));
    let request = Request::put("http://api/items/1")
        .body(String::from("hello world"))
        .unwrap();
    assert_eq!(svc.oneshot(request).await.unwrap().body(), "call 0");
    assert_eq!(seen.lock().unwrap().len(), 1);
    assert_eq!(layer.stats().sent, 0);
}

#[tokio::test(start_paused = true)]
async fn a_grpc_hedge_carries_grpc_previous_rpc_attempts() {
    let heads = Heads::default();
    let svc = ServiceBuilder::new()
        .layer(fixed(20))
        .service(scripted(&[100, 5], &[], &[], &heads));
    // A gRPC call is a POST: hedged when declared idempotent.
    let mut request = Request::post("http://api/pkg.Svc/Get")
        .header("content-type", "application/grpc")
        .body(String::new())
        .unwrap();
    request.extensions_mut().insert(Idempotent);
    assert_eq!(svc.oneshot(request).await.unwrap().body(), "call 1");
    assert_eq!(header(&heads, 0, "grpc-previous-rpc-attempts"), None);
    assert_eq!(
        header(&heads, 1, "grpc-previous-rpc-attempts").as_deref(),
        Some("1")
    );
    assert_eq!(header(&heads, 1, "retry-attempt").as_deref(), Some("2"));
}

#[tokio::test(start_paused = true)]
async fn the_same_budget_in_a_budget_layer_below_is_not_charged_twice() {
    use retrysafe_core::strategy::StandardRetryStrategy;
    use retrysafe_tower::budget::RetryBudgetLayer;

    // One deposit pays for one withdrawal: a second charge of the hedge would be
    // refused by the budget layer, and the slow first copy's answer would come.
    let budget = one_for_one();
    let seen = Seen::default();
    let svc = ServiceBuilder::new()
        .layer(fixed(20).budget(budget.clone()))
        .layer(RetryLayer::new().strategy(StandardRetryStrategy::new().budget(budget.clone())))
        .layer(RetryBudgetLayer::new(budget.clone()))
        .service(callee(&[100, 5], &[], &seen));
    assert_eq!(svc.oneshot(get()).await.unwrap().body(), "call 1");
    assert_eq!(deposits_and_withdrawals(&budget), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn on_its_own_the_hedge_makes_the_requests_deposit() {
    // No retry layer below: the hedge layer deposits for the request, once, and that
    // pays for its hedge (with no floor, nothing else could).
    let budget = one_for_one();
    let seen = Seen::default();
    let layer = fixed(20).budget(budget.clone());
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(callee(&[100, 5, 1], &[], &seen));
    assert_eq!(svc.clone().oneshot(get()).await.unwrap().body(), "call 1");
    assert_eq!(deposits_and_withdrawals(&budget), (1, 1));
    // A fast call deposits too, once.
    assert_eq!(svc.oneshot(get()).await.unwrap().body(), "call 2");
    assert_eq!(deposits_and_withdrawals(&budget), (2, 1));
    assert_eq!(layer.stats().sent, 1);
}

#[tokio::test(start_paused = true)]
async fn a_hedge_waiting_for_readiness_costs_nothing_when_the_first_copy_wins() {
    // One slot below: the first copy holds it, so the hedge due at 20 ms waits for
    // readiness until the first copy has answered, and is never sent nor paid for.
    let budget = one_for_one();
    let seen = Seen::default();
    let layer = fixed(20).budget(budget.clone());
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .concurrency_limit(1)
        .service(callee(&[100], &[], &seen));
    assert_eq!(svc.oneshot(get()).await.unwrap().body(), "call 0");
    assert_eq!(seen.lock().unwrap().len(), 1);
    assert_eq!(deposits_and_withdrawals(&budget), (1, 0));
    assert_eq!((layer.stats().sent, layer.stats().budget_refusals), (0, 0));
}

// ClientLayers with a hedge: the same race, each copy a call of the fused part.

#[tokio::test(start_paused = true)]
async fn client_layers_send_a_hedge_with_retry_attempt_from_the_stacks_budget() {
    use retrysafe_tower::client::ClientLayers;

    let budget = one_for_one();
    let heads = Heads::default();
    let hedge = fixed(20);
    let layers = ClientLayers::new()
        .budget(budget.clone())
        .hedge(hedge.clone())
        .build()
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(layers)
        .service(scripted(&[100, 5], &[], &[], &heads));
    let started = Instant::now();
    let response = svc.oneshot(get()).await.unwrap();
    assert_eq!(started.elapsed(), Duration::from_millis(25));
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "call 1");
    assert_eq!(header(&heads, 0, "retry-attempt"), None);
    assert_eq!(header(&heads, 1, "retry-attempt").as_deref(), Some("2"));
    // One deposit for the request (the retry part's), one withdrawal for the hedge,
    // both in the stack's budget; the hedge layer's own is not used.
    assert_eq!(deposits_and_withdrawals(&budget), (1, 1));
    assert_eq!(deposits_and_withdrawals(hedge.retry_budget()), (0, 0));
    assert_eq!((hedge.stats().sent, hedge.stats().won), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn client_layers_hedges_never_outlive_the_deadline() {
    use retrysafe_core::error::{DeadlineExceeded, find};
    use retrysafe_tower::client::ClientLayers;

    // The deadline (30 ms) is outermost: the hedge sent at 20 ms is told what is
    // left of it, and the call ends with the deadline, both copies with it.
    let heads = Heads::default();
    let layers = ClientLayers::new()
        .deadline(Duration::from_millis(30))
        .hedge(fixed(20))
        .build()
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(layers)
        .service(scripted(&[100, 100], &[], &[], &heads));
    let started = Instant::now();
    let error = svc.clone().oneshot(get()).await.unwrap_err();
    assert!(find::<DeadlineExceeded>(&*error).is_some(), "{error}");
    assert_eq!(started.elapsed(), Duration::from_millis(30));
    assert_eq!(heads.lock().unwrap().len(), 2);
    assert_eq!(
        header(&heads, 0, "request-timeout-ms").as_deref(),
        Some("30")
    );
    assert_eq!(
        header(&heads, 1, "request-timeout-ms").as_deref(),
        Some("10")
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        heads.lock().unwrap().len(),
        2,
        "nothing is sent after the call"
    );

    // A deadline shorter than the hedge delay: no hedge at all.
    let heads = Heads::default();
    let layers = ClientLayers::new()
        .deadline(Duration::from_millis(15))
        .hedge(fixed(20))
        .build()
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(layers)
        .service(scripted(&[100, 100], &[], &[], &heads));
    assert!(svc.oneshot(get()).await.is_err());
    assert_eq!(heads.lock().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn client_layers_retry_the_first_copy_but_send_each_hedge_once() {
    use retrysafe_core::strategy::StandardRetryStrategy;
    use retrysafe_tower::client::ClientLayers;

    // The hedge (sent at 5 ms) answers 503 at 6 ms and is not retried; the first copy
    // answers 503 at 10 ms and is retried; the retry's 200 wins.
    let heads = Heads::default();
    let hedge = fixed(5);
    let layers = ClientLayers::new()
        .retry(RetryLayer::new().strategy(StandardRetryStrategy::new().seed(3)))
        .hedge(hedge.clone())
        .build()
        .unwrap();
    let svc = ServiceBuilder::new().layer(layers).service(scripted(
        &[10, 1, 0],
        &[503, 503, 200],
        &[],
        &heads,
    ));
    let response = svc.oneshot(get()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "call 2");
    assert_eq!(heads.lock().unwrap().len(), 3);
    assert_eq!(header(&heads, 1, "retry-attempt").as_deref(), Some("2"));
    assert_eq!(header(&heads, 2, "retry-attempt").as_deref(), Some("2"));
    assert_eq!((hedge.stats().sent, hedge.stats().won), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_hedge_refused_after_waiting_for_readiness_leaves_the_first_copys_answer() {
    // The first copy holds the one slot and answers 503 at 100 ms; the hedge that
    // waited for the slot is then refused by an empty budget: the 503 is the answer.
    let empty = RetryBudget::ratio_with(
        RatioConfig::default()
            .with_min_per_sec(0)
            .with_retry_ratio(0.0),
    );
    let seen = Seen::default();
    let layer = fixed(20).budget(empty);
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .concurrency_limit(1)
        .service(callee(&[100], &[503], &seen));
    let answer = tokio::time::timeout(Duration::from_secs(60), svc.oneshot(get())).await;
    let response = answer.expect("the call ended").unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.lock().unwrap().len(), 1);
    assert_eq!((layer.stats().sent, layer.stats().budget_refusals), (0, 1));
}
