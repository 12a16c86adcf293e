//! A stream subscription's mailbox: a bounded queue publishers push into and
//! one [`Receiver`](crate::Receiver) pops from.
//!
//! # Contract
//! - **Bounded, drop-oldest**: a push into a full mailbox displaces the
//!   oldest message and counts it in `lost` (a bridge's export tap counts
//!   only the messages it would have sent; see `Mailbox::owns`). A push never blocks and runs no
//!   user code, so publishers do it themselves, in publish order.
//! - **Closing** (the bus closed or dropped) refuses further pushes (each
//!   counted as lost); the reader still drains what is queued, then sees the
//!   end.
//! - **Nothing is lost uncounted** when the reader goes away; see below.
//!
//! # A `Disconnect` mailbox closed by a push
//! Only a `Disconnect` mailbox closes while publishers push (one push does
//! not fit): a push that found it open may land after the reader emptied
//! it and saw the end. So one atomic word, `pushes`, holds the closed mark
//! and the pushes in flight: a push counts itself in and reads the mark in
//! one step, and the reader reports the end only when it reads the mark
//! with no push in flight. A push counted in before the close finishes,
//! then (the last one out of a closed mailbox) wakes the reader, whose next
//! look takes what it queued; one counted in after finds the mark and is
//! refused, counted lost. One word needs no fence: its read-modify-writes
//! are ordered among themselves, and each releases what its push queued. The push that does not fit counts itself lost before it
//! closes the mailbox, so a reader that sees the end sees that loss too
//! (`Lagged` before `Disconnected`).
//!
//! # A receiver dropped during a push
//! A publisher checks `closed` before it pushes, so a push can land after
//! `Receiver::drop` has closed the mailbox and drained it. Closing cannot
//! cover that (and `Bus::close` closes mailboxes too, yet their readers keep
//! reading), so the mailbox has a second flag, `reader_gone`, set only by
//! the drop. The drop sets it, issues a `SeqCst` fence and drains; a
//! publisher pushes, issues a `SeqCst` fence and reads it. The two fences
//! are ordered one way or the other: either the publisher sees the flag and
//! drains the mailbox itself, or the drop's drain sees the message (or both,
//! and each pops different messages). Whoever pops a message counts it as
//! dropped, so each is counted once.

use std::any::Any;
use std::sync::Arc;
use std::task::{Context, Poll};

use super::quiesce::Running;
use super::room::{Room, Take};
use crate::message::Message;
use crate::stream_options::StreamOverflow;
use crate::sync::queue::ArrayQueue;
use crate::sync::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering, ReaderWaker};

/// The outcome of [`Mailbox::try_reserve`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reserve {
    /// One slot is now held for the caller.
    Taken,
    /// No room now.
    Full,
    /// Closed (its reader is gone, or the bus closed), or not lossless:
    /// nothing to hold, and nothing will be delivered to it.
    Closed,
}

/// Who takes messages out of a mailbox when it is not a [`Receiver`](crate::Receiver):
/// an ordered handler's drain (`dispatch/ordered.rs`). The registry only
/// keeps it; the publisher, which pushed, starts the drain.
pub(crate) type Consumer = Arc<dyn Any + Send + Sync>;

