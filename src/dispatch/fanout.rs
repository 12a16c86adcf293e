//! [`Fanout`]: one publish's handler deliveries, and the loop runners run.
//!
//! # Contract
//! - Deliveries are numbered `0..total` across the route's handler sets, in
//!   the lengths read at publish time. Runners **claim** ranges of them from
//!   one shared cursor with an atomic add, so each delivery is claimed by
//!   exactly one runner, whichever runners there are and whenever they come.
//! - A claim is `unit` deliveries (a chunk above the threshold, one
//!   subscription below it; see `mod.rs`). Below the threshold under
//!   `Batch::Chunked` a runner may claim a *grain* of several units at once,
//!   to spare cheap handlers an atomic add each: the grain doubles, up to
//!   [`MAX_GRAIN`], only while the units it ran averaged under
//!   [`FAST_UNIT`] each, and it drops back to one unit otherwise. So
//!   handlers that take real time are always claimed one by one (a free
//!   worker takes the next subscription while another runs), and a handler
//!   that turns slow without warning can hold up at most `MAX_GRAIN - 1`
//!   subscriptions claimed with it (a free worker takes the rest). A job
//!   that only one runner may work on (`Inline`, or a publish reaching one
//!   subscription) is claimed whole: there is nobody to share it with, and
//!   a grain would cost a clock read per claim.
//! - A job is run either by claims, or whole in a batch of publishes to the
//!   same subscriptions taken before any runner saw it
//!   ([`Batch`](super::batch::Batch): a pool worker's), never both.
//! - A panicking delivery is caught at its call ([`start`]: no cost unless
//!   it panics), counted, and the loop goes on with the next delivery. What
//!   can panic after that (handing a future over, reporting the panic) is
//!   caught once per runner ([`Fanout::resuming`]), which resumes past the
//!   delivery the walk stored as its place.
//! - Each delivery checks its subscription's flag immediately before running,
//!   so a subscription removed since the publish is skipped.

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use super::{pending, report_panic, Env, Plan, Policy};
use crate::message::Message;
use crate::registry::entry::{BoxFuture, HandlerEntry, Settled, Sink, Subscriber, NO_POSITION};
use crate::registry::quiesce;
use crate::registry::route::{HandlerSets, Positions};
use crate::registry::subset::{HandlerSet, Slot};
use crate::stats::Tally;
use crate::sync::{AtomicBool, AtomicUsize, Ordering};

/// The most units a runner claims at once below the threshold.
pub(crate) const MAX_GRAIN: usize = 64;

/// The most publishes a worker runs as one batch
/// ([`Batch`](super::batch::Batch)).
///
/// The batch's walk and an ordered subscription's runner turn are paid once
/// per batch, so a bigger one costs less per delivery: from 8 to 64, 1,000
/// ordered handlers went from 1.5-1.7x to 1.0-1.4x the time of unordered
/// ones, and 500 handlers on counters of their own from 383-391 to 469-474
/// M deliveries/s (`docs/design-notes.md`, thirteenth session). A handler
/// that blocks holds up the subscriptions claimed with it for the whole
/// batch; the others are claimed by a worker that joins.
pub(crate) const MAX_BATCH: usize = 64;

/// A unit that takes less than this counts as cheap enough to claim in grains.
pub(crate) const FAST_UNIT: Duration = Duration::from_micros(1);

/// Lengths of the route's handler sets, read once at publish.
type Lens = SmallVec<[usize; 4]>;

/// One publish's handler deliveries, shared by the runners working on it.
pub(crate) struct Fanout<T> {
    message: Arc<Message<T>>,
    sets: HandlerSets<T>,
    /// Per set: the message's position in that node's ordered log (empty:
    /// no set has one).
    positions: Positions,
    lens: Lens,
    total: usize,
    plan: Plan,
    /// The place its route's home gave it (see `placement.rs`): the pool
    /// worker or task-mode lane it is queued to.
    place: usize,
    next: AtomicUsize,
    runners: AtomicUsize,
    helper_queued: AtomicBool,
}

