//! One keep-alive HTTP/1.1 connection of the loopback load drivers.

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// The sending half of one connection.
pub type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

/// Opens a connection to `addr` with `TCP_NODELAY`; its driver runs in a spawned task.
pub async fn open_http(
    addr: SocketAddr,
) -> Result<Sender, Box<dyn std::error::Error + Send + Sync>> {
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}
