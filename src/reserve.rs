//! Reserve, then deliver: how a publish reaches lossless
//! ([`StreamOverflow::Backpressure`](crate::StreamOverflow::Backpressure))
//! mailboxes all or nothing.
//!
//! # Contract
//! - Before a publish delivers anything, it takes one slot of room in every
//!   active lossless mailbox its route reaches. It tries once, without
//!   waiting ([`reserve_now`]): if any is full, every slot taken is given
//!   back and the publish reaches no one (`publish` returns `Error::Full`).
//!   `publish_async` then waits ([`reserve_waiting`]) for each full one in
//!   turn, holding meanwhile only slots it waited for, in mailboxes of
//!   lower ids (so two publishers never wait on each other in a cycle, a
//!   waiter keeps its place in each queue, and it holds no room in a
//!   mailbox that had some), and publishes once it holds room everywhere.
//! - Room taken without waiting is spent by the same publish at once, so
//!   nothing records where: the reserve pass holds the stream sets it took
//!   room in (a set a subscribe replaces meanwhile stays as it was for this
//!   publish) and the push walks those same sets, in which the first
//!   entries, as many as the pass walked, are the ones it took room in
//!   (except any it found closed). No entry is cloned (a reference count
//!   contended with the reader per mailbox and publish), and nothing is
//!   allocated while room is taken in at most two of the route's sets.
//!   Room taken by waiting is held by [`Reservations`] with its entries:
//!   dropped (the publish failed, or the future was
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
use crate::registry::subset::StreamSet;
use crate::sync::CellGuard;

/// The lossless mailboxes a publish reaches.
type Targets<T> = SmallVec<[StreamEntry<T>; 4]>;

/// Room held in lossless mailboxes for one publish.
pub(crate) struct Reservations<T> {
    /// Taken without waiting, during the publish that spends them: the
    /// stream sets the reserve pass took room in, held so that the push
    /// walks the very same ones, in the order of the route's nodes. Nothing
    /// to give back when dropped: the push spent each slot, or skipped its
    /// subscription because it had left, and a mailbox nobody publishes to
    /// again has no use for room. Empty when nothing was taken.
    now: SmallVec<[HeldSet<T>; 2]>,
    /// Ids of the lossless mailboxes the pass found closed (no slot) in
    /// the sets of `now`.
    closed: SmallVec<[u64; 2]>,
    /// Taken by waiting, before the publish: the entries, sorted by id, each
    /// holding a slot until the push spends it (`true` while held). Dropped
    /// (the future was cancelled, the publish refused), it gives back what
    /// is held.
    waited: SmallVec<[(StreamEntry<T>, bool); 4]>,
}

/// A stream set the reserve pass took room in.
struct HeldSet<T> {
    /// The place of the set's node among the route's nodes.
    node: usize,
    set: CellGuard<StreamSet<T>>,
    /// How many of its entries the pass walked. Of those, every active
    /// lossless one holds a slot, except the ones found closed.
    walked: usize,
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
            closed: SmallVec::new(),
            waited: SmallVec::new(),
        }
    }

    /// Runs `f` on each stream set a publish with these reservations
    /// pushes to, with what it holds there: where the reserve pass took
    /// room without waiting, the set it walked (let go of afterwards,
    /// before any handler runs); elsewhere the node's current one. Called
    /// once, by the push.
    pub(crate) fn for_each_stream_set(
        &mut self,
        route: &Route<T>,
        mut f: impl FnMut(&StreamSet<T>, &mut Held<'_, T>),
    ) {
        let Self {
            now,
            closed,
            waited,
        } = self;
        let mut held = Held {
            walked: 0,
            closed,
            waited,
        };
        let now = std::mem::take(now);
        if now.is_empty() {
            route.for_each_stream_set(|set| f(set, &mut held));
            return;
        }
        let mut now = now.iter().peekable();
        for (number, node) in route.nodes().enumerate() {
            match now.next_if(|kept| kept.node == number) {
                Some(kept) => {
                    held.walked = kept.walked;
                    f(&kept.set, &mut held);
                }
                None if node.had_streams() => {
                    held.walked = 0;
                    node.with_streams(|set| f(set, &mut held));
                }
                None => {}
            }
        }
    }
}

