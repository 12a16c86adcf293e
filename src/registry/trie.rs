//! The subscription trie: which subscriptions a topic name reaches.
//!
//! # Contract
//! - **Readers never lock.** The trie's shape is an immutable snapshot behind
//!   one atomically replaced root. A reader (a publish whose route is not
//!   cached) loads the root and walks it; nothing it sees changes under it.
//! - **Writers serialise** on one mutex (`subscribe`/`unsubscribe` only; a
//!   publish never takes it). A change of shape (a node created or pruned)
//!   copies the path from the root to that node, sharing everything else
//!   (children maps are persistent hash maps, so even a node with a million
//!   children is updated in O(log n)), then stores the new root.
//! - **No user code runs under the writer lock.** Whatever a writer replaces
//!   (an old root, an old subscriber set, a pruned node's subscriptions) may
//!   hold the last reference to a removed subscription's entry, and dropping
//!   that drops the user's closure — which may own another `Subscription`
//!   and unsubscribe it, taking this lock again. Writers therefore collect
//!   what they replace in a [`Released`] list and drop it after unlocking.
//! - **Subscriber sets are shared, not copied**: every node version points to
//!   the same [`NodeSubs`], whose [`SubSet`]s accept appends in place (see
//!   `subset.rs`). So subscribing to an existing filter is an append. A
//!   cached route holds the `NodeSubs`, never a set, and loads the current
//!   set on every publish: a set that grows or is compacted is picked up
//!   at once, and an old set is pinned only by publishes still running on it.
//! - **Removed entries are released promptly.** A set is compacted (rebuilt
//!   from its live entries) on every removal of an entry that owns something
//!   while the set is small ([`EAGER_COMPACTION_LEN`] entries or fewer), and
//!   once half of it is dead otherwise, so each removal costs O(1) copies on average; a pruned
//!   node's sets are emptied. A removed handler's closure is therefore
//!   dropped once the publishes already running on its old set finish,
//!   in a small set; in a larger one, at the compaction once half of it is
//!   dead (or at once through `unsubscribe_and_wait`, which compacts).
//! - **The stamp** a route is checked against ([`Trie::stamp`]) changes,
//!   after the change is visible, whenever a reader's earlier result for
//!   that topic may no longer be complete: a filter's node gained its first
//!   subscription or lost its last. For a filter with a wildcard that is the
//!   trie-wide generation; for a filter without one, which matches exactly
//!   one topic name, only the epoch of that topic's bucket, so a service
//!   that keeps making and dropping exact subscriptions (a request's reply
//!   topic, a device's command topic) leaves every other topic's cached
//!   route warm. Appends, growth, compaction and other removals change no
//!   stamp (routes load the sets anew; a removed subscription's flag stops
//!   its deliveries). A route built after reading stamp `s` is therefore
//!   valid for as long as its topic's stamp is still `s` (`route.rs` relies
//!   on this).
//!
//! Matching follows MQTT (see `topic.rs`): `+` matches one level, `#` any
//! number including none, and first-level wildcards skip `$` topics.

use std::str::Split;
use std::sync::{Arc, OnceLock};

use rustc_hash::{FxBuildHasher, FxHashMap};
use smallvec::SmallVec;

use super::entry::{EntryControl, HandlerEntry, StreamEntry};
use super::ordered_log::OrderedLog;
use super::subset::{HandlerSet, SetEntry, StreamSet, SubSet};
use super::{Kind, Registry};
use crate::sync::{
    ArcCell, AtomicBool, AtomicU64, AtomicUsize, CellGuard, Mutex, MutexGuard, Ordering,
};
use crate::topic::is_system_topic;

/// A set this long or shorter is compacted on every removal of an entry that
/// owns something (its closure has drop glue), so that closure is released
/// at once; copying this many entries costs well under a microsecond. An
/// entry with nothing to release (a closure capturing nothing, or only
/// `Copy` data) waits for the ordinary compaction, which keeps
/// subscribe/unsubscribe churn as cheap as before.
pub(crate) const EAGER_COMPACTION_LEN: usize = 64;

/// Dead entries a set tolerates before an ordinary compaction, whatever its
/// size (a set is rebuilt once its dead entries reach this and outnumber the
/// live ones).
const MIN_DEAD_BEFORE_REBUILD: usize = 8;

