//! The fault mode: HTTP/1.1 framing, and one fault per request.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::{Fault, ProxyConfig, Reader, Shared, Way, copy_both_ways};
use crate::rng::SplitMix64;

/// The largest message the proxy frames; a larger one makes it fall back to a copy.
const MAX_MESSAGE: usize = 4 << 20;

/// Resets `stream`: `SO_LINGER` 0, then close, so the peer gets an RST, not a FIN.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

/// Why a message could not be read.
enum ReadError {
    /// The connection ended or failed.
    Io,
    /// The proxy cannot find where the message ends.
    Unframed,
}

/// One side of a proxied connection: its stream, what was read from it and not
/// forwarded yet, and how it is read.
struct Side {
    stream: TcpStream,
    buf: Vec<u8>,
    reader: Reader,
}

/// One proxied client connection.
pub(super) struct Conn<'a> {
    /// `None` once reset.
    client: Option<Side>,
    server: Option<Side>,
    config: &'a ProxyConfig,
    shared: &'a Arc<Shared>,
    rng: SplitMix64,
}

impl<'a> Conn<'a> {
    /// The `n`th connection accepted.
    pub(super) fn new(
        client: TcpStream,
        n: u64,
        config: &'a ProxyConfig,
        shared: &'a Arc<Shared>,
    ) -> Conn<'a> {
        Conn {
            client: Some(Side {
                stream: client,
                buf: Vec::new(),
                reader: Reader::new(Way::Up, shared),
            }),
            server: None,
            config,
            shared,
            rng: SplitMix64::new(config.seed ^ n.wrapping_mul(0xA076_1D64_78BD_642F)),
        }
    }

    pub(super) async fn run(mut self) {
        loop {
            let request = match read_message(self.client.as_mut().unwrap(), None).await {
                Ok(Some(m)) => m,
                Ok(None) | Err(ReadError::Io) => return,
                Err(ReadError::Unframed) => return self.copy_rest().await,
            };
            let counters = &self.shared.counters;
            counters.requests.fetch_add(1, Ordering::Relaxed);
            let fault = self.config.mix.pick(&mut self.rng);
            counters.faults[fault.index()].fetch_add(1, Ordering::Relaxed);
            let keep_going = self.serve(request, fault).await;
            if !keep_going {
                return;
            }
        }
    }

    /// Serves one request with `fault`; whether the connection goes on.
    async fn serve(&mut self, request: Vec<u8>, fault: Fault) -> bool {
        match fault {
            Fault::ResetBeforeRequest => {
                self.reset_client();
                return false;
            }
            Fault::BlackHole => {
                self.black_hole().await;
                return false;
            }
            _ => {}
        }
        let (delay_request, delay_response) = if fault == Fault::Delay {
            match self.rng.below(3) {
                0 => (true, false),
                1 => (false, true),
                _ => (true, true),
            }
        } else {
            (false, false)
        };
        if delay_request {
            let d = self.rng.duration_up_to(self.config.max_delay);
            tokio::time::sleep(d).await;
        }
        if !self.forward_request(&request).await {
            return false;
        }
        self.answer(&request, fault, delay_response).await
    }

    /// Once `request` is forwarded: breaks (or delays) its answer as `fault` says;
    /// whether the connection goes on.
    async fn answer(&mut self, request: &[u8], fault: Fault, delay_response: bool) -> bool {
        match fault {
            Fault::ResetAfterRequest => {
                self.reset_client();
                self.server = None;
                false
            }
            Fault::HalfCloseClient => {
                let _ = self.client().shutdown().await;
                // Let the server finish and drain its answer; then close both.
                let _ = self.read_response(request).await;
                false
            }
            Fault::HalfCloseServer => {
                if let Some(server) = self.server.as_mut() {
                    let _ = server.stream.shutdown().await;
                }
                if let Some(response) = self.read_response(request).await {
                    let _ = self.client().write_all(&response).await;
                    let _ = self.client().shutdown().await;
                }
                false
            }
            Fault::LoseResponse => {
                let _ = self.read_response(request).await;
                self.reset_client();
                false
            }
            Fault::CutMidBody => {
                if let Some(response) = self.read_response(request).await {
                    let len = response.len();
                    if len > 1 {
                        let cut = 1 + self.rng.below(len as u64 - 1);
                        let cut = usize::try_from(cut).unwrap_or(len - 1);
                        let _ = self.client().write_all(&response[..cut]).await;
                        let _ = self.client().flush().await;
                    }
                }
                self.reset_client();
                false
            }
            Fault::Pass | Fault::Delay => {
                let Some(response) = self.read_response(request).await else {
                    // The server closed without a (framable) answer: close as it did.
                    return false;
                };
                if delay_response {
                    let d = self.rng.duration_up_to(self.config.max_delay);
                    tokio::time::sleep(d).await;
                }
                if self.client().write_all(&response).await.is_err() {
                    return false;
                }
                !closes(&response)
            }
            Fault::ResetBeforeRequest | Fault::BlackHole => false,
        }
    }

    /// Resets the client connection; the `Conn` must end right after.
    fn reset_client(&mut self) {
        if let Some(client) = self.client.take() {
            reset(client.stream);
        }
    }

    fn client(&mut self) -> &mut TcpStream {
        &mut self
            .client
            .as_mut()
            .expect("the client connection was reset")
            .stream
    }

    /// Connects upstream if needed and writes `request`; false when that failed (the
    /// client is then reset).
    async fn forward_request(&mut self, request: &[u8]) -> bool {
        if self.server.is_none() {
            let Some(stream) = self.shared.connect().await else {
                self.reset_client();
                return false;
            };
            self.server = Some(Side {
                stream,
                buf: Vec::new(),
                reader: Reader::new(Way::Down, self.shared),
            });
        }
        let server = self.server.as_mut().unwrap();
        server.stream.write_all(request).await.is_ok()
    }

    /// The whole response to `request` from the server, `None` when the server closed
    /// or the response cannot be framed.
    async fn read_response(&mut self, request: &[u8]) -> Option<Vec<u8>> {
        let server = self.server.as_mut()?;
        let head_request = request.starts_with(b"HEAD ");
        match read_message(server, Some(head_request)).await {
            Ok(Some(m)) => Some(m),
            _ => None,
        }
    }

    /// Reads and drops what the client sends, never answering, until it closes or the
    /// hold time is over.
    async fn black_hole(&mut self) {
        let hold = self.config.black_hole_hold;
        let Some(client) = self.client.as_mut() else {
            return;
        };
        let _ = tokio::time::timeout(hold, async {
            let mut buf = [0u8; 4096];
            loop {
                match client.reader.read(&mut client.stream, &mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        })
        .await;
    }

    /// Falls back to a plain copy for the rest of the connection.
    async fn copy_rest(mut self) {
        self.shared
            .counters
            .unframed
            .fetch_add(1, Ordering::Relaxed);
        let Some(client) = self.client.take() else {
            return;
        };
        let (server, ahead) = match self.server.take() {
            Some(server) => (server.stream, server.buf),
            None => match self.shared.connect().await {
                Some(stream) => (stream, Vec::new()),
                None => return,
            },
        };
        copy_both_ways(client.stream, server, self.shared, client.buf, ahead).await;
    }
}

/// Whether a response says the connection closes after it (`connection: close`).
fn closes(message: &[u8]) -> bool {
    let Some(end) = find(message, b"\r\n\r\n", 0) else {
        return true;
    };
    header_lines(&message[..end]).any(|(name, value)| {
        name.eq_ignore_ascii_case("connection") && value.to_ascii_lowercase().contains("close")
    })
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if from >= hay.len() {
        return None;
    }
    hay[from..]
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}

/// The `name: value` lines of a head (without its first line).
fn header_lines(head: &[u8]) -> impl Iterator<Item = (String, String)> + '_ {
    head.split(|b| *b == b'\n').skip(1).filter_map(|line| {
        let line = std::str::from_utf8(line).ok()?.trim_end_matches('\r');
        let (name, value) = line.split_once(':')?;
        Some((name.trim().to_owned(), value.trim().to_owned()))
    })
}

