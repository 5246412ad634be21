//! Bodies trickled byte by byte (slow loris): they hold in-flight slots only within
//! their scope's share and until a timeout frees them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::Request as AxumRequest;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::IntoResponse;
use bytes::Bytes;
use retrysafe::memory::MemoryStore;
use retrysafe_tower::idempotency::{IdempotencyLayer, ProblemKind};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tower::ServiceExt;

use super::{Effects, app, eventually, pay, raw, raw_post, serve};

/// Opens `n` connections as `who` that send their head and one byte of a 100-byte
/// body, then hold it open.
async fn trickle(addr: SocketAddr, who: &str, n: usize) -> Vec<TcpStream> {
    let mut conns = Vec::new();
    for i in 0..n {
        let mut req = raw_post(who, format!("idempotency-key: slow-{i}").as_bytes(), b"");
        let at = req
            .windows(17)
            .position(|w| w == b"content-length: 0")
            .unwrap();
        req.splice(at..at + 17, b"content-length: 100".iter().copied());
        req.push(b'{');
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&req).await.unwrap();
        conns.push(s);
    }
    conns
}

/// `router` with a count of the trickled requests (keys `slow-…`) whose body the
/// server has begun to read. The layer reads a body only once it holds the request's
/// slot, so the count says how many trickled requests hold one: waiting for it before
/// probing keeps a probe from taking a slot a trickled request would have got (which
/// would answer that request 503 and leave a slot free for every later probe).
fn count_trickled_reads(router: Router) -> (Router, Arc<AtomicUsize>) {
    let reads = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&reads);
    let router = router.layer(axum::middleware::from_fn(
        move |req: AxumRequest, next: Next| {
            let trickled = req
                .headers()
                .get("idempotency-key")
                .is_some_and(|k| k.as_bytes().starts_with(b"slow-"));
            let req = if trickled {
                let count = Arc::clone(&count);
                let mut first = true;
                req.map(|body| {
                    axum::body::Body::new(http_body_util::BodyExt::map_frame(body, move |f| {
                        if std::mem::take(&mut first) {
                            count.fetch_add(1, Ordering::SeqCst);
                        }
                        f
                    }))
                })
            } else {
                req
            };
            next.run(req)
        },
    ));
    (router, reads)
}

/// Waits until `n` trickled requests hold their slots (see [`count_trickled_reads`]).
async fn trickled_hold(reads: &AtomicUsize, n: usize) {
    eventually("the trickled requests hold their slots", || {
        reads.load(Ordering::SeqCst) == n
    })
    .await;
}