/// Things a writer replaced, dropped once the writer lock is released (see
/// the module docs). Inline storage: a subscribe or unsubscribe allocates
/// nothing for it.
pub(crate) struct Released<T> {
    roots: SmallVec<[Arc<Node<T>>; 1]>,
    nodes: SmallVec<[Arc<NodeSubs<T>>; 1]>,
    handler_sets: SmallVec<[Arc<HandlerSet<T>>; 2]>,
    stream_sets: SmallVec<[Arc<StreamSet<T>>; 2]>,
    /// A filter that gained its first or lost its last visible subscription,
    /// told to the watchers once the lock is released (see [`Interest`]).
    interest: Option<InterestChange>,
}

impl<T> Released<T> {
    pub(crate) fn new() -> Self {
        Self {
            roots: SmallVec::new(),
            nodes: SmallVec::new(),
            handler_sets: SmallVec::new(),
            stream_sets: SmallVec::new(),
            interest: None,
        }
    }
}

/// Tells the watchers of an interest change once every lock is released:
/// [`Released`] is dropped after the writer lock (and any lock of the
/// caller's), so a watcher never runs under one.
impl<T> Drop for Released<T> {
    fn drop(&mut self) {
        if let Some(change) = self.interest.take() {
            for watcher in change.watchers.iter() {
                watcher.changed(&change.filter, change.gained);
            }
        }
    }
}

/// What watches which distinct filters have subscribers (a bridge, which
/// holds one upstream subscription per such filter). Called with no lock
/// of the bus held, from the thread that subscribed or unsubscribed; it
/// must be quick and must not block (a bridge updates a table and wakes its
/// task).
///
/// Only *visible* subscriptions count: those a user made, not a bridge's
/// own export taps ([`Trie::insert_tap`]). Changes for one filter may reach
/// a watcher out of order when two threads race; `gained` is +1 and a loss
/// -1 of a count whose sum is always right, so a watcher keeps a signed
/// count per filter rather than a flag.
pub(crate) trait Interest: Send + Sync {
    /// `filter` gained its first (`gained`) or lost its last (`!gained`)
    /// visible subscription.
    fn changed(&self, filter: &Arc<str>, gained: bool);
}

/// The watchers registered on a trie, shared with each change.
type Watchers = Arc<[Arc<dyn Interest>]>;

struct InterestChange {
    filter: Arc<str>,
    gained: bool,
    watchers: Watchers,
}

type Children<T> =
    imbl::GenericHashMap<Arc<str>, Arc<Node<T>>, FxBuildHasher, imbl::shared_ptr::DefaultSharedPtr>;

/// One level of a filter. Versions of a node share its `subs`.
struct Node<T> {
    children: Children<T>,
    subs: Option<Arc<NodeSubs<T>>>,
}

impl<T> Clone for Node<T> {
    fn clone(&self) -> Self {
        Self {
            children: self.children.clone(),
            subs: self.subs.clone(),
        }
    }
}

/// Dropping a node drops its children, and theirs: recursion as deep as the
/// trie. Chains of single children (what a deep filter makes) are unlinked
/// here one by one instead, so dropping a 32,768-level filter does not
/// overflow the stack. Shared children (held by another version of the trie)
/// are left to their other owner.
impl<T> Drop for Node<T> {
    fn drop(&mut self) {
        let mut next = take_only_child(&mut self.children);
        while let Some(child) = next {
            next = Arc::try_unwrap(child)
                .ok()
                .and_then(|mut child| take_only_child(&mut child.children));
        }
    }
}

fn take_only_child<T>(children: &mut Children<T>) -> Option<Arc<Node<T>>> {
    if children.len() != 1 {
        return None;
    }
    let level = children.keys().next().cloned()?;
    children.remove(&level)
}

impl<T> Node<T> {
    fn empty() -> Self {
        Self {
            children: Children::with_hasher(FxBuildHasher),
            subs: None,
        }
    }

    fn child(&self, level: &str) -> Option<&Node<T>> {
        self.children.get(level).map(|c| &**c)
    }

    fn is_empty(&self) -> bool {
        self.subs.is_none() && self.children.is_empty()
    }
}

/// The subscriptions whose filter ends at one node.
pub(crate) struct NodeSubs<T> {
    /// The node's whole filter, shared by its subscriptions' entries.
    filter: Arc<str>,
    handlers: ArcCell<HandlerSet<T>>,
    streams: ArcCell<StreamSet<T>>,
    /// The log its sync ordered handlers read (their entries sit in
    /// `handlers`), made by the first one.
    ordered: OnceLock<Arc<OrderedLog<T>>>,
    /// Set before its first stream subscription is visible, never cleared:
    /// a publish skips loading the stream set of a node that never had one.
    had_streams: AtomicBool,
}

