//! [`SubSet`]: the subscriptions of one trie node, readable by any number of
//! publishers while one writer appends to it.
//!
//! The contract:
//! - **Readers** take a length with [`SubSet::len`] and may then read every
//!   slot below it, lock-free; entries are never moved or overwritten.
//!   [`SubSet::runs`] and [`SubSet::get`] cut what they return at a length
//!   they load themselves, so no reader views a slot being filled: that is
//!   what lets a slot be a plain write-once cell (`write_once.rs`).
//! - **The writer** (whoever holds the trie's writer lock; there is only ever
//!   one) appends into spare capacity by filling the next slot and *then*
//!   publishing the new length with `Release`. A reader that loads the length
//!   with `Acquire` therefore sees every entry below it. Appending needs no
//!   copy and no cache invalidation: a cached route holds the set, not a copy
//!   of it, and reads the length anew on every publish.
//! - Slots live in **segments**. When the set is full, the writer makes a
//!   replacement that shares every existing segment (they are full and never
//!   written again) and adds one as large as all of them together, so the
//!   capacity doubles without copying a single entry; it swaps the
//!   replacement into the node, where routes load it on their next publish. A million subscribes to one topic are a million
//!   appends plus about twenty segment allocations.
//! - Each slot has an **id** beside it, in a parallel array of its
//!   segment: the subscription's id, written with the slot and published
//!   by the same length. A handler entry does not hold its id (one word
//!   less for every delivery to walk past: `counted.rs`); the rare reader
//!   that wants it (a panic's report) asks the set.
//! - Removing is two steps: the subscription's own flag is cleared (delivery
//!   stops at once), and the writer counts it out of `live`. Dead entries stay
//!   until the writer *compacts* the set — copies the live entries into one
//!   fresh segment — which it does on every removal while the set is small
//!   and once half of it is dead otherwise (see `trie.rs`), so each
//!   removal costs O(1) copies on average.

use std::ops::Range;
use std::sync::Arc;

use smallvec::{smallvec, SmallVec};

use super::entry::{HandlerEntry, StreamEntry};
use super::write_once::{Filled, WriteOnce};
use crate::sync::{AtomicU64, AtomicUsize, Ordering};

/// A slot as readers see it: below a length they loaded, so filled (see
/// `write_once.rs`).
pub(crate) type Slot<E> = Filled<E>;

/// What a set holds: a pointer to a subscription's entry.
pub(crate) trait SetEntry: Clone {
    /// Whether the subscription is still subscribed.
    fn is_active(&self) -> bool;
}

impl<T> SetEntry for HandlerEntry<T> {
    #[inline]
    fn is_active(&self) -> bool {
        (**self).is_active()
    }
}

impl<T> SetEntry for StreamEntry<T> {
    #[inline]
    fn is_active(&self) -> bool {
        (**self).is_active()
    }
}

/// A run of slots allocated together, and their ids; shared by the sets
/// that grew from it.
struct Segment<E> {
    slots: Arc<[WriteOnce<E>]>,
    ids: Arc<[AtomicU64]>,
}

impl<E> Clone for Segment<E> {
    fn clone(&self) -> Self {
        Self {
            slots: Arc::clone(&self.slots),
            ids: Arc::clone(&self.ids),
        }
    }
}

impl<E> Segment<E> {
    fn len(&self) -> usize {
        self.slots.len()
    }
}

/// A node's handler subscriptions.
pub(crate) type HandlerSet<T> = SubSet<HandlerEntry<T>>;
/// A node's stream subscriptions.
pub(crate) type StreamSet<T> = SubSet<StreamEntry<T>>;

/// The smallest capacity a non-empty set is given.
const MIN_CAPACITY: usize = 4;

/// Segments of a set, inline while there are few: a compacted set (one
/// segment) costs three allocations: its slots, their ids and the set.
type Segments<E> = SmallVec<[Segment<E>; 2]>;

pub(crate) struct SubSet<E> {
    /// Segments in order; together they hold `capacity` slots.
    segments: Segments<E>,
    /// Where each segment starts.
    starts: SmallVec<[usize; 2]>,
    capacity: usize,
    len: AtomicUsize,
    live: AtomicUsize,
}

