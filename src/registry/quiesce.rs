//! Knowing when a removed subscription's handler can no longer be running:
//! what [`Subscription::unsubscribe_and_wait`](crate::Subscription::unsubscribe_and_wait)
//! waits for.
//!
//! # Contract
//! - **Runners announce themselves, per run, not per delivery.** Every
//!   runner brackets its claiming loop with [`Quiescence::enter`] (one atomic
//!   add on a per-thread shard, then a fence) and the guard's drop. Deliveries
//!   check their subscription's flag *inside* that bracket.
//! - **A grace period** ([`Quiescence::wait_for_readers`]), started after a
//!   subscription's flag was cleared, ends once every runner that entered
//!   before it started has left. A runner entering later is ordered after the
//!   flag was cleared (both sides use sequentially consistent operations:
//!   the waiter clears the flag, then flips the epoch and reads the counts; a
//!   runner adds to its count, fences, then reads flags), so it sees the
//!   subscription inactive and never calls its handler. This is read-copy-
//!   update's grace period with two epochs, as in SRCU: runners count
//!   themselves under the current epoch's parity, a waiter first lets the
//!   other parity drain (only non-empty if an earlier wait was cancelled),
//!   flips the epoch, and lets the old parity drain.
//! - **A long run renews its presence** ([`Quiescence::renew_if_outermost`]):
//!   a sync ordered handler's runner, which catches up for as long as
//!   publishers keep adding, counts itself under the current epoch again
//!   between rounds (entering anew, then leaving the old count), so a grace
//!   period does not wait for it to catch up. Only between calls (each
//!   checks its flag after the renewal) and only a thread's outermost
//!   presence of the bus: a nested one runs inside a handler's call (its
//!   publish), which the grace period must outlast.
//! - **Runners on the waiting thread's own stack are not waited for**: they
//!   sit below the wait in the call stack and cannot leave before it ends (a
//!   handler blocking on its own unsubscribe). Each thread counts the runners
//!   it is inside of, per bus: a handler of one bus waiting on another's
//!   subscription is not one of the other bus's runners, and is waited for
//!   like any.
//! - **Async deliveries** outlive their runner; each async subscription
//!   counts its unfinished deliveries in a [`Running`], and waiting for it
//!   likewise skips the deliveries being polled on the waiting thread (an
//!   async handler awaiting its own unsubscribe).
//!
//! Waiters are served one at a time; a wait is cancel-safe (dropping it
//! leaves nothing held).

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Weak};

use crossbeam_utils::CachePadded;
use tokio::sync::Notify;

use crate::sync::{fence, AtomicUsize, Ordering};

/// Per-parity counters, spread over shards so runners on different threads
/// do not share a cache line.
const SHARDS: usize = 8;

thread_local! {
    /// This thread's shard.
    static SHARD: usize = {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % SHARDS
    };
}

// What this thread's stack holds: per loom thread in loom builds (loom runs
// all its threads on one OS thread), so the models see a waiter's own
// counts and no other thread's.
//
// - `OWN`: per bus (by [`Quiescence`] id), the runners of that bus this
//   thread is inside of, per parity, and the deliveries in flight that the
//   runners and async deliveries on this thread's stack hold: a `close`
//   called from a handler does not wait for them (they cannot finish before
//   it returns). Per bus, because a handler of one bus may wait on another:
//   its runner is not the other bus's. An entry goes once all zero if the
//   list is longer than a few, so it holds the buses this stack is in now
//   and the last few it was (rarely more than one).
// - `POLLING`: the async deliveries this thread is polling now (their
//   [`Running`] counters, by address, and their bus), innermost last.
// - `IN_PLACE`: one more than the `POLLING` depth at which this thread is
//   finishing a pending delivery in place (see [`finishing_in_place`]), 0
//   if none: the delivery polled at that depth is the one being finished.
#[cfg(not(loom))]
std::thread_local! {
    static OWN: RefCell<Vec<Own>> = const { RefCell::new(Vec::new()) };
    static POLLING: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
    static IN_PLACE: Cell<usize> = const { Cell::new(0) };
}
#[cfg(loom)]
loom::thread_local! {
    static OWN: RefCell<Vec<Own>> = RefCell::new(Vec::new());
    static POLLING: RefCell<Vec<Frame>> = RefCell::new(Vec::new());
    static IN_PLACE: Cell<usize> = Cell::new(0);
}

