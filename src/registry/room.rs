//! [`Room`]: the free slots of a lossless mailbox, taken by publishers and
//! given back by its reader, with a queue of publishers waiting for one.
//!
//! # Contract
//! - [`Room::try_take`] takes a slot now if one is free **and nobody
//!   waits**: room goes to waiters first, so a publisher that does not wait
//!   never takes a slot a waiting one is owed. One compare-and-swap.
//! - [`Room::give_back`] frees a slot: it goes to the longest-waiting
//!   publisher if there is one (which is woken holding it), else it is
//!   counted free. One atomic add when nobody waits, which is the
//!   reader's common case: a mailbox read as fast as it is written never
//!   has a waiter. When some wait, the add counts the slot free first and
//!   the waiter lock then moves it to the first waiter: no take that skips
//!   the lock uses a free slot while anyone waits.
//! - [`Room::take`] waits in arrival order (first come, first served, so a
//!   fast publisher cannot starve a slower one). Cancel-safe: dropped while
//!   waiting it holds nothing; a slot handed to it that it did not collect
//!   goes on to the next waiter, or back to the free count.
//! - [`Room::close`] wakes every waiter (they get `false`) and makes
//!   [`Room::try_take`] report `Closed`. A slot already handed to a waiter
//!   stays with it.
//! - A waker belongs to the publisher's executor: none is cloned, woken or
//!   dropped while the waiter lock is held, and a slot given back while
//!   the thread holds a lock of the bus (a refused `publish_retained`
//!   giving back what it took under the retained store's lock) wakes its
//!   waiter only once that lock is let go ([`DeferWakes`]).
//!
//! It replaces tokio's semaphore, whose release takes its waiter lock even
//! when nobody waits: three read-modify-writes per message read instead of
//! one. The waiter lock is taken here only when somebody waits, and never
//! while a waker runs.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use smallvec::SmallVec;

use crate::sync::{AtomicUsize, Mutex, MutexGuard, Ordering};

/// `state` bit: closed.
const CLOSED: usize = 1;
/// `state` bit: some publisher waits (set and cleared under the waiter
/// lock). While set, [`Room::try_take`] takes nothing: a slot counted free
/// meanwhile is on its way to a waiter.
const WAITING: usize = 2;
/// One free slot in `state` (the count sits above the two flags).
const ONE: usize = 4;

#[cfg(not(loom))]
std::thread_local!(static DEFERRED: RefCell<Option<Vec<Waker>>> = const { RefCell::new(None) });
#[cfg(loom)]
loom::thread_local!(static DEFERRED: RefCell<Option<Vec<Waker>>> = RefCell::new(None));

/// While alive, the wakers a give-back on this thread would run are kept,
/// and run when the outermost one is dropped: made before a bus lock is
/// taken, dropped after it is let go.
pub(crate) struct DeferWakes {
    outermost: bool,
}

impl DeferWakes {
    pub(crate) fn begin() -> Self {
        let outermost = DEFERRED.with(|deferred| {
            let mut deferred = deferred.borrow_mut();
            let outermost = deferred.is_none();
            if outermost {
                *deferred = Some(Vec::new());
            }
            outermost
        });
        Self { outermost }
    }
}

impl Drop for DeferWakes {
    fn drop(&mut self) {
        if self.outermost {
            let wakers = DEFERRED.with(|deferred| deferred.borrow_mut().take());
            for waker in wakers.into_iter().flatten() {
                waker.wake();
            }
        }
    }
}

/// Wakes `waker` now, or once the thread's [`DeferWakes`] ends.
fn wake_unless_deferred(waker: Waker) {
    let now = DEFERRED.with(|deferred| match deferred.borrow_mut().as_mut() {
        Some(kept) => {
            kept.push(waker);
            None
        }
        None => Some(waker),
    });
    if let Some(waker) = now {
        waker.wake();
    }
}

/// What [`Room::try_take`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Take {
    Taken,
    /// No free slot, or publishers wait for one.
    Full,
    Closed,
}

/// `repr(C)`: the free count first, in the line a mailbox keeps hot.
#[repr(C)]
pub(crate) struct Room {
    /// Free slots times [`ONE`], plus the [`WAITING`] and [`CLOSED`] bits.
    state: AtomicUsize,
    waiters: Mutex<Waiters>,
}

