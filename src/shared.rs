//! Shared subscriptions: MQTT 5's `$share/{group}/{filter}` (§4.8.2). The
//! members of one group on one filter share its messages: each matching
//! publish goes to exactly one of them.
//!
//! # Contract
//! - Every subscribe call accepts a shared filter ([`Bus::subscribe`],
//!   [`Bus::subscribe_async`], [`Bus::subscribe_stream`], ...), and a group
//!   may mix handler and stream members. A group is its share name *and* its
//!   filter: `$share/g/a/#` and `$share/g/b/#` are two groups.
//! - **Exactly one member.** A matching publish picks one live member, on
//!   the publisher's thread, by [`SharePolicy`]: the publish counts the group
//!   once in its result. A stream member gets the message pushed into its
//!   mailbox then and there (in publish order, as any stream, but for what
//!   a leaving member hands it: that comes after what it holds); a handler
//!   member gets it as one more delivery of the publish's job, run where the
//!   delivery mode runs handlers.
//! - **Leaving loses nothing silently.** A handler member that leaves
//!   (unsubscribe or drop) is never called again; a delivery already picked
//!   for it but not started goes to another member instead, or, with none
//!   left, is counted as dropped. A stream member that leaves hands every
//!   message still queued in its mailbox to the other members, in order
//!   (picked by the policy, on the thread dropping the receiver); with none
//!   left they are counted as dropped. A handler member gets each as a job
//!   of its own, run where the delivery mode runs handlers, so dropping a
//!   `Receiver` runs a handler only where a publish would (in `Inline`
//!   mode, or under `CallerRuns` with no room). A publish racing the leave
//!   that pushes into the mailbox after it was handed over takes its
//!   message back and passes it on itself (the receiver's drop leaves it
//!   alone); so does one pushing into a member that is leaving too, which
//!   returns its whole queue: each message is passed on in turn.
//! - Retained messages are not sent to shared subscriptions (MQTT 5
//!   §4.8.2); [`Bus::retained`] reads a shared filter as its filter.
//! - Least loaded counts a stream member's unread messages and a handler
//!   member's deliveries picked and not yet finished (an async handler's
//!   until its future ends). A delivery an overflow policy drops
//!   (`Overflow::Drop`/`Error`) stays counted as load: that member looks a
//!   little busier than it is.
//!
//! # Cost
//! A publish on a bus without shared groups pays one atomic load. With
//! groups, it checks each group's filter against the topic (groups, not
//! members: a group of a thousand members is one check) and picks a member
//! with one or a few atomic operations; no lock, no allocation (a handler
//! member's one-entry subscriber set is made when it joins). The sets of
//! the handler members a publish picks go into one list, inline up to four
//! groups: past that it allocates, by doubling.
//!
//! # Locks
//! Joining and leaving take the groups' one lock; publishers never do. What
//! a change replaces (old member lists, a departed member's handler) is
//! dropped after it is released, and a leaving stream member hands its
//! queue over with no lock held.

use std::future::Future;
use std::hash::BuildHasher;
use std::sync::{Arc, Weak};

use rustc_hash::{FxBuildHasher, FxHashMap};

use crate::bus::{Bus, BusInner};
use crate::config::SharePolicy;
use crate::dispatch::Env;
use crate::error::Error;
use crate::handles::{Receiver, Subscription};
use crate::message::Message;
use crate::registry::entry::{
    BoxFuture, Control, EntryControl, HandlerEntry, Sink, StreamEntry, StreamSubscriber,
    Subscriber, Tracked,
};
use crate::registry::mailbox::Mailbox;
use crate::registry::quiesce::Running;
use crate::registry::route::HandlerSets;
use crate::registry::subset::{HandlerSet, SubSet};
use crate::registry::{Kind, Registry};
use crate::stats::Counters;
use crate::sync::{ArcCell, AtomicBool, AtomicU64, AtomicUsize, Mutex, MutexGuard, Ordering};
use crate::topic::{matches_valid, overlaps, split_shared};