/// What this thread's stack holds of one bus (see `OWN`).
#[derive(Clone, Copy, Default)]
struct Own {
    bus: u64,
    inside: [usize; 2],
    held: u64,
}

/// Changes this thread's record of bus `bus`.
#[inline]
fn change_own(bus: u64, change: impl FnOnce(&mut Own)) {
    OWN.with(|own| {
        let mut own = own.borrow_mut();
        let index = match own.iter().position(|o| o.bus == bus) {
            Some(index) => index,
            None => {
                own.push(Own {
                    bus,
                    ..Own::default()
                });
                own.len() - 1
            }
        };
        change(&mut own[index]);
        // A bus's record stays while it is all zeros (a runner enters and
        // leaves for every run: no need to take it out and put it back each
        // time), until the thread has met more buses than a short list
        // holds.
        let o = own[index];
        if o.inside == [0, 0] && o.held == 0 && own.len() > KEPT_RECORDS {
            own.swap_remove(index);
        }
    });
}

/// Idle bus records a thread keeps (see [`change_own`]).
const KEPT_RECORDS: usize = 4;

/// This thread's record of bus `bus`.
#[inline]
fn own(bus: u64) -> Own {
    OWN.with(|own| {
        own.borrow()
            .iter()
            .find(|o| o.bus == bus)
            .copied()
            .unwrap_or_default()
    })
}

/// One async delivery being polled on this thread.
struct Frame {
    /// Its subscription's [`Running`], by address.
    key: usize,
    /// Its bus's [`Quiescence::id`].
    bus: u64,
    /// Set when this poll returns, for a `close` called inside it or in
    /// an earlier poll of the same delivery (see [`caller_here`]); made
    /// only by such a call. Never set for a delivery being finished in
    /// place, and cleared when one starts to be: its poll returning does
    /// not let the stack below it go on.
    ended: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// Whether this delivery is being finished in place (see
    /// [`finishing_in_place`]).
    in_place: bool,
    /// For an ordered handler's call: what is queued behind it.
    behind: Option<Weak<dyn QueuedBehind>>,
}

/// What a `close` called on this thread must not wait for: its caller.
/// Computed when it is called, before it first waits.
pub(crate) struct Caller {
    /// The bus's deliveries this thread's stack holds (runners' claims,
    /// async deliveries being polled).
    held: u64,
    /// If called while an async delivery is being polled (the innermost):
    /// that poll's end, and whether the delivery is of this bus.
    poll: Option<(Arc<std::sync::atomic::AtomicBool>, bool)>,
    /// If that delivery is an ordered handler's call of this bus: the
    /// messages queued behind it, which cannot run before it returns.
    behind: Option<Weak<dyn QueuedBehind>>,
}

impl Caller {
    /// Whether there is anything of the caller's not to wait for.
    pub(crate) fn holds_any(&self) -> bool {
        self.held > 0 || self.poll.as_ref().is_some_and(|(_, same_bus)| *same_bus)
    }

