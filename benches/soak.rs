//! Soak run (issue 8): placeholder until the driver lands.

fn main() {}