/// Load counters of up to eight handler members of one group, in one cache
/// line: least loaded reads one line for eight members, where a counter per
/// member would cost a cache miss per member read. A slot is never reused
/// (a member that left may still have deliveries finishing); a full table
/// is replaced by a fresh one for the members that join next, and freed
/// with its last member.
#[repr(align(64))]
struct LoadTable([AtomicUsize; LOAD_SLOTS]);

const LOAD_SLOTS: usize = 8;

impl LoadTable {
    fn new() -> Self {
        Self(std::array::from_fn(|_| AtomicUsize::new(0)))
    }
}

/// One handler member's state, shared by its sink and the group.
struct MemberState {
    /// The member left: deliveries picked for it go elsewhere.
    left: AtomicBool,
    /// Whether the load is kept: only under `SharePolicy::LeastLoaded`, the
    /// one policy that reads it (the others touch no shared counter).
    counts_load: bool,
    /// Its deliveries picked and not yet finished: `table.0[slot]`.
    table: Arc<LoadTable>,
    slot: usize,
}

impl MemberState {
    #[inline]
    fn picked(&self) {
        if self.counts_load {
            self.table.0[self.slot].fetch_add(1, Ordering::Relaxed);
        }
    }

    #[inline]
    fn finished(&self) {
        if self.counts_load {
            self.table.0[self.slot].fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Deliveries picked and not finished.
    fn load(&self) -> usize {
        self.table.0[self.slot].load(Ordering::Relaxed)
    }
}

/// A member of a group.
enum Member<T> {
    Handler {
        id: u64,
        entry: HandlerEntry<T>,
        /// A subscriber set holding only `entry`, made once, appended to a
        /// publish's handler sets when this member is picked.
        set: Arc<HandlerSet<T>>,
        state: Arc<MemberState>,
    },
    Stream {
        id: u64,
        entry: StreamEntry<T>,
    },
}

impl<T> Clone for Member<T> {
    fn clone(&self) -> Self {
        match self {
            Member::Handler {
                id,
                entry,
                set,
                state,
            } => Member::Handler {
                id: *id,
                entry: entry.clone(),
                set: Arc::clone(set),
                state: Arc::clone(state),
            },
            Member::Stream { id, entry } => Member::Stream {
                id: *id,
                entry: Arc::clone(entry),
            },
        }
    }
}

impl<T> Member<T> {
    fn id(&self) -> u64 {
        match self {
            Member::Handler { id, .. } | Member::Stream { id, .. } => *id,
        }
    }

    fn load(&self) -> usize {
        match self {
            Member::Handler { state, .. } => state.load(),
            Member::Stream { entry, .. } => entry.sink.len(),
        }
    }
}

/// The members of one `$share/{group}/{filter}`.
pub(crate) struct Group<T> {
    /// The filter without its `$share/{group}/` prefix.
    filter: Box<str>,
    members: ArcCell<Vec<Member<T>>>,
    /// Round robin's turn, and least loaded's tie-breaker.
    turn: AtomicUsize,
    policy: SharePolicy,
    /// The load table new handler members take a slot in, and its next
    /// free slot (changed under the groups' lock only).
    loads: Mutex<(Arc<LoadTable>, usize)>,
}

impl<T> Group<T> {
    /// A new handler member's state, with a load slot of its own.
    fn member_state(&self) -> MemberState {
        let mut loads = self.loads.lock().unwrap_or_else(|e| e.into_inner());
        if loads.1 == LOAD_SLOTS {
            *loads = (Arc::new(LoadTable::new()), 0);
        }
        let slot = loads.1;
        loads.1 += 1;
        MemberState {
            left: AtomicBool::new(false),
            counts_load: self.policy == SharePolicy::LeastLoaded,
            table: Arc::clone(&loads.0),
            slot,
        }
    }

    /// Picks the member for a message to `topic` among `members`.
    fn pick<'m>(&self, members: &'m [Member<T>], topic: &str) -> Option<&'m Member<T>> {
        let len = members.len();
        if len <= 1 {
            return members.first();
        }
        let index = match self.policy {
            SharePolicy::RoundRobin => self.turn.fetch_add(1, Ordering::Relaxed) % len,
            SharePolicy::TopicHash => (FxBuildHasher.hash_one(topic) as usize) % len,
            SharePolicy::LeastLoaded => {
                // Ties go round robin, so idle members share the work.
                let start = self.turn.fetch_add(1, Ordering::Relaxed) % len;
                let mut best = start;
                let mut best_load = members[start].load();
                for step in 1..len {
                    if best_load == 0 {
                        break;
                    }
                    let at = (start + step) % len;
                    let load = members[at].load();
                    if load < best_load {
                        best = at;
                        best_load = load;
                    }
                }
                best
            }
        };
        members.get(index)
    }
}

