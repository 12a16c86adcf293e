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
//!   `stream_capacity`). A subscription whose handler falls further behind
//!   finds the older ones gone: it counts them dropped (its lag).
//! - A message pushed out of the ring is dropped after the lock, so no user
//!   `Drop` runs while the log is locked. Once no subscription reads the
//!   log, the last one's entry lets go of what it kept (the node may live on
//!   for other subscriptions).
//! - `head` (the next position) is published with `SeqCst` after the
//!   append; a reader that sees it can read every position below it.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::message::Message;
use crate::sync::{AtomicU64, AtomicUsize, Mutex, MutexGuard, Ordering};

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

struct Ring<T> {
    messages: VecDeque<Arc<Message<T>>>,
    /// The position of `messages[0]`.
    first: u64,
}

impl<T> OrderedLog<T> {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            ring: Mutex::new(Ring {
                messages: VecDeque::new(),
                first: 0,
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
        ring.first + ring.messages.len() as u64
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
            ring.first += ring.messages.len() as u64;
            std::mem::take(&mut ring.messages)
        };
        drop(released);
    }

    /// The position the next append gets: every position below it can be
    /// read.
    #[inline]
    pub(crate) fn head(&self) -> u64 {
        self.head.load(Ordering::SeqCst)
    }

    /// Appends `message`; returns its position.
    pub(crate) fn append(&self, message: &Arc<Message<T>>) -> u64 {
        let displaced;
        let position;
        {
            let mut ring = self.lock();
            position = ring.first + ring.messages.len() as u64;
            ring.messages.push_back(Arc::clone(message));
            displaced = if ring.messages.len() > self.capacity {
                ring.first += 1;
                ring.messages.pop_front()
            } else {
                None
            };
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
        position + (self.capacity as u64) < self.head()
    }

    /// Copies the messages from position `from` to the head into `into`;
    /// returns the position of the first one copied (above `from` if the
    /// older ones were pushed out of the ring).
    pub(crate) fn read(&self, from: u64, into: &mut Vec<Arc<Message<T>>>) -> u64 {
        let ring = self.lock();
        let start = from.max(ring.first);
        let skip = usize::try_from(start - ring.first).unwrap_or(usize::MAX);
        into.extend(ring.messages.iter().skip(skip).cloned());
        start
    }
}