/// Sends fresh keys as `who` until one gets `status` (the server frees the slots of
/// closed trickling connections concurrently with these).
async fn until_status(
    client: &reqwest::Client,
    addr: SocketAddr,
    who: &str,
    status: u16,
    tag: &str,
) -> usize {
    let bearer = format!("Bearer {who}");
    let auth = [("authorization", bearer.as_str())];
    for i in 0..2000 {
        let a = pay(client, addr, Some(&format!("{tag}-{i}")), "x", &auth).await;
        if a.status == status {
            return i;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("never got {status}");
}

/// Clients that declare a body and trickle it hold an in-flight slot while it is
/// read (the slot is taken before the body is buffered, to bound the memory of
/// buffered bodies): with `max_in_flight` of them, every other guarded request gets
/// 503 until they go away. An outer timeout (here a plain `tokio::time::timeout`
/// middleware; tower-http's `TimeoutLayer` or `RequestBodyTimeoutLayer` do the same)
/// drops them and frees the slots. No handler runs for a body that never arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_bodies_hold_in_flight_slots_until_an_outer_timeout() {
    const MAX: usize = 4;
    let client = reqwest::Client::new();
    let bearer = [("authorization", "Bearer mallory")];

    // No timeout: the slots are held for as long as the clients keep the connections.
    // One scope (mallory) fills the whole bound: its fair share is the bound (see
    // `a_trickling_scope_keeps_to_its_share` for the default share).
    let fx = Effects::new();
    let layer = IdempotencyLayer::in_memory()
        .max_in_flight(MAX)
        .max_in_flight_per_scope(MAX);
    let (router, reads) = count_trickled_reads(app(layer, true, &fx));
    let addr = serve(router).await;
    let conns = trickle(addr, "mallory", MAX).await;
    // Every slot is held: the next guarded request is refused.
    trickled_hold(&reads, MAX).await;
    let blocked = pay(&client, addr, Some("legit"), "x", &bearer).await;
    blocked.assert_problem(ProblemKind::Overloaded);
    drop(conns);
    until_status(&client, addr, "mallory", 201, "after").await;
    let legit = pay(&client, addr, Some("legit"), "x", &bearer).await;
    assert_eq!(legit.status, 201);

    // With an outer timeout the trickling requests are dropped and their slots freed.
    let fx = Effects::new();
    let layer = IdempotencyLayer::in_memory()
        .max_in_flight(MAX)
        .max_in_flight_per_scope(MAX);
    let timed_out = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&timed_out);
    let router = app(layer, true, &fx).layer(axum::middleware::from_fn(
        move |req: AxumRequest, next: Next| {
            let count = Arc::clone(&count);
            async move {
                match tokio::time::timeout(Duration::from_millis(300), next.run(req)).await {
                    Ok(res) => res,
                    Err(_) => {
                        count.fetch_add(1, Ordering::SeqCst);
                        StatusCode::REQUEST_TIMEOUT.into_response()
                    }
                }
            }
        },
    ));
    let addr = serve(router).await;
    let conns = trickle(addr, "mallory", MAX).await;
    eventually("the trickling requests timed out", || {
        timed_out.load(Ordering::SeqCst) == MAX
    })
    .await;
    let legit = pay(&client, addr, Some("legit"), "x", &bearer).await;
    assert_eq!(legit.status, 201, "{}", legit.text());
    drop(conns);
    let slow_ran = fx
        .started_keys()
        .iter()
        .filter(|k| k.starts_with("slow-"))
        .count();
    assert_eq!(slow_ran, 0, "no handler ran for a body that never arrived");
}

/// The bound is shared fairly between scopes: a scope that trickles its bodies holds
/// at most its share of the slots (3 of 4 by default), and gets 503 `overloaded` past
/// it, while other scopes are still served. Over real TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_scope_keeps_to_its_share() {
    const MAX: usize = 4;
    let fx = Effects::new();
    let layer = IdempotencyLayer::in_memory()
        .max_in_flight(MAX)
        .build()
        .unwrap();
    let (router, reads) = count_trickled_reads(app(layer, true, &fx));
    let addr = serve(router).await;
    let client = reqwest::Client::new();
    let mallory = [("authorization", "Bearer mallory")];
    let alice = [("authorization", "Bearer alice")];

    // Mallory trickles as many bodies as the bound has slots: she gets her share.
    let conns = trickle(addr, "mallory", MAX).await;
    // She holds her share: her next guarded request is refused.
    trickled_hold(&reads, MAX - 1).await;
    let blocked = pay(&client, addr, Some("m-legit"), "x", &mallory).await;
    blocked.assert_problem(ProblemKind::Overloaded);
    assert!(blocked.headers.contains_key("retry-after"));
    // The slot she cannot take serves everyone else, again and again.
    for i in 0..3 {
        let a = pay(&client, addr, Some(&format!("a-{i}")), "x", &alice).await;
        assert_eq!(a.status, 201, "{}", a.text());
    }
    drop(conns);
    until_status(&client, addr, "mallory", 201, "after").await;
    let legit = pay(&client, addr, Some("m-legit"), "x", &mallory).await;
    assert_eq!(legit.status, 201, "{}", legit.text());
    let slow_ran = fx
        .started_keys()
        .iter()
        .filter(|k| k.starts_with("slow-"))
        .count();
    assert_eq!(slow_ran, 0, "no handler ran for a body that never arrived");
}