/// What the groups' lock guards.
struct Groups<T> {
    /// By the whole shared filter (`$share/g/a/#`).
    by_filter: FxHashMap<Arc<str>, Arc<Group<T>>>,
    closed: bool,
}

/// Every shared group of a bus.
pub(crate) struct SharedGroups<T> {
    policy: SharePolicy,
    env: Arc<Env>,
    groups: Mutex<Groups<T>>,
    /// The groups as publishers read them.
    list: ArcCell<Vec<Arc<Group<T>>>>,
    /// Groups in `list`: a publish checks this first.
    active: AtomicUsize,
    /// Members of all groups.
    members: AtomicU64,
    /// The bus, set once it is made: a message a leaving stream member
    /// hands to a handler member becomes a job of its own there.
    bus: std::sync::OnceLock<Weak<BusInner<T>>>,
}

/// How many times a passed-on message may bounce off leaving stream members
/// before it is counted dropped (see [`SharedGroups::pass_on`]).
const MAX_BOUNCES: u32 = 64;

/// Messages a leaving stream member bounced back to a publisher, with their
/// group.
type Bounced<T> = (Arc<Group<T>>, Vec<Arc<Message<T>>>);

/// Things a change replaced, dropped after the lock.
type Replaced<T> = (Option<Arc<Vec<Member<T>>>>, Option<Arc<Vec<Arc<Group<T>>>>>);

impl<T> SharedGroups<T> {
    /// Members of all groups.
    pub(crate) fn members(&self) -> u64 {
        self.members.load(Ordering::Relaxed)
    }
}

