//! [`Counted`]: a shared pointer to a handler subscription's entry whose
//! one header word counts the pointers to the entry *and* holds the
//! subscription's active flag.
//!
//! # Contract
//! - Every pointee is a [`Headed`] type: `repr(C)`, its first field the
//!   header word (an `AtomicU64`). Bit 0 of the word is the active flag,
//!   which [`Counted`] never touches; the bits above it count the
//!   `Counted` pointers to the entry.
//! - A `Counted` is made only by [`Counted::new`] (a `Box` of a sized
//!   entry, count one) or from another `Counted` to the same entry
//!   ([`Clone`], [`Counted::unsize`]). So whatever type a `Counted` names
//!   (the entry's own, `Subscriber<T, dyn Sink<T>>`, `dyn EntryControl`),
//!   its pointer's address part is the start of a live boxed entry, where
//!   the header is.
//! - Clone and drop act as `Arc`'s strong count does: a clone adds one
//!   (`Relaxed`: the clone is made from a pointer that keeps the entry
//!   alive), a drop takes one away with `Release`, and the drop that takes
//!   the last one issues an `Acquire` fence before it drops the entry, so
//!   every use of the entry through other pointers happens before that.
//!   More than 2^61 pointers abort the process, as `Arc` does past
//!   `isize::MAX`.
//!
//! # Why not `Arc`
//! A publish walks every entry of its route, and its cost follows the
//! memory it touches (`docs/design-notes.md` §13). An `Arc` puts two
//! counts in front of the entry, and the entry needs a word of its own for
//! the flag: a handler capturing two `Arc`s took 40 bytes, a 48-byte heap
//! chunk. One word for both makes it 24, a 32-byte chunk: the same memory
//! a plain `Box<dyn Fn>` of that closure takes, which is what the raw
//! loop of the fan-out bench walks. Handler entries need no weak count;
//! stream entries, which do (`retained.rs`), keep `Arc`.

#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::ptr::NonNull;

use crate::sync::{fence, AtomicU64, Ordering};

/// One pointer in the header word: the count sits above the flag bit.
const ONE: u64 = 2;
/// A header at or past this (2^61 pointers) aborts the next clone, long
/// before the count could wrap: as `Arc` does on overflow.
const MAX: u64 = 1 << 62;

/// A type whose first word, at offset zero, is its header (see the module
/// docs).
///
/// # Safety
/// The type is `repr(C)` and its first field is a [`AtomicU64`] (from
/// `crate::sync`) that no code other than [`Counted`] changes above bit 0,
/// and every value of the type is made with those bits zero (no pointer
/// counted yet), as [`Counted::new`] takes it.
pub(crate) unsafe trait Headed {}

/// A counted pointer to a boxed entry (see the module docs).
pub(crate) struct Counted<E: ?Sized> {
    entry: NonNull<E>,
    /// Owns an `E`: dropping the last pointer drops it.
    _owns: PhantomData<E>,
}

// The entry is never moved through a `Counted`, pinned or not (as `Arc`).
impl<E: ?Sized> Unpin for Counted<E> {}

// SAFETY: as for `Arc<E>`: the entry is shared between threads (`Sync`)
// and dropped by whichever thread lets go of it last (`Send`).
unsafe impl<E: ?Sized + Send + Sync> Send for Counted<E> {}
// SAFETY: as above.
unsafe impl<E: ?Sized + Send + Sync> Sync for Counted<E> {}

impl<E: Headed> Counted<E> {
    /// Boxes `entry`, whose header reads a count of zero (`Headed`'s
    /// contract; the flag bit as its maker set it), and counts this pointer.
    pub(crate) fn new(entry: E) -> Self {
        let entry = NonNull::from(Box::leak(Box::new(entry)));
        let counted = Self {
            entry,
            _owns: PhantomData,
        };
        let before = counted.header().fetch_add(ONE, Ordering::Relaxed);
        debug_assert_eq!(before >> 1, 0, "an entry made with pointers counted");
        counted
    }
}

impl<E: ?Sized> Counted<E> {
    /// The entry's header word.
    #[inline(always)]
    pub(crate) fn header(&self) -> &AtomicU64 {
        // SAFETY: the address part of `entry` is the start of a live boxed
        // `Headed` entry (module contract), whose first field, at offset
        // zero, is an `AtomicU64`; this pointer's count keeps it alive for
        // as long as `self` is borrowed.
        unsafe { &*self.entry.as_ptr().cast::<AtomicU64>() }
    }

    /// This pointer to the same entry, as a `U` (an unsized view of it).
    ///
    /// # Safety
    /// `view` returns its argument as a `*mut U`: the same address, and
    /// metadata describing the entry's own type (an unsizing coercion).
    pub(crate) unsafe fn unsize<U: ?Sized>(
        self,
        view: impl FnOnce(*mut E) -> *mut U,
    ) -> Counted<U> {
        let entry = std::mem::ManuallyDrop::new(self).entry.as_ptr();
        // SAFETY: the caller's contract: `view(entry)` is `entry`, which is
        // not null.
        let entry = unsafe { NonNull::new_unchecked(view(entry)) };
        // The count moves to the new pointer with `self`'s.
        Counted {
            entry,
            _owns: PhantomData,
        }
    }
}

