//! The route cache: topic name → the subscriber sets it reaches.
//!
//! # Contract
//! A cache hit costs one hash, one lock-free slot load, a stamp and a
//! string comparison, and one reference-count increment: no lock, no
//! allocation, no trie walk. It **never serves a stale route**: an entry is
//! used only if it was built at its topic's *current* stamp, and the trie
//! changes a topic's stamp after every change that an existing route for it
//! could miss (see `trie.rs`: a wildcard filter's changes reach every
//! topic's stamp, an exact filter's only its own topic's). Concretely, a publish that starts after `subscribe`
//! returns reaches the new subscriber, and one that starts after
//! `unsubscribe` returns does not (the entry's own flag sees to that).
//! BlazeSub's cache can serve a list from before a change; this one cannot.
//!
//! The cache is a fixed table of slots (direct-mapped by topic hash), so its
//! memory is bounded by its capacity whatever topics are published; two
//! topics that share a slot simply evict each other.
//!
//! Each cached route carries a [`Home`]: an id of its own and the place (a
//! pool worker, a task-mode lane) that runs the route's publishes. Routes
//! get homes in turn, a route rebuilt for its topic keeps the one it had
//! (so a topic's deliveries stay in one place while its subscriptions
//! change), and the dispatcher may move a home to an idle place
//! (`dispatch/placement.rs`).

use std::sync::Arc;

use smallvec::SmallVec;

use super::entry::NO_POSITION;
use super::subset::{HandlerSet, StreamSet};
use super::trie::{topic_hash, NodeSubs, Trie};
use crate::message::Message;
use crate::sync::{AtomicUsize, OptionArcCell, Ordering};

/// The handler sets one publish reaches, loaded from its route's nodes.
/// Inline up to four (a topic rarely matches more filters): no allocation.
pub(crate) type HandlerSets<T> = SmallVec<[Arc<HandlerSet<T>>; 4]>;

/// Per handler set of a publish: its message's position in that node's
/// ordered log; empty when no set has one (most publishes). One inline:
/// a publish to ordered subscriptions rarely matches several filters that
/// have them.
pub(crate) type Positions = SmallVec<[u64; 1]>;

/// Where a route's publishes run: an id that tells this route's home from
/// another's, and the place (a number the dispatcher maps to one of its
/// workers or lanes) its publishes go to now. The place starts at the id,
/// so routes handed out in turn start in different places; a dispatcher
/// may move it (`dispatch/placement.rs`). Both are hints for where work
/// runs, never for what runs: any value is correct.
pub(crate) struct Home {
    id: usize,
    place: AtomicUsize,
    lifetime: Lifetime,
}

/// How long a home's moves last with it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lifetime {
    /// A cached route's: as long as its topic's route (kept when rebuilt).
    Cached,
    /// A route built for each publish (no route cache): not past the
    /// publish, so the place remembers them (`dispatch/placement.rs`).
    PerPublish,
    /// A route built for one delivery: it takes no part in placement.
    OneDelivery,
}

impl Home {
    /// The home of a cached route.
    pub(crate) fn new(id: usize) -> Self {
        Self {
            id,
            place: AtomicUsize::new(id),
            lifetime: Lifetime::Cached,
        }
    }

    /// The home of a route built for one publish of its topic (a bus
    /// without a route cache), with its topic's hash for an id: the same
    /// at every publish, so the place a move went to finds it again.
    pub(crate) fn per_publish(hash: usize) -> Self {
        Self {
            lifetime: Lifetime::PerPublish,
            ..Self::new(hash)
        }
    }

    /// The home of a route built for one delivery (a request to a filter,
    /// a bridge's delivery to one filter's subscribers): its place follows
    /// from `hash`, and it takes no part in placement: as a resident it
    /// would displace a topic that lasts.
    pub(crate) fn transient(hash: usize) -> Self {
        Self {
            lifetime: Lifetime::OneDelivery,
            ..Self::new(hash)
        }
    }

    pub(crate) fn id(&self) -> usize {
        self.id
    }

