//! Each fault of the proxy behaves as documented: what the client sees, and whether the
//! server answered.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use retrysafe_test_support::proxy::{FaultMix, FaultProxy, ProxyConfig};
use tokio::net::TcpListener;

/// What one request through a proxy with a single fault looks like from both ends.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    /// A full 200 with the body.
    Answered,
    /// An error before the response head.
    NoResponse,
    /// The head arrived, the body failed.
    BodyCut,
    /// Nothing within the client's patience.
    TimedOut,
}

async fn one_request(proxy: SocketAddr, patience: Duration) -> Seen {
    let http = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http::<Full<Bytes>>();
    let request = Request::post(format!("http://{proxy}/hit"))
        .body(Full::new(Bytes::from_static(b"ping")))
        .unwrap();
    let call = async {
        let Ok(response) = http.request(request).await else {
            return Seen::NoResponse;
        };
        match response.into_body().collect().await.map(|b| b.to_bytes()) {
            Ok(body) if body.len() == 2000 => Seen::Answered,
            _ => Seen::BodyCut,
        }
    };
    tokio::time::timeout(patience, call)
        .await
        .unwrap_or(Seen::TimedOut)
}

/// Each fault of the proxy alone, against a server that counts the requests it
/// finished: what the client sees, and whether the server answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_fault_behaves_as_documented() {
    use retrysafe_test_support::proxy::Fault;

    let hits = Arc::new(AtomicU64::new(0));
    let h = Arc::clone(&hits);
    let app = Router::new().route(
        "/hit",
        post(move || {
            let h = Arc::clone(&h);
            async move {
                h.fetch_add(1, Ordering::SeqCst);
                "x".repeat(2000)
            }
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });

    for fault in Fault::ALL {
        let mut config = ProxyConfig::new(FaultMix::none_but(fault, 1), 7);
        config.black_hole_hold = Duration::from_secs(2);
        let proxy = FaultProxy::start(server, config).await.unwrap();
        let before = hits.load(Ordering::SeqCst);
        let mut seen = Vec::new();
        // A black hole never answers: wait a little. Anything else answers or fails
        // long before 10 s.
        let patience = if fault == Fault::BlackHole {
            Duration::from_millis(300)
        } else {
            Duration::from_secs(10)
        };
        for _ in 0..5 {
            seen.push(one_request(proxy.addr, patience).await);
        }
        // Let a server that got the requests finish them (the client may have seen its
        // connection fail before the handler ran).
        let expect_all = !matches!(
            fault,
            Fault::ResetBeforeRequest
                | Fault::BlackHole
                | Fault::ResetAfterRequest
                | Fault::HalfCloseServer
        );
        for _ in 0..200 {
            if !expect_all || hits.load(Ordering::SeqCst) - before >= 5 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let answered = hits.load(Ordering::SeqCst) - before;
        let stats = proxy.stats();
        assert_eq!(stats.count(fault), 5, "{fault:?}: {stats:?}");
        assert_eq!(stats.unframed, 0, "{fault:?}");
        let all = |s: Seen| seen.iter().all(|x| *x == s);
        match fault {
            Fault::Pass | Fault::Delay => {
                assert!(all(Seen::Answered), "{fault:?}: {seen:?}");
                assert_eq!(answered, 5, "{fault:?}");
            }
            Fault::ResetBeforeRequest => {
                assert!(all(Seen::NoResponse), "{fault:?}: {seen:?}");
                assert_eq!(answered, 0, "{fault:?}");
            }
            Fault::BlackHole => {
                assert!(all(Seen::TimedOut), "{fault:?}: {seen:?}");
                assert_eq!(answered, 0, "{fault:?}");
            }
            Fault::LoseResponse | Fault::HalfCloseClient => {
                assert!(all(Seen::NoResponse), "{fault:?}: {seen:?}");
                assert_eq!(answered, 5, "{fault:?}: the server answered every request");
            }
            Fault::CutMidBody => {
                assert!(
                    seen.iter()
                        .all(|s| matches!(s, Seen::NoResponse | Seen::BodyCut)),
                    "{fault:?}: {seen:?}"
                );
                assert_eq!(answered, 5, "{fault:?}");
            }
            Fault::ResetAfterRequest => {
                // The server got the whole request; whether it ran depends on how fast
                // it noticed the closed connection.
                assert!(all(Seen::NoResponse), "{fault:?}: {seen:?}");
            }
            Fault::HalfCloseServer => {
                // hyper's server answers a request whose connection was half-closed
                // after it, or drops it: either is what a real peer may see.
                assert!(
                    seen.iter()
                        .all(|s| matches!(s, Seen::Answered | Seen::NoResponse)),
                    "{fault:?}: {seen:?}"
                );
            }
        }
        println!(
            "{}: client {seen:?}, server answered {answered}",
            fault.name()
        );
    }
}
