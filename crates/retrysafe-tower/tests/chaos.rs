//! Tests of the `FaultLayer`: each fault on tokio's paused clock with seeded draws
//! (what runs, what the caller sees, how a retry layer classifies it, that the same
//! seed gives the same faults), the builder's checks, and a keyed client stack over
//! real HTTP on loopback through lost replies, errors and resets against an axum
//! server with an `IdempotencyLayer`: every effect once.
#![cfg(feature = "chaos")]
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub
)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use retrysafe_core::budget::{RatioConfig, RetryBudget};
use retrysafe_core::classify::Failure;
use retrysafe_core::error::find;
use retrysafe_core::strategy::StandardRetryStrategy;
use retrysafe_tower::breaker::{BreakerConfig, CircuitBreakerLayer};
use retrysafe_tower::chaos::{ConnectionReset, FaultLayer, ReplyLost};
use retrysafe_tower::client::ClientLayers;
use retrysafe_tower::idempotency::{IdempotencyContext, IdempotencyLayer};
use retrysafe_tower::retry::{RetryLayer, failure_of};
use tokio::time::Instant;
use tower::{Service, ServiceBuilder, ServiceExt};

/// A service that counts its calls and notes when each was made, answering 201.
#[derive(Clone, Default)]
struct Callee {
    calls: Arc<AtomicU32>,
    at: Arc<Mutex<Vec<Instant>>>,
}

impl Callee {
    fn service(
        &self,
    ) -> impl Service<
        Request<String>,
        Response = Response<String>,
        Error = Infallible,
        Future = impl Send,
    > + Clone {
        let me = self.clone();
        tower::service_fn(move |_req: Request<String>| {
            me.calls.fetch_add(1, Ordering::SeqCst);
            me.at.lock().unwrap().push(Instant::now());
            async {
                let mut response = Response::new("created".to_owned());
                *response.status_mut() = StatusCode::CREATED;
                Ok::<_, Infallible>(response)
            }
        })
    }

    fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }
}

