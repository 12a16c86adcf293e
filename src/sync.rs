//! The synchronisation primitives the concurrent core is built from.
//!
//! Everything that takes part in a cross-thread protocol (the route cache's
//! generation check, the subscriber sets' publication of new entries, the
//! stream mailbox's close and lost count, the pool's shutdown) imports its
//! atomics and cells from here rather than from `std`. Under `--cfg loom`
//! this module swaps in loom's types, so the model checks in `tests/loom_*.rs`
//! run the real code instead of a copy of it (the approach of tokio's
//! `crate::loom`).
//!
//! [`ArcCell`] is an atomically replaceable `Arc<T>`: `arc-swap` in normal
//! builds (lock-free loads, no reference-count traffic for a short read), and a
//! loom mutex around an `Arc` under loom, where what is being checked is the
//! protocol around the cell rather than arc-swap itself.

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Condvar, Mutex};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex};

#[cfg(not(loom))]
mod cell {
    use std::sync::Arc;

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

        pub(crate) fn store(&self, value: Arc<T>) {
            self.0.store(value);
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

        pub(crate) fn store(&self, value: Arc<T>) {
            *self.0.lock().unwrap() = value;
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

pub(crate) use cell::{ArcCell, OptionArcCell};