/// A runner's view of its mode: how to enlist help and what to do with an
/// async delivery that did not finish on its first poll.
pub(crate) trait Runner<T> {
    /// Whether other runners may work on the same job: if not (`Inline`,
    /// whose job lives on the publisher's stack), nobody reads the job's
    /// runner count, and a run does not keep it.
    const SHARES_JOBS: bool = true;
    /// Whether a helper would find an idle worker now. Asked at every claim,
    /// so it must be a cheap read. Only the pool's runners enlist helpers;
    /// `Inline` has none to enlist, and `TaskPerSubscriber` starts all its
    /// runners at publish (see `tasks.rs`), so both answer no.
    fn has_idle_capacity(&self) -> bool;
    /// Starts one more runner on `job` if that can be done without waiting.
    fn offer_helper(&mut self, job: &Fanout<T>) -> bool;
    /// Whether this runner claims all that is left of a job at once: a
    /// publisher running work itself (no task could take it, or it serves
    /// its full lane). A grain would leave the rest unclaimed, so not
    /// counted as held by this thread's stack (see `quiesce::held_here`),
    /// while a handler of the job blocks there: a `close` it blocks on
    /// would wait for the rest of its own publish, which no task may come
    /// to run.
    fn claims_rest(&self) -> bool {
        false
    }
    /// Takes over an async delivery still running after its first poll. It
    /// must eventually finish it and account for it. True if it now
    /// continues off this thread's stack (as a task of its own), where the
    /// runner's claim no longer holds it.
    fn pending(&mut self, delivery: BoxFuture, tally: &mut Tally) -> bool;
}

/// One runner's position in a job.
struct Progress {
    /// The next delivery this runner will run.
    current: usize,
    /// The end of its current claim.
    claim_end: usize,
    /// Deliveries it claimed in all.
    claimed: usize,
    /// What of those did not simply deliver.
    exceptions: Exceptions,
    /// Units in its next claim (below the threshold).
    grain: Grain,
}

/// How many units a runner claims next: one at first, doubling up to
/// [`MAX_GRAIN`] while the units it ran were cheap, back to one otherwise
/// (see the module docs).
#[derive(Default)]
pub(super) struct Grain {
    size: usize,
    /// When the last claim was made, and how many units it held.
    last_claim: Option<(Instant, usize)>,
}

impl Grain {
    /// The units of the next claim, if a unit counts as cheap when it took
    /// under `per_unit`.
    pub(super) fn next(&mut self, per_unit: Duration) -> usize {
        let now = crate::sync::now();
        let cheap = self.last_claim.is_some_and(|(since, units)| {
            now.saturating_duration_since(since) <= per_unit.saturating_mul(units as u32)
        });
        // Whether a worker is idle does not matter: one that is idle but
        // does not come (not scheduled yet, or about to wait) left the
        // runner claiming one unit at a time, a clock read and a contended
        // add per delivery, for the whole job: 5-8x slower publishes.
        self.size = if cheap {
            (self.size * 2).min(MAX_GRAIN)
        } else {
            1
        };
        self.last_claim = Some((now, self.size));
        self.size
    }
}

impl<T> Fanout<T> {
    /// Deliveries in this job (entries of subscriptions removed since may be
    /// among them; they are skipped).
    pub(crate) fn total(&self) -> usize {
        self.total
    }

    /// Whether another runner would find units to claim and room to run.
    pub(crate) fn wants_help(&self) -> bool {
        self.next.load(Ordering::Relaxed) < self.total
            && self.runners.load(Ordering::Relaxed) < self.plan.max_runners
    }
}

