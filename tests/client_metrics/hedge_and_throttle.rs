//! Hedges count as won, lost and refused and carry their attempt number; the throttle
//! counts each local refusal.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use retrysafe::budget::RatioConfig;
use retrysafe::error::{Throttled, find};
use retrysafe::hedge::HedgeOutcome;
use retrysafe::observe::names;
use retrysafe::{
    AdaptiveThrottleLayer, HedgeLayer, RetryBudget, RetryLayer, StandardRetryStrategy,
};
use retrysafe_test_support::observe::Recorder;
use tower::util::BoxCloneSyncService;
use tower::{BoxError, ServiceBuilder, ServiceExt};

use super::{Answer, Script, get};

/// The stack behind a hedge layer named `h`: a retry layer of one attempt.
fn hedged(
    recorder: &Recorder,
    script: &Script,
    layer: impl FnOnce() -> HedgeLayer,
) -> BoxCloneSyncService<Request<Full<Bytes>>, Response<Full<Bytes>>, BoxError> {
    recorder.build(|| {
        BoxCloneSyncService::new(
            ServiceBuilder::new()
                .layer(layer())
                .layer(RetryLayer::new().strategy(StandardRetryStrategy::new().max_attempts(1)))
                .service(script.service()),
        )
    })
}

#[tokio::test(start_paused = true)]
async fn hedges_count_as_won_lost_and_refused_and_carry_their_attempt_number() {
    let recorder = Recorder::new();
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let seen = outcomes.clone();
    // The first copy is slow: the hedge sent after 10 ms wins.
    let script = Script::new(&[
        Answer::Slow(Duration::from_millis(100), 200),
        Answer::Status(200),
        // Then the first copy wins over a slower hedge.
        Answer::Slow(Duration::from_millis(20), 200),
        Answer::Slow(Duration::from_millis(100), 200),
    ]);
    let client = hedged(&recorder, &script, || {
        HedgeLayer::new()
            .name("h")
            .delay(Duration::from_millis(10))
            .on_hedge(move |e| seen.lock().unwrap().push((e.name.to_string(), e.outcome)))
    });
    for _ in 0..2 {
        let response = client.clone().oneshot(get()).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    assert_eq!(script.attempts(), [Some(1), Some(2), Some(1), Some(2)]);

    // A budget with nothing to spend refuses the hedge.
    let refusing = Script::new(&[Answer::Slow(Duration::from_millis(100), 200)]);
    let seen = outcomes.clone();
    let client = hedged(&recorder, &refusing, || {
        HedgeLayer::new()
            .name("h")
            .delay(Duration::from_millis(10))
            .budget(RetryBudget::ratio_with(
                RatioConfig::default().with_min_per_sec(0),
            ))
            .on_hedge(move |e| seen.lock().unwrap().push((e.name.to_string(), e.outcome)))
    });
    let response = client.oneshot(get()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(refusing.attempts(), [Some(1)]);

    let m = recorder.read();
    let hedges = names::HEDGES_TOTAL;
    assert_eq!(m.counter(hedges, &[("name", "h"), ("outcome", "won")]), 1);
    assert_eq!(m.counter(hedges, &[("name", "h"), ("outcome", "lost")]), 1);
    assert_eq!(
        m.counter(hedges, &[("name", "h"), ("outcome", "refused")]),
        1
    );
    assert_eq!(m.total(hedges), 3);
    let h = || "h".to_owned();
    assert_eq!(
        *outcomes.lock().unwrap(),
        [
            (h(), HedgeOutcome::Won),
            (h(), HedgeOutcome::Lost),
            (h(), HedgeOutcome::Refused)
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn throttle_rejections_count_each_local_refusal() {
    let recorder = Recorder::new();
    let hooked = Arc::new(Mutex::new(0u64));
    let seen = hooked.clone();
    // Overloaded: every call that gets through is answered 503.
    let answers = vec![Answer::Status(503); 200];
    let script = Script::new(&answers);
    let client = recorder.build(|| {
        ServiceBuilder::new()
            .layer(
                AdaptiveThrottleLayer::new()
                    .name("t")
                    .seed(1)
                    .on_rejection(move |r| {
                        assert_eq!(r.name.as_str(), "t");
                        *seen.lock().unwrap() += 1;
                    }),
            )
            .service(script.service::<Full<Bytes>>())
    });
    let mut throttled = 0;
    for _ in 0..100 {
        if let Err(error) = client.clone().oneshot(get()).await {
            assert!(find::<Throttled>(&*error).is_some(), "{error}");
            throttled += 1;
        }
    }
    assert!(throttled > 0, "an overloaded callee is throttled locally");
    assert_eq!(script.attempts().len(), 100 - throttled);

    let m = recorder.read();
    let counted = m.counter(names::THROTTLE_REJECTIONS_TOTAL, &[("name", "t")]);
    assert_eq!(counted, u64::try_from(throttled).unwrap());
    assert_eq!(*hooked.lock().unwrap(), counted);
}
