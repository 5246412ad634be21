//! A small HTTP/1.1 client over plain TCP, written for the checks rather than taken
//! from a library: it must send what a library refuses to (an empty key, a key twice,
//! control characters), hold many copies back to release them at once, and close a
//! connection before reading its answer.

use std::fmt;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long one exchange may take before it counts as no answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest answer read (head and body).
const MAX_ANSWER: usize = 8 << 20;
/// The most response header fields parsed.
const MAX_HEADERS: usize = 128;

/// Where requests go: a host and port, and the `host` header that names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Origin {
    /// `host:port`, for connecting.
    pub(crate) addr: String,
    /// The `host` header (the URL's authority).
    pub(crate) authority: String,
}

/// One request, as bytes on the wire.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub(crate) method: String,
    /// The origin-form target: path and query.
    pub(crate) target: String,
    /// Header fields in order, raw: a value may hold any byte but CR and LF.
    pub(crate) headers: Vec<(String, Vec<u8>)>,
    pub(crate) body: Vec<u8>,
}

impl Request {
    /// The request with one more header field.
    pub(crate) fn header(mut self, name: &str, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.to_owned(), value.into()));
        self
    }

    /// The request as bytes, with `host`, `content-length` and `connection: close`.
    fn encode(&self, origin: &Origin) -> Vec<u8> {
        let mut out = Vec::with_capacity(256 + self.body.len());
        out.extend_from_slice(format!("{} {} HTTP/1.1\r\n", self.method, self.target).as_bytes());
        if !self.has("host") {
            out.extend_from_slice(format!("host: {}\r\n", origin.authority).as_bytes());
        }
        for (name, value) in &self.headers {
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            // CR and LF would end the field early: the request would be another one.
            out.extend(value.iter().filter(|b| **b != b'\r' && **b != b'\n'));
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(format!("content-length: {}\r\n", self.body.len()).as_bytes());
        out.extend_from_slice(b"connection: close\r\n\r\n");
        out.extend_from_slice(&self.body);
        out
    }

    fn has(&self, name: &str) -> bool {
        self.headers
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case(name))
    }

    /// `METHOD target`, for failure messages.
    pub(crate) fn line(&self) -> String {
        format!("{} {}", self.method, self.target)
    }
}

/// An answer: status, header fields (names lowercased, values raw) and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, Vec<u8>)>,
    pub(crate) body: Vec<u8>,
}

