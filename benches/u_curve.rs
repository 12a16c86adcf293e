//! Placeholder for the `u_curve` analysis (being written).

fn main() {}
