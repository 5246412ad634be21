//! Replays and releases: what is stored and replayed (with which headers), what is
//! released to run again, and the retention.

use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use bytes::Bytes;
use retrysafe_tower::idempotency::{EventKind, IdempotencyLayer};

use super::{Recorder, make_app, post_req, req, send};

// Rows: first request, then completed → replay with status, body, stable headers.
#[tokio::test]
async fn completed_request_is_replayed_with_stable_headers() {
    let rec = Recorder::default();
    let (app, effects) = make_app(rec.attach(IdempotencyLayer::in_memory()));
    let first = send(&app, req("k1", "hello")).await;
    assert_eq!(first.0, StatusCode::CREATED);
    assert!(first.1.get("idempotent-replayed").is_none());
    assert_eq!(
        first.1["set-cookie"], "session=abc",
        "the first answer is the handler's own"
    );
    let again = send(&app, req("k1", "hello")).await;
    assert_eq!(again.0, StatusCode::CREATED);
    assert_eq!(again.2, first.2);
    assert_eq!(again.2, Bytes::from("effect 1: hello"));
    assert_eq!(again.1["idempotent-replayed"], "true");
    assert_eq!(again.1["x-custom"], "kept");
    assert_eq!(again.1["content-type"], first.1["content-type"]);
    let links: Vec<_> = again.1.get_all("link").iter().collect();
    assert_eq!(
        links,
        ["<a>; rel=next", "<b>; rel=prev"],
        "multi-value headers intact"
    );
    assert!(
        again.1.get("set-cookie").is_none(),
        "set-cookie is never replayed"
    );
    assert!(
        again.1.get("x-request-id").is_none(),
        "x-request-id is never replayed"
    );
    assert_eq!(effects.get(), 1);
    assert_eq!(rec.count(EventKind::Claimed), 1);
    assert_eq!(rec.count(EventKind::Replayed), 1);
}

// A configured deny list keeps a header out of replays.
#[tokio::test]
async fn deny_header_is_not_replayed() {
    let layer = IdempotencyLayer::in_memory().deny_header("x-custom".parse().unwrap());
    let (app, _) = make_app(layer);
    send(&app, req("k", "a")).await;
    let again = send(&app, req("k", "a")).await;
    assert!(again.1.get("x-custom").is_none());
    assert_eq!(again.1["idempotent-replayed"], "true");
}

// Row: 2xx, 3xx and 4xx other than 401/403/408/429 are stored.
#[tokio::test]
async fn stored_statuses_are_replayed() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory());
    for (i, status) in [200u16, 201, 204, 302, 400, 404, 409, 422]
        .into_iter()
        .enumerate()
    {
        let key = format!("k{i}");
        let mk = || {
            post_req(Some(&key), "")
                .header("x-status", status.to_string())
                .body(Body::from("a"))
                .unwrap()
        };
        let first = send(&app, mk()).await;
        let again = send(&app, mk()).await;
        assert_eq!(first.0.as_u16(), status);
        assert_eq!(again.0.as_u16(), status);
        assert_eq!(
            again.1["idempotent-replayed"], "true",
            "{status} is replayed"
        );
        assert_eq!(again.2, first.2);
        assert_eq!(effects.get(), i + 1);
    }
}

// Row: 401, 403, 429 or NoEffect → released: a retry runs the handler again.
#[tokio::test]
async fn released_statuses_run_again() {
    let (app, effects) = make_app(IdempotencyLayer::in_memory());
    let mut expected = 0;
    for (i, (status, no_effect)) in [
        (401u16, false),
        (403, false),
        (429, false),
        (503, true),
        (500, true),
        (201, true),
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("k{i}");
        let mut b = post_req(Some(&key), "").header("x-status", status.to_string());
        if no_effect {
            b = b.header("x-no-effect", "1");
        }
        let first = send(&app, b.body(Body::from("a")).unwrap()).await;
        assert_eq!(first.0.as_u16(), status);
        assert!(
            first.1.get("do-not-retry").is_none(),
            "a released answer may be retried"
        );
        let retry = send(&app, req(&key, "a")).await;
        assert_eq!(retry.0, StatusCode::CREATED, "the retry ran");
        assert!(retry.1.get("idempotent-replayed").is_none());
        expected += 2;
        assert_eq!(effects.get(), expected);
    }
}

// Row: after the retention the key is new again.
#[tokio::test(start_paused = true)]
async fn retention_expires() {
    let (app, effects) = make_app(
        IdempotencyLayer::in_memory()
            .retention(Duration::from_secs(60))
            .build()
            .unwrap(),
    );
    send(&app, req("k", "a")).await;
    tokio::time::advance(Duration::from_secs(59)).await;
    assert_eq!(
        send(&app, req("k", "a")).await.1["idempotent-replayed"],
        "true"
    );
    tokio::time::advance(Duration::from_secs(2)).await;
    let r = send(&app, req("k", "b")).await;
    assert_eq!(r.0, StatusCode::CREATED);
    assert!(
        r.1.get("idempotent-replayed").is_none(),
        "a new key: even another body runs"
    );
    assert_eq!(effects.get(), 2);
}
