//! Sans-IO core of retrysafe.
//!
//! This crate holds the logic every retrysafe layer and adapter shares, with no tower
//! dependency and no I/O:
//!
//! - [`wire`]: the header convention (names in a [`wire::Convention`], total parsers and
//!   encoders);
//! - [`Deadline`]: the time a call has left, which can only be tightened;
//! - [`idempotency`]: scopes, record keys, fingerprints, tokens, the record states and
//!   their versioned byte encoding, the decision table of the `IdempotencyLayer`, and the
//!   [`IdempotencyContext`](idempotency::IdempotencyContext) handlers see;
//! - [`store`]: the [`IdempotencyStore`](store::IdempotencyStore) trait every backend
//!   implements, its boxed object-safe form, and (feature `test-util`) the conformance
//!   suite every backend passes.
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

mod config;
mod deadline;
pub mod idempotency;
pub mod store;
pub mod wire;

pub use config::ConfigError;
pub use deadline::Deadline;