impl<T: Send + Sync + 'static> Fanout<T> {
    /// The job for `message`, or `None` if it reaches no handler.
    pub(crate) fn new(
        message: Arc<Message<T>>,
        sets: HandlerSets<T>,
        mut positions: Positions,
        policy: &Policy,
    ) -> Option<Self> {
        // Sets added after the route's (shared groups') have no log.
        if !positions.is_empty() {
            positions.resize(sets.len(), NO_POSITION);
        }
        let lens: Lens = sets.iter().map(|set| set.len()).collect();
        let total = lens.iter().sum();
        if total == 0 {
            return None;
        }
        Some(Self {
            message,
            sets,
            positions,
            lens,
            total,
            plan: policy.plan(total),
            place: 0,
            next: AtomicUsize::new(0),
            runners: AtomicUsize::new(0),
            helper_queued: AtomicBool::new(false),
        })
    }

    /// The message's position in set `index`'s ordered log.
    #[inline]
    pub(super) fn position(&self, index: usize) -> u64 {
        self.positions.get(index).copied().unwrap_or(NO_POSITION)
    }

    pub(crate) fn plan(&self) -> Plan {
        self.plan
    }

    /// The job, to run at `place` (see [`Self::place`]).
    #[must_use]
    pub(crate) fn at_place(mut self, place: usize) -> Self {
        self.place = place;
        self
    }

    /// The pool worker or task-mode lane its route's home placed it at.
    pub(crate) fn place(&self) -> usize {
        self.place
    }

    pub(crate) fn topic(&self) -> &str {
        self.message.topic()
    }

    pub(super) fn message(&self) -> &Arc<Message<T>> {
        &self.message
    }

    /// Lengths of the handler sets, as read at publish.
    pub(super) fn lens(&self) -> &[usize] {
        &self.lens
    }

    pub(super) fn set(&self, index: usize) -> &HandlerSet<T> {
        &self.sets[index]
    }

    /// Claims and runs deliveries until none are left (or, under a
    /// single-claim plan, after one claim), then adds what it did to `tally`.
    pub(crate) fn run<R: Runner<T>>(&self, env: &Env, runner: &mut R, tally: &mut Tally) {
        // Every flag check and handler call of this run happens while present.
        let _present = env.quiescence.enter();
        if R::SHARES_JOBS {
            self.runners.fetch_add(1, Ordering::Relaxed);
            // This runner may be the helper that was queued: make room for
            // another.
            self.helper_queued.store(false, Ordering::Relaxed);
        }
        let mut progress = Progress {
            current: 0,
            claim_end: 0,
            claimed: 0,
            exceptions: Exceptions::default(),
            grain: Grain::default(),
        };
        self.resuming(&mut progress, tally, |progress, tally| {
            self.work(env, runner, progress, tally);
        });
        progress.exceptions.unhold_rest(env, progress.claimed);
        progress.exceptions.add_to(progress.claimed, tally);
        if R::SHARES_JOBS {
            self.runners.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Whether the job is planned for one runner that claims units and
    /// enlists helpers (`Batch::Chunked`, on either side of the threshold):
    /// such a job, taken from a queue before anyone ran it, may run whole
    /// in a batch instead ([`Batch`](super::batch::Batch)).
    pub(crate) fn has_one_claiming_runner(&self) -> bool {
        self.plan.runners == 1 && !self.plan.single_claim
    }

    /// Whether `other` holds the same deliveries as this job: the same
    /// handler sets, read at the same lengths, cut the same way (two
    /// publishes to one topic while no subscription came or went).
    pub(crate) fn same_chunks(&self, other: &Self) -> bool {
        self.plan.unit == other.plan.unit
            && self.lens == other.lens
            && self.sets.len() == other.sets.len()
            && self
                .sets
                .iter()
                .zip(other.sets.iter())
                .all(|(a, b)| Arc::ptr_eq(a, b))
    }

    /// Runs `work` to its end: a delivery that panics is caught, counted
    /// and reported, and `work` resumes just past it (a runner's other
    /// deliveries still run).
    pub(super) fn resuming<P: Resumable>(
        &self,
        progress: &mut P,
        tally: &mut Tally,
        mut work: impl FnMut(&mut P, &mut Tally),
    ) {
        while let Err(panic) = catch_unwind(AssertUnwindSafe(|| work(progress, tally))) {
            // The progress still points at the delivery that panicked.
            let delivery = progress.delivery();
            progress
                .exceptions()
                .panicked(self, delivery, panic.as_ref(), tally);
            progress.step_past();
        }
    }

    /// The hot loop: run the current claim, claim again, until done. It
    /// counts only the exceptions; `run` works out the tally from them.
    #[inline]
    fn work(&self, env: &Env, runner: &mut impl Runner<T>, p: &mut Progress, tally: &mut Tally) {
        let mut sets = SetWalker::new(&self.lens);
        loop {
            // A claim that reached the end leaves nothing for another.
            if p.current >= p.claim_end
                && (p.claim_end >= self.total || !self.claim(env, runner, p))
            {
                return;
            }
            let (set_index, offset, set_end) = sets.locate(p.current);
            let stop = p.claim_end.min(set_end);
            let set = &self.sets[set_index];
            let position = self.position(set_index);
            // The walk's place, kept in a register: a handler's panic is
            // caught at the call, and the place stored only for the rare
            // steps after it (see `start`).
            let mut current = p.current;
            for run in set.runs(offset..offset + (stop - current)) {
                for slot in run {
                    match member(slot) {
                        Some((entry, sink)) if entry.is_active() => {
                            let started = start(
                                sink,
                                &self.message,
                                position,
                                env,
                                &mut p.exceptions.settled,
                            );
                            if !matches!(started, Ok(None)) {
                                p.current = current;
                                p.exceptions
                                    .unfinished(started, self, current, runner, env, tally);
                            }
                        }
                        // Unsubscribed since the publish (or never published).
                        _ => p.exceptions.not_delivered += 1,
                    }
                    current += 1;
                }
            }
            p.current = current;
        }
    }

    /// Claims the next range for this runner. False when nothing is left.
    fn claim(&self, env: &Env, runner: &mut impl Runner<T>, p: &mut Progress) -> bool {
        if self.plan.single_claim && p.claimed > 0 {
            return false;
        }
        let size =
            if (self.plan.max_runners == 1 || runner.claims_rest()) && !self.plan.single_claim {
                // Nobody to share with (`Inline`, or one subscription), or
                // a publisher running it itself: all of it at once, and no
                // clock read for a grain.
                self.total
            } else if self.plan.unit == 1 && !self.plan.single_claim {
                // Units of one subscription: a grain of them.
                p.grain.next(FAST_UNIT)
            } else {
                self.plan.unit
            };
        let start = self.next.fetch_add(size, Ordering::Relaxed);
        if start >= self.total {
            return false;
        }
        let end = (start + size).min(self.total);
        p.claimed += end - start;
        quiesce::hold(&env.quiescence, (end - start) as u64);
        p.current = start;
        p.claim_end = end;
        if end < self.total && self.plan.runners < self.plan.max_runners {
            self.enlist_helper(runner);
        }
        true
    }

    fn enlist_helper(&self, runner: &mut impl Runner<T>) {
        if self.runners.load(Ordering::Relaxed) >= self.plan.max_runners
            || self.helper_queued.load(Ordering::Relaxed)
            || !runner.has_idle_capacity()
            || self.helper_queued.swap(true, Ordering::Relaxed)
        {
            return;
        }
        if !runner.offer_helper(self) {
            self.helper_queued.store(false, Ordering::Relaxed);
        }
    }

    /// Claims units without running them, counting their deliveries as
    /// dropped: one unit under a single-claim plan, else all that are left.
    /// Returns the deliveries dropped.
    pub(crate) fn drop_units(&self, tally: &mut Tally) -> usize {
        let before = tally.dropped;
        loop {
            let start = self.next.fetch_add(self.plan.unit, Ordering::Relaxed);
            if start >= self.total {
                break;
            }
            let end = (start + self.plan.unit).min(self.total);
            self.discard(start..end, tally);
            tally.finished += (end - start) as u64;
            if self.plan.single_claim {
                break;
            }
        }
        (tally.dropped - before) as usize
    }

    /// Deliveries that will not run, counted in `tally`: dropped for active
    /// subscriptions, or what an ordered one settled (which may have run
    /// messages other deliveries left to it).
    fn discard(&self, deliveries: Range<usize>, tally: &mut Tally) {
        for (index, (set, slots)) in self.segments_indexed(deliveries) {
            let position = self.position(index);
            for entry in slots.filter_map(|offset| set.get(offset)) {
                if !entry.is_active() {
                    continue;
                }
                match entry.sink.discard_at(&self.message, position) {
                    None => tally.dropped += 1,
                    Some(settled) => {
                        tally.dropped += u64::from(settled.dropped);
                        tally.delivered += u64::from(settled.delivered);
                        tally.panics += u64::from(settled.panics);
                    }
                }
            }
        }
    }

    /// The handler sets and slot ranges holding `deliveries`.
    fn segments(
        &self,
        deliveries: Range<usize>,
    ) -> impl Iterator<Item = (&HandlerSet<T>, Range<usize>)> {
        self.segments_indexed(deliveries)
            .map(|(_, segment)| segment)
    }

    /// The handler sets (with their index) and slot ranges holding
    /// `deliveries`.
    fn segments_indexed(
        &self,
        deliveries: Range<usize>,
    ) -> impl Iterator<Item = (usize, (&HandlerSet<T>, Range<usize>))> {
        let mut skip = deliveries.start;
        let mut left = deliveries.len();
        self.sets
            .iter()
            .zip(self.lens.iter())
            .enumerate()
            .filter_map(move |(index, (set, &len))| {
                if skip >= len {
                    skip -= len;
                    return None;
                }
                let from = std::mem::take(&mut skip);
                let to = len.min(from + left);
                left -= to - from;
                (to > from).then(|| (index, (&**set, from..to)))
            })
    }

    /// The id of the subscription the `index`th delivery goes to.
    fn subscription(&self, index: usize) -> Option<u64> {
        let (set, mut slots) = self.segments(index..index + 1).next()?;
        set.id(slots.next()?)
    }
}

/// A subscription's slot, dereferenced: its entry (for the flag) and its
/// sink (`None`: an empty slot).
pub(super) type Member<'a, T> = Option<(&'a Subscriber<T, dyn Sink<T>>, &'a dyn Sink<T>)>;

/// Dereferences `slot` (see [`Member`]).
#[inline(always)]
pub(super) fn member<T>(slot: &Slot<HandlerEntry<T>>) -> Member<'_, T> {
    slot.get()
        .map(|entry| (&**entry, &entry.sink as &dyn Sink<T>))
}

