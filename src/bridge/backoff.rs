//! Reconnect pacing and node ids, shared by the transports.

use std::time::Duration;

/// Reconnect delays: exponential from `min` to `max`, each one jittered
/// down by up to half, so many nodes that lost one server do not come back
/// in step.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Backoff {
    pub(crate) min: Duration,
    pub(crate) max: Duration,
}

impl Backoff {
    /// The delay before reconnect attempt `attempt` (0 for the first).
    pub(crate) fn delay(&self, attempt: usize) -> Duration {
        let exp = self
            .min
            .saturating_mul(1u32 << attempt.min(20) as u32)
            .min(self.max);
        // Half fixed, half random.
        let half = exp / 2;
        half + half.mul_f64(random_unit())
    }
}

/// A number in [0, 1), from the standard library's randomly keyed hasher.
fn random_unit() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    );
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// A node id: random, 16 hex digits.
pub(crate) fn node_id() -> String {
    format!(
        "{:016x}",
        (random_unit() * (1u64 << 53) as f64) as u64 ^ u64::from(std::process::id())
    )
}
