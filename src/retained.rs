//! Retained messages: the last message of a topic, handed to every new
//! matching subscription before anything live (MQTT 5 §3.3.1.3).
//!
//! # Contract
//! - **One message per topic name.** [`Bus::publish_retained`] publishes as
//!   [`Bus::publish`] does and makes the message its topic's retained one;
//!   [`Bus::clear_retained`] forgets it; [`Bus::retained`] reads the retained
//!   messages a filter matches.
//! - **A new subscription** (handler or stream; not a shared one) receives the
//!   retained messages its filter matches first, oldest retained first, each
//!   marked [`Message::is_retained`]; then, **per topic, no gap and no
//!   duplicate**: every retained publish to that topic that was not in its
//!   snapshot, exactly once, never one older than the snapshot's, even with
//!   publishers racing the subscribe.
//! - **Bounded**: at most `Config::max_retained` topics; retaining one more
//!   evicts the topic retained least recently ([`Stats::retained_evicted`](crate::Stats::retained_evicted)).
//!   With `Config::retained_expiry`, a message older than that is removed by
//!   the next retained operation ([`Stats::retained_expired`](crate::Stats::retained_expired)) and never
//!   handed out.
//! - **Cost**: the store is a trie of topic levels, walked with the filter,
//!   so a subscribe costs what its filter reaches (all of the store for `#`,
//!   one path for a filter without wildcards), not what is stored.
//!
//! # How the snapshot meets the live messages
//! The store has one lock, `R`. A retained publish takes it, looks up who
//! to deliver to (its route, current under `R`) and takes room in their
//! lossless streams, then numbers its message (a sequence `s` shared by all
//! topics) and stores it; it delivers after releasing `R`. A subscribe takes
//! `R`, reads its snapshot and the current number `G`, and inserts its
//! subscription into the subscription trie *while still holding `R`* (lock
//! order: `R`, then the trie's writer lock; nothing takes them the other
//! way round). So a retained publish numbered after `G` looked up its route
//! after the subscription was visible, and reaches it: no gap. One numbered
//! `G` or lower was stored before the snapshot: it is in the snapshot, or
//! older than the topic's message there, or was cleared; the subscription
//! skips any live message numbered `G` or lower (the mailbox checks it on
//! push; a handler's sink before calling the handler; a skipped delivery
//! is counted nowhere, since the snapshot's call or push was counted): no
//! duplicate, nothing older, and `Stats::delivered` counts the one call.
//!
//! A retained publish that finds a lossless stream full is refused
//! (`Error::Full`) before it is numbered: it stores nothing, so no later
//! subscription is handed a message that reached no one. Its route is the
//! cached one if still current, else built under `R` without touching the
//! cache, so nothing dropped under `R` can be a subscription's.
//!
//! Ordered handlers (`subscribe_ordered`, `subscribe_ordered_async`) take
//! `R` even before the first retained publish, and hold it until they
//! read their live messages: a sync one joins its node's ordered log
//! under `R` (the log is where its live messages come from), and runs the
//! snapshot itself after releasing it, as the subscription's runner from
//! the start, so live deliveries meanwhile leave their messages to it and
//! none overlaps a snapshot call; an async one has its snapshot queued in
//! its mailbox before it is visible, as a stream does, and a drain started
//! for it.
//!
//! A stream's mailbox holds its snapshot before the subscription is
//! visible, so it comes first; a snapshot larger than the mailbox keeps its
//! newest messages and counts the others as lost. A handler's snapshot is
//! delivered on the subscribing thread, after `R` is released and before
//! `subscribe` returns; live messages that arrive meanwhile wait in a
//! backlog (up to `Config::stream_capacity`; beyond it they are delivered at
//! once, still exactly once) and are delivered after it, in arrival order.
//! The subscriber holds a publish token from before the subscription is
//! visible until the backlog is empty, so `close` waits for the snapshot and
//! the backlog (whose live messages their publishers' runners counted
//! finished when they handed them over), and an async handler's futures
//! among them are admitted under that token even once `close` has begun.
//!
//! # Before the first retained message
//! Most buses never retain anything, and their subscribes should not pay for
//! the store's lock. Until a retained publish begins, a subscribe takes no
//! snapshot and skips `R`; its trie insert checks, under the trie's writer
//! lock, that no retained publish has begun, and starts over the ordinary
//! way if one has. A retained publish sets that flag and passes through the
//! trie's writer lock before it looks up its route: a subscribe whose check
//! saw no flag finished its insert before that, so the publish's lookup
//! finds it (a live delivery, no gap); one that checks later sees the flag.
//! Every retained publish passes through that lock until one has done so
//! after setting the flag: one that only saw the flag set by a racing
//! publish could otherwise look up its route while such an insert is still
//! under way, and miss it.
//!
//! What the store replaces, evicts or lets expire, and what the trie insert
//! replaces, is dropped after `R` is released: a message's value is user
//! data whose `Drop` may do anything.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use crate::bus::Bus;
use crate::config::Config;
use crate::dispatch::{deliver_now, start_drains, InlineDeeper, Ordered, OrderedSink};
use crate::error::{Error, Rejected};
use crate::handles::{Receiver, Subscription};
use crate::message::{Message, Metadata};
use crate::registry::counted::Counted;
use crate::registry::entry::{
    BoxFuture, Control, Outcome, Settled, Sink, StreamSubscriber, Subscriber, Tracked,
};
use crate::registry::mailbox::{Mailbox, Reserve};
use crate::registry::quiesce::{QueuedBehind, Running};
use crate::registry::room::DeferWakes;
use crate::registry::trie::{Handlers, InsertError, Released, Streams};
use crate::registry::Kind;
use crate::stats::{Counters, Tally};
use crate::stream_options::StreamOverflow;
use crate::sync::{AtomicBool, AtomicUsize, Mutex, MutexGuard, Ordering};
use crate::topic::{is_system_topic, split_shared, validate_filter, validate_topic};

