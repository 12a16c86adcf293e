//! Reserve, then deliver: how a publish reaches lossless
//! ([`StreamOverflow::Backpressure`](crate::StreamOverflow::Backpressure))
//! mailboxes all or nothing.
//!
//! # Contract
//! - Before a publish delivers anything, it takes one slot of room in every
//!   active lossless mailbox its route reaches. `publish` tries once
//!   ([`reserve_now`]): if any is full, every slot taken is given back and
//!   the publish reaches no one (`Error::Full`). `publish_async` waits
//!   ([`reserve_waiting`]): first it tries once, as `publish` does; if some
//!   mailbox is full it gives everything back and takes them again mailbox
//!   by mailbox in the order of their ids, waiting, so two publishers never
//!   wait on each other in a cycle. (Taken without waiting, they are in the
//!   route's order, which the push then consumes front to back.)
//! - [`Reservations`] holds the room taken: dropped (the publish failed, or
//!   its future was dropped while waiting) it gives back whatever the push
//!   did not spend, at once. Trying first spares the common case (room
//!   everywhere) a sort and a suspension point per mailbox: an await that
//!   is ready at once still spends the task's cooperative budget.
//!   Delivery after the last reservation is synchronous, so a cancelled
//!   `publish_async` has delivered nothing and holds nothing.
//! - Waiting publishers are served in order (tokio's semaphore is fair): a
//!   fast publisher cannot starve one that waits: room a reader frees goes
//!   to the waiters first, so taking room without waiting never takes what
//!   a waiter is owed. A mailbox that closes (its
//!   receiver dropped, the bus closed) releases its waiters at once; they
//!   skip it.
//! - A lossless subscription that appears after the reservations were made
//!   did not exist for the whole publish, and is skipped (not counted).

use std::sync::Arc;

use smallvec::SmallVec;

use crate::registry::entry::StreamEntry;
use crate::registry::mailbox::Reserve;
use crate::registry::route::Route;

/// The lossless mailboxes a publish reaches.
type Targets<T> = SmallVec<[StreamEntry<T>; 4]>;

/// Room held in lossless mailboxes for one publish, in the order it was
/// taken: the route's order, or by id (after waiting). Each entry holds one
/// slot until the push spends it (`true` while held).
pub(crate) struct Reservations<T> {
    held: SmallVec<[(StreamEntry<T>, bool); 4]>,
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

    /// Whether this publish holds room in `entry`'s mailbox; if so, the
    /// slot passes to the push it is handed to, which spends it or gives it
    /// back.
    #[inline]
    pub(crate) fn take(&mut self, entry: &StreamEntry<T>) -> bool {
        if self.held.is_empty() {
            return false;
        }
        let index = if self.by_id {
            match self
                .held
                .binary_search_by_key(&entry.id(), |(held, _)| held.id())
            {
                Ok(index) => index,
                Err(_) => return false,
            }
        } else {
            // The push walks the route in the order the reservations were
            // made: the next one is the one, unless the push skipped some
            // (they left meanwhile); then it is further on.
            let Some(found) = self.held[self.cursor..]
                .iter()
                .position(|(held, _)| Arc::ptr_eq(held, entry))
            else {
                return false;
            };
            self.cursor += found + 1;
            self.cursor - 1
        };
        std::mem::replace(&mut self.held[index].1, false)
    }
}

impl<T> Drop for Reservations<T> {
    /// Gives back the room no push spent.
    fn drop(&mut self) {
        for (entry, held) in &self.held {
            if *held {
                entry.sink.unreserve();
            }
        }
    }
}

/// The active lossless mailboxes `route` reaches, in the route's order.
fn lossless_targets<T>(route: &Route<T>) -> Targets<T> {
    let mut targets: Targets<T> = SmallVec::new();
    route.for_each_stream_set(|set| {
        for entry in set.entries(set.len()) {
            if entry.is_active() && entry.sink.is_lossless() {
                targets.push(Arc::clone(entry));
            }
        }
    });
    targets
}

/// Takes room in every one of `targets` now, or none at all.
fn reserve_all_now<T>(targets: Targets<T>) -> Result<Reservations<T>, (NoRoom, Targets<T>)> {
    let mut reservations = Reservations::none();
    reservations.held.reserve(targets.len());
    let mut targets = targets.into_iter();
    while let Some(entry) = targets.next() {
        match entry.sink.try_reserve() {
            Reserve::Taken => reservations.held.push((entry, true)),
            // The receiver is gone or the bus closed; nothing to hold.
            Reserve::Closed => {}
            Reserve::Full => {
                let capacity = entry.sink.capacity();
                // Everything taken goes back (`Drop`); the targets with it.
                let mut all: Targets<T> = reservations
                    .held
                    .iter()
                    .map(|(entry, _)| Arc::clone(entry))
                    .collect();
                all.push(entry);
                all.extend(targets);
                return Err((NoRoom { capacity }, all));
            }
        }
    }
    Ok(reservations)
}

/// Takes room in every lossless mailbox of `route` now, or none at all.
pub(crate) fn reserve_now<T>(route: &Route<T>) -> Result<Reservations<T>, NoRoom> {
    reserve_all_now(lossless_targets(route)).map_err(|(full, _)| full)
}

/// Takes room in every lossless mailbox of `route`, waiting for it.
pub(crate) async fn reserve_waiting<T>(route: &Route<T>) -> Reservations<T> {
    let mut targets = match reserve_all_now(lossless_targets(route)) {
        Ok(reservations) => return reservations,
        Err((_, targets)) => targets,
    };
    // By id: two publishers waiting never hold what the other waits for.
    targets.sort_by_key(|entry: &StreamEntry<T>| entry.id());
    let mut reservations = Reservations::none();
    reservations.by_id = true;
    for entry in targets {
        if entry.sink.reserve().await {
            reservations.held.push((entry, true));
        }
    }
    reservations
}