/// The fix for trickled bodies: `request_body_timeout` answers 408 `body-timeout`
/// before any claim and frees the slot; nothing runs; the same key with a whole body is
/// new. Over real TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_bodies_time_out_and_free_their_slots() {
    const MAX: usize = 4;
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store.clone())
        .max_in_flight(MAX)
        .max_in_flight_per_scope(MAX)
        .request_body_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let fx = Effects::new();
    let addr = serve(app(layer, true, &fx)).await;
    let client = reqwest::Client::new();
    let bearer = [("authorization", "Bearer mallory")];
    let mut trickling = Vec::new();
    for i in 0..MAX {
        let mut req = raw_post(
            "mallory",
            format!("idempotency-key: slow-{i}").as_bytes(),
            b"",
        );
        let at = req
            .windows(17)
            .position(|w| w == b"content-length: 0")
            .unwrap();
        req.splice(at..at + 17, b"content-length: 100".iter().copied());
        req.push(b'{');
        trickling.push(tokio::spawn(async move { raw(addr, &req).await }));
    }
    for t in trickling {
        let r = t.await.unwrap();
        assert!(r.is_problem(ProblemKind::BodyTimeout), "{}", r.text);
        assert!(
            !r.text.contains("do-not-retry"),
            "a retry is safe: {}",
            r.text
        );
    }
    assert_eq!(
        (store.in_flight_len(), store.cached_len()),
        (0, 0),
        "no record"
    );
    // Every slot is free again.
    for i in 0..MAX + 1 {
        let a = pay(&client, addr, Some(&format!("legit-{i}")), "x", &bearer).await;
        assert_eq!(a.status, 201, "{}", a.text());
    }
    // The same key with its whole body is a new request.
    let a = pay(&client, addr, Some("slow-0"), "{}", &bearer).await;
    assert_eq!(a.status, 201, "{}", a.text());
    assert!(!a.replayed());
    assert_eq!(fx.runs(), MAX + 2);
}

/// The same on tokio's paused clock, exactly: a body that never ends gets the 408 at
/// the configured time (or the request's sooner deadline), and the slot is free.
#[tokio::test(start_paused = true)]
async fn a_body_that_never_arrives_times_out_on_the_paused_clock() {
    use axum::body::Body;
    let fx = Effects::new();
    let layer = IdempotencyLayer::in_memory()
        .max_in_flight(1)
        .request_body_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let router = app(layer, true, &fx);
    let never =
        || Body::from_stream(futures_util::stream::pending::<Result<Bytes, std::io::Error>>());
    let req = |key: &str, body: Body| {
        axum::http::Request::post("/pay")
            .header("authorization", "Bearer mallory")
            .header("idempotency-key", key)
            .body(body)
            .unwrap()
    };
    let start = tokio::time::Instant::now();
    let res = router.clone().oneshot(req("k", never())).await.unwrap();
    assert_eq!(res.status(), StatusCode::REQUEST_TIMEOUT);
    assert_eq!(start.elapsed(), Duration::from_secs(5));
    // The request's deadline, when sooner, bounds it instead.
    let mut early = req("k2", never());
    early
        .extensions_mut()
        .insert(retrysafe_core::Deadline::after(Duration::from_millis(700)));
    let start = tokio::time::Instant::now();
    let res = router.clone().oneshot(early).await.unwrap();
    assert_eq!(res.status(), StatusCode::REQUEST_TIMEOUT);
    assert_eq!(start.elapsed(), Duration::from_millis(700));
    // The single slot is free: a whole body runs.
    let res = router
        .clone()
        .oneshot(req("k", Body::from("x")))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(fx.runs(), 1);
    assert!(
        IdempotencyLayer::in_memory()
            .request_body_timeout(Duration::ZERO)
            .build()
            .is_err()
    );
}
