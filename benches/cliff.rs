//! Placeholder for the `cliff` analysis (being written).

fn main() {}
