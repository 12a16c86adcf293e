//! Placeholder for the `payload_matrix` analysis (being written).

fn main() {}
