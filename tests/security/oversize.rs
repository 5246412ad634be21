//! Oversize bodies and headers: refused before any claim, and the server keeps serving.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use retrysafe::memory::MemoryStore;
use retrysafe_tower::idempotency::{IdempotencyLayer, ProblemKind};

use super::disconnect_flood::H2;
use super::{Effects, app, healthy, pay, raw, raw_post, serve};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_bodies_are_refused_before_any_claim() {
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store.clone())
        .max_request_body(1024)
        .build()
        .unwrap();
    let fx = Effects::new();
    let addr = serve(app(layer, true, &fx)).await;
    let client = reqwest::Client::new();
    let bearer = [("authorization", "Bearer mallory")];
    let no_record = |store: &MemoryStore| (store.in_flight_len(), store.cached_len()) == (0, 0);

    // Declared length over the limit.
    pay(&client, addr, Some("big"), vec![b'x'; 4096], &bearer)
        .await
        .assert_problem(ProblemKind::BodyTooLarge);
    // Chunked, without a content-length.
    let mut chunked = b"POST /pay HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer mallory\r\n\
        idempotency-key: big\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        .to_vec();
    for _ in 0..8 {
        chunked.extend_from_slice(b"200\r\n");
        chunked.extend_from_slice(&[b'y'; 0x200]);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let r = raw(addr, &chunked).await;
    assert!(r.is_problem(ProblemKind::BodyTooLarge), "{}", r.text);
    // A huge declared length whose body never comes: answered after the bounded drain.
    let mut stalled = raw_post("mallory", b"idempotency-key: big", b"");
    let at = stalled
        .windows(17)
        .position(|w| w == b"content-length: 0")
        .unwrap();
    stalled.splice(at..at + 17, b"content-length: 1073741824".iter().copied());
    stalled.extend_from_slice(&[b'z'; 64 * 1024]);
    let r = raw(addr, &stalled).await;
    assert!(r.is_problem(ProblemKind::BodyTooLarge), "{}", r.text);
    assert_eq!(
        fx.started.load(Ordering::SeqCst),
        0,
        "the handler never ran"
    );
    assert!(no_record(&store));

    // The same key with a body within the limit is a new request.
    let ok = pay(&client, addr, Some("big"), vec![b'x'; 1024], &bearer).await;
    assert_eq!(ok.status, 201, "{}", ok.text());
    assert!(!ok.replayed());
    assert_eq!(fx.runs(), 1);
    healthy(&client, addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_headers_are_refused_and_the_server_keeps_serving() {
    let fx = Effects::new();
    let addr = serve(app(IdempotencyLayer::in_memory(), true, &fx)).await;
    let client = reqwest::Client::new();

    // Over hyper's HTTP/1 head limit (about 400 KiB) or its 100 headers: 431, or a
    // close; never the layer, never the handler.
    let huge = format!("x-junk: {}", "a".repeat(1 << 20));
    let huge_key = format!("idempotency-key: {}", "k".repeat(1 << 20));
    let many: Vec<String> = (0..500).map(|i| format!("x-h{i}: v")).collect();
    let many = format!("idempotency-key: many\r\n{}", many.join("\r\n"));
    for (what, line) in [
        ("a 1 MiB header", huge.as_bytes()),
        ("a 1 MiB key", huge_key.as_bytes()),
        ("500 headers", many.as_bytes()),
    ] {
        let r = raw(addr, &raw_post("mallory", line, b"x")).await;
        assert!(
            matches!(r.status, None | Some(431)),
            "{what}: {:?}",
            r.status
        );
        eprintln!("HTTP/1.1 with {what}: {:?}", r.status);
        healthy(&client, addr).await;
    }
    // The same over HTTP/2 (hyper's client, prior knowledge): refused by one side or
    // the other (hyper's server advertises a 16 KiB header list), never the handler.
    for (what, name, value) in [
        ("a 1 MiB header", "x-junk", "a".repeat(1 << 20)),
        ("a 1 MiB key", "idempotency-key", "k".repeat(1 << 20)),
        ("a 64 KiB key", "idempotency-key", "k".repeat(64 << 10)),
    ] {
        let h2: H2 = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http();
        let req = http::Request::post(format!("http://{addr}/pay"))
            .header("authorization", "Bearer mallory")
            .header(name, value)
            .body(Full::new(Bytes::from_static(b"x")))
            .unwrap();
        let outcome = match h2.request(req).await {
            Ok(res) => {
                assert!(
                    matches!(res.status().as_u16(), 400 | 431),
                    "{what}: {}",
                    res.status()
                );
                format!("{}", res.status())
            }
            Err(e) => {
                let mut chain = e.to_string();
                let mut source = std::error::Error::source(&e);
                while let Some(inner) = source {
                    chain = format!("{chain}: {inner}");
                    source = inner.source();
                }
                format!("error: {chain}")
            }
        };
        eprintln!("HTTP/2 with {what}: {outcome}");
        healthy(&client, addr).await;
    }
    // A key of 8 KiB, within hyper's limits: the layer's 400.
    let long_key = format!("idempotency-key: {}", "k".repeat(8192));
    let r = raw(addr, &raw_post("mallory", long_key.as_bytes(), b"x")).await;
    assert!(r.is_problem(ProblemKind::KeyInvalid), "{}", r.text);
    // The key twice.
    let r = raw(
        addr,
        &raw_post("mallory", b"idempotency-key: a\r\nidempotency-key: b", b"x"),
    )
    .await;
    assert!(r.is_problem(ProblemKind::KeyInvalid), "{}", r.text);

    assert_eq!(fx.started.load(Ordering::SeqCst), 0);
    healthy(&client, addr).await;
    let ok = pay(
        &client,
        addr,
        Some("after"),
        "x",
        &[("authorization", "Bearer mallory")],
    )
    .await;
    assert_eq!(ok.status, 201);
}
