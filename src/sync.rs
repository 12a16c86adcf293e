//! The synchronisation primitives the concurrent core is built from.
//!
//! Everything that takes part in a cross-thread protocol (the route cache's
//! generation check, the subscriber sets' publication of new entries, the
//! stream mailbox's close, reader-gone flag, lost count and its reader's
//! parked mark ([`ReaderWaker`]), the pool's
//! shutdown, the runners' grace periods) imports its atomics, fences and
//! cells from here rather than from `std`. Under `--cfg loom` this module
//! swaps in loom's types, so the model checks in `src/loom_tests.rs`
//! run the real code instead of a copy of it (the approach of tokio's
//! `crate::loom`).
//!
//! [`ArcCell`] is an atomically replaceable `Arc<T>`: `arc-swap` in normal
//! builds (lock-free loads, no reference-count traffic for a short read), and a
//! loom mutex around an `Arc` under loom, where what is being checked is the
//! protocol around the cell rather than arc-swap itself.

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex, MutexGuard};

/// A cell whose accesses the caller orders itself
/// (`registry/write_once.rs`): std's `UnsafeCell` in normal builds, loom's
/// under loom, which checks every access against the others it could
/// race with. Both are used through `with` and `with_mut`.
#[cfg(not(loom))]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(std::cell::UnsafeCell::new(value))
    }

    /// Calls `f` with a pointer for reading.
    #[inline(always)]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    /// Calls `f` with a pointer for writing.
    #[inline(always)]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

#[cfg(loom)]
pub(crate) use loom::cell::UnsafeCell;

/// The clock the core reads (claim grains, close timeouts). Under loom it
/// stands still, so that decisions taken on elapsed time are the same in
/// every execution loom explores (loom requires a deterministic model).
pub(crate) fn now() -> std::time::Instant {
    #[cfg(all(test, not(loom)))]
    if let Some(stopped) = STOPPED_CLOCK.with(std::cell::Cell::get) {
        return stopped;
    }
    #[cfg(not(loom))]
    return std::time::Instant::now();
    #[cfg(loom)]
    {
        static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        *EPOCH.get_or_init(std::time::Instant::now)
    }
}

#[cfg(all(test, not(loom)))]
std::thread_local!(static STOPPED_CLOCK: std::cell::Cell<Option<std::time::Instant>> = const { std::cell::Cell::new(None) });

/// Stops [`now`] on this thread until dropped (unit tests): a decision
/// taken on elapsed time (a claim's grain) is then the same on a machine
/// too busy to keep a unit under a microsecond.
#[cfg(all(test, not(loom)))]
pub(crate) struct StoppedClock(Option<std::time::Instant>);

#[cfg(all(test, not(loom)))]
impl StoppedClock {
    pub(crate) fn here() -> Self {
        Self(STOPPED_CLOCK.with(|clock| clock.replace(Some(std::time::Instant::now()))))
    }
}

#[cfg(all(test, not(loom)))]
impl Drop for StoppedClock {
    fn drop(&mut self) {
        STOPPED_CLOCK.with(|clock| clock.set(self.0));
    }
}

/// One task's waker: a stream reader registers it, publishers wake it.
pub(crate) struct WakerSlot(
    #[cfg(not(loom))] atomic_waker::AtomicWaker,
    #[cfg(loom)] loom::future::AtomicWaker,
);

impl WakerSlot {
    pub(crate) fn new() -> Self {
        #[cfg(not(loom))]
        return Self(atomic_waker::AtomicWaker::new());
        #[cfg(loom)]
        return Self(loom::future::AtomicWaker::new());
    }

    pub(crate) fn register(&self, waker: &std::task::Waker) {
        #[cfg(not(loom))]
        self.0.register(waker);
        #[cfg(loom)]
        self.0.register_by_ref(waker);
    }

    pub(crate) fn wake(&self) {
        self.0.wake();
    }
}

/// A stream reader's waker, and whether the reader is parked on it.
///
/// A publisher pushes for every message, but the reader needs waking only
/// when it found its mailbox empty and went to sleep. [`WakerSlot::wake`]
/// costs a read-modify-write of the slot whether or not a waker is in it,
/// on a line the reader writes whenever it registers; with a hundred
/// mailboxes per publish that was a tenth of a stream fan-out's time. Here
/// a push that finds the reader running only reads a flag, whose line
/// changes only when the reader parks or is woken.
///
/// The protocol is a Dekker pair of `SeqCst` fences. The reader, having
/// found nothing, calls [`Self::park`] (register, mark parked, fence) and
/// then looks again. A publisher makes its message visible, issues a
/// `SeqCst` fence, then calls [`Self::wake_parked`] (read the mark). The
/// two fences are ordered one way or the other: either the reader's second
/// look finds the message, or the publisher finds the mark and wakes it.
pub(crate) struct ReaderWaker {
    slot: WakerSlot,
    parked: AtomicBool,
}