impl Answer {
    /// The first value of header `name` (lowercase).
    pub(crate) fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    /// Every value of header `name` (lowercase).
    pub(crate) fn all(&self, name: &str) -> impl Iterator<Item = &[u8]> {
        self.headers
            .iter()
            .filter(move |(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    pub(crate) fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// Why an exchange produced no answer.
#[derive(Debug)]
pub(crate) enum Failure {
    Connect(std::io::Error),
    Io(std::io::Error),
    Timeout,
    /// The bytes that came back are not an HTTP/1.1 answer.
    Malformed(String),
    TooLarge,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Connect(e) => write!(f, "cannot connect: {e}"),
            Failure::Io(e) => write!(f, "connection failed: {e}"),
            Failure::Timeout => write!(f, "no answer within {} s", ANSWER_TIMEOUT.as_secs()),
            Failure::Malformed(why) => write!(f, "not an HTTP/1.1 answer: {why}"),
            Failure::TooLarge => write!(f, "answer larger than {} MiB", MAX_ANSWER >> 20),
        }
    }
}

pub(crate) type Exchange = Result<Answer, Failure>;

async fn connect(origin: &Origin) -> Result<TcpStream, Failure> {
    let stream = tokio::time::timeout(ANSWER_TIMEOUT, TcpStream::connect(&origin.addr))
        .await
        .map_err(|_| Failure::Timeout)?
        .map_err(Failure::Connect)?;
    // The copies held back for a simultaneous release go out at once.
    stream.set_nodelay(true).map_err(Failure::Io)?;
    Ok(stream)
}

/// Sends `request` on a new connection and reads its answer.
pub(crate) async fn send(origin: &Origin, request: &Request) -> Exchange {
    let exchange = async {
        let mut stream = connect(origin).await?;
        stream
            .write_all(&request.encode(origin))
            .await
            .map_err(Failure::Io)?;
        read_answer(&mut stream).await
    };
    tokio::time::timeout(ANSWER_TIMEOUT, exchange)
        .await
        .unwrap_or(Err(Failure::Timeout))
}

/// Sends every request on a connection of its own, all at once: each is written but
/// its last byte, then the last bytes go out together, so the server sees the copies
/// complete within microseconds of each other. The answers, in order.
pub(crate) async fn send_together(origin: &Origin, requests: &[Request]) -> Vec<Exchange> {
    let mut held = Vec::with_capacity(requests.len());
    for request in requests {
        let bytes = request.encode(origin);
        let prepared = async {
            let mut stream = connect(origin).await?;
            let (head, last) = bytes.split_at(bytes.len().saturating_sub(1));
            stream.write_all(head).await.map_err(Failure::Io)?;
            Ok::<_, Failure>((stream, last.to_vec()))
        };
        held.push(prepared.await);
    }
    for (stream, last) in held.iter_mut().flatten() {
        // A failure shows when the answer is read.
        let _ = stream.write_all(last).await;
    }
    let reads = held.into_iter().map(|prepared| async move {
        let (mut stream, _) = prepared?;
        tokio::time::timeout(ANSWER_TIMEOUT, read_answer(&mut stream))
            .await
            .unwrap_or(Err(Failure::Timeout))
    });
    join_all(reads).await
}

/// Sends `request` and closes the connection after `wait`, or as soon as an answer
/// starts to arrive: a reply lost while the server is working on the request.
pub(crate) async fn send_and_close(
    origin: &Origin,
    request: &Request,
    wait: Duration,
) -> Result<(), Failure> {
    let mut stream = connect(origin).await?;
    stream
        .write_all(&request.encode(origin))
        .await
        .map_err(Failure::Io)?;
    // Long enough for the server to have taken the request up; an answer that comes
    // sooner is lost unread all the same.
    let _ = tokio::time::timeout(wait, stream.readable()).await;
    drop(stream);
    Ok(())
}

/// Sends `request`, waits until its answer starts to arrive and closes the connection
/// without reading it: a reply lost after the server finished.
pub(crate) async fn send_and_drop_answer(
    origin: &Origin,
    request: &Request,
) -> Result<(), Failure> {
    let exchange = async {
        let mut stream = connect(origin).await?;
        stream
            .write_all(&request.encode(origin))
            .await
            .map_err(Failure::Io)?;
        stream.readable().await.map_err(Failure::Io)?;
        drop(stream);
        Ok(())
    };
    tokio::time::timeout(ANSWER_TIMEOUT, exchange)
        .await
        .unwrap_or(Err(Failure::Timeout))
}

/// Runs the futures concurrently on this task; their outputs in order.
async fn join_all<F: std::future::Future>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut pending: Vec<_> = futures.into_iter().map(Box::pin).collect();
    let mut done: Vec<Option<F::Output>> = pending.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut all = true;
        for (future, out) in pending.iter_mut().zip(done.iter_mut()) {
            if out.is_none() {
                match future.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *out = Some(v),
                    std::task::Poll::Pending => all = false,
                }
            }
        }
        if all {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    done.into_iter().flatten().collect()
}

/// Reads one answer (skipping interim 1xx answers): head, then the body by
/// `content-length`, by chunks, or to the end of the connection.
async fn read_answer(stream: &mut TcpStream) -> Exchange {
    let mut buf = Vec::with_capacity(4096);
    loop {
        let (status, headers, head_len) = loop {
            if let Some(head) = parse_head(&buf)? {
                break head;
            }
            if read_more(stream, &mut buf).await? == 0 {
                return Err(Failure::Malformed(if buf.is_empty() {
                    "the connection closed without an answer".to_owned()
                } else {
                    "the connection closed inside the answer's head".to_owned()
                }));
            }
        };
        buf.drain(..head_len);
        if (100..200).contains(&status) && status != 101 {
            continue;
        }
        let body = read_body(stream, &mut buf, &headers).await?;
        return Ok(Answer {
            status,
            headers,
            body,
        });
    }
}

type Head = (u16, Vec<(String, Vec<u8>)>, usize);

fn parse_head(buf: &[u8]) -> Result<Option<Head>, Failure> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut fields);
    match response.parse(buf) {
        Ok(httparse::Status::Complete(len)) => {
            let status = response.code.unwrap_or(0);
            let headers = response
                .headers
                .iter()
                .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
                .collect();
            Ok(Some((status, headers, len)))
        }
        Ok(httparse::Status::Partial) if buf.len() > MAX_ANSWER => Err(Failure::TooLarge),
        Ok(httparse::Status::Partial) => Ok(None),
        Err(e) => Err(Failure::Malformed(e.to_string())),
    }
}