impl<E: SetEntry> SubSet<E> {
    pub(crate) fn empty() -> Self {
        Self::from_parts(Segments::new(), 0, 0)
    }

    fn from_parts(segments: Segments<E>, len: usize, live: usize) -> Self {
        let mut capacity = 0;
        let starts = segments
            .iter()
            .map(|segment| {
                let start = capacity;
                capacity += segment.len();
                start
            })
            .collect();
        Self {
            segments,
            starts,
            capacity,
            len: AtomicUsize::new(len),
            live: AtomicUsize::new(live),
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

    #[cfg(all(test, not(loom)))]
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// The segment holding slot `index`, and the index's offset in it.
    #[inline]
    fn locate(&self, index: usize) -> Option<(usize, usize)> {
        if index >= self.capacity {
            return None;
        }
        // Few segments (one per doubling): a backwards scan is cheapest.
        let segment = self.starts.iter().rposition(|&start| start <= index)?;
        Some((segment, index - self.starts[segment]))
    }

    /// The entry at `index`, if it is below the set's length (loaded here).
    pub(crate) fn get(&self, index: usize) -> Option<&E> {
        let (segment, offset) = self.locate(index)?;
        let published = self.len().saturating_sub(self.starts[segment]);
        view(&self.segments[segment], offset..offset + 1, published)
            .first()?
            .get()
    }

    /// The id of the subscription at `index`, if it is below the set's
    /// length (loaded here).
    pub(crate) fn id(&self, index: usize) -> Option<u64> {
        let (segment, offset) = self.locate(index)?;
        // The length, loaded first with `Acquire`, publishes the id stored
        // before it.
        (index < self.len()).then(|| self.segments[segment].ids[offset].load(Ordering::Relaxed))
    }

    /// The slots of `range`, as the contiguous runs of the segments they
    /// sit in. Cut at the set's length, loaded here: a caller passes a
    /// range below a length it loaded before, and the length only grows.
    #[inline]
    pub(crate) fn runs(&self, range: Range<usize>) -> impl Iterator<Item = &[Slot<E>]> {
        let len = self.len();
        let end = range.end.min(len);
        let first = self
            .locate(range.start)
            .map_or(self.segments.len(), |(s, _)| s);
        self.segments[first..]
            .iter()
            .zip(&self.starts[first..])
            .map_while(move |(segment, &start)| {
                let from = range.start.max(start) - start;
                let to = end.min(start + segment.len()).saturating_sub(start);
                (from < to).then(|| view(segment, from..to, len - start))
            })
    }

    /// The first `len` entries (a length previously read with [`Self::len`]).
    pub(crate) fn entries(&self, len: usize) -> impl Iterator<Item = &E> {
        self.runs(0..len.min(self.capacity))
            .flatten()
            .filter_map(Filled::get)
    }

    /// The first `len` entries with their ids (a length previously read
    /// with [`Self::len`]).
    pub(crate) fn entries_with_ids(&self, len: usize) -> impl Iterator<Item = (u64, &E)> {
        let len = len.min(self.len());
        self.segments
            .iter()
            .zip(&self.starts)
            .flat_map(move |(segment, &start)| {
                let to = len.saturating_sub(start).min(segment.len());
                // The length, loaded above with `Acquire`, publishes the ids
                // stored before it, as it does the slots.
                view(segment, 0..to, to)
                    .iter()
                    .zip(&segment.ids[..to])
                    .filter_map(|(slot, id)| Some((id.load(Ordering::Relaxed), slot.get()?)))
            })
    }

    /// Appends `entry`, subscription `id`, into spare capacity, or hands
    /// the entry back if the set is full.
    ///
    /// # Safety
    /// The caller is the set's only writer: no other thread calls this on
    /// the same set meanwhile (the trie's writer lock, or a set not yet
    /// shared).
    #[allow(unsafe_code)]
    pub(crate) unsafe fn try_push(&self, id: u64, entry: E) -> Result<(), E> {
        let len = self.len.load(Ordering::Relaxed);
        let Some((segment, offset)) = self.locate(len) else {
            return Err(entry);
        };
        let segment = &self.segments[segment];
        // SAFETY: the only writer (this function's contract) fills the slot
        // at the length, which no reader views before the store below
        // publishes it (readers view only slots below a length they loaded
        // with `Acquire`: `view`).
        unsafe { segment.slots[offset].fill(entry) }?;
        segment.ids[offset].store(id, Ordering::Relaxed);
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

    /// Writer only: a replacement for this full set with `entry`
    /// (subscription `id`) added and twice the room, sharing every segment
    /// of this one.
    #[allow(unsafe_code)]
    pub(crate) fn grown(&self, id: u64, entry: E) -> Self {
        let added = new_segment(self.capacity.max(MIN_CAPACITY));
        let segments: Segments<E> = self.segments.iter().cloned().chain([added]).collect();
        let len = self.len.load(Ordering::Relaxed);
        let grown = Self::from_parts(segments, len, self.live());
        // SAFETY: `grown` is this thread's alone until it returns it.
        if unsafe { grown.try_push(id, entry) }.is_err() {
            unreachable!("a grown set has room");
        }
        grown
    }

    /// Writer only: a replacement holding only the live entries, in one
    /// segment with room for as many again.
    pub(crate) fn compacted(&self) -> Self {
        let len = self.len.load(Ordering::Relaxed);
        let count = self.live();
        if count == 0 {
            return Self::empty();
        }
        let capacity = (count * 2).max(MIN_CAPACITY);
        let mut live = self
            .entries_with_ids(len)
            .filter(|(_, entry)| entry.is_active());
        let ids: Arc<[AtomicU64]> = std::iter::repeat_with(|| AtomicU64::new(0))
            .take(capacity)
            .collect();
        let mut filled = 0;
        // Mapping a range collects straight into the segment's allocation.
        let slots: Arc<[WriteOnce<E>]> = (0..capacity)
            .map(|_| match live.next() {
                Some((id, entry)) => {
                    ids[filled].store(id, Ordering::Relaxed);
                    filled += 1;
                    WriteOnce::filled(entry.clone())
                }
                None => WriteOnce::empty(),
            })
            .collect();
        let segment = Segment { slots, ids };
        debug_assert!(
            filled == count && live.next().is_none(),
            "the live count disagrees with the active entries"
        );
        Self::from_parts(smallvec![segment], filled, filled)
    }
}

/// `segment[range]` viewed as filled, cut at `published`: the set's
/// length, loaded with `Acquire`, less the segment's start.
#[allow(unsafe_code)]
#[inline(always)]
fn view<E>(segment: &Segment<E>, range: Range<usize>, published: usize) -> &[Slot<E>] {
    let range = range.start.min(published)..range.end.min(published);
    // SAFETY: the slots lie below a length of this set loaded with
    // `Acquire` (`SubSet::len`), which the writer stored with `Release`
    // after filling each of them (`SubSet::try_push`, or before the set was
    // shared: `grown`, `compacted`); and the writer fills only at the
    // length, above them, so none is filled while the view lives. Segments
    // a set shares with the set it grew from were full there, so that
    // set's writer fills nothing more in them either.
    unsafe { Filled::view(&segment.slots[range]) }
}

fn new_segment<E>(capacity: usize) -> Segment<E> {
    Segment {
        slots: std::iter::repeat_with(WriteOnce::empty)
            .take(capacity)
            .collect(),
        ids: std::iter::repeat_with(|| AtomicU64::new(0))
            .take(capacity)
            .collect(),
    }
}

// Plain unit tests: under `--cfg loom` the atomics they touch are loom's,
// usable only inside a model.
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// A test entry: the id it was pushed with, and a flag.
    struct Probe {
        id: u64,
        active: AtomicBool,
    }

    type Entry = Arc<Probe>;

    impl SetEntry for Entry {
        fn is_active(&self) -> bool {
            self.active.load(std::sync::atomic::Ordering::Relaxed)
        }
    }

    fn entry(id: u64) -> Entry {
        Arc::new(Probe {
            id,
            active: AtomicBool::new(true),
        })
    }

    /// `try_push` from the test's one thread, under the entry's id.
    #[allow(unsafe_code)]
    fn push(set: &SubSet<Entry>, entry: Entry) -> Result<(), Entry> {
        // SAFETY: the set is this thread's alone.
        unsafe { set.try_push(entry.id, entry) }
    }

    fn grown(set: &SubSet<Entry>, entry: Entry) -> SubSet<Entry> {
        set.grown(entry.id, entry)
    }

    /// The set's ids, each checked against its entry's.
    fn ids(set: &SubSet<Entry>) -> Vec<u64> {
        set.entries_with_ids(set.len())
            .map(|(id, e)| {
                assert_eq!(id, e.id, "an id beside the wrong entry");
                id
            })
            .collect()
    }

    #[test]
    fn appends_until_full_then_grows_by_a_segment() {
        let set: SubSet<Entry> = SubSet::empty();
        assert!(push(&set, entry(0)).is_err());
        let set = grown(&set, entry(0));
        assert_eq!((set.len(), set.capacity()), (1, MIN_CAPACITY));
        for id in 1..4 {
            assert!(push(&set, entry(id)).is_ok());
        }
        assert!(push(&set, entry(4)).is_err());
        let grown = grown(&set, entry(4));
        assert_eq!((grown.len(), grown.capacity()), (5, 8));
        assert_eq!(ids(&grown), [0, 1, 2, 3, 4]);
        // The old set is untouched and shares its entries.
        assert_eq!(ids(&set), [0, 1, 2, 3]);
        assert!(Arc::ptr_eq(set.get(2).unwrap(), grown.get(2).unwrap()));
    }

    #[test]
    fn runs_cover_ranges_across_segments() {
        let mut set: SubSet<Entry> = grown(&SubSet::empty(), entry(0));
        for id in 1..20 {
            if let Err(e) = push(&set, entry(id)) {
                set = grown(&set, e);
            }
        }
        let lens: Vec<usize> = set.runs(2..19).map(<[_]>::len).collect();
        assert_eq!(lens, [2, 4, 8, 3]);
        let ids: Vec<u64> = set
            .runs(2..19)
            .flatten()
            .filter_map(Filled::get)
            .map(|e| e.id)
            .collect();
        assert_eq!(ids, (2..19).collect::<Vec<_>>());
        assert_eq!(set.get(17).map(|e| e.id), Some(17));
        assert_eq!(set.id(17), Some(17));
        assert!(set.get(32).is_none());
        assert_eq!(set.id(20), None, "above the length");
    }

    /// Readers walking while the writer appends see a prefix of the
    /// entries, each whole and beside its id (Miri checks the accesses for
    /// races: `cargo +nightly miri test --lib registry::subset`; loom
    /// checks the same protocol in `loom_tests.rs`).
    #[test]
    fn readers_racing_appends_see_a_prefix() {
        let set = Arc::new(grown(&SubSet::empty(), entry(0)));
        let reader = {
            let set = Arc::clone(&set);
            std::thread::spawn(move || {
                let mut seen = 0;
                while seen < 4 {
                    let got = ids(&set);
                    assert_eq!(got, (0..got.len() as u64).collect::<Vec<_>>());
                    let walked = set.runs(0..8).flatten().filter(|s| s.get().is_some());
                    assert!(walked.count() >= got.len());
                    seen = got.len();
                    std::thread::yield_now();
                }
            })
        };
        for id in 1..4 {
            assert!(push(&set, entry(id)).is_ok());
            std::thread::yield_now();
        }
        reader.join().unwrap();
    }

    #[test]
    fn compacting_drops_dead_entries_and_keeps_each_id_beside_its_entry() {
        let set = grown(&SubSet::empty(), entry(0));
        for id in 1..4 {
            assert!(push(&set, entry(id)).is_ok());
        }
        for dead in [0, 2] {
            set.get(dead)
                .unwrap()
                .active
                .store(false, std::sync::atomic::Ordering::Relaxed);
            set.count_removed();
        }
        assert_eq!((set.live(), set.dead()), (2, 2));
        let set = set.compacted();
        assert_eq!(ids(&set), [1, 3]);
        assert_eq!(set.dead(), 0);
    }
}