    /// Whether it takes part in placement (see [`Self::transient`]).
    pub(crate) fn lasts(&self) -> bool {
        self.lifetime != Lifetime::OneDelivery
    }

    /// Whether its moves are forgotten with it, and only the place it
    /// moved to remembers them (see [`Self::per_publish`]).
    pub(crate) fn forgets_moves(&self) -> bool {
        self.lifetime == Lifetime::PerPublish
    }

    /// The place its publishes go to now.
    pub(crate) fn place(&self) -> usize {
        self.place.load(Ordering::Relaxed)
    }

    /// Sends its publishes to `place` from now on.
    pub(crate) fn move_to(&self, place: usize) {
        self.place.store(place, Ordering::Relaxed);
    }

    /// The same home, for the route rebuilt for its topic.
    fn kept(&self) -> Self {
        Self {
            id: self.id,
            place: AtomicUsize::new(self.place()),
            lifetime: self.lifetime,
        }
    }
}

/// What one topic name reaches: the trie nodes whose filters match it. A
/// route holds nodes, not their subscriber sets, so a set that grows or is
/// compacted needs no new route, and a cached route never keeps an old set
/// (or the removed entries in it) alive.
pub(crate) struct Route<T> {
    pub(crate) stamp: u64,
    pub(crate) topic: Arc<str>,
    /// Where this route's publishes run (see the module docs).
    pub(crate) home: Home,
    nodes: Box<[Arc<NodeSubs<T>>]>,
}

impl<T> Route<T> {
    /// A route that is not cached (a request published to a filter).
    pub(crate) fn uncached(trie: &Trie<T>, topic: &str) -> Self
    where
        T: 'static,
    {
        let matched = trie.overlapping(topic);
        Route {
            stamp: matched.stamp,
            home: Home::transient(topic_hash(topic) as usize),
            topic: Arc::from(topic),
            nodes: matched.nodes.into_boxed_slice(),
        }
    }

    /// A route to exactly one node, for a bridge delivering a remote message
    /// to one filter's subscribers (not cached).
    #[cfg_attr(not(any(feature = "nats", feature = "mqtt")), allow(dead_code))]
    pub(crate) fn single(topic: Arc<str>, node: Arc<NodeSubs<T>>) -> Self {
        Route {
            stamp: 0,
            home: Home::transient(topic_hash(&topic) as usize),
            topic,
            nodes: Box::new([node]),
        }
    }

    /// The current handler sets of the route's nodes (empty ones left out).
    #[cfg(test)]
    pub(crate) fn handler_sets(&self) -> HandlerSets<T> {
        self.nodes
            .iter()
            .filter_map(|node| node.handler_set())
            .collect()
    }

    /// The route's current handler sets (empty ones left out) for a
    /// publish of `message`: first appends it to each node's ordered log
    /// that has readers, and records its position there in `positions`
    /// (one per set returned; `NO_POSITION` where there is no log). Appending before the set is loaded means a
    /// set that lacks an ordered subscription also lacks every one that
    /// started reading before the append.
    pub(crate) fn handler_sets_appending(
        &self,
        message: &Arc<Message<T>>,
        positions: &mut Positions,
    ) -> HandlerSets<T> {
        let mut sets = HandlerSets::new();
        for node in self.nodes.iter() {
            let position = node
                .ordered_log()
                .filter(|log| log.has_members())
                .map_or(NO_POSITION, |log| log.append(message));
            if let Some(set) = node.handler_set() {
                // Left empty until a set has a log: most publishes reach no
                // ordered subscription and carry no positions.
                if position != NO_POSITION || !positions.is_empty() {
                    positions.resize(sets.len(), NO_POSITION);
                    positions.push(position);
                }
                sets.push(set);
            }
        }
        sets
    }

    /// Ids of the active handler subscriptions the route reaches now.
    #[cfg(test)]
    pub(crate) fn active_ids(&self) -> Vec<u64> {
        self.handler_sets()
            .iter()
            .flat_map(|set| set.entries_with_ids(set.len()))
            .filter(|(_, entry)| entry.is_active())
            .map(|(id, _)| id)
            .collect()
    }