/// What a delivery did when [`start`]ed: finished (`Ok(None)`), left a
/// future to hand over, or panicked.
pub(super) type Started = std::thread::Result<Option<BoxFuture>>;

/// Starts one delivery of `message` (at `position` in the set's ordered
/// log) to `sink`, through an async handler's first poll, and catches a
/// panic of either right here. A walk that calls this keeps its place in
/// registers across the call: storing it before every call, for
/// [`Fanout::resuming`] to resume from, cost a tenth of a cheap handler's
/// delivery (the handler's locked add waits for the store). It stores its
/// place only when the delivery did not simply finish, before
/// [`Exceptions::unfinished`], which can panic in turn (a user's
/// `tracing` layer, a runtime's spawn) and is then resumed from there.
#[inline(always)]
pub(super) fn start<T: Send + Sync + 'static>(
    sink: &dyn Sink<T>,
    message: &Arc<Message<T>>,
    position: u64,
    env: &Env,
    settled: &mut Settled,
) -> Started {
    catch_unwind(AssertUnwindSafe(|| {
        sink.deliver_at(message, position, settled)
            .and_then(|started| pending::first_poll(started, env.handle.as_ref()))
    }))
}

/// A runner's place in its deliveries, for [`Fanout::resuming`] to step
/// past one that panicked.
pub(super) trait Resumable {
    /// The delivery it is at (the index of its subscription in the job).
    fn delivery(&self) -> usize;
    fn exceptions(&mut self) -> &mut Exceptions;
    /// Moves past the delivery it is at.
    fn step_past(&mut self);
}

