//! [`SubSet`]: the subscriptions of one trie node, readable by any number of
//! publishers while one writer appends to it.
//!
//! The contract:
//! - **Readers** take a length with [`SubSet::len`] and may then read every
//!   slot below it, lock-free; entries are never moved or overwritten.
//! - **The writer** (whoever holds the trie's writer lock; there is only ever
//!   one) appends into spare capacity by filling the next slot and *then*
//!   publishing the new length with `Release`. A reader that loads the length
//!   with `Acquire` therefore sees every entry below it. Appending needs no
//!   copy and no cache invalidation: a cached route holds the set, not a copy
//!   of it, and reads the length anew on every publish.
//! - Removing is two steps: the subscription's own flag is cleared (delivery
//!   stops at once), and the writer counts it out of `live`. Dead entries stay
//!   until the set is rebuilt.
//! - When the set is full, or when dead entries outnumber live ones, the
//!   writer builds a replacement with only the live entries and room to grow
//!   (capacity doubles), swaps it into the node and bumps the trie's
//!   generation so cached routes pick it up. Each entry is copied O(1) times
//!   on average, so a million subscribes to one topic cost a million appends
//!   plus about two million pointer copies in total, not a million copies of
//!   the whole set.

use std::sync::{Arc, OnceLock};

use crate::subscriber::Subscriber;
use crate::sync::{AtomicUsize, Ordering};

/// The smallest capacity a non-empty set is given.
const MIN_CAPACITY: usize = 4;

pub(crate) struct SubSet<S: ?Sized> {
    slots: Box<[OnceLock<Arc<Subscriber<S>>>]>,
    len: AtomicUsize,
    live: AtomicUsize,
}

impl<S: ?Sized> SubSet<S> {
    pub(crate) fn empty() -> Self {
        Self {
            slots: Box::new([]),
            len: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
        }
    }

    fn from_entries(entries: Vec<Arc<Subscriber<S>>>) -> Self {
        let capacity = (entries.len() * 2).max(MIN_CAPACITY);
        let len = entries.len();
        let slots: Box<[OnceLock<Arc<Subscriber<S>>>]> = entries
            .into_iter()
            .map(OnceLock::from)
            .chain(std::iter::repeat_with(OnceLock::new))
            .take(capacity)
            .collect();
        Self {
            slots,
            len: AtomicUsize::new(len),
            live: AtomicUsize::new(len),
        }
    }

    /// Entries published so far (live or dead). Every slot below it is filled.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    /// Active subscriptions, as the writer last counted them.
    pub(crate) fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// The entry at `index`, if `index` is below a length this thread loaded.
    #[inline]
    pub(crate) fn get(&self, index: usize) -> Option<&Arc<Subscriber<S>>> {
        self.slots.get(index).and_then(OnceLock::get)
    }

    /// The slots in `range` (which must lie below a length this thread
    /// loaded).
    #[inline]
    pub(crate) fn slots(&self, range: std::ops::Range<usize>) -> &[OnceLock<Arc<Subscriber<S>>>] {
        &self.slots[range]
    }

    /// The first `len` entries (a length previously read with [`Self::len`]).
    pub(crate) fn entries(&self, len: usize) -> impl Iterator<Item = &Arc<Subscriber<S>>> {
        self.slots[..len.min(self.slots.len())]
            .iter()
            .filter_map(OnceLock::get)
    }

    /// Writer only: appends into spare capacity, or hands the entry back if the
    /// set is full.
    pub(crate) fn try_push(&self, entry: Arc<Subscriber<S>>) -> Result<(), Arc<Subscriber<S>>> {
        let len = self.len.load(Ordering::Relaxed);
        let Some(slot) = self.slots.get(len) else {
            return Err(entry);
        };
        slot.set(entry)?;
        self.live.fetch_add(1, Ordering::Relaxed);
        self.len.store(len + 1, Ordering::Release);
        Ok(())
    }

    /// Writer only: one of this set's subscriptions has been deactivated.
    pub(crate) fn count_removed(&self) {
        self.live.fetch_sub(1, Ordering::Relaxed);
    }

    /// Dead entries still taking slots.
    pub(crate) fn dead(&self) -> usize {
        self.len.load(Ordering::Relaxed) - self.live()
    }

    /// Writer only: a replacement holding the live entries, plus `extra`.
    pub(crate) fn rebuilt(&self, extra: Option<Arc<Subscriber<S>>>) -> Self {
        let len = self.len.load(Ordering::Relaxed);
        let entries: Vec<_> = self
            .entries(len)
            .filter(|e| e.is_active())
            .cloned()
            .chain(extra)
            .collect();
        if entries.is_empty() {
            Self::empty()
        } else {
            Self::from_entries(entries)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u64) -> Arc<Subscriber<u64>> {
        Arc::new(Subscriber::new(id, id))
    }

    #[test]
    fn appends_until_full_then_rebuilds_with_room() {
        let set: SubSet<u64> = SubSet::empty();
        assert!(set.try_push(entry(0)).is_err());
        let set = set.rebuilt(Some(entry(0)));
        assert_eq!((set.len(), set.capacity()), (1, MIN_CAPACITY));
        for id in 1..4 {
            assert!(set.try_push(entry(id)).is_ok());
        }
        assert!(set.try_push(entry(4)).is_err());
        let ids: Vec<u64> = set.entries(set.len()).map(|e| e.id()).collect();
        assert_eq!(ids, [0, 1, 2, 3]);
    }

    #[test]
    fn rebuilding_drops_dead_entries() {
        let set = SubSet::empty().rebuilt(Some(entry(0)));
        assert!(set.try_push(entry(1)).is_ok());
        set.get(0).unwrap().deactivate();
        set.count_removed();
        assert_eq!((set.live(), set.dead()), (1, 1));
        let set = set.rebuilt(None);
        let ids: Vec<u64> = set.entries(set.len()).map(|e| e.id()).collect();
        assert_eq!(ids, [1]);
    }
}