async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Result<usize, Failure> {
    if buf.len() > MAX_ANSWER {
        return Err(Failure::TooLarge);
    }
    let mut chunk = [0u8; 8192];
    let n = stream.read(&mut chunk).await.map_err(Failure::Io)?;
    buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
    Ok(n)
}

async fn read_body(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    headers: &[(String, Vec<u8>)],
) -> Result<Vec<u8>, Failure> {
    let field = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v);
    let chunked = field("transfer-encoding").is_some_and(|v| {
        String::from_utf8_lossy(v)
            .to_ascii_lowercase()
            .contains("chunked")
    });
    if chunked {
        return read_chunked(stream, buf).await;
    }
    if let Some(length) = field("content-length") {
        let length: usize = std::str::from_utf8(length)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| {
                Failure::Malformed("a content-length that is not a number".to_owned())
            })?;
        if length > MAX_ANSWER {
            return Err(Failure::TooLarge);
        }
        while buf.len() < length {
            if read_more(stream, buf).await? == 0 {
                return Err(Failure::Malformed(
                    "the connection closed inside the body".to_owned(),
                ));
            }
        }
        buf.truncate(length);
        return Ok(std::mem::take(buf));
    }
    while read_more(stream, buf).await? > 0 {}
    Ok(std::mem::take(buf))
}

/// Decodes a chunked body, trailers ignored.
async fn read_chunked(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Result<Vec<u8>, Failure> {
    let mut body = Vec::new();
    let mut at = 0;
    loop {
        let line_end = loop {
            if let Some(i) = find_crlf(buf.get(at..).unwrap_or_default()) {
                break at + i;
            }
            if read_more(stream, buf).await? == 0 {
                return Err(Failure::Malformed(
                    "the connection closed inside a chunk".to_owned(),
                ));
            }
        };
        let line = String::from_utf8_lossy(buf.get(at..line_end).unwrap_or_default()).into_owned();
        let size_text = line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| Failure::Malformed(format!("a chunk size of {size_text:?}")))?;
        at = line_end + 2;
        if size == 0 {
            return Ok(body);
        }
        if body.len() + size > MAX_ANSWER {
            return Err(Failure::TooLarge);
        }
        while buf.len() < at + size + 2 {
            if read_more(stream, buf).await? == 0 {
                return Err(Failure::Malformed(
                    "the connection closed inside a chunk".to_owned(),
                ));
            }
        }
        body.extend_from_slice(buf.get(at..at + size).unwrap_or_default());
        at += size + 2;
    }
}

fn find_crlf(bytes: &[u8]) -> Option<usize> {
    bytes.windows(2).position(|w| w == b"\r\n")
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn a_head_is_parsed_with_lowercase_names_and_raw_values() {
        let (status, headers, len) =
            parse_head(b"HTTP/1.1 201 Created\r\nContent-Type: a/b\r\nX: \xff\r\n\r\nbody")
                .unwrap()
                .unwrap();
        assert_eq!(status, 201);
        assert_eq!(
            headers,
            [
                ("content-type".to_owned(), b"a/b".to_vec()),
                ("x".to_owned(), b"\xff".to_vec())
            ]
        );
        assert_eq!(len, 49);
        assert!(parse_head(b"HTTP/1.1 201 Created\r\n").unwrap().is_none());
        assert!(parse_head(b"SSH-2.0-OpenSSH\r\n\r\n").is_err());
    }

    #[test]
    fn a_request_is_encoded_with_its_framing_and_no_line_breaks_in_values() {
        let origin = Origin {
            addr: "127.0.0.1:1".to_owned(),
            authority: "api.test:8080".to_owned(),
        };
        let request = Request {
            method: "POST".to_owned(),
            target: "/pay?x=1".to_owned(),
            headers: vec![("idempotency-key".to_owned(), b"a\r\nb".to_vec())],
            body: b"{}".to_vec(),
        };
        assert_eq!(
            String::from_utf8(request.encode(&origin)).unwrap(),
            "POST /pay?x=1 HTTP/1.1\r\nhost: api.test:8080\r\nidempotency-key: ab\r\n\
             content-length: 2\r\nconnection: close\r\n\r\n{}"
        );
    }
}