impl Resumable for Progress {
    fn delivery(&self) -> usize {
        self.current
    }

    fn exceptions(&mut self) -> &mut Exceptions {
        &mut self.exceptions
    }

    fn step_past(&mut self) {
        self.current += 1;
    }
}

/// What a runner's deliveries did other than deliver one message each: a
/// runner counts only these in its hot loop and works out its tally from
/// them at the end.
#[derive(Default)]
pub(super) struct Exceptions {
    /// Deliveries skipped, panicked or handed over.
    pub(super) not_delivered: usize,
    /// Of those: async deliveries handed over to the runner, unfinished.
    handed_over: usize,
    /// Of those: handed over to run off this thread's stack, so no longer
    /// held by it (see `quiesce::held_here`).
    away: usize,
    /// Ordered deliveries that counted what they ran themselves.
    pub(super) settled: Settled,
}

impl Exceptions {
    /// An async delivery not finished at its first poll: the runner takes
    /// it over, with its accounting.
    #[inline]
    pub(super) fn hand_over<T>(
        &mut self,
        future: BoxFuture,
        runner: &mut impl Runner<T>,
        env: &Env,
        tally: &mut Tally,
    ) {
        // Counted once the runner has it: a panic before that (user code
        // the runner runs, such as a cancelled future's `Drop`) is this
        // delivery's outcome, counted by the runner's resume as a panic.
        let away = runner.pending(future, tally);
        self.handed_over += 1;
        self.not_delivered += 1;
        if away {
            // A `close` called further up this stack must wait for it now:
            // it may finish before anything here does.
            self.away += 1;
            quiesce::unhold(&env.quiescence, 1);
        }
    }

    /// Lets go of the deliveries of a run that claimed `claimed` which this
    /// thread's stack still holds, as the run ends.
    pub(super) fn unhold_rest(&self, env: &Env, claimed: usize) {
        quiesce::unhold(&env.quiescence, (claimed - self.away) as u64);
    }

