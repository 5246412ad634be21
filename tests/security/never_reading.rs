//! A client that sends a key and never reads its response holds no slot.

use std::net::SocketAddr;

use retrysafe::memory::MemoryStore;
use retrysafe_tower::idempotency::{IdempotencyLayer, ProblemKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use super::{Effects, app, eventually, healthy, pay, raw_post, serve};

/// Sends a guarded POST for a response of `size` bytes on a connection with a small
/// receive buffer, and never reads.
async fn never_reading(addr: SocketAddr, key: &str, size: usize) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(addr).await.unwrap();
    let line = format!("idempotency-key: {key}\r\nx-big: {size}");
    stream
        .write_all(&raw_post("mallory", line.as_bytes(), b"x"))
        .await
        .unwrap();
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_holds_no_slot() {
    // Bigger than the socket buffers on both sides (loopback autotuning tops out at a
    // few MiB), and storable.
    const SIZE: usize = 16 << 20;
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store.clone())
        .max_stored_response(32 << 20)
        .max_in_flight(1)
        .build()
        .unwrap();
    let shutdown = layer.shutdown_handle();
    let fx = Effects::new();
    let addr = serve(app(layer, true, &fx)).await;
    let client = reqwest::Client::new();
    let bearer = [("authorization", "Bearer mallory")];

    let mut stalled = never_reading(addr, "big-reply", SIZE).await;
    eventually("the handler ran and its record completed", || {
        fx.runs() == 1 && shutdown.in_flight() == 0 && store.in_flight_len() == 0
    })
    .await;
    assert_eq!(store.cached_len(), 1);
    // The slot (max_in_flight 1) is free although the response is still unread.
    let other = pay(&client, addr, Some("other"), "x", &bearer).await;
    assert_eq!(other.status, 201, "{}", other.text());
    // The same key from another client: the replay, whole.
    let again = pay(&client, addr, Some("big-reply"), "x", &bearer).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.body.len(), SIZE);
    assert_eq!(fx.runs(), 2);
    healthy(&client, addr).await;
    // The stalled connection still has its answer waiting: the first bytes are there.
    let mut head = [0u8; 12];
    stalled.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 201");
    drop(stalled);

    // A response over the storable limit (1 MiB by default): recorded as not stored
    // before it streams, so the slot is free as well, and the key never runs again.
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store.clone())
        .max_in_flight(1)
        .build()
        .unwrap();
    let shutdown = layer.shutdown_handle();
    let fx = Effects::new();
    let addr = serve(app(layer, true, &fx)).await;
    let stalled = never_reading(addr, "huge-reply", SIZE).await;
    eventually("the handler ran and its record completed", || {
        fx.runs() == 1 && shutdown.in_flight() == 0 && store.in_flight_len() == 0
    })
    .await;
    let again = pay(&client, addr, Some("huge-reply"), "x", &bearer).await;
    again.assert_problem(ProblemKind::ResponseNotStored);
    let other = pay(&client, addr, Some("other"), "x", &bearer).await;
    assert_eq!(other.status, 201);
    assert_eq!(fx.runs(), 2);
    drop(stalled);
}