#[derive(Default)]
struct Waiters {
    /// Waiting publishers in arrival order: their ticket and waker.
    queue: VecDeque<(u64, Waker)>,
    /// Tickets handed a slot, not yet collected by their waiter.
    granted: SmallVec<[u64; 2]>,
    next_ticket: u64,
}

impl Room {
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            state: AtomicUsize::new(slots * ONE),
            waiters: Mutex::new(Waiters::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Waiters> {
        // Nothing here panics while holding it; a poisoned lock still
        // holds consistent state.
        self.waiters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a free slot now, unless publishers wait for one.
    #[inline]
    pub(crate) fn try_take(&self) -> Take {
        let mut state = self.state.load(Ordering::Acquire);
        loop {
            if state & CLOSED != 0 {
                return Take::Closed;
            }
            if state & WAITING != 0 || state < ONE {
                return Take::Full;
            }
            match self.state.compare_exchange_weak(
                state,
                state - ONE,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Take::Taken,
                Err(now) => state = now,
            }
        }
    }

    /// A slot is free again: counted free in one step, then, if publishers
    /// were waiting, moved on to the first of them.
    #[inline]
    pub(crate) fn give_back(&self) {
        // One read-modify-write, not a load and a compare-and-swap: the
        // reader's common case, with nobody waiting.
        if self.state.fetch_add(ONE, Ordering::AcqRel) & WAITING == 0 {
            return;
        }
        let mut waiters = self.lock();
        let woken = self.pass_on_freed(&mut waiters);
        drop(waiters);
        if let Some(waker) = woken {
            wake_unless_deferred(waker);
        }
    }

    /// Under the waiter lock, after a give-back counted a slot free while
    /// publishers waited: takes a free slot back from the count for the
    /// first waiter (returns its waker). While any waits, `WAITING` is set
    /// and nobody takes a free slot without the lock, so the slot is still
    /// counted, unless the waiters all left meanwhile and a publisher took
    /// it then, which was its to take (a waiter queued since waits for the
    /// next one).
    fn pass_on_freed(&self, waiters: &mut Waiters) -> Option<Waker> {
        if waiters.queue.is_empty() {
            return None;
        }
        let mut now = self.state.load(Ordering::Acquire);
        loop {
            if now < ONE {
                return None;
            }
            match self.state.compare_exchange_weak(
                now,
                now - ONE,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(seen) => now = seen,
            }
        }
        self.grant_first(waiters)
    }

    /// Under the waiter lock: grants a slot (already taken off the count,
    /// or never on it) to the first waiter and returns its waker, to wake
    /// once the lock is released; `None` if nobody waits.
    fn grant_first(&self, waiters: &mut Waiters) -> Option<Waker> {
        let (ticket, waker) = waiters.queue.pop_front()?;
        waiters.granted.push(ticket);
        if waiters.queue.is_empty() {
            self.state.fetch_and(!WAITING, Ordering::AcqRel);
        }
        Some(waker)
    }

    /// Under the waiter lock: gives one slot to the first waiter (returns
    /// its waker, to wake once the lock is released), or counts it free.
    fn hand_over(&self, waiters: &mut Waiters) -> Option<Waker> {
        let woken = self.grant_first(waiters);
        if woken.is_none() {
            // Nobody waits any more: the slot is counted free.
            self.state.fetch_add(ONE, Ordering::AcqRel);
        }
        woken
    }

    /// Waits for a slot; `false` if the room closed instead. See the
    /// module docs for cancelling.
    pub(crate) fn take(&self) -> TakeSlot<'_> {
        TakeSlot {
            room: self,
            ticket: None,
        }
    }

    /// Wakes every waiter (they give up) and refuses every later take.
    pub(crate) fn close(&self) {
        self.state.fetch_or(CLOSED, Ordering::AcqRel);
        let queue = {
            let mut waiters = self.lock();
            self.state.fetch_and(!WAITING, Ordering::AcqRel);
            std::mem::take(&mut waiters.queue)
        };
        for (_, waker) in queue {
            waker.wake();
        }
    }

    /// Slots neither occupied nor reserved.
    #[cfg(all(test, loom))]
    pub(crate) fn free(&self) -> usize {
        self.state.load(Ordering::Acquire) / ONE
    }
}

/// The future of [`Room::take`].
pub(crate) struct TakeSlot<'a> {
    room: &'a Room,
    /// Set while it waits in the queue (or holds an uncollected slot).
    ticket: Option<u64>,
}

