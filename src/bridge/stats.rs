//! [`BridgeStats`]: what a bridge has sent, received and lost.

use crate::sync::{AtomicU64, Ordering};

/// A snapshot of a bridge's counters ([`Bridge::stats`](super::Bridge::stats)).
///
/// Every loss the bridge can see is in `dropped` (`docs/bridge.md`, "What
/// cannot be counted", names the ones it cannot: what a connection had
/// written the instant it broke, and with NATS what the server sent after
/// `close` unsubscribed). Delivery is at most once by default, as core
/// NATS is; at least once over MQTT with
/// [`BridgeBuilder::at_least_once`](super::BridgeBuilder::at_least_once).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BridgeStats {
    /// Local publishes sent to the engine.
    pub sent: u64,
    /// Remote messages delivered to local subscribers (one per upstream
    /// subscription they arrived on; see the module docs).
    pub received: u64,
    /// Upstream subscriptions held now: one per distinct local filter (and
    /// import it falls in), however many local subscribers share it.
    pub upstream_subscriptions: u64,
    /// Times the connection came back after being lost.
    pub reconnects: u64,
    /// Messages lost, each counted once: exports that overflowed the export
    /// buffer or the outgoing buffer while disconnected, that could not be
    /// encoded or sent, or were too big for the engine; imports the engine
    /// or client dropped for a slow consumer, the local bus refused, or
    /// that still waited for local delivery when the bridge closed (in the
    /// bridge's queues, or in the client's, received but not yet handed
    /// to the bridge).
    pub dropped: u64,
    /// Remote payloads (or subjects) that could not be decoded; each is
    /// also logged with its topic.
    pub decode_errors: u64,
    /// Messages dropped because local delivery fell behind: the bridge's
    /// queue for a local filter (`import_buffer`) was full, or the client
    /// reported a slow consumer. Each is also in `dropped`.
    pub slow_consumers: u64,
    /// The node's own messages that came back from the engine and were
    /// dropped (an engine that ignores `no_echo` would otherwise loop them).
    pub echoes: u64,
    /// Whether the bridge is connected to the engine now (false once
    /// `Bridge::close` has begun).
    pub connected: bool,
}

/// The live counters behind [`BridgeStats`].
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) sent: AtomicU64,
    pub(crate) received: AtomicU64,
    pub(crate) upstream_subscriptions: AtomicU64,
    pub(crate) connects: AtomicU64,
    pub(crate) dropped: AtomicU64,
    pub(crate) decode_errors: AtomicU64,
    pub(crate) slow_consumers: AtomicU64,
    pub(crate) echoes: AtomicU64,
}

impl Counters {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self, connected: bool) -> BridgeStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        BridgeStats {
            sent: get(&self.sent),
            received: get(&self.received),
            upstream_subscriptions: get(&self.upstream_subscriptions),
            reconnects: get(&self.connects).saturating_sub(1),
            dropped: get(&self.dropped),
            decode_errors: get(&self.decode_errors),
            slow_consumers: get(&self.slow_consumers),
            echoes: get(&self.echoes),
            connected,
        }
    }
}