/// A node of the store's trie, in an arena: no recursion to drop it, and a
/// prune walks up by index.
struct Node<T> {
    parent: u32,
    level: Box<str>,
    children: Children,
    slot: Option<Slot<T>>,
}

/// A retained message and when it expires.
struct Slot<T> {
    message: Arc<Message<T>>,
    expires: Option<Instant>,
}

/// A node's children: a short list of node indices while few (most nodes
/// have one or two; their levels are read from the nodes, not copied), a
/// hash map by level beyond.
enum Children {
    Few(Vec<u32>),
    Many(Box<FxHashMap<Box<str>, u32>>),
}

const FEW: usize = 8;

impl Children {
    fn is_empty(&self) -> bool {
        match self {
            Children::Few(list) => list.is_empty(),
            Children::Many(map) => map.is_empty(),
        }
    }
}

/// What the store's lock guards.
struct Store<T> {
    /// Index 0 is the root (no level, never a topic).
    nodes: Vec<Node<T>>,
    free: Vec<u32>,
    /// Retained topics by the number of their message: oldest first, which
    /// is both the eviction order and (one expiry for all) the expiry order.
    by_seq: BTreeMap<u64, u32>,
    /// The number of the last retained publish.
    seq: u64,
}

/// The bus's retained messages.
pub(crate) struct RetainedStore<T> {
    store: Mutex<Store<T>>,
    /// Whether a retained publish has begun on this bus. Until then a
    /// subscribe skips the store (nothing to snapshot) and its lock: see
    /// "Before the first retained message" in the module docs.
    in_use: AtomicBool,
    /// Set once a retained publish has set `in_use` and passed through the
    /// trie's writer lock: every subscribe that saw `in_use` unset has
    /// finished its insert. Until then each retained publish passes through
    /// that lock itself (one that only saw `in_use` set could otherwise look
    /// up its route while such an insert is still under way).
    settled: AtomicBool,
    /// Topics retained, for `Stats` (written under the lock).
    len: AtomicUsize,
    max: usize,
    expiry: Option<Duration>,
}

/// Retained messages a locked operation let go of, dropped after unlocking.
type Garbage<T> = Vec<Arc<Message<T>>>;

/// A subscription's snapshot: the matching retained messages, oldest first,
/// and the number `G` it was taken at.
struct Snapshot<T> {
    messages: Vec<Arc<Message<T>>>,
    after: u64,
}

impl<T> RetainedStore<T> {
    pub(crate) fn new(config: &Config) -> Self {
        Self {
            store: Mutex::new(Store {
                nodes: vec![Node {
                    parent: 0,
                    level: "".into(),
                    children: Children::Few(Vec::new()),
                    slot: None,
                }],
                free: Vec::new(),
                by_seq: BTreeMap::new(),
                seq: 0,
            }),
            in_use: AtomicBool::new(false),
            settled: AtomicBool::new(false),
            len: AtomicUsize::new(0),
            max: config.max_retained,
            expiry: config.retained_expiry,
        }
    }

    /// Whether a retained publish has begun on this bus.
    fn in_use(&self) -> bool {
        self.in_use.load(Ordering::Relaxed)
    }

    /// Topics retained now: with an expiry, what has expired is removed
    /// first (counted), so it is not counted here.
    pub(crate) fn len(&self, counters: &Counters) -> usize {
        if self.expiry.is_none() || !self.in_use() {
            return self.len.load(Ordering::Relaxed);
        }
        let mut garbage = Garbage::new();
        let len = self.lock_fresh(&mut garbage, counters).by_seq.len();
        // The expired messages are dropped here, after the lock.
        drop(garbage);
        len
    }

