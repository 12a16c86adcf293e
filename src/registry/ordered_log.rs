//! [`OrderedLog`]: the messages published to one trie node's ordered
//! handler subscriptions, in the order they were published.
//!
//! # Contract
//! - Every ordered subscription of a node shares its filter, so they share
//!   one log. A publish that reaches the node appends its message once (not
//!   once per subscription) and gets its **position**; positions count up
//!   from 0 without gaps. Two publishers append in some order; each one's
//!   own messages keep its publish order.
//! - The log keeps the newest `capacity` messages (the bus's
//!   `stream_capacity`) readable. A subscription whose handler falls further
//!   behind finds the older ones gone: it counts them dropped (its lag).
//!   Messages sit in shared blocks of 32 positions, which a runner catching
//!   up reads by reference (one `Arc` clone per block, not per message); a
//!   block is let go once all of it is pushed out, so up to 31 messages
//!   more than `capacity` stay allocated.
//! - A message pushed out of the ring is dropped after the lock, so no user
//!   `Drop` runs while the log is locked. Once no subscription reads the
//!   log, the last one's entry lets go of what it kept (the node may live on
//!   for other subscriptions).
//! - `head` (the next position) is published with `SeqCst` after the
//!   append; a reader that sees it can read every position below it.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};

use crate::message::Message;
use crate::sync::{AtomicU64, AtomicUsize, Mutex, MutexGuard, Ordering};

/// Messages per block of the ring.
const BLOCK: usize = 32;

/// One node's ordered log.
pub(crate) struct OrderedLog<T> {
    ring: Mutex<Ring<T>>,
    /// The position the next append gets.
    head: AtomicU64,
    /// Ordered subscriptions attached and not yet deactivated: a publish
    /// appends only while there is one.
    members: AtomicUsize,
    capacity: usize,
}

/// The ring holds its messages in shared blocks of [`BLOCK`] positions, so
/// a runner catching up reads them by reference after one `Arc` clone per
/// block, instead of one per message (a locked operation each, as costly
/// as the call it precedes).
struct Ring<T> {
    blocks: VecDeque<Arc<Block<T>>>,
    /// The oldest position kept (the ring's bound); blocks wholly below it
    /// are let go.
    first: u64,
    /// The position the next append gets.
    next: u64,
}

/// [`BLOCK`] consecutive positions from `first`. A slot is set once, before
/// the head passes it, and never changes after.
pub(crate) struct Block<T> {
    first: u64,
    slots: [OnceLock<Arc<Message<T>>>; BLOCK],
}

/// What a runner read from the log: the blocks holding positions
/// `start..end`. Reused between reads to keep its allocation.
pub(crate) struct Read<T> {
    blocks: Vec<Arc<Block<T>>>,
    start: u64,
    end: u64,
}

impl<T> Default for Read<T> {
    fn default() -> Self {
        Self {
            blocks: Vec::new(),
            start: 0,
            end: 0,
        }
    }
}

impl<T> Read<T> {
    /// The first position read (above the one asked for if older ones were
    /// pushed out of the ring).
    pub(crate) fn start(&self) -> u64 {
        self.start
    }

    /// The messages read, with their positions, in order.
    pub(crate) fn messages(&self) -> impl Iterator<Item = (u64, &Arc<Message<T>>)> {
        let (start, end) = (self.start, self.end);
        self.blocks.iter().flat_map(move |block| {
            let from = start.max(block.first);
            let to = end.min(block.first + BLOCK as u64);
            (from..to).filter_map(move |position| {
                let slot = usize::try_from(position - block.first).ok()?;
                block.slots[slot].get().map(|message| (position, message))
            })
        })
    }

    /// Lets go of the blocks (and so of the messages only they kept).
    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
    }
}

