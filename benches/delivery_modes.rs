//! Placeholder for the `delivery_modes` analysis (being written).

fn main() {}
