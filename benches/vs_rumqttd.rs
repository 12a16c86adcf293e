//! Placeholder for the `vs_rumqttd` analysis (being written).

fn main() {}