/// The room a publish holds in one stream set's mailboxes (see
/// [`Reservations::for_each_stream_set`]).
pub(crate) struct Held<'a, T> {
    /// The set's entries the reserve pass walked (0 if it took nothing).
    walked: usize,
    closed: &'a [u64],
    waited: &'a mut SmallVec<[(StreamEntry<T>, bool); 4]>,
}

impl<T> Held<'_, T> {
    /// Whether this publish holds room in `entry`'s mailbox, the set's
    /// `index`th entry; if so, the slot passes to the push it is handed to,
    /// which spends it or gives it back.
    #[inline]
    pub(crate) fn take(&mut self, index: usize, entry: &StreamEntry<T>) -> bool {
        if !self.waited.is_empty() {
            return match self
                .waited
                .binary_search_by_key(&entry.id(), |(held, _)| held.id())
            {
                Ok(index) => std::mem::replace(&mut self.waited[index].1, false),
                Err(_) => false,
            };
        }
        // Walked by the reserve pass (an entry past that appeared since),
        // and not found closed there.
        index < self.walked && !self.closed.contains(&entry.id())
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

/// Calls `f` on each active lossless mailbox of `set` among its first
/// `len` entries.
fn for_each_lossless<T>(set: &StreamSet<T>, len: usize, f: impl FnMut(&StreamEntry<T>)) {
    set.entries(len)
        .filter(|entry| entry.is_active() && entry.sink.is_lossless())
        .for_each(f);
}

/// Takes room in every lossless mailbox of `route` now, or none at all. The
/// caller publishes at once, with the same route.
pub(crate) fn reserve_now<T>(route: &Route<T>) -> Result<Reservations<T>, NoRoom> {
    let mut reservations = Reservations::none();
    let mut full = None;
    for (number, node) in route.nodes().enumerate() {
        if !node.had_streams() {
            continue;
        }
        let set = node.stream_set();
        let len = set.len();
        let closed = reservations.closed.len();
        // Up to where the pass got: a full mailbox ends it.
        let mut walked = len;
        let mut taken = false;
        for (index, entry) in set.entries(len).enumerate() {
            if !entry.is_active() || !entry.sink.is_lossless() {
                continue;
            }
            match entry.sink.try_reserve() {
                Reserve::Taken => taken = true,
                // The receiver is gone or the bus closed; nothing to hold.
                Reserve::Closed => reservations.closed.push(entry.id()),
                Reserve::Full => {
                    full = Some(entry.sink.capacity());
                    walked = index;
                    break;
                }
            }
        }
        if taken {
            reservations.now.push(HeldSet {
                node: number,
                set,
                walked,
            });
        } else {
            // Nothing held here: the push walks the node's set as it
            // finds it then, and needs no list of closed ones.
            reservations.closed.truncate(closed);
        }
        if full.is_some() {
            break;
        }
    }
    let Some(capacity) = full else {
        return Ok(reservations);
    };
    // Give back what was taken: the same sets, up to the full mailbox (one
    // that left meanwhile has no use for its room).
    for kept in &reservations.now {
        for_each_lossless(&kept.set, kept.walked, |entry| {
            if !reservations.closed.contains(&entry.id()) {
                entry.sink.unreserve();
            }
        });
    }
    Err(NoRoom { capacity })
}

/// Takes room in every lossless mailbox of `route`, waiting for it where
/// there is none.
///
/// While it waits for a full mailbox it holds only slots it waited for, in
/// mailboxes of lower ids:
/// - a slot taken without waiting (the mailbox had room) is given back
///   before a wait and taken again after: held, it would hold back the
///   other topics' publishers to a mailbox that has room (one slot per
///   waiting publisher, its reader idle);
/// - a slot it waited for is kept (room a mailbox frees goes to its
///   waiters in order, and giving it back would send this publisher to
///   the back of that queue, where publishers to either mailbox alone can
///   keep it forever); only one of a higher id than the mailbox it is
///   about to wait for is given back, so that, as with locks taken in
///   order, two publishers never hold what the other waits for.
pub(crate) async fn reserve_waiting<T>(route: &Route<T>) -> Reservations<T> {
    let mut targets: Targets<T> = SmallVec::new();
    route.for_each_stream_set(|set| {
        for_each_lossless(set, set.len(), |entry| targets.push(Arc::clone(entry)));
    });
    targets.sort_by_key(|entry: &StreamEntry<T>| entry.id());
    let mut reservations = Reservations::none();
    // Every target, sorted by id as `Held::take` looks them up, none held
    // yet; a slot taken is held there (dropped, it is given back).
    reservations.waited = targets.into_iter().map(|entry| (entry, false)).collect();
    let mut how: SmallVec<[Slot; 4]> = SmallVec::from_elem(Slot::None, reservations.waited.len());
    'scan: loop {
        for i in 0..how.len() {
            if how[i] != Slot::None {
                continue;
            }
            // Without waiting where there is room: an await costs the
            // task's cooperative budget even when ready at once.
            match reservations.waited[i].0.sink.try_reserve() {
                Reserve::Taken => {
                    reservations.waited[i].1 = true;
                    how[i] = Slot::Taken;
                }
                Reserve::Closed => how[i] = Slot::Closed,
                Reserve::Full => {
                    for j in 0..how.len() {
                        let kept = how[j] == Slot::Waited && j < i;
                        if matches!(how[j], Slot::Taken | Slot::Waited) && !kept {
                            reservations.waited[j].0.sink.unreserve();
                            reservations.waited[j].1 = false;
                            how[j] = Slot::None;
                        }
                    }
                    let entry = Arc::clone(&reservations.waited[i].0);
                    // Ready with the slot in the poll that records it.
                    if entry.sink.reserve().await {
                        reservations.waited[i].1 = true;
                        how[i] = Slot::Waited;
                    } else {
                        how[i] = Slot::Closed;
                    }
                    continue 'scan;
                }
            }
        }
        return reservations;
    }
}