impl<T: Send + Sync + 'static> SharedGroups<T> {
    pub(crate) fn new(policy: SharePolicy, env: &Arc<Env>) -> Self {
        Self {
            policy,
            env: Arc::clone(env),
            groups: Mutex::new(Groups {
                by_filter: FxHashMap::default(),
                closed: false,
            }),
            list: ArcCell::new(Arc::new(Vec::new())),
            active: AtomicUsize::new(0),
            members: AtomicU64::new(0),
            bus: std::sync::OnceLock::new(),
        }
    }

    /// Called once the bus that owns these groups is made.
    pub(crate) fn set_bus(&self, bus: Weak<BusInner<T>>) {
        let _ = self.bus.set(bus);
    }

    fn lock(&self) -> MutexGuard<'_, Groups<T>> {
        self.groups.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Picks one member of every group matching `message`'s topic: pushes
    /// into a stream member's mailbox, or adds a handler member's set to
    /// `sets`. Returns how many groups it reached.
    #[inline]
    pub(crate) fn route(
        &self,
        message: &Arc<Message<T>>,
        sets: &mut HandlerSets<T>,
        counters: &Counters,
    ) -> usize {
        if self.active.load(Ordering::Acquire) == 0 {
            return 0;
        }
        self.route_slow(message, sets, counters)
    }

    /// How many groups a publish to `topic` (a valid topic name) would
    /// reach now: those matching it with a member. No lock, no allocation;
    /// one load on a bus without groups.
    #[inline]
    pub(crate) fn reached(&self, topic: &str) -> usize {
        if self.active.load(Ordering::Acquire) == 0 {
            return 0;
        }
        self.list.with(|groups| {
            groups
                .iter()
                .filter(|group| {
                    matches_valid(&group.filter, topic)
                        && group.members.with(|members| !members.is_empty())
                })
                .count()
        })
    }

    fn route_slow(
        &self,
        message: &Arc<Message<T>>,
        sets: &mut HandlerSets<T>,
        counters: &Counters,
    ) -> usize {
        let topic = message.topic();
        // A request may be published to a filter: it reaches the groups
        // whose filter overlaps it.
        let to_filter = topic.contains(['+', '#']);
        let mut reached = 0;
        // Messages a leaving stream member bounced, passed on after the
        // loads below are let go (passing on may run a handler).
        let mut bounced: Vec<Bounced<T>> = Vec::new();
        self.list.with(|groups| {
            for group in groups.iter() {
                let reaches = if to_filter {
                    overlaps(&group.filter, topic)
                } else {
                    matches_valid(&group.filter, topic)
                };
                if !reaches {
                    continue;
                }
                group
                    .members
                    .with(|members| match group.pick(members, topic) {
                        Some(Member::Handler { set, state, .. }) => {
                            state.picked();
                            sets.push(Arc::clone(set));
                            reached += 1;
                        }
                        Some(Member::Stream { entry, .. }) => {
                            let mut back = Vec::new();
                            let dropped = entry.sink.push_or_return(Arc::clone(message), &mut back);
                            if dropped > 0 {
                                counters.dropped_now(dropped);
                            }
                            if !back.is_empty() {
                                bounced.push((Arc::clone(group), back));
                            }
                            reached += 1;
                        }
                        None => {}
                    });
            }
        });
        for (group, messages) in bounced {
            for message in messages {
                self.pass_on(&group, message, counters);
            }
        }
        reached
    }

    /// Gives `message`, which a leaving stream member could not keep, to a
    /// member of the group's current list; counts it dropped if none can
    /// take it. A stream member it is pushed into may be leaving too, and
    /// bounce it back with the rest of its queue: each message is passed on
    /// again, in its order, until a member keeps it. A handler member gets
    /// it as a job of its own, run where the delivery mode runs handlers.
    fn pass_on(&self, group: &Group<T>, message: Arc<Message<T>>, counters: &Counters) {
        // Each message with the bounces it has taken: each bounce finds the
        // list without the member that bounced it (it leaves the list
        // before it closes), so a message bounces at most once per member
        // leaving meanwhile; bounded all the same, per message (a bounce
        // returns a whole queue, which must not share one budget).
        let mut pending = std::collections::VecDeque::from([(message, 0u32)]);
        let mut back = Vec::new();
        while let Some((message, bounces)) = pending.pop_front() {
            if bounces > MAX_BOUNCES {
                counters.dropped_now(1);
                continue;
            }
            let members = group.members.load_full();
            match group.pick(&members, message.topic()) {
                Some(Member::Handler { set, state, .. }) => {
                    state.picked();
                    if !self.hand_to_handler(Arc::clone(set), message, counters) {
                        state.finished();
                    }
                }
                Some(Member::Stream { entry, .. }) => {
                    let dropped = entry.sink.push_or_return(message, &mut back);
                    if dropped > 0 {
                        counters.dropped_now(dropped);
                    }
                    pending.extend(back.drain(..).map(|message| (message, bounces + 1)));
                }
                None => counters.dropped_now(1),
            }
        }
    }

    /// A passed-on message for a handler member (its one-entry `set`): a
    /// job of its own, as a publish's delivery would be, so the thread
    /// passing it on (one dropping a `Receiver`, or a publisher) runs the
    /// handler only where a publisher would: in `Inline` mode, or under
    /// `CallerRuns` with no room. `false` if it was dropped (counted)
    /// instead: the bus is gone or closing, or the overflow policy dropped
    /// it; the caller then takes the pick off the member's load.
    fn hand_to_handler(
        &self,
        set: Arc<HandlerSet<T>>,
        message: Arc<Message<T>>,
        counters: &Counters,
    ) -> bool {
        match self.bus.get().and_then(Weak::upgrade) {
            Some(inner) => Bus { inner }.dispatch_to(message, set),
            None => {
                counters.dropped_now(1);
                false
            }
        }
    }

    /// Adds `member` to the group of `filter` (a valid shared filter),
    /// making the group if needed.
    fn join(
        &self,
        filter: &Arc<str>,
        make: impl FnOnce(&Arc<Group<T>>) -> Member<T>,
    ) -> Result<(), Error> {
        let mut replaced: Replaced<T> = (None, None);
        {
            let mut groups = self.lock();
            if groups.closed {
                return Err(Error::Closed);
            }
            let group = match groups.by_filter.get(filter) {
                Some(group) => Arc::clone(group),
                None => {
                    let (_, inner) = split_shared(filter).unwrap_or(("", filter));
                    let group = Arc::new(Group {
                        filter: inner.into(),
                        members: ArcCell::new(Arc::new(Vec::new())),
                        turn: AtomicUsize::new(0),
                        policy: self.policy,
                        loads: Mutex::new((Arc::new(LoadTable::new()), 0)),
                    });
                    groups
                        .by_filter
                        .insert(Arc::clone(filter), Arc::clone(&group));
                    replaced.1 = Some(self.publish_list(&groups));
                    group
                }
            };
            let member = make(&group);
            let mut members: Vec<Member<T>> = group.members.load_full().iter().cloned().collect();
            members.push(member);
            replaced.0 = Some(group.members.swap(Arc::new(members)));
            self.members.fetch_add(1, Ordering::Relaxed);
        }
        drop(replaced);
        Ok(())
    }

    /// Republishes the groups list from `groups`; returns the old list.
    fn publish_list(&self, groups: &Groups<T>) -> Arc<Vec<Arc<Group<T>>>> {
        let list: Vec<Arc<Group<T>>> = groups.by_filter.values().cloned().collect();
        self.active.store(list.len(), Ordering::Release);
        self.list.swap(Arc::new(list))
    }

    /// Takes member `id` out of the group of `filter`. Returns it and the
    /// group, or `None` if it was not there.
    fn leave(&self, filter: &str, id: u64) -> Option<(Member<T>, Arc<Group<T>>)> {
        let mut replaced: Replaced<T> = (None, None);
        let result = {
            let mut groups = self.lock();
            let group = groups.by_filter.get(filter).cloned()?;
            let current = group.members.load_full();
            let at = current.iter().position(|m| m.id() == id)?;
            let member = current[at].clone();
            let rest: Vec<Member<T>> = current.iter().filter(|m| m.id() != id).cloned().collect();
            let nobody_left = rest.is_empty();
            replaced.0 = Some(group.members.swap(Arc::new(rest)));
            if nobody_left {
                groups.by_filter.remove(filter);
                replaced.1 = Some(self.publish_list(&groups));
            }
            self.members.fetch_sub(1, Ordering::Relaxed);
            drop(current);
            (member, group)
        };
        drop(replaced);
        Some(result)
    }

    /// The group of `filter` (a shared filter) now, if it has one.
    fn group_of(&self, filter: &str) -> Option<Arc<Group<T>>> {
        self.lock().by_filter.get(filter).cloned()
    }

    /// Ends every stream member's mailbox (the bus closed or is gone), and
    /// refuses new members.
    pub(crate) fn close_streams(&self) {
        let mut mailboxes = Vec::new();
        {
            let mut groups = self.lock();
            groups.closed = true;
            for group in groups.by_filter.values() {
                group.members.with(|members| {
                    for member in members.iter() {
                        if let Member::Stream { entry, .. } = member {
                            mailboxes.push(Arc::clone(entry));
                        }
                    }
                });
            }
        }
        // Closing wakes readers and waiting publishers: their wakers run
        // after the groups' lock is let go (one may unsubscribe).
        for entry in &mailboxes {
            entry.sink.close();
        }
    }
}