    fn lock(&self) -> MutexGuard<'_, Store<T>> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Locks the store and removes what has expired.
    fn lock_fresh(
        &self,
        garbage: &mut Garbage<T>,
        counters: &Counters,
    ) -> MutexGuard<'_, Store<T>> {
        let mut store = self.lock();
        if self.expiry.is_some() {
            let now = crate::sync::now();
            let mut expired = 0;
            while let Some((&seq, &node)) = store.by_seq.first_key_value() {
                let due = store.nodes[node as usize]
                    .slot
                    .as_ref()
                    .and_then(|slot| slot.expires)
                    .is_some_and(|at| at <= now);
                if !due {
                    break;
                }
                store.by_seq.remove(&seq);
                if let Some(slot) = store.take_slot(node) {
                    garbage.push(slot.message);
                }
                expired += 1;
            }
            if expired > 0 {
                counters
                    .retained_expired
                    .fetch_add(expired, Ordering::Relaxed);
                self.len.store(store.by_seq.len(), Ordering::Relaxed);
            }
        }
        store
    }

    /// Runs `first` under the store's lock and, unless it fails, retains
    /// the message `make` builds from its number, replacing the topic's
    /// message or evicting the oldest topic if the store is full.
    fn retain<R, E>(
        &self,
        topic: &str,
        first: impl FnOnce() -> Result<R, E>,
        make: impl FnOnce(u64) -> Arc<Message<T>>,
        garbage: &mut Garbage<T>,
        counters: &Counters,
    ) -> Result<(Arc<Message<T>>, R), E> {
        let mut store = self.lock_fresh(garbage, counters);
        let first = first()?;
        // Read under the lock: expiries then follow the numbers, which is
        // the order the store lets them expire in (it stops at the first
        // message not yet due).
        // Past what an `Instant` can hold (`Duration::MAX`, say): never.
        let expires = self
            .expiry
            .and_then(|expiry| crate::sync::now().checked_add(expiry));
        store.seq += 1;
        let seq = store.seq;
        let message = make(seq);
        let node = store.node_for(topic);
        let old = store.nodes[node as usize].slot.take();
        match old {
            Some(old) => {
                store.by_seq.remove(&old.message.seq());
                garbage.push(old.message);
            }
            None => {
                if store.by_seq.len() >= self.max {
                    if let Some((_, evicted)) = store.by_seq.pop_first() {
                        if let Some(slot) = store.take_slot(evicted) {
                            garbage.push(slot.message);
                        }
                        counters.retained_evicted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        // Eviction may have pruned nodes; find (or remake) the topic's node.
        let node = store.node_for(topic);
        store.nodes[node as usize].slot = Some(Slot {
            message: Arc::clone(&message),
            expires,
        });
        store.by_seq.insert(seq, node);
        self.len.store(store.by_seq.len(), Ordering::Relaxed);
        Ok((message, first))
    }

    /// Forgets `topic`'s retained message; returns it.
    fn clear(
        &self,
        topic: &str,
        garbage: &mut Garbage<T>,
        counters: &Counters,
    ) -> Option<Arc<Message<T>>> {
        let mut store = self.lock_fresh(garbage, counters);
        let node = store.find(topic)?;
        let seq = store.nodes[node as usize].slot.as_ref()?.message.seq();
        store.by_seq.remove(&seq);
        let slot = store.take_slot(node)?;
        self.len.store(store.by_seq.len(), Ordering::Relaxed);
        Some(slot.message)
    }
}

impl<T> Store<T> {
    /// `node`'s child at `level`.
    fn child(&self, node: u32, level: &str) -> Option<u32> {
        match &self.nodes[node as usize].children {
            Children::Few(list) => list
                .iter()
                .copied()
                .find(|&child| &*self.nodes[child as usize].level == level),
            Children::Many(map) => map.get(level).copied(),
        }
    }

    fn add_child(&mut self, node: u32, level: &str, child: u32) {
        match &mut self.nodes[node as usize].children {
            Children::Few(list) if list.len() < FEW => {
                list.push(child);
                return;
            }
            Children::Many(map) => {
                map.insert(level.into(), child);
                return;
            }
            Children::Few(_) => {}
        }
        // A full short list becomes a map.
        let Children::Few(list) = std::mem::replace(
            &mut self.nodes[node as usize].children,
            Children::Few(Vec::new()),
        ) else {
            return;
        };
        let mut map: FxHashMap<Box<str>, u32> = list
            .into_iter()
            .map(|other| (self.nodes[other as usize].level.clone(), other))
            .collect();
        map.insert(level.into(), child);
        self.nodes[node as usize].children = Children::Many(Box::new(map));
    }

    fn remove_child(&mut self, node: u32, level: &str, child: u32) {
        match &mut self.nodes[node as usize].children {
            Children::Few(list) => list.retain(|&c| c != child),
            Children::Many(map) => {
                map.remove(level);
            }
        }
    }

    /// Runs `f` on each child of `node` with its level.
    fn for_each_child(&self, node: u32, mut f: impl FnMut(&str, u32)) {
        match &self.nodes[node as usize].children {
            Children::Few(list) => {
                for &child in list {
                    f(&self.nodes[child as usize].level, child);
                }
            }
            Children::Many(map) => map.iter().for_each(|(level, &child)| f(level, child)),
        }
    }

    /// The node of `topic`, made if missing.
    fn node_for(&mut self, topic: &str) -> u32 {
        let mut node = 0u32;
        for level in topic.split('/') {
            node = match self.child(node, level) {
                Some(child) => child,
                None => {
                    let child = self.alloc(node, level);
                    self.add_child(node, level, child);
                    child
                }
            };
        }
        node
    }

    fn find(&self, topic: &str) -> Option<u32> {
        let mut node = 0u32;
        for level in topic.split('/') {
            node = self.child(node, level)?;
        }
        Some(node)
    }

    fn alloc(&mut self, parent: u32, level: &str) -> u32 {
        let node = Node {
            parent,
            level: level.into(),
            children: Children::Few(Vec::new()),
            slot: None,
        };
        match self.free.pop() {
            Some(index) => {
                self.nodes[index as usize] = node;
                index
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    /// Takes `node`'s slot and prunes the nodes left empty above it (the
    /// caller has removed it from `by_seq`).
    fn take_slot(&mut self, node: u32) -> Option<Slot<T>> {
        let slot = self.nodes[node as usize].slot.take();
        let mut at = node;
        while at != 0 {
            let n = &self.nodes[at as usize];
            if n.slot.is_some() || !n.children.is_empty() {
                break;
            }
            let parent = n.parent;
            let level = std::mem::take(&mut self.nodes[at as usize].level);
            self.remove_child(parent, &level, at);
            self.free.push(at);
            at = parent;
        }
        slot
    }

    /// The retained messages `filter` (a valid, non-shared filter) matches,
    /// oldest first.
    fn matching(&self, filter: &str) -> Vec<Arc<Message<T>>> {
        let levels: Vec<&str> = filter.split('/').collect();
        let mut found: Vec<(u64, Arc<Message<T>>)> = Vec::new();
        let mut add = |slot: &Option<Slot<T>>| {
            if let Some(slot) = slot {
                found.push((slot.message.seq(), Arc::clone(&slot.message)));
            }
        };
        // (node, index of the filter level it must match next)
        let mut stack = vec![(0u32, 0usize)];
        let mut subtree = Vec::new();
        while let Some((node, depth)) = stack.pop() {
            let n = &self.nodes[node as usize];
            match levels.get(depth) {
                None => add(&n.slot),
                Some(&"#") => {
                    // `a/#` matches `a` too (the root is never a topic).
                    if depth > 0 {
                        add(&n.slot);
                    }
                    self.for_each_child(node, |level, child| {
                        if !(depth == 0 && is_system_topic(level)) {
                            subtree.push(child);
                        }
                    });
                    while let Some(inside) = subtree.pop() {
                        add(&self.nodes[inside as usize].slot);
                        self.for_each_child(inside, |_, child| subtree.push(child));
                    }
                }
                Some(&"+") => self.for_each_child(node, |level, child| {
                    if !(depth == 0 && is_system_topic(level)) {
                        stack.push((child, depth + 1));
                    }
                }),
                Some(level) => {
                    if let Some(child) = self.child(node, level) {
                        stack.push((child, depth + 1));
                    }
                }
            }
        }
        found.sort_unstable_by_key(|&(seq, _)| seq);
        found.into_iter().map(|(_, message)| message).collect()
    }
}

/// A handler subscription primed with a retained snapshot: it skips live
/// duplicates of the snapshot, and holds live messages back until the
/// snapshot has been delivered (see the module docs).
pub(crate) struct Primed<T, S> {
    inner: S,
    after: u64,
    ready: AtomicBool,
    backlog: Mutex<VecDeque<Arc<Message<T>>>>,
    capacity: usize,
}

impl<T, S> Primed<T, S> {
    fn backlog(&self) -> MutexGuard<'_, VecDeque<Arc<Message<T>>>> {
        self.backlog.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<T, S> Primed<T, S> {
    /// Whether `message` is a live copy of a retained publish the snapshot
    /// delivered (or of an older one): not delivered again.
    fn in_snapshot(&self, message: &Message<T>) -> bool {
        message.seq() != 0 && message.seq() <= self.after
    }
}

impl<T: Send + Sync, S: Sink<T>> Sink<T> for Primed<T, S> {
    fn deliver(&self, message: &Arc<Message<T>>) -> Option<BoxFuture> {
        if self.in_snapshot(message) {
            return None;
        }
        if !self.ready.load(Ordering::Acquire) {
            let mut backlog = self.backlog();
            if !self.ready.load(Ordering::Relaxed) && backlog.len() < self.capacity {
                backlog.push_back(Arc::clone(message));
                return None;
            }
        }
        self.inner.deliver(message)
    }

    /// A publish's job: as [`Self::deliver`], except that a live copy of a
    /// snapshot's message settles as no delivery (the snapshot's call was
    /// counted), rather than as one more delivered.
    fn deliver_at(
        &self,
        message: &Arc<Message<T>>,
        _position: u64,
        settled: &mut Settled,
    ) -> Option<BoxFuture> {
        if self.in_snapshot(message) {
            settled.settle(Outcome::default());
            return None;
        }
        self.deliver(message)
    }

    /// A live copy of a snapshot's message is not lost when its job is
    /// refused: the snapshot delivered it.
    fn discard_at(&self, message: &Message<T>, _position: u64) -> Option<Outcome> {
        self.in_snapshot(message).then(Outcome::default)
    }
}

impl<T, S: Tracked> Tracked for Primed<T, S> {
    fn running(&self) -> Option<Arc<Running>> {
        self.inner.running()
    }
}

impl<T: Send + Sync + 'static> Bus<T> {
    /// Publishes `data` to `topic`, as [`Bus::publish`] does, and makes it
    /// the topic's retained message: every subscription made later whose
    /// filter matches receives it first (see [`Message::is_retained`]),
    /// until another retained publish replaces it or it is cleared,
    /// evicted (`Config::max_retained`) or expires (`Config::retained_expiry`).
    ///
    /// Returns the subscriptions the live publish matched.
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
    /// use blazesub::Bus;
    ///
    /// let bus = Bus::<String>::builder().build()?;
    /// bus.publish_retained("config/db", "postgres://db-1".to_string())?;
    ///
    /// // A watcher that starts later still gets the current value first.
    /// let mut watcher = bus.subscribe_stream("config/#")?;
    /// let current = watcher.recv().await.unwrap();
    /// assert_eq!(current.data(), "postgres://db-1");
    /// assert!(current.is_retained());
    ///
    /// bus.publish_retained("config/db", "postgres://db-2".to_string())?;
    /// let update = watcher.recv().await.unwrap();
    /// assert_eq!(update.data(), "postgres://db-2");
    /// assert!(!update.is_retained()); // live
    /// # Ok(()) }
    /// ```
    ///
    /// Errors: as [`Bus::publish`]. Refused with [`Error::Full`] (a lossless
    /// stream it reaches has no room), it reaches no one and is not
    /// retained: the topic keeps the message it had.
    pub fn publish_retained(&self, topic: &str, data: T) -> Result<usize, Error> {
        self.publish_retained_message(topic, data, None)
            .map_err(|rejected| rejected.error)
    }

    /// [`Self::publish_retained`] with [`Metadata`].
    pub fn publish_retained_with(
        &self,
        topic: &str,
        data: T,
        metadata: Metadata,
    ) -> Result<usize, Error> {
        self.publish_retained_message(topic, data, Some(metadata))
            .map_err(|rejected| rejected.error)
    }

    fn publish_retained_message(
        &self,
        topic: &str,
        data: T,
        metadata: Option<Metadata>,
    ) -> Result<usize, Rejected<T>> {
        let inner = &*self.inner;
        let counters = &inner.env.counters;
        let admitted = match self.admit(topic) {
            Ok(admitted) => admitted,
            Err(error) => return Err(Rejected::with_value(error, data)),
        };
        if let Err(error) = self.check_depth(topic) {
            return Err(Rejected::with_value(error, data));
        }
        let retained = &inner.retained;
        if !retained.settled.load(Ordering::Acquire) {
            // Subscribes that skipped the store read `in_use` under the
            // trie's writer lock; passing through that lock orders each of
            // them before this publish's route is looked up.
            retained.in_use.store(true, Ordering::Relaxed);
            inner.trie.barrier();
            retained.settled.store(true, Ordering::Release);
        }
        let cached = inner.routes.route(&inner.trie, topic);
        let mut garbage = Garbage::new();
        // Handed back if the publish is refused.
        let mut data = Some(data);
        // Under the store's lock, before the message is stored: who it
        // reaches, and room in their lossless streams. A publish that finds
        // one full is refused and stores nothing (see the module docs); the
        // room it gives back wakes waiting publishers after the lock.
        let wakes = DeferWakes::begin();
        let retained = retained.retain(
            topic,
            || {
                let route = inner.routes.current(&inner.trie, &cached);
                self.reserve(&route, topic)
                    .map(|reservations| (route, reservations))
            },
            |seq| {
                let name = Arc::clone(&cached.topic);
                let data = data.take().expect("made once");
                Arc::new(self.stamp(name, data, metadata).with_seq(seq))
            },
            &mut garbage,
            counters,
        );
        drop(wakes);
        drop(garbage);
        drop(cached);
        match retained {
            Ok((message, (route, reservations))) => {
                self.fan_out(admitted, topic, route, message, Some(reservations))
            }
            Err(full) => Err(Rejected {
                error: full,
                value: data,
            }),
        }
    }

    /// Forgets `topic`'s retained message. Returns whether there was one (an
    /// invalid topic name never has one).
    ///
    /// ```
    /// use blazesub::{Bus, DeliveryMode};
    ///
    /// let bus = Bus::<u32>::builder().delivery(DeliveryMode::Inline).build()?;
    /// bus.publish_retained("flags/dark-mode", 1)?;
    /// assert!(bus.clear_retained("flags/dark-mode"));
    /// assert!(!bus.clear_retained("flags/dark-mode"));
    /// assert!(bus.retained("flags/#").is_empty());
    /// # Ok::<(), blazesub::Error>(())
    /// ```
    pub fn clear_retained(&self, topic: &str) -> bool {
        if validate_topic(topic).is_err() {
            return false;
        }
        let mut garbage = Garbage::new();
        let cleared = self
            .inner
            .retained
            .clear(topic, &mut garbage, &self.inner.env.counters);
        let was = cleared.is_some();
        drop(cleared);
        drop(garbage);
        was
    }

    /// The retained messages `filter` matches, oldest retained first, each
    /// marked [`Message::is_retained`]. A shared filter
    /// (`$share/{group}/{filter}`) reads as its filter; an invalid filter
    /// matches nothing (check it with
    /// [`topic::validate_filter`](crate::topic::validate_filter)).
    ///
    /// ```
    /// use blazesub::{Bus, DeliveryMode};
    ///
    /// let bus = Bus::<f32>::builder().delivery(DeliveryMode::Inline).build()?;
    /// bus.publish_retained("sensors/kitchen/temp", 21.5)?;
    /// bus.publish_retained("sensors/attic/temp", 14.0)?;
    /// bus.publish("sensors/attic/temp", 14.5)?; // not retained: changes nothing
    /// let temps: Vec<f32> = bus.retained("sensors/+/temp").iter().map(|m| *m.data()).collect();
    /// assert_eq!(temps, [21.5, 14.0]);
    /// # Ok::<(), blazesub::Error>(())
    /// ```
    pub fn retained(&self, filter: &str) -> Vec<Arc<Message<T>>> {
        if validate_filter(filter).is_err() {
            return Vec::new();
        }
        let filter = split_shared(filter).map_or(filter, |(_, inner)| inner);
        let mut garbage = Garbage::new();
        let found = {
            let store = self
                .inner
                .retained
                .lock_fresh(&mut garbage, &self.inner.env.counters);
            store.matching(filter)
        };
        drop(garbage);
        found
            .iter()
            .map(|origin| Arc::new(Message::retained_copy(origin)))
            .collect()
    }

    /// How many topics have a retained message now.
    pub fn retained_count(&self) -> usize {
        self.inner.retained.len(&self.inner.env.counters)
    }

    /// Subscribes a handler (not shared) with its retained snapshot.
    pub(crate) fn insert_handler<S: Sink<T> + Tracked + 'static>(
        &self,
        filter: &str,
        id: u64,
        sink: S,
    ) -> Result<Subscription, Error> {
        let inner = &*self.inner;
        let env = &inner.env;
        // A retained snapshot runs on this thread's stack, like an `Inline`
        // publish: a handler that subscribes from its snapshot call nests.
        if inner.retained.in_use() {
            self.check_depth(filter)?;
        }
        let mut sink = Some(sink);
        let mut made: Option<(Control, Arc<str>)> = None;
        let mut primed: Option<Counted<Subscriber<T, Primed<T, S>>>> = None;
        // Taken with a snapshot, before the subscription is visible, and
        // held until the snapshot and the live messages held back behind it
        // are delivered: `close` waits for those (their runners counted the
        // held-back ones finished when they handed them over).
        let mut running = None;
        let snapshot = loop {
            let mut garbage = Garbage::new();
            let mut released = Released::new();
            // The entry-makers borrow the user's handler: if the bus is
            // closed it stays in `sink`, dropped after the store's lock.
            let mut plain = None;
            let mut wrapped = None;
            let skip_store = !inner.retained.in_use();
            let store =
                (!skip_store).then(|| inner.retained.lock_fresh(&mut garbage, &env.counters));
            let snapshot = Snapshot {
                messages: store.as_ref().map_or_else(Vec::new, |s| s.matching(filter)),
                after: store.as_ref().map_or(0, |s| s.seq),
            };
            let after = snapshot.after;
            let refuse = || skip_store && inner.retained.in_use();
            if !snapshot.messages.is_empty() && running.is_none() {
                match env.counters.begin_publish() {
                    Ok(token) => running = Some(token),
                    Err(closed) => {
                        drop(store);
                        // The user's handler goes after the lock.
                        drop((garbage, sink));
                        return Err(closed);
                    }
                }
            }
            let inserted = if snapshot.messages.is_empty() {
                plain = Some(|filter: Arc<str>| {
                    let sink = sink.take().expect("the trie makes one entry");
                    let entry = Subscriber::new(sink);
                    made = Some((entry.control(), filter));
                    entry.into_handler()
                });
                inner
                    .trie
                    .insert_keeping::<Handlers>(filter, id, &mut plain, &mut released, refuse)
            } else {
                wrapped = Some(|filter: Arc<str>| {
                    let sink = Primed {
                        inner: sink.take().expect("the trie makes one entry"),
                        after,
                        ready: AtomicBool::new(false),
                        backlog: Mutex::new(VecDeque::new()),
                        capacity: inner.config.stream_capacity,
                    };
                    let entry = Subscriber::new(sink);
                    made = Some((entry.control(), filter));
                    primed = Some(entry.clone());
                    entry.into_handler()
                });
                inner.trie.insert_keeping::<Handlers>(
                    filter,
                    id,
                    &mut wrapped,
                    &mut released,
                    refuse,
                )
            };
            drop(store);
            drop((plain, wrapped, released, garbage));
            match inserted {
                Ok(true) => break snapshot,
                // A retained publish began since the check: take a snapshot.
                Ok(false) => continue,
                Err(InsertError::Closed) => {
                    drop(sink);
                    return Err(Error::Closed);
                }
            }
        };
        let (control, filter) = made.expect("the trie made the entry");
        let subscription = self.handle(control, id, filter, Kind::Handlers);
        if let Some(entry) = primed {
            let _deeper = InlineDeeper::enter();
            for origin in &snapshot.messages {
                let copy = Arc::new(Message::retained_copy(origin));
                deliver_now(&entry.sink.inner, &copy, env, running.as_mut());
            }
            drop(snapshot);
            loop {
                let batch: Vec<_> = {
                    let mut backlog = entry.sink.backlog();
                    if backlog.is_empty() {
                        entry.sink.ready.store(true, Ordering::Release);
                        break;
                    }
                    backlog.drain(..).collect()
                };
                for message in batch {
                    // Its runner counted it as delivered already.
                    env.counters.retract_delivered(1);
                    deliver_now(&entry.sink.inner, &message, env, running.as_mut());
                }
            }
        }
        drop(running);
        Ok(subscription)
    }

    /// Subscribes a sync ordered handler, with its retained snapshot. It
    /// takes the store's lock even before the first retained publish, and
    /// joins its node's ordered log before letting go of it: a retained
    /// publish (routed and numbered under that lock) is then either in the
    /// snapshot or appended to the log after the subscription reads it.
    /// The subscriber runs the snapshot itself, as the subscription's
    /// runner from the start, so live deliveries that arrive meanwhile
    /// leave their messages to it and none overlaps a snapshot call.
    pub(crate) fn insert_ordered<H>(
        &self,
        filter: &str,
        id: u64,
        handler: H,
    ) -> Result<Subscription, Error>
    where
        H: Fn(&Message<T>) + Send + Sync + 'static,
    {
        let inner = &*self.inner;
        let counters = &inner.env.counters;
        if inner.retained.in_use() {
            self.check_depth(filter)?;
        }
        // Work in progress until the snapshot has run: `close` waits for it.
        let running = counters.begin_publish()?;
        let mut garbage = Garbage::new();
        let mut released = Released::new();
        let mut handler = Some(handler);
        let mut made = None;
        let store = inner.retained.lock_fresh(&mut garbage, counters);
        let snapshot = store.matching(filter);
        let after = store.seq;
        let mut make = Some(|filter: Arc<str>| {
            let handler = handler.take().expect("the trie makes one entry");
            let sink = if snapshot.is_empty() {
                OrderedSink::new(handler, id)
            } else {
                OrderedSink::primed(handler, id, after)
            };
            let entry = Subscriber::new(sink);
            made = Some((entry.clone(), filter));
            entry.into_handler()
        });
        let inserted =
            inner
                .trie
                .insert_keeping::<Handlers>(filter, id, &mut make, &mut released, || false);
        if let Err(InsertError::Closed) = inserted {
            drop(store);
            // The user's handler, still in `handler`, goes after the lock.
            drop((released, garbage));
            return Err(Error::Closed);
        }
        let (entry, filter) = made.expect("the trie made the entry");
        if let Some(log) = inner
            .trie
            .ordered_log(&filter, inner.config.stream_capacity)
        {
            entry.sink.attach(log, Arc::clone(&inner.env.quiescence));
        }
        drop(store);
        drop((released, garbage));
        if !snapshot.is_empty() {
            let copies: Vec<_> = snapshot
                .iter()
                .map(|origin| Arc::new(Message::retained_copy(origin)))
                .collect();
            let ran = {
                let _deeper = InlineDeeper::enter();
                entry.sink.run_snapshot(&copies)
            };
            counters.add(&Tally {
                finished: 0,
                delivered: ran.delivered.into(),
                dropped: ran.dropped.into(),
                panics: ran.panics.into(),
            });
        }
        drop(running);
        Ok(self.handle(entry.control(), id, filter, Kind::Handlers))
    }

    /// Subscribes an async ordered handler (a mailbox its drain empties),
    /// with its retained snapshot: as [`Self::insert_ordered`], the store's
    /// lock is held from the snapshot to the insert. The snapshot is queued
    /// in the mailbox before the subscription is visible, each message a
    /// delivery in flight, and a drain started for it after.
    pub(crate) fn insert_ordered_async(
        &self,
        filter: &str,
        id: u64,
        mailbox: Mailbox<T>,
    ) -> Result<Subscription, Error> {
        let inner = &*self.inner;
        let counters = &inner.env.counters;
        let mut running = counters.begin_publish()?;
        let mut garbage = Garbage::new();
        let mut released = Released::new();
        let mut made = None;
        let store = inner.retained.lock_fresh(&mut garbage, counters);
        let snapshot = store.matching(filter);
        let mailbox = mailbox.after_snapshot(store.seq);
        let queued = fitting(&mailbox, &snapshot, counters);
        // In flight before they are queued: the drain finishes each.
        running.extend(queued.len() as u64);
        queue_copies(&mailbox, queued, counters);
        let mut make = Some(|filter: Arc<str>| {
            let entry = Arc::new(StreamSubscriber::new(id, mailbox));
            if let Some(running) = entry.sink.running() {
                let mailbox: Weak<dyn QueuedBehind> = Arc::downgrade(&entry) as _;
                running.queue_behind(mailbox);
            }
            made = Some((Arc::clone(&entry), filter));
            entry
        });
        let inserted =
            inner
                .trie
                .insert_keeping::<Streams>(filter, id, &mut make, &mut released, || false);
        drop(store);
        // If the bus closed, the mailbox (with the user's handler) is still
        // in the entry-maker, dropped here after the lock; and so are the
        // queued copies, counted in flight: they are settled as dropped.
        drop(make);
        drop((released, garbage));
        if let Err(InsertError::Closed) = inserted {
            counters.add(&Tally {
                finished: queued.len() as u64,
                dropped: queued.len() as u64,
                ..Tally::default()
            });
            return Err(Error::Closed);
        }
        let (entry, filter) = made.expect("the trie made the entry");
        if !queued.is_empty()
            && entry
                .sink
                .consumer()
                .and_then(|c| c.downcast_ref::<Ordered<T>>())
                .is_some_and(Ordered::claim)
        {
            start_drains(smallvec::smallvec![Arc::clone(&entry)]);
        }
        drop(running);
        Ok(self.handle(entry.control(), id, filter, Kind::Streams))
    }

    /// Subscribes a stream (not shared), with its retained snapshot if
    /// `snapshot` (a bus's own reply streams take none).
    pub(crate) fn insert_stream(
        &self,
        filter: &str,
        id: u64,
        capacity: usize,
        overflow: StreamOverflow,
        snapshot: bool,
    ) -> Result<Receiver<T>, Error> {
        if !snapshot {
            return self.insert_plain_stream(filter, id, capacity, overflow);
        }
        let inner = &*self.inner;
        let counters = &inner.env.counters;
        let mut made = None;
        loop {
            let mut garbage = Garbage::new();
            let mut released = Released::new();
            let skip_store = !inner.retained.in_use();
            let store = (!skip_store).then(|| inner.retained.lock_fresh(&mut garbage, counters));
            let messages = store.as_ref().map_or_else(Vec::new, |s| s.matching(filter));
            let mailbox = match &store {
                Some(store) if !messages.is_empty() => {
                    Mailbox::primed(capacity, overflow, store.seq)
                }
                _ => Mailbox::with_overflow(capacity, overflow),
            };
            let fitting = fitting(&mailbox, &messages, counters);
            queue_copies(&mailbox, fitting, counters);
            let mut make = Some(|filter: Arc<str>| {
                let entry = Arc::new(StreamSubscriber::new(id, mailbox));
                made = Some((Arc::clone(&entry), filter));
                entry
            });
            let refuse = || skip_store && inner.retained.in_use();
            let inserted =
                inner
                    .trie
                    .insert_keeping::<Streams>(filter, id, &mut make, &mut released, refuse);
            drop(store);
            drop((make, messages, released, garbage));
            match inserted {
                Ok(true) => break,
                // A retained publish began since the check: take a snapshot.
                Ok(false) => continue,
                Err(InsertError::Closed) => return Err(Error::Closed),
            }
        }
        let (entry, filter) = made.expect("insert made the entry");
        Ok(self.receiver(entry, filter))
    }
}

/// The messages of `snapshot` (oldest first) to push into a fresh mailbox,
/// by its overflow policy: `DropOldest` keeps the newest that
/// fit and `DropNewest` the oldest, as a burst of publishes would leave
/// them; `Backpressure`, which has no publisher to hold back here, keeps
/// the newest (a topic's latest value is what a snapshot is for). Those
/// left out are counted lost (in the mailbox and in `Stats`). `Disconnect`
/// gets one message more than fits, whose push closes it.
fn fitting<'a, T>(
    mailbox: &Mailbox<T>,
    snapshot: &'a [Arc<Message<T>>],
    counters: &Counters,
) -> &'a [Arc<Message<T>>] {
    let capacity = mailbox.capacity();
    let left_out = snapshot.len().saturating_sub(capacity);
    if left_out == 0 {
        return snapshot;
    }
    let count_lost = || {
        mailbox.count_lost(left_out as u64);
        counters.dropped_now(left_out as u64);
    };
    match mailbox.overflow() {
        StreamOverflow::DropOldest | StreamOverflow::Backpressure => {
            count_lost();
            &snapshot[left_out..]
        }
        StreamOverflow::DropNewest => {
            count_lost();
            &snapshot[..capacity]
        }
        StreamOverflow::Disconnect => &snapshot[..=capacity],
    }
}

/// Queues a retained copy of each of `snapshot` in a fresh mailbox. A
/// lossless one keeps only what room was taken for (a fresh one has room
/// for all of these); whatever a push drops is counted in `Stats` as well as
/// in the mailbox, and a push that disconnects it is counted too (and ends
/// the snapshot).
fn queue_copies<T>(mailbox: &Mailbox<T>, snapshot: &[Arc<Message<T>>], counters: &Counters) {
    for origin in snapshot {
        let reserved = mailbox.try_reserve() == Reserve::Taken;
        let pushed = mailbox.push(Arc::new(Message::retained_copy(origin)), reserved);
        if pushed.dropped > 0 {
            counters.dropped_now(pushed.dropped);
        }
        if pushed.disconnected {
            counters.disconnected();
            break;
        }
    }
}