/// A stream subscription's bounded queue, with its overflow policy.
///
/// `repr(C)` keeps what the publisher and the reader both write for every
/// message (the room's free count) in the line after the queue's, and what
/// a push only reads (the reader's parked mark, written only when the
/// reader parks or is woken, the flags, the policy) after it:
/// a fan-out to many streams touches a few lines per mailbox, and every one
/// more is a cache miss per message once they outgrow the core's cache.
#[repr(C)]
pub(crate) struct Mailbox<T> {
    queue: ArrayQueue<Arc<Message<T>>>,
    /// `Backpressure` only: slots neither occupied nor reserved. A publisher
    /// takes a slot per mailbox before it delivers (reserve, then deliver);
    /// the slot is occupied when its message is queued and given back when
    /// the reader takes the message. Closing the room releases waiting
    /// publishers when the mailbox closes. It serves waiters in order, so
    /// no publisher starves another (see `room.rs`).
    room: Option<Room>,
    /// The reader's waker and parked mark: a push reads the mark, so it
    /// sits with the flags a push reads rather than on the room's line,
    /// which the reader writes for every message it takes.
    waker: ReaderWaker,
    /// No more pushes: the bus closed, or the reader is gone. A reader still
    /// drains what is queued.
    closed: AtomicBool,
    /// Set by the receiver's drop, before it drains: nobody will take from
    /// this mailbox again. See the module docs.
    reader_gone: AtomicBool,
    /// Set when a shared group's member leaves: its queue was handed over,
    /// and a push racing that is taken back by its own publisher and passed
    /// on, so the receiver's drop must not take it (and count it dropped).
    handed_over: AtomicBool,
    /// Set when a push did not fit under `Disconnect`.
    disconnected: AtomicBool,
    /// `Disconnect` only: [`CLOSED`] once closed, plus [`PUSH`] per push in
    /// flight (see the module docs).
    pushes: AtomicUsize,
    overflow: StreamOverflow,
    /// Retained publishes numbered this or lower were in the snapshot this
    /// mailbox was primed with (or older than it): a live copy of one is a
    /// duplicate and is skipped. 0 for a mailbox not primed.
    retained_after: u64,
    /// For an ordered handler: who drains the mailbox. `None` for a stream
    /// read through a `Receiver`.
    consumer: Option<Consumer>,
    /// An async ordered handler's calls in progress (its drain tracks each
    /// call), for `unsubscribe_and_wait`.
    running: Option<Arc<Running>>,
    /// Messages pushed out by newer ones, or refused because it was closed.
    lost: AtomicU64,
    /// A bridge's export tap only: which of the messages it drops count in
    /// `lost` (those the tap would have sent; see `bridge/export.rs`). Only
    /// a push that drops something reads it.
    owns: Option<Owns<T>>,
}

/// Which messages a mailbox's losses count (see `Mailbox::owns`).
pub(crate) type Owns<T> = Box<dyn Fn(&Message<T>) -> bool + Send + Sync>;

impl<T> Mailbox<T> {
    /// A drop-oldest mailbox of `capacity` messages.
    pub(crate) fn new(capacity: usize) -> Self {
        Self::with_overflow(capacity, StreamOverflow::DropOldest)
    }

    pub(crate) fn with_overflow(capacity: usize, overflow: StreamOverflow) -> Self {
        Self::with_consumer(capacity, overflow, None)
    }

    /// A mailbox drained by `consumer` rather than read by a receiver.
    pub(crate) fn with_consumer(
        capacity: usize,
        overflow: StreamOverflow,
        consumer: Option<Consumer>,
    ) -> Self {
        Self {
            consumer,
            overflow,
            room: (overflow == StreamOverflow::Backpressure).then(|| Room::new(capacity)),
            disconnected: AtomicBool::new(false),
            pushes: AtomicUsize::new(0),
            queue: ArrayQueue::new(capacity),
            waker: ReaderWaker::new(),
            lost: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            reader_gone: AtomicBool::new(false),
            handed_over: AtomicBool::new(false),
            retained_after: 0,
            running: None,
            owns: None,
        }
    }

    /// Counts in `lost` only the dropped messages `owns` accepts (a
    /// bridge's export tap: a message another tap sends is no loss).
    #[cfg_attr(not(any(feature = "nats", feature = "mqtt")), allow(dead_code))]
    pub(crate) fn owning(self, owns: Owns<T>) -> Self {
        Self {
            owns: Some(owns),
            ..self
        }
    }

    /// Counts `message`, which this mailbox dropped, in `lost`.
    fn lose(&self, message: &Message<T>) {
        if self.owns.as_ref().is_none_or(|owns| owns(message)) {
            // Release: a reader that sees the count also sees the push.
            self.lost.fetch_add(1, Ordering::Release);
        }
    }

