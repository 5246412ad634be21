//! The `PropagateLayer` on streamed gRPC responses (tonic-free): a status that comes in
//! the trailers, after the headers and messages, gets `do-not-retry: 1` there when an
//! outbound call made for the request gave up — also when it gave up while the stream
//! was being produced, because the context stays current while such a body is polled.
//! Trailers-Only and plain HTTP responses keep the head marking and are not watched.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub
)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::{self, BoxStream};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::{Body as _, Frame};
use http_body_util::{BodyExt, Full, StreamBody};
use retrysafe_core::CallContext;
use retrysafe_tower::propagate::{PropagateLayer, ResponseBody};
use tower::{Layer, ServiceExt};

type Frames = BoxStream<'static, Result<Frame<Bytes>, Infallible>>;
type Streamed = StreamBody<Frames>;

fn trailers(status: &'static str) -> HeaderMap {
    let mut map = HeaderMap::new();
    map.insert("grpc-status", HeaderValue::from_static(status));
    map
}

/// A gRPC response with headers first: one message, then `status` in the trailers. The
/// message is produced with the request's context current: when `give_up` is set, it
/// records that an outbound call gave up, as a `RetryLayer` inside the stream would.
fn streamed(
    status: &'static str,
    give_up: bool,
    saw_context: Arc<AtomicBool>,
) -> Response<Streamed> {
    let message = stream::once(async move {
        if let Some(ctx) = CallContext::current() {
            saw_context.store(true, Ordering::SeqCst);
            if give_up {
                ctx.mark_downstream_gave_up();
            }
        }
        Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\0")))
    });
    let end = stream::once(async move { Ok(Frame::trailers(trailers(status))) });
    let frames: Frames = message.chain(end).boxed();
    Response::builder()
        .header("content-type", "application/grpc")
        .body(StreamBody::new(frames))
        .unwrap()
}

async fn call_streamed(
    status: &'static str,
    give_up: bool,
) -> (Response<ResponseBody<Streamed>>, Arc<AtomicBool>) {
    let saw_context = Arc::new(AtomicBool::new(false));
    let seen = saw_context.clone();
    let svc = PropagateLayer::new().layer(tower::service_fn(move |_req: Request<()>| {
        let seen = seen.clone();
        async move { Ok::<_, Infallible>(streamed(status, give_up, seen)) }
    }));
    let request = Request::post("/grpc.health.v1.Health/Watch")
        .header("content-type", "application/grpc")
        .header("grpc-timeout", "1S")
        .body(())
        .unwrap();
    (svc.oneshot(request).await.unwrap(), saw_context)
}

#[tokio::test]
async fn an_error_status_in_the_trailers_is_marked_when_the_stream_gave_up_downstream() {
    let (response, saw_context) = call_streamed("14", true).await;
    // The head went out before anything failed: nothing to mark there.
    assert!(!response.headers().contains_key("do-not-retry"));
    assert!(response.body().is_watched());
    let collected = response.into_body().collect().await.unwrap();
    assert!(
        saw_context.load(Ordering::SeqCst),
        "the stream ran without the context"
    );
    let trailers = collected.trailers().unwrap();
    assert_eq!(trailers["grpc-status"], "14");
    assert_eq!(trailers["do-not-retry"], "1");
    assert_eq!(collected.to_bytes().len(), 5);
}

#[tokio::test]
async fn trailers_stay_unmarked_when_nothing_gave_up_or_the_status_is_ok() {
    let (response, saw_context) = call_streamed("14", false).await;
    let collected = response.into_body().collect().await.unwrap();
    assert!(saw_context.load(Ordering::SeqCst));
    let trailers = collected.trailers().unwrap();
    assert_eq!(trailers["grpc-status"], "14");
    assert!(!trailers.contains_key("do-not-retry"));

    let (response, _) = call_streamed("0", true).await;
    let collected = response.into_body().collect().await.unwrap();
    let trailers = collected.trailers().unwrap();
    assert_eq!(trailers["grpc-status"], "0");
    assert!(!trailers.contains_key("do-not-retry"));
}

#[tokio::test]
async fn a_watched_body_stops_being_watched_at_its_trailers() {
    let (response, _) = call_streamed("14", true).await;
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.is_data());
    assert!(body.is_watched());
    let second = body.frame().await.unwrap().unwrap();
    assert!(second.is_trailers());
    assert!(!body.is_watched());
    assert!(body.frame().await.is_none());
}

#[tokio::test]
async fn trailers_only_and_plain_responses_are_marked_in_the_head_and_not_watched() {
    let svc = PropagateLayer::new().layer(tower::service_fn(|req: Request<()>| async move {
        CallContext::current().unwrap().mark_downstream_gave_up();
        let response = if req.uri().path() == "/grpc" {
            // Trailers-Only: the status in the head, no body.
            Response::builder()
                .header("content-type", "application/grpc")
                .header("grpc-status", "14")
                .body(Full::new(Bytes::new()))
                .unwrap()
        } else {
            Response::builder()
                .status(StatusCode::BAD_GATEWAY)
                .body(Full::new(Bytes::from_static(b"upstream failed")))
                .unwrap()
        };
        Ok::<_, Infallible>(response)
    }));

    let grpc = Request::post("/grpc")
        .header("content-type", "application/grpc")
        .body(())
        .unwrap();
    let response = svc.clone().oneshot(grpc).await.unwrap();
    assert_eq!(response.headers()["do-not-retry"], "1");
    assert!(!response.body().is_watched());

    let plain = Request::get("/plain").body(()).unwrap();
    let response = svc.oneshot(plain).await.unwrap();
    assert_eq!(response.headers()["do-not-retry"], "1");
    let body = response.into_body();
    assert!(!body.is_watched());
    // Size hints pass through unchanged.
    assert_eq!(body.size_hint().exact(), Some(15));
    assert!(!body.is_end_stream());
    assert_eq!(body.collect().await.unwrap().to_bytes(), "upstream failed");
}