impl TakeSlot<'_> {
    /// First poll: takes a free slot if nobody waits, else joins the queue
    /// with `waker` (handed back when it did not join).
    fn arrive(&mut self, waiters: &mut Waiters, waker: Waker) -> (Poll<bool>, Option<Waker>) {
        let state = &self.room.state;
        let mut now = state.load(Ordering::Acquire);
        loop {
            if now & CLOSED != 0 {
                return (Poll::Ready(false), Some(waker));
            }
            let (next, taking) = if now & WAITING == 0 && now >= ONE {
                (now - ONE, true)
            } else {
                // Setting the flag in the same step as seeing no free slot:
                // a reader that frees one after this hands it to the queue.
                (now | WAITING, false)
            };
            match state.compare_exchange_weak(now, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) if taking => return (Poll::Ready(true), Some(waker)),
                Ok(_) => break,
                Err(seen) => now = seen,
            }
        }
        let ticket = waiters.next_ticket;
        waiters.next_ticket += 1;
        waiters.queue.push_back((ticket, waker));
        self.ticket = Some(ticket);
        (Poll::Pending, None)
    }

    /// Leaves the queue: whether it had been handed a slot, and its waker
    /// if it was still queued (for the caller to drop after unlocking).
    fn leave(&mut self, waiters: &mut Waiters) -> (bool, Option<Waker>) {
        let Some(ticket) = self.ticket.take() else {
            return (false, None);
        };
        if let Some(index) = waiters.granted.iter().position(|&t| t == ticket) {
            waiters.granted.swap_remove(index);
            return (true, None);
        }
        // Not queued any more if closing emptied the queue.
        let index = waiters.queue.iter().position(|&(t, _)| t == ticket);
        let left = index.and_then(|index| waiters.queue.remove(index));
        if left.is_some() && waiters.queue.is_empty() {
            self.room.state.fetch_and(!WAITING, Ordering::AcqRel);
        }
        (false, left.map(|(_, waker)| waker))
    }
}

impl Future for TakeSlot<'_> {
    type Output = bool;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<bool> {
        let this = self.get_mut();
        let room = this.room;
        // Cloned before locking; a waker left over is dropped after
        // unlocking (the `_left` bindings live past `drop(waiters)`).
        let waker = cx.waker().clone();
        let mut waiters = room.lock();
        let Some(ticket) = this.ticket else {
            let (poll, _left) = this.arrive(&mut waiters, waker);
            drop(waiters);
            return poll;
        };
        if waiters.granted.contains(&ticket) || room.state.load(Ordering::Acquire) & CLOSED != 0 {
            // Granted: collect it. Closed: give up (unless granted first).
            let (granted, _left) = this.leave(&mut waiters);
            drop(waiters);
            return Poll::Ready(granted);
        }
        let _left = match waiters.queue.iter_mut().find(|(t, _)| *t == ticket) {
            Some((_, queued)) => std::mem::replace(queued, waker),
            None => waker,
        };
        drop(waiters);
        Poll::Pending
    }
}