fn payment() -> Request<String> {
    Request::post("http://payments.test/payments")
        .body("{}".to_owned())
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_lost_reply_runs_the_call_drops_its_answer_and_looks_like_a_closed_connection() {
    let callee = Callee::default();
    let layer = FaultLayer::new().lost_replies(1.0).seed(1).build().unwrap();
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(callee.service());

    let error = svc.oneshot(payment()).await.unwrap_err();
    assert_eq!(callee.calls(), 1, "the call ran to its answer");
    assert!(find::<ReplyLost>(&*error).is_some(), "{error}");
    assert!(error.to_string().contains("reply lost"), "{error}");
    assert_eq!(failure_of(&*error), Failure::NoResponse);
    let stats = layer.stats();
    assert_eq!((stats.calls, stats.lost_replies), (1, 1), "{stats:?}");
    assert_eq!((stats.delayed, stats.resets, stats.errors), (0, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_reset_and_an_error_answer_call_nothing() {
    let callee = Callee::default();
    let reset = FaultLayer::new()
        .connection_resets(1.0)
        .seed(2)
        .build()
        .unwrap();
    let error = ServiceBuilder::new()
        .layer(reset.clone())
        .service(callee.service())
        .oneshot(payment())
        .await
        .unwrap_err();
    assert!(find::<ConnectionReset>(&*error).is_some(), "{error}");
    assert_eq!(failure_of(&*error), Failure::NoResponse);
    assert_eq!(reset.stats().resets, 1);

    let errors = FaultLayer::new()
        .error_answers(1.0, StatusCode::BAD_GATEWAY)
        .seed(3)
        .build()
        .unwrap();
    let response = ServiceBuilder::new()
        .layer(errors.clone())
        .service(callee.service())
        .oneshot(payment())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
    assert!(
        response
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .is_empty()
    );
    assert_eq!(errors.stats().errors, 1);
    assert_eq!(callee.calls(), 0, "neither fault reached the callee");
}

#[tokio::test(start_paused = true)]
async fn no_fault_passes_the_answer_through() {
    let callee = Callee::default();
    let layer = FaultLayer::new().build().unwrap();
    let response = ServiceBuilder::new()
        .layer(layer.clone())
        .service(callee.service())
        .oneshot(payment())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "created");
    let stats = layer.stats();
    assert_eq!(stats.calls, 1);
    assert_eq!(
        (
            stats.delayed,
            stats.resets,
            stats.errors,
            stats.lost_replies
        ),
        (0, 0, 0, 0)
    );
}

#[tokio::test(start_paused = true)]
async fn latency_delays_the_call_itself_by_a_seeded_draw_within_its_bounds() {
    let delays = |seed: u64| async move {
        let callee = Callee::default();
        let layer = FaultLayer::new()
            .latency(0.5, Duration::from_millis(10), Duration::from_millis(50))
            .seed(seed)
            .build()
            .unwrap();
        let svc = ServiceBuilder::new()
            .layer(layer.clone())
            .service(callee.service());
        let mut delays = Vec::new();
        for _ in 0..200 {
            let sent = Instant::now();
            svc.clone().oneshot(payment()).await.unwrap();
            let called = *callee.at.lock().unwrap().last().unwrap();
            // The delay comes before the call: the callee sees the request late.
            assert_eq!(called, Instant::now());
            delays.push(called - sent);
        }
        let delayed = delays.iter().filter(|d| !d.is_zero()).count() as u64;
        assert_eq!(layer.stats().delayed, delayed);
        delays
    };
    let first = delays(11).await;
    let delayed: Vec<_> = first.iter().filter(|d| !d.is_zero()).collect();
    assert!(
        (70..130).contains(&delayed.len()),
        "about half: {}",
        delayed.len()
    );
    assert!(
        delayed
            .iter()
            .all(|d| (Duration::from_millis(10)..=Duration::from_millis(50)).contains(*d)),
        "{delayed:?}"
    );
    assert_eq!(delays(11).await, first, "the same seed, the same delays");
    assert_ne!(delays(12).await, first);
}

#[tokio::test(start_paused = true)]
async fn a_caller_gone_during_the_delay_cancels_the_call() {
    let callee = Callee::default();
    let second = Duration::from_secs(1);
    let layer = FaultLayer::new()
        .latency(1.0, second, second)
        .lost_replies(1.0)
        .seed(5)
        .build()
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(callee.service());
    let gave_up = tokio::time::timeout(Duration::from_millis(500), svc.oneshot(payment())).await;
    assert!(gave_up.is_err());
    tokio::time::sleep(second * 2).await;
    assert_eq!(callee.calls(), 0);
    let stats = layer.stats();
    assert_eq!((stats.delayed, stats.lost_replies), (1, 0), "{stats:?}");
}

#[tokio::test(start_paused = true)]
async fn the_shares_follow_the_probabilities_and_the_seed() {
    let run = |seed: u64| async move {
        let callee = Callee::default();
        let layer = FaultLayer::new()
            .connection_resets(0.1)
            .error_answers(0.05, StatusCode::SERVICE_UNAVAILABLE)
            .lost_replies(0.3)
            .seed(seed)
            .build()
            .unwrap();
        let svc = ServiceBuilder::new()
            .layer(layer.clone())
            .service(callee.service());
        for _ in 0..10_000 {
            let _ = svc.clone().oneshot(payment()).await;
        }
        let stats = layer.stats();
        // Everything but resets and error answers reached the callee.
        assert_eq!(
            u64::from(callee.calls()),
            stats.calls - stats.resets - stats.errors
        );
        stats
    };
    let stats = run(21).await;
    assert_eq!(stats.calls, 10_000);
    assert!((850..1150).contains(&stats.resets), "{stats:?}");
    assert!((380..620).contains(&stats.errors), "{stats:?}");
    assert!((2750..3250).contains(&stats.lost_replies), "{stats:?}");
    assert_eq!(run(21).await, stats);
    assert_ne!(run(22).await, stats);
}

#[test]
fn the_builder_names_every_bad_setting() {
    let fields = |layer: FaultLayer| layer.build().unwrap_err().fields().collect::<Vec<_>>();
    let ms = Duration::from_millis;
    assert_eq!(
        fields(FaultLayer::new().latency(1.5, ms(1), ms(2))),
        ["latency"]
    );
    assert_eq!(
        fields(FaultLayer::new().latency(0.5, ms(3), ms(2))),
        ["latency"]
    );
    assert_eq!(
        fields(FaultLayer::new().connection_resets(-0.1)),
        ["connection_resets"]
    );
    assert_eq!(
        fields(FaultLayer::new().error_answers(f64::NAN, StatusCode::SERVICE_UNAVAILABLE)),
        ["error_answers"]
    );
    assert_eq!(
        fields(FaultLayer::new().error_answers(0.1, StatusCode::NO_CONTENT)),
        ["error_status"]
    );
    assert_eq!(
        fields(FaultLayer::new().lost_replies(2.0)),
        ["lost_replies"]
    );
    assert_eq!(
        fields(
            FaultLayer::new()
                .connection_resets(0.5)
                .error_answers(0.3, StatusCode::SERVICE_UNAVAILABLE)
                .lost_replies(0.3)
        ),
        ["faults"]
    );
    let error = FaultLayer::new().lost_replies(2.0).build().unwrap_err();
    assert!(
        error.to_string().contains("invalid lost_replies"),
        "{error}"
    );
    assert!(
        FaultLayer::new()
            .latency(1.0, ms(0), ms(0))
            .connection_resets(0.2)
            .error_answers(0.3, StatusCode::TOO_MANY_REQUESTS)
            .lost_replies(0.5)
            .build()
            .is_ok()
    );
}

/// The payments ledger of the loopback server: effects per idempotency key.
type Ledger = Arc<Mutex<HashMap<String, u32>>>;

async fn pay(
    State(ledger): State<Ledger>,
    axum::Extension(ctx): axum::Extension<IdempotencyContext>,
) -> StatusCode {
    let key = ctx.key().as_str().to_owned();
    *ledger.lock().unwrap().entry(key).or_default() += 1;
    StatusCode::CREATED
}

#[tokio::test]
async fn a_keyed_client_stack_through_lost_replies_over_loopback_makes_every_effect_once() {
    let ledger = Ledger::default();
    let router = Router::new()
        .route("/payments", post(pay))
        .with_state(Arc::clone(&ledger))
        .layer(
            IdempotencyLayer::in_memory()
                .global_scope()
                .build()
                .unwrap(),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });

    let faults = FaultLayer::new()
        .lost_replies(0.3)
        .error_answers(0.05, StatusCode::SERVICE_UNAVAILABLE)
        .connection_resets(0.05)
        .seed(38)
        .build()
        .unwrap();
    // Generous attempts and a budget that allows them: this test is about effects.
    let budget = RetryBudget::ratio_with(RatioConfig::default().with_retry_ratio(1.0));
    let strategy = StandardRetryStrategy::new().max_attempts(6).seed(38);
    // And a breaker that 40 % of faults cannot open by chance (the default opens at
    // 50 % of 20 calls).
    let breaker = BreakerConfig::default().with_failure_rate_threshold(80.0);
    let layers = ClientLayers::new()
        .retry(
            RetryLayer::new()
                .strategy(strategy)
                .generate_idempotency_keys(),
        )
        .budget(budget)
        .breaker(CircuitBreakerLayer::with_config(breaker))
        .build()
        .unwrap();
    let client = ServiceBuilder::new()
        .layer(layers)
        .layer(faults.clone())
        .service(Client::builder(TokioExecutor::new()).build_http::<_>());

    let requests = 200;
    let mut succeeded = 0;
    for _ in 0..requests {
        let request = Request::post(format!("http://{addr}/payments"))
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        match client.clone().oneshot(request).await {
            Ok(response) if response.status() == StatusCode::CREATED => succeeded += 1,
            // Given up after injected error answers only, marked so.
            Ok(response) => {
                assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
                assert_eq!(response.headers()["do-not-retry"], "1");
            }
            Err(error) => assert!(
                find::<ReplyLost>(&*error).is_some() || find::<ConnectionReset>(&*error).is_some(),
                "{error}"
            ),
        }
    }
    let stats = faults.stats();
    assert!(stats.lost_replies > 30, "{stats:?}");
    assert!(stats.errors > 0 && stats.resets > 0, "{stats:?}");
    let ledger = ledger.lock().unwrap();
    assert!(
        ledger.values().all(|n| *n == 1),
        "a key paid twice: {ledger:?}"
    );
    // A request that succeeded paid; one that failed may have paid too (its last reply
    // lost) or not (every attempt reset or answered an error before the call).
    assert!(ledger.len() >= succeeded, "{} < {succeeded}", ledger.len());
    // Six attempts each fail with a probability of 0.4^6.
    assert!(succeeded >= requests - 5, "{succeeded} of {requests}");
}