impl Side {
    /// Reads more of the stream into the buffer; `Io` at its end.
    async fn read_more(&mut self) -> Result<(), ReadError> {
        let mut chunk = [0u8; 16 * 1024];
        match self.reader.read(&mut self.stream, &mut chunk).await {
            Ok(0) | Err(_) => Err(ReadError::Io),
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(())
            }
        }
    }

    /// Reads until the buffer holds at least `len` bytes.
    async fn fill(&mut self, len: usize) -> Result<(), ReadError> {
        while self.buf.len() < len {
            self.read_more().await?;
        }
        Ok(())
    }

    /// Reads until `needle` is in the buffer at or after `from`; its position.
    async fn fill_until(&mut self, needle: &[u8], from: usize) -> Result<usize, ReadError> {
        loop {
            if let Some(p) = find(&self.buf, needle, from) {
                return Ok(p);
            }
            if self.buf.len() > MAX_MESSAGE {
                return Err(ReadError::Unframed);
            }
            self.read_more().await?;
        }
    }
}

/// Reads one whole HTTP/1.1 message from `side` (its buffer holding what was read
/// ahead) and returns its bytes; `Ok(None)` when the peer closed cleanly between
/// messages. `response` is `None` for a request, or `Some(to a HEAD request)`.
async fn read_message(
    side: &mut Side,
    response: Option<bool>,
) -> Result<Option<Vec<u8>>, ReadError> {
    if side.buf.is_empty() && side.read_more().await.is_err() {
        return Ok(None);
    }
    let head_end = side.fill_until(b"\r\n\r\n", 0).await? + 4;
    let head = &side.buf[..head_end];
    let status: Option<u16> = response.and_then(|_| {
        let line = head.split(|b| *b == b'\r').next()?;
        let line = std::str::from_utf8(line).ok()?;
        line.split(' ').nth(1)?.parse().ok()
    });
    let mut chunked = false;
    let mut length: Option<usize> = None;
    for (name, value) in header_lines(&head[..head_end - 4]) {
        if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.to_ascii_lowercase().contains("chunked");
        } else if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse().map_err(|_| ReadError::Unframed)?);
        }
    }
    let bodiless = match (response, status) {
        (Some(true), _) => true,
        (Some(false), Some(s)) => s < 200 || s == 204 || s == 304,
        _ => false,
    };
    let end = if bodiless {
        head_end
    } else if chunked {
        chunked_end(side, head_end).await?
    } else if let Some(n) = length {
        if head_end + n > MAX_MESSAGE {
            return Err(ReadError::Unframed);
        }
        side.fill(head_end + n).await?;
        head_end + n
    } else if response.is_some() {
        // A response delimited by the end of the connection: not produced by the
        // servers under test; do not guess.
        return Err(ReadError::Unframed);
    } else {
        head_end
    };
    let rest = side.buf.split_off(end);
    let message = std::mem::replace(&mut side.buf, rest);
    Ok(Some(message))
}

/// Reads a chunked body that starts at `pos`, and its trailers: where they end.
async fn chunked_end(side: &mut Side, mut pos: usize) -> Result<usize, ReadError> {
    loop {
        let line_end = side.fill_until(b"\r\n", pos).await?;
        let line =
            std::str::from_utf8(&side.buf[pos..line_end]).map_err(|_| ReadError::Unframed)?;
        let size_hex = line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_hex, 16).map_err(|_| ReadError::Unframed)?;
        pos = line_end + 2;
        if size == 0 {
            // Trailers, up to an empty line.
            loop {
                let e = side.fill_until(b"\r\n", pos).await?;
                let empty = e == pos;
                pos = e + 2;
                if empty {
                    return Ok(pos);
                }
            }
        }
        if pos + size > MAX_MESSAGE {
            return Err(ReadError::Unframed);
        }
        side.fill(pos + size + 2).await?;
        pos += size + 2;
    }
}