impl<T> NodeSubs<T> {
    fn new(filter: &str) -> Self {
        Self {
            filter: Arc::from(filter),
            handlers: ArcCell::new(Arc::new(SubSet::empty())),
            streams: ArcCell::new(Arc::new(SubSet::empty())),
            ordered: OnceLock::new(),
            had_streams: AtomicBool::new(false),
        }
    }

    /// Whether a stream subscription was ever added here: if not, its
    /// stream set is empty and need not be loaded.
    #[inline]
    pub(crate) fn had_streams(&self) -> bool {
        self.had_streams.load(Ordering::SeqCst)
    }

    /// The node's ordered log, if an ordered subscription ever made one.
    #[inline]
    pub(crate) fn ordered_log(&self) -> Option<&Arc<OrderedLog<T>>> {
        self.ordered.get()
    }

    /// Active subscriptions at this node, as the writer last counted them.
    #[inline]
    pub(crate) fn live(&self) -> usize {
        self.handlers.with(|s| s.live()) + self.streams.with(|s| s.live())
    }

    /// The node's current handler set, if it has any entries.
    #[inline]
    pub(crate) fn handler_set(&self) -> Option<Arc<HandlerSet<T>>> {
        self.handlers
            .with(|set| (set.len() > 0).then(|| Arc::clone(set)))
    }

    /// Runs `f` on the node's current stream set.
    #[inline]
    pub(crate) fn with_streams<R>(&self, f: impl FnOnce(&StreamSet<T>) -> R) -> R {
        self.streams.with(|set| f(set))
    }

    /// The node's current stream set, held: a set the node replaces
    /// meanwhile (grown, compacted) stays alive, unchanged, for the holder.
    #[inline]
    pub(crate) fn stream_set(&self) -> CellGuard<StreamSet<T>> {
        self.streams.guard()
    }
}

/// Which of a node's two sets an operation is about.
pub(crate) trait SetKind<T>: 'static {
    /// What its sets hold.
    type Entry: SetEntry + 'static;
    /// Whether these are stream subscriptions (see [`Trie::had_streams`]).
    const STREAMS: bool;
    fn cell(subs: &NodeSubs<T>) -> &ArcCell<SubSet<Self::Entry>>;
    /// Keeps a replaced set of this kind for dropping after the lock.
    fn release(released: &mut Released<T>, set: Arc<SubSet<Self::Entry>>);
}

/// Handler subscriptions (sync and async).
pub(crate) enum Handlers {}
/// Stream subscriptions.
pub(crate) enum Streams {}

impl<T: 'static> SetKind<T> for Handlers {
    type Entry = HandlerEntry<T>;
    const STREAMS: bool = false;
    fn cell(subs: &NodeSubs<T>) -> &ArcCell<HandlerSet<T>> {
        &subs.handlers
    }
    fn release(released: &mut Released<T>, set: Arc<HandlerSet<T>>) {
        released.handler_sets.push(set);
    }
}

impl<T: 'static> SetKind<T> for Streams {
    type Entry = StreamEntry<T>;
    const STREAMS: bool = true;
    fn cell(subs: &NodeSubs<T>) -> &ArcCell<StreamSet<T>> {
        &subs.streams
    }
    fn release(released: &mut Released<T>, set: Arc<StreamSet<T>>) {
        released.stream_sets.push(set);
    }
}

/// The nodes a topic name reaches, as of its stamp `stamp`.
pub(crate) struct Matched<T> {
    pub(crate) stamp: u64,
    pub(crate) nodes: Vec<Arc<NodeSubs<T>>>,
}

/// State only the writer touches.
struct Writer<T> {
    /// Once set, no subscription may be added (the bus has closed).
    closed: bool,
    /// Every node that has subscriptions, by its filter: subscribing to or
    /// unsubscribing from an existing filter is one hash lookup, not a walk.
    by_filter: FxHashMap<Arc<str>, Arc<NodeSubs<T>>>,
    /// Hidden subscriptions (a bridge's export taps) per filter: they count
    /// in a node's `live`, but not as interest, nor in `subscriptions`.
    hidden: FxHashMap<Arc<str>, usize>,
    /// Who is told of interest changes; `None` (the usual case) costs a
    /// subscribe one branch.
    watchers: Option<Watchers>,
}

impl<T> Writer<T> {
    /// Visible subscriptions under `filter` (exact under the lock).
    fn visible(&self, filter: &str) -> usize {
        let live = self.by_filter.get(filter).map_or(0, |subs| subs.live());
        live - self.hidden.get(filter).copied().unwrap_or(0)
    }

    fn interest_change(&self, filter: &Arc<str>, gained: bool) -> Option<InterestChange> {
        self.watchers.as_ref().map(|watchers| InterestChange {
            filter: Arc::clone(filter),
            gained,
            watchers: Arc::clone(watchers),
        })
    }
}

