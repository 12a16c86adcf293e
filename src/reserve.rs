//! Reserve, then deliver: how a publish reaches lossless
//! ([`StreamOverflow::Backpressure`](crate::StreamOverflow::Backpressure))
//! mailboxes all or nothing.
//!
//! # Contract
//! - Before a publish delivers anything, it takes one slot of room in every
//!   active lossless mailbox its route reaches. `publish` tries once
//!   ([`reserve_now`]): if any is full, every slot taken is given back and
//!   the publish reaches no one (`Error::Full`). `publish_async` waits
//!   ([`reserve_waiting`]), mailbox by mailbox in the order of their ids, so
//!   two publishers never wait on each other in a cycle. (`publish` never
//!   waits, so it takes them in the route's order, which its push then
//!   consumes front to back.)
//! - A reservation is an owned semaphore permit: dropped (the publish failed,
//!   or its future was dropped while waiting) it gives the room back at once.
//!   Delivery after the last reservation is synchronous, so a cancelled
//!   `publish_async` has delivered nothing and holds nothing.
//! - Waiting publishers are served in order (tokio's semaphore is fair): a
//!   fast publisher cannot starve one that waits. A mailbox that closes (its
//!   receiver dropped, the bus closed) releases its waiters at once; they
//!   skip it.
//! - A lossless subscription that appears after the reservations were made
//!   did not exist for the whole publish, and is skipped (not counted).

use std::sync::Arc;

use smallvec::SmallVec;
use tokio::sync::{OwnedSemaphorePermit, TryAcquireError};

use crate::registry::entry::StreamEntry;
use crate::registry::route::Route;

/// Room held in lossless mailboxes for one publish, in the order it was
/// taken: the route's order (`publish`), or by id (`publish_async`).
pub(crate) struct Reservations<T> {
    held: SmallVec<[(StreamEntry<T>, Option<OwnedSemaphorePermit>); 4]>,
    /// Sorted by entry id (looked up by binary search) rather than in the
    /// route's order (consumed front to back as the push walks the route).
    by_id: bool,
    /// The next reservation in route order.
    cursor: usize,
}

/// A lossless mailbox had no room.
pub(crate) struct NoRoom {
    /// That mailbox's capacity.
    pub(crate) capacity: usize,
}

impl<T> Reservations<T> {
    /// No reservations (the route reaches no lossless mailbox).
    pub(crate) fn none() -> Self {
        Self {
            held: SmallVec::new(),
            by_id: false,
            cursor: 0,
        }
    }

    /// The room reserved in `entry`'s mailbox, if any; it is spent by the
    /// push it is handed to.
    #[inline]
    pub(crate) fn take(&mut self, entry: &StreamEntry<T>) -> Option<OwnedSemaphorePermit> {
        if self.held.is_empty() {
            return None;
        }
        let index = if self.by_id {
            self.held
                .binary_search_by_key(&entry.id(), |(held, _)| held.id())
                .ok()?
        } else {
            // The push walks the route in the order the reservations were
            // made: the next one is the one, unless the push skipped some
            // (they left meanwhile); then it is further on.
            let found = self.held[self.cursor..]
                .iter()
                .position(|(held, _)| Arc::ptr_eq(held, entry))?;
            self.cursor += found + 1;
            self.cursor - 1
        };
        self.held[index].1.take()
    }
}

/// The active lossless mailboxes `route` reaches, in the route's order.
fn lossless_targets<T>(route: &Route<T>) -> SmallVec<[StreamEntry<T>; 4]> {
    let mut targets: SmallVec<[StreamEntry<T>; 4]> = SmallVec::new();
    route.for_each_stream_set(|set| {
        for entry in set.entries(set.len()) {
            if entry.is_active() && entry.sink.room().is_some() {
                targets.push(Arc::clone(entry));
            }
        }
    });
    targets
}

/// Takes room in every lossless mailbox of `route` now, or none at all.
pub(crate) fn reserve_now<T>(route: &Route<T>) -> Result<Reservations<T>, NoRoom> {
    let mut reservations = Reservations::none();
    for entry in lossless_targets(route) {
        let room = Arc::clone(entry.sink.room().expect("a lossless target"));
        match room.try_acquire_owned() {
            Ok(permit) => reservations.held.push((entry, Some(permit))),
            // Closed: the receiver is gone or the bus closed; nothing to hold.
            Err(TryAcquireError::Closed) => {}
            Err(TryAcquireError::NoPermits) => {
                return Err(NoRoom {
                    capacity: entry.sink.capacity(),
                })
            }
        }
    }
    Ok(reservations)
}

/// Takes room in every lossless mailbox of `route`, waiting for it.
pub(crate) async fn reserve_waiting<T>(route: &Route<T>) -> Reservations<T> {
    let mut targets = lossless_targets(route);
    // By id: two publishers waiting never hold what the other waits for.
    targets.sort_by_key(|entry: &StreamEntry<T>| entry.id());
    let mut reservations = Reservations::none();
    reservations.by_id = true;
    for entry in targets {
        let room = Arc::clone(entry.sink.room().expect("a lossless target"));
        if let Ok(permit) = room.acquire_owned().await {
            reservations.held.push((entry, Some(permit)));
        }
    }
    reservations
}
