//! Reserve, then deliver: how a publish reaches lossless
//! ([`StreamOverflow::Backpressure`](crate::StreamOverflow::Backpressure))
//! mailboxes all or nothing.
//!
//! # Contract
//! - Before a publish delivers anything, it takes one slot of room in every
//!   active lossless mailbox its route reaches. It tries once, without
//!   waiting ([`reserve_now`]): if any is full, every slot taken is given
//!   back and the publish reaches no one (`publish` returns `Error::Full`).
//!   `publish_async` then waits ([`reserve_waiting`]), mailbox by mailbox
//!   in the order of their ids, so two publishers never wait on each other
//!   in a cycle, and publishes with the room it holds.
//! - Room taken without waiting is spent by the same publish at once, so it
//!   is recorded as ids in the route's order, which the push walks again
//!   (no entry is cloned: a reference count contended with the reader per
//!   mailbox and publish). Room taken by waiting is held by [`Reservations`]
//!   with its entries: dropped (the publish failed, or the future was
//!   dropped while waiting) it gives back whatever the push did not spend,
//!   at once. Delivery after the last reservation is synchronous, so a
//!   cancelled `publish_async` has delivered nothing and holds nothing.
//! - Waiting publishers are served in order (see `registry/room.rs`):
//!   room a reader frees goes to the waiters first, so a publisher that
//!   takes room without waiting never takes what a waiter is owed, and a
//!   fast publisher cannot starve one that waits. A mailbox that closes (its
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

/// Room held in lossless mailboxes for one publish.
pub(crate) struct Reservations<T> {
    /// Taken without waiting, during the publish that spends them: the ids
    /// of the entries, in the route's order (the push walks the route in the
    /// same order). Nothing to give back when dropped: the push spent each
    /// one, or skipped its subscription because it had left, and a mailbox
    /// nobody publishes to again has no use for room.
    now: SmallVec<[u64; 8]>,
    /// Taken by waiting, before the publish: the entries, sorted by id, each
    /// holding a slot until the push spends it (`true` while held). Dropped
    /// (the future was cancelled, the publish refused), it gives back what
    /// is held.
    waited: SmallVec<[(StreamEntry<T>, bool); 4]>,
    /// The next of `now` in route order.
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
            now: SmallVec::new(),
            waited: SmallVec::new(),
            cursor: 0,
        }
    }

    /// Whether this publish holds room in `entry`'s mailbox; if so, the
    /// slot passes to the push it is handed to, which spends it or gives it
    /// back.
    #[inline]
    pub(crate) fn take(&mut self, entry: &StreamEntry<T>) -> bool {
        if !self.waited.is_empty() {
            return match self
                .waited
                .binary_search_by_key(&entry.id(), |(held, _)| held.id())
            {
                Ok(index) => std::mem::replace(&mut self.waited[index].1, false),
                Err(_) => false,
            };
        }
        // The push walks the route in the order the reservations were made:
        // the next one is the one, unless the push skipped some (they left
        // meanwhile); then it is further on.
        match self.now[self.cursor..]
            .iter()
            .position(|&id| id == entry.id())
        {
            Some(found) => {
                self.cursor += found + 1;
                true
            }
            None => false,
        }
    }
}

impl<T> Drop for Reservations<T> {
    /// Gives back the room taken by waiting that no push spent.
    fn drop(&mut self) {
        for (entry, held) in &self.waited {
            if *held {
                entry.sink.unreserve();
            }
        }
    }
}

/// Calls `f` on each active lossless mailbox of `route`, in the route's order.
fn for_each_lossless<T>(route: &Route<T>, mut f: impl FnMut(&StreamEntry<T>)) {
    route.for_each_stream_set(|set| {
        for entry in set.entries(set.len()) {
            if entry.is_active() && entry.sink.is_lossless() {
                f(entry);
            }
        }
    });
}

/// Takes room in every lossless mailbox of `route` now, or none at all. The
/// caller publishes at once, with the same route.
pub(crate) fn reserve_now<T>(route: &Route<T>) -> Result<Reservations<T>, NoRoom> {
    let mut reservations = Reservations::none();
    // Sized once for every stream of the route: a fan-out to more lossless
    // streams than fit inline then allocates once per publish, not once
    // per doubling (four times for a hundred).
    let mut streams = 0;
    route.for_each_stream_set(|set| streams += set.len());
    if streams > reservations.now.inline_size() {
        reservations.now.reserve_exact(streams);
    }
    let mut full = None;
    for_each_lossless(route, |entry| {
        if full.is_some() {
            return;
        }
        match entry.sink.try_reserve() {
            Reserve::Taken => reservations.now.push(entry.id()),
            // The receiver is gone or the bus closed; nothing to hold.
            Reserve::Closed => {}
            Reserve::Full => full = Some(entry.sink.capacity()),
        }
    });
    let Some(capacity) = full else {
        return Ok(reservations);
    };
    // Give back what was taken: the same walk finds the same entries, in
    // order (one that left meanwhile has no use for its room).
    for_each_lossless(route, |entry| {
        if reservations.take(entry) {
            entry.sink.unreserve();
        }
    });
    Err(NoRoom { capacity })
}

/// Takes room in every lossless mailbox of `route`, waiting for it, mailbox
/// by mailbox in the order of their ids.
pub(crate) async fn reserve_waiting<T>(route: &Route<T>) -> Reservations<T> {
    let mut targets: Targets<T> = SmallVec::new();
    for_each_lossless(route, |entry| targets.push(Arc::clone(entry)));
    // By id: two publishers waiting never hold what the other waits for.
    targets.sort_by_key(|entry: &StreamEntry<T>| entry.id());
    let mut reservations = Reservations::none();
    for entry in targets {
        // Without waiting where there is room: an await costs the task's
        // cooperative budget even when ready at once.
        let taken = match entry.sink.try_reserve() {
            Reserve::Taken => true,
            Reserve::Closed => false,
            Reserve::Full => entry.sink.reserve().await,
        };
        if taken {
            reservations.waited.push((entry, true));
        }
    }
    reservations
}