    /// A delivery of `job` (the `delivery`th) that [`start`] left
    /// unfinished: its future handed over, or its panic counted.
    pub(super) fn unfinished<T: Send + Sync + 'static>(
        &mut self,
        started: Started,
        job: &Fanout<T>,
        delivery: usize,
        runner: &mut impl Runner<T>,
        env: &Env,
        tally: &mut Tally,
    ) {
        match started {
            Ok(None) => {}
            Ok(Some(future)) => self.hand_over(future, runner, env, tally),
            Err(panic) => self.panicked(job, delivery, panic.as_ref(), tally),
        }
    }

    /// A delivery of `job` (the `delivery`th) panicked, caught by the runner.
    pub(super) fn panicked<T: Send + Sync + 'static>(
        &mut self,
        job: &Fanout<T>,
        delivery: usize,
        panic: &(dyn std::any::Any + Send),
        tally: &mut Tally,
    ) {
        tally.panics += 1;
        self.not_delivered += 1;
        let subscription = job.subscription(delivery);
        report_panic(job.topic(), subscription, panic);
    }

    /// Adds to `tally` what a runner that claimed `claimed` deliveries did.
    pub(super) fn add_to(&self, claimed: usize, tally: &mut Tally) {
        tally.finished += (claimed - self.handed_over) as u64;
        let settled = self.settled;
        tally.delivered +=
            (claimed - self.not_delivered) as u64 - settled.deliveries + settled.delivered;
        tally.panics += settled.panics;
        tally.dropped += settled.dropped;
    }
}

/// Finds which handler set holds a delivery, moving forward only (a runner's
/// claims only ever move forward).
pub(super) struct SetWalker<'a> {
    lens: &'a [usize],
    index: usize,
    base: usize,
}

impl<'a> SetWalker<'a> {
    pub(super) fn new(lens: &'a [usize]) -> Self {
        Self {
            lens,
            index: 0,
            base: 0,
        }
    }

