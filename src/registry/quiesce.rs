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
//! - **Runners on the waiting thread's own stack are not waited for**: they
//!   sit below the wait in the call stack and cannot leave before it ends (a
//!   handler blocking on its own unsubscribe). Each thread counts the runners
//!   it is inside of.
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
use std::sync::Arc;

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
// - `INSIDE`: runners this thread is inside of, per parity.
// - `POLLING`: the async subscriptions whose deliveries this thread is
//   polling now (their [`Running`] counters, by address), innermost last.
// - `HELD`: deliveries in flight that the runners and async deliveries on
//   this thread's stack hold: a `close` called from a handler does not wait
//   for them (they cannot finish before it returns).
#[cfg(not(loom))]
std::thread_local! {
    static INSIDE: [Cell<usize>; 2] = const { [Cell::new(0), Cell::new(0)] };
    static POLLING: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
    static HELD: Cell<u64> = const { Cell::new(0) };
}
#[cfg(loom)]
loom::thread_local! {
    static INSIDE: [Cell<usize>; 2] = [Cell::new(0), Cell::new(0)];
    static POLLING: RefCell<Vec<usize>> = RefCell::new(Vec::new());
    static HELD: Cell<u64> = Cell::new(0);
}

/// Runners on this thread now hold `n` more deliveries (see [`held_here`]).
#[inline]
pub(crate) fn hold(n: u64) {
    HELD.with(|held| held.set(held.get() + n));
}

/// Runners on this thread no longer hold `n` deliveries.
#[inline]
pub(crate) fn unhold(n: u64) {
    HELD.with(|held| held.set(held.get().saturating_sub(n)));
}

/// In-flight deliveries held by the call stack of this thread: what a
/// `close` called from inside a handler must not wait for.
pub(crate) fn held_here() -> u64 {
    HELD.with(Cell::get)
}

/// The bus's record of which runners are delivering.
pub(crate) struct Quiescence {
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
}

impl Quiescence {
    pub(crate) fn new() -> Self {
        Self {
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
        // One cell per parity: a read-modify-write of the pair made the
        // next read of it wait on a partial store.
        INSIDE.with(|inside| inside[parity].set(inside[parity].get() + 1));
        Presence {
            quiescence: self,
            parity,
            counter,
        }
    }

    fn outside_this_thread(&self, parity: usize) -> usize {
        let total: usize = self.active[parity * SHARDS..(parity + 1) * SHARDS]
            .iter()
            .map(|count| count.load(Ordering::SeqCst))
            .sum();
        total.saturating_sub(INSIDE.with(|inside| inside[parity].get()))
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
        INSIDE.with(|inside| inside[self.parity].set(inside[self.parity].get() - 1));
        let quiescence = self.quiescence;
        quiescence.active[self.counter].fetch_sub(1, Ordering::SeqCst);
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

/// An async subscription's unfinished deliveries.
pub(crate) struct Running {
    count: AtomicUsize,
    finished: Notify,
}

impl Running {
    pub(crate) fn new() -> Self {
        Self {
            count: AtomicUsize::new(0),
            finished: Notify::new(),
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
            let key = done.0.key();
            let mut future = pin!(future);
            std::future::poll_fn(|cx| {
                POLLING.with(|polling| polling.borrow_mut().push(key));
                // Polled outside any runner (continued as a task), this
                // delivery is held by this thread's stack; inside a runner
                // (its first poll), the runner already holds it.
                let outside = INSIDE.with(|inside| inside[0].get() == 0 && inside[1].get() == 0);
                if outside {
                    hold(1);
                }
                let _unmark = Unmark { held: outside };
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
            let own =
                POLLING.with(|polling| polling.borrow().iter().filter(|&&k| k == key).count());
            if self.count.load(Ordering::SeqCst) <= own {
                return;
            }
            finished.await;
        }
    }
}

/// Pops this thread's "being polled" mark, even if the poll panics.
struct Unmark {
    held: bool,
}

impl Drop for Unmark {
    fn drop(&mut self) {
        POLLING.with(|polling| {
            polling.borrow_mut().pop();
        });
        if self.held {
            unhold(1);
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