    /// The publish tokens and deliveries not to wait for, now, given the
    /// `tokens` the stack held when `close` was called. While the poll it
    /// was called in is still running, that is everything the stack holds:
    /// the close blocks it (a handler blocking on it), so none of that can
    /// finish first. Once that poll has returned, the close is awaited by
    /// that delivery's future, and only that delivery cannot finish first:
    /// the runner that polled it went on, and its other deliveries, like the
    /// publish it ran in, are waited for like any. Either way, if that
    /// delivery is an ordered handler's call, what is queued behind it in
    /// its mailbox waits for it (and runs after `close` has returned).
    pub(crate) fn own_now(&self, tokens: u64) -> (u64, u64) {
        let behind = self
            .behind
            .as_ref()
            .and_then(Weak::upgrade)
            .map_or(0, |mailbox| mailbox.queued());
        match &self.poll {
            Some((ended, same_bus)) if ended.load(std::sync::atomic::Ordering::SeqCst) => {
                (0, u64::from(*same_bus) + behind)
            }
            _ => (tokens, self.held + behind),
        }
    }
}

/// What a `close` of `quiescence`'s bus called here must not wait for.
pub(crate) fn caller_here(quiescence: &Quiescence) -> Caller {
    let held = held_here(quiescence);
    let mut behind = None;
    let poll = POLLING.with(|polling| {
        polling.borrow_mut().last_mut().map(|frame| {
            let ended = frame.ended.get_or_insert_with(Arc::default);
            let same_bus = frame.bus == quiescence.id;
            if same_bus {
                behind = frame.behind.clone();
            }
            (Arc::clone(ended), same_bus)
        })
    });
    Caller { held, poll, behind }
}

/// Runners of `quiescence`'s bus on this thread now hold `n` more
/// deliveries (see [`held_here`]).
#[inline]
pub(crate) fn hold(quiescence: &Quiescence, n: u64) {
    change_own(quiescence.id, |own| own.held += n);
}

/// Runners of `quiescence`'s bus on this thread no longer hold `n`
/// deliveries.
#[inline]
pub(crate) fn unhold(quiescence: &Quiescence, n: u64) {
    change_own(quiescence.id, |own| own.held = own.held.saturating_sub(n));
}

/// `n` deliveries held by this thread's stack (see [`held_here`]) until
/// dropped, even by a panic.
pub(crate) struct HeldHere<'a>(&'a Quiescence, u64);

impl<'a> HeldHere<'a> {
    pub(crate) fn new(quiescence: &'a Quiescence, n: u64) -> Self {
        hold(quiescence, n);
        Self(quiescence, n)
    }
}

impl Drop for HeldHere<'_> {
    fn drop(&mut self) {
        unhold(self.0, self.1);
    }
}

/// Runs `finish`, which drives a pending delivery's future to its end on
/// this thread, blocking it (at the task cap, where the delivery's runner
/// finishes it itself). A `close` awaited in that delivery then never
/// waits for what this thread's stack holds, even between polls: the stack
/// below (the rest of the run, the publish it serves) cannot go on before
/// the future is finished, which needs the `close` to return.
pub(crate) fn finishing_in_place<R>(finish: impl FnOnce() -> R) -> R {
    /// Puts back the outer in-place depth, even if `finish` panics.
    struct Restore(usize);
    impl Drop for Restore {
        fn drop(&mut self) {
            IN_PLACE.with(|depth| depth.set(self.0));
        }
    }
    let depth = POLLING.with(|polling| polling.borrow().len());
    let _restore = Restore(IN_PLACE.with(|here| here.replace(depth + 1)));
    finish()
}

/// Whether this thread is inside [`finishing_in_place`], blocked on a
/// pending delivery's future (of any bus): it cannot block on another (a
/// runtime's `block_on` does not nest).
pub(crate) fn finishing_in_place_here() -> bool {
    IN_PLACE.with(Cell::get) > 0
}

/// In-flight deliveries of `quiescence`'s bus held by the call stack of
/// this thread: what a `close` called from inside a handler must not wait
/// for.
pub(crate) fn held_here(quiescence: &Quiescence) -> u64 {
    own(quiescence.id).held
}

/// Whether this thread's stack holds deliveries of any bus (a handler's
/// thread: it must not wait for a lane it may be serving).
pub(crate) fn held_by_any_bus_here() -> bool {
    OWN.with(|own| own.borrow().iter().any(|o| o.held > 0))
}

