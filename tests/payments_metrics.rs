//! `payments --metrics-listen ADDR`: the example serves its metrics as Prometheus text at
//! `GET /metrics`, named `payments`, and its stdout keeps its one ready line.
// This test drives a real child process on the wall clock, like the other CLI tests.
#![allow(
    clippy::disallowed_methods,
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use retrysafe_test_support::payments::{Api, Server, binary};

/// A port free on loopback now (bound, read and released).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// The value of the series `metric{labels}` in Prometheus text: the labels are matched
/// whatever their order. `None` when the series is absent.
fn value(text: &str, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (name, rest) = series.split_once('{').unwrap_or((series, "}"));
            let rest = rest.strip_suffix('}')?;
            let mut found: Vec<(&str, &str)> = rest
                .split(',')
                .filter(|l| !l.is_empty())
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k, v.trim_matches('"')))
                .collect();
            found.sort_unstable();
            let mut wanted = labels.to_vec();
            wanted.sort_unstable();
            (name == metric && found == wanted).then(|| value.parse().unwrap())
        })
        .next()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_a_first_request_a_replay_and_a_mismatch_by_name() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    // `Server::start` checks that the first stdout line is the ready line.
    let server = Server::start(&["--metrics-listen", &addr]);
    let api = Api::new(&server);

    api.pay("m-1", "acct-metrics", 500, &[])
        .await
        .assert_created("acct-metrics", 500);
    let replay = api.pay("m-1", "acct-metrics", 500, &[]).await;
    assert_eq!(replay.headers["idempotent-replayed"], "true", "{replay:?}");
    api.pay("m-1", "acct-metrics", 999, &[])
        .await
        .assert_problem(422);

    let scrape = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap();
    assert_eq!(scrape.status(), 200);
    let text = scrape.text().await.unwrap();

    let requests = |decision| {
        value(
            &text,
            "retrysafe_idempotency_requests_total",
            &[("name", "payments"), ("decision", decision)],
        )
    };
    assert_eq!(requests("first"), Some(1.0), "{text}");
    assert_eq!(requests("replay"), Some(1.0), "{text}");
    assert_eq!(requests("mismatch"), Some(1.0), "{text}");
    // Every decision has its series from the start, at zero until it happens.
    assert_eq!(requests("in_flight"), Some(0.0), "{text}");
    assert_eq!(requests("unavailable"), Some(0.0), "{text}");
    // A bad key would be `invalid`; none was sent.
    assert_eq!(requests("invalid"), Some(0.0), "{text}");

    // One claim per request, one completion: the store histogram's counts.
    let store = |op| {
        value(
            &text,
            "retrysafe_idempotency_store_seconds_count",
            &[("name", "payments"), ("op", op)],
        )
    };
    assert_eq!(store("claim"), Some(3.0), "{text}");
    assert_eq!(store("complete"), Some(1.0), "{text}");
    // Buckets are configured: a Prometheus histogram, not a summary.
    assert!(
        text.contains("retrysafe_idempotency_store_seconds_bucket{"),
        "{text}"
    );

    // The MemoryStore keeps the one record.
    let bytes = value(
        &text,
        "retrysafe_memory_store_bytes",
        &[("name", "payments")],
    );
    assert!(bytes.is_some_and(|b| b > 0.0), "{text}");
}

#[test]
fn a_metrics_address_that_cannot_be_bound_is_a_runtime_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = std::process::Command::new(binary())
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", &addr])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty(), "no ready line");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot listen on"), "{stderr}");
    assert!(stderr.contains("for metrics"), "{stderr}");
}

/// Why the example sets no idle timeout on the exporter: retrysafe resolves its handles
/// once, and a series the exporter forgets for being idle is never registered again, so
/// what its handle records later is lost — whatever the mask (histograms only too) and
/// whatever the length (a longer timeout only takes a quieter series). Should the
/// exporter ever keep held series, this fails and an idle timeout becomes possible.
#[test]
fn an_idle_timeout_would_lose_series_whose_handles_are_held() {
    use metrics_exporter_prometheus::PrometheusBuilder;
    use metrics_util::MetricKindMask;

    for mask in [MetricKindMask::HISTOGRAM, MetricKindMask::ALL] {
        let recorder = PrometheusBuilder::new()
            .idle_timeout(mask, Some(std::time::Duration::ZERO))
            .build_recorder();
        let handle = recorder.handle();
        // Resolved once, as a layer does when it is built.
        let (histogram, counter) = metrics::with_local_recorder(&recorder, || {
            (
                metrics::histogram!("store_seconds", "op" => "release"),
                metrics::counter!("requests_total", "decision" => "evicted"),
            )
        });
        histogram.record(0.001);
        counter.increment(1);
        assert!(handle.render().contains("store_seconds_count"), "{mask:?}");
        // Idle past the timeout (the exporter's own clock): forgotten at a scrape.
        std::thread::sleep(std::time::Duration::from_millis(2));
        let _ = handle.render();
        histogram.record(0.002);
        counter.increment(1);
        let text = handle.render();
        assert!(!text.contains("store_seconds"), "{mask:?}: {text}");
        let counter_kept = mask == MetricKindMask::HISTOGRAM;
        assert_eq!(
            text.contains("requests_total"),
            counter_kept,
            "{mask:?}: {text}"
        );
    }
}
