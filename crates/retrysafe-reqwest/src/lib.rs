//! reqwest-middleware implementations of retrysafe's client layers: retry, circuit
//! breaker and deadline, driven by `retrysafe-core` like the tower layers.
//!
//! (Crate docs with the recommended middleware order and a runnable example: being
//! written.)

pub mod breaker;
pub mod deadline;
pub mod error;
pub mod retry;