impl<T: Send + Sync + 'static> Registry for SharedGroups<T> {
    fn remove(&self, filter: &str, kind: Kind, entry: &dyn EntryControl, id: u64) -> bool {
        let _ = (kind, entry);
        let Some((member, group)) = self.leave(filter, id) else {
            return false;
        };
        match member {
            Member::Handler { state, .. } => {
                // After the list no longer holds it: a redirect never picks it.
                state.left.store(true, Ordering::SeqCst);
            }
            Member::Stream { entry, .. } => {
                // Hand the queue over, with no lock held. Pushes from now on
                // bounce back to their publisher, who passes them on.
                entry.sink.leaving();
                // The list no longer holds it, so each is passed to another
                // member, bouncing (boundedly) off any whose mailbox closed.
                // Admitted like a publish, so `close` waits for the hand-
                // over; once the bus is closing, nothing is handed over (no
                // handler is called after `close` returned): counted.
                let admitted = self.env.counters.begin_publish();
                while let Some(message) = entry.sink.take() {
                    if admitted.is_ok() {
                        self.pass_on(&group, message, &self.env.counters);
                    } else {
                        self.env.counters.dropped_now(1);
                    }
                }
                drop(admitted);
            }
        }
        true
    }

    fn compact(&self, _filter: &str, _kind: Kind) {}
}

