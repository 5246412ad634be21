//! A conformance checker for HTTP endpoints that honour `Idempotency-Key`, in any
//! language: the `retrysafe-conformance` command, and this library behind it.
//!
//! Point it at one endpoint of your service — a POST that has an effect, such as
//! creating a payment — and it sends that request the ways retrying clients do: with
//! keys of every form and length the convention allows or refuses, twice in a row,
//! many copies at once, with the same key and another body, and with the reply lost
//! (the connection closed before the answer is read, then a retry with the same key).
//! Each rule checks one thing [`docs/wire-convention.md`] says, and names the section
//! it checks. With a ledger URL (a GET that counts the endpoint's effects) every rule
//! that sends copies also checks that they made **one** effect.
//!
//! ```text
//! retrysafe-conformance --url URL [--header 'NAME: VALUE']… [--body JSON]
//!                       [--ledger-url URL] [--method POST|PATCH] [--json]
//! ```
//!
//! The output is one line per rule, `PASS|FAIL|SKIP <id> <title>: <detail>`, and last
//! `conformance: N passed, M failed, K skipped`; the exit status is 0 exactly when no
//! rule failed (2 for a usage error). `--json` prints one JSON document instead
//! ([`Report::to_json`]). [`RULES`] lists the rules.
//!
//! The ledger is read with a GET to `--ledger-url`, with the same `--header`s; it
//! answers either a JSON array (one element per effect) or an object with a `count`
//! member. Effects are the change between two reads, so nothing else may write to
//! what it counts during a run: give the checker an account (in `--body` and the
//! ledger URL) of its own.
//!
//! The library runs the same checks from a test. Here against an axum service guarded
//! by retrysafe, whose ledger answers `{"count": N}`:
//!
//! ```
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use axum::{Json, Router, extract::Request, http::StatusCode, routing::{get, post}};
//! use retrysafe::DeadlineLayer;
//! use retrysafe::idempotency::{IdempotencyLayer, Principal};
//! use retrysafe::server::ServerLayers;
//! use retrysafe_conformance::{Command, parse_args};
//!
//! // The service under test: POST /payments pays once per key, GET /count counts.
//! let paid = Arc::new(AtomicU64::new(0));
//! let (p, c) = (paid.clone(), paid.clone());
//! let auth = axum::middleware::map_request(|mut req: Request| async move {
//!     req.extensions_mut().insert(Principal::new("conformance"));
//!     req
//! });
//! let guard = ServerLayers::new(IdempotencyLayer::in_memory().require_key())
//!     .authentication(auth)
//!     .deadline(DeadlineLayer::server())
//!     .build()?;
//! let app = Router::new()
//!     .route("/payments", post(move || async move { p.fetch_add(1, Ordering::SeqCst); StatusCode::CREATED }))
//!     .layer(guard)
//!     .route("/count", get(move || async move { Json(serde_json::json!({"count": c.load(Ordering::SeqCst)})) }));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let base = format!("http://{}", listener.local_addr()?);
//! tokio::spawn(async move { axum::serve(listener, app).await });
//!
//! let args = ["--url", &format!("{base}/payments"), "--ledger-url", &format!("{base}/count")];
//! let Command::Check(options) = parse_args(args.map(Into::into))? else { unreachable!() };
//! let report = retrysafe_conformance::check(&options).await;
//! assert_eq!(report.failed(), 0, "{}", report.to_text());
//! assert!(report.to_text().ends_with(&format!("{}\n", report.summary())));
//! # Ok(())
//! # }
//! ```
//!
//! It speaks HTTP/1.1 over plain TCP (`http://` URLs only): point it at a local
//! instance, or at a port forwarded to one.
//!
//! [`docs/wire-convention.md`]: https://github.com/retrysafe/retrysafe/blob/main/docs/wire-convention.md

mod args;
mod check;
mod http;
mod report;
mod rules;

pub use args::{Command, Options, USAGE, UsageError, parse_args};
pub use report::{Outcome, Report, Verdict};
pub use rules::RULES;

/// One rule of the checker.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Rule {
    /// A stable id, `<topic>.<check>`.
    pub id: &'static str,
    /// The heading of `docs/wire-convention.md` it checks, as its anchor
    /// (`idempotency-key`).
    pub section: &'static str,
    /// What it checks, in a few words.
    pub title: &'static str,
}

impl Rule {
    /// `docs/wire-convention.md#<section>`.
    pub fn section_ref(&self) -> String {
        format!("docs/wire-convention.md#{}", self.section)
    }
}

/// Runs every rule against the endpoint of `options`, one after another (the effects
/// of one rule must not mix with another's), and reports what each found.
pub async fn check(options: &Options) -> Report {
    rules::run(options).await
}
