//! The error helpers find retrysafe's typed errors where `source()` does not look: in
//! the `anyhow` payload of `reqwest_middleware::Error::Middleware`, behind anyhow
//! context, in a `reqwest_middleware::Error` nested in another error, and in the chain
//! of a real `reqwest::Error` (a refused connection to a loopback port), as well as in
//! the errors the middleware of this crate return against a real axum server.
//!
//! The errors of a client stack against a real server run on both forms (`both_forms!`:
//! the separate middleware and the fused `ClientMiddlewares`). Single-form: the tests
//! of the helpers on errors built by hand, and on a bare reqwest error (no middleware).
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs,
    unreachable_pub
)]

use std::error::Error as StdError;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use reqwest_middleware::{ClientBuilder, Error};
use retrysafe_core::breaker::CircuitBreaker;
use retrysafe_core::error::{BudgetExhausted, CircuitOpen, DeadlineExceeded};
use retrysafe_reqwest::CircuitBreakerMiddleware;
use retrysafe_reqwest::error::{
    find, find_in, is_budget_exhausted, is_circuit_open, is_deadline_exceeded,
};
use tokio::net::TcpListener;

use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::reqwest::Stack;

fn open() -> CircuitOpen {
    CircuitOpen::new(Duration::from_millis(1500))
}

#[test]
fn source_skips_the_payload_and_the_helpers_do_not() {
    let error = Error::Middleware(anyhow::Error::new(open()));
    // What a plain walk of `source()` sees: nothing.
    assert!(error.source().is_none());
    assert!(retrysafe_core::error::find::<CircuitOpen>(&error).is_none());
    // The helpers look inside.
    assert_eq!(find::<CircuitOpen>(&error), Some(&open()));
    assert!(is_circuit_open(&error));
    assert!(!is_deadline_exceeded(&error));
    assert!(!is_budget_exhausted(&error));
    assert_eq!(error.to_string(), "circuit open (retry in 1500 ms)");
}

#[test]
fn each_typed_error_is_recognised_by_its_helper() {
    let deadline = Error::middleware(DeadlineExceeded::new());
    let budget = Error::middleware(BudgetExhausted::new());
    let breaker = Error::middleware(open());
    let other = Error::Middleware(anyhow::anyhow!("not ours"));

    assert!(is_deadline_exceeded(&deadline));
    assert!(is_budget_exhausted(&budget));
    assert!(is_circuit_open(&breaker));
    for error in [&deadline, &budget, &breaker, &other] {
        let hits = [
            is_deadline_exceeded(error),
            is_budget_exhausted(error),
            is_circuit_open(error),
        ];
        assert!(hits.iter().filter(|hit| **hit).count() <= 1, "{error:?}");
    }
    assert!(!is_deadline_exceeded(&other) && !is_budget_exhausted(&other));
    assert!(!is_circuit_open(&other));
}

#[derive(Debug)]
struct Wrapper(Box<dyn StdError + Send + Sync>);

impl std::fmt::Display for Wrapper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("wrapped")
    }
}

impl StdError for Wrapper {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.0)
    }
}

#[test]
fn context_wrappers_and_nested_middleware_errors_are_looked_through() {
    // anyhow context on top of ours.
    let error = Error::Middleware(
        anyhow::Error::new(DeadlineExceeded::new())
            .context("calling the ledger")
            .context("settling"),
    );
    assert!(is_deadline_exceeded(&error));

    // Our error inside a wrapper of the payload's own.
    let error = Error::middleware(Wrapper(Box::new(BudgetExhausted::new())));
    assert!(is_budget_exhausted(&error));
    assert!(find::<Wrapper>(&error).is_some());

    // A middleware that wrapped the error of a middleware below it.
    let inner = Error::middleware(open());
    let error = Error::middleware(Wrapper(Box::new(inner)));
    assert!(is_circuit_open(&error));
    assert!(find::<Error>(&error).is_some());

    // Any error whose chain holds a middleware error.
    let outer = Wrapper(Box::new(Error::middleware(DeadlineExceeded::new())));
    assert!(find_in::<DeadlineExceeded>(&outer).is_some());
    assert!(find_in::<CircuitOpen>(&outer).is_none());
}

#[test]
fn a_cyclic_chain_ends() {
    #[derive(Debug)]
    struct Loop;
    impl std::fmt::Display for Loop {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("loop")
        }
    }
    impl StdError for Loop {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(self)
        }
    }
    let error = Error::middleware(Loop);
    assert!(!is_deadline_exceeded(&error));
    assert!(find::<Loop>(&error).is_some());
}

#[tokio::test]
async fn the_chain_of_a_real_reqwest_error_is_walked() {
    // A port nothing listens on: the connection is refused.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let client = ClientBuilder::new(reqwest::Client::new()).build();
    let error = client
        .get(format!("http://127.0.0.1:{port}/"))
        .send()
        .await
        .unwrap_err();
    assert!(matches!(error, Error::Reqwest(_)));
    // The reqwest::Error itself, which `source()` skips…
    assert!(find::<reqwest::Error>(&error).unwrap().is_connect());
    // …and the I/O error deep in its chain.
    let io = find::<std::io::Error>(&error).unwrap();
    assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);
    assert!(!is_deadline_exceeded(&error) && !is_circuit_open(&error));
}

both_forms! {
    #[tokio::test]
    async fn errors_of_the_middleware_against_a_real_server_are_found(form) {
        let app = Router::new().route(
            "/",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(600)).await;
                "late"
            }),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

        let breaker = CircuitBreaker::default();
        let client = Stack::new()
            .deadline(Duration::from_millis(100))
            .breaker(CircuitBreakerMiddleware::new(breaker.clone()))
            .client(form);

        let error = client.get(&url).send().await.unwrap_err();
        assert!(is_deadline_exceeded(&error), "{error:?}");
        assert!(!is_circuit_open(&error));

        breaker.force_open();
        let error = client.get(&url).send().await.unwrap_err();
        assert!(is_circuit_open(&error), "{error:?}");
        assert!(!is_deadline_exceeded(&error));
    }
}