/// The bus's record of which runners are delivering.
pub(crate) struct Quiescence {
    /// Unique per bus: this thread's counts are kept per bus under it.
    id: u64,
    epoch: AtomicUsize,
    /// `2 * SHARDS` counters: parity 0's shards, then parity 1's.
    active: Box<[CachePadded<AtomicUsize>]>,
    /// Waiters in progress: runners notify on leaving only when there are.
    waiting: AtomicUsize,
    left: Notify,
    turn: tokio::sync::Mutex<()>,
}

/// A runner's presence; leaving is dropping it.
pub(crate) struct Presence<'a> {
    quiescence: &'a Quiescence,
    parity: usize,
    counter: usize,
    /// Not `Send`: it is counted in its thread's record (`OWN`), and
    /// [`Quiescence::renew_if_outermost`] relies on a thread's presences
    /// ending in the reverse order they began.
    _thread_bound: std::marker::PhantomData<*const ()>,
}

impl Quiescence {
    pub(crate) fn new() -> Self {
        // Not a loom atomic: a name, not part of any protocol.
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Self {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            epoch: AtomicUsize::new(0),
            active: (0..2 * SHARDS)
                .map(|_| CachePadded::new(AtomicUsize::new(0)))
                .collect(),
            waiting: AtomicUsize::new(0),
            left: Notify::new(),
            turn: tokio::sync::Mutex::new(()),
        }
    }

    /// Announces a runner about to check flags and call handlers.
    #[inline]
    pub(crate) fn enter(&self) -> Presence<'_> {
        let parity = self.epoch.load(Ordering::SeqCst) & 1;
        let counter = parity * SHARDS + SHARD.with(|shard| *shard);
        self.active[counter].fetch_add(1, Ordering::SeqCst);
        // Orders the flag loads of this run after the count is visible.
        fence(Ordering::SeqCst);
        change_own(self.id, |own| own.inside[parity] += 1);
        Presence {
            quiescence: self,
            parity,
            counter,
            _thread_bound: std::marker::PhantomData,
        }
    }

    /// Renews this thread's presence as if it left and entered again, when
    /// it is the thread's only one of this bus and a waiter has flipped the
    /// epoch since it entered: a grace period in progress then stops
    /// waiting for it. For a runner that may go on for long (an ordered
    /// handler's runner catching up while publishers keep adding), called
    /// between its rounds, where it has no flag checked that a call still
    /// depends on: each call after it checks its flag again, ordered after
    /// the renewed count as after [`Self::enter`]. A presence nested in
    /// another of this bus is not renewed: the outer one may be inside a
    /// handler's call (the inner run is that handler's publish), which the
    /// grace period must outlast.
    pub(crate) fn renew_if_outermost(&self) {
        let own = own(self.id);
        let old = match own.inside {
            [1, 0] => 0,
            [0, 1] => 1,
            _ => return,
        };
        let parity = self.epoch.load(Ordering::SeqCst) & 1;
        if parity == old {
            return;
        }
        let shard = SHARD.with(|shard| *shard);
        // Entered anew first, as `enter` does, then the old count goes, as
        // `Presence::drop` does: the thread is counted throughout.
        self.active[parity * SHARDS + shard].fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        change_own(self.id, |own| {
            own.inside[parity] += 1;
            own.inside[old] -= 1;
        });
        self.active[old * SHARDS + shard].fetch_sub(1, Ordering::SeqCst);
        #[cfg(loom)]
        fence(Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.left.notify_waiters();
        }
    }

    /// This bus's identity, for a [`Running`] of one of its subscriptions.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    fn outside_this_thread(&self, parity: usize) -> usize {
        let total: usize = self.active[parity * SHARDS..(parity + 1) * SHARDS]
            .iter()
            .map(|count| count.load(Ordering::SeqCst))
            .sum();
        total.saturating_sub(own(self.id).inside[parity])
    }

    /// Waits until no runner of `parity` is left but those on this thread.
    async fn drain(&self, parity: usize) {
        loop {
            let mut left = pin!(self.left.notified());
            left.as_mut().enable();
            if self.outside_this_thread(parity) == 0 {
                return;
            }
            left.await;
        }
    }

    /// Ends once every runner that entered before this was called has left
    /// (see the module docs). Call it after clearing the flags concerned.
    pub(crate) async fn wait_for_readers(&self) {
        let _turn = self.turn.lock().await;
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let _done = Waiting(&self.waiting);
        // Pairs with the fence in `enter`: either a runner's count is seen
        // by the loads below, or that runner's flag loads see the clearing
        // that preceded this call; and with the one in `Presence::drop`: a
        // runner that leaves unseen sees `waiting` and wakes us. The
        // clearing, the counts and the loads are `SeqCst`, which suffices
        // in the language's model; the fence makes each argument one of two
        // fences, which loom checks (it models `SeqCst` fences, not the
        // total order of `SeqCst` accesses). One fence per wait.
        fence(Ordering::SeqCst);
        let current = self.epoch.load(Ordering::SeqCst) & 1;
        self.drain(current ^ 1).await;
        self.epoch.fetch_add(1, Ordering::SeqCst);
        self.drain(current).await;
    }
}