    /// Reports `running` as its subscription's calls in progress.
    pub(crate) fn tracking(self, running: Arc<Running>) -> Self {
        Self {
            running: Some(running),
            ..self
        }
    }

    /// A mailbox primed with a retained snapshot taken at retained sequence
    /// number `after` (see `retained.rs`).
    /// What a push into a full mailbox does.
    pub(crate) fn overflow(&self) -> StreamOverflow {
        self.overflow
    }

    pub(crate) fn primed(capacity: usize, overflow: StreamOverflow, after: u64) -> Self {
        Self {
            retained_after: after,
            ..Self::with_overflow(capacity, overflow)
        }
    }

    /// The same mailbox, primed with a retained snapshot taken at retained
    /// number `after` (see [`Self::primed`]).
    pub(crate) fn after_snapshot(self, after: u64) -> Self {
        Self {
            retained_after: after,
            ..self
        }
    }

    /// Counts `n` messages as lost without pushing them (a snapshot larger
    /// than the mailbox keeps its newest messages).
    pub(crate) fn count_lost(&self, n: u64) {
        self.lost.fetch_add(n, Ordering::Release);
    }

    /// Pushes `message` under the mailbox's policy; returns how many
    /// messages this push dropped, for `Stats::dropped`: one if it was
    /// refused (closed, full under `DropNewest`, `Disconnect` or an
    /// unreserved `Backpressure` push) or pushed out the oldest, plus any it
    /// cleared out of a mailbox whose receiver was dropped meanwhile. Under
    /// `Backpressure`, `reserved` says this publish holds a slot of room
    /// (see [`Self::try_reserve`]): the push spends it, or gives it back if
    /// the message does not stay. A live copy of a retained message already
    /// in this mailbox's snapshot is skipped.
    pub(crate) fn push(&self, message: Arc<Message<T>>, reserved: bool) -> Pushed {
        debug_assert!(
            !reserved || self.overflow == StreamOverflow::Backpressure,
            "room reserved in a lossy mailbox"
        );
        let kept = self.push_kept(message, reserved);
        if reserved && !kept.queued {
            self.unreserve();
        }
        kept
    }

    fn push_kept(&self, message: Arc<Message<T>>, reserved: bool) -> Pushed {
        if message.seq() != 0 && message.seq() <= self.retained_after {
            // Already delivered, as part of this mailbox's retained snapshot.
            return Pushed {
                dropped: 0,
                disconnected: false,
                queued: false,
            };
        }
        if self.overflow != StreamOverflow::Disconnect {
            return self.push_open(message, reserved);
        }
        let pushed = if self.pushes.fetch_add(PUSH, Ordering::AcqRel) & CLOSED != 0 {
            self.refuse_closed(&message)
        } else {
            self.push_open(message, reserved)
        };
        if self.pushes.fetch_sub(PUSH, Ordering::AcqRel) == CLOSED | PUSH {
            // The last push out of a closed mailbox: the reader may be
            // waiting for it to see the end.
            self.waker.wake();
        }
        pushed
    }

    /// A push into a closed mailbox: refused, counted lost.
    fn refuse_closed(&self, message: &Message<T>) -> Pushed {
        self.lose(message);
        Pushed {
            dropped: 1,
            disconnected: false,
            queued: false,
        }
    }

