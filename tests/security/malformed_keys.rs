//! Malformed keys (CR/LF, non-ASCII, control bytes, over the length limit) over raw
//! HTTP/1.1 and hand-written HTTP/2 frames: refused, and nothing runs.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use retrysafe_tower::idempotency::{IdempotencyLayer, ProblemKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{Effects, app, healthy, pay, raw, raw_post, serve};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_keys_are_refused_over_the_wire() {
    let fx = Effects::new();
    let addr = serve(app(IdempotencyLayer::in_memory(), true, &fx)).await;
    let client = reqwest::Client::new();

    // The http crate refuses to build these at all.
    for bad in [&b"a\r\nb"[..], b"a\rb", b"a\nb", b"a\0b"] {
        assert!(http::HeaderValue::from_bytes(bad).is_err());
    }
    // On the wire, hyper refuses what is not a header value (400, or a close); the
    // layer refuses what is one but not a key (400 key-invalid). Either way, nothing runs.
    let cases: [(&str, &[u8], bool); 10] = [
        ("CR", b"idempotency-key: ab\rcd", false),
        ("LF", b"idempotency-key: ab\ncd", false),
        (
            "CRLF then a continuation (obs-fold)",
            b"idempotency-key: ab\r\n cd",
            false,
        ),
        ("NUL", b"idempotency-key: ab\0cd", false),
        ("DEL", b"idempotency-key: ab\x7fcd", false),
        ("UTF-8", "idempotency-key: clé-1".as_bytes(), true),
        ("Latin-1", b"idempotency-key: cl\xe9", true),
        ("invalid UTF-8", b"idempotency-key: \xff\xfe", true),
        ("empty sf-string", b"idempotency-key: \"\"", true),
        (
            "256 characters",
            format!("idempotency-key: {}", "k".repeat(256))
                .leak()
                .as_bytes(),
            true,
        ),
    ];
    for (what, line, ours) in cases {
        let r = raw(addr, &raw_post("mallory", line, b"x")).await;
        if ours {
            assert!(r.is_problem(ProblemKind::KeyInvalid), "{what}: {}", r.text);
        } else {
            assert!(
                matches!(r.status, None | Some(400)),
                "{what}: {:?} {}",
                r.status,
                r.text
            );
        }
        eprintln!(
            "key with {what}: {}",
            match r.status {
                None => "connection closed".to_owned(),
                Some(s) if r.is_problem(ProblemKind::KeyInvalid) => format!("{s} key-invalid"),
                Some(s) => format!("{s} from hyper"),
            }
        );
    }
    assert_eq!(fx.started.load(Ordering::SeqCst), 0, "no malformed key ran");
    healthy(&client, addr).await;

    // A key of exactly 255 characters is accepted and replayed.
    let max = "k".repeat(255);
    let line = format!("idempotency-key: {max}");
    let first = raw(addr, &raw_post("mallory", line.as_bytes(), b"x")).await;
    assert_eq!(first.status, Some(201), "{}", first.text);
    let again = raw(addr, &raw_post("mallory", line.as_bytes(), b"x")).await;
    assert_eq!(again.status, Some(201));
    assert!(
        again.text.contains("idempotent-replayed: true"),
        "{}",
        again.text
    );
    // The sf-string and the bare form are one key; so is the bare form with spaces.
    let bearer = [("authorization", "Bearer mallory")];
    let a = pay(&client, addr, Some("abc"), "x", &bearer).await;
    assert!(!a.replayed());
    for form in [
        &b"idempotency-key: \"abc\""[..],
        b"idempotency-key:    abc   ",
    ] {
        let r = raw(addr, &raw_post("mallory", form, b"x")).await;
        assert_eq!(r.status, Some(201));
        assert!(r.text.contains("idempotent-replayed: true"), "{}", r.text);
    }
    assert_eq!(fx.runs(), 2);
}

/// An HPACK integer with a 7-bit prefix and the Huffman bit clear (RFC 7541 §5.1).
fn hpack_len(out: &mut Vec<u8>, n: usize) {
    if n < 127 {
        out.push(n as u8);
        return;
    }
    out.push(127);
    let mut n = n - 127;
    while n >= 128 {
        out.push((n % 128 + 128) as u8);
        n /= 128;
    }
    out.push(n as u8);
}

/// An HPACK literal header field without indexing, with a new name, raw bytes as they
/// are (RFC 7541 §6.2.2): what a hostile client can put on the wire.
fn hpack_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    hpack_len(out, name.len());
    out.extend_from_slice(name);
    hpack_len(out, value.len());
    out.extend_from_slice(value);
}