impl Drop for Presence<'_> {
    fn drop(&mut self) {
        let quiescence = self.quiescence;
        // Counted under the parity it entered with, unless
        // `renew_if_outermost` moved it: then it was the thread's only
        // presence of this bus, and so it is now (presences on a thread
        // end in the reverse order they began), the one count left.
        let mut parity = self.parity;
        change_own(quiescence.id, |own| {
            if own.inside[parity] == 0 {
                parity ^= 1;
            }
            own.inside[parity] -= 1;
        });
        let counter = parity * SHARDS + self.counter % SHARDS;
        quiescence.active[counter].fetch_sub(1, Ordering::SeqCst);
        // The count's decrement and the load of `waiting` are both
        // `SeqCst`: their total order with the waiter's increment and count
        // loads means a waiter that missed this decrement is seen here. Loom
        // does not model that order, so its builds state it as a fence
        // (paired with the one in `wait_for_readers`); a real build spares
        // every runner a full fence on its way out.
        #[cfg(loom)]
        fence(Ordering::SeqCst);
        if quiescence.waiting.load(Ordering::SeqCst) > 0 {
            quiescence.left.notify_waiters();
        }
    }
}

/// Un-counts a waiter however its wait ends.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The messages queued behind an async ordered handler's call, which
/// cannot run before it returns: its mailbox.
pub(crate) trait QueuedBehind: Send + Sync {
    fn queued(&self) -> u64;
}