impl<T> OrderedLog<T> {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            ring: Mutex::new(Ring {
                blocks: VecDeque::new(),
                first: 0,
                next: 0,
            }),
            head: AtomicU64::new(0),
            members: AtomicUsize::new(0),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Ring<T>> {
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a publish should append: some subscription reads the log.
    #[inline]
    pub(crate) fn has_members(&self) -> bool {
        self.members.load(Ordering::SeqCst) > 0
    }

    /// A subscription starts reading: returns the position it starts at
    /// (what is appended from now on reaches it).
    pub(crate) fn join(&self) -> u64 {
        let ring = self.lock();
        self.members.fetch_add(1, Ordering::SeqCst);
        ring.next
    }

    /// A subscription stopped reading.
    pub(crate) fn leave(&self) {
        self.members.fetch_sub(1, Ordering::SeqCst);
    }

    /// Lets go of the messages kept, if no subscription reads the log any
    /// more (one that joins later starts at the head anyway). Called when an
    /// ordered entry is dropped, which happens outside the trie's lock; the
    /// messages are dropped after this log's lock too.
    pub(crate) fn release_if_unread(&self) {
        let released = {
            let mut ring = self.lock();
            if self.members.load(Ordering::SeqCst) > 0 {
                return;
            }
            ring.first = ring.next;
            std::mem::take(&mut ring.blocks)
        };
        drop(released);
    }

    /// The position the next append gets: every position below it can be
    /// read.
    #[inline]
    pub(crate) fn head(&self) -> u64 {
        self.head.load(Ordering::SeqCst)
    }

    /// Appends `message`; returns its position. Keeps the newest `capacity`
    /// positions readable; a block is let go once all of it is older (so up
    /// to `BLOCK - 1` messages more stay allocated until then).
    pub(crate) fn append(&self, message: &Arc<Message<T>>) -> u64 {
        let mut displaced = None;
        let position;
        {
            let mut ring = self.lock();
            position = ring.next;
            let full = ring
                .blocks
                .back()
                .is_none_or(|block| position >= block.first + BLOCK as u64);
            if full {
                ring.blocks.push_back(Arc::new(Block {
                    first: position,
                    slots: std::array::from_fn(|_| OnceLock::new()),
                }));
            }
            let block = ring.blocks.back().expect("a block with room");
            let slot = usize::try_from(position - block.first).expect("within a block");
            let _ = block.slots[slot].set(Arc::clone(message));
            ring.next = position + 1;
            ring.first = ring
                .first
                .max(ring.next.saturating_sub(self.capacity as u64));
            if ring
                .blocks
                .front()
                .is_some_and(|block| block.first + BLOCK as u64 <= ring.first)
            {
                displaced = ring.blocks.pop_front();
            }
            self.head.store(position + 1, Ordering::SeqCst);
        }
        drop(displaced);
        position
    }

    /// Whether the message at `position` has been pushed out of the ring:
    /// a subscription that had not run it yet lost it, even if a runner
    /// still holds a copy (the bound is the ring's, not the copies').
    #[inline]
    pub(crate) fn pushed_out(&self, position: u64) -> bool {
        position < self.oldest_kept()
    }

    /// The oldest position still readable: every older one is pushed out.
    #[inline]
    pub(crate) fn oldest_kept(&self) -> u64 {
        self.head().saturating_sub(self.capacity as u64)
    }

    /// Reads the messages from position `from` to the head into `into`
    /// (see [`Read`]); older ones pushed out of the ring are not there.
    /// `read_to` is called with the read's start and end before appends
    /// are let go on: whatever [`Self::while_appends_wait`] does next sees
    /// what it did.
    pub(crate) fn read(&self, from: u64, into: &mut Read<T>, read_to: impl FnOnce(u64, u64)) {
        into.blocks.clear();
        let ring = self.lock();
        into.start = from.max(ring.first);
        into.end = ring.next;
        let (start, end) = (into.start, into.end);
        into.blocks.extend(
            ring.blocks
                .iter()
                .filter(|block| block.first + BLOCK as u64 > start && block.first < end)
                .cloned(),
        );
        read_to(start, end);
    }

    /// Runs `step` while no append and no read can happen: a step that
    /// must see every read made before it, and that every read made after
    /// it must see. `step` runs no user code.
    pub(crate) fn while_appends_wait<R>(&self, step: impl FnOnce() -> R) -> R {
        let _ring = self.lock();
        step()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::Arc;

    use super::{OrderedLog, Read, BLOCK};
    use crate::message::Message;

    fn values(read: &Read<u64>) -> Vec<(u64, u64)> {
        read.messages()
            .map(|(position, message)| (position, *message.data()))
            .collect()
    }

    /// Reads span blocks and start mid-block; the ring keeps the newest
    /// `capacity` positions readable and lets go of whole blocks only.
    #[test]
    fn reads_span_blocks_and_the_ring_keeps_its_bound() {
        let capacity = BLOCK + 8;
        let log = OrderedLog::<u64>::new(capacity);
        let total = 3 * BLOCK as u64 + 5;
        for value in 0..total {
            assert_eq!(log.append(&Arc::new(Message::new("t", value))), value);
        }
        assert_eq!(log.head(), total);
        let mut read = Read::default();
        log.read(total - 10, &mut read, |_, _| {});
        assert_eq!(
            values(&read),
            (total - 10..total).map(|p| (p, p)).collect::<Vec<_>>()
        );
        // Older than the bound: the read starts at the oldest kept.
        log.read(0, &mut read, |_, _| {});
        let oldest = total - capacity as u64;
        assert_eq!(read.start(), oldest);
        assert_eq!(
            values(&read),
            (oldest..total).map(|p| (p, p)).collect::<Vec<_>>()
        );
        assert!(log.pushed_out(oldest - 1) && !log.pushed_out(oldest));
        let kept = log.lock().blocks.len();
        assert!(kept * BLOCK <= capacity + 2 * BLOCK, "{kept} blocks kept");
    }
}
