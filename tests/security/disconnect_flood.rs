//! A flood of clients that disconnect (HTTP/1.1) or reset their stream (HTTP/2) while
//! their handlers are parked: the detached work stays bounded.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use retrysafe::memory::MemoryStore;
use retrysafe_tower::idempotency::{IdempotencyLayer, ProblemKind};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::{Effects, app, eventually, pay, raw_post, serve};

/// How a flood client goes away.
#[derive(Clone, Copy, Debug)]
enum Hangup {
    /// HTTP/1.1 over a raw `TcpStream`: the connection is closed.
    CloseConnection,
    /// HTTP/2 over hyper, all streams on one connection: the response future is
    /// dropped, which resets the stream (`RST_STREAM`, the "rapid reset" pattern).
    ResetStream,
}

/// A client that is about to go away.
pub(super) enum Leaving {
    Conn(TcpStream),
    Stream(tokio::task::JoinHandle<()>),
}

pub(super) type H2 = Client<HttpConnector, Full<Bytes>>;

/// Sends a guarded POST with `key` whose handler parks, keeping it open until the
/// returned value is dropped (or aborted).
async fn park(addr: SocketAddr, key: &str, how: Hangup, h2: &H2) -> Leaving {
    match how {
        Hangup::CloseConnection => {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let line = format!("idempotency-key: {key}\r\nx-hold: 1");
            s.write_all(&raw_post("mallory", line.as_bytes(), b"pay 1"))
                .await
                .unwrap();
            Leaving::Conn(s)
        }
        Hangup::ResetStream => {
            let req = http::Request::post(format!("http://{addr}/pay"))
                .header("authorization", "Bearer mallory")
                .header("content-type", "text/plain")
                .header("idempotency-key", key)
                .header("x-hold", "1")
                .body(Full::new(Bytes::from_static(b"pay 1")))
                .unwrap();
            let h2 = h2.clone();
            Leaving::Stream(tokio::spawn(async move {
                let _ = h2.request(req).await;
            }))
        }
    }
}

pub(super) fn leave(clients: Vec<Leaving>) {
    for c in clients {
        match c {
            Leaving::Conn(s) => drop(s),
            Leaving::Stream(task) => task.abort(),
        }
    }
}

/// Waves of clients send a guarded POST whose handler parks, then go away. The
/// detached work stays within `max_in_flight`, the excess gets 503, every detached
/// handler completes and stores its response, and the tracker drains.
async fn disconnect_flood(how: Hangup) {
    const MAX: usize = 4;
    const WAVE: usize = 40;
    let store = MemoryStore::new();
    // One scope (mallory) fills the whole bound: its fair share is the bound.
    let layer = IdempotencyLayer::new(store.clone())
        .max_in_flight(MAX)
        .max_in_flight_per_scope(MAX)
        .build()
        .unwrap();
    let shutdown = layer.shutdown_handle();
    let fx = Effects::new();
    let addr = serve(app(layer, true, &fx)).await;
    let client = reqwest::Client::new();
    let h2: H2 = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let bearer = [("authorization", "Bearer mallory")];
    let mut all_keys = Vec::new();
    let mut detached = 0;

    for wave in 0..3 {
        fx.gate.close();
        let started_before = fx.started.load(Ordering::SeqCst);
        let cancelled_before = fx.cancelled.load(Ordering::SeqCst);
        let refused_before = fx.answered_503.load(Ordering::SeqCst);
        let keys: Vec<String> = (0..WAVE).map(|i| format!("gone-{wave}-{i}")).collect();
        let mut clients = Vec::new();
        for key in &keys {
            clients.push(park(addr, key, how, &h2).await);
        }
        // The first MAX park; the rest are refused at once (503 overloaded).
        eventually("the bound's worth of handlers parked", || {
            fx.holding() == MAX
        })
        .await;
        eventually("the excess refused", || {
            fx.answered_503.load(Ordering::SeqCst) - refused_before == WAVE - MAX
        })
        .await;
        leave(clients);
        // The clients of the parked handlers are gone: hyper dropped their response
        // futures, and the guarded work went on detached.
        eventually("the abandoned requests seen by the server", || {
            fx.cancelled.load(Ordering::SeqCst) - cancelled_before == MAX
        })
        .await;
        assert_eq!(fx.started.load(Ordering::SeqCst) - started_before, MAX);
        assert_eq!(shutdown.in_flight(), MAX, "the detached tasks are tracked");
        // While they run, the bound holds for everyone else: 503 with retry-after.
        for i in 0..10 {
            let a = pay(
                &client,
                addr,
                Some(&format!("late-{wave}-{i}")),
                "pay 1",
                &bearer,
            )
            .await;
            a.assert_problem(ProblemKind::Overloaded);
            assert!(a.headers.contains_key("retry-after"));
        }
        assert_eq!(fx.holding(), MAX);
        // Release them: every detached handler completes and stores its response.
        fx.gate.open();
        tokio::time::timeout(Duration::from_secs(30), shutdown.clone().drain())
            .await
            .expect("the tracker drains");
        assert_eq!(shutdown.in_flight(), 0);
        assert_eq!(store.in_flight_len(), 0);
        detached += MAX;
        all_keys.extend(keys);
    }
    assert_eq!(
        fx.high_water.load(Ordering::SeqCst),
        MAX,
        "at most max_in_flight handlers at once"
    );
    assert_eq!(
        fx.started.load(Ordering::SeqCst),
        fx.finished.load(Ordering::SeqCst)
    );

    // A later retry of each key: the detached ones replay, the refused ones run now.
    let ran = fx.started_keys();
    let mut replays = 0;
    for key in &all_keys {
        let a = pay(&client, addr, Some(key), "pay 1", &bearer).await;
        assert_eq!(a.status, 201, "{key}: {}", a.text());
        if ran.contains(key) {
            assert!(a.replayed(), "{key} ran detached but did not replay");
            assert!(a.text().contains(key.as_str()));
            replays += 1;
        } else {
            assert!(!a.replayed());
        }
    }
    assert_eq!(replays, detached);
    assert_eq!(fx.runs(), all_keys.len(), "each key ran exactly once");
    eprintln!(
        "disconnect flood ({how:?}): {} clients gone, {detached} detached handlers (bound {MAX}), \
         high water {}",
        all_keys.len(),
        fx.high_water.load(Ordering::SeqCst)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detached_work_is_bounded_under_a_disconnect_flood() {
    disconnect_flood(Hangup::CloseConnection).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detached_work_is_bounded_under_an_h2_stream_reset_flood() {
    disconnect_flood(Hangup::ResetStream).await;
}
