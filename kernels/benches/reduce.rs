//! Reduction throughput (placeholder until the bench lands).

fn main() {}