impl<E: ?Sized> std::ops::Deref for Counted<E> {
    type Target = E;

    #[inline(always)]
    fn deref(&self) -> &E {
        // SAFETY: the entry is alive while this pointer counts in it, and
        // nothing takes `&mut` to it while shared.
        unsafe { self.entry.as_ref() }
    }
}

impl<E: ?Sized> Clone for Counted<E> {
    fn clone(&self) -> Self {
        if self.header().fetch_add(ONE, Ordering::Relaxed) >= MAX {
            std::process::abort();
        }
        Self {
            entry: self.entry,
            _owns: PhantomData,
        }
    }
}

impl<E: ?Sized> Drop for Counted<E> {
    fn drop(&mut self) {
        if self.header().fetch_sub(ONE, Ordering::Release) >> 1 != 1 {
            return;
        }
        // Every other pointer's uses of the entry (each released with its
        // drop) happen before the entry is dropped.
        fence(Ordering::Acquire);
        // SAFETY: this was the last pointer, so nothing else can reach the
        // entry; it was boxed by `Counted::new` as its own sized type, and
        // `E`'s metadata describes that type (module contract), so the box
        // is rebuilt with the layout it was allocated with.
        drop(unsafe { Box::from_raw(self.entry.as_ptr()) });
    }
}

impl<E: ?Sized> std::fmt::Debug for Counted<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counted")
            .field("pointers", &(self.header().load(Ordering::Relaxed) >> 1))
            .finish_non_exhaustive()
    }
}

// Plain unit tests: under `--cfg loom` the header is loom's atomic, usable
// only inside a model (see `loom_tests.rs` for the concurrent model).
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    #[repr(C)]
    struct Entry<S: ?Sized> {
        header: AtomicU64,
        sink: S,
    }
    // SAFETY: `repr(C)`, the header first; only `Counted` changes its count
    // bits, and the tests make every entry with none counted.
    unsafe impl<S: ?Sized> Headed for Entry<S> {}

    trait Named {
        fn name(&self) -> &str;
    }

    /// Counts its drops.
    struct Sink(Arc<AtomicUsize>, &'static str);
    impl Drop for Sink {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
    impl Named for Sink {
        fn name(&self) -> &str {
            self.1
        }
    }

    fn entry(drops: &Arc<AtomicUsize>) -> Counted<Entry<Sink>> {
        Counted::new(Entry {
            header: AtomicU64::new(1),
            sink: Sink(Arc::clone(drops), "sink"),
        })
    }

    #[test]
    fn the_last_pointer_drops_the_entry_once_and_the_flag_stays() {
        let drops = Arc::new(AtomicUsize::new(0));
        let first = entry(&drops);
        let second = first.clone();
        assert_eq!(first.header().load(Ordering::Relaxed), (2 * ONE) | 1);
        drop(first);
        assert_eq!(drops.load(Ordering::Relaxed), 0, "a pointer is left");
        assert_eq!(second.header().load(Ordering::Relaxed), ONE | 1);
        second.header().fetch_and(!1, Ordering::Relaxed);
        let third = second.clone();
        assert_eq!(third.header().load(Ordering::Relaxed), 2 * ONE);
        drop(second);
        drop(third);
        assert_eq!(
            drops.load(Ordering::Relaxed),
            1,
            "dropped once, at the last"
        );
    }

    #[test]
    fn an_unsized_view_shares_the_count_and_drops_the_right_type() {
        let drops = Arc::new(AtomicUsize::new(0));
        let sized = entry(&drops);
        // SAFETY: an unsizing coercion of the same pointer.
        let view: Counted<Entry<dyn Named>> =
            unsafe { sized.clone().unsize(|e| e as *mut Entry<dyn Named>) };
        assert!(std::ptr::addr_eq(&*view, &*sized));
        assert_eq!(view.sink.name(), "sink");
        assert_eq!(view.header().load(Ordering::Relaxed) >> 1, 2);
        drop(sized);
        assert_eq!(view.clone().sink.name(), "sink");
        drop(view);
        assert_eq!(drops.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn an_over_aligned_sink_is_found_behind_the_header() {
        #[repr(align(64))]
        struct Wide(u8);
        impl Named for Wide {
            fn name(&self) -> &str {
                if self.0 == 7 {
                    "wide"
                } else {
                    "misread"
                }
            }
        }
        let sized = Counted::new(Entry {
            header: AtomicU64::new(0),
            sink: Wide(7),
        });
        // SAFETY: an unsizing coercion of the same pointer.
        let view: Counted<Entry<dyn Named>> =
            unsafe { sized.unsize(|e| e as *mut Entry<dyn Named>) };
        assert_eq!(view.sink.name(), "wide");
        assert_eq!(view.header().load(Ordering::Relaxed), ONE);
    }
}
