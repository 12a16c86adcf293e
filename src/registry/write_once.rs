//! [`WriteOnce`]: a slot one writer fills once and readers then read
//! without a lock; and [`Filled`], the readers' view of such slots.
//!
//! # Contract
//! - [`WriteOnce::fill`] (unsafe): while it runs, no other thread touches
//!   the slot, and no reader reads the slot until the write is published
//!   to it: a `Release` store after the fill that the reader loads with
//!   `Acquire` before it reads.
//! - [`Filled::view`] (unsafe): every fill of the viewed slots was
//!   published to the caller that way, and none is filled while the view
//!   lives. [`Filled::get`] is then a plain read, safe to call.
//! - A slot never filled reads as `None`.
//!
//! The subscriber sets (`subset.rs`) keep both: the trie's writer lock
//! makes one writer, which fills only the slot at the set's length and
//! then publishes the new length with `Release`; readers view only slots
//! below a length they loaded with `Acquire`; and a slot below the length
//! is never filled again.
//!
//! # Why not `OnceLock`
//! A `OnceLock` makes each slot safe on its own, at the price of a state
//! word per slot (24 bytes for an `Arc<dyn _>` where 16 hold it) and a load
//! and a branch on it at every read, although the set's length already
//! orders every read after its write. A publish reads every slot of its
//! route; with 1,000 handler subscriptions run `Inline` in the service
//! setting that was about 3% of the publish (`docs/design-notes.md` §13,
//! twenty-eighth session). `loom_tests.rs` checks the protocol
//! (`loom_a_reader_walking_a_set_sees_only_published_slots`): loom's cell
//! reports any read not ordered after the write it could see.

#![allow(unsafe_code)]

use crate::sync::UnsafeCell;

/// A slot filled at most once (see the module docs).
pub(crate) struct WriteOnce<V> {
    value: UnsafeCell<Option<V>>,
}

// SAFETY: sharing a `WriteOnce` between threads lets one of them fill it
// with a `V` that others then read through `&V` and that any of them may
// drop with the last reference to the slot: `V: Send + Sync`. The fill
// and the reads never overlap: that is the contract of `fill` and
// `Filled::view`, which their callers keep.
unsafe impl<V: Send + Sync> Sync for WriteOnce<V> {}
// SAFETY: moving the slot moves its `V`.
unsafe impl<V: Send> Send for WriteOnce<V> {}

impl<V> WriteOnce<V> {
    pub(crate) fn empty() -> Self {
        Self {
            value: UnsafeCell::new(None),
        }
    }

    pub(crate) fn filled(value: V) -> Self {
        Self {
            value: UnsafeCell::new(Some(value)),
        }
    }

    /// Fills the slot, or hands `value` back if it is already filled.
    ///
    /// # Safety
    /// While this runs no other thread accesses the slot, and no thread
    /// reads it afterwards before a `Release` store made after this call
    /// has been loaded by that thread with `Acquire`.
    pub(crate) unsafe fn fill(&self, value: V) -> Result<(), V> {
        self.value.with_mut(|slot| {
            // SAFETY: by the caller's contract this thread is the only one
            // accessing the slot now, so the exclusive borrow is unique.
            let slot = unsafe { &mut *slot };
            if slot.is_some() {
                return Err(value);
            }
            *slot = Some(value);
            Ok(())
        })
    }
}

/// A slot whose fill, if any, was published to the thread holding this
/// view, and which is not filled while the view lives: safe to read.
/// `repr(transparent)`, so a slice of slots is viewed in place.
#[repr(transparent)]
pub(crate) struct Filled<V>(WriteOnce<V>);

impl<V> Filled<V> {
    /// Views `slots` as filled.
    ///
    /// # Safety
    /// Every fill of these slots happened before a `Release` store that
    /// this thread has loaded with `Acquire`, and none of them is filled
    /// while the view lives.
    #[inline]
    pub(crate) unsafe fn view(slots: &[WriteOnce<V>]) -> &[Filled<V>] {
        let slots: *const [WriteOnce<V>] = slots;
        // SAFETY: `Filled<V>` is `repr(transparent)` over `WriteOnce<V>`,
        // so the two slices have the same layout and length, and the view
        // borrows the slots for as long as they were borrowed.
        unsafe { &*(slots as *const [Filled<V>]) }
    }

    /// The slot's value; `None` if it was never filled.
    #[inline(always)]
    pub(crate) fn get(&self) -> Option<&V> {
        // SAFETY: by `view`'s contract every fill of this slot happened
        // before this read and none happens while `self` is borrowed, so
        // the shared borrow cannot alias a write.
        self.0.value.with(|slot| unsafe { (*slot).as_ref() })
    }
}

// Plain unit tests: under `--cfg loom` the cell is loom's, usable only
// inside a model (the protocol's model is in `loom_tests.rs`).
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_filled_once_and_an_empty_one_reads_as_none() {
        let slots = [WriteOnce::empty(), WriteOnce::filled(7)];
        // SAFETY: one thread, nothing viewed yet.
        assert_eq!(unsafe { slots[0].fill(1) }, Ok(()));
        // SAFETY: as above.
        assert_eq!(unsafe { slots[0].fill(2) }, Err(2), "filled once");
        // SAFETY: one thread: every fill happened before, none follows.
        let view = unsafe { Filled::view(&slots) };
        let values: Vec<_> = view.iter().map(Filled::get).collect();
        assert_eq!(values, [Some(&1), Some(&7)]);
        let empty = [WriteOnce::<u32>::empty()];
        // SAFETY: as above.
        assert_eq!(unsafe { Filled::view(&empty) }[0].get(), None);
    }
}