    /// [`Self::push_kept`] of a message not in the snapshot.
    fn push_open(&self, message: Arc<Message<T>>, reserved: bool) -> Pushed {
        if self.closed.load(Ordering::Acquire) {
            return self.refuse_closed(&message);
        }
        let mut dropped = 0;
        let mut disconnected = false;
        let refused = match self.overflow {
            StreamOverflow::DropOldest => match self.queue.force_push(message) {
                Some(oldest) => {
                    self.lose(&oldest);
                    true
                }
                None => false,
            },
            StreamOverflow::DropNewest => self.queue.push(message).is_err(),
            StreamOverflow::Disconnect => {
                let refused = self.queue.push(message).is_err();
                if refused {
                    // Before the close: a reader that sees the end sees
                    // this loss (reported `Lagged` first).
                    self.lost.fetch_add(1, Ordering::Release);
                    if !self.disconnected.swap(true, Ordering::AcqRel) {
                        disconnected = true;
                        self.close();
                    }
                }
                refused
            }
            StreamOverflow::Backpressure => {
                // A reserved slot fits; it comes back when the reader takes
                // the message.
                let refused = !reserved || self.queue.push(message).is_err();
                debug_assert!(!reserved || !refused, "a reserved push found no room");
                refused
            }
        };
        if refused {
            if !matches!(
                self.overflow,
                StreamOverflow::DropOldest | StreamOverflow::Disconnect
            ) {
                // Release: a reader that sees the count also sees the push.
                self.lost.fetch_add(1, Ordering::Release);
            }
            dropped = 1;
        }
        // Pairs with the fence in `reader_dropped`: either that drain sees
        // this push, or this load sees the flag. It is also the fence the
        // reader's wake-up needs (see `ReaderWaker`).
        fence(Ordering::SeqCst);
        if self.reader_gone.load(Ordering::Relaxed) {
            dropped += self.drain();
        } else if self.consumer.is_none() {
            self.waker.wake_parked();
        }
        Pushed {
            dropped,
            disconnected,
            queued: !refused,
        }
    }

    /// Whether an ordered handler drains it (each queued message is then a
    /// delivery in flight until the handler has run).
    pub(crate) fn has_consumer(&self) -> bool {
        self.consumer.is_some()
    }

    /// The ordered handler's drain that empties this mailbox, if any.
    pub(crate) fn consumer(&self) -> Option<&Consumer> {
        self.consumer.as_ref()
    }

    /// An async ordered handler's calls in progress, if it is one's.
    pub(crate) fn running(&self) -> Option<Arc<Running>> {
        self.running.clone()
    }

    /// Whether publishers reserve room in it (`Backpressure`).
    pub(crate) fn is_lossless(&self) -> bool {
        self.room.is_some()
    }

    /// Room neither occupied nor reserved (`Backpressure` only).
    #[cfg(all(test, loom))]
    pub(crate) fn unreserved_room(&self) -> Option<usize> {
        self.room.as_ref().map(Room::free)
    }

    /// Takes one slot of room now, without waiting (`Backpressure` only).
    /// A slot taken must be spent by [`Self::push`] or given back with
    /// [`Self::unreserve`]. Never takes a slot a waiting publisher is owed:
    /// freed room goes to waiters first.
    pub(crate) fn try_reserve(&self) -> Reserve {
        let Some(room) = &self.room else {
            return Reserve::Closed;
        };
        match room.try_take() {
            Take::Taken => Reserve::Taken,
            Take::Full => Reserve::Full,
            Take::Closed => Reserve::Closed,
        }
    }

    /// Waits for one slot of room (`Backpressure` only); `false` if the
    /// mailbox closed instead. Cancel-safe: dropped while waiting, it has
    /// taken nothing. Waiters are served in order.
    pub(crate) async fn reserve(&self) -> bool {
        let Some(room) = &self.room else {
            return false;
        };
        // Ready with a slot in the same poll that the caller records it,
        // so there is no point where a cancel could lose it.
        room.take().await
    }

    /// Gives back a slot taken by [`Self::try_reserve`] or [`Self::reserve`]
    /// and not spent.
    pub(crate) fn unreserve(&self) {
        if let Some(room) = &self.room {
            room.give_back();
        }
    }

    /// Whether it closed because a message did not fit (`Disconnect`).
    pub(crate) fn disconnected(&self) -> bool {
        self.disconnected.load(Ordering::Acquire)
    }

    /// Takes one message, giving its reserved slot back.
    fn pop(&self) -> Option<Arc<Message<T>>> {
        let message = self.queue.pop()?;
        if let Some(room) = &self.room {
            room.give_back();
        }
        Some(message)
    }