/// Buckets of exact-topic epochs ([`Trie::stamp`]); a power of two.
const TOPIC_EPOCHS: usize = 256;

/// The hash a topic's stamp and route-cache slot are found by.
#[inline]
pub(crate) fn topic_hash(topic: &str) -> u64 {
    use std::hash::BuildHasher;
    FxBuildHasher.hash_one(topic)
}

pub(crate) struct Trie<T> {
    root: ArcCell<Node<T>>,
    /// Changed by subscriptions whose filter has a wildcard.
    generation: AtomicU64,
    /// Changed by subscriptions to exact topics, per bucket of topic hashes.
    topic_epochs: Box<[AtomicU64]>,
    nodes: AtomicUsize,
    subscriptions: AtomicU64,
    /// Set before the first stream subscription is visible, never cleared:
    /// until then a publish has no mailbox to look for.
    had_streams: AtomicBool,
    writer: Mutex<Writer<T>>,
}

/// Why an insert was refused.
pub(crate) enum InsertError {
    Closed,
}

impl<T: 'static> Trie<T> {
    pub(crate) fn new() -> Self {
        Self {
            root: ArcCell::new(Arc::new(Node::empty())),
            generation: AtomicU64::new(0),
            topic_epochs: (0..TOPIC_EPOCHS).map(|_| AtomicU64::new(0)).collect(),
            nodes: AtomicUsize::new(0),
            subscriptions: AtomicU64::new(0),
            had_streams: AtomicBool::new(false),
            writer: Mutex::new(Writer {
                closed: false,
                by_filter: FxHashMap::default(),
                hidden: FxHashMap::default(),
                watchers: None,
            }),
        }
    }

    /// Whether a stream subscription was ever added (a bus with handlers
    /// only skips looking for mailboxes on every publish).
    #[inline]
    pub(crate) fn had_streams(&self) -> bool {
        self.had_streams.load(Ordering::SeqCst)
    }

    /// The current stamp of the topic whose [`topic_hash`] is `hash`: the
    /// trie-wide generation plus the topic's bucket epoch (see the module
    /// docs). Both only grow, so the sum changes whenever either does.
    #[inline]
    pub(crate) fn stamp(&self, hash: u64) -> u64 {
        self.generation.load(Ordering::Acquire) + self.topic_epoch(hash).load(Ordering::Acquire)
    }

    #[inline]
    fn topic_epoch(&self, hash: u64) -> &AtomicU64 {
        &self.topic_epochs[hash as usize & (TOPIC_EPOCHS - 1)]
    }

    /// Called after `filter`'s node gained its first subscription or lost its
    /// last, once the new root is visible: changes the stamp of every topic
    /// the filter matches.
    fn invalidate(&self, filter: &str) {
        if filter.contains(['+', '#']) {
            self.generation.fetch_add(1, Ordering::Release);
        } else {
            self.topic_epoch(topic_hash(filter))
                .fetch_add(1, Ordering::Release);
        }
    }

    /// Nodes below the root (for leak checks).
    pub(crate) fn node_count(&self) -> usize {
        self.nodes.load(Ordering::Relaxed)
    }

    /// Live subscriptions.
    pub(crate) fn subscriptions(&self) -> u64 {
        self.subscriptions.load(Ordering::Relaxed)
    }

    /// Everything `topic` (a valid topic name) reaches.
    /// `hash` is the topic's [`topic_hash`].
    pub(crate) fn matched(&self, topic: &str, hash: u64) -> Matched<T> {
        let stamp = self.stamp(hash);
        let mut matched = Matched {
            stamp,
            nodes: Vec::new(),
        };
        let root = self.root.load_full();
        collect(&root, topic, &mut matched);
        matched
    }

    /// Every node whose filter overlaps `filter` (a valid, non-shared
    /// filter): shares at least one topic name with it. For requests
    /// published to a filter (`request.rs`; such routes are not cached, and
    /// their stamp is never checked).
    pub(crate) fn overlapping(&self, filter: &str) -> Matched<T> {
        let mut matched = Matched {
            stamp: 0,
            nodes: Vec::new(),
        };
        let root = self.root.load_full();
        collect_overlapping(&root, filter, &mut matched);
        matched
    }

    fn lock(&self) -> MutexGuard<'_, Writer<T>> {
        self.writer.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds subscription `id` under `filter` (a valid filter). `make` builds
    /// its entry from the filter string the node shares with its entries.
    pub(crate) fn insert<K: SetKind<T>>(
        &self,
        filter: &str,
        id: u64,
        make: impl FnOnce(Arc<str>) -> K::Entry,
    ) -> Result<(), InsertError> {
        let mut released = Released::new();
        // Passed by reference: if the bus is closed, the entry-maker (which
        // owns the user's closure) is dropped here, after the lock, too.
        let mut make = Some(make);
        let result = self.insert_locked::<K>(
            &mut self.lock(),
            filter,
            id,
            false,
            &mut make,
            &mut released,
        );
        drop(released);
        result
    }

    /// The ordered log of `filter`'s node, made with room for `capacity`
    /// messages if it has none yet; `None` if no subscription is at
    /// `filter` (call it after inserting the one that reads it).
    pub(crate) fn ordered_log(&self, filter: &str, capacity: usize) -> Option<Arc<OrderedLog<T>>> {
        let writer = self.lock();
        let subs = writer.by_filter.get(filter)?;
        Some(Arc::clone(
            subs.ordered
                .get_or_init(|| Arc::new(OrderedLog::new(capacity))),
        ))
    }

    /// Adds a *hidden* stream subscription under `filter`: a bridge's
    /// export tap. It receives what matches like any stream, but is not
    /// interest (watchers are not told of it) and is not counted in
    /// [`Self::subscriptions`]. Remove it with [`Kind::Tap`].
    #[cfg_attr(not(any(feature = "nats", feature = "mqtt")), allow(dead_code))]
    pub(crate) fn insert_tap(
        &self,
        filter: &str,
        id: u64,
        make: impl FnOnce(Arc<str>) -> StreamEntry<T>,
    ) -> Result<(), InsertError> {
        let mut released = Released::new();
        let mut make = Some(make);
        let result = self.insert_locked::<Streams>(
            &mut self.lock(),
            filter,
            id,
            true,
            &mut make,
            &mut released,
        );
        drop(released);
        result
    }

    /// Registers `watcher` for interest changes and returns the filters
    /// that have visible subscriptions now, as its starting point: every
    /// later change reaches it, none before (see [`Interest`]).
    #[cfg_attr(not(any(feature = "nats", feature = "mqtt")), allow(dead_code))]
    pub(crate) fn watch(&self, watcher: Arc<dyn Interest>) -> Vec<Arc<str>> {
        let mut writer = self.lock();
        let mut all: Vec<Arc<dyn Interest>> = writer
            .watchers
            .as_deref()
            .map(<[_]>::to_vec)
            .unwrap_or_default();
        all.push(watcher);
        writer.watchers = Some(all.into());
        writer
            .by_filter
            .keys()
            .filter(|filter| writer.visible(filter) > 0)
            .cloned()
            .collect()
    }

    /// Unregisters `watcher` (compared by address). The watcher list it
    /// was in is dropped after the lock.
    #[cfg_attr(not(any(feature = "nats", feature = "mqtt")), allow(dead_code))]
    pub(crate) fn unwatch(&self, watcher: &Arc<dyn Interest>) {
        let old = {
            let mut writer = self.lock();
            let old = writer.watchers.take();
            let rest: Vec<Arc<dyn Interest>> = old
                .iter()
                .flat_map(|all| all.iter())
                .filter(|w| !Arc::ptr_eq(w, watcher))
                .cloned()
                .collect();
            writer.watchers = (!rest.is_empty()).then(|| rest.into());
            old
        };
        drop(old);
    }

    /// The node of exactly `filter` (not the filters matching it), from
    /// the current snapshot: no lock. For a bridge that delivers a remote
    /// message to one filter's subscribers only.
    #[cfg_attr(not(any(feature = "nats", feature = "mqtt")), allow(dead_code))]
    pub(crate) fn exact(&self, filter: &str) -> Option<Arc<NodeSubs<T>>> {
        let root = self.root.load_full();
        let mut node: &Node<T> = &root;
        for level in filter.split('/') {
            node = node.child(level)?;
        }
        node.subs.clone()
    }

    /// [`Self::insert`], leaving what the insert replaced in `released`, and
    /// the entry-maker in `make` if the bus is closed or `refuse` said no,
    /// for the caller to drop once it holds no lock of its own either (the
    /// retained store subscribes under its lock; see `retained.rs`).
    ///
    /// `refuse` runs under the writer lock, before anything changes: a
    /// caller that decided something without a lock of its own checks here
    /// that it still holds, ordered against [`Self::barrier`]. Returns
    /// `Ok(false)` if it refused.
    pub(crate) fn insert_keeping<K: SetKind<T>>(
        &self,
        filter: &str,
        id: u64,
        make: &mut Option<impl FnOnce(Arc<str>) -> K::Entry>,
        released: &mut Released<T>,
        refuse: impl FnOnce() -> bool,
    ) -> Result<bool, InsertError> {
        let mut writer = self.lock();
        if !writer.closed && refuse() {
            return Ok(false);
        }
        self.insert_locked::<K>(&mut writer, filter, id, false, make, released)
            .map(|()| true)
    }

    /// Passes through the writer lock: every insert whose critical section
    /// began before this call is visible to lookups made after it returns,
    /// and every later one sees what was stored before the call (the gate
    /// `insert_keeping`'s `refuse` reads).
    pub(crate) fn barrier(&self) {
        drop(self.lock());
    }

    fn insert_locked<K: SetKind<T>>(
        &self,
        writer: &mut Writer<T>,
        filter: &str,
        id: u64,
        hidden: bool,
        make: &mut Option<impl FnOnce(Arc<str>) -> K::Entry>,
        released: &mut Released<T>,
    ) -> Result<(), InsertError> {
        if writer.closed {
            return Err(InsertError::Closed);
        }
        let make = make.take().expect("insert_locked runs once per insert");
        if K::STREAMS {
            // Before the entry is visible: a publish that can find it, or
            // that starts after this insert returns, sees the flag.
            self.had_streams.store(true, Ordering::SeqCst);
        }
        if hidden {
            self.note_hidden(writer, filter, true);
        } else {
            self.subscriptions.fetch_add(1, Ordering::Relaxed);
            if writer.watchers.is_some() && writer.visible(filter) == 0 {
                released.interest = writer.interest_change(&Arc::from(filter), true);
            }
        }
        if let Some(subs) = writer.by_filter.get(filter) {
            if K::STREAMS {
                // Before the entry is visible, as the trie's flag above.
                subs.had_streams.store(true, Ordering::SeqCst);
            }
            let cell = K::cell(subs);
            let entry = make(Arc::clone(&subs.filter));
            let set = cell.load_full();
            // SAFETY: `writer` is the trie's writer lock, held: every set
            // of this trie is written only under it, so this thread is the
            // set's only writer.
            #[allow(unsafe_code)]
            let pushed = unsafe { set.try_push(id, entry) };
            if let Err(entry) = pushed {
                // Routes hold the node, not the set: no generation bump.
                K::release(released, cell.swap(Arc::new(set.grown(id, entry))));
            }
            K::release(released, set);
            return Ok(());
        }
        let subs = Arc::new(NodeSubs::new(filter));
        subs.had_streams.store(K::STREAMS, Ordering::SeqCst);
        let entry = make(Arc::clone(&subs.filter));
        K::cell(&subs).store(Arc::new(SubSet::empty().grown(id, entry)));
        writer
            .by_filter
            .insert(Arc::clone(&subs.filter), Arc::clone(&subs));
        let root = self.root.load_full();
        let mut created = 0isize;
        let new_root = with_subs(&root, filter.split('/'), Some(subs), &mut created);
        released.roots.push(root);
        self.replace_root(filter, new_root, created, released);
        Ok(())
    }

    /// Counts a hidden subscription in or out under `filter`.
    fn note_hidden(&self, writer: &mut Writer<T>, filter: &str, added: bool) {
        if added {
            *writer.hidden.entry(Arc::from(filter)).or_insert(0) += 1;
        } else if let Some(count) = writer.hidden.get_mut(filter) {
            *count -= 1;
            if *count == 0 {
                writer.hidden.remove(filter);
            }
        }
    }

    /// Removes a subscription added under `filter`: clears its flag, so no
    /// delivery that has not started will run, then tidies the trie. Returns
    /// whether this call removed it (false if it already was). What it
    /// releases (possibly the entry's last reference, and with it the user's
    /// closure) is dropped after the writer lock is released.
    pub(crate) fn remove<K: SetKind<T>>(
        &self,
        filter: &str,
        hidden: bool,
        entry: &dyn EntryControl,
    ) -> bool {
        let mut released = Released::new();
        let removed =
            self.remove_locked::<K>(&mut self.lock(), filter, hidden, entry, &mut released);
        drop(released);
        removed
    }

    fn remove_locked<K: SetKind<T>>(
        &self,
        writer: &mut Writer<T>,
        filter: &str,
        hidden: bool,
        entry: &dyn EntryControl,
        released: &mut Released<T>,
    ) -> bool {
        // Deactivating under the writer lock keeps each set's `live` count
        // exact: a rebuild (also under the lock) sees the flag and the count
        // agree.
        if !entry.deactivate() {
            return false;
        }
        if hidden {
            self.note_hidden(writer, filter, false);
        } else {
            self.subscriptions.fetch_sub(1, Ordering::Relaxed);
        }
        let Some(subs) = writer.by_filter.get(filter).cloned() else {
            return true;
        };
        let cell = K::cell(&subs);
        let set = cell.load_full();
        set.count_removed();
        debug_assert!(
            set.live() <= set.len(),
            "live entries exceed the set's length"
        );
        if !hidden && writer.watchers.is_some() && writer.visible(filter) == 0 {
            released.interest = writer.interest_change(&subs.filter, false);
        }
        if subs.live() == 0 {
            writer.by_filter.remove(filter);
            // Routes may still hold this node: empty it, so they pin nothing.
            released
                .handler_sets
                .push(subs.handlers.swap(Arc::new(SubSet::empty())));
            released
                .stream_sets
                .push(subs.streams.swap(Arc::new(SubSet::empty())));
            let root = self.root.load_full();
            let mut created = 0isize;
            let new_root = with_subs(&root, filter.split('/'), None, &mut created);
            released.roots.push(root);
            self.replace_root(filter, new_root, created, released);
        } else if (entry.owns_resources() && set.live() <= EAGER_COMPACTION_LEN)
            || set.dead() >= MIN_DEAD_BEFORE_REBUILD.max(set.live())
        {
            K::release(released, cell.swap(Arc::new(set.compacted())));
        }
        released.nodes.push(subs);
        K::release(released, set);
        true
    }

    /// Compacts the set of kind `K` under `filter` if it holds dead entries,
    /// releasing them (after the lock) once running publishes let go of the
    /// old set. For an unsubscribe that waits for its handler to be gone.
    pub(crate) fn compact<K: SetKind<T>>(&self, filter: &str) {
        let mut released = Released::new();
        {
            let writer = self.lock();
            if let Some(subs) = writer.by_filter.get(filter) {
                let cell = K::cell(subs);
                let set = cell.load_full();
                if set.dead() > 0 {
                    K::release(&mut released, cell.swap(Arc::new(set.compacted())));
                }
                K::release(&mut released, set);
            }
        }
        drop(released);
    }

    /// Installs the root made by giving `filter`'s node its first
    /// subscription or taking its last.
    fn replace_root(
        &self,
        filter: &str,
        root: Option<Node<T>>,
        created: isize,
        released: &mut Released<T>,
    ) {
        let old = self.root.swap(Arc::new(root.unwrap_or_else(Node::empty)));
        released.roots.push(old);
        self.invalidate(filter);
        if created >= 0 {
            self.nodes
                .fetch_add(created.unsigned_abs(), Ordering::Relaxed);
        } else {
            self.nodes
                .fetch_sub(created.unsigned_abs(), Ordering::Relaxed);
        }
    }

    /// Refuses further stream subscriptions and closes every mailbox, so
    /// receivers end once they have drained what they hold.
    pub(crate) fn close_streams(&self) {
        let mut mailboxes = Vec::new();
        {
            let mut writer = self.lock();
            writer.closed = true;
            let root = self.root.load_full();
            for_each_subs(&root, &mut |subs| {
                subs.streams.with(|set| {
                    mailboxes.extend(set.entries(set.len()).cloned());
                });
            });
        }
        // Closing wakes readers and waiting publishers: their wakers run
        // after the writer lock is let go (one may unsubscribe).
        for entry in &mailboxes {
            entry.sink.close();
        }
    }
}