    /// The set holding `delivery`, its offset there, and the delivery number
    /// where that set ends.
    #[inline]
    pub(super) fn locate(&mut self, delivery: usize) -> (usize, usize, usize) {
        while delivery >= self.base + self.lens[self.index] {
            self.base += self.lens[self.index];
            self.index += 1;
        }
        (
            self.index,
            delivery - self.base,
            self.base + self.lens[self.index],
        )
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::atomic::{AtomicU64, AtomicUsize as StdAtomicUsize};
    use std::sync::Arc;

    use super::{Fanout, Runner};
    use crate::config::{Config, DeliveryMode, Overflow};
    use crate::dispatch::batch::Batch;
    use crate::dispatch::{Env, Policy, TaskGauge};
    use crate::message::Message;
    use crate::registry::entry::{BoxFuture, HandlerEntry, Subscriber, SyncSink};
    use crate::registry::route::{HandlerSets, RouteCache};
    use crate::registry::trie::{Handlers, Trie};
    use crate::stats::{Counters, Tally};

    /// What a job's runners share, for a bus of `workers` under `overflow`.
    fn test_env(workers: usize, overflow: Overflow) -> Env {
        Env {
            counters: Arc::new(Counters::new()),
            quiescence: Arc::new(crate::registry::quiesce::Quiescence::new()),
            workers,
            handle: None,
            tasks: TaskGauge::new(4),
            overflow,
        }
    }

    /// Three publishes (values 0, 1, 2) to topic "t"'s `sets`.
    fn three_publishes(sets: &HandlerSets<u32>, config: &Config) -> Vec<Arc<Fanout<u32>>> {
        (0..3)
            .map(|value| {
                Arc::new(
                    Fanout::new(
                        Arc::new(Message::new("t", value)),
                        sets.clone(),
                        Default::default(),
                        &Policy::new(config),
                    )
                    .unwrap(),
                )
            })
            .collect()
    }

    /// A runner that always sees an idle worker, which never comes.
    struct LonelyRunner {
        claims: StdAtomicUsize,
    }

    impl Runner<u32> for LonelyRunner {
        fn has_idle_capacity(&self) -> bool {
            // Asked once per claim that may want a helper.
            self.claims
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            true
        }

        fn offer_helper(&mut self, _job: &Fanout<u32>) -> bool {
            false
        }

        fn pending(&mut self, _delivery: BoxFuture, _tally: &mut Tally) -> bool {
            unreachable!("sync handlers only")
        }
    }

    /// Below the threshold, a runner left alone with cheap handlers claims
    /// them in grains even while a worker looks idle: before, it claimed
    /// one by one for the whole job (the slow state of the cliff bench's
    /// rotation, 5-8x per publish).
    #[test]
    fn a_lone_runner_claims_cheap_handlers_in_grains_though_a_worker_looks_idle() {
        const HANDLERS: usize = 1_000;
        let config = Config {
            delivery: DeliveryMode::WorkerPool,
            max_concurrent_subscriptions: 2 * HANDLERS,
            ..Config::default()
        };
        let env = test_env(2, Overflow::CallerRuns);
        let calls = Arc::new(AtomicU64::new(0));
        let trie = Trie::<u32>::new();
        for id in 0..HANDLERS as u64 {
            let calls = Arc::clone(&calls);
            let entry: HandlerEntry<u32> = Subscriber::new(SyncSink(move |_: &Message<u32>| {
                calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }))
            .into_handler();
            assert!(trie.insert::<Handlers>("t", id, |_| entry).is_ok());
        }
        // The grain follows the clock, which a busy machine (a debug build
        // beside others) can keep over a microsecond per unit: stopped
        // here, every unit is cheap and only the idle worker could keep
        // the runner claiming one by one (as it did, before).
        let _stopped = crate::sync::StoppedClock::here();
        let sets = RouteCache::<u32>::new(2).route(&trie, "t").handler_sets();
        let job = Fanout::new(
            Arc::new(Message::new("t", 1)),
            sets,
            Default::default(),
            &Policy::new(&config),
        )
        .unwrap();
        assert!(
            job.plan().unit == 1 && !job.plan().single_claim,
            "below the threshold"
        );
        let mut runner = LonelyRunner {
            claims: StdAtomicUsize::new(0),
        };
        job.run(&env, &mut runner, &mut Tally::default());
        assert_eq!(
            calls.load(std::sync::atomic::Ordering::Relaxed),
            HANDLERS as u64
        );
        let claims = runner.claims.load(std::sync::atomic::Ordering::Relaxed);
        // Grains doubling up to 64 take about 25 claims.
        assert!(
            claims < HANDLERS / 4,
            "{claims} claims for {HANDLERS} handlers"
        );
    }

    /// A worker that joins a batch claims the subscriptions its owner has
    /// not reached, while the owner is blocked in a handler: a handler that
    /// blocks holds up only itself, and each subscription still receives
    /// the publishes in order.
    #[test]
    fn a_joining_runner_takes_the_subscriptions_a_blocked_owner_left() {
        use std::sync::mpsc;
        use std::sync::Mutex;
        use std::thread::ThreadId;
        const HANDLERS: u64 = 4;
        let config = Config {
            delivery: DeliveryMode::WorkerPool,
            ..Config::default()
        };
        let env = Arc::new(test_env(2, Overflow::Wait));
        let (release, released) = mpsc::channel::<()>();
        let released = Mutex::new(released);
        let (entered, blocked) = mpsc::channel::<()>();
        let entered = Mutex::new(entered);
        let seen = Arc::new(Mutex::new(Vec::<(u64, u32, ThreadId)>::new()));
        let trie = Trie::<u32>::new();
        let unblock = Arc::new((released, entered));
        for id in 0..HANDLERS {
            let (seen, unblock) = (Arc::clone(&seen), Arc::clone(&unblock));
            let entry: HandlerEntry<u32> = Subscriber::new(SyncSink(move |m: &Message<u32>| {
                if id == 0 && *m.data() == 0 {
                    // The owner blocks here until the joiner is done.
                    let _ = unblock.1.lock().unwrap().send(());
                    let _ = unblock.0.lock().unwrap().recv();
                }
                seen.lock()
                    .unwrap()
                    .push((id, *m.data(), std::thread::current().id()));
            }))
            .into_handler();
            assert!(trie.insert::<Handlers>("t", id, |_| entry).is_ok());
        }
        let sets = RouteCache::<u32>::new(2).route(&trie, "t").handler_sets();
        let jobs = three_publishes(&sets, &config).into_iter().collect();
        let batch = Arc::new(Batch::of(jobs));
        let owner = {
            let (batch, env) = (Arc::clone(&batch), Arc::clone(&env));
            std::thread::spawn(move || {
                let mut tally = Tally::default();
                let mut runner = LonelyRunner {
                    claims: StdAtomicUsize::new(0),
                };
                batch.run(&env, &mut runner, &mut tally);
                (tally, std::thread::current().id())
            })
        };
        blocked.recv().unwrap();
        assert!(batch.wants_help(), "the owner claimed only what blocks");
        let mut tally = Tally::default();
        let mut runner = LonelyRunner {
            claims: StdAtomicUsize::new(0),
        };
        batch.run(&env, &mut runner, &mut tally);
        assert!(!batch.wants_help());
        let joiner = std::thread::current().id();
        release.send(()).unwrap();
        let (owner_tally, owner) = owner.join().unwrap();
        let seen = seen.lock().unwrap().clone();
        for id in 0..HANDLERS {
            let calls: Vec<_> = seen.iter().filter(|(who, ..)| *who == id).collect();
            let values: Vec<_> = calls.iter().map(|(_, value, _)| *value).collect();
            assert_eq!(values, [0, 1, 2], "subscription {id}: in order");
            let thread = if id == 0 { owner } else { joiner };
            assert!(calls.iter().all(|(.., ran)| *ran == thread), "{id}");
        }
        assert_eq!(owner_tally.delivered, 3);
        assert_eq!(tally.delivered, 3 * (HANDLERS - 1));
        assert_eq!(owner_tally.finished + tally.finished, 3 * HANDLERS);
    }

    /// A batch of three publishes runs each subscription's deliveries in
    /// publish order, skips a removed subscription, resumes after a panic
    /// with the next delivery, and counts as three single runs would:
    /// above the threshold (one chunk) ...
    #[test]
    fn a_batch_runs_each_subscription_in_order_and_counts_like_single_runs() {
        batch_runs_in_order_and_counts(1);
    }

    /// ... and below it (a unit per subscription).
    #[test]
    fn a_batch_of_whole_jobs_runs_in_order_and_counts_like_single_runs() {
        batch_runs_in_order_and_counts(100);
    }

    fn batch_runs_in_order_and_counts(threshold: usize) {
        use std::sync::Mutex;
        const HANDLERS: u64 = 6;
        let config = Config {
            delivery: DeliveryMode::WorkerPool,
            max_concurrent_subscriptions: threshold,
            ..Config::default()
        };
        let env = test_env(1, Overflow::CallerRuns);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let trie = Trie::<u32>::new();
        let mut entries = Vec::new();
        for id in 0..HANDLERS {
            let seen = Arc::clone(&seen);
            let entry: HandlerEntry<u32> = Subscriber::new(SyncSink(move |m: &Message<u32>| {
                // Subscription 2 panics on the second publish.
                assert!(!(id == 2 && *m.data() == 1), "handler panic");
                seen.lock().unwrap().push((id, *m.data()));
            }))
            .into_handler();
            entries.push(entry.clone());
            assert!(trie.insert::<Handlers>("t", id, |_| entry).is_ok());
        }
        assert!(entries[4].deactivate(), "subscription 4 was removed");
        let sets = RouteCache::<u32>::new(2).route(&trie, "t").handler_sets();
        let jobs = three_publishes(&sets, &config);
        assert!(jobs.iter().all(|job| job.has_one_claiming_runner()));
        assert!(jobs.iter().all(|job| jobs[0].same_chunks(job)));
        let mut runner = LonelyRunner {
            claims: StdAtomicUsize::new(0),
        };
        let mut tally = Tally::default();
        let batch = Batch::of(jobs.iter().cloned().collect());
        batch.run(&env, &mut runner, &mut tally);
        let mut seen = seen.lock().unwrap().clone();
        // Subscriptions run in groups, job by job: what matters is that
        // each one got every publish but the one it panicked on, in order
        // (a stable sort by subscription keeps each one's own order).
        seen.sort_by_key(|&(id, _)| id);
        let expected: Vec<_> = (0..HANDLERS)
            .filter(|&id| id != 4)
            .flat_map(|id| (0..3).map(move |value| (id, value)))
            .filter(|&(id, value)| !(id == 2 && value == 1))
            .collect();
        assert_eq!(seen, expected, "each subscription in publish order");
        assert_eq!(tally.finished, 3 * HANDLERS);
        assert_eq!(tally.panics, 1);
        assert_eq!(tally.delivered, expected.len() as u64);
    }
}