impl<T> Drop for SharedGroups<T> {
    fn drop(&mut self) {
        // The bus is gone: end every stream member's mailbox.
        let groups = self.groups.get_mut().unwrap_or_else(|e| e.into_inner());
        for group in groups.by_filter.values() {
            group.members.with(|members| {
                for member in members.iter() {
                    if let Member::Stream { entry, .. } = member {
                        entry.sink.close();
                    }
                }
            });
        }
    }
}

/// A handler member's sink: counts its load, and sends a delivery picked for
/// it after it left to another member.
struct MemberSink<T, S> {
    inner: S,
    state: Arc<MemberState>,
    group: Weak<Group<T>>,
    /// The group's shared filter: where a member that joined after this
    /// group emptied is found.
    key: Arc<str>,
    shared: Weak<SharedGroups<T>>,
    counters: Arc<Counters>,
}

/// Takes one delivery off a member's load when an async delivery ends,
/// however it ends.
struct Unload(Arc<MemberState>);

impl Drop for Unload {
    fn drop(&mut self) {
        self.0.finished();
    }
}

/// [`Unload`] for a delivery that ends within the call (or panics there).
struct UnloadHere<'a>(&'a MemberState);

impl Drop for UnloadHere<'_> {
    fn drop(&mut self) {
        self.0.finished();
    }
}

impl<T: Send + Sync + 'static, S: Sink<T>> Sink<T> for MemberSink<T, S> {
    #[inline]
    fn deliver(&self, message: &Arc<Message<T>>) -> Option<BoxFuture> {
        if self.state.left.load(Ordering::Acquire) {
            self.state.finished();
            return self.redirect(message);
        }
        if !self.state.counts_load {
            return self.inner.deliver(message);
        }
        let here = UnloadHere(&self.state);
        let future = self.inner.deliver(message)?;
        // Still running: off the load when the future ends instead.
        std::mem::forget(here);
        Some(Box::pin(Unloading {
            future,
            _unload: Unload(Arc::clone(&self.state)),
        }))
    }
}

/// An async member delivery that takes itself off the load when it ends.
struct Unloading {
    future: BoxFuture,
    _unload: Unload,
}

impl Future for Unloading {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        self.future.as_mut().poll(cx)
    }
}

