//! The IdempotencyLayer over a small `MemoryStore`, on a real server over loopback:
//! one principal flooding it with new keys never makes another principal's completed
//! request run again, and does not lock the other principal out.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use retrysafe_memory::MemoryStore;
use retrysafe_tower::idempotency::IdempotencyLayer;
use tokio::net::TcpListener;

use retrysafe_test_support::bearer::auth;

/// How many times the handler ran, per idempotency key.
type Runs = Arc<Mutex<HashMap<String, usize>>>;

/// `POST /pay` behind the layer and bearer authentication: counts its runs per key and
/// answers 201 with a 512-byte body naming the key.
fn app(store: MemoryStore, runs: Runs) -> Router {
    let handler = move |req: Request| {
        let runs = Arc::clone(&runs);
        async move {
            let key = req
                .headers()
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            *runs.lock().unwrap().entry(key.clone()).or_default() += 1;
            let mut body = format!("paid {key} ").into_bytes();
            body.resize(512, b'.');
            (StatusCode::CREATED, body)
        }
    };
    Router::new()
        .route("/pay", post(handler))
        .layer(IdempotencyLayer::new(store))
        .layer(axum::middleware::map_request(auth))
}

async fn serve(app: Router) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// `POST /pay` as `who` with `key`, over the connection pool.
async fn pay(
    client: &HttpClient,
    addr: std::net::SocketAddr,
    who: &str,
    key: &str,
) -> (StatusCode, HeaderMap, Bytes) {
    let req = http::Request::post(format!("http://{addr}/pay"))
        .header("authorization", format!("Bearer {who}"))
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"{\"amount\":10}")))
        .unwrap();
    let res = client.request(req).await.unwrap();
    let (parts, body) = res.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

#[tokio::test]
async fn a_flooding_principal_never_makes_another_principals_request_run_again() {
    let forgotten = Arc::new(Mutex::new(0usize));
    let store = MemoryStore::new()
        .max_bytes(64 * 1024)
        .on_evicted({
            let forgotten = Arc::clone(&forgotten);
            move |_| *forgotten.lock().unwrap() += 1
        })
        .build()
        .unwrap();
    let runs = Runs::default();
    let addr = serve(app(store.clone(), Arc::clone(&runs))).await;
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();

    let (status, _, first) = pay(&client, addr, "bob", "bob-order-1").await;
    assert_eq!(status, StatusCode::CREATED);

    for i in 0..400 {
        let (status, _, _) = pay(&client, addr, "alice", &format!("alice-{i}")).await;
        assert_eq!(status, StatusCode::CREATED, "alice's key {i}");
    }
    assert!(store.tombstones_len() > 0, "the flood shrank records");
    assert!(
        *forgotten.lock().unwrap() > 0,
        "the flood overflowed the tombstones too"
    );

    // Bob's retry is replayed (or refused as evicted), never run again.
    let (status, headers, body) = pay(&client, addr, "bob", "bob-order-1").await;
    match status {
        StatusCode::CREATED => {
            assert_eq!(body, first, "the stored response");
            assert!(headers.contains_key("idempotent-replayed"));
        }
        StatusCode::CONFLICT => {
            let text = String::from_utf8_lossy(&body);
            assert!(text.contains("response-evicted"), "{text}");
            assert_eq!(headers["do-not-retry"], "1");
        }
        other => panic!("bob's retry got {other}: {body:?}"),
    }
    assert_eq!(
        runs.lock().unwrap()["bob-order-1"],
        1,
        "bob's payment ran once"
    );
    // Bob's completed record is under its share: it was kept whole.
    assert_eq!(status, StatusCode::CREATED);

    // Bob is still served.
    let (status, _, _) = pay(&client, addr, "bob", "bob-order-2").await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(runs.lock().unwrap()["bob-order-2"], 1);
}