impl ReaderWaker {
    pub(crate) fn new() -> Self {
        Self {
            slot: WakerSlot::new(),
            parked: AtomicBool::new(false),
        }
    }

    /// The reader found nothing and will sleep on `waker`. The caller must
    /// look for a message again after this returns, and go to sleep only if
    /// that look finds nothing too.
    pub(crate) fn park(&self, waker: &std::task::Waker) {
        self.slot.register(waker);
        // Release: a publisher that reads the mark also sees the waker.
        self.parked.store(true, Ordering::Release);
        fence(Ordering::SeqCst);
    }

    /// The reader found a message: a mark it left from an earlier park
    /// goes, so no publisher wakes a reader that is running anyway.
    #[inline]
    pub(crate) fn running(&self) {
        if self.parked.load(Ordering::Relaxed) {
            self.parked.store(false, Ordering::Relaxed);
        }
    }

    /// Wakes the reader if it is parked. The caller made its message
    /// visible and then issued a `SeqCst` fence (see the type's docs); one
    /// publisher of several racing here wakes it.
    #[inline]
    pub(crate) fn wake_parked(&self) {
        if self.parked.load(Ordering::Acquire) && self.parked.swap(false, Ordering::AcqRel) {
            self.slot.wake();
        }
    }

    /// Wakes the reader whether or not it is marked parked (the mailbox
    /// closed: a reader that registered by any path must see it).
    pub(crate) fn wake(&self) {
        self.slot.wake();
    }
}

/// A stream mailbox's bounded queue: `crossbeam-queue`'s lock-free
/// `ArrayQueue`, or under loom a mutex around a deque with the same calls, so
/// the mailbox's push, pop and close are explored step by step.
pub(crate) mod queue {
    #[cfg(not(loom))]
    pub(crate) use crossbeam_queue::ArrayQueue;

    #[cfg(loom)]
    pub(crate) struct ArrayQueue<T> {
        items: loom::sync::Mutex<std::collections::VecDeque<T>>,
        capacity: usize,
    }

    #[cfg(loom)]
    impl<T> ArrayQueue<T> {
        pub(crate) fn new(capacity: usize) -> Self {
            Self {
                items: loom::sync::Mutex::new(std::collections::VecDeque::new()),
                capacity,
            }
        }

        /// Pushes unless full; hands the item back if it is.
        pub(crate) fn push(&self, item: T) -> Result<(), T> {
            let mut items = self.items.lock().unwrap();
            if items.len() == self.capacity {
                return Err(item);
            }
            items.push_back(item);
            Ok(())
        }

        /// Pushes, dropping and returning the oldest item if full.
        pub(crate) fn force_push(&self, item: T) -> Option<T> {
            let mut items = self.items.lock().unwrap();
            let oldest = if items.len() == self.capacity {
                items.pop_front()
            } else {
                None
            };
            items.push_back(item);
            oldest
        }

        pub(crate) fn pop(&self) -> Option<T> {
            self.items.lock().unwrap().pop_front()
        }

        pub(crate) fn len(&self) -> usize {
            self.items.lock().unwrap().len()
        }

        pub(crate) fn is_empty(&self) -> bool {
            self.len() == 0
        }

        pub(crate) fn capacity(&self) -> usize {
            self.capacity
        }
    }
}

/// Marks the threads of the worker pools: a publish made there never waits
/// for a pool's room (`Overflow::Wait`), since the room may be its own, and
/// a request made there runs its job in place when it would queue behind
/// the requester itself.
pub(crate) mod worker_mark {
    use std::cell::Cell;

    // The pool (a non-zero key) and the worker's index in it; (0, 0) off
    // the pools.
    #[cfg(not(loom))]
    std::thread_local!(static WORKER_OF: Cell<(usize, usize)> = const { Cell::new((0, 0)) });
    #[cfg(loom)]
    loom::thread_local!(static WORKER_OF: Cell<(usize, usize)> = Cell::new((0, 0)));

    /// Marks the calling thread as worker `index` of the pool `pool` (a
    /// non-zero key), for its whole life.
    pub(crate) fn set(pool: usize, index: usize) {
        WORKER_OF.with(|of| of.set((pool, index)));
    }