    /// Subscriptions a publish to this route would reach now.
    #[inline]
    pub(crate) fn subscribers(&self) -> usize {
        self.nodes.iter().map(|node| node.live()).sum()
    }

    /// Runs `f` on the current stream set of each of the route's nodes
    /// that ever had a stream subscription (the others' are empty).
    #[inline]
    pub(crate) fn for_each_stream_set(&self, mut f: impl FnMut(&StreamSet<T>)) {
        for node in self.nodes.iter().filter(|node| node.had_streams()) {
            node.with_streams(&mut f);
        }
    }

    /// The route's nodes, in the order of [`Self::for_each_stream_set`].
    #[inline]
    pub(crate) fn nodes(&self) -> impl Iterator<Item = &NodeSubs<T>> {
        self.nodes.iter().map(|node| &**node)
    }
}

pub(crate) struct RouteCache<T> {
    slots: Box<[OptionArcCell<Route<T>>]>,
    /// The home the next new route gets.
    next_home: AtomicUsize,
}

impl<T: 'static> RouteCache<T> {
    /// A cache of `capacity` slots, rounded up to a power of two; 0 disables it.
    pub(crate) fn new(capacity: usize) -> Self {
        let slots = if capacity == 0 {
            0
        } else {
            capacity.next_power_of_two()
        };
        Self {
            slots: (0..slots).map(|_| OptionArcCell::empty()).collect(),
            next_home: AtomicUsize::new(0),
        }
    }

    /// The route for `topic` (a valid topic name), from the cache if it holds a
    /// current one, else from the trie (and then cached).
    pub(crate) fn route(&self, trie: &Trie<T>, topic: &str) -> Arc<Route<T>> {
        let hash = topic_hash(topic);
        self.cached(trie, topic, hash, Arc::clone)
            .unwrap_or_else(|| self.build_and_cache(trie, topic, hash))
    }

    /// How many subscriptions a publish to `topic` would reach now: as
    /// [`Self::route`], but a hit is read in place, without taking a
    /// reference to the cached route (a read-modify-write on its count and
    /// another to drop it, most of an interest query's cost).
    pub(crate) fn subscribers(&self, trie: &Trie<T>, topic: &str) -> usize {
        let hash = topic_hash(topic);
        self.cached(trie, topic, hash, |route| route.subscribers())
            .unwrap_or_else(|| self.build_and_cache(trie, topic, hash).subscribers())
    }

    /// `read` of the cached route for `topic`, if the cache holds a current
    /// one (`None` when it is disabled, empty, stale or another topic's).
    fn cached<R>(
        &self,
        trie: &Trie<T>,
        topic: &str,
        hash: u64,
        read: impl FnOnce(&Arc<Route<T>>) -> R,
    ) -> Option<R> {
        if self.slots.is_empty() {
            return None;
        }
        let stamp = trie.stamp(hash);
        self.slot(hash).with(|cached| {
            cached
                .filter(|r| r.stamp == stamp && &*r.topic == topic)
                .map(read)
        })
    }

    /// `cached` (a route this cache gave out) if it is still current for its
    /// topic, else the topic's route built now, with the same home, and not
    /// cached: the call replaces (and drops) nothing in the cache, so it may
    /// run under a lock.
    pub(crate) fn current(&self, trie: &Trie<T>, cached: &Arc<Route<T>>) -> Arc<Route<T>> {
        let hash = topic_hash(&cached.topic);
        if trie.stamp(hash) == cached.stamp {
            return Arc::clone(cached);
        }
        Arc::new(build(trie, &cached.topic, hash, cached.home.kept()))
    }

    /// Builds the route from the trie and caches it (when the cache is on).
    fn build_and_cache(&self, trie: &Trie<T>, topic: &str, hash: u64) -> Arc<Route<T>> {
        if self.slots.is_empty() {
            return Arc::new(build(trie, topic, hash, Home::per_publish(hash as usize)));
        }
        let slot = self.slot(hash);
        let home = slot
            .with(|old| {
                old.filter(|old| &*old.topic == topic)
                    .map(|old| old.home.kept())
            })
            .unwrap_or_else(|| Home::new(self.next_home.fetch_add(1, Ordering::Relaxed)));
        let route = Arc::new(build(trie, topic, hash, home));
        slot.store(Some(Arc::clone(&route)));
        route
    }

    fn slot(&self, hash: u64) -> &OptionArcCell<Route<T>> {
        &self.slots[hash as usize & (self.slots.len() - 1)]
    }

    /// Slots holding a route at its topic's current stamp (for leak checks).
    pub(crate) fn current_entries(&self, trie: &Trie<T>) -> usize {
        self.slots
            .iter()
            .filter(|slot| {
                slot.with(|r| r.is_some_and(|r| r.stamp == trie.stamp(topic_hash(&r.topic))))
            })
            .count()
    }

    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }
}