impl<T: Send + Sync + 'static> Registry for Trie<T> {
    fn remove(&self, filter: &str, kind: Kind, entry: &dyn EntryControl, _id: u64) -> bool {
        match kind {
            Kind::Handlers => Trie::remove::<Handlers>(self, filter, false, entry),
            Kind::Streams => Trie::remove::<Streams>(self, filter, false, entry),
            Kind::Tap => Trie::remove::<Streams>(self, filter, true, entry),
        }
    }

    fn compact(&self, filter: &str, kind: Kind) {
        match kind {
            Kind::Handlers => Trie::compact::<Handlers>(self, filter),
            Kind::Streams | Kind::Tap => Trie::compact::<Streams>(self, filter),
        }
    }
}

impl<T> Drop for Trie<T> {
    fn drop(&mut self) {
        // The bus is gone: no more messages will come, so end every stream.
        let root = self.root.load_full();
        for_each_subs(&root, &mut |subs| {
            subs.streams.with(|set| {
                for entry in set.entries(set.len()) {
                    entry.sink.close();
                }
            });
        });
    }
}

fn for_each_subs<T>(root: &Node<T>, f: &mut dyn FnMut(&NodeSubs<T>)) {
    // Iterative: a filter may have 32,768 levels, too deep to recurse.
    let mut stack = vec![root];
    while let Some(node) = stack.pop() {
        if let Some(subs) = &node.subs {
            f(subs);
        }
        stack.extend(node.children.values().map(|child| &**child));
    }
}

