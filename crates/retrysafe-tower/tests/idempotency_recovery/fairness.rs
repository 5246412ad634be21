//! No scope holds more than its share of the in-flight bound.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::http::StatusCode;
use bytes::Bytes;
use http_body::Frame;
use retrysafe_tower::idempotency::{IdempotencyLayer, ProblemKind};
use tokio::sync::oneshot;
use tower::ServiceExt;

use super::{app, pay, poll_once, read};

/// A request body that arrives only when its sender sends it: a client trickling it.
struct Held(Option<oneshot::Receiver<Bytes>>);

impl http_body::Body for Held {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let Some(rx) = self.0.as_mut() else {
            return Poll::Ready(None);
        };
        let data = std::task::ready!(Pin::new(rx).poll(cx)).unwrap_or_default();
        self.0 = None;
        Poll::Ready(Some(Ok(Frame::data(data))))
    }
}

fn held() -> (oneshot::Sender<Bytes>, Body) {
    let (tx, rx) = oneshot::channel();
    (tx, Body::new(Held(Some(rx))))
}

async fn ok() -> (StatusCode, &'static str) {
    (StatusCode::CREATED, "paid")
}

// The default share of a bound of 4 is 3: a scope that holds 3 slots with bodies it
// has not sent gets 503 `overloaded` (before its body is read), while another scope is
// still served; once its bodies arrive, it is served again.
#[tokio::test(start_paused = true)]
async fn a_trickling_scope_cannot_take_the_other_scopes_slots() {
    let layer = IdempotencyLayer::in_memory()
        .max_in_flight(4)
        .build()
        .unwrap();
    let app = app(layer, ok);
    let mut senders = Vec::new();
    let mut trickling = Vec::new();
    for i in 0..3 {
        let (tx, body) = held();
        let mut res = Box::pin(app.clone().oneshot(pay("mallory", &format!("t-{i}"), body)));
        assert!(poll_once(&mut res).await.is_none(), "holds a slot, reading");
        senders.push(tx);
        trickling.push(res);
    }
    // A body that never comes: refused at once, before it is read.
    let (_never, body) = held();
    let over = read(
        app.clone()
            .oneshot(pay("mallory", "t-3", body))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(over.0, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(over.3, Some(ProblemKind::Overloaded));
    assert!(over.1.contains_key("retry-after"));
    // The other scope has the slot mallory cannot take, again and again.
    for i in 0..3 {
        let r = app
            .clone()
            .oneshot(pay("alice", &format!("a-{i}"), Body::from("x")));
        assert_eq!(read(r.await.unwrap()).await.0, StatusCode::CREATED);
    }
    // Mallory's bodies arrive: her requests complete and free her slots.
    for tx in senders {
        tx.send(Bytes::from_static(b"x")).unwrap();
    }
    for res in trickling {
        assert_eq!(read(res.await.unwrap()).await.0, StatusCode::CREATED);
    }
    let again = app.clone().oneshot(pay("mallory", "t-3", Body::from("x")));
    assert_eq!(read(again.await.unwrap()).await.0, StatusCode::CREATED);
}

// The bound still holds for everyone: with the share of one scope taken and the rest
// by a second scope, a third gets 503 too.
#[tokio::test(start_paused = true)]
async fn the_bound_holds_whatever_the_shares() {
    let layer = IdempotencyLayer::in_memory()
        .max_in_flight(4)
        .max_in_flight_per_scope(2)
        .build()
        .unwrap();
    let app = app(layer, ok);
    let mut pending = Vec::new();
    for who in ["a", "a", "b", "b"] {
        let (tx, body) = held();
        let mut res = Box::pin(app.clone().oneshot(pay(
            who,
            &format!("{who}-{}", pending.len()),
            body,
        )));
        assert!(poll_once(&mut res).await.is_none());
        pending.push((tx, res));
    }
    for who in ["a", "c"] {
        let r = read(
            app.clone()
                .oneshot(pay(who, "late", Body::from("x")))
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(r.3, Some(ProblemKind::Overloaded), "{who}");
    }
    for (tx, res) in pending {
        tx.send(Bytes::from_static(b"x")).unwrap();
        assert_eq!(read(res.await.unwrap()).await.0, StatusCode::CREATED);
    }
    let r = app.clone().oneshot(pay("c", "late", Body::from("x")));
    assert_eq!(read(r.await.unwrap()).await.0, StatusCode::CREATED);
}

// The share is validated by `build`: at least 1, at most the bound.
#[test]
fn the_share_is_validated() {
    let refused = |l: IdempotencyLayer| l.build().unwrap_err().fields().collect::<Vec<_>>();
    let l = IdempotencyLayer::in_memory;
    assert_eq!(
        refused(l().max_in_flight_per_scope(0)),
        ["max_in_flight_per_scope"]
    );
    assert_eq!(
        refused(l().max_in_flight(4).max_in_flight_per_scope(5)),
        ["max_in_flight_per_scope"]
    );
    assert!(
        l().max_in_flight_per_scope(4)
            .max_in_flight(4)
            .build()
            .is_ok()
    );
    assert!(
        l().max_in_flight(1).build().is_ok(),
        "a share of at least one slot"
    );
}