    /// Messages this mailbox dropped.
    pub(crate) fn lost(&self) -> u64 {
        self.lost.load(Ordering::Acquire)
    }

    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        if self.overflow == StreamOverflow::Disconnect {
            self.pushes.fetch_or(CLOSED, Ordering::AcqRel);
        }
        if let Some(room) = &self.room {
            // Publishers waiting for room give up on this mailbox.
            room.close();
        }
        self.waker.wake();
    }

    /// The receiver is being dropped: flags the mailbox, closes it and
    /// empties it. Returns how many messages it took out (unread, so
    /// dropped); a push racing this counts what it finds itself.
    pub(crate) fn reader_dropped(&self) -> u64 {
        if self.handed_over.load(Ordering::Acquire) {
            // Its member left its group first and handed the queue over; a
            // message pushed since is its publisher's to pass on.
            self.close();
            return 0;
        }
        self.reader_gone.store(true, Ordering::Relaxed);
        self.close();
        // Pairs with the fence in `push`.
        fence(Ordering::SeqCst);
        self.drain()
    }

    /// A shared group member's push: as [`Self::push`], except that a
    /// message that cannot stay (the mailbox is closed, or its member left
    /// during the push) is put in `back` for another member instead of
    /// being dropped. Returns how many it dropped (the oldest, pushed out of
    /// a full mailbox).
    pub(crate) fn push_or_return(
        &self,
        message: Arc<Message<T>>,
        back: &mut Vec<Arc<Message<T>>>,
    ) -> u64 {
        if self.closed.load(Ordering::Acquire) {
            back.push(message);
            return 0;
        }
        let mut dropped = 0;
        if self.queue.force_push(message).is_some() {
            self.lost.fetch_add(1, Ordering::Release);
            dropped = 1;
        }
        // Pairs with the fence in `leaving`: either its drain sees this
        // push, or this load sees the flag (and whoever pops a message
        // passes it on).
        fence(Ordering::SeqCst);
        if self.reader_gone.load(Ordering::Acquire) {
            while let Some(message) = self.queue.pop() {
                back.push(message);
            }
            return dropped;
        }
        self.waker.wake_parked();
        dropped
    }

    /// A shared group's member is leaving (it has been taken out of its
    /// group's list first): no more pushes stay; what is queued is taken
    /// with [`Self::take`] and passed on.
    pub(crate) fn leaving(&self) {
        self.handed_over.store(true, Ordering::Release);
        self.reader_gone.store(true, Ordering::Release);
        self.closed.store(true, Ordering::Release);
        fence(Ordering::SeqCst);
    }

    /// Takes a queued message without registering a waker (a shared group's
    /// leaving member handing its queue over).
    pub(crate) fn take(&self) -> Option<Arc<Message<T>>> {
        self.queue.pop()
    }

    /// Pops everything queued; returns how many.
    fn drain(&self) -> u64 {
        let mut popped = 0;
        while self.pop().is_some() {
            popped += 1;
        }
        popped
    }

    pub(crate) fn poll_pop(&self, cx: &mut Context<'_>) -> Poll<Option<Arc<Message<T>>>> {
        if let Some(message) = self.pop() {
            self.waker.running();
            return Poll::Ready(Some(message));
        }
        self.waker.park(cx.waker());
        // Look again after parking: a push or close in between would
        // otherwise wake nobody.
        if let Some(message) = self.pop() {
            self.waker.running();
            return Poll::Ready(Some(message));
        }
        match self.end() {
            // A push that raced the close may have landed after our pop.
            End::Closed => Poll::Ready(self.pop()),
            // A push in flight wakes this reader as it ends.
            End::Open | End::Pushing => Poll::Pending,
        }
    }

    /// Whether the reader may see the end once it finds nothing queued.
    fn end(&self) -> End {
        if self.overflow == StreamOverflow::Disconnect {
            let pushes = self.pushes.load(Ordering::Acquire);
            if pushes & CLOSED == 0 {
                End::Open
            } else if pushes >= PUSH {
                End::Pushing
            } else {
                End::Closed
            }
        } else if self.closed.load(Ordering::Acquire) {
            End::Closed
        } else {
            End::Open
        }
    }

    /// A message if one is queued, without registering for a wake-up.
    pub(crate) fn try_pop(&self) -> Result<Arc<Message<T>>, Popped> {
        if let Some(message) = self.pop() {
            return Ok(message);
        }
        match self.end() {
            // A push that raced the close may have landed after our pop.
            End::Closed => self.pop().ok_or(Popped::Closed),
            End::Open | End::Pushing => Err(Popped::Empty),
        }
    }

    /// Messages waiting.
    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    pub(crate) fn capacity(&self) -> usize {
        self.queue.capacity()
    }
}

