//! Circuit breaker and deadline benches (being written).
fn main() {}