/// An async subscription's unfinished deliveries.
pub(crate) struct Running {
    /// Its bus's [`Quiescence::id`].
    bus: u64,
    count: AtomicUsize,
    finished: Notify,
    /// An ordered subscription's mailbox, set once it exists.
    behind: std::sync::OnceLock<Weak<dyn QueuedBehind>>,
    /// What `unsubscribe_and_wait` runs once no delivery runs: an async
    /// ordered subscription's drain lets go of its handler.
    removed: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl Running {
    pub(crate) fn new(bus: u64) -> Self {
        Self {
            bus,
            count: AtomicUsize::new(0),
            finished: Notify::new(),
            behind: std::sync::OnceLock::new(),
            removed: std::sync::OnceLock::new(),
        }
    }

    /// Names the mailbox an ordered subscription's calls are run from: a
    /// `close` called inside one does not wait for what is queued behind it.
    pub(crate) fn queue_behind(&self, mailbox: Weak<dyn QueuedBehind>) {
        let _ = self.behind.set(mailbox);
    }

    /// Sets what [`Self::removed`] runs.
    pub(crate) fn on_removed(&self, release: Box<dyn Fn() + Send + Sync>) {
        let _ = self.removed.set(release);
    }

    /// The subscription was removed and none of its deliveries runs (what
    /// `unsubscribe_and_wait` waited for).
    pub(crate) fn removed(&self) {
        if let Some(release) = self.removed.get() {
            release();
        }
    }

    fn key(self: &Arc<Self>) -> usize {
        Arc::as_ptr(self) as usize
    }

    /// Wraps one delivery's future: counted until it completes or is
    /// dropped, and marked as "being polled" on the thread polling it.
    pub(crate) fn track<F: Future<Output = ()> + Send + 'static>(
        self: &Arc<Self>,
        future: F,
    ) -> impl Future<Output = ()> + Send + 'static {
        self.count.fetch_add(1, Ordering::SeqCst);
        let done = Finished(Arc::clone(self));
        async move {
            let (key, bus) = (done.0.key(), done.0.bus);
            let mut future = pin!(future);
            // The end mark of a `close` called in an earlier poll of this
            // delivery, carried from poll to poll.
            let mut ended: Option<Arc<std::sync::atomic::AtomicBool>> = None;
            std::future::poll_fn(|cx| {
                POLLING.with(|polling| {
                    let mut polling = polling.borrow_mut();
                    let in_place = IN_PLACE.with(Cell::get) == polling.len() + 1;
                    if in_place {
                        if let Some(ended) = &ended {
                            // Its first poll returned and let the stack go
                            // on; now the stack blocks on it again.
                            ended.store(false, std::sync::atomic::Ordering::SeqCst);
                        }
                    }
                    polling.push(Frame {
                        key,
                        bus,
                        ended: ended.take(),
                        in_place,
                        behind: done.0.behind.get().cloned(),
                    })
                });
                // Polled outside any runner of its bus (continued as a
                // task), this delivery is held by this thread's stack; inside
                // one (its first poll), the runner already holds it.
                let outside = own(bus).inside == [0, 0];
                if outside {
                    change_own(bus, |own| own.held += 1);
                }
                let _unmark = Unmark {
                    held: outside.then_some(bus),
                    ended: &mut ended,
                };
                future.as_mut().poll(cx)
            })
            .await;
            drop(done);
        }
    }

    /// Waits until none of this subscription's deliveries is running but
    /// those this thread is polling (the caller's own).
    pub(crate) async fn wait_idle(self: &Arc<Self>) {
        loop {
            let mut finished = pin!(self.finished.notified());
            finished.as_mut().enable();
            let key = self.key();
            let own = POLLING.with(|polling| {
                polling
                    .borrow()
                    .iter()
                    .filter(|frame| frame.key == key)
                    .count()
            });
            if self.count.load(Ordering::SeqCst) <= own {
                return;
            }
            finished.await;
        }
    }
}

/// Pops this thread's "being polled" mark, even if the poll panics, and
/// keeps its end mark for the delivery's next poll.
struct Unmark<'a> {
    /// The bus whose delivery this poll held, if it did.
    held: Option<u64>,
    ended: &'a mut Option<Arc<std::sync::atomic::AtomicBool>>,
}

impl Drop for Unmark<'_> {
    fn drop(&mut self) {
        let frame = POLLING.with(|polling| polling.borrow_mut().pop());
        if let Some(frame) = frame {
            if let Some(ended) = frame.ended {
                if !frame.in_place {
                    ended.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                *self.ended = Some(ended);
            }
        }
        if let Some(bus) = self.held {
            change_own(bus, |own| own.held = own.held.saturating_sub(1));
        }
    }
}

/// Counts a delivery out when its future completes or is dropped.
struct Finished(Arc<Running>);

impl Drop for Finished {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::SeqCst);
        self.0.finished.notify_waiters();
    }
}
