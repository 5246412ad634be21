//! A tonic generated client (`grpc.health.v1`) through retrysafe's client stack:
//! `ClientLayers::grpc()` over a `Channel` (deadline → retry → budget → breaker, the
//! body adapter and the `tonic::Status` mapping inside). The program starts the stock
//! tonic-health server on 127.0.0.1:0, checks it, and exits.
//! Run it with `cargo run --example tonic_client`.
#![allow(clippy::print_stdout)]

use std::time::Duration;

use retrysafe::retry::Idempotent;
use retrysafe::{ClientLayers, RetryBudget, RetryLayer};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Endpoint, Server};
use tonic_health::ServingStatus;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tower::Layer;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // A server to talk to: tonic-health's own, reporting SERVING.
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", ServingStatus::Serving)
        .await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let server = Server::builder().add_service(health);
    tokio::spawn(server.serve_with_incoming(TcpIncoming::from(listener)));

    // The client stack, given to the generated client as its channel.
    let channel = Endpoint::from_shared(url)?.connect_lazy();
    let stack = ClientLayers::new()
        .deadline(Duration::from_secs(5)) // the whole call, every attempt included
        .retry(RetryLayer::new()) // UNAVAILABLE is retried; only safe calls, though
        .budget(RetryBudget::ratio()) // share it between every client of this server
        .build()?
        .grpc()
        .layer(channel);
    let mut client = HealthClient::new(stack);

    // gRPC sends every call as a POST: declare a read safe to repeat.
    let mut request = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    request.extensions_mut().insert(Idempotent);
    let status = client.check(request).await?.into_inner().status();
    println!("status: {}", status.as_str_name());
    Ok(())
}