fn build<T: 'static>(trie: &Trie<T>, topic: &str, hash: u64, home: Home) -> Route<T> {
    let matched = trie.matched(topic, hash);
    Route {
        stamp: matched.stamp,
        home,
        topic: Arc::from(topic),
        nodes: matched.nodes.into_boxed_slice(),
    }
}

// Plain unit tests: under `--cfg loom` the atomics they touch are loom's,
// usable only inside a model (`loom_tests.rs` races the same lookups).
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::registry::counted::Counted;
    use crate::registry::entry::{Subscriber, SyncSink};
    use crate::registry::trie::Handlers;

    type Entry = Counted<Subscriber<u32, SyncSink<fn(&Message<u32>)>>>;

    fn subscribe(trie: &Trie<u32>, filter: &str, id: u64) -> Entry {
        let entry: Entry = Subscriber::new(SyncSink(|_| {}));
        let inserted = entry.clone().into_handler();
        assert!(trie.insert::<Handlers>(filter, id, |_| inserted).is_ok());
        entry
    }

    #[test]
    fn an_exact_subscription_coming_and_going_leaves_other_routes_cached() {
        let (trie, cache) = (Trie::<u32>::new(), RouteCache::<u32>::new(64));
        subscribe(&trie, "orders/created", 1);
        let warm = cache.route(&trie, "orders/created");
        // A request's reply topic: a node made, then pruned.
        let reply = subscribe(&trie, "$reply/1/7", 2);
        assert_eq!(cache.route(&trie, "$reply/1/7").active_ids(), [2]);
        assert!(trie.remove::<Handlers>("$reply/1/7", false, &*reply));
        assert!(cache.route(&trie, "$reply/1/7").active_ids().is_empty());
        assert!(
            Arc::ptr_eq(&warm, &cache.route(&trie, "orders/created")),
            "an exact filter elsewhere must not invalidate this route"
        );
        // A wildcard filter may match any topic: every route is rebuilt.
        subscribe(&trie, "orders/+", 3);
        let rebuilt = cache.route(&trie, "orders/created");
        assert!(!Arc::ptr_eq(&warm, &rebuilt));
        assert_eq!(rebuilt.active_ids(), [1, 3]);
    }

    #[test]
    fn an_exact_subscription_reaches_its_own_cached_route() {
        let (trie, cache) = (Trie::<u32>::new(), RouteCache::<u32>::new(64));
        subscribe(&trie, "a/#", 1);
        assert_eq!(cache.route(&trie, "a/b").active_ids(), [1]);
        // A new node for exactly this topic.
        let exact = subscribe(&trie, "a/b", 2);
        let mut reached = cache.route(&trie, "a/b").active_ids();
        reached.sort_unstable();
        assert_eq!(reached, [1, 2]);
        // Its last subscription gone: the route no longer holds the node.
        assert!(trie.remove::<Handlers>("a/b", false, &*exact));
        assert_eq!(cache.route(&trie, "a/b").active_ids(), [1]);
    }
}
