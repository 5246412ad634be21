//! Recovery of the store-backed IdempotencyLayer under pressure: the fair share of the
//! in-flight bound per scope (`fairness`), and handlers cancelled past their time or
//! after their lease was lost (`cancel`), a reconciler over the store (`reconcile`), and
//! leases renewed while a handler blocks its thread (`renewal`). On tokio's paused
//! clock (but `renewal`), with `oneshot`.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

mod cancel;
mod fairness;
mod reconcile;
mod renewal;

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use retrysafe_tower::idempotency::{IdempotencyLayer, Problem, ProblemKind};

use retrysafe_test_support::bearer::auth;

/// `handler` behind `layer` and the authentication, on `POST /pay`.
fn app<H, T>(layer: IdempotencyLayer, handler: H) -> Router
where
    H: axum::handler::Handler<T, ()>,
    T: 'static,
{
    Router::new()
        .route("/pay", post(handler))
        .layer(layer)
        .layer(axum::middleware::map_request(auth))
}

fn pay(who: &str, key: &str, body: Body) -> Request {
    Request::post("/pay")
        .header("authorization", format!("Bearer {who}"))
        .header("idempotency-key", key)
        .body(body)
        .unwrap()
}

/// Sends `POST /pay` as `who` with `key` and `body` to `app`, and reads the answer.
async fn send(
    app: &Router,
    who: &str,
    key: &str,
    body: &'static str,
) -> (StatusCode, HeaderMap, Bytes, Option<ProblemKind>) {
    use tower::ServiceExt;
    read(
        app.clone()
            .oneshot(pay(who, key, Body::from(body)))
            .await
            .unwrap(),
    )
    .await
}

/// Status, headers and body of an answer.
async fn read(res: Response) -> (StatusCode, HeaderMap, Bytes, Option<ProblemKind>) {
    let kind = res.extensions().get::<Problem>().map(Problem::kind);
    let (parts, body) = res.into_parts();
    let body = to_bytes(body, usize::MAX).await.unwrap();
    (parts.status, parts.headers, body, kind)
}

/// Polls `f` once: its output if it is ready.
async fn poll_once<F: Future + Unpin>(f: &mut F) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        Poll::Ready(match Pin::new(&mut *f).poll(cx) {
            Poll::Ready(v) => Some(v),
            Poll::Pending => None,
        })
    })
    .await
}
