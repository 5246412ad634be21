//! Forged convention headers (retry point, deadline, attempt) from an untrusted peer,
//! neutralised by the `EdgeLayer`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response as AxumResponse};
use axum::routing::get;
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use retrysafe_core::CallContext;
use retrysafe_core::backoff::{Backoff, Jitter};
use retrysafe_core::budget::{BudgetSnapshot, RatioConfig, RetryBudget};
use retrysafe_core::strategy::StandardRetryStrategy;
use retrysafe_core::wire::{parse_grpc_timeout, parse_request_timeout_ms};
use retrysafe_tower::budget::RetryBudgetLayer;
use retrysafe_tower::edge::EdgeLayer;
use retrysafe_tower::propagate::PropagateLayer;
use retrysafe_tower::retry::{ReplayBody, RetryLayer, RetryService};
use tower::{Layer, ServiceExt};

use super::{Answer, answer, serve};

type Outbound = RetryService<Client<HttpConnector, ReplayBody<Full<Bytes>>>>;

/// What the middle tier's handler saw.
#[derive(Debug, Clone)]
struct Seen {
    headers: HeaderMap,
    caller_is_retry_point: bool,
    deadline_ms: Option<u128>,
    /// Calls the downstream got for this request.
    downstream_calls: usize,
}

#[derive(Clone)]
struct Tier {
    client: Outbound,
    downstream: String,
    downstream_calls: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

async fn middle(State(tier): State<Tier>, headers: HeaderMap) -> AxumResponse {
    let ctx = CallContext::current().unwrap_or_default();
    let before = tier.downstream_calls.load(Ordering::SeqCst);
    let req = http::Request::get(&tier.downstream)
        .body(Full::default())
        .unwrap();
    let status = match tier.client.clone().oneshot(req).await {
        Ok(res) => res.status().as_u16(),
        Err(_) => 0,
    };
    tier.seen.lock().unwrap().push(Seen {
        headers,
        caller_is_retry_point: ctx.caller_is_retry_point(),
        deadline_ms: ctx.deadline().map(|d| d.remaining().as_millis()),
        downstream_calls: tier.downstream_calls.load(Ordering::SeqCst) - before,
    });
    (StatusCode::OK, format!("downstream {status}")).into_response()
}

/// A budget that affords no retry at all: any request charged as a retry is refused.
fn empty_budget() -> RetryBudget {
    let mut config = RatioConfig::default();
    config = config.with_min_per_sec(0);
    config = config.with_retry_ratio(0.0);
    RetryBudget::ratio_with(config)
}

fn withdrawals(budget: &RetryBudget) -> u64 {
    match budget.snapshot() {
        BudgetSnapshot::Ratio { withdrawals, .. } => withdrawals,
        other => panic!("not a ratio budget: {other:?}"),
    }
}

/// A middle tier (optionally behind `edge`) whose handler calls a downstream that
/// always answers 503, through a `RetryLayer` (3 attempts); its inbound path has a
/// server `RetryBudgetLayer` over `budget` and a `PropagateLayer`.
async fn tier(edge: Option<EdgeLayer>, budget: &RetryBudget) -> (SocketAddr, Tier) {
    let downstream_calls = Arc::new(AtomicUsize::new(0));
    let calls = Arc::clone(&downstream_calls);
    let downstream = serve(Router::new().route(
        "/",
        get(move || {
            calls.fetch_add(1, Ordering::SeqCst);
            async { StatusCode::SERVICE_UNAVAILABLE }
        }),
    ))
    .await;
    let backoff = Backoff::new(
        Duration::from_millis(1),
        Duration::from_millis(5),
        Jitter::Full,
    );
    let retry = RetryLayer::new().strategy(StandardRetryStrategy::new().backoff(backoff));
    let state = Tier {
        client: retry.layer(Client::builder(TokioExecutor::new()).build_http()),
        downstream: format!("http://{downstream}/"),
        downstream_calls,
        seen: Arc::new(Mutex::new(Vec::new())),
    };
    // `Router::layer` wraps what is there: the edge outermost, then the budget, then
    // the propagation of the (remaining) convention headers.
    let router = Router::new()
        .route("/", get(middle))
        .with_state(state.clone())
        .layer(PropagateLayer::new())
        .layer(RetryBudgetLayer::new(budget.clone()).server());
    let router = match edge {
        Some(edge) => router.layer(edge),
        None => router,
    };
    (serve(router).await, state)
}

async fn forged_get(
    client: &reqwest::Client,
    addr: SocketAddr,
    headers: &[(&str, &str)],
) -> Answer {
    let mut req = client.get(format!("http://{addr}/"));
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    answer(req.send().await.unwrap()).await
}

const CONVENTION: [&str; 5] = [
    "retry-attempt",
    "retry-point",
    "request-timeout-ms",
    "grpc-timeout",
    "grpc-previous-rpc-attempts",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_neutralises_forged_convention_headers() {
    let client = reqwest::Client::new();
    let forged: [[(&str, &str); 5]; 2] = [
        [
            ("retry-attempt", "2"),
            ("retry-point", "caller"),
            ("request-timeout-ms", "1"),
            ("grpc-timeout", "1n"),
            ("grpc-previous-rpc-attempts", "1"),
        ],
        [
            ("retry-attempt", "99999999999999999999"),
            ("retry-point", "caller"),
            ("request-timeout-ms", "99999999999999"),
            ("grpc-timeout", "99999999H"),
            ("grpc-previous-rpc-attempts", "4"),
        ],
    ];

    // Behind the edge (strip): nothing of it reaches the handler or its client.
    let budget = empty_budget();
    let (addr, state) = tier(Some(EdgeLayer::new()), &budget).await;
    for headers in &forged {
        let a = forged_get(&client, addr, headers).await;
        assert_eq!(a.status, 200, "charged as a retry: {}", a.text());
    }
    assert_eq!(
        withdrawals(&budget),
        0,
        "the inbound budget paid for no retry"
    );
    for seen in state.seen.lock().unwrap().iter() {
        for name in CONVENTION {
            assert!(
                seen.headers.get(name).is_none(),
                "{name} reached the handler"
            );
        }
        assert!(
            !seen.caller_is_retry_point,
            "retry-point reached the context"
        );
        assert_eq!(
            seen.deadline_ms, None,
            "a forged deadline reached the context"
        );
        assert_eq!(seen.downstream_calls, 3, "outbound calls still retry");
    }

    // Behind the edge (clamp to 2 s): deadlines kept, at most 2 s; the rest stripped.
    let budget = empty_budget();
    let edge = EdgeLayer::new().clamp_deadlines(Duration::from_secs(2));
    let (addr, state) = tier(Some(edge), &budget).await;
    let a = forged_get(&client, addr, &forged[1]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let malformed = [
        ("request-timeout-ms", "-5"),
        ("grpc-timeout", "1x"),
        ("retry-attempt", "2"),
    ];
    let b = forged_get(&client, addr, &malformed).await;
    assert_eq!(b.status, 200, "{}", b.text());
    assert_eq!(withdrawals(&budget), 0);
    {
        let seen = state.seen.lock().unwrap();
        let huge = &seen[0];
        let ms = parse_request_timeout_ms(huge.headers["request-timeout-ms"].as_bytes()).unwrap();
        let grpc = parse_grpc_timeout(huge.headers["grpc-timeout"].as_bytes()).unwrap();
        assert!(ms <= Duration::from_secs(2), "{ms:?}");
        assert!(grpc <= Duration::from_secs(2), "{grpc:?}");
        let left = huge.deadline_ms.expect("a clamped deadline is honoured");
        assert!(left <= 2000, "deadline {left} ms");
        for name in ["retry-attempt", "retry-point", "grpc-previous-rpc-attempts"] {
            assert!(
                huge.headers.get(name).is_none(),
                "{name} reached the handler"
            );
        }
        assert!(!huge.caller_is_retry_point);
        assert_eq!(huge.downstream_calls, 3);
        // A malformed deadline is removed, not passed on.
        let bad = &seen[1];
        for name in CONVENTION {
            assert!(
                bad.headers.get(name).is_none(),
                "{name} reached the handler"
            );
        }
        assert_eq!(bad.deadline_ms, None);
    }

    // Without the edge (a trusted peer) the same headers are honoured.
    let budget = empty_budget();
    let (addr, state) = tier(None, &budget).await;
    let a = forged_get(&client, addr, &forged[0]).await;
    a.assert_problem_status_503_do_not_retry();
    assert!(
        state.seen.lock().unwrap().is_empty(),
        "a refused retry reached the handler"
    );
    let trusted = [("retry-point", "caller"), ("request-timeout-ms", "5000")];
    let b = forged_get(&client, addr, &trusted).await;
    assert_eq!(b.status, 200, "{}", b.text());
    let seen = state.seen.lock().unwrap();
    assert!(seen[0].caller_is_retry_point);
    assert_eq!(seen[0].downstream_calls, 1, "the caller is the retry point");
    let left = seen[0].deadline_ms.expect("the deadline is honoured");
    assert!(left > 0 && left <= 5000, "deadline {left} ms");
}

impl Answer {
    /// The server budget's refusal: 503 with `do-not-retry: 1`.
    fn assert_problem_status_503_do_not_retry(&self) {
        assert_eq!(self.status, 503, "{}", self.text());
        assert_eq!(self.headers["do-not-retry"], "1");
    }
}
