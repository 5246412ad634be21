//! Tower layers of retrysafe.
//!
//! - [`idempotency`] (feature `idempotency`): the server-side `IdempotencyLayer` that makes
//!   POST and PATCH safe to retry by `Idempotency-Key`, and the in-memory `MemoryStore`.
//! - [`server`]: a helper that assembles the recommended server order.
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

#[cfg(feature = "idempotency")]
pub mod idempotency;
pub mod local;
#[cfg(feature = "retry")]
pub mod retry;
#[cfg(feature = "idempotency")]
pub mod server;

pub use retrysafe_core as core;