/// [`Mailbox::pushes`]: the closed mark.
const CLOSED: usize = 1;
/// [`Mailbox::pushes`]: one push in flight.
const PUSH: usize = 2;

/// What the reader finds after an empty pop ([`Mailbox::end`]).
enum End {
    Open,
    /// Closed, with a push in flight that may still queue a message.
    Pushing,
    Closed,
}

/// What one push did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pushed {
    /// Messages it dropped (see [`Mailbox::push`]).
    pub(crate) dropped: u64,
    /// It closed the mailbox under `Disconnect`.
    pub(crate) disconnected: bool,
    /// The message is in the mailbox now.
    pub(crate) queued: bool,
}

/// Why [`Mailbox::try_pop`] returned no message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Popped {
    /// Nothing queued; more may come.
    Empty,
    /// Nothing queued and nothing will come.
    Closed,
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::Arc;

    use super::Mailbox;
    use crate::message::Message;
    use crate::sync::{fence, Ordering};

    /// The room's free count (first in `Room`) is written by both sides for
    /// every lossless message; the reader's waker and parked mark only when
    /// it parks or is woken, though a push reads the mark every time. On one
    /// line, every give-back would take the mark's line from the publisher
    /// too.
    #[test]
    fn the_parked_mark_is_not_on_the_free_counts_line() {
        let mailbox =
            Mailbox::<u32>::with_overflow(8, crate::stream_options::StreamOverflow::Backpressure);
        let waker = std::ptr::from_ref(&mailbox.waker) as usize;
        let waker_end = waker + std::mem::size_of_val(&mailbox.waker) - 1;
        let room = mailbox.room.as_ref().expect("a lossless mailbox has room");
        let count = std::ptr::from_ref(room) as usize;
        assert_ne!(
            waker / 64,
            count / 64,
            "waker at {waker:#x}, count at {count:#x}"
        );
        assert_ne!(
            waker_end / 64,
            count / 64,
            "waker ends at {waker_end:#x}, count at {count:#x}"
        );
    }

    /// A shared member's receiver is dropped while a publisher's push is
    /// in flight: the member left (its queue handed over), then the push
    /// lands, then the receiver's drop runs, then the publisher looks
    /// again. The message is the publisher's to pass on: the drop neither
    /// takes it nor counts it dropped.
    #[test]
    fn a_push_racing_a_shared_members_leave_is_passed_on_not_dropped() {
        let mailbox = Mailbox::<u32>::new(8);
        mailbox.leaving();
        while mailbox.take().is_some() {}
        // The publisher passed the `closed` check before `leaving`, and
        // pushes now.
        assert!(mailbox
            .queue
            .force_push(Arc::new(Message::new("t", 7)))
            .is_none());
        assert_eq!(mailbox.reader_dropped(), 0, "nothing counted dropped");
        // The publisher's look after its push: the reader is gone, so it
        // takes its message back to pass it on.
        fence(Ordering::SeqCst);
        assert!(mailbox.reader_gone.load(Ordering::Acquire));
        let back = mailbox
            .take()
            .expect("the message is still there to pass on");
        assert_eq!(*back.data(), 7);
    }
}