/// A copy of `root` with the node at the end of `levels` given `subs`,
/// creating missing nodes and pruning ones left empty. `None` if the root
/// itself ends up empty. Adjusts `created` by the nodes created and pruned.
fn with_subs<T>(
    root: &Node<T>,
    levels: Split<'_, char>,
    subs: Option<Arc<NodeSubs<T>>>,
    created: &mut isize,
) -> Option<Node<T>> {
    // Copy the path down (iteratively: filters can be 32,768 levels deep)...
    let mut path: Vec<(Node<T>, &str)> = Vec::new();
    let mut node = root.clone();
    for level in levels {
        let child = match node.child(level) {
            Some(child) => child.clone(),
            None => {
                *created += 1;
                Node::empty()
            }
        };
        path.push((node, level));
        node = child;
    }
    node.subs = subs;
    // ...then link the copies back up, dropping nodes left empty.
    let mut below = (!node.is_empty()).then_some(node);
    while let Some((mut parent, level)) = path.pop() {
        match below {
            Some(child) => {
                parent.children.insert(Arc::from(level), Arc::new(child));
            }
            None => {
                if parent.children.remove(level).is_some() {
                    *created -= 1;
                }
            }
        }
        below = (!parent.is_empty()).then_some(parent);
    }
    below
}

