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
//!   two publishers never wait on each other in a cycle.
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

/// Room held in lossless mailboxes for one publish.
pub(crate) struct Reservations<T> {
    held: SmallVec<[(StreamEntry<T>, OwnedSemaphorePermit); 4]>,
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
        }
    }

    /// The room reserved in `entry`'s mailbox, if any; it is spent by the
    /// push it is handed to.
    #[inline]
    pub(crate) fn take(&mut self, entry: &StreamEntry<T>) -> Option<OwnedSemaphorePermit> {
        if self.held.is_empty() {
            return None;
        }
        let index = self
            .held
            .iter()
            .position(|(held, _)| Arc::ptr_eq(held, entry))?;
        Some(self.held.swap_remove(index).1)
    }
}

/// The active lossless mailboxes `route` reaches, by id.
fn lossless_targets<T>(route: &Route<T>) -> SmallVec<[StreamEntry<T>; 4]> {
    let mut targets: SmallVec<[StreamEntry<T>; 4]> = SmallVec::new();
    route.for_each_stream_set(|set| {
        for entry in set.entries(set.len()) {
            if entry.is_active() && entry.sink.room().is_some() {
                targets.push(Arc::clone(entry));
            }
        }
    });
    targets.sort_by_key(|entry: &StreamEntry<T>| entry.id());
    targets
}

/// Takes room in every lossless mailbox of `route` now, or none at all.
pub(crate) fn reserve_now<T>(route: &Route<T>) -> Result<Reservations<T>, NoRoom> {
    let mut reservations = Reservations::none();
    for entry in lossless_targets(route) {
        let room = Arc::clone(entry.sink.room().expect("a lossless target"));
        match room.try_acquire_owned() {
            Ok(permit) => reservations.held.push((entry, permit)),
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
    let targets = lossless_targets(route);
    let mut reservations = Reservations::none();
    for entry in targets {
        let room = Arc::clone(entry.sink.room().expect("a lossless target"));
        if let Ok(permit) = room.acquire_owned().await {
            reservations.held.push((entry, permit));
        }
    }
    reservations
}
