//! Stream deliveries: the publisher pushes a publish into every stream
//! mailbox its route reaches itself, in every delivery mode (a push runs no
//! user code and never blocks; design notes §2).
//!
//! # Contract
//! - Every active mailbox of the route gets the message once, in the
//!   route's order; a lossless one only if this publish holds room in it
//!   (its [`Reservations`]), so one that appeared after the reserve pass is
//!   skipped, not counted.
//! - Whatever a push drops (the oldest message, a refusal, a mailbox whose
//!   reader left during the push) is counted in `Stats::dropped`; a
//!   mailbox that closes on overflow (`Disconnect`) is counted as
//!   disconnected.
//! - An ordered subscription's push is a delivery in flight before it is
//!   queued (its drain may finish it at once on another thread); the
//!   publisher starts the drain of each one it claimed, after the pushes.

use std::sync::Arc;

use smallvec::SmallVec;

use super::{start_drains, Ordered};
use crate::message::Message;
use crate::registry::route::Route;
use crate::reserve::Reservations;
use crate::stats::{Counters, PublishGuard, Tally};

/// How many references to a message a publish takes at once, before it
/// pushes them into mailboxes (see `push_to_streams`). With 100 lossless
/// streams read by tasks that keep up, taking them one by one between pushes
/// cost 1.47-1.68x a drop-oldest publish's time, and a batch of 64
/// 1.19-1.34x (128: 1.12-1.20x; probe pairs, `docs/design-notes.md` §13,
/// fifteenth session).
const COPIES_AT_ONCE: usize = 64;

/// References to one message, waiting to be pushed.
type Copies<T> = SmallVec<[Arc<Message<T>>; COPIES_AT_ONCE]>;

/// Pushes `message` into every active mailbox of the route; returns how many
/// stream subscriptions matched.
pub(crate) fn push_to_streams<T: Send + Sync + 'static>(
    route: &Route<T>,
    message: &Arc<Message<T>>,
    counters: &Counters,
    admitted: &mut PublishGuard<'_>,
    reservations: &mut Reservations<T>,
) -> usize {
    let mut matched = 0;
    let mut dropped = 0;
    let mut claimed = SmallVec::new();
    // Deliveries counted in flight ahead of ordered pushes and not used yet:
    // counted a set's remainder at a time, not one by one (a shared atomic).
    let mut spare = 0u64;
    // The message's references for the pushes, taken a batch at a time
    // before any of them is pushed: a reader that has taken the message
    // drops its reference on the count's line while the publisher would be
    // adding the next one there, a contended read-modify-write per stream.
    let mut copies: Copies<T> = SmallVec::new();
    reservations.for_each_stream_set(route, |set, held| {
        let len = set.len();
        for (index, entry) in set.entries(len).enumerate() {
            if copies.is_empty() {
                let batch = (len - index).min(COPIES_AT_ONCE);
                copies.extend(std::iter::repeat_with(|| Arc::clone(message)).take(batch));
            }
            if !entry.is_active() || entry.sink.disconnected() {
                continue;
            }
            let reserved = entry.sink.is_lossless();
            if reserved && !held.take(index, entry) {
                // A lossless subscription this publish made no room in: it
                // appeared after the reservations (see `reserve.rs`).
                continue;
            }
            matched += 1;
            let ordered = entry.sink.has_consumer();
            if ordered {
                // In flight from before the push: its drain may finish it
                // at once, on another thread.
                if spare == 0 {
                    spare = (len - index) as u64;
                    admitted.extend(spare);
                }
                spare -= 1;
            }
            let copy = copies.pop().unwrap_or_else(|| Arc::clone(message));
            let pushed = entry.sink.push(copy, reserved);
            dropped += pushed.dropped;
            if ordered {
                if !pushed.queued {
                    spare += 1;
                } else if entry
                    .sink
                    .consumer()
                    .and_then(|consumer| consumer.downcast_ref::<Ordered<T>>())
                    .is_some_and(Ordered::claim)
                {
                    claimed.push(Arc::clone(entry));
                }
            }
            if pushed.disconnected {
                counters.disconnected();
            }
        }
        if spare > 0 {
            counters.add(&Tally {
                finished: spare,
                ..Tally::default()
            });
            spare = 0;
        }
    });
    if dropped > 0 {
        counters.dropped_now(dropped);
    }
    if !claimed.is_empty() {
        start_drains(claimed);
    }
    matched
}