impl<T: Send + Sync + 'static, S> MemberSink<T, S> {
    /// A delivery for this member, which has left: to another member, from
    /// this runner. The runner counts what this returns as one delivery, so
    /// a push (counted when read) or a drop takes that count back.
    fn redirect(&self, message: &Arc<Message<T>>) -> Option<BoxFuture> {
        let counters = &self.counters;
        let mut members = self
            .group
            .upgrade()
            .map(|group| (group.members.load_full(), group));
        if members.as_ref().is_none_or(|(list, _)| list.is_empty()) {
            // This was the group's last member, and the group went with
            // it: one that joined since is in the filter's group now.
            if let Some(now) = self.shared.upgrade().and_then(|s| s.group_of(&self.key)) {
                members = Some((now.members.load_full(), now));
            }
        }
        let picked = members
            .as_ref()
            .and_then(|(members, group)| group.pick(members, message.topic()));
        match picked {
            Some(Member::Handler { entry, state, .. }) => {
                state.picked();
                entry.sink.deliver(message)
            }
            Some(Member::Stream { entry, .. }) => {
                counters.retract_delivered(1);
                let mut back = Vec::new();
                let dropped = entry.sink.push_or_return(Arc::clone(message), &mut back);
                if dropped > 0 {
                    counters.dropped_now(dropped);
                }
                // That member is leaving too: pass on what bounced.
                match (self.shared.upgrade(), &members) {
                    (Some(shared), Some((_, group))) => {
                        for bounced in back {
                            shared.pass_on(group, bounced, counters);
                        }
                    }
                    _ => counters.dropped_now(back.len() as u64),
                }
                None
            }
            None => {
                counters.retract_delivered(1);
                counters.dropped_now(1);
                None
            }
        }
    }
}

impl<T, S: Tracked> Tracked for MemberSink<T, S> {
    fn running(&self) -> Option<Arc<Running>> {
        self.inner.running()
    }
}

impl<T: Send + Sync + 'static> Bus<T> {
    /// Adds a handler to the shared group of `filter` (a valid shared filter).
    pub(crate) fn join_group_handler<S: Sink<T> + Tracked + 'static>(
        &self,
        filter: &str,
        id: u64,
        sink: S,
    ) -> Result<Subscription, Error> {
        let shared = &self.inner.shared;
        let filter: Arc<str> = Arc::from(filter);
        let mut control: Option<Control> = None;
        shared.join(&filter, |group| {
            let state = Arc::new(group.member_state());
            let entry = Subscriber::new(MemberSink {
                inner: sink,
                state: Arc::clone(&state),
                group: Arc::downgrade(group),
                key: Arc::clone(&filter),
                shared: Arc::downgrade(shared),
                counters: Arc::clone(&self.inner.env.counters),
            });
            control = Some(entry.control());
            let entry = entry.into_handler();
            let set = Arc::new(SubSet::empty().grown(id, entry.clone()));
            Member::Handler {
                id,
                entry,
                set,
                state,
            }
        })?;
        let control = control.expect("join made the member");
        Ok(self.shared_handle(control, id, filter, Kind::Handlers))
    }

    /// Adds a stream to the shared group of `filter` (a valid shared filter).
    pub(crate) fn join_group_stream(
        &self,
        filter: &str,
        id: u64,
        capacity: usize,
    ) -> Result<Receiver<T>, Error> {
        let filter: Arc<str> = Arc::from(filter);
        let entry: StreamEntry<T> = Arc::new(StreamSubscriber::new(id, Mailbox::new(capacity)));
        self.inner.shared.join(&filter, |_| Member::Stream {
            id,
            entry: Arc::clone(&entry),
        })?;
        let subscription = self.shared_handle(entry.control(), id, filter, Kind::Streams);
        Ok(Receiver::new(
            entry,
            Arc::clone(&self.inner.env.counters),
            subscription,
        ))
    }

    fn shared_handle(&self, entry: Control, id: u64, filter: Arc<str>, kind: Kind) -> Subscription {
        let links = Arc::clone(&self.inner.links);
        Subscription::new(entry, id, filter, links, true, kind)
    }
}
