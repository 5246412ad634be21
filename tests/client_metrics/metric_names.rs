//! The names metrics carry: keyed breakers under their configuration's name, the parts
//! of `ClientLayers`, and `default` without a name.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use retrysafe::breaker::{BreakerConfig, SlidingWindow};
use retrysafe::error::{CircuitOpen, find};
use retrysafe::observe::names;
use retrysafe::{CircuitBreakerLayer, ClientLayers, RetryLayer, StandardRetryStrategy};
use retrysafe_test_support::observe::Recorder;
use tower::{Layer, ServiceBuilder, ServiceExt};

use super::{Answer, MINUTE, Script, budget, get, strategy};

/// Breakers per authority count their rejections under their configuration's name,
/// with no label per key, and report no state gauge.
#[tokio::test(start_paused = true)]
async fn keyed_breakers_count_rejections_under_the_configurations_name() {
    use retrysafe::breaker::KeyedBreakers;

    let recorder = Recorder::new();
    let script = Script::new(&[Answer::Status(500), Answer::Status(500)]);
    let rejected = Arc::new(Mutex::new(Vec::new()));
    let seen = rejected.clone();
    let client = recorder.build(|| {
        let config = BreakerConfig::default()
            .with_name("per-host")
            .with_window(SlidingWindow::count(2, 1))
            .with_minimum_calls(2)
            .with_open_duration(MINUTE)
            .with_on_rejection(move |r| seen.lock().unwrap().push(r.name.to_string()));
        let budget = budget();
        ServiceBuilder::new()
            .layer(RetryLayer::new().strategy(strategy(1, &budget)))
            .layer(CircuitBreakerLayer::keyed(KeyedBreakers::per_authority(
                config,
            )))
            .service(script.service::<retrysafe::ReplayBody<Full<Bytes>>>())
    });
    let to = |host: &str| {
        Request::get(format!("http://{host}/items"))
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    for _ in 0..2 {
        let response = client.clone().oneshot(to("a.test")).await.unwrap();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
    let refused = client.clone().oneshot(to("a.test")).await.unwrap_err();
    assert!(find::<CircuitOpen>(&*refused).is_some(), "{refused}");
    let other = client.clone().oneshot(to("b.test")).await.unwrap();
    assert_eq!(
        other.status(),
        StatusCode::OK,
        "another host's breaker is closed"
    );

    let m = recorder.read();
    let rejections = names::BREAKER_REJECTIONS_TOTAL;
    assert_eq!(m.counter(rejections, &[("name", "per-host")]), 1);
    assert_eq!(m.total(rejections), 1, "no series per key");
    assert_eq!(m.label_keys(rejections), ["name"]);
    assert_eq!(m.gauge(names::BREAKER_STATE, &[("name", "per-host")]), None);
    assert!(m.label_keys(names::BREAKER_STATE).is_empty());
    assert_eq!(*rejected.lock().unwrap(), ["per-host"]);
}

/// `ClientLayers::name` names the parts it made itself: the retry layer, the budget and
/// the breaker.
#[tokio::test(start_paused = true)]
async fn client_layers_name_their_own_parts() {
    let recorder = Recorder::new();
    let script = Script::new(&[
        Answer::Status(503),
        Answer::Status(503),
        Answer::Status(503),
    ]);
    let client = recorder.build(|| ClientLayers::new().name("svc").layer(script.service()));

    let response = client.oneshot(get()).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(script.attempts(), [None, Some(2), Some(3)]);

    let m = recorder.read();
    assert_eq!(
        m.counter(
            names::CLIENT_ATTEMPTS_TOTAL,
            &[("name", "svc"), ("outcome", "failure")]
        ),
        3
    );
    assert_eq!(
        m.counter(
            names::CLIENT_RETRIES_TOTAL,
            &[("name", "svc"), ("reason", "status")]
        ),
        2
    );
    assert_eq!(m.gauge(names::BREAKER_STATE, &[("name", "svc")]), Some(0.0));
    // Nothing is left behind under the name the stack had before it was named.
    assert_eq!(m.gauge(names::BREAKER_STATE, &[("name", "default")]), None);
    assert_eq!(
        m.counter(names::BUDGET_REFUSALS_TOTAL, &[("name", "svc")]),
        0
    );
    let defaults: Vec<_> = m.names_with_label("name", "default");
    assert!(defaults.is_empty(), "{defaults:?}");
}

#[tokio::test(start_paused = true)]
async fn without_a_name_every_metric_is_named_default() {
    let recorder = Recorder::new();
    let script = Script::new(&[Answer::Status(503), Answer::Status(200)]);
    let client = recorder.build(|| {
        ServiceBuilder::new()
            .layer(RetryLayer::new().strategy(StandardRetryStrategy::new().seed(1)))
            .service(script.service())
    });
    client.oneshot(get()).await.unwrap();
    let m = recorder.read();
    let attempts = names::CLIENT_ATTEMPTS_TOTAL;
    assert_eq!(
        m.counter(attempts, &[("name", "default"), ("outcome", "failure")]),
        1
    );
    assert_eq!(
        m.counter(attempts, &[("name", "default"), ("outcome", "success")]),
        1
    );
}