fn h2_frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = payload.len();
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// What the server did with one raw HTTP/2 request.
#[derive(Debug, PartialEq)]
enum H2Outcome {
    /// Response headers whose first field is an indexed `:status` (RFC 7541
    /// appendix A: 0x88 = 200 … 0x8e = 500), or `None` for another encoding (201).
    Headers(Option<u16>),
    /// `RST_STREAM` with this error code (1 = PROTOCOL_ERROR).
    Reset(u32),
    /// `GOAWAY` with this error code.
    GoAway(u32),
    /// Closed with neither.
    Closed,
}

/// Sends one POST on a new HTTP/2 connection (prior knowledge) with `key` as raw bytes
/// in the `idempotency-key` field, and reads frames until the server answers stream 1.
async fn h2_raw_post(addr: SocketAddr, key: &[u8]) -> H2Outcome {
    let mut block = Vec::new();
    for (name, value) in [
        (&b":method"[..], &b"POST"[..]),
        (b":scheme", b"http"),
        (b":path", b"/pay"),
        (b":authority", b"localhost"),
        (b"authorization", b"Bearer mallory"),
        (b"idempotency-key", key),
    ] {
        hpack_literal(&mut block, name, value);
    }
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    h2_frame(&mut out, 0x4, 0, 0, &[]); // SETTINGS
    h2_frame(&mut out, 0x1, 0x4 | 0x1, 1, &block); // HEADERS, END_HEADERS | END_STREAM
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&out).await.unwrap();
    let read = async {
        loop {
            let mut head = [0u8; 9];
            if s.read_exact(&mut head).await.is_err() {
                return H2Outcome::Closed;
            }
            let len =
                (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
            let (kind, flags) = (head[3], head[4]);
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            let mut payload = vec![0u8; len];
            if s.read_exact(&mut payload).await.is_err() {
                return H2Outcome::Closed;
            }
            let code = |at: usize| {
                u32::from_be_bytes([
                    payload[at],
                    payload[at + 1],
                    payload[at + 2],
                    payload[at + 3],
                ])
            };
            match (kind, stream) {
                (0x4, 0) if flags & 0x1 == 0 => {
                    // Acknowledge the server's SETTINGS.
                    let mut ack = Vec::new();
                    h2_frame(&mut ack, 0x4, 0x1, 0, &[]);
                    let _ = s.write_all(&ack).await;
                }
                (0x1, 1) => {
                    let status = match payload.first() {
                        Some(0x88) => Some(200),
                        Some(0x89) => Some(204),
                        Some(0x8a) => Some(206),
                        Some(0x8b) => Some(304),
                        Some(0x8c) => Some(400),
                        Some(0x8d) => Some(404),
                        Some(0x8e) => Some(500),
                        _ => None,
                    };
                    return H2Outcome::Headers(status);
                }
                (0x3, 1) => return H2Outcome::Reset(code(0)),
                (0x7, 0) => return H2Outcome::GoAway(code(4)),
                _ => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .expect("the server neither answered nor closed")
}

/// Over HTTP/2 a client is not bound by the `http` crate's builder: HPACK carries any
/// bytes. CR, LF, NUL and DEL in the key never reach the layer (h2 refuses the
/// field: the stream is reset, or the connection closed); non-ASCII reaches it and gets
/// its 400. Nothing runs, and the server keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_keys_over_h2_are_refused() {
    let fx = Effects::new();
    let addr = serve(app(IdempotencyLayer::in_memory(), true, &fx)).await;
    let client = reqwest::Client::new();
    // The harness works: a valid key runs once (201, not an indexed status).
    assert_eq!(h2_raw_post(addr, b"h2-ok").await, H2Outcome::Headers(None));
    assert_eq!(fx.runs(), 1);
    for (what, key, ours) in [
        ("CR LF", &b"ab\r\ncd"[..], false),
        ("CR LF and a header", b"ab\r\nx-injected: 1", false),
        ("LF", b"ab\ncd", false),
        ("NUL", b"ab\0cd", false),
        ("DEL", b"ab\x7fcd", false),
        ("UTF-8", "clé".as_bytes(), true),
        ("invalid UTF-8", b"\xff\xfe", true),
    ] {
        let outcome = h2_raw_post(addr, key).await;
        eprintln!("HTTP/2 key with {what}: {outcome:?}");
        if ours {
            assert_eq!(outcome, H2Outcome::Headers(Some(400)), "{what}");
        } else {
            assert!(
                matches!(
                    outcome,
                    H2Outcome::Reset(_)
                        | H2Outcome::GoAway(_)
                        | H2Outcome::Closed
                        | H2Outcome::Headers(Some(400))
                ),
                "{what}: {outcome:?}"
            );
        }
        healthy(&client, addr).await;
    }
    assert_eq!(fx.runs(), 1, "no malformed key ran");
}