/// How [`reserve_waiting`] holds (or not) room in one mailbox.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Slot {
    None,
    /// Taken without waiting: given back before any wait.
    Taken,
    /// Taken by waiting for it: kept, unless a lower one must be waited
    /// for.
    Waited,
    /// The mailbox closed (its receiver gone): skipped.
    Closed,
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::Arc;

    use super::reserve_now;
    use crate::{Bus, DeliveryMode, Message, StreamOptions, StreamOverflow};

    /// Room is taken, then a second lossless stream subscribes to the same
    /// filter (its set grows) before the push: the push walks what the
    /// reserve pass walked, so the newcomer gets nothing and loses nothing,
    /// and the stream that was there gets the message in the room it holds.
    #[test]
    fn a_lossless_stream_subscribed_between_reserving_and_pushing_is_skipped() {
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::Inline)
            .build()
            .expect("bus");
        let lossless = StreamOptions::new(1).overflow(StreamOverflow::Backpressure);
        let mut first = bus.subscribe_stream_with("t", lossless).expect("subscribe");
        let route = bus.inner.routes.route(&bus.inner.trie, "t");
        let Ok(reservations) = reserve_now(&route) else {
            panic!("an empty mailbox has room");
        };
        let mut later = bus.subscribe_stream_with("t", lossless).expect("subscribe");
        let admitted = bus.admit("t").expect("admitted");
        let message = Arc::new(Message::new("t", 7));
        let Ok(reached) = bus.fan_out(admitted, "t", route, message, Some(reservations)) else {
            panic!("the publish held its room");
        };
        assert_eq!(reached, 1);
        assert_eq!(first.try_recv().map(|m| *m.data()).ok(), Some(7));
        assert!(later.try_recv().is_err(), "the newcomer got a message");
        assert_eq!(later.lost(), 0, "the newcomer counted a loss");
        // Both have their room: the next publish reaches both.
        assert_eq!(bus.publish("t", 8).ok(), Some(2));
        assert_eq!(first.try_recv().map(|m| *m.data()).ok(), Some(8));
        assert_eq!(later.try_recv().map(|m| *m.data()).ok(), Some(8));
    }
}