fn add_node<T>(node: &Node<T>, out: &mut Matched<T>) {
    if let Some(subs) = &node.subs {
        out.nodes.push(Arc::clone(subs));
    }
}

/// Adds every node matching `topic`'s levels to `out`. Iterative, with an
/// explicit stack of (node, levels still to match, at the first level).
fn collect<T>(root: &Node<T>, topic: &str, out: &mut Matched<T>) {
    let system = is_system_topic(topic);
    let mut stack = vec![(root, topic.split('/'), true)];
    while let Some((node, mut levels, first_level)) = stack.pop() {
        match levels.next() {
            None => {
                add_node(node, out);
                // `a/#` also matches `a`.
                if let Some(hash) = node.child("#") {
                    add_node(hash, out);
                }
            }
            Some(level) => {
                if !(first_level && system) {
                    if let Some(hash) = node.child("#") {
                        add_node(hash, out);
                    }
                    if let Some(plus) = node.child("+") {
                        stack.push((plus, levels.clone(), false));
                    }
                }
                // Topic names hold no wildcards, so this never aliases `+` or `#`.
                if let Some(child) = node.child(level) {
                    stack.push((child, levels, false));
                }
            }
        }
    }
}

/// Adds every node whose filter overlaps `filter` to `out` (see
/// `topic::overlaps`, which this walk agrees with). Iterative.
fn collect_overlapping<T>(root: &Node<T>, filter: &str, out: &mut Matched<T>) {
    let mut stack = vec![(root, filter.split('/'), true)];
    let mut subtree: Vec<(&Node<T>, bool)> = Vec::new();
    while let Some((node, mut levels, first_level)) = stack.pop() {
        match levels.next() {
            None => {
                add_node(node, out);
                if let Some(hash) = node.child("#") {
                    add_node(hash, out);
                }
            }
            Some("#") => {
                // `x/#` matches `x`; everything below overlaps, except `$`
                // filters under a first-level `#`.
                if !first_level {
                    add_node(node, out);
                }
                subtree.push((node, first_level));
                while let Some((at, at_root)) = subtree.pop() {
                    for (level, child) in at.children.iter() {
                        if at_root && level.starts_with('$') {
                            continue;
                        }
                        add_node(child, out);
                        subtree.push((child, false));
                    }
                }
            }
            Some("+") => {
                for (level, child) in node.children.iter() {
                    if first_level && level.starts_with('$') {
                        continue;
                    }
                    if &**level == "#" {
                        add_node(child, out);
                    } else {
                        stack.push((child, levels.clone(), false));
                    }
                }
            }
            Some(level) => {
                if !(first_level && level.starts_with('$')) {
                    if let Some(hash) = node.child("#") {
                        add_node(hash, out);
                    }
                    if let Some(plus) = node.child("+") {
                        stack.push((plus, levels.clone(), false));
                    }
                }
                if let Some(child) = node.child(level) {
                    stack.push((child, levels, false));
                }
            }
        }
    }
}