    /// Whether the calling thread is a worker of any pool.
    pub(crate) fn is_set() -> bool {
        WORKER_OF.with(Cell::get).0 != 0
    }

    /// This thread's index among the workers of the pool `pool`, if it is
    /// one of them.
    pub(crate) fn index_in(pool: usize) -> Option<usize> {
        let (of, index) = WORKER_OF.with(Cell::get);
        (of != 0 && of == pool).then_some(index)
    }
}

pub(crate) mod thread {
    #[cfg(loom)]
    pub(crate) use loom::thread::Builder;
    #[cfg(not(loom))]
    pub(crate) use std::thread::Builder;
}

#[cfg(not(loom))]
mod cell {
    use std::sync::Arc;

    /// A value read from an [`ArcCell`], held (see [`ArcCell::guard`]).
    pub(crate) type CellGuard<T> = arc_swap::Guard<Arc<T>>;

    /// An `Arc<T>` that can be replaced while other threads read it.
    pub(crate) struct ArcCell<T>(arc_swap::ArcSwap<T>);

    impl<T> ArcCell<T> {
        pub(crate) fn new(value: Arc<T>) -> Self {
            Self(arc_swap::ArcSwap::new(value))
        }

        /// A counted reference to the current value.
        pub(crate) fn load_full(&self) -> Arc<T> {
            self.0.load_full()
        }

        /// Runs `f` on the current value without touching its reference count.
        pub(crate) fn with<R>(&self, f: impl FnOnce(&Arc<T>) -> R) -> R {
            f(&self.0.load())
        }

        /// The current value, kept alive for as long as the guard is held,
        /// without touching its reference count in the common case.
        pub(crate) fn guard(&self) -> CellGuard<T> {
            self.0.load()
        }

        pub(crate) fn store(&self, value: Arc<T>) {
            self.0.store(value);
        }

        /// Replaces the value, handing the old one back so the caller decides
        /// where it is dropped (the trie drops it after releasing its lock).
        pub(crate) fn swap(&self, value: Arc<T>) -> Arc<T> {
            self.0.swap(value)
        }
    }

    /// An `Option<Arc<T>>` that can be replaced while other threads read it.
    pub(crate) struct OptionArcCell<T>(arc_swap::ArcSwapOption<T>);

    impl<T> OptionArcCell<T> {
        pub(crate) fn empty() -> Self {
            Self(arc_swap::ArcSwapOption::empty())
        }

        pub(crate) fn with<R>(&self, f: impl FnOnce(Option<&Arc<T>>) -> R) -> R {
            f(self.0.load().as_ref())
        }

        pub(crate) fn store(&self, value: Option<Arc<T>>) {
            self.0.store(value);
        }
    }
}

#[cfg(loom)]
mod cell {
    use loom::sync::Mutex;
    use std::sync::Arc;

    pub(crate) type CellGuard<T> = Arc<T>;

    pub(crate) struct ArcCell<T>(Mutex<Arc<T>>);

    impl<T> ArcCell<T> {
        pub(crate) fn new(value: Arc<T>) -> Self {
            Self(Mutex::new(value))
        }

        pub(crate) fn load_full(&self) -> Arc<T> {
            self.0.lock().unwrap().clone()
        }

        pub(crate) fn with<R>(&self, f: impl FnOnce(&Arc<T>) -> R) -> R {
            let value = self.load_full();
            f(&value)
        }

        pub(crate) fn guard(&self) -> CellGuard<T> {
            self.load_full()
        }

        pub(crate) fn store(&self, value: Arc<T>) {
            *self.0.lock().unwrap() = value;
        }

        pub(crate) fn swap(&self, value: Arc<T>) -> Arc<T> {
            std::mem::replace(&mut *self.0.lock().unwrap(), value)
        }
    }

    pub(crate) struct OptionArcCell<T>(Mutex<Option<Arc<T>>>);

    impl<T> OptionArcCell<T> {
        pub(crate) fn empty() -> Self {
            Self(Mutex::new(None))
        }

        pub(crate) fn with<R>(&self, f: impl FnOnce(Option<&Arc<T>>) -> R) -> R {
            let value = self.0.lock().unwrap().clone();
            f(value.as_ref())
        }

        pub(crate) fn store(&self, value: Option<Arc<T>>) {
            *self.0.lock().unwrap() = value;
        }
    }
}

pub(crate) use cell::{ArcCell, CellGuard, OptionArcCell};
