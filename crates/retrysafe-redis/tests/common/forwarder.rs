//! A TCP forwarder on a loopback port that sends each new connection to the port it is
//! told, as a DNS name or a proxy in front of a managed Redis does after a failover:
//! connections already made keep their node.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Forwards connections to 127.0.0.1:`upstream`; stops when dropped.
pub(crate) struct Forwarder {
    addr: SocketAddr,
    upstream: Arc<AtomicU16>,
    task: JoinHandle<()>,
}

impl Forwarder {
    pub(crate) async fn start(upstream: u16) -> Forwarder {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let upstream = Arc::new(AtomicU16::new(upstream));
        let to = Arc::clone(&upstream);
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let port = to.load(Ordering::SeqCst);
                tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(("127.0.0.1", port)).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        Forwarder {
            addr,
            upstream,
            task,
        }
    }

    /// The URL of the name in front: `redis://127.0.0.1:PORT`.
    pub(crate) fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Sends new connections to 127.0.0.1:`port` from now on.
    pub(crate) fn switch(&self, port: u16) {
        self.upstream.store(port, Ordering::SeqCst);
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.task.abort();
    }
}
