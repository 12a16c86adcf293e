//! The registry: who is subscribed, and what a topic reaches.
//!
//! - `entry.rs` — one subscription's entry: its flag and its sink.
//! - `counted.rs` — the pointer a handler entry is held by: its count
//!   shares the entry's header word with the flag.
//! - `mailbox.rs` — a stream subscription's bounded mailbox.
//! - `ordered_log.rs` — the messages a node's ordered handlers have yet to
//!   run, shared by them.
//! - `subset.rs` — the subscriptions of one trie node, appendable in place.
//! - `trie.rs` — the subscription trie: snapshot shape, one writer lock.
//! - `write_once.rs` — a set's slot: filled once by the writer, then read
//!   without a lock by readers the set's length tells of it.
//! - `route.rs` — the route cache: topic → the trie nodes it reaches.
//! - `quiesce.rs` — grace periods: when no runner can still be delivering
//!   to a removed subscription.
//!
//! # Readers never lock
//! A publish finds its subscribers without taking a lock and without
//! allocating on a route-cache hit: it reads the route cache (one slot
//! load), loads each matched node's current subscriber set (a lock-free
//! cell), and walks slots below a length it read with `Acquire`. Only
//! `subscribe` and `unsubscribe` take the trie's one writer lock.
//!
//! # Invariants (each `debug_assert`ed where it is maintained)
//! - A set's slots below its published length are filled and never change;
//!   only the writer appends, and only above that length (`subset.rs`).
//! - A set's `live` count equals its active entries, as counted under the
//!   writer lock (`trie.rs`: deactivation happens under the lock too).
//! - A route built at stamp `s` is complete while its topic's stamp is `s`:
//!   every change that could add to or empty a topic's route changes that
//!   topic's stamp after becoming visible (`trie.rs`, `route.rs`).
//! - No user code (a closure's `Drop`) runs under the writer lock: writers
//!   collect what they replace and drop it after unlocking (`trie.rs`).
//! - Once a subscription's flag is cleared, a grace period ends only after
//!   every runner that could have read it as active has left (`quiesce.rs`).
//!
//! Imports run one way: handles and the bus use the registry, dispatch
//! reads it, and the registry depends only on `topic`, `message`,
//! `handler` and `sync`. The entry knows nothing of the trie; a handle goes
//! back to the trie through [`Registry`].

pub(crate) mod counted;
pub(crate) mod entry;
pub(crate) mod mailbox;
pub(crate) mod ordered_log;
pub(crate) mod quiesce;
pub(crate) mod room;
pub(crate) mod route;
pub(crate) mod subset;
pub(crate) mod trie;
pub(crate) mod write_once;

use entry::EntryControl;

/// Which of a node's two subscriber sets an entry lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Handler subscriptions, sync and async.
    Handlers,
    /// Stream subscriptions.
    Streams,
    /// A hidden stream subscription: a bridge's export tap, which is not
    /// interest (see `trie::Interest`).
    #[cfg_attr(not(any(feature = "nats", feature = "mqtt")), allow(dead_code))]
    Tap,
}

/// What a user's handle can ask of the trie it subscribed in, without
/// knowing the bus's message type.
pub(crate) trait Registry: Send + Sync {
    /// Removes the entry (subscription `id`) subscribed under `filter`:
    /// clears its flag, then tidies the trie. False if it was already
    /// removed.
    fn remove(&self, filter: &str, kind: Kind, entry: &dyn EntryControl, id: u64) -> bool;
    /// Rebuilds `filter`'s set of `kind` without its dead entries, so they
    /// are released now rather than at the next compaction.
    fn compact(&self, filter: &str, kind: Kind);
}
