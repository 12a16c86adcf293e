//! Placeholder for the `fanout_1m` analysis (being written).

fn main() {}
