//! reqwest-middleware implementations of retrysafe's client layers.
//!
//! (Being built: retry, circuit breaker and deadline middleware over
//! `retrysafe-core`, the same core the tower layers drive.)