impl Drop for TakeSlot<'_> {
    fn drop(&mut self) {
        if self.ticket.is_none() {
            return;
        }
        let room = self.room;
        let mut waiters = room.lock();
        let (granted, _left) = self.leave(&mut waiters);
        // Handed a slot it never collected: on to the next waiter.
        let woken = if granted {
            room.hand_over(&mut waiters)
        } else {
            None
        };
        drop(waiters);
        if let Some(waker) = woken {
            waker.wake();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::future::Future;
    use std::pin::pin;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};

    use super::{Room, Take};

    /// Counts its wakes.
    struct Counting(AtomicUsize);

    impl Wake for Counting {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn waker() -> (Arc<Counting>, Waker) {
        let counting = Arc::new(Counting(AtomicUsize::new(0)));
        (Arc::clone(&counting), Waker::from(counting))
    }

    #[test]
    fn slots_are_taken_and_given_back_without_waiting() {
        let room = Room::new(2);
        assert_eq!(room.try_take(), Take::Taken);
        assert_eq!(room.try_take(), Take::Taken);
        assert_eq!(room.try_take(), Take::Full);
        room.give_back();
        assert_eq!(room.try_take(), Take::Taken);
        room.close();
        assert_eq!(room.try_take(), Take::Closed);
    }

    /// Room freed while publishers wait goes to them in arrival order, not
    /// to a publisher that comes without waiting.
    #[test]
    fn freed_room_goes_to_waiters_first_in_order() {
        let room = Room::new(1);
        assert_eq!(room.try_take(), Take::Taken);
        let (first_wakes, first_waker) = waker();
        let (_, second_waker) = waker();
        let mut first = pin!(room.take());
        let mut second = pin!(room.take());
        let mut cx1 = Context::from_waker(&first_waker);
        let mut cx2 = Context::from_waker(&second_waker);
        assert_eq!(first.as_mut().poll(&mut cx1), Poll::Pending);
        assert_eq!(second.as_mut().poll(&mut cx2), Poll::Pending);
        room.give_back();
        assert_eq!(
            first_wakes.0.load(Ordering::SeqCst),
            1,
            "the first is woken"
        );
        assert_eq!(room.try_take(), Take::Full, "a waiter is still owed room");
        assert_eq!(second.as_mut().poll(&mut cx2), Poll::Pending);
        assert_eq!(first.as_mut().poll(&mut cx1), Poll::Ready(true));
        room.give_back();
        assert_eq!(second.as_mut().poll(&mut cx2), Poll::Ready(true));
        room.give_back();
        assert_eq!(room.try_take(), Take::Taken, "nobody waits any more");
    }

    /// A slot given back while the thread defers wakes (it holds a bus
    /// lock) is handed to the waiter at once, but its waker runs only when
    /// the outermost deferral ends.
    #[test]
    fn a_deferred_give_back_wakes_after_the_deferral() {
        let room = Room::new(1);
        assert_eq!(room.try_take(), Take::Taken);
        let (wakes, waiter) = waker();
        let mut waiting = pin!(room.take());
        let mut cx = Context::from_waker(&waiter);
        assert_eq!(waiting.as_mut().poll(&mut cx), Poll::Pending);
        let outer = super::DeferWakes::begin();
        let inner = super::DeferWakes::begin();
        room.give_back();
        drop(inner);
        assert_eq!(wakes.0.load(Ordering::SeqCst), 0, "woken under the lock");
        drop(outer);
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1, "never woken");
        assert_eq!(waiting.as_mut().poll(&mut cx), Poll::Ready(true));
    }

    /// A waiter dropped after it was handed a slot passes the slot on.
    #[test]
    fn a_cancelled_waiter_passes_its_slot_on() {
        let room = Room::new(1);
        assert_eq!(room.try_take(), Take::Taken);
        let (_, w1) = waker();
        let (second_wakes, w2) = waker();
        let mut second = Box::pin(room.take());
        {
            let mut first = Box::pin(room.take());
            assert!(first
                .as_mut()
                .poll(&mut Context::from_waker(&w1))
                .is_pending());
            assert!(second
                .as_mut()
                .poll(&mut Context::from_waker(&w2))
                .is_pending());
            room.give_back();
        }
        assert_eq!(second_wakes.0.load(Ordering::SeqCst), 1);
        assert_eq!(
            second.as_mut().poll(&mut Context::from_waker(&w2)),
            Poll::Ready(true)
        );
        drop(second);
        room.give_back();
        assert_eq!(room.try_take(), Take::Taken, "the slot came back free");
    }

    /// A waiter dropped before room came leaves nothing behind.
    #[test]
    fn a_waiter_dropped_while_waiting_holds_nothing() {
        let room = Room::new(1);
        assert_eq!(room.try_take(), Take::Taken);
        let (_, w) = waker();
        let mut waiting = Box::pin(room.take());
        assert!(waiting
            .as_mut()
            .poll(&mut Context::from_waker(&w))
            .is_pending());
        drop(waiting);
        room.give_back();
        assert_eq!(room.try_take(), Take::Taken);
    }

    #[test]
    fn closing_releases_waiters_with_false() {
        let room = Room::new(1);
        assert_eq!(room.try_take(), Take::Taken);
        let (wakes, w) = waker();
        let mut waiting = Box::pin(room.take());
        let mut cx = Context::from_waker(&w);
        assert!(waiting.as_mut().poll(&mut cx).is_pending());
        room.close();
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
        assert_eq!(waiting.as_mut().poll(&mut cx), Poll::Ready(false));
    }
}
